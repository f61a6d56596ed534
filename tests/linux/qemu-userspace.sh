#!/usr/bin/env bash
# Boot the lendvm guest kernel with the busybox initramfs under QEMU+KVM and
# check the user-space NVMe test (`LENDVM-USERSPACE <disk> ok ...`, QEMU exit
# 1 = guest powered off through lendvm_exit_port=0xf4 with code 0).
#
#   tests/linux/qemu-userspace.sh [--syscall-fixup] [--syscall-ud] [--probe NAME]
#                  [--kernel BZIMAGE] [--timeout SECONDS] [--workdir DIR] [--append ARGS]
#
#   --syscall-fixup  add `lendvm_syscall_fixup` (finish SYSCALL from the #PF it
#                    raises; needed where the guest runs in KVM's emulator on a
#                    PVM host, see docs/linux-guest-on-pvm.md)
#   --syscall-ud     add `lendvm_syscall_ud` (clear EFER.SCE, SYSCALL via #UD;
#                    does not help on this host)
#   --probe NAME  boot rdinit=/probe-NAME (syscall, int80, ud2, spin) instead of
#                 /init and only print what happened (no pass/fail)
# On a PVM host without --syscall-fixup, init dies at its first SYSCALL (see
# docs/linux-guest-on-pvm.md); this script then fails.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

TIMEOUT=1200 WORK="" PROBE="" EXTRA="" DISK_MIB=64 LBA=4096 COUNT=8
while [ $# -gt 0 ]; do
	case "$1" in
	--syscall-fixup) EXTRA="$EXTRA lendvm_syscall_fixup"; shift ;;
	--syscall-ud) EXTRA="$EXTRA lendvm_syscall_ud"; shift ;;
	--probe) PROBE=$2; shift 2 ;;
	--append) EXTRA="$EXTRA $2"; shift 2 ;;
	--kernel) BZIMAGE=$2; shift 2 ;;
	--timeout) TIMEOUT=$2; shift 2 ;;
	--workdir) WORK=$2; shift 2 ;;
	*) die "unknown argument '$1'" ;;
	esac
done

ensure_pkgs qemu-system-x86
ensure_kernel
INITRD=$("$LINUX_TESTS_DIR/make-initramfs.sh" | tail -n1)
[ -n "$WORK" ] || WORK=$(mktemp -d "${TMPDIR:-/tmp}/lendvm-qemu-userspace.XXXXXX")
mkdir -p "$WORK"
DISK=$WORK/disk.img LOG=$WORK/serial.log
make_disk "$DISK" $DISK_MIB

CMDLINE="$LENDVM_BASE_CMDLINE $QEMU_CPU_CMDLINE lendvm_exit_port=0xf4 lendvm_us=nvme0n1,$LBA,$COUNT$EXTRA"
[ -z "$PROBE" ] || CMDLINE="$CMDLINE rdinit=/probe-$PROBE"
log "booting $BZIMAGE + $INITRD (timeout ${TIMEOUT}s, log $LOG)"
log "cmdline: $CMDLINE"
start=$(date +%s)
rc=0
run_qemu "$LOG" "$TIMEOUT" "$CMDLINE" -initrd "$INITRD" \
	-drive "file=$DISK,if=none,id=d0,format=raw" -device nvme,drive=d0,serial=lendvm0 || rc=$?
log "qemu exited with $rc after $(( $(date +%s) - start )) s"

grep -aE 'Run /|probe|LENDVM-USERSPACE|segfault|traps:|Kernel panic|Attempted to kill|general protection|BUG|Oops' "$LOG" \
	| sed 's/^/  | /' | head -n 40 || true
if [ -n "$PROBE" ]; then
	exit 0
fi
size=$((DISK_MIB * 1024 * 1024))
if grep -qE "LENDVM-USERSPACE nvme0n1 ok sectors=$COUNT lba=$LBA size=$size parts=1" "$LOG" && [ "$rc" = 1 ]; then
	echo "qemu-userspace: 1 passed, 0 failed"
else
	echo "--- last 30 serial lines ($LOG)"; tail -n 30 "$LOG"
	echo "qemu-userspace: 0 passed, 1 failed"
	exit 1
fi
