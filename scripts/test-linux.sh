#!/usr/bin/env bash
# End-to-end tests with a real Linux guest (tests/tests/linux.rs):
#
#   scripts/test-linux.sh [extra cargo test filter/args...]
#
# 1. builds (or takes from the cache) the guest kernel: scripts/build-guest-kernel.sh,
#    ~6-7 min the first time, instant when cached;
# 2. builds lendvm and lenderd (the tests spawn them from the same target dir);
# 3. runs the two #[ignore]d tests of `--test linux` in parallel (one boot per core):
#    a boot with a lent NVMe disk, and a boot without it plus an ACPI hot-add.
#
# The guest is the uncompressed vmlinux (lendvm loads the ELF directly: no decompressor,
# ~20-30 s less emulated time than the bzImage). Set LENDVM_LINUX_KERNEL to use another
# kernel image (bzImage or vmlinux) and skip the kernel build.
# With a cached kernel the script takes about 1.5-4 min, depending on the host's load.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${LENDVM_LINUX_KERNEL:-}" ]; then
	out=$(scripts/build-guest-kernel.sh)
	vmlinux=$(printf '%s\n' "$out" | sed -n 's/^VMLINUX=//p' | tail -n 1)
	[ -n "$vmlinux" ] && [ -f "$vmlinux" ] || {
		echo "test-linux: scripts/build-guest-kernel.sh printed no VMLINUX= file:" >&2
		printf '%s\n' "$out" >&2
		exit 1
	}
	export LENDVM_LINUX_KERNEL="$vmlinux"
fi
echo "test-linux: guest kernel $LENDVM_LINUX_KERNEL" >&2

cargo build --workspace --bins --locked
# --nocapture: each test prints one line with its boot times.
cargo test -p lendvm-tests --locked --test linux -- --ignored --test-threads=2 --nocapture "$@"
