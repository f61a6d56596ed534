#!/usr/bin/env bash
# Build the lendvm test initramfs (newc cpio, uncompressed: gunzip of 2 MB
# takes most of a minute in KVM's instruction emulator on a PVM host):
#   /init            PID 1 (tests/linux/initramfs/pid1.c): runs /init.sh, and again when
#                    the emulator's TLS fault kills it
#   /init.sh         busybox script (tests/linux/initramfs/init): user-space
#                    NVMe write/read-back check, prints LENDVM-USERSPACE ...
#   /bin/busybox     from Debian's busybox-static
#   /bin/fio         static fio built from Debian's fio source (build-fio.sh)
#   /bin/barpoke     writes and reads back words of a PCI memory BAR through its sysfs
#                    resource file (tests/linux/initramfs/barpoke.c; lendvm_bar=)
#   /bin/msixpoke    raises every MSI-X vector of a PCI endpoint test function through the
#                    kernel's pci_endpoint_test driver (initramfs/msixpoke.c; lendvm_msix=)
#   /fio/<job>.fio   fio jobs for /init's fio runner (tests/linux/initramfs/fio)
#   /probe-<name>    libc-free probes of CPL 3 -> CPL 0 transitions
#                    (tests/linux/initramfs/probes.S; select with rdinit=)
#   /dev/console     so init has a console before devtmpfs is mounted
#   /tmp/nap         a FIFO: /init's `nap` (a wait without a process)
#
#   tests/linux/make-initramfs.sh [--small] [OUTPUT]
# --small: the same archive without fio (/bin/fio, /fio): 2 MB instead of 4.8 MB, for the
# guests that run no fio job. The kernel unpacks the initramfs before it runs /init, about
# 3.5 s per MB of emulated time on this PVM host, so a boot reaches /init 7-11 s sooner.
# Prints the path of the archive (last line). Installs busybox-static, cpio,
# gcc and libc6-dev with apt when missing; needs root (apt, mknod).
#
# Without OUTPUT the archive is cached like the guest kernel:
# $CACHE/linux/initramfs-<key>.cpio with key = sha256 of (busybox-static and
# gcc package versions, this script, lib.sh, build-fio.sh, the fio binary,
# tests/linux/initramfs/**); a rerun
# with the same key prints the path at once. $CACHE/linux/initramfs.cpio is a
# symlink to the newest one.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

SMALL=0
if [ "${1:-}" = --small ]; then
	SMALL=1
	shift
fi

CACHE="${LENDVM_CACHE:-$HOME/.cache/lendvm}/linux"
VARIANT="" LINK=$CACHE/initramfs.cpio
if [ "$SMALL" = 1 ]; then
	VARIANT=small- LINK=$CACHE/initramfs-small.cpio
fi
ensure_pkgs busybox-static cpio gcc libc6-dev binutils
BUSYBOX=/bin/busybox
[ -x "$BUSYBOX" ] || die "$BUSYBOX missing after installing busybox-static"
file_is_static() { ! LC_ALL=C readelf -l "$1" 2>/dev/null | grep -q 'INTERP'; }
file_is_static "$BUSYBOX" || die "$BUSYBOX is not static (is busybox-static installed?)"
FIO=$("$LINUX_TESTS_DIR/build-fio.sh" | tail -n 1)
[ -x "$FIO" ] || die "tests/linux/build-fio.sh printed no fio binary"
file_is_static "$FIO" || die "$FIO is not static"

if [ $# -ge 1 ]; then
	OUT=$1 KEY=""
else
	KEY=$( {
		echo "variant ${VARIANT:-full}"
		dpkg-query -W -f='busybox-static ${Version}\ngcc ${Version}\n' busybox-static gcc
		echo "fio $(sha256sum <"$FIO")"
		for f in "${BASH_SOURCE[0]}" "$LINUX_TESTS_DIR/lib.sh" "$LINUX_TESTS_DIR/build-fio.sh" \
			$(find "$LINUX_TESTS_DIR/initramfs" -type f | LC_ALL=C sort); do
			echo "file ${f#"$LINUX_TESTS_DIR"/}"
			cat "$f"
		done
	} | sha256sum | cut -c1-16)
	OUT=$CACHE/initramfs-$VARIANT$KEY.cpio
	if [ -f "$OUT" ]; then
		ln -sfn "initramfs-$VARIANT$KEY.cpio" "$LINK"
		echo "$OUT"
		exit 0
	fi
fi

STAGE=$(mktemp -d "${TMPDIR:-/tmp}/lendvm-initramfs.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE"/{bin,dev,proc,sys,tmp,fio}
cp "$BUSYBOX" "$STAGE/bin/busybox"
if [ "$SMALL" = 0 ]; then
	cp "$FIO" "$STAGE/bin/fio"
	cp "$LINUX_TESTS_DIR"/initramfs/fio/*.fio "$STAGE/fio/"
fi
# /init is PID 1 (initramfs/pid1.c), the script runs as its child: when the emulator's TLS
# fault kills the script, PID 1 runs it again instead of the kernel panicking.
install -m 0755 "$LINUX_TESTS_DIR/initramfs/init" "$STAGE/init.sh"
build_pid1 /init.sh "$STAGE/init"
build_nolibc "$LINUX_TESTS_DIR/initramfs/barpoke.c" "$STAGE/bin/barpoke"
build_nolibc "$LINUX_TESTS_DIR/initramfs/msixpoke.c" "$STAGE/bin/msixpoke"
for p in syscall int80 ud2 spin; do
	def=PROBE_$(tr a-z A-Z <<<"$p")
	gcc -nostdlib -static -no-pie -D"$def" -o "$STAGE/probe-$p" "$LINUX_TESTS_DIR/initramfs/probes.S" \
		|| die "building probe-$p failed"
done
mknod "$STAGE/dev/console" c 5 1 || die "mknod /dev/console failed (run as root)"
# /init's `nap` waits with a timed `read` on this FIFO instead of running `sleep`, an applet:
# a fork and an exec in every turn of every polling loop.
mkfifo "$STAGE/tmp/nap" || die "mkfifo /tmp/nap failed"

mkdir -p "$(dirname "$OUT")"
(cd "$STAGE" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc --quiet -R 0:0) >"$OUT.tmp"
mv "$OUT.tmp" "$OUT"
if [ -n "$KEY" ]; then
	rm -f "$LINK" # a plain file from before the cache
	ln -sfn "initramfs-$VARIANT$KEY.cpio" "$LINK"
	# Keep the newest few archives of this variant, and any from the last hours (the full
	# one's names start with the key's hex digits).
	if [ "$SMALL" = 1 ]; then
		prune_cache 3 "$CACHE"/initramfs-small-*.cpio
	else
		prune_cache 3 "$CACHE"/initramfs-[0-9a-f]*.cpio
	fi
fi
echo "$OUT"
