#!/usr/bin/env bash
# The test command: installs what is missing, checks formatting and lints, builds every
# binary (integration tests run the real lendvm/lenderd processes), runs all tests, then the
# real-Linux end-to-end tests (builds the guest kernel once, cached by content hash).
#
# LENDVM_SKIP_LINUX=1 skips the Linux part (e.g. for a quick local run).
#
# Each stage is timed; the table of durations is printed at the end, on failure too, so that
# every CI log shows where the time went (the budget: docs/DEVELOPING.md).
set -euo pipefail
cd "$(dirname "$0")/.."

# Under CI nothing is niced (LENDVM_NICE=0 for the kernel build, L1 and the guests): a
# stand-in CPU load at nice 0 beside CI must not starve them.
if [ -n "${CI:-}" ]; then export LENDVM_NICE=${LENDVM_NICE:-0}; fi

STAGES=()
T_ALL=$SECONDS
report() {
	local rc=$?
	echo "test: stage durations (seconds):"
	printf '  %s\n' "${STAGES[@]}"
	printf '  %5d  total%s\n' $((SECONDS - T_ALL)) "$([ "$rc" = 0 ] || echo " (failed, rc=$rc)")"
}
trap report EXIT
# stage NAME CMD...: runs CMD, records how long it took.
stage() {
	local name=$1 t0=$SECONDS rc=0
	shift
	"$@" || rc=$?
	STAGES+=("$(printf '%5d  %s' $((SECONDS - t0)) "$name")")
	return "$rc"
}

stage setup scripts/setup.sh
stage fmt cargo fmt --all -- --check
stage clippy cargo clippy --workspace --all-targets --locked -- -D warnings
stage build cargo build --workspace --bins --locked
stage unit+integration cargo test --workspace --locked
# Every benchmark of docs/BENCHMARKS.md at a short budget (dev profile, ~3 min): checks that
# each still runs and writes its section's fragment; no speeds are checked, docs/ is untouched.
stage bench-quick scripts/bench.sh --quick
# The decoders' fuzz properties at CI depth (10^5 cases each crate); the default runs above
# are shorter.
stage fuzz-wire env PROPTEST_CASES=25000 cargo test -p ntb --locked --test wire_fuzz
stage fuzz-protocol env PROPTEST_CASES=100000 cargo test -p lending --locked --lib protocol
# Config-space requests through the lender's gate (conventional filter + extended space).
stage fuzz-config env PROPTEST_CASES=20000 cargo test -p lending --locked --lib backend::config::fuzz
# NVMe submission entries and PRP lists against the emulated controller (each case is real
# I/O through the controller thread and its file: ~30 s at this budget on 2 cores).
stage fuzz-nvme env PROPTEST_CASES=96 cargo test -p emulated --locked --test fuzz
# REST request bodies: random and mutated bodies against the real server in front of the
# fake VMM (api/tests/rest_fuzz.rs), at a fixed budget.
stage fuzz-rest env PROPTEST_CASES=2000 cargo test -p api --locked --test rest_fuzz
# Soak (tests/tests/soak.rs, #[ignore]d in the plain run above): hot-add/remove cycles of
# real devices with lender restarts, then zero leaks. Longer or shorter locally with
# LENDVM_SOAK_CYCLES / LENDVM_SOAK_RESTARTS.
stage soak env LENDVM_SOAK_CYCLES="${LENDVM_SOAK_CYCLES:-500}" \
  LENDVM_SOAK_RESTARTS="${LENDVM_SOAK_RESTARTS:-10}" \
  cargo test -p lendvm-tests --locked --test soak -- --ignored --nocapture
# The Debian packages: built with cargo-deb from the binaries above, installed into a
# throwaway root, their lendctl/lenderd/man pages run from the installed paths (~20 s, plus
# `cargo install cargo-deb` once).
stage packages scripts/test-packages.sh
if [ "${LENDVM_SKIP_LINUX:-0}" = 1 ]; then
  if [ -n "${CI:-}" ]; then
    echo "test: LENDVM_SKIP_LINUX=1 under CI: the Linux end-to-end tests are required there" >&2
    exit 1
  fi
  echo "test: LENDVM_SKIP_LINUX=1: Linux end-to-end tests skipped"
else
  stage linux scripts/test-linux.sh
  # L1's lenderd is a release build (tests/vfio/make-l1-initramfs.sh): built here, so that
  # the vfio stage's time is L1's.
  stage build-l1 cargo build --release --locked -p lending --bin lenderd
  # Real VFIO in a nested QEMU guest (docs/VFIO.md): one L1 boot with intel-iommu, the VFIO
  # backend against the real kernel inside it (tests/vfio_kernel.rs), the NVMe's DMA read
  # from the ivshmem file out here, L1's lenderd lending its vfio-pci functions over the bar
  # fabric, then the lendvm guests' cases (tests/tests/vfio.rs: stock nvme and e1000e
  # drivers, replug, FLR, migration, lenderd killed mid-write, P2P, L1's death).
  stage vfio scripts/test-vfio.sh
fi
