# Shared helpers for the QEMU-based guest-kernel checks (sourced, not run).
# shellcheck shell=bash

LINUX_TESTS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$LINUX_TESTS_DIR/../.." && pwd)

# Kernel command line that gets a non-PVM Linux through KVM's instruction
# emulator on a PVM host (see docs/linux-guest-on-pvm.md). lendvm masks the
# CPUID bits itself, so `clearcpuid=`/`noxsave` are only needed under QEMU.
# rodata=off: the kernel does not write-protect its own text and read-only data, 4.4 s of
# emulated page-table work per boot; a guest's self-hardening that no check here is about.
LENDVM_BASE_CMDLINE="console=ttyS0 earlyprintk=serial,ttyS0,115200 panic=-1 nokaslr lpj=1000000 rodata=off"
QEMU_CPU_CMDLINE="noxsave clearcpuid=smap,smep,pcid,popcnt"
# QEMU's qemu64 still has POPCNT; the other unhandled features are absent.
QEMU_CPU="qemu64,-popcnt"

log() { echo "[$(date +%H:%M:%S)] $*" >&2; }
die() { echo "error: $*" >&2; exit 1; }

# build_nolibc SRC OUT [CFLAGS...]: a static program without libc (the guests' PID 1 and
# tools: tests/linux/initramfs/*.c), a few KB where glibc would add most of a megabyte to
# an initramfs the guest kernel unpacks in emulated time. Needs gcc and binutils.
build_nolibc() {
	local src=$1 out=$2
	shift 2
	gcc -nostdlib -static -no-pie -ffreestanding -fno-stack-protector -fno-builtin \
		-fcf-protection=none -O2 -Wall -Werror "$@" \
		-o "$out" "$src" || die "building $(basename "$src") ($out) failed"
}

# build_pid1 SCRIPT OUT: the guests' PID 1 (tests/linux/initramfs/pid1.c), which runs the
# init script SCRIPT as its child and runs it again when the emulator's TLS fault kills it.
# Fails unless the program's code leaves %fs alone: a PID 1 with thread-local storage would
# meet the very fault it is there to survive.
build_pid1() {
	local script=$1 out=$2
	build_nolibc "$LINUX_TESTS_DIR/initramfs/pid1.c" "$out" -DSCRIPT="\"$script\""
	if objdump -d "$out" | grep -q '%fs'; then
		die "$out uses %fs (thread-local storage): PID 1 must not"
	fi
}

# prune_cache KEEP PATH...: of the cache entries PATH... (files or directories, newest
# first by modification time), removes those past the newest KEEP that are older than six
# hours. Not every one past the newest KEEP: a run that started earlier on the same cache (a
# CI run beside a developer's test run) may still be booting an older archive, and deleting
# it under that run failed its guests (a loaded run of 2026-11-29).
prune_cache() {
	local keep=$1 p
	shift
	# (`|| true`, ifs: callers run under `set -e -o pipefail`, and a glob that matched
	# nothing or an entry kept is no failure.)
	{ ls -1dt "$@" 2>/dev/null || true; } | tail -n +$((keep + 1)) | while IFS= read -r p; do
		if [ -n "$(find "$p" -maxdepth 0 -mmin +360 2>/dev/null)" ]; then
			rm -rf -- "$p"
		fi
	done
}

ensure_pkgs() {
	local missing=() p
	for p in "$@"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	[ "$(id -u)" = 0 ] || die "missing packages ${missing[*]}; run as root"
	log "installing ${missing[*]}"
	apt-get update -qq >&2 || die "apt-get update failed"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 \
		|| die "apt-get install ${missing[*]} failed"
}

# Sets BZIMAGE/VMLINUX (build-guest-kernel.sh is cached, so this is instant
# after the first build) unless BZIMAGE is already set.
ensure_kernel() {
	if [ -n "${BZIMAGE:-}" ]; then
		[ -f "$BZIMAGE" ] || die "kernel $BZIMAGE not found"
		return 0
	fi
	local out
	out=$("$REPO/scripts/build-guest-kernel.sh") || die "guest kernel build failed"
	BZIMAGE=$(sed -n 's/^BZIMAGE=//p' <<<"$out")
	VMLINUX=$(sed -n 's/^VMLINUX=//p' <<<"$out")
	[ -f "$BZIMAGE" ] || die "build-guest-kernel.sh printed no bzImage"
}

le32() { # value -> printf escape string, little endian
	local v=$1
	printf '\\x%02x\\x%02x\\x%02x\\x%02x' $((v & 255)) $((v >> 8 & 255)) $((v >> 16 & 255)) $((v >> 24 & 255))
}

# make_disk IMG SIZE_MIB: a raw image with an MBR holding one Linux partition
# from sector 2048 to the end.
make_disk() {
	local img=$1 mib=$2 sectors start=2048 entry
	sectors=$((mib * 2048))
	rm -f "$img"
	truncate -s "${mib}M" "$img"
	# status, CHS first (LBA mode), type 0x83, CHS last, first LBA, sector count
	entry="\\x00\\xfe\\xff\\xff\\x83\\xfe\\xff\\xff$(le32 $start)$(le32 $((sectors - start)))"
	# shellcheck disable=SC2059
	printf "$(le32 0x4c454e44)" | dd of="$img" bs=1 seek=440 conv=notrunc status=none
	# shellcheck disable=SC2059
	printf "$entry" | dd of="$img" bs=1 seek=446 conv=notrunc status=none
	printf '\x55\xaa' | dd of="$img" bs=1 seek=510 conv=notrunc status=none
}

# run_qemu LOG TIMEOUT_S CMDLINE [extra qemu args...]; returns QEMU's exit code
# (124 on timeout).
run_qemu() {
	local logf=$1 tmo=$2 cmdline=$3
	shift 3
	local rc=0
	timeout --foreground -k 10 "$tmo" qemu-system-x86_64 \
		-enable-kvm -cpu "$QEMU_CPU" -machine "${QEMU_MACHINE:-q35}" -m 256M -smp 1 \
		-nographic -no-reboot -monitor none -net none -serial "file:$logf" \
		-device isa-debug-exit,iobase=0xf4,iosize=0x04 \
		-kernel "$BZIMAGE" -append "$cmdline" "$@" </dev/null >"$logf.qemu" 2>&1 || rc=$?
	return $rc
}
