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
#
#   scripts/test-linux.sh --prepare ENVFILE
#
# builds everything above and writes ENVFILE (shell assignments); a later run with those
# variables exported and LENDVM_LINUX_PREBUILT=1 runs the tests without cargo. The binaries
# it runs (lendvm, lenderd, the test executable) are copies in target/linux-run/ (the
# consoles: target/linux-run/linux-tests/), so cargo
# may build anything meanwhile (CI runs its other stages beside this one: scripts/test.sh)
# without replacing a binary under a running test.
set -euo pipefail
cd "$(dirname "$0")/.."

prepare=""
if [ "${1:-}" = --prepare ]; then
	prepare=${2:?usage: scripts/test-linux.sh --prepare ENVFILE}
	shift 2
fi
if [ "${LENDVM_LINUX_PREBUILT:-0}" = 1 ]; then
	exe=${LENDVM_LINUX_TEST_EXE:?LENDVM_LINUX_PREBUILT=1 needs LENDVM_LINUX_TEST_EXE (from --prepare)}
	: "${LENDVM_LINUX_KERNEL:?LENDVM_LINUX_PREBUILT=1 needs LENDVM_LINUX_KERNEL}"
	: "${LENDVM_LINUX_INITRAMFS:?LENDVM_LINUX_PREBUILT=1 needs LENDVM_LINUX_INITRAMFS}"
	[ -x "$exe" ] || { echo "test-linux: $exe is not an executable" >&2; exit 1; }
	echo "test-linux: guest kernel $LENDVM_LINUX_KERNEL, initramfs $LENDVM_LINUX_INITRAMFS (prebuilt: $exe)" >&2
	exec "$exe" --ignored --test-threads=1 --nocapture "$@"
fi

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
# The same without fio, for the guests that run no fio job (they reach /init sooner).
if [ -z "${LENDVM_LINUX_INITRAMFS_SMALL:-}" ]; then
	LENDVM_LINUX_INITRAMFS_SMALL=$(tests/linux/make-initramfs.sh --small | tail -n 1)
	[ -f "$LENDVM_LINUX_INITRAMFS_SMALL" ] || {
		echo "test-linux: tests/linux/make-initramfs.sh --small printed no archive" >&2
		exit 1
	}
	export LENDVM_LINUX_INITRAMFS_SMALL
fi
echo "test-linux: guest kernel $LENDVM_LINUX_KERNEL, initramfs $LENDVM_LINUX_INITRAMFS (without fio: $LENDVM_LINUX_INITRAMFS_SMALL)" >&2

cargo build --workspace --bins --locked
if [ -n "$prepare" ]; then
	# Copies of the test executable and of the binaries it spawns (it looks for them one
	# directory up from its own: target/linux-run/{lendvm,lenderd}; its consoles go to
	# target/linux-run/linux-tests/, its figures to target/reliability/).
	built=$(scripts/test-exe.sh linux)
	target=$(dirname "$(dirname "$(dirname "$built")")")
	run="$target/linux-run"
	rm -rf "$run"
	mkdir -p "$run/deps"
	cp "$built" "$run/deps/linux"
	cp "$target/debug/lendvm" "$target/debug/lenderd" "$run/"
	printf '%s=%q\n' LENDVM_LINUX_KERNEL "$LENDVM_LINUX_KERNEL" \
		LENDVM_LINUX_INITRAMFS "$LENDVM_LINUX_INITRAMFS" \
		LENDVM_LINUX_INITRAMFS_SMALL "${LENDVM_LINUX_INITRAMFS_SMALL:-}" \
		LENDVM_LINUX_TEST_EXE "$run/deps/linux" >"$prepare"
	echo "test-linux: prepared: $run (kernel, initramfs, lendvm, lenderd, the tests)" >&2
	exit 0
fi
# --nocapture: each test prints one line with its boot times.
cargo test --workspace --locked --test linux -- --ignored --test-threads=1 --nocapture "$@"
