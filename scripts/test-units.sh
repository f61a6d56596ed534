#!/usr/bin/env bash
# The systemd units' hardening, checked where systemd does not run as PID 1 (CI):
#
# 1. `systemd-analyze security --offline=true` rates both units at most 2.0 (exposure 20 of
#    100); a unit rated above that fails here, with systemd's table of what it exposes.
# 2. Their SystemCallFilter= admits every system call the daemons make: lenderd and lendvm
#    run real leases (shm and tcp+TLS, hot-add and remove through the REST API, live
#    migration of a VM with a lent NVMe, the etcd directory, metrics) under strace, and
#    scripts/check-syscalls.py fails on any call a unit's filter would refuse, by name.
#    Under systemd such a call would fail with EPERM (SystemCallErrorNumber=) and the
#    daemon with it.
# 3. The units themselves, started by systemd under their whole sandbox, and the tenant
#    boundaries between the processes they start (scripts/test-units-live.sh: systemd as
#    PID 1 in a container on a throwaway root, the packages installed, lenderd and two VMs
#    each a user of its own, leases and what one VM's user cannot reach).
#
# Uses the test executables `cargo test --workspace` built (it builds them if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
UNITS=resources/systemd

for u in "$UNITS/lenderd.service" "$UNITS/lendvm@.service"; do
	if ! systemd-analyze security --offline=true --threshold=20 "$u" >/tmp/units-security.$$ 2>&1; then
		cat /tmp/units-security.$$ >&2
		rm -f /tmp/units-security.$$
		echo "test-units: $u is exposed above 2.0 (systemd-analyze security, table above)" >&2
		exit 1
	fi
	echo "test-units: $(grep 'Overall exposure' /tmp/units-security.$$ | sed 's/^→ //')"
	rm -f /tmp/units-security.$$
done

command -v strace >/dev/null || { echo "test-units: strace is missing (scripts/setup.sh installs it)" >&2; exit 1; }
TRACE=$(mktemp -d "${TMPDIR:-/tmp}/lendvm-syscalls.XXXXXX")
trap 'rm -rf "$TRACE"' EXIT
# executable TEST: the test executable of tests/tests/TEST.rs.
executable() {
	cargo test --locked --workspace --test "$1" --no-run --message-format=json 2>/dev/null |
		sed -n "s/.*\"executable\":\"\([^\"]*\/$1-[^\"]*\)\".*/\1/p" | tail -n1
}
# trace TEST CASE...: runs the cases of tests/tests/TEST.rs under strace.
trace() {
	local test=$1 exe
	shift
	exe=$(executable "$test")
	[ -n "$exe" ] && [ -x "$exe" ] || { echo "test-units: no test executable for $test" >&2; exit 1; }
	echo "test-units: tracing $test: $*"
	strace -f -ff -qq -e signal=none -o "$TRACE/t" "$exe" "$@" --exact --test-threads=1 >"$TRACE/$test.log" 2>&1 || {
		cat "$TRACE/$test.log" >&2
		echo "test-units: $test failed under strace" >&2
		exit 1
	}
}
trace remote_nvme nvme_over_shm_direct nvme_over_tcp_trapped
trace hotplug hot_add_io_remove_and_re_add
trace migration_lent live_migration_hands_the_lent_nvme_over_without_reset
trace directory the_directory_works_over_tls_with_client_certificates_and_refuses_a_client_without_one
trace prometheus a_metrics_address_in_use_does_not_stop_lending
python3 scripts/check-syscalls.py "$TRACE" "$UNITS"
scripts/test-units-live.sh
