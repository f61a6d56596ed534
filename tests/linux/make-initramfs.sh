#!/usr/bin/env bash
# Build the lendvm test initramfs (newc cpio, uncompressed: gunzip of 2 MB
# takes most of a minute in KVM's instruction emulator on a PVM host):
#   /init            busybox script (tests/linux/initramfs/init): user-space
#                    NVMe write/read-back check, prints LENDVM-USERSPACE ...
#   /bin/busybox     from Debian's busybox-static
#   /bin/fio         static fio built from Debian's fio source (build-fio.sh)
#   /fio/<job>.fio   fio jobs for /init's fio runner (tests/linux/initramfs/fio)
#   /probe-<name>    libc-free probes of CPL 3 -> CPL 0 transitions
#                    (tests/linux/initramfs/probes.S; select with rdinit=)
#   /dev/console     so init has a console before devtmpfs is mounted
#
#   tests/linux/make-initramfs.sh [OUTPUT]
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

CACHE="${LENDVM_CACHE:-$HOME/.cache/lendvm}/linux"
ensure_pkgs busybox-static cpio gcc libc6-dev
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
		dpkg-query -W -f='busybox-static ${Version}\ngcc ${Version}\n' busybox-static gcc
		echo "fio $(sha256sum <"$FIO")"
		for f in "${BASH_SOURCE[0]}" "$LINUX_TESTS_DIR/lib.sh" "$LINUX_TESTS_DIR/build-fio.sh" \
			$(find "$LINUX_TESTS_DIR/initramfs" -type f | LC_ALL=C sort); do
			echo "file ${f#"$LINUX_TESTS_DIR"/}"
			cat "$f"
		done
	} | sha256sum | cut -c1-16)
	OUT=$CACHE/initramfs-$KEY.cpio
	if [ -f "$OUT" ]; then
		ln -sfn "initramfs-$KEY.cpio" "$CACHE/initramfs.cpio"
		echo "$OUT"
		exit 0
	fi
fi

STAGE=$(mktemp -d "${TMPDIR:-/tmp}/lendvm-initramfs.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE"/{bin,dev,proc,sys,tmp,fio}
cp "$BUSYBOX" "$STAGE/bin/busybox"
cp "$FIO" "$STAGE/bin/fio"
cp "$LINUX_TESTS_DIR"/initramfs/fio/*.fio "$STAGE/fio/"
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
if [ -n "$KEY" ]; then
	rm -f "$CACHE/initramfs.cpio" # a plain file from before the cache
	ln -sfn "initramfs-$KEY.cpio" "$CACHE/initramfs.cpio"
	# Keep only the newest few archives.
	ls -1t "$CACHE"/initramfs-*.cpio 2>/dev/null | tail -n +4 | xargs -r rm -f
fi
echo "$OUT"
