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
	return "$rc"
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
LINUX=1
if [ "${LENDVM_SKIP_LINUX:-0}" = 1 ]; then
  if [ -n "${CI:-}" ]; then
    echo "test: LENDVM_SKIP_LINUX=1 under CI: the Linux end-to-end tests are required there" >&2
    exit 1
  fi
  echo "test: LENDVM_SKIP_LINUX=1: Linux end-to-end tests skipped"
  LINUX=0
fi
if [ "$LINUX" = 1 ]; then
  # Real VFIO in a nested QEMU guest (docs/VFIO.md). Everything it needs is built here,
  # while cargo is at hand: the guest kernel (also the Linux stage's), L1's initramfs with a
  # release lenderd, the guests' initramfs, lendvm and the cases; the `vfio` stage below
  # builds nothing.
  VFIO_ENV=$(mktemp)
  stage build-vfio scripts/test-vfio.sh --prepare "$VFIO_ENV"
  set -a
  # shellcheck disable=SC1090
  source "$VFIO_ENV"
  set +a
  rm -f "$VFIO_ENV"
fi
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
if [ "$LINUX" = 1 ]; then
  stage linux scripts/test-linux.sh
  # L1 (QEMU under TCG: its kernel boots in seconds), the vfio_kernel cases inside it, then
  # the lendvm guests' cases against its lenderd (tests/tests/vfio.rs: stock nvme and e1000e
  # drivers, replug, FLR, migration, lenderd killed mid-write, P2P, L1's death), one VM at a
  # time.
  stage vfio env LENDVM_VFIO_PREBUILT=1 scripts/test-vfio.sh
fi
