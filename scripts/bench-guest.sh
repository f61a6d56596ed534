#!/usr/bin/env bash
# fio inside the Linux guest on each VMM configuration, side by side with QEMU's NVMe:
#
#   scripts/bench-guest.sh [--configs a,b,...] [--repeat N] [--allow-missing-counters] [--no-docs]
#                          [--perf | --perf-guest] [--name NAME]   (outputs target/bench/NAME.{json,svg}, NAME-logs/;
#                                           implies --no-docs; default guest-fio)
#                          [--cpus N] [--cpu-model host|qemu64] [--qemu-cpu CPU] [--qemu-append ARGS]
#
# Guest CPU: --cpus N vCPUs in every guest (default 1: lendvm --cpus, QEMU -smp); lendvm's
# configurations boot with --cpu-model (default qemu64, QEMU's model: see docs/BENCHMARKS.md,
# "The CPU-model experiment"); QEMU with -cpu CPU (default qemu64,-popcnt; `host` runs here
# too, 1 vCPU) and ARGS appended to its kernel command line (default: what QEMU needs for the
# CPU given, see tests/linux/bench_guest.py).
#
# Configurations (one boot each, same kernel, same initramfs, same fio jobs):
#   lendvm-shm-irq-dbbuf-off  NVMe lent over shm, interrupt mode, shadow doorbells off
#   lendvm-shm-irq-dbbuf-on   NVMe lent over shm, interrupt mode, shadow doorbells + ioeventfd
#   lendvm-shm-polling        NVMe lent over shm, polling mode
#   lendvm-tcp-trapped        NVMe lent over tcp (every BAR access trapped)
#   qemu-nvme                 Debian's qemu-system-x86_64 -enable-kvm -device nvme on a raw file
#   (lendvm-shm-irq           the lender's defaults; not in the default set)
# Jobs (tests/linux/initramfs/fio): 4 KiB randread and randwrite at QD1 and QD8, 128 KiB
# sequential read at QD8, each a fixed number of I/Os (libaio, O_DIRECT, on /dev/nvme0n1).
#
# Reports per configuration and job: IOPS, MiB/s, clat p50/p99 (fio's JSON), KVM exits per
# I/O (all, and to user space) raw and net of the idle guest's exit rate, and IOPS relative
# to qemu-nvme of the same round (--repeat N boots every configuration N times, in rounds), and
# where the CPU went during each job (the vCPU thread's run time and run-queue wait, the
# lender's threads, the rest of the host: schedstat). lendvm's counters come from `lendctl counters --json` (GET /api/v1/vm.counters),
# QEMU's from QMP query-stats. --allow-missing-counters reports exits as n/a on a lendvm
# without that endpoint instead of failing.
#
# Writes target/bench/guest-fio.json and .svg, updates the table in docs/BENCHMARKS.md
# (between the bench-guest markers) and docs/bench-guest.svg unless --no-docs; the consoles
# are in target/bench/guest-fio-logs/. Exits 1 naming every configuration that failed.
#
# Installs what it needs on a fresh Debian machine: python3 and qemu-system-x86 (apt), the
# guest kernel (scripts/build-guest-kernel.sh, ~7 min the first time) and the initramfs with
# fio (tests/linux/make-initramfs.sh, ~2 min the first time). Each boot takes a few minutes
# here (the guest runs in KVM's instruction emulator on this PVM host): about 20 min in all.
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/linux/lib.sh

configs="" extra=() docs=1 name=guest-fio perf=0
while [ $# -gt 0 ]; do
	case $1 in
	--configs) configs=$2; shift 2 ;;
	--configs=*) configs=${1#--configs=}; shift ;;
	--allow-missing-counters) extra+=(--allow-missing-counters); shift ;;
	--repeat) extra+=(--repeat "$2"); shift 2 ;;
	--perf) extra+=(--perf); perf=1; shift ;;
	--perf-guest) extra+=(--perf-guest); perf=1; shift ;;
	--repeat=*) extra+=(--repeat "${1#--repeat=}"); shift ;;
	--no-docs) docs=0; shift ;;
	--cpus | --cpu-model | --qemu-cpu | --qemu-append) extra+=("$1" "$2"); shift 2 ;;
	--cpus=* | --cpu-model=* | --qemu-cpu=* | --qemu-append=*) extra+=("$1"); shift ;;
	--name) name=$2; docs=0; shift 2 ;;
	--name=*) name=${1#--name=}; docs=0; shift ;;
	-h | --help) sed -n '2,38p' "$0"; exit 0 ;;
	*) die "unknown argument $1 (see --help)" ;;
	esac
done

scripts/setup.sh >&2
ensure_pkgs python3 qemu-system-x86
[ "$perf" = 0 ] || ensure_pkgs linux-perf
out=$(scripts/build-guest-kernel.sh) || die "guest kernel build failed"
vmlinux=$(sed -n 's/^VMLINUX=//p' <<<"$out" | tail -n 1)
bzimage=$(sed -n 's/^BZIMAGE=//p' <<<"$out" | tail -n 1)
[ -f "$vmlinux" ] && [ -f "$bzimage" ] || die "scripts/build-guest-kernel.sh printed no VMLINUX=/BZIMAGE= files"
initramfs=$(tests/linux/make-initramfs.sh | tail -n 1)
[ -f "$initramfs" ] || die "tests/linux/make-initramfs.sh printed no archive"
log "building lendvm, lenderd, lendctl (release)"
nice cargo build --release --workspace --bins --locked >&2

args=(--vmlinux "$vmlinux" --bzimage "$bzimage" --initramfs "$initramfs"
	--bin-dir target/release --out "target/bench/$name.json" --svg "target/bench/$name.svg"
	--log-dir "target/bench/$name-logs")
[ -z "$configs" ] || args+=(--configs "$configs")
[ "$docs" = 0 ] || args+=(--markdown docs/BENCHMARKS.md --svg-rel bench-guest.svg)
mkdir -p target/bench
rc=0
python3 tests/linux/bench_guest.py "${args[@]}" ${extra[@]+"${extra[@]}"} || rc=$?
[ "$docs" = 0 ] || [ ! -f "target/bench/$name.svg" ] || cp "target/bench/$name.svg" docs/bench-guest.svg
if [ "$rc" != 0 ]; then
	echo "bench-guest: FAILED (see the lines above and target/bench/guest-fio-logs/)" >&2
	exit 1
fi
