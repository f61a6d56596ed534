/*
 * msixpoke: raises MSI-X vectors 1..N of a PCI endpoint test function through the guest
 * kernel's pci_endpoint_test driver (the PCITEST_MSIX ioctl of include/uapi/linux/pcitest.h:
 * the driver writes IRQ_NUMBER and COMMAND, waits up to 1 s for its handler to see the
 * vector and checks that the Linux IRQ it came in on is that vector's), as Linux's own
 * `pcitest -x N` does.
 *
 *   msixpoke <misc-device> <count>
 *
 * Prints `MSIXPOKE <n> late, again` for a try that did not come back in time and
 * `MSIXPOKE <n> bad` for a vector whose three tries did not (nothing for those that did,
 * to keep the console short; it stops after 8 lost in a row, each having cost the
 * driver's 1 s waits), then `MSIXPOKE done ok=<k> of=<count>`, and
 * exits 0 when all came back, 1 when one did not, 2 on bad usage or a failed open (named on
 * the line). Why a program and no libc: as barpoke.c.
 */

#define NR_write 1
#define NR_open 2
#define NR_ioctl 16
#define NR_exit 60
#define O_RDWR 2
/* _IOW('P', 0x7, int) */
#define PCITEST_MSIX 0x40045007UL

#include "nolibc.h"
#include "lines.h"

static unsigned long decimal(const char *s, int *ok)
{
	unsigned long v = 0;
	*ok = *s != 0;
	for (; *s; s++) {
		if (*s < '0' || *s > '9') {
			*ok = 0;
			return 0;
		}
		v = v * 10 + (unsigned long)(*s - '0');
	}
	return v;
}

void __attribute__((noreturn, used)) msixpoke_main(long *sp)
{
	long argc = sp[0];
	char **argv = (char **)(sp + 1);
	unsigned long count, n, good = 0, run = 0;
	char buf[256];
	int ok, at;
	long fd;

	if (argc != 3) {
		static const char usage[] = "usage: msixpoke <misc-device> <count>\n";
		sys3(NR_write, 2, (long)usage, sizeof(usage) - 1);
		leave(2);
	}
	count = decimal(argv[2], &ok);
	if (!ok || count == 0 || count > 2048) {
		at = 0;
		put_str(buf, &at, "MSIXPOKE fail count ");
		put_str(buf, &at, argv[2]);
		say(buf, at);
		leave(2);
	}
	fd = sys3(NR_open, (long)argv[1], O_RDWR, 0);
	if (fd < 0) {
		at = 0;
		put_str(buf, &at, "MSIXPOKE fail open ");
		put_str(buf, &at, argv[1]);
		put_str(buf, &at, " errno ");
		put_dec(buf, &at, (unsigned long)-fd);
		say(buf, at);
		leave(2);
	}
	for (n = 1; n <= count; n++) {
		int try;
		/*
		 * The driver answers 1 when the vector came back on its own IRQ within its 1 s
		 * wait. On a loaded host an emulated guest can take longer; the late interrupt
		 * then completes the next wait with the wrong IRQ, so a vector gets three tries
		 * (each one named) before it counts as lost.
		 */
		for (try = 1; try <= 3; try++) {
			if (sys3(NR_ioctl, fd, (long)PCITEST_MSIX, (long)n) == 1)
				break;
			at = 0;
			put_str(buf, &at, "MSIXPOKE ");
			put_dec(buf, &at, n);
			put_str(buf, &at, try < 3 ? " late, again" : " bad");
			say(buf, at);
		}
		if (try <= 3) {
			good++;
			run = 0;
			continue;
		}
		/* Each loss costs the driver's 1 s waits: a broken path is not waited out 2048 times. */
		if (++run == 8) {
			at = 0;
			put_str(buf, &at, "MSIXPOKE stop: 8 in a row did not come back");
			say(buf, at);
			break;
		}
	}
	at = 0;
	put_str(buf, &at, "MSIXPOKE done ok=");
	put_dec(buf, &at, good);
	put_str(buf, &at, " of=");
	put_dec(buf, &at, count);
	say(buf, at);
	leave(good == count ? 0 : 1);
}

NOLIBC_START(msixpoke_main);
