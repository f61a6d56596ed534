/*
 * Minimal static user-space probes (no libc) to find out which CPL 3 <-> CPL 0
 * transitions work when the guest runs in KVM's instruction emulator on a
 * PVM host. Each is linked as its own /probe-<name> and selected with
 * rdinit=/probe-<name>. Results show up in the kernel log:
 *   probe-syscall: write(2) via SYSCALL, then exit(0)          -> "probe: syscall ok"
 *   probe-int80:   write via int $0x80 (32-bit ABI), then exit  -> "probe: int80 ok"
 *   probe-ud2:     ud2 at once: #UD from CPL 3                  -> "traps: probe-ud2[1] trap invalid opcode"
 *   probe-spin:    ~20 M loop iterations (timer interrupts from CPL 3), then
 *                  write via int $0x80                           -> "probe: spin ok"
 * Whatever happens, init then ends and the kernel panics ("Attempted to kill
 * init! exitcode=..."), which is the expected last line.
 */
	.text
	.globl _start
_start:
#if defined(PROBE_SYSCALL)
	mov	$1, %eax		/* write */
	mov	$1, %edi
	lea	msg_syscall(%rip), %rsi
	mov	$msg_syscall_len, %edx
	syscall
	mov	$60, %eax		/* exit */
	xor	%edi, %edi
	syscall
#elif defined(PROBE_INT80)
	mov	$4, %eax		/* i386 write */
	mov	$1, %ebx
	lea	msg_int80(%rip), %rcx
	mov	$msg_int80_len, %edx
	int	$0x80
	mov	$1, %eax		/* i386 exit */
	xor	%ebx, %ebx
	int	$0x80
#elif defined(PROBE_UD2)
	ud2
#elif defined(PROBE_SPIN)
	mov	$20000000, %rcx
1:	dec	%rcx
	jnz	1b
	mov	$4, %eax
	mov	$1, %ebx
	lea	msg_spin(%rip), %rcx
	mov	$msg_spin_len, %edx
	int	$0x80
	mov	$1, %eax
	xor	%ebx, %ebx
	int	$0x80
#endif
2:	jmp	2b

	.data
msg_syscall:	.ascii "probe: syscall ok\n"
	.set msg_syscall_len, . - msg_syscall
msg_int80:	.ascii "probe: int80 ok\n"
	.set msg_int80_len, . - msg_int80
msg_spin:	.ascii "probe: spin ok\n"
	.set msg_spin_len, . - msg_spin
