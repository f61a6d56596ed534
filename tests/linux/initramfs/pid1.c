/*
 * The test guests' PID 1: runs the real /init script as its child and runs it again when
 * the emulator's TLS fault kills it.
 *
 * On this project's hosts a guest runs in KVM's instruction emulator, and now and then a
 * freshly exec'd process dies on its first thread-local access (`segfault at 0 ip 4a4d02`
 * in busybox: docs/linux-guest-on-pvm.md). The script's own commands are covered by its
 * `flaky` wrapper, but when the victim is the script itself, PID 1, the kernel panics
 * ("Attempted to kill init!") and the whole boot is lost: CI of record lost a Linux case so.
 * This program cannot meet that fault: it has no libc and no thread-local storage (the
 * build checks that its code never touches %fs), so it only forks, execs, waits and writes.
 *
 *   - It runs SCRIPT (argv[0] of the child is SCRIPT; the environment and the kernel's
 *     extra arguments are passed on as the kernel gave them to PID 1).
 *   - When the script dies by a signal, it prints, like the script's `flaky`,
 *       LENDVM-FLAKE <script> rc=<128+sig> attempt=<n>: died by signal <sig>, run again
 *     and runs it again, at most 3 runs in all. The host accepts that line only after a
 *     kernel report of the fault (tests/src/flake.rs), so a script that a real bug kills
 *     still fails its case.
 *   - When the script exits (or its third run dies), PID 1 exits with its status: the
 *     kernel then panics as it did when the script was PID 1 itself, and lendvm's exit port
 *     reports the panic.
 *   - Orphans are reaped meanwhile, as PID 1 must.
 *
 * Built by make-initramfs.sh (and the L1 initramfs) with
 *   gcc -nostdlib -static -no-pie -ffreestanding -fno-stack-protector -fno-builtin -O2
 *       -DSCRIPT='"/init.sh"'
 */

#ifndef SCRIPT
#error "build with -DSCRIPT='\"/path/of/the/script\"'"
#endif

#define NR_write 1
#define NR_fork 57
#define NR_execve 59
#define NR_exit 60
#define NR_wait4 61
#define EINTR 4
#define ECHILD 10
#define MAX_RUNS 3

#include "nolibc.h"

static void put(const char *s)
{
	long n = 0;
	while (s[n])
		n++;
	sys3(NR_write, 1, (long)s, n);
}

/* Appends the decimal form of v to buf at *at (buf is large enough: see report()). */
static void put_num(char *buf, int *at, long v)
{
	char tmp[24];
	int n = 0;
	if (v < 0) {
		buf[(*at)++] = '-';
		v = -v;
	}
	do {
		tmp[n++] = (char)('0' + v % 10);
		v /= 10;
	} while (v);
	while (n)
		buf[(*at)++] = tmp[--n];
}

static void put_str(char *buf, int *at, const char *s)
{
	while (*s)
		buf[(*at)++] = *s++;
}

static void report(const char *what, long a, long b, long c)
{
	char buf[256];
	int at = 0;
	put_str(buf, &at, what);
	put_num(buf, &at, a);
	if (b >= 0) {
		put_str(buf, &at, " attempt=");
		put_num(buf, &at, b);
		put_str(buf, &at, ": died by signal ");
		put_num(buf, &at, c);
		put_str(buf, &at, ", run again");
	}
	buf[at++] = '\n';
	buf[at] = 0;
	put(buf);
}

static void __attribute__((noreturn)) die(long code)
{
	for (;;)
		sys3(NR_exit, code, 0, 0);
}

/* argc, argv and envp as the kernel put them on the stack. */
void __attribute__((noreturn, used)) pid1_main(long *sp)
{
	long argc = sp[0];
	char **argv = (char **)(sp + 1);
	char **envp = argv + argc + 1;
	int run;

	argv[0] = SCRIPT;
	for (run = 1;; run++) {
		long pid = sys3(NR_fork, 0, 0, 0);
		int status = 0;
		long sig;

		if (pid == 0) {
			long e = sys3(NR_execve, (long)SCRIPT, (long)argv, (long)envp);
			report("LENDVM-INIT exec of " SCRIPT " failed: errno ", -e, -1, 0);
			die(127);
		}
		if (pid < 0) {
			report("LENDVM-INIT fork failed: errno ", -pid, -1, 0);
			die(1);
		}
		for (;;) {
			long w = sys4(NR_wait4, -1, (long)&status, 0, 0);
			if (w == pid)
				break;
			if (w == -EINTR || w > 0)
				continue; /* an orphan reaped, or a signal */
			report("LENDVM-INIT wait4 failed: errno ", -w, -1, 0);
			die(1);
		}
		sig = status & 0x7f;
		if (sig == 0)
			die((status >> 8) & 0xff); /* the script exited: its status */
		if (run >= MAX_RUNS)
			die(128 + sig);
		report("LENDVM-FLAKE " SCRIPT " rc=", 128 + sig, run, sig);
	}
}

NOLIBC_START(pid1_main);
