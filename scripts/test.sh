#!/usr/bin/env bash
# The test command: installs what is missing, checks formatting and lints, builds every
# binary (integration tests run the real lendvm/lenderd processes) and runs all tests.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo build --workspace --bins --locked
cargo test --workspace --locked
