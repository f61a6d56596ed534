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
# stand-in CPU load at nice 0 beside CI must not starve them. A fresh clone gains nothing
# from incremental compilation (there is nothing to reuse), only its bookkeeping.
if [ -n "${CI:-}" ]; then
	export LENDVM_NICE=${LENDVM_NICE:-0}
	export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/lendvm-test.XXXXXX")
STAGES_FILE=$WORK/stages
: >"$STAGES_FILE"
T_ALL=$SECONDS
report() {
	local rc=$?
	echo "test: stage durations (seconds; [beside X]: ran in the background during stage X):"
	sed 's/^/  /' "$STAGES_FILE"
	printf '  %5d  total%s\n' $((SECONDS - T_ALL)) "$([ "$rc" = 0 ] || echo " (failed, rc=$rc)")"
	rm -rf "$WORK"
	return "$rc"
}
trap report EXIT
# stage NAME CMD...: runs CMD, records how long it took (STAGE_NOTE is appended to the line).
stage() {
	local name=$1 t0=$SECONDS rc=0
	shift
	"$@" || rc=$?
	printf '%5d  %s%s%s\n' $((SECONDS - t0)) "$name" "${STAGE_NOTE:-}" \
		"$([ "$rc" = 0 ] || echo " (failed, rc=$rc)")" >>"$STAGES_FILE"
	return "$rc"
}

stage setup scripts/setup.sh
stage fmt cargo fmt --all -- --check
stage build cargo build --workspace --bins --locked
LINUX=1
if [ "${LENDVM_SKIP_LINUX:-0}" = 1 ]; then
  if [ -n "${CI:-}" ]; then
    echo "test: LENDVM_SKIP_LINUX=1 under CI: the Linux end-to-end tests are required there" >&2
    exit 1
  fi
  echo "test: LENDVM_SKIP_LINUX=1: Linux end-to-end tests skipped"
  LINUX=0
fi

# The stages that boot no guest, one after another. With the Linux tests they run in the
# background beside the Linux stage: a Linux guest keeps about one core and a half busy (its
# vCPUs run in KVM's instruction emulator), the rest of the machine would idle, and these
# stages would otherwise add ~15 min (on a slow machine) after the guests. The VFIO stage
# runs alone: L1 (QEMU under TCG) slows with every other busy thread, and with these beside
# it on a loaded machine its longest case took twice as long (docs/DEVELOPING.md). The guest
# stages run copies of their binaries (`--prepare` of test-linux.sh and test-vfio.sh), so
# cargo may build meanwhile.
#
# Every cargo command here selects the whole workspace (`--workspace` plus a target or a
# test-name filter) rather than one package: with one package cargo resolves features for
# it alone and rebuilds the crates it shares with the others (about 100 s of compiling for
# the fuzz stages on a loaded machine); with the workspace they reuse the unit stage's
# artifacts.
others() {
	stage unit+integration cargo test --workspace --locked
	if [ "$LINUX" = 1 ]; then
		# Real VFIO in a nested QEMU guest (docs/VFIO.md): everything the `vfio` stage needs
		# is built here, while cargo is at hand (L1's initramfs with a release lenderd, the
		# guests' initramfs, copies of lendvm, lendctl and the cases); that stage builds
		# nothing.
		stage build-vfio scripts/test-vfio.sh --prepare "$WORK/vfio.env"
	fi
	stage clippy cargo clippy --workspace --all-targets --locked -- -D warnings
	# Every benchmark of docs/BENCHMARKS.md at a short budget (dev profile): checks that each
	# still runs and writes its section's fragment; no speeds are checked, docs/ is untouched.
	stage bench-quick scripts/bench.sh --quick
	# The decoders' fuzz properties at CI depth (10^5 cases each crate); the default runs
	# above are shorter.
	stage fuzz-wire env PROPTEST_CASES=25000 cargo test --workspace --locked --test wire_fuzz
	# (lending's protocol decoders; the filter also runs vmm's few migration::protocol unit
	# tests, which take no cases)
	stage fuzz-protocol env PROPTEST_CASES=100000 cargo test --workspace --locked --lib -- protocol::
	# Config-space requests through the lender's gate (conventional filter + extended space).
	stage fuzz-config env PROPTEST_CASES=20000 cargo test --workspace --locked --lib -- backend::config::fuzz
	# NVMe submission entries and PRP lists against the emulated controller (each case is
	# real I/O through the controller thread and its file: ~30 s at this budget on 2 cores).
	stage fuzz-nvme env PROPTEST_CASES=96 cargo test --workspace --locked --test fuzz
	# REST request bodies: random and mutated bodies against the real server in front of
	# the fake VMM (api/tests/rest_fuzz.rs), at a fixed budget.
	stage fuzz-rest env PROPTEST_CASES=2000 cargo test --workspace --locked --test rest_fuzz
	# Soak (tests/tests/soak.rs, #[ignore]d in the plain run above): hot-add/remove cycles
	# of real devices with lender restarts, then zero leaks. Longer or shorter locally with
	# LENDVM_SOAK_CYCLES / LENDVM_SOAK_RESTARTS. CI runs 300 cycles (the test's own default
	# is 500): a leak grows with every cycle, and 300 with 10 restarts show one as surely,
	# in ~60 s less on a loaded machine, where CI's budget is tight (docs/DEVELOPING.md).
	stage soak env LENDVM_SOAK_CYCLES="${LENDVM_SOAK_CYCLES:-300}" \
		LENDVM_SOAK_RESTARTS="${LENDVM_SOAK_RESTARTS:-10}" \
		cargo test --workspace --locked --test soak -- --ignored --nocapture
	# The Debian packages: built with cargo-deb from the binaries above, installed into a
	# throwaway root, their lendctl/lendvm/man pages run from the installed paths (~20 s,
	# plus `cargo install cargo-deb` once).
	stage packages scripts/test-packages.sh
	# The units' hardening where systemd does not run as PID 1: systemd's own rating (at
	# most 2.0) and their system call filters against every call the daemons make through
	# real leases, traced (~20 s).
	stage units scripts/test-units.sh
	# A cluster under fire (tests/tests/chaos_cluster.rs, #[ignore]d in the plain run): 3
	# etcd members, 3 lenders and 2 borrower hosts with 2 VMs each in network namespaces,
	# one short seeded fault schedule (seed 2: 19 faults of 11 kinds in 3 minutes), the
	# checker on the whole history (~3.5 min). Longer ones: scripts/chaos.sh.
	stage chaos env LENDVM_CHAOS_SEED=2 LENDVM_CHAOS_MINUTES=3 \
		cargo test --workspace --locked --test chaos_cluster -- --ignored --nocapture
}

