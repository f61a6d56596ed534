#!/usr/bin/env bash
# A cluster under fire (docs/RELIABILITY.md, "A cluster under fire"; issue 34):
#
#   scripts/chaos.sh [--minutes N] [--seed S] [--faults a,b,...|all]
#
# builds lenderd, lendvm and the harness, then runs tests/tests/chaos_cluster.rs: 3 etcd
# members (TLS, client certificates, etcd users), 3 lenders (NVMe disks, dmatest engines)
# and 2 borrower hosts with 2 VMs each, each in a network namespace of its own on a private
# bridge (169.254.91.0/24, deleted at the end), faults from the seeded schedule, and the
# checker on the whole history. Needs root (namespaces, iptables, tmpfs mounts) and Debian's
# etcd-server. Defaults: 3 minutes, seed 1, every fault kind. The history, the lenders'
# logs and audit logs and report.md go to target/chaos/seed-S/. A seed replays the same
# schedule.
set -euo pipefail
cd "$(dirname "$0")/.."

minutes=3 seed=1 faults=all
while [ $# -gt 0 ]; do
	case "$1" in
	--minutes) minutes=${2:?--minutes needs a number}; shift 2 ;;
	--seed) seed=${2:?--seed needs a number}; shift 2 ;;
	--faults) faults=${2:?--faults needs a list}; shift 2 ;;
	-h | --help) sed -n '2,13p' "$0"; exit 0 ;;
	*) echo "chaos: unknown argument \"$1\" (known: --minutes N, --seed S, --faults a,b|all)" >&2; exit 2 ;;
	esac
done
[ "$(id -u)" = 0 ] || { echo "chaos: run as root: the cluster's hosts are network namespaces" >&2; exit 2; }
command -v etcd >/dev/null || { echo "chaos: etcd is not installed (apt-get install etcd-server; scripts/setup.sh does it)" >&2; exit 2; }
cargo build --workspace --bins --locked -q
# Bad input gets its error before anything starts: the schedule's own parser names it.
target/debug/lendvm-chaos schedule --seed "$seed" --minutes "$minutes" --faults "$faults" >/dev/null
LENDVM_CHAOS_SEED=$seed LENDVM_CHAOS_MINUTES=$minutes LENDVM_CHAOS_FAULTS=$faults \
	exec cargo test -p lendvm-tests --locked --test chaos_cluster -- --ignored --nocapture
