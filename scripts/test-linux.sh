#!/usr/bin/env bash
# End-to-end tests with a real Linux guest (tests/tests/linux.rs):
#
#   scripts/test-linux.sh [extra cargo test filter/args...]
#
# 1. builds (or takes from the cache) the guest kernel: scripts/build-guest-kernel.sh,
#    ~6-7 min the first time, instant when cached;
# 2. builds (or takes from the cache) the initramfs: tests/linux/make-initramfs.sh (busybox
#    from busybox-static and a static fio from Debian's fio source, tests/linux/build-fio.sh,
#    ~2 min the first time; cached by content like the kernel);
# 3. builds lendvm and lenderd (the tests spawn them from the same target dir);
# 4. runs the #[ignore]d tests of `--test linux`, one boot at a time: each guest has 2 vCPUs,
#    and two such guests on the 2 cores (4 vCPUs) wait on each other's descheduled vCPUs
#    (IPIs, spinlocks) so badly that a boot took 2-3 times as long as alone
#    (docs/linux-guest-on-pvm.md, "Two vCPUs"):
#    a boot with a lent NVMe disk, a boot without it plus an ACPI hot-add (both checked by
#    the in-kernel self-test), a boot with the lent disk checked from busybox user space,
#    a boot that runs fio's crc32c verify job on the lent disk (fio's JSON checked: no errors,
#    the expected number of writes and verify reads, the blocks in the lender's file), and
#    a boot whose lender is SIGKILLed mid-write (lender crash: no acknowledged block lost,
#    the device lost and hot-added again; figures in target/reliability/lender_crash.json),
#    and a boot with two lent disks from two lenders written at once, one removed while
#    the other keeps writing (pinned bytes = guest RAM throughout, zero leaks at the end).
#
# The user-space test always runs: on this PVM host user space needs the kernel's
# `lendvm_syscall_fixup` (docs/linux-guest-on-pvm.md), which the test passes and which does
# nothing where SYSCALL works (hardware KVM).
#
# The guest is the uncompressed vmlinux (lendvm loads the ELF directly: no decompressor,
# ~20-30 s less emulated time than the bzImage). Set LENDVM_LINUX_KERNEL to use another
# kernel image (bzImage or vmlinux) and skip the kernel build; LENDVM_LINUX_INITRAMFS likewise
# for the initramfs.
# With a cached kernel and initramfs the script takes about 2-4 min, depending on the load.
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
if [ -z "${LENDVM_LINUX_INITRAMFS:-}" ]; then
	LENDVM_LINUX_INITRAMFS=$(tests/linux/make-initramfs.sh | tail -n 1)
	[ -f "$LENDVM_LINUX_INITRAMFS" ] || {
		echo "test-linux: tests/linux/make-initramfs.sh printed no archive" >&2
		exit 1
	}
	export LENDVM_LINUX_INITRAMFS
fi
echo "test-linux: guest kernel $LENDVM_LINUX_KERNEL, initramfs $LENDVM_LINUX_INITRAMFS" >&2

cargo build --workspace --bins --locked
# --nocapture: each test prints one line with its boot times.
cargo test -p lendvm-tests --locked --test linux -- --ignored --test-threads=1 --nocapture "$@"
