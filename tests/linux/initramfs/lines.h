/*
 * Console lines for the guests' small libc-free programs (barpoke.c, msixpoke.c; after
 * nolibc.h): a 256-byte buffer filled by put_str/put_dec/put_hex (at most 200 bytes of
 * text, so a line always fits with its newline), written by say(); leave() ends the
 * process. pid1.c keeps its own (it must be checked free of %fs on its own).
 */
#ifndef LENDVM_LINES_H
#define LENDVM_LINES_H

static inline __attribute__((unused)) void put_str(char *buf, int *at, const char *s)
{
	while (*s && *at < 200)
		buf[(*at)++] = *s++;
}

static inline __attribute__((unused)) void put_dec(char *buf, int *at, unsigned long v)
{
	char tmp[24];
	int n = 0;
	do {
		tmp[n++] = (char)('0' + v % 10);
		v /= 10;
	} while (v && n < 24);
	while (n && *at < 200)
		buf[(*at)++] = tmp[--n];
}

static inline __attribute__((unused)) void put_hex(char *buf, int *at, unsigned long v)
{
	static const char digits[] = "0123456789abcdef";
	int shift;
	put_str(buf, at, "0x");
	for (shift = 60; shift >= 0 && *at < 200; shift -= 4)
		buf[(*at)++] = digits[(v >> shift) & 0xf];
}

/* Writes buf[0..at) and a newline to standard output (write(2) is syscall 1). */
static inline __attribute__((unused)) void say(char *buf, int at)
{
	buf[at++] = '\n';
	sys3(1, 1, (long)buf, at);
}

/* Ends the process (exit(2) is syscall 60). */
static inline __attribute__((unused, noreturn)) void leave(long code)
{
	for (;;)
		sys3(60, code, 0, 0);
}

#endif
