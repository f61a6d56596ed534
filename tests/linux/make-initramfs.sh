#!/usr/bin/env bash
# Build the lendvm test initramfs (newc cpio, uncompressed: gunzip of 2 MB
# takes most of a minute in KVM's instruction emulator on a PVM host):
#   /init            busybox script (tests/linux/initramfs/init): user-space
#                    NVMe write/read-back check, prints LENDVM-USERSPACE ...
#   /bin/busybox     from Debian's busybox-static
#   /probe-<name>    libc-free probes of CPL 3 -> CPL 0 transitions
#                    (tests/linux/initramfs/probes.S; select with rdinit=)
#   /dev/console     so init has a console before devtmpfs is mounted
#
#   tests/linux/make-initramfs.sh [OUTPUT]   (default: $CACHE/linux/initramfs.cpio)
# Prints the path of the archive. Needs root (mknod; apt for missing packages).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CACHE="${LENDVM_CACHE:-$HOME/.cache/lendvm}/linux"
OUT=${1:-$CACHE/initramfs.cpio}
ensure_pkgs busybox-static cpio gcc libc6-dev
BUSYBOX=/bin/busybox
[ -x "$BUSYBOX" ] || die "$BUSYBOX missing after installing busybox-static"
file_is_static() { ! LC_ALL=C readelf -l "$1" 2>/dev/null | grep -q 'INTERP'; }
file_is_static "$BUSYBOX" || die "$BUSYBOX is not static (is busybox-static installed?)"

STAGE=$(mktemp -d "${TMPDIR:-/tmp}/lendvm-initramfs.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE"/{bin,dev,proc,sys,tmp}
cp "$BUSYBOX" "$STAGE/bin/busybox"
install -m 0755 "$LINUX_TESTS_DIR/initramfs/init" "$STAGE/init"
for p in syscall int80 ud2 spin; do
	def=PROBE_$(tr a-z A-Z <<<"$p")
	gcc -nostdlib -static -no-pie -D"$def" -o "$STAGE/probe-$p" "$LINUX_TESTS_DIR/initramfs/probes.S" \
		|| die "building probe-$p failed"
done
mknod "$STAGE/dev/console" c 5 1 || die "mknod /dev/console failed (run as root)"

mkdir -p "$(dirname "$OUT")"
(cd "$STAGE" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc --quiet -R 0:0) >"$OUT.tmp"
mv "$OUT.tmp" "$OUT"
echo "$OUT"
