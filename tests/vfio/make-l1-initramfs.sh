#!/usr/bin/env bash
# Build L1's initramfs (newc cpio, uncompressed) for scripts/test-vfio.sh:
#   /init             tests/vfio/initramfs/init (binds devices to vfio-pci, runs the
#                     kernel test, starts lenderd; markers on the console)
#   /bin/busybox      from Debian's busybox-static
#   /bin/lenderd      static (glibc, crt-static), release
#   /bin/vfio_kernel  static test binary of lending/tests/vfio_kernel.rs
#   /dev/console
#
#   tests/vfio/make-l1-initramfs.sh
# Prints the archive's path (last line). Static binaries are built with cargo in
# target/static (RUSTFLAGS=-C target-feature=+crt-static, --target
# x86_64-unknown-linux-gnu, so that build scripts and proc macros stay dynamic).
# The archive is cached: ${LENDVM_CACHE:-$HOME/.cache/lendvm}/linux/l1-initramfs-<key>.cpio,
# key = sha256 of (busybox-static version, this script, the init, both binaries).
# It holds no secret: the cluster file and token come in a second cpio per run.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../linux/lib.sh"
VFIO_DIR=$REPO/tests/vfio
CACHE="${LENDVM_CACHE:-$HOME/.cache/lendvm}/linux"
ensure_pkgs busybox-static cpio
BUSYBOX=/bin/busybox
file_is_static() { ! LC_ALL=C readelf -l "$1" 2>/dev/null | grep -q 'INTERP'; }
file_is_static "$BUSYBOX" || die "$BUSYBOX is not static (is busybox-static installed?)"

TRIPLE=x86_64-unknown-linux-gnu
STATIC_TARGET=$REPO/target/static
log "building static lenderd and vfio_kernel (target/static; cached by cargo)"
export RUSTFLAGS='-C target-feature=+crt-static'
nice -n "${LENDVM_NICE:-10}" cargo build --release --locked -p lending --bin lenderd --target "$TRIPLE" \
	--target-dir "$STATIC_TARGET" >&2 || die "static lenderd build failed"
TEST_BIN=$(nice -n "${LENDVM_NICE:-10}" cargo test --release --locked -p lending --test vfio_kernel --no-run \
	--target "$TRIPLE" --target-dir "$STATIC_TARGET" --message-format=json 2>/dev/null \
	| sed -n 's/.*"executable":"\([^"]*vfio_kernel[^"]*\)".*/\1/p' | tail -n1)
LENDERD=$STATIC_TARGET/$TRIPLE/release/lenderd
[ -x "$LENDERD" ] || die "no static lenderd at $LENDERD"
[ -n "$TEST_BIN" ] && [ -x "$TEST_BIN" ] || die "static vfio_kernel test binary not built"
file_is_static "$LENDERD" || die "$LENDERD is not static"
file_is_static "$TEST_BIN" || die "$TEST_BIN is not static"

KEY=$( {
	dpkg-query -W -f='busybox-static ${Version}\n' busybox-static
	cat "${BASH_SOURCE[0]}" "$VFIO_DIR/initramfs/init"
	sha256sum <"$LENDERD"
	sha256sum <"$TEST_BIN"
} | sha256sum | cut -c1-16)
OUT=$CACHE/l1-initramfs-$KEY.cpio
if [ -f "$OUT" ]; then echo "$OUT"; exit 0; fi

STAGE=$(mktemp -d "${TMPDIR:-/tmp}/lendvm-l1-initramfs.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE"/{bin,dev,proc,sys,tmp,run,etc/lendvm}
cp "$BUSYBOX" "$STAGE/bin/busybox"
cp "$LENDERD" "$STAGE/bin/lenderd"
cp "$TEST_BIN" "$STAGE/bin/vfio_kernel"
strip "$STAGE/bin/lenderd" "$STAGE/bin/vfio_kernel" 2>/dev/null || true
install -m 0755 "$VFIO_DIR/initramfs/init" "$STAGE/init"
chmod 0700 "$STAGE/etc/lendvm"
mknod "$STAGE/dev/console" c 5 1 || die "mknod /dev/console failed (run as root)"
mkdir -p "$CACHE"
(cd "$STAGE" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc --quiet -R 0:0) >"$OUT.tmp"
mv "$OUT.tmp" "$OUT"
ls -1t "$CACHE"/l1-initramfs-*.cpio 2>/dev/null | tail -n +3 | xargs -r rm -f
echo "$OUT"
