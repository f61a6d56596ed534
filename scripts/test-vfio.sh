#!/usr/bin/env bash
# Real VFIO in a nested QEMU guest ("L1", docs/VFIO.md): L1 runs Linux 6.1 with QEMU's
# intel-iommu (interrupt remapping), vfio-pci owns QEMU's NVMe and an e1000e, and an
# ivshmem-plain BAR backed by a file in a private directory under /dev/shm is the NTB
# window between L1 and this machine.
#
#   scripts/test-vfio.sh          the cases below (CI)
#   scripts/test-vfio.sh --bench OUTDIR   the benchmark of L1's control paths
#                                 (scripts/bench-l1.sh): tests/tests/vfio.rs
#                                 bench_l1_control_paths, JSON into OUTDIR
#   scripts/test-vfio.sh --demo   the README's `scripts/demo.sh --vfio`: L1 lends its NVMe,
#                                 a Linux guest of lendvm runs fio's verify job on it; shows
#                                 the lender's view (vfio-pci, the IOMMU group, the lease)
#                                 beside fio's figures
#
# One L1 boot serves the cases in a row:
#   vfio_kernel  lending/tests/vfio_kernel.rs run inside L1 against the NVMe (container,
#                group, regions, mmap, config gate, IOVA ranges + MSI window refused, DMA
#                and MSI-X through an admin Identify into the ivshmem BAR, drain, reset),
#                the SR-IOV VF, and the e1000e (a borrower that kept every fd after its
#                lease gets nothing of the next borrower's registers);
#                then this script reads the Identify data the NVMe wrote by DMA from the
#                ivshmem backing file, out here
#   lenderd      L1's lenderd lends the vfio-pci functions over the bar fabric (control on
#                tcp+TLS through QEMU's hostfwd on 127.0.0.1 only, DMA windows in the ivshmem
#                region); `lendctl list` from out here sees them
#   tests/tests/vfio.rs (--ignored): a Linux guest of lendvm out here, its RAM inside the
#                ivshmem file, uses what L1 lends with stock drivers (fio verify on the
#                NVMe with a replug and an FLR; the e1000e pings the NIC that stays in L1; a
#                16 GiB BAR placed past 4 GiB and written at its ends through sysfs)
# Builds (or takes from the content-hashed caches) the guest kernel, which also serves as
# L1's (scripts/build-guest-kernel.sh), the guest's initramfs (tests/linux/make-initramfs.sh)
# and L1's (tests/vfio/make-l1-initramfs.sh). LENDVM_VFIO_ONLY_L1=1 stops after the
# two L1 cases.
# Everything it creates is in private temporary directories (mode 0700), removed at
# exit; QEMU is killed at exit, on failure too. At most one VM runs.
#
# Under CI (CI set) a missing prerequisite (qemu-system-x86_64, /dev/kvm) fails; locally
# the script says what is missing and exits 0 without running anything.
# LENDVM_VFIO_ONLY="<test> ..." runs just those of tests/tests/vfio.rs after the L1 cases.
# Timeouts (seconds; L1 boots in about 2 s under TCG, the default, and in 3-7 min under
# LENDVM_VFIO_L1_ACCEL=kvm, this host's instruction emulator):
# LENDVM_VFIO_BOOT_TIMEOUT (900),
# LENDVM_VFIO_TEST_TIMEOUT (600).
set -euo pipefail
# Niceness of the long runs: none under CI, where a stand-in CPU load at nice 0 must not
# starve them; 10 on a developer's machine. LENDVM_NICE overrides.
NICE=${LENDVM_NICE:-$([ -n "${CI:-}" ] && echo 0 || echo 10)}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO/tests/linux/lib.sh"
QEMU=${QEMU:-qemu-system-x86_64}
BOOT_TIMEOUT=${LENDVM_VFIO_BOOT_TIMEOUT:-900}
TEST_TIMEOUT=${LENDVM_VFIO_TEST_TIMEOUT:-600}
# Each later step of L1 (binding, lenderd start): every fork costs ~0.4 s in its emulated kernel.
STEP_TIMEOUT=${LENDVM_VFIO_STEP_TIMEOUT:-600}
WINDOW_MIB=256 # two 64 MiB guests (a migration's source and destination) and the links' control
# rings at its end (ntb::ring); a power of two (QEMU 7.2 asserts on others); L1 maps only what
# a lease uses (~4 ms per 4 KiB page there)
# Where the borrowers' control messages go: "ring" (default: rings in the window, TCP only
# for wake-ups) or "tcp" (all through QEMU's user network into L1's TCP stack), to compare.
CONTROL_PATH=${LENDVM_VFIO_CONTROL_PATH:-ring}
# How QEMU runs L1: "tcg" (default: QEMU's JIT; L1's kernel boots in about 2 s and runs its
# lenderd and VFIO at roughly a hundred times the speed of "kvm") or "kvm" (this host's
# /dev/kvm is PVM: a non-PVM guest runs in KVM's instruction emulator, ~1.5 M instructions/s,
# where L1 booted in 170-430 s and a lease's 64 MiB DMA map took 23-50 s: docs/VFIO.md).
# L1 is a device host, not a VM under test: what the cases check (vfio-pci, the IOMMU, the
# lender) is the same kernel code under either accelerator.
L1_ACCEL=${LENDVM_VFIO_L1_ACCEL:-tcg}
case $L1_ACCEL in
tcg) L1_MACHINE="q35,accel=tcg" REF_BOOT_MS=2000 ;;
kvm) L1_MACHINE="q35,accel=kvm,kernel-irqchip=split" REF_BOOT_MS=200000 ;;
*) die "LENDVM_VFIO_L1_ACCEL=$L1_ACCEL: expected tcg or kvm" ;;
esac
# L1's speed, which is this machine's: its boot's wall time (QEMU's start to init's first
# line) against REF_BOOT_MS, measured on an idle machine of this kind. The cases' deadlines
# scale with the ratio, within [1, SLOW_MAX].
SLOW_MAX=4

