#!/usr/bin/env bash
# Build the lendvm guest kernel (x86_64) from Debian's linux-source-6.1.
#
#   scripts/build-guest-kernel.sh [--print-key] [--force] [--no-install]
#
# Steps: install the build dependencies (apt, needs root when something is
# missing), unpack /usr/src/linux-source-6.1.tar.xz into the cache, apply
# resources/patches/*.patch in order (patch -p1), `make tinyconfig`, merge
# resources/linux-config-x86_64, check that every `=y` of the fragment made it
# into .config, build vmlinux + bzImage (nice, -j$(nproc)).
#
# Cache: ${LENDVM_CACHE:-$HOME/.cache/lendvm}/linux
#   out-<key>/{vmlinux,bzImage,config,key}   one finished build per key
#   out -> out-<key>                          stable symlink to the latest build
#   tree/                                     the build tree (reused: a change in
#                                             the config fragment only rebuilds
#                                             incrementally; new patches or a new
#                                             linux-source re-unpack it)
# key = sha256 of (linux-source-6.1 package version, config fragment, patches,
# this script). A rerun with the same key prints the paths and exits at once.
#
# Output (stdout, last lines):
#   VMLINUX=<path>
#   BZIMAGE=<path>
#   OUT=<cache>/linux/out
# Progress goes to stderr; the full build log is in <cache>/linux/build.log.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SCRIPT="$REPO/scripts/build-guest-kernel.sh"
FRAGMENT="$REPO/resources/linux-config-x86_64"
PATCHDIR="$REPO/resources/patches"
CACHE="${LENDVM_CACHE:-$HOME/.cache/lendvm}/linux"
SRC_PKG=linux-source-6.1
SRC_TAR=/usr/src/linux-source-6.1.tar.xz
DEPS=(linux-source-6.1 build-essential flex bison bc libelf-dev libssl-dev cpio lz4 xz-utils kmod)

log() { echo "build-guest-kernel: $*" >&2; }
die() { echo "build-guest-kernel: error: $*" >&2; exit 1; }

PRINT_KEY=0 FORCE=0 INSTALL=1
for arg in "$@"; do
	case "$arg" in
	--print-key) PRINT_KEY=1 ;;
	--force) FORCE=1 ;;
	--no-install) INSTALL=0 ;;
	-h|--help) sed -n '2,26p' "$SCRIPT"; exit 0 ;;
	*) die "unknown argument '$arg' (see --help)" ;;
	esac
done

[ -f "$FRAGMENT" ] || die "config fragment $FRAGMENT is missing"

# --- 1. dependencies --------------------------------------------------------
missing=()
for p in "${DEPS[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	[ "$INSTALL" = 1 ] || die "missing packages: ${missing[*]} (run without --no-install as root)"
	SUDO=""
	if [ "$(id -u)" != 0 ]; then
		command -v sudo >/dev/null || die "missing packages ${missing[*]}; run as root"
		SUDO=sudo
	fi
	log "installing ${missing[*]}"
	$SUDO apt-get update -qq >&2 || die "apt-get update failed"
	DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 \
		|| die "apt-get install ${missing[*]} failed"
fi
[ -f "$SRC_TAR" ] || die "$SRC_TAR not found after installing $SRC_PKG"

