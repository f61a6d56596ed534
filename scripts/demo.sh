#!/usr/bin/env bash
# The main job: a local demo cluster on the embedded defaults.
#
#   scripts/demo.sh            a real Linux guest runs fio on two lent NVMe disks
#   scripts/demo.sh --quick    the bare-metal test guest instead (a few seconds once built)
#   scripts/demo.sh --vfio     a real device through the real kernel: a QEMU guest ("L1")
#                              with an emulated intel-iommu lends QEMU's NVMe, owned by
#                              vfio-pci there, over the bar fabric; a Linux guest of lendvm
#                              runs fio's verify job on it (scripts/test-vfio.sh --demo,
#                              docs/VFIO.md; about 90 s here, most of it the Linux
#                              guest's boot; L1 runs under QEMU's TCG)
#
# Two lenders (node1, node2) on the shm fabric each lend an emulated NVMe disk backed by a
# small sparse image file. A VM boots with node1's disk attached at launch; node2's disk is
# hot-added through the REST API while the guest runs.
#
# Default: the guest is Linux (scripts/build-guest-kernel.sh; the first run builds the kernel
# once, about 7 minutes on 2 cores, then it is cached) with the initramfs of
# tests/linux/make-initramfs.sh (busybox and a static fio, ~2 min the first time). The stock
# nvme driver binds the lent disk, the initramfs runs fio's verify job (4 KiB random writes,
# each block read back and checked with crc32c) on /dev/nvme0n1, then on the hot-added
# /dev/nvme1n1, prints fio's JSON, and powers off; the demo shows fio's figures per disk.
# This host runs the guest in KVM's instruction emulator (PVM), so the boot takes a minute
# or two and the I/O rates are those of an emulated CPU.
#
# --quick: the bare-metal test guest drives node1's disk with its own NVMe driver, node2's
# disk is hot-added, used by the guest, removed (the guest ejects it) and the VM is shut down.
#
# Everything lives in a temporary state directory that is removed at the end, also on Ctrl-C.
# Set LENDVM_DEMO_KEEP=1 to keep it (logs, images) for a look afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

quick=0
case "${1:-}" in
  --quick) quick=1 ;;
  --vfio) scripts/setup.sh && exec scripts/test-vfio.sh --demo ;;
  "") ;;
  *) echo "usage: scripts/demo.sh [--quick | --vfio]" >&2; exit 2 ;;
esac

scripts/setup.sh
echo "== building lendvm, lenderd, lendctl and the test guest"
cargo build --quiet --workspace --bins
bin="$root/target/debug"
if [ "$quick" = 1 ]; then
  guest=$(cargo run --quiet -p lendvm-tests --bin lendvm-test-guest-path)
else
  echo "== the Linux guest kernel (scripts/build-guest-kernel.sh; cached after the first run," \
    "which builds it once: about 7 minutes on 2 cores)"
  kout=$(scripts/build-guest-kernel.sh)
  vmlinux=$(printf '%s\n' "$kout" | sed -n 's/^VMLINUX=//p' | tail -n 1)
  [ -f "$vmlinux" ] || { echo "demo: scripts/build-guest-kernel.sh printed no VMLINUX=" >&2; exit 1; }
  echo "== the initramfs with busybox and fio (tests/linux/make-initramfs.sh; cached)"
  initramfs=$(tests/linux/make-initramfs.sh | tail -n 1)
  [ -f "$initramfs" ] || { echo "demo: tests/linux/make-initramfs.sh printed no archive" >&2; exit 1; }
fi

