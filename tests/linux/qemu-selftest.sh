#!/usr/bin/env bash
# Boot the lendvm guest kernel under QEMU+KVM with an NVMe disk and check the
# in-kernel self-test (resources/patches/0002-block-lendvm-selftest.patch):
#   - the stock nvme driver probes (`nvme nvme0: ...`),
#   - the MBR partition is seen (`nvme0n1: p1`),
#   - `LENDVM-SELFTEST nvme0n1 ok sectors=N ... size=<disk bytes>` is printed,
#   - the pattern landed in the disk image at lba*512,
#   - QEMU exits with 1 = (0 << 1) | 1 through isa-debug-exit at port 0xf4.
#
#   tests/linux/qemu-selftest.sh [--kernel BZIMAGE] [--timeout SECONDS] [--workdir DIR]
#
# Boot takes minutes on a PVM host (the guest runs in KVM's instruction
# emulator). Prints `qemu-selftest: 5 passed, 0 failed` (or the failures) and
# exits non-zero on any failure. Serial log: <workdir>/serial.log.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

TIMEOUT=900 WORK="" LBA=2048 COUNT=8 SEED=1e5d7e57 DISK_MIB=64
while [ $# -gt 0 ]; do
	case "$1" in
	--kernel) BZIMAGE=$2; shift 2 ;;
	--timeout) TIMEOUT=$2; shift 2 ;;
	--workdir) WORK=$2; shift 2 ;;
	*) die "unknown argument '$1'" ;;
	esac
done

ensure_pkgs qemu-system-x86
ensure_kernel
[ -n "$WORK" ] || WORK=$(mktemp -d "${TMPDIR:-/tmp}/lendvm-qemu-selftest.XXXXXX")
mkdir -p "$WORK"
DISK=$WORK/disk.img LOG=$WORK/serial.log
make_disk "$DISK" $DISK_MIB

CMDLINE="$LENDVM_BASE_CMDLINE $QEMU_CPU_CMDLINE lendvm_selftest=nvme0n1,lba=$LBA,count=$COUNT,seed=0x$SEED,exit_port=0xf4"
log "booting $BZIMAGE (timeout ${TIMEOUT}s, log $LOG)"
log "cmdline: $CMDLINE"
start=$(date +%s)
rc=0
run_qemu "$LOG" "$TIMEOUT" "$CMDLINE" \
	-drive "file=$DISK,if=none,id=d0,format=raw" -device nvme,drive=d0,serial=lendvm0 || rc=$?
log "qemu exited with $rc after $(( $(date +%s) - start )) s"

pass=0 fail=0
check() { # name, command...
	local name=$1
	shift
	if "$@"; then
		echo "ok   $name"
		pass=$((pass + 1))
	else
		echo "FAIL $name"
		fail=$((fail + 1))
	fi
}
pattern_ok() {
	local i s want got
	for ((i = 0; i < COUNT; i++)); do
		s=$((LBA + i))
		want="LENDVM-SELFTEST sector=$s seed=$SEED"
		got=$(dd if="$DISK" bs=512 skip=$s count=1 status=none | head -c ${#want})
		[ "$got" = "$want" ] || { echo "  sector $s: '$got'" >&2; return 1; }
	done
}
size=$((DISK_MIB * 1024 * 1024))
check "nvme driver probed" grep -qE 'nvme nvme0: ' "$LOG"
check "partition p1 seen" grep -q 'nvme0n1: p1' "$LOG"
check "self-test ok line" grep -qE "LENDVM-SELFTEST nvme0n1 ok sectors=$COUNT lba=$LBA seed=$SEED size=$size lbs=512 parts=1" "$LOG"
check "pattern on disk at lba $LBA" pattern_ok
check "qemu exit code 1 (guest wrote 0 to 0xf4)" test "$rc" = 1

grep -aE 'nvme nvme0|nvme0n1|LENDVM-SELFTEST|lendvm-selftest' "$LOG" | sed 's/^/  | /' || true
t=$(grep -aE 'LENDVM-SELFTEST nvme0n1' "$LOG" | sed -nE 's/^\[ *([0-9.]+)\].*/\1/p' | head -n1)
[ -z "$t" ] || log "self-test result at guest time ${t}s"
echo "qemu-selftest: $pass passed, $fail failed"
if [ "$fail" -ne 0 ]; then
	echo "--- last 30 serial lines ($LOG)"; tail -n 30 "$LOG"; cat "$LOG.qemu" 2>/dev/null | tail -n 5
	exit 1
fi