if [ "$LINUX" = 0 ]; then
	others
	exit 0
fi

# beside GUEST_STAGE NAME CMD... -- FUNCTION: runs the guest stage NAME (CMD) in the
# foreground and FUNCTION's stages in the background (their output after the stage's);
# fails if either failed.
beside() {
	local name=$1 t0=$SECONDS
	shift
	local cmd=()
	while [ "$1" != -- ]; do
		cmd+=("$1")
		shift
	done
	local fn=$2 log=$WORK/beside-$name.log
	echo "test: the $fn stages run in the background beside the $name stage; their output follows it"
	(STAGE_NOTE="  [beside $name]" "$fn") >"$log" 2>&1 &
	local pid=$! rc_fg=0 rc_bg=0
	stage "$name" "${cmd[@]}" || rc_fg=$?
	wait "$pid" || rc_bg=$?
	printf '%5d  %s\n' $((SECONDS - t0)) "$name and the stages beside it, wall time" >>"$STAGES_FILE"
	echo "test: ---- output of the stages that ran beside the $name stage ----"
	cat "$log"
	echo "test: ---- end of their output ----"
	if [ "$rc_bg" != 0 ]; then
		echo "test: a stage beside the $name stage failed (rc=$rc_bg): its output is above" >&2
		return "$rc_bg"
	fi
	return "$rc_fg"
}

# The guest kernel (built once, cached by content hash), the initramfs archives, lendvm,
# lenderd and tests/tests/linux.rs, copied where the Linux stage runs them.
stage build-linux scripts/test-linux.sh --prepare "$WORK/linux.env"
set -a
# shellcheck disable=SC1091
source "$WORK/linux.env"
set +a
beside linux env LENDVM_LINUX_PREBUILT=1 scripts/test-linux.sh -- others

set -a
# shellcheck disable=SC1091
source "$WORK/vfio.env"
set +a
# L1 (QEMU under TCG: its kernel boots in seconds), the vfio_kernel cases inside it, then
# the lendvm guests' cases against its lenderd (tests/tests/vfio.rs: stock nvme and e1000e
# drivers, replug, FLR, migration, lenderd killed mid-write, P2P, L1's death), one VM at a
# time, with nothing else of CI beside it. Its deadlines are scaled by L1's boot.
stage vfio env LENDVM_VFIO_PREBUILT=1 scripts/test-vfio.sh
