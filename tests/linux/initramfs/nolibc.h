/*
 * System calls without libc for the guests' small programs (pid1.c, barpoke.c): the
 * x86_64 `syscall` convention, the kernel's return value (a negative errno on failure).
 * Not a program: make-initramfs.sh builds only the .c files that include it.
 */
#ifndef LENDVM_NOLIBC_H
#define LENDVM_NOLIBC_H

static inline long sys3(long n, long a, long b, long c)
{
	long r;
	__asm__ volatile("syscall"
			 : "=a"(r)
			 : "a"(n), "D"(a), "S"(b), "d"(c)
			 : "rcx", "r11", "memory");
	return r;
}

static inline long sys4(long n, long a, long b, long c, long d)
{
	long r;
	register long r10 __asm__("r10") = d;
	__asm__ volatile("syscall"
			 : "=a"(r)
			 : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10)
			 : "rcx", "r11", "memory");
	return r;
}

static inline long sys6(long n, long a, long b, long c, long d, long e, long f)
{
	long r;
	register long r10 __asm__("r10") = d;
	register long r8 __asm__("r8") = e;
	register long r9 __asm__("r9") = f;
	__asm__ volatile("syscall"
			 : "=a"(r)
			 : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
			 : "rcx", "r11", "memory");
	return r;
}

/*
 * The program's entry point: `fn(sp)` with the kernel's initial stack pointer (argc, then
 * argv and envp), on a 16-byte aligned stack; `fn` never returns.
 */
#define NOLIBC_START(fn)                                                                   \
	__asm__(".text\n"                                                                  \
		".globl _start\n"                                                          \
		"_start:\n"                                                                \
		"	xor %ebp, %ebp\n"                                                    \
		"	mov %rsp, %rdi\n"                                                    \
		"	and $-16, %rsp\n"                                                    \
		"	call " #fn "\n"                                                       \
		"	hlt\n")

#endif
