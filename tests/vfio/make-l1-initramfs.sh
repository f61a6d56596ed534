#!/usr/bin/env bash
# Build L1's initramfs (newc cpio, uncompressed) for scripts/test-vfio.sh:
#   /init             PID 1 (tests/linux/initramfs/pid1.c): runs /init.sh, and again when
#                     the emulator's TLS fault kills it
#   /init.sh          tests/vfio/initramfs/init (binds devices to vfio-pci, runs the
#                     kernel test, starts lenderd; markers on the console)
#   /bin/busybox      from Debian's busybox-static
#   /bin/lenderd      the workspace's lenderd (debug, stripped; LENDVM_L1_LENDERD_PROFILE=release:
#                     the `l1` profile, release without debug info)
#   /bin/vfio_kernel  the test binary of lending/tests/vfio_kernel.rs (target/debug)
#   /bin/lendvm-nvme-sriov  the SR-IOV PF driver's half (tests/src/bin, target/debug)
#   /lib*, /usr/lib*  the shared libraries both need (ldd), and the dynamic loader
#   /dev/console
#
#   tests/vfio/make-l1-initramfs.sh
# Prints the archive's path (last line). The binaries are the workspace's own builds
# (cargo, ${CARGO_TARGET_DIR:-target}; debug unless asked otherwise), dynamically
# linked, with their libraries copied
# from this machine: L1 runs this machine's glibc. (A static build, RUSTFLAGS=-C
# target-feature=+crt-static, would be a second full build of lenderd's dependencies in
# another target directory: ~30 min on a busy 2-core machine, for the same result.)
# The archive is cached: ${LENDVM_CACHE:-$HOME/.cache/lendvm}/linux/l1-initramfs-<key>.cpio,
# key = sha256 of (busybox-static version, this script, the init, both binaries).
# It holds no secret: the cluster file and token come in a second cpio per run.
set -euo pipefail
# Niceness of the long runs: none under CI, where a stand-in CPU load at nice 0 must not
# starve them; 10 on a developer's machine. LENDVM_NICE overrides.
NICE=${LENDVM_NICE:-$([ -n "${CI:-}" ] && echo 0 || echo 10)}
source "$(dirname "${BASH_SOURCE[0]}")/../linux/lib.sh"
VFIO_DIR=$REPO/tests/vfio
CACHE="${LENDVM_CACHE:-$HOME/.cache/lendvm}/linux"
ensure_pkgs busybox-static cpio gcc libc6-dev binutils
BUSYBOX=/bin/busybox
file_is_static() { ! LC_ALL=C readelf -l "$1" 2>/dev/null | grep -q 'INTERP'; }
file_is_static "$BUSYBOX" || die "$BUSYBOX is not static (is busybox-static installed?)"

# lenderd's build: the workspace's debug build (what CI's `build` stage made; why not release:
# scripts/test-vfio.sh, where the default is set), or the `l1` profile (release without debug
# info) for scripts/bench-l1.sh's comparison. The one-shot helpers are debug builds.
PROFILE=${LENDVM_L1_LENDERD_PROFILE:-debug}
case $PROFILE in
release) PFLAG='--profile l1' PDIR=l1 ;;
debug) PFLAG="" PDIR=debug ;;
*) die "LENDVM_L1_LENDERD_PROFILE is '$PROFILE', not release or debug" ;;
esac
log "building lenderd (cargo, $PROFILE), lendvm-nvme-sriov and the vfio_kernel test (debug)"
# --workspace, not -p lending: the workspace's feature resolution, so that the debug build is
# the one the `build` stage already made.
(cd "$REPO" && nice -n "$NICE" cargo build --locked -q $PFLAG --workspace \
	--bin lenderd >&2) || die "building lenderd ($PROFILE) failed"
# The debug helpers with --workspace, not -p: the workspace's feature resolution, so the
# crates the other stages built are not compiled again.
(cd "$REPO" && nice -n "$NICE" cargo build --locked -q \
	--workspace --bin lendvm-nvme-sriov >&2) || die "building lendvm-nvme-sriov failed"
TEST_BIN=$(cd "$REPO" && nice -n "$NICE" cargo test --locked --workspace --test vfio_kernel \
	--no-run --message-format=json 2>/dev/null \
	| sed -n 's/.*"executable":"\([^"]*vfio_kernel[^"]*\)".*/\1/p' | tail -n1)
LENDERD=${CARGO_TARGET_DIR:-$REPO/target}/$PDIR/lenderd
SRIOV=${CARGO_TARGET_DIR:-$REPO/target}/debug/lendvm-nvme-sriov
[ -x "$LENDERD" ] || die "no lenderd at $LENDERD"
[ -x "$SRIOV" ] || die "no lendvm-nvme-sriov at $SRIOV"
[ -n "$TEST_BIN" ] && [ -x "$TEST_BIN" ] || die "the vfio_kernel test binary was not built"

KEY=$( {
	dpkg-query -W -f='busybox-static ${Version}\n' busybox-static
	cat "${BASH_SOURCE[0]}" "$VFIO_DIR/initramfs/init" "$LINUX_TESTS_DIR/lib.sh" \
		"$LINUX_TESTS_DIR/initramfs/pid1.c" "$LINUX_TESTS_DIR/initramfs/nolibc.h"
	sha256sum <"$LENDERD"
	sha256sum <"$TEST_BIN"
	sha256sum <"$SRIOV"
} | sha256sum | cut -c1-16)
OUT=$CACHE/l1-initramfs-$KEY.cpio
if [ -f "$OUT" ]; then echo "$OUT"; exit 0; fi

STAGE=$(mktemp -d "${TMPDIR:-/tmp}/lendvm-l1-initramfs.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE"/{bin,dev,proc,sys,tmp,run,etc/lendvm}
cp "$BUSYBOX" "$STAGE/bin/busybox"
cp "$LENDERD" "$STAGE/bin/lenderd"
cp "$TEST_BIN" "$STAGE/bin/vfio_kernel"
cp "$SRIOV" "$STAGE/bin/lendvm-nvme-sriov"
# Symbols and debug info are most of a debug binary's size (150 MB -> 25 MB for lenderd);
# L1 unpacks the archive in emulated code.
strip --strip-all "$STAGE/bin/lenderd" "$STAGE/bin/vfio_kernel" "$STAGE/bin/lendvm-nvme-sriov" \
	|| die "strip failed"
# The libraries and the loader, at the paths the binaries look for them.
for lib in $(for b in "$LENDERD" "$TEST_BIN" "$SRIOV"; do ldd "$b"; done | grep -o '/[^ ]*' | sort -u); do
	mkdir -p "$STAGE$(dirname "$lib")"
	cp -L "$lib" "$STAGE$lib"
done
# /init is PID 1 (tests/linux/initramfs/pid1.c), the script its child: when the emulator's
# TLS fault kills the script, it runs again instead of L1's kernel panicking.
install -m 0755 "$VFIO_DIR/initramfs/init" "$STAGE/init.sh"
build_pid1 /init.sh "$STAGE/init"
chmod 0700 "$STAGE/etc/lendvm"
mknod "$STAGE/dev/console" c 5 1 || die "mknod /dev/console failed (run as root)"
mkdir -p "$CACHE"
(cd "$STAGE" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc --quiet -R 0:0) >"$OUT.tmp"
mv "$OUT.tmp" "$OUT"
prune_cache 2 "$CACHE"/l1-initramfs-*.cpio
echo "$OUT"