demo=0 bench="" prepare=""
case "${1:-}" in
--demo) demo=1 ;;
--bench)
	bench=${2:?usage: scripts/test-vfio.sh --bench OUTDIR}
	mkdir -p "$bench"
	bench=$(cd "$bench" && pwd) ;;
--prepare) prepare=${2:?usage: scripts/test-vfio.sh --prepare ENVFILE} ;;
"") ;;
*) echo "usage: scripts/test-vfio.sh [--demo | --bench OUTDIR | --prepare ENVFILE]" >&2; exit 2 ;;
esac
# Which build of lenderd L1 runs: the workspace's debug build, which CI's `build` stage has
# already made. A release build would compile every dependency of lenderd a second time
# (4 min on an idle 2-core machine, 15 beside a CPU load, on CI's critical path) and buys the
# cases nothing: docs/BENCHMARKS.md, section l1, measured the same fio job in L1 at 18.7 s with
# a debug lenderd and 17.8-19.9 s with a release one (the guest's emulated kernel is the
# cost, not lenderd). LENDVM_L1_LENDERD_PROFILE=release for scripts/bench-l1.sh's comparison.
export LENDVM_L1_LENDERD_PROFILE=${LENDVM_L1_LENDERD_PROFILE:-debug}

missing=()
command -v "$QEMU" >/dev/null || missing+=("$QEMU (apt-get install qemu-system-x86)")
[ -c /dev/kvm ] && [ -w /dev/kvm ] || missing+=("/dev/kvm (read-write)")
[ -d /dev/shm ] && [ -w /dev/shm ] || missing+=("/dev/shm (writable)")
if [ ${#missing[@]} -gt 0 ]; then
	if [ -n "${CI:-}" ]; then
		die "test-vfio: missing under CI: ${missing[*]}"
	fi
	echo "test-vfio: not run, missing: ${missing[*]}" >&2
	exit 0
fi

# --- builds: the kernel, both initramfs archives, the binaries --------------------
# All of them before L1 starts: `--prepare ENVFILE` does just this and writes the paths to
# ENVFILE; a run with LENDVM_VFIO_PREBUILT=1 and those variables set builds nothing and runs
# no cargo (CI runs it beside stages that build: scripts/test.sh).
ensure_kernel # BZIMAGE (taken as is when set)
if [ "${LENDVM_VFIO_PREBUILT:-0}" = 1 ]; then
	INITRD=${LENDVM_VFIO_L1_INITRD:?LENDVM_VFIO_PREBUILT=1 needs LENDVM_VFIO_L1_INITRD}
	GUEST_INITRAMFS=${LENDVM_VFIO_GUEST_INITRAMFS:?LENDVM_VFIO_PREBUILT=1 needs LENDVM_VFIO_GUEST_INITRAMFS}
	GUEST_INITRAMFS_SMALL=${LENDVM_VFIO_GUEST_INITRAMFS_SMALL:?LENDVM_VFIO_PREBUILT=1 needs LENDVM_VFIO_GUEST_INITRAMFS_SMALL}
else
	INITRD=$("$REPO/tests/vfio/make-l1-initramfs.sh" | tail -n1)
	GUEST_INITRAMFS=$("$REPO/tests/linux/make-initramfs.sh" | tail -n1)
	# Without fio, for the cases' guests that run no fio job.
	GUEST_INITRAMFS_SMALL=$("$REPO/tests/linux/make-initramfs.sh" --small | tail -n1)
	# lendctl, to ask L1's lenderd from out here; lendvm and the cases.
	# (--workspace, not -p: the workspace's feature resolution, so nothing the other stages
	# built is compiled again)
	cargo build --locked -q --workspace --bin lendctl --bin lendvm \
		--bin lendvm-fio-summary >&2 || die "building lendctl and lendvm failed"
	cargo test --locked -q --workspace --test vfio --no-run >&2 \
		|| die "building tests/tests/vfio.rs failed"
fi
[ -f "$INITRD" ] || die "make-l1-initramfs.sh printed no archive"
[ -f "$GUEST_INITRAMFS" ] || die "make-initramfs.sh printed no archive"
[ -f "$GUEST_INITRAMFS_SMALL" ] || die "make-initramfs.sh --small printed no archive"
if [ -n "$prepare" ]; then
	# Copies of what the run uses from out here (the cases' executable, lendvm, lendctl,
	# lendvm-fio-summary) in target/vfio-run/: the run needs no cargo, and cargo may build
	# meanwhile (CI runs other stages beside it) without replacing a binary under a case.
	# The cases look for lendvm one directory up from their own executable.
	target=${CARGO_TARGET_DIR:-$REPO/target}
	exe=$("$REPO/scripts/test-exe.sh" vfio) || die "building tests/tests/vfio.rs failed"
	snap=$target/vfio-run
	rm -rf "$snap"
	mkdir -p "$snap/deps"
	cp "$exe" "$snap/deps/vfio"
	cp "$target/debug/lendvm" "$target/debug/lendctl" "$target/debug/lendvm-fio-summary" "$snap/"
	printf '%s=%q\n' BZIMAGE "$BZIMAGE" VMLINUX "${VMLINUX:-}" \
		LENDVM_VFIO_L1_INITRD "$INITRD" LENDVM_VFIO_GUEST_INITRAMFS "$GUEST_INITRAMFS" \
		LENDVM_VFIO_GUEST_INITRAMFS_SMALL "$GUEST_INITRAMFS_SMALL" \
		LENDVM_VFIO_TEST_EXE "$snap/deps/vfio" LENDVM_VFIO_BIN "$snap" >"$prepare"
	log "test-vfio: prepared (kernel, L1's and the guests' initramfs, binaries in $snap): $prepare"
	exit 0
fi
# Where lendctl, lendvm and lendvm-fio-summary are: the prepared copies, or cargo's.
BIN=${LENDVM_VFIO_BIN:-${CARGO_TARGET_DIR:-$REPO/target}/debug}
# The lendvm guests boot the uncompressed vmlinux beside it (lendvm loads the ELF: no
# decompressor, about 20 s less emulated time per boot); L1 (QEMU, no PVH entry in this
# kernel) boots the bzImage.
GUEST_KERNEL=${VMLINUX:-$(dirname "$BZIMAGE")/vmlinux}
[ -f "$GUEST_KERNEL" ] || GUEST_KERNEL=$BZIMAGE
log "kernel $BZIMAGE (lendvm guests: $GUEST_KERNEL), initramfs $INITRD"
LENDCTL=$BIN/lendctl
[ -x "$LENDCTL" ] || die "no lendctl at $LENDCTL"

# --- private run directory, shared window, token ---------------------------------
umask 077
RUN=$(mktemp -d "${TMPDIR:-/tmp}/lendvm-vfio.XXXXXX")
SHMDIR=$(mktemp -d /dev/shm/lendvm-vfio.XXXXXX)
QPID=""
cleanup() {
	local rc=$?
	if [ -n "$QPID" ] && kill -0 "$QPID" 2>/dev/null; then
		kill "$QPID" 2>/dev/null || true
		for _ in $(seq 50); do kill -0 "$QPID" 2>/dev/null || break; sleep 0.1; done
		kill -9 "$QPID" 2>/dev/null || true
	fi
	if [ "$rc" != 0 ] && [ -f "$RUN/serial.log" ]; then
		echo "test-vfio: last lines of L1's console:" >&2
		tail -n 60 "$RUN/serial.log" >&2
		# The tests run on several threads, so a panic's message is often further up
		# than the tail: show every one, and keep the whole console.
		if grep -q "panicked at" "$RUN/serial.log"; then
			echo "test-vfio: the panics in L1's console:" >&2
			grep -A 12 "panicked at" "$RUN/serial.log" >&2
		fi
		mkdir -p "$REPO/target" && cp "$RUN/serial.log" "$REPO/target/vfio-l1-console.log" \
			&& echo "test-vfio: L1's whole console: $REPO/target/vfio-l1-console.log" >&2
	fi
	rm -rf "$RUN" "$SHMDIR"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
WINDOW=$SHMDIR/window
truncate -s "${WINDOW_MIB}M" "$WINDOW"

# A loopback port for the hostfwd to L1's lenderd.
# (bash's /dev/tcp: the first port from a random start that nothing answers on).
PORT=$((20000 + RANDOM % 20000))
while (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; do PORT=$((PORT + 1)); done
od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$RUN/token"
# L1's view (it listens on its user-net address; the region is the ivshmem BAR) and ours
# (the forwarded loopback port; the region is the file behind the BAR).
SHM_BDF=0000:01:00.0
cluster() {
	cat <<-EOF
	version = 1
	token_file = "token"

	# L1 has one emulated vCPU, and a lease's MAP_DMA or UNMAP_DMA of the guest's window
	# holds it for up to a minute (type1 walks the BAR's VM_PFNMAP mapping page by page):
	# lenderd answers nothing else meanwhile (a new borrower's handshake waits behind the
	# last one's teardown), and its heartbeats come late.
	[link]
	heartbeat_ms = 1000
	peer_timeout_ms = 30000
	connect_timeout_ms = 300000
	request_timeout_ms = 600000

	[[node]]
	name = "l1"
	fabric = "bar"
	control = "$1"
	$2
	EOF
}
mkdir -p "$RUN/l1/etc/lendvm"
cluster "10.0.2.15:7700" "region_device = \"$SHM_BDF\"" >"$RUN/l1/etc/lendvm/cluster.toml"
cp "$RUN/token" "$RUN/l1/etc/lendvm/token"
chmod 700 "$RUN/l1/etc/lendvm"
chmod 600 "$RUN/l1/etc/lendvm/"*
cluster "127.0.0.1:$PORT" "region = \"$WINDOW\"
	control_path = \"$CONTROL_PATH\"" >"$RUN/cluster.toml"
# The initramfs plus a second archive with the cluster file and token (mode 0600 inside;
# the concatenation is 0600 in the 0700 run directory).
(cd "$RUN/l1" && find etc | LC_ALL=C sort | cpio -o -H newc --quiet -R 0:0) >"$RUN/secrets.cpio"
cat "$INITRD" "$RUN/secrets.cpio" >"$RUN/initrd.cpio"
rm -f "$RUN/secrets.cpio"

# --- L1 -------------------------------------------------------------------------
# Fixed slots make the bus numbers fixed: root ports 00:02.0-00:04.0 get buses 1-3.
NVME_BDF=0000:02:00.0
NIC_BDF=0000:03:00.0
# A second ivshmem-plain function, lent like the others: its BAR 2 (1 MiB of a file out
# here) is memory a peer-to-peer DMA of the NVMe lands in.
PEER_BDF=0000:04:00.0
PEER=$SHMDIR/peer
truncate -s 1M "$PEER"
# A GPU-sized aperture: a third ivshmem-plain function whose BAR 2 is 16 GiB of a sparse file
# out here (a 64-bit prefetchable BAR past 4 GiB, as an H100's BAR1; docs/GPU.md). Nothing
# reads or writes it but the case that pokes a few words, so it stays a few pages on disk.
BIG_BDF=0000:06:00.0
BIG=$SHMDIR/big
BIG_GIB=16
truncate -s "${BIG_GIB}G" "$BIG"
truncate -s 64M "$RUN/nvme.img"
# QEMU's NVMe with SR-IOV (an nvme-subsys, one VF): L1's nvme driver keeps the PF and gives
# the VF its queues (lendvm-nvme-sriov, as nvme-cli's virt-mgmt); the VF is lent. The
# namespace (shared in the subsystem) is the VF's disk too.
NVME_SERIAL=deadbeef SRIOV_SERIAL=5r10v # the VF has its PF's serial
SRIOV_PF=0000:05:00.0
SRIOV_VF=0000:05:00.1
truncate -s 64M "$RUN/nvme-sriov.img"
CMDLINE="$LENDVM_BASE_CMDLINE $QEMU_CPU_CMDLINE rdinit=/init lendvm_syscall_fixup intel_iommu=on iommu=pt"
# ttyS1 is L1's command port (kill-lenderd, start-lenderd: tests/vfio/initramfs/init).
CMDLINE+=" 8250.nr_uarts=2"
CTL_MAC=52:54:00:00:00:10 NIC_MAC=52:54:00:00:01:01 PEER_MAC=52:54:00:00:01:02
NIC_ADDR=169.254.10.1/16 PEER_ADDR=169.254.10.2
CMDLINE+=" lendvm_ctl=$CTL_MAC,10.0.2.15/24,10.0.2.2 lendvm_peer=$PEER_MAC,$PEER_ADDR/16"
CMDLINE+=" lendvm_vfio=$NVME_BDF,$NIC_BDF,$PEER_BDF,$SRIOV_VF,$BIG_BDF lendvm_shm=$SHM_BDF lendvm_lenderd=1"
CMDLINE+=" lendvm_sriov=$SRIOV_PF,$SRIOV_VF"
[ "$demo" = 1 ] || CMDLINE+=" lendvm_test=kernel"
T_L1=$SECONDS T_L1_MS=$(date +%s%3N)
nice -n "$NICE" "$QEMU" -nodefaults -display none -no-reboot \
	-machine "$L1_MACHINE" -cpu "$QEMU_CPU" -m 384M -smp 1 \
	-device intel-iommu,intremap=on \
	-object "memory-backend-file,id=shm0,share=on,mem-path=$WINDOW,size=${WINDOW_MIB}M" \
	-device pcie-root-port,id=rp1,chassis=1,slot=1,bus=pcie.0,addr=0x2 \
	-device ivshmem-plain,memdev=shm0,bus=rp1 \
	-device pcie-root-port,id=rp2,chassis=2,slot=2,bus=pcie.0,addr=0x3 \
	-drive "id=nvm,if=none,file=$RUN/nvme.img,format=raw" \
	-device nvme,serial=$NVME_SERIAL,drive=nvm,bus=rp2 \
	-device pcie-root-port,id=rp3,chassis=3,slot=3,bus=pcie.0,addr=0x4 \
	-object "memory-backend-file,id=peer0,share=on,mem-path=$PEER,size=1M" \
	-device pcie-root-port,id=rp4,chassis=4,slot=4,bus=pcie.0,addr=0x7 \
	-device ivshmem-plain,memdev=peer0,bus=rp4 \
	-device pcie-root-port,id=rp5,chassis=5,slot=5,bus=pcie.0,addr=0x8 \
	-device nvme-subsys,id=nvs0,nqn=lendvm-sriov \
	-drive "id=nvm2,if=none,file=$RUN/nvme-sriov.img,format=raw" \
	-device nvme,id=nvme-sriov,serial=$SRIOV_SERIAL,subsys=nvs0,bus=rp5,sriov_max_vfs=1,sriov_vq_flexible=2,sriov_vi_flexible=1 \
	-device nvme-ns,drive=nvm2,bus=nvme-sriov,nsid=1 \
	-device pcie-root-port,id=rp6,chassis=6,slot=6,bus=pcie.0,addr=0x9 \
	-object "memory-backend-file,id=big0,share=on,mem-path=$BIG,size=${BIG_GIB}G" \
	-device ivshmem-plain,memdev=big0,bus=rp6 \
	-netdev hubport,id=hp1,hubid=0 -device "e1000e,netdev=hp1,bus=rp3,mac=$NIC_MAC" \
	-netdev hubport,id=hp2,hubid=0 -device "e1000e,netdev=hp2,bus=pcie.0,addr=0x5,mac=$PEER_MAC" \
	-netdev "user,id=n0,net=10.0.2.0/24,restrict=on,hostfwd=tcp:127.0.0.1:$PORT-10.0.2.15:7700" \
	-device "virtio-net-pci,netdev=n0,bus=pcie.0,addr=0x6,mac=$CTL_MAC" \
	-kernel "$BZIMAGE" -initrd "$RUN/initrd.cpio" -append "$CMDLINE" \
	-serial "file:$RUN/serial.log" \
	-chardev "socket,id=l1cmd,path=$RUN/l1-cmd.sock,server=on,wait=off" -serial chardev:l1cmd \
	>"$RUN/qemu.log" 2>&1 &
QPID=$!
# Out of bash's job table: the L1-death case kills QEMU on purpose, and bash would print a
# "Killed" notice with QEMU's whole command line into the log.
disown "$QPID"
log "L1 started (qemu pid $QPID), window $WINDOW, lenderd at 127.0.0.1:$PORT"

# wait_for PATTERN TIMEOUT WHAT: the console shows PATTERN within TIMEOUT seconds.
wait_for() {
	local pat=$1 timeout=$2 what=$3 t0=$SECONDS
	while ! grep -q -- "$pat" "$RUN/serial.log" 2>/dev/null; do
		kill -0 "$QPID" 2>/dev/null || { cat "$RUN/qemu.log" >&2; die "L1 exited before $what"; }
		grep -q "L1-STEP .* fail\|Kernel panic" "$RUN/serial.log" 2>/dev/null \
			&& die "L1 failed before $what: $(grep -m1 "L1-STEP .* fail\|Kernel panic" "$RUN/serial.log")"
		[ $((SECONDS - t0)) -lt "$timeout" ] || die "no '$pat' ($what) within ${timeout}s"
		sleep 0.1 # L1 under TCG boots in about 2 s: its boot time calibrates the deadlines
	done
}

wait_for "L1-STEP boot ok" "$BOOT_TIMEOUT" "boot"
BOOT_MS=$(($(date +%s%3N) - T_L1_MS))
# Deadlines of the cases scale with L1's measured speed (hundredths: bash has no floats).
SLOW=$((BOOT_MS * 100 / REF_BOOT_MS))
[ "$SLOW" -ge 100 ] || SLOW=100
[ "$SLOW" -le $((SLOW_MAX * 100)) ] || SLOW=$((SLOW_MAX * 100))
log "L1 ($L1_ACCEL) booted in ${BOOT_MS} ms (reference ${REF_BOOT_MS} ms): deadlines x$((SLOW / 100)).$(printf %02d $((SLOW % 100)))"
wait_for "L1-STEP bind ok $SRIOV_VF" "$STEP_TIMEOUT" "binding to vfio-pci"
grep "L1-STEP\|L1-PCI\|LENDVM-SRIOV" "$RUN/serial.log" >&2

# --- case vfio_kernel -------------------------------------------------------------
if [ "$demo" = 0 ]; then
wait_for "L1-TEST rc=" "$TEST_TIMEOUT" "vfio_kernel"
grep "VFIO-STEP\|VFIO-OBS\|L1-TEST" "$RUN/serial.log" >&2
grep -q "L1-TEST rc=0 " "$RUN/serial.log" && grep -q "VFIO-KERNEL-TEST PASS" "$RUN/serial.log" \
	&& grep -q "VFIO-KERNEL-TEST SRIOV PASS" "$RUN/serial.log" \
	&& grep -q "VFIO-KERNEL-TEST EARLIER-BORROWER PASS" "$RUN/serial.log" \
	|| die "vfio_kernel failed in L1"
# The NVMe's DMA reached the file out here: Identify Controller's model name at byte 24
# of the data (tests/vfio_kernel.rs IDENTIFY_OFFSET = 0x2000).
model=$(dd if="$WINDOW" bs=1 skip=$((0x2000 + 24)) count=14 status=none)
[ "$model" = "QEMU NVMe Ctrl" ] || die "the Identify data is not in the ivshmem file (read '$model')"
log "PASS vfio_kernel (Identify data read from the window file: '$model')"
fi

# --- case lenderd -------------------------------------------------------------------
wait_for "L1-LENDERD started" "$STEP_TIMEOUT" "lenderd start"
wait_for "lenderd l1 listening" "$STEP_TIMEOUT" "lenderd listening"
out=""
for _ in $(seq 30); do
	out=$("$LENDCTL" --cluster "$RUN/cluster.toml" --token-file "$RUN/token" list 2>&1) && break
	sleep 2
done
echo "$out" >&2
for b in "$NVME_BDF" "$NIC_BDF" "$PEER_BDF" "$SRIOV_VF" "$BIG_BDF"; do
	grep -q "$b" <<<"$out" || die "lendctl list does not show $b lent by L1"
done
log "PASS lenderd (L1 lends $NVME_BDF, $NIC_BDF, $PEER_BDF, the VF $SRIOV_VF and the ${BIG_GIB} GiB BAR's $BIG_BDF through vfio-pci; $((SECONDS - T_L1))s since L1's start)"
if [ "${LENDVM_VFIO_ONLY_L1:-0}" = 1 ]; then
	log "test-vfio: L1 cases passed (LENDVM_VFIO_ONLY_L1=1: the lendvm guest cases not run)"
	exit 0
fi

# --- the lendvm guest's cases (tests/tests/vfio.rs) --------------------------------

if [ "$demo" = 1 ]; then
	echo "== the lender: L1 (QEMU 7.2, intel-iommu with interrupt remapping, Linux $(sed -n 's/.*L1-STEP boot ok kernel=\([^ ]*\).*/\1/p' "$RUN/serial.log"))"
	grep "L1-STEP bind ok\|L1-STEP iommu" "$RUN/serial.log" | sed 's/ uptime=.*//; s/^/  L1: /'
	echo "== booting Linux under lendvm out here, its 64 MiB of RAM in the window file, with l1:$NVME_BDF"
	serial=$RUN/guest.log
	cmdline="$LENDVM_BASE_CMDLINE rdinit=/init lendvm_syscall_fixup lendvm_exit_port=0xf4"
	cmdline+=" lendvm_fio=verify@nvme0n1"
	RUST_LOG=info "$BIN/lendvm" --kernel "$GUEST_KERNEL" --initramfs "$GUEST_INITRAMFS" \
		--memory "64M,shared=$WINDOW,offset=0" --cpus 2 --cmdline "$cmdline" \
		--serial "file=$serial" --cluster "$RUN/cluster.toml" --name demo-vfio \
		--remote-device "l1:$NVME_BDF,id=nvme0" --api-socket "$RUN/api.sock" 2>"$RUN/lendvm.log" &
	vmm=$!
	t0=$SECONDS
	until grep -q "LENDVM-FIO run i=1" "$serial" 2>/dev/null; do
		kill -0 "$vmm" 2>/dev/null || { tail -n 30 "$RUN/lendvm.log" >&2; die "lendvm exited"; }
		[ $((SECONDS - t0)) -lt "$TEST_TIMEOUT" ] || die "fio did not start in the guest within ${TEST_TIMEOUT}s"
		sleep 1
	done
	grep -E "nvme nvme0:|nvme0n1:" "$serial" | sed 's/^/  guest: /' || true
	echo "== the lease, as L1's lenderd and lendvm see it"
	"$LENDCTL" --cluster "$RUN/cluster.toml" --token-file "$RUN/token" list | sed 's/^/  lenderd: /'
	"$LENDCTL" --api-socket "$RUN/api.sock" info | sed 's/^/  lendvm: /'
	grep "window .* mapped" "$RUN/serial.log" | sed 's/^/  L1: /' || true
	rc=0
	wait "$vmm" || rc=$?
	echo "== fio's verify job in the guest, on QEMU's NVMe in L1 (fio's JSON, parsed by lendvm-fio-summary)"
	"$BIN/lendvm-fio-summary" "$serial" | sed 's/^/  /' || rc=1
	grep -q "LENDVM-FIO done runs=1 failed=0" "$serial" || rc=1
	[ "$rc" = 0 ] || die "the demo guest failed (lendvm exit $rc; see its log above)"
	log "demo: done"
	exit 0
fi
# run_vfio_tests ARGS...: tests/tests/vfio.rs with what this script set up (its header lists
# the variables).
run_vfio_tests() {
	LENDVM_VFIO_CLUSTER=$RUN/cluster.toml LENDVM_VFIO_LENDER=l1 LENDVM_VFIO_REGION=$WINDOW \
		LENDVM_VFIO_NVME=$NVME_BDF LENDVM_VFIO_DISK=$RUN/nvme.img \
		LENDVM_VFIO_VF=$SRIOV_VF LENDVM_VFIO_VF_DISK=$RUN/nvme-sriov.img \
		LENDVM_VFIO_NVME_SERIAL=$NVME_SERIAL LENDVM_VFIO_VF_SERIAL=$SRIOV_SERIAL \
		LENDVM_VFIO_NIC=$NIC_BDF LENDVM_VFIO_NIC_PEER=$PEER_ADDR LENDVM_VFIO_NIC_ADDR=$NIC_ADDR \
		LENDVM_VFIO_L1_CMD=$RUN/l1-cmd.sock LENDVM_VFIO_L1_CONSOLE=$RUN/serial.log \
		LENDVM_VFIO_L1_PID=$QPID LENDVM_VFIO_PEER=$PEER_BDF LENDVM_VFIO_PEER_FILE=$PEER \
		LENDVM_VFIO_BIG=$BIG_BDF LENDVM_VFIO_BIG_FILE=$BIG \
		LENDVM_LINUX_KERNEL=$GUEST_KERNEL LENDVM_LINUX_INITRAMFS=$GUEST_INITRAMFS \
		LENDVM_LINUX_INITRAMFS_SMALL=$GUEST_INITRAMFS_SMALL LENDVM_TOKEN="$(cat "$RUN/token")" \
		LENDVM_VFIO_SLOWNESS=$SLOW LENDVM_VFIO_CONTROL_PATH=$CONTROL_PATH \
		LENDVM_VFIO_ALL_DEVICES="$NVME_BDF $NIC_BDF $PEER_BDF $SRIOV_VF $BIG_BDF" \
		nice -n "$NICE" "${VFIO_TESTS[@]}" --ignored --test-threads=1 --nocapture "$@"
}
# The cases: the prepared executable (no cargo), or through cargo.
if [ -n "${LENDVM_VFIO_TEST_EXE:-}" ]; then
	[ -x "$LENDVM_VFIO_TEST_EXE" ] || die "LENDVM_VFIO_TEST_EXE=$LENDVM_VFIO_TEST_EXE is not an executable"
	VFIO_TESTS=("$LENDVM_VFIO_TEST_EXE")
else
	VFIO_TESTS=(cargo test --locked -p lendvm-tests --test vfio --)
fi
L1_DEATH_CASE=vfio_l1_dying_mid_lease_leaves_the_vm_running
if [ -n "$bench" ]; then
	LENDVM_VFIO_BENCH_OUT=$bench run_vfio_tests --exact bench_l1_control_paths \
		|| die "bench_l1_control_paths failed"
	log "test-vfio: bench done (lenderd $LENDVM_L1_LENDERD_PROFILE), JSON in $bench"
	exit 0
fi
if [ -n "${LENDVM_VFIO_ONLY:-}" ]; then
	# Just these cases (space-separated test names; the L1-death case, if named, last).
	for c in $LENDVM_VFIO_ONLY; do
		[ "$c" = "$L1_DEATH_CASE" ] && continue
		run_vfio_tests --exact "$c" || die "tests/tests/vfio.rs $c failed"
	done
	if [[ " $LENDVM_VFIO_ONLY " == *" $L1_DEATH_CASE "* ]]; then
		run_vfio_tests --exact "$L1_DEATH_CASE" || die "tests/tests/vfio.rs $L1_DEATH_CASE failed"
		QPID=""
	fi
	log "test-vfio: $LENDVM_VFIO_ONLY passed"
	exit 0
fi
# One process per case (the prepared executable, or cargo), timed: a failed case is
# reported and the next still runs
# (each case waits until L1's lenderd shows its devices free before it borrows, so a
# failure does not leave the next one a busy device).
CASES=$(run_vfio_tests --list 2>/dev/null | sed -n 's/: test$//p')
[ -n "$CASES" ] || die "tests/tests/vfio.rs lists no cases"
failed=() times=()
run_case() {
	local c=$1 t0=$SECONDS rc=0
	log "case $c"
	run_vfio_tests --exact "$c" || rc=$?
	times+=("$(printf '%5ss  %s  %s' $((SECONDS - t0)) "$([ $rc = 0 ] && echo pass || echo FAIL)" "$c")")
	[ $rc = 0 ] || failed+=("$c")
}
for c in $CASES; do
	case $c in
	"$L1_DEATH_CASE" | bench_*) ;; # the L1 death last; benchmarks only with --bench
	*) run_case "$c" ;;
	esac
done
# Last, as it ends L1: QEMU is killed under a lease.
run_case "$L1_DEATH_CASE"
QPID=""
log "test-vfio: the cases' times (L1 ($L1_ACCEL) booted in ${BOOT_MS} ms, deadlines x$((SLOW / 100)).$(printf %02d $((SLOW % 100))), control path $CONTROL_PATH):"
printf '  %s\n' "${times[@]}" >&2
[ ${#failed[@]} = 0 ] || die "tests/tests/vfio.rs: ${#failed[@]} cases failed: ${failed[*]}"
log "test-vfio: all cases passed in $((SECONDS - T_L1))s since L1's start"