# --- 2. cache key -------------------------------------------------------------
SRC_VER=$(dpkg-query -W -f='${Version}' "$SRC_PKG")
shopt -s nullglob
PATCHES=("$PATCHDIR"/*.patch)
shopt -u nullglob
tree_key=$( { echo "src $SRC_VER"; for p in "${PATCHES[@]}"; do echo "patch $(basename "$p")"; cat "$p"; done; } \
	| sha256sum | cut -c1-16)
KEY=$( { echo "tree $tree_key"; echo "fragment"; cat "$FRAGMENT"; echo "script"; cat "$SCRIPT"; } \
	| sha256sum | cut -c1-16)
if [ "$PRINT_KEY" = 1 ]; then echo "$KEY"; exit 0; fi

OUTDIR="$CACHE/out-$KEY"
print_result() {
	ln -sfn "out-$KEY" "$CACHE/out"
	echo "VMLINUX=$OUTDIR/vmlinux"
	echo "BZIMAGE=$OUTDIR/bzImage"
	echo "OUT=$CACHE/out"
}
if [ "$FORCE" = 0 ] && [ -f "$OUTDIR/bzImage" ] && [ -f "$OUTDIR/vmlinux" ]; then
	log "cached build $KEY ($SRC_PKG $SRC_VER)"
	print_result
	exit 0
fi

# Only one build at a time per cache.
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9 || die "cannot lock $CACHE/.lock"

# --- 3. source tree -----------------------------------------------------------
TREE="$CACHE/tree"
KSRC="$TREE/linux-source-6.1"
# Undo the patches the tree has (kept in $TREE/.applied) so that only changed
# files get rebuilt; a tree that cannot be reverted cleanly is unpacked anew.
revert_tree() {
	[ -f "$TREE/.src-version" ] && [ "$(cat "$TREE/.src-version")" = "$SRC_VER" ] || return 1
	[ -d "$TREE/.applied" ] || return 1
	local p
	for p in $(ls -1 "$TREE/.applied" | sort -r); do
		patch -d "$KSRC" -p1 -R --batch --quiet <"$TREE/.applied/$p" >/dev/null 2>&1 || return 1
	done
	rm -rf "$TREE/.applied" "$TREE/.tree-key"
}
if [ "$(cat "$TREE/.tree-key" 2>/dev/null || true)" != "$tree_key" ]; then
	if [ -d "$KSRC" ] && revert_tree; then
		log "reverted the previous patches in $KSRC"
	else
		log "unpacking $SRC_TAR ($SRC_VER)"
		rm -rf "$TREE"
		mkdir -p "$TREE"
		tar -C "$TREE" -xf "$SRC_TAR" || die "unpacking $SRC_TAR failed"
		[ -f "$KSRC/Makefile" ] || die "unexpected layout of $SRC_TAR (no linux-source-6.1/Makefile)"
		echo "$SRC_VER" >"$TREE/.src-version"
	fi
	mkdir -p "$TREE/.applied"
	for p in "${PATCHES[@]}"; do
		log "applying $(basename "$p")"
		patch -d "$KSRC" -p1 --forward --batch --quiet <"$p" >&2 \
			|| { rm -rf "$TREE"; die "patch $(basename "$p") does not apply to $SRC_PKG $SRC_VER"; }
		cp "$p" "$TREE/.applied/"
	done
	echo "$tree_key" >"$TREE/.tree-key"
fi

# --- 4. configuration -----------------------------------------------------------
BUILDLOG="$CACHE/build.log"
: >"$BUILDLOG"
run() { "$@" >>"$BUILDLOG" 2>&1 || { tail -n 40 "$BUILDLOG" >&2; die "'$*' failed (log: $BUILDLOG)"; }; }
MAKE=(nice -n "${LENDVM_NICE:-15}" make -C "$KSRC" ARCH=x86_64 -j"$(nproc)")

log "configuring (tinyconfig + $(basename "$FRAGMENT"))"
run "${MAKE[@]}" tinyconfig
run env -C "$KSRC" ./scripts/kconfig/merge_config.sh -m .config "$FRAGMENT"
run "${MAKE[@]}" olddefconfig

# Every option the fragment sets (=y or a value) or unsets must have survived (a dependency that is
# not met makes Kconfig drop an option silently).
dropped=()
while IFS= read -r line; do
	case "$line" in
	CONFIG_*=*)
		grep -qx -- "$line" "$KSRC/.config" || dropped+=("${line%%=*}") ;;
	"# CONFIG_"*" is not set")
		opt=${line#"# "}; opt=${opt%% *}
		grep -q "^$opt=" "$KSRC/.config" && dropped+=("$opt(should be unset)") ;;
	esac
done < <(sed -e 's/[[:space:]]*$//' "$FRAGMENT")
[ ${#dropped[@]} -eq 0 ] || die "options from $(basename "$FRAGMENT") not in the final .config: ${dropped[*]}"

# --- 5. build -------------------------------------------------------------------
log "building vmlinux + bzImage with -j$(nproc) (several minutes; log: $BUILDLOG)"
start=$(date +%s)
run "${MAKE[@]}" vmlinux bzImage
log "built in $(( $(date +%s) - start )) s"

rm -rf "$OUTDIR.tmp"
mkdir -p "$OUTDIR.tmp"
cp "$KSRC/vmlinux" "$KSRC/arch/x86/boot/bzImage" "$OUTDIR.tmp/"
cp "$KSRC/.config" "$OUTDIR.tmp/config"
cp "$KSRC/System.map" "$OUTDIR.tmp/System.map"
echo "$KEY" >"$OUTDIR.tmp/key"
rm -rf "$OUTDIR"
mv "$OUTDIR.tmp" "$OUTDIR"
# Keep only the newest few finished builds.
ls -1dt "$CACHE"/out-* 2>/dev/null | tail -n +4 | xargs -r rm -rf
print_result
