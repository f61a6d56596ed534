/*
 * barpoke: writes a pattern into a PCI memory BAR through its sysfs resource file and reads
 * it back, as a user-space driver (DPDK, a GPU's tools) reaches a BAR: mmap of
 * /sys/bus/pci/devices/<bdf>/resource<n>, stores and loads of 64-bit words.
 *
 *   barpoke <resource-file> <seed> <offset>...
 *
 * For each offset (decimal or 0x hex, 8-byte aligned, inside the file) it maps the page
 * holding it, stores pattern(seed, offset) there, loads it back and prints
 *   BARPOKE <offset> <value read> ok|bad
 * (hex), then exits 0 if every word read back as written, 1 if one did not, 2 on bad usage
 * or a failed open/mmap (named on the line). pattern() is the host's
 * `tests/tests/vfio.rs::bar_pattern`: the host reads the same words in the file behind the
 * BAR.
 *
 * Why a program and not busybox: the guest kernel has no /dev/mem (tinyconfig), and sysfs
 * resource files of memory BARs can only be mapped, not read or written. Why no libc: a
 * static glibc binary would add most of a megabyte to the initramfs, which the kernel
 * unpacks at ~3.5 s per MB of emulated time (tests/linux/make-initramfs.sh). Built like
 * PID 1 (pid1.c), with -nostdlib.
 */

#define NR_write 1
#define NR_open 2
#define NR_close 3
#define NR_mmap 9
#define NR_munmap 11
#define NR_exit 60
#define O_RDWR 2
#define O_SYNC 04010000
#define PROT_READ 1
#define PROT_WRITE 2
#define MAP_SHARED 1
#define PAGE 4096UL

#include "nolibc.h"
#include "lines.h"

static void __attribute__((noreturn)) fail(const char *what, const char *arg, long err)
{
	char buf[256];
	int at = 0;
	put_str(buf, &at, "BARPOKE fail ");
	put_str(buf, &at, what);
	put_str(buf, &at, " ");
	put_str(buf, &at, arg);
	if (err) {
		put_str(buf, &at, " errno ");
		put_hex(buf, &at, (unsigned long)-err);
	}
	say(buf, at);
	leave(2);
}

/* Decimal or 0x-prefixed hex; returns 0 and sets *ok = 0 on anything else. */
static unsigned long number(const char *s, int *ok)
{
	unsigned long v = 0;
	int base = 10, any = 0;
	*ok = 1;
	if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
		base = 16;
		s += 2;
	}
	for (; *s; s++, any = 1) {
		int d;
		if (*s >= '0' && *s <= '9')
			d = *s - '0';
		else if (base == 16 && *s >= 'a' && *s <= 'f')
			d = *s - 'a' + 10;
		else if (base == 16 && *s >= 'A' && *s <= 'F')
			d = *s - 'A' + 10;
		else
			break;
		v = v * (unsigned long)base + (unsigned long)d;
	}
	if (*s || !any)
		*ok = 0;
	return v;
}

/* The word at `offset` for `seed`: distinct per offset and per seed, never zero for the
 * seeds the tests use (an unwritten word of the sparse file reads zero). */
static unsigned long pattern(unsigned long seed, unsigned long offset)
{
	return (seed * 0x100000001b3UL) ^ (offset * 0x9e3779b97f4a7c15UL) ^ 0x4c454e44UL;
}

void __attribute__((noreturn, used)) barpoke_main(long *sp)
{
	long argc = sp[0];
	char **argv = (char **)(sp + 1);
	unsigned long seed;
	int ok, bad = 0, i;
	long fd;

	if (argc < 4) {
		static const char usage[] = "usage: barpoke <resource-file> <seed> <offset>...\n";
		sys3(NR_write, 2, (long)usage, sizeof(usage) - 1);
		leave(2);
	}
	seed = number(argv[2], &ok);
	if (!ok)
		fail("seed", argv[2], 0);
	fd = sys3(NR_open, (long)argv[1], O_RDWR | O_SYNC, 0);
	if (fd < 0)
		fail("open", argv[1], fd);
	for (i = 3; i < argc; i++) {
		unsigned long off = number(argv[i], &ok), page, want, got;
		volatile unsigned long *word;
		char buf[256];
		int at = 0;
		long p;

		if (!ok || off % 8)
			fail("offset", argv[i], 0);
		page = off & ~(PAGE - 1);
		p = sys6(NR_mmap, 0, PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (long)page);
		if (p < 0 && p > -4096)
			fail("mmap", argv[i], p);
		word = (volatile unsigned long *)(p + (long)(off - page));
		want = pattern(seed, off);
		*word = want;
		got = *word;
		sys3(NR_munmap, p, PAGE, 0);
		put_str(buf, &at, "BARPOKE ");
		put_hex(buf, &at, off);
		put_str(buf, &at, " ");
		put_hex(buf, &at, got);
		put_str(buf, &at, got == want ? " ok" : " bad");
		say(buf, at);
		bad |= got != want;
	}
	sys3(NR_close, fd, 0, 0);
	leave(bad);
}

NOLIBC_START(barpoke_main);
