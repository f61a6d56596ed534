//! Exit-free doorbells end to end: the real `lenderd` lends an emulated NVMe over shm,
//! `lendvm` borrows it, and the bare-metal test guest's NVMe driver enables shadow doorbells
//! (Doorbell Buffer Config) when the controller offers them.
//!
//! * `dbbuf=on` (the default): the guest's I/O queue doorbell updates go to the shadow
//!   buffer and only some become MMIO stores (CQ heads never do on a queue that does not
//!   wrap); the VMM registers the kick-only doorbells as KVM ioeventfds on the lender's
//!   eventfd (its log says so) and sees fewer trapped BAR writes than with
//!   `dbbuf=off`, where every doorbell update is a trapped store.
//!
//! Guest work: the `nvme` test of `nvme_over_shm_direct` plus one admin command.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;

/// Trapped BAR writes and VMM-signalled kicks from the device's release line.
struct Release {
    trapped_writes: u64,
    kicks: u64,
}

fn release_line(log: &str) -> Release {
    let line = log
        .lines()
        .find(|l| l.contains("nvme0: released; returning"))
        .unwrap_or_else(|| panic!("no release line for nvme0 in the VMM log:\n{log}"));
    let num = |key: &str| -> u64 {
        let rest = &line[line.find(key).unwrap_or_else(|| panic!("{key} in {line}")) + key.len()..];
        rest.trim_start()
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    Release {
        trapped_writes: num("trapped writes"),
        kicks: num("vmm kicks"),
    }
}

/// Runs the guest's NVMe test against a lender NVMe with `dbbuf=on|off`; returns the
/// guest's `nvme-doorbells` line, the VMM log and the release counters.
fn run(dbbuf: &str) -> (String, String, Release) {
    let cluster = Cluster::new(Fabric::Shm);
    let spec = format!(
        "{NVME_BDF}=nvme:path={},size=4M,dbbuf={dbbuf}",
        cluster.file("disk.img").display()
    );
    let _lender = cluster.start_lenderd(&[spec]);
    let dev = format!("{LENDER}:{NVME_BDF},id=nvme0");
    let cmdline = format!("tests=pci,nvme seed={SEED:#x} lba=8");
    let cluster_arg = cluster.path.display().to_string();
    let mut vm = Vm::start_with_log(
        "64M",
        &[
            "--cluster",
            &cluster_arg,
            "--remote-device",
            &dev,
            "--cmdline",
            &cmdline,
        ],
        "info",
    );
    vm.expect_exit(0, BOOT_TIMEOUT);
    let read = vm.expect_ok("nvme-read", std::time::Duration::ZERO);
    assert!(read.contains("verified 32768 bytes"), "{read}");
    let doorbells = vm.expect_ok("nvme-doorbells", std::time::Duration::ZERO);
    let out = vm.stdout();
    assert_eq!(
        out.contains("nvme-dbbuf"),
        dbbuf == "on",
        "shadow doorbells offered only with dbbuf=on:\n{out}"
    );
    assert_backing_has_pattern(&cluster.file("disk.img"), 8, 64, SEED);
    let log = vm.stderr();
    let rel = release_line(&log);
    (doorbells, log, rel)
}

#[test]
fn nvme_shadow_doorbells_register_ioeventfds_and_cut_trapped_writes() {
    let (on, on_log, on_rel) = run("on");
    let (off, off_log, off_rel) = run("off");
    eprintln!("dbbuf=on:  {on}");
    eprintln!("dbbuf=off: {off}");
    let n = |line: &str, k: &str| -> u64 { field(line, k).unwrap().parse().unwrap() };
    // Five I/O commands (3 writes, a read, a flush): an SQ tail and a CQ head update each.
    assert!(on.contains("shadow on") && off.contains("shadow off"));
    assert_eq!(n(&on, "updates"), 10, "{on}");
    assert_eq!(n(&off, "updates"), 10, "{off}");
    assert_eq!(
        n(&off, "mmio"),
        10,
        "without shadow doorbells every update is a store"
    );
    // With them: the controller is idle at each submission (EventIdx = old tail: ring), and
    // a CQ head never passes its EventIdx on a ring that does not wrap.
    assert!(n(&on, "mmio") <= 5, "{on}");
    // The VMM registered the kick-only doorbells as ioeventfds (and only with dbbuf=on).
    assert!(
        on_log.contains("doorbell ioeventfds (kick-only doorbells"),
        "no ioeventfd registration in the VMM log:\n{on_log}"
    );
    assert!(!off_log.contains("doorbell ioeventfds (kick-only doorbells"));
    // Fewer doorbell stores reach the VMM: at least the 5 CQ heads (minus the 2 exact
    // doorbells of the extra admin command), more once the ioeventfds are in place.
    eprintln!(
        "trapped writes: on {} (vmm kicks {}), off {} (vmm kicks {})",
        on_rel.trapped_writes, on_rel.kicks, off_rel.trapped_writes, off_rel.kicks
    );
    assert!(
        on_rel.trapped_writes + 3 <= off_rel.trapped_writes,
        "trapped writes: on {}, off {}",
        on_rel.trapped_writes,
        off_rel.trapped_writes
    );
    assert!(on_rel.kicks + 3 <= off_rel.kicks);
}
