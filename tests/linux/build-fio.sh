#!/usr/bin/env bash
# Build a static fio for the lendvm guest initramfs from Debian's own fio source package
# (the version of the `fio` package this Debian release ships).
#
#   tests/linux/build-fio.sh
#
# Prints the path of the stripped static binary (last line). Cached like the guest kernel:
# $CACHE/linux/fio-<key>/fio, key = sha256 of (the fio source version, this script); a rerun
# with the same key prints the path at once. About 1.5 min on the 2 shared cores here.
#
# Why a static build and not Debian's binary plus its libraries: Debian's fio links every
# engine it ships (ceph/rbd, gluster, rdma, nbd, pmem, ...), and its 64 shared libraries
# weigh 84 MB. The guest unpacks the initramfs into RAM in KVM's instruction emulator,
# so that would cost minutes and most of a 128 MiB guest. The static build is 2.8 MB.
#
# Configure choices, each for the guest kernel (tinyconfig, resources/linux-config-x86_64):
#   --disable-shm     fio keeps its job table in SysV shared memory unless built without it;
#                     the guest kernel has no SYSVIPC. Jobs must then run with `thread`.
#   --disable-native  no -march=native: the binary must run on whatever CPU the guest has.
#   --build-static    glibc static; only psync/libaio/io_uring-style engines are wanted.
#   the library-based engines are all disabled (and would not link statically anyway).
# The libaio engine needs CONFIG_AIO and fio's helper thread needs CONFIG_TIMERFD in the
# guest kernel (both in resources/linux-config-x86_64).
#
# The source comes with `apt-get source`, through the machine's own apt sources turned into
# deb-src entries in a private apt state directory (the system's apt configuration is not
# touched). Installs gcc, make, libc6-dev, libaio-dev, zlib1g-dev and dpkg-dev when missing.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CACHE="${LENDVM_CACHE:-$HOME/.cache/lendvm}/linux"
ensure_pkgs gcc make libc6-dev libaio-dev zlib1g-dev dpkg-dev fio

# The source version follows the binary package (Debian's `fio`, installed above: the same
# version a user of this Debian release would run).
VERSION=$(dpkg-query -W -f='${Version}' fio)
[ -n "$VERSION" ] || die "cannot tell the version of Debian's fio package"
CONFIGURE_ARGS=(--build-static --disable-native --disable-shm --disable-numa --disable-rdma
	--disable-rados --disable-rbd --disable-http --disable-gfapi --disable-pmem --disable-xnvme
	--disable-libzbc --disable-tcmalloc --disable-dfs --disable-libnfs)
KEY=$({
	echo "fio $VERSION"
	echo "configure ${CONFIGURE_ARGS[*]}"
	cat "${BASH_SOURCE[0]}"
} | sha256sum | cut -c1-16)
OUT_DIR=$CACHE/fio-$KEY
if [ -x "$OUT_DIR/fio" ]; then
	echo "$OUT_DIR/fio"
	exit 0
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/lendvm-fio.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# deb-src twins of the machine's apt sources (one-line and deb822 formats), in a private apt
# state: `apt-get update` may complain about third-party repositories without sources; only
# the `apt-get source` below has to succeed.
mkdir -p "$WORK/apt/lists/partial" "$WORK/apt/sources.list.d" "$WORK/src"
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
	[ -f "$f" ] || continue
	sed -n 's/^[[:space:]]*deb[[:space:]]/deb-src /p' "$f" >>"$WORK/apt/sources.list.d/src.list"
done
for f in /etc/apt/sources.list.d/*.sources; do
	[ -f "$f" ] || continue
	sed 's/^Types:.*/Types: deb-src/' "$f" >"$WORK/apt/sources.list.d/$(basename "$f")"
done
APT_OPTS=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$WORK/apt/sources.list.d"
	-o "Dir::State::Lists=$WORK/apt/lists" -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
	-o "Debug::NoLocking=1")
log "fetching the source of fio $VERSION (apt-get source)"
apt-get "${APT_OPTS[@]}" update -qq >"$WORK/apt-update.log" 2>&1 || true
(cd "$WORK/src" && apt-get "${APT_OPTS[@]}" source -qq "fio=$VERSION" >"$WORK/apt-source.log" 2>&1) || {
	cat "$WORK/apt-update.log" "$WORK/apt-source.log" >&2
	die "apt-get source fio=$VERSION failed (no deb-src reachable for the machine's Debian sources?)"
}
SRC=$(find "$WORK/src" -mindepth 1 -maxdepth 1 -type d -name 'fio-*' | head -n 1)
[ -n "$SRC" ] && [ -f "$SRC/configure" ] || die "apt-get source fio left no source tree in $WORK/src"

log "building a static fio $VERSION (${CONFIGURE_ARGS[*]})"
(cd "$SRC" && ./configure "${CONFIGURE_ARGS[@]}" >"$WORK/configure.log" 2>&1) || {
	tail -n 30 "$WORK/configure.log" >&2
	die "fio configure failed"
}
grep -q '^CONFIG_LIBAIO=y' "$SRC/config-host.mak" || die "fio configure found no static libaio (libaio-dev)"
(cd "$SRC" && nice -n 15 make -j"$(nproc)" fio >"$WORK/make.log" 2>&1) || {
	tail -n 30 "$WORK/make.log" >&2
	die "fio build failed"
}
LC_ALL=C readelf -l "$SRC/fio" | grep -q INTERP && die "the fio build is not static"
mkdir -p "$OUT_DIR.tmp"
strip -o "$OUT_DIR.tmp/fio" "$SRC/fio"
rm -rf "$OUT_DIR"
mv "$OUT_DIR.tmp" "$OUT_DIR"
# Keep only the newest few builds.
ls -1dt "$CACHE"/fio-* 2>/dev/null | tail -n +4 | xargs -r rm -rf
echo "$OUT_DIR/fio"
