#!/usr/bin/env bash
# Prints the path of the executable cargo builds for the integration test NAME of the
# lendvm-tests package (building it when needed):
#
#   scripts/test-exe.sh NAME
#
# Used by scripts/test-linux.sh and scripts/test-vfio.sh --prepare, which copy it (and the
# binaries it spawns) so that their runs need no cargo.
set -euo pipefail
name=${1:?usage: scripts/test-exe.sh NAME}
cd "$(dirname "$0")/.."
# --workspace (not -p lendvm-tests): the features the unit stage's `cargo test --workspace`
# resolves, so its artifacts serve both and nothing is compiled twice.
exe=$(cargo test --workspace --locked --test "$name" --no-run --message-format=json 2>/dev/null \
	| grep -F '"kind":["test"]' | grep -F "\"name\":\"$name\"" \
	| sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
[ -n "$exe" ] && [ -x "$exe" ] || {
	echo "test-exe: cargo printed no test executable for tests/tests/$name.rs" >&2
	exit 1
}
echo "$exe"