state=$(mktemp -d /tmp/lendvm-demo.XXXXXX)
pids=()
cleanup() {
  local rc=$?
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  if [ "${LENDVM_DEMO_KEEP:-0}" = 1 ]; then
    echo "state kept in $state"
  else
    rm -rf "$state"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'echo; echo "interrupted: cleaning up"; exit 130' INT TERM

# Polls until FILE has COUNT lines matching PATTERN; bounded by SECONDS.
wait_for() {
  local file=$1 pattern=$2 count=$3 seconds=$4 what=$5
  local deadline=$((SECONDS + seconds)) n
  while :; do
    n=$(grep -c -- "$pattern" "$file" 2>/dev/null) || n=${n:-0}
    [ "${n:-0}" -lt "$count" ] || break
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "demo: timed out after ${seconds}s waiting for $what (see $file)" >&2
      tail -n 20 "$file" >&2 || true
      exit 1
    fi
    sleep 0.1
  done
}

# Embedded defaults: the cluster file, token and disks.
umask 077
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$state/cluster.token"
cat >"$state/cluster.toml" <<EOF
version = 1
token_file = "cluster.token"

[link]
heartbeat_ms = 250
peer_timeout_ms = 1500

[[node]]
name = "node1"
fabric = "shm"
control = "$state/node1.sock"

[[node]]
name = "node2"
fabric = "shm"
control = "$state/node2.sock"
EOF
truncate -s 64M "$state/disk1.img" "$state/disk2.img"

# A loopback port nothing listens on, from $1 up (for the lenders' --metrics).
free_port() {
  local p=$1
  while (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; do p=$((p + 1)); done
  echo "$p"
}
metrics1=127.0.0.1:$(free_port 9464)
metrics2=127.0.0.1:$(free_port $((${metrics1##*:} + 1)))

echo "== starting lenderd on node1 and node2 (emulated NVMe, 64 MiB sparse images)"
RUST_LOG=${RUST_LOG:-info} "$bin/lenderd" --node node1 --cluster "$state/cluster.toml" \
  --device "0000:01:00.0=nvme:path=$state/disk1.img,size=64M" --metrics "$metrics1" \
  2>"$state/node1.log" &
pids+=($!)
RUST_LOG=${RUST_LOG:-info} "$bin/lenderd" --node node2 --cluster "$state/cluster.toml" \
  --device "0000:02:00.0=nvme:path=$state/disk2.img,size=64M" --metrics "$metrics2" \
  2>"$state/node2.log" &
pids+=($!)
echo "   Prometheus metrics: node1 at http://$metrics1/metrics, node2 at http://$metrics2/metrics"
echo "   (scrape_configs: - job_name: lenderd; static_configs: [{targets: ['$metrics1', '$metrics2']}])"
for n in node1 node2; do
  deadline=$((SECONDS + 20))
  until [ -S "$state/$n.sock" ]; do
    [ "$SECONDS" -lt "$deadline" ] || { echo "demo: $n did not start" >&2; cat "$state/$n.log" >&2; exit 1; }
    sleep 0.1
  done
done
ctl=("$bin/lendctl" --cluster "$state/cluster.toml")
"${ctl[@]}" list

quick_demo() {
  echo "== booting the test guest with node1:0000:01:00.0 attached at launch"
  api="$state/api.sock"
  serial="$state/serial.log"
  start=$SECONDS
  RUST_LOG=${RUST_LOG:-info} "$bin/lendvm" --kernel "$guest" --memory 256M --cpus 1 \
    --cmdline "tests=nvme,hotplug rounds=2 seed=0x44454d4f" \
    --serial "file=$serial" --cluster "$state/cluster.toml" --name demo-vm \
    --remote-device node1:0000:01:00.0,id=nvme0 --api-socket "$api" 2>"$state/lendvm.log" &
  vmm=$!
  pids+=("$vmm")
  wait_for "$serial" "^TEST nvme-msix" 1 180 "the guest's NVMe test on nvme0"
  grep -E '^TEST nvme' "$serial" | sed 's/^/  guest: /'
  api_ctl=("$bin/lendctl" --api-socket "$api")
  "${api_ctl[@]}" info

  echo "== hot-adding node2:0000:02:00.0 as nvme1 through the REST API"
  "${api_ctl[@]}" add-remote-device node2:0000:02:00.0 --id nvme1
  wait_for "$serial" "^HOTPLUG add" 1 60 "the guest to see the hot-added device"
  wait_for "$serial" "^TEST nvme-msix" 2 180 "the guest's I/O on nvme1"
  grep -E '^(HOTPLUG|TEST nvme)' "$serial" | tail -n 6 | sed 's/^/  guest: /'
  "${api_ctl[@]}" info
  "${ctl[@]}" list

  echo "== removing nvme1 (the guest ejects it)"
  "${api_ctl[@]}" remove-device nvme1
  wait_for "$serial" "^HOTPLUG eject" 1 60 "the guest to eject nvme1"
  "${api_ctl[@]}" info
  "${ctl[@]}" list

  echo "== shutting the VM down"
  "${api_ctl[@]}" shutdown
  rc=0
  wait "$vmm" || rc=$?
  elapsed=$((SECONDS - start))

  echo
  echo "== summary"
  echo "  guest results: $(grep -c ' ok' "$serial" || true) ok, $(grep -c ' fail' "$serial" || true) failed"
  echo "  lendvm exit status: $rc, guest ran ${elapsed}s"
  for d in disk1 disk2; do
    used=$(du -k "$state/$d.img" | cut -f1)
    echo "  $d.img: ${used} KiB written by the guest through the lender (sparse 64 MiB)"
  done
  if grep -q ' fail' "$serial"; then
    echo "demo: the guest reported failures" >&2
    exit 1
  fi
}

linux_demo() {
  echo "== booting Linux with node1:0000:01:00.0 attached at launch"
  local api="$state/api.sock" serial="$state/serial.log" start=$SECONDS rc=0
  # rdinit=/init: the initramfs' runner; lendvm_fio: fio's verify job on each disk in turn (it
  # waits for nvme1n1 to appear); lendvm_syscall_fixup: user space on a PVM host (see
  # docs/linux-guest-on-pvm.md; inert elsewhere); lendvm_exit_port: power-off ends lendvm.
  local cmdline="console=ttyS0 earlyprintk=serial,ttyS0,115200 panic=-1 nokaslr lpj=1000000"
  cmdline+=" rdinit=/init lendvm_syscall_fixup lendvm_exit_port=0xf4"
  cmdline+=" lendvm_fio=verify@nvme0n1,verify@nvme1n1"
  RUST_LOG=${RUST_LOG:-info} "$bin/lendvm" --kernel "$vmlinux" --initramfs "$initramfs" \
    --memory 128M --cpus 2 --cmdline "$cmdline" \
    --serial "file=$serial" --cluster "$state/cluster.toml" --name demo-vm \
    --remote-device node1:0000:01:00.0,id=nvme0 --api-socket "$api" 2>"$state/lendvm.log" &
  vmm=$!
  pids+=("$vmm")
  wait_for "$serial" "nvme nvme0: pci function" 1 600 "Linux to probe the lent disk"
  grep -E "smp: Brought up|nvme nvme0:|nvme0n1:" "$serial" | sed 's/^/  guest: /' || true
  wait_for "$serial" "LENDVM-FIO run i=1" 1 600 "fio to start on /dev/nvme0n1"
  echo "  guest: fio verify on /dev/nvme0n1 (node1's disk) is running"
  local api_ctl=("$bin/lendctl" --api-socket "$api")
  "${api_ctl[@]}" info

  echo "== hot-adding node2:0000:02:00.0 as nvme1 through the REST API"
  "${api_ctl[@]}" add-remote-device node2:0000:02:00.0 --id nvme1
  wait_for "$serial" "nvme nvme1: pci function" 1 300 "Linux to probe the hot-added disk"
  grep -E "nvme nvme1:|nvme1n1:" "$serial" | sed 's/^/  guest: /' || true
  "${api_ctl[@]}" info
  "${ctl[@]}" list
  wait_for "$serial" "LENDVM-FIO done" 1 900 "fio on both disks"
  echo "== the guest's 2 vCPUs: one NVMe I/O queue per CPU, each queue's interrupts on its CPU"
  echo "   (the guest's /proc/interrupts after each fio run: <irq>:<queue>=<CPU0>/<CPU1>)"
  grep -E "LENDVM-CPUS|LENDVM-FIO qirq" "$serial" | sed 's/^/  guest: /' || true
  echo "== fio in the guest (fio's JSON, parsed by lendvm-fio-summary)"
  local summary_rc=0
  "$bin/lendvm-fio-summary" "$serial" | sed 's/^/  /' || summary_rc=$?
  wait "$vmm" || rc=$?
  echo
  echo "== summary"
  echo "  lendvm exit status: $rc (the guest powered off), guest ran $((SECONDS - start))s"
  for d in disk1 disk2; do
    echo "  $d.img: $(du -k "$state/$d.img" | cut -f1) KiB written by fio through the lender (sparse 64 MiB)"
  done
  if [ "$summary_rc" != 0 ] || [ "$rc" != 0 ] || ! grep -q "LENDVM-FIO done runs=2 failed=0" "$serial"; then
    echo "demo: fio in the guest failed (see $serial; LENDVM_DEMO_KEEP=1 keeps it)" >&2
    exit 1
  fi
}

if [ "$quick" = 1 ]; then
  quick_demo
else
  linux_demo
fi
