//! The checker against histories with one planted violation each: it must report exactly
//! that one (and a clean history nothing).

use super::check::{check, Bounds, Invariant, Report};
use super::history::{DeviceEvent, Entry, Op, Outcome, Phase};

const DEV: &str = "l1:0000:82:00.0";
const VM: &str = "b1-vm0";

fn write(start: u64, end: u64, outcome: Outcome, block: u64, seq: u64) -> Entry {
    Entry::span(
        start,
        end,
        outcome,
        Op::Write {
            vm: VM.into(),
            device: DEV.into(),
            block,
            seq,
            sum: sum(block, seq),
        },
    )
}

fn read(start: u64, end: u64, block: u64, seq: u64) -> Entry {
    read_sum(
        start,
        end,
        block,
        seq,
        if seq == 0 { 0 } else { sum(block, seq) },
    )
}

fn read_sum(start: u64, end: u64, block: u64, seq: u64, s: u32) -> Entry {
    Entry::span(
        start,
        end,
        Outcome::Ok,
        Op::Read {
            vm: VM.into(),
            device: DEV.into(),
            block,
            seq,
            sum: s,
        },
    )
}

fn sum(block: u64, seq: u64) -> u32 {
    crc32fast::hash(&[block.to_le_bytes(), seq.to_le_bytes()].concat())
}

fn grant(at: u64, lease: u64, holder: &str, fence: u64) -> Entry {
    Entry::at(
        at,
        Outcome::Info,
        Op::LeaseGrant {
            lender: "l1".into(),
            device: DEV.into(),
            lease,
            holder: holder.into(),
            fence,
            transfer: false,
        },
    )
}

fn end(at: u64, lease: u64) -> Entry {
    Entry::at(
        at,
        Outcome::Info,
        Op::LeaseEnd {
            lender: "l1".into(),
            device: DEV.into(),
            lease,
            reason: "returned".into(),
        },
    )
}

fn serve(at: u64, lease: u64) -> Entry {
    Entry::at(
        at,
        Outcome::Info,
        Op::LeaseServe {
            lender: "l1".into(),
            device: DEV.into(),
            lease,
        },
    )
}

fn device(at: u64, event: DeviceEvent) -> Entry {
    Entry::at(
        at,
        Outcome::Info,
        Op::Device {
            vm: VM.into(),
            device: DEV.into(),
            event,
        },
    )
}

fn fault(at: u64, kind: &str, target: &str) -> Entry {
    Entry::at(
        at,
        Outcome::Info,
        Op::Fault {
            kind: kind.into(),
            target: target.into(),
        },
    )
}

fn heal(at: u64, kind: &str, target: &str) -> Entry {
    Entry::at(
        at,
        Outcome::Info,
        Op::Heal {
            kind: kind.into(),
            target: target.into(),
        },
    )
}

fn api(start: u64, end: Option<u64>) -> Entry {
    Entry {
        start_ms: start,
        end_ms: end,
        outcome: if end.is_some() {
            Outcome::Ok
        } else {
            Outcome::Info
        },
        op: Op::Api {
            process: VM.into(),
            call: "vm.info".into(),
        },
    }
}

fn resources(at: u64, phase: Phase, fds: u64, rss_kib: u64) -> Entry {
    Entry::at(
        at,
        Outcome::Info,
        Op::Resources {
            daemon: "l1".into(),
            phase,
            counts: [("fds".to_string(), fds), ("rss_kib".to_string(), rss_kib)]
                .into_iter()
                .collect(),
        },
    )
}

/// A run in which everything held: a lease, writes through a lender kill that the VM
/// survives (a new lease with a higher fence), a final read-back, answered calls, no leak.
fn clean() -> Vec<Entry> {
    vec![
        resources(0, Phase::Baseline, 40, 10_000),
        grant(100, 1, "b1/vm0", 1),
        device(150, DeviceEvent::Attached),
        serve(200, 1),
        write(1_000, 1_010, Outcome::Ok, 0, 1),
        write(1_100, 1_110, Outcome::Ok, 1, 2),
        api(1_200, Some(1_250)),
        fault(2_000, "lender-kill", "l1"),
        end(2_000, 1),
        // In flight when the lender died: indeterminate.
        write(2_010, 7_000, Outcome::Info, 0, 3),
        heal(5_000, "lender-kill", "l1"),
        grant(5_500, 2, "b1/vm0", 10),
        serve(5_600, 2),
        write(8_000, 8_010, Outcome::Ok, 1, 4),
        // Block 0 may hold seq 1 or the indeterminate seq 3: it holds 3.
        read(9_000, 9_010, 0, 3),
        read(9_020, 9_030, 1, 4),
        read(9_040, 9_050, 2, 0),
        api(9_100, Some(9_150)),
        end(70_000, 2),
        device(70_000, DeviceEvent::Detached),
        resources(70_100, Phase::Final, 40, 12_000),
    ]
}

/// `clean()` without the entries `drop` picks, with `add`.
fn plant(drop: impl Fn(&Op) -> bool, add: impl IntoIterator<Item = Entry>) -> Vec<Entry> {
    let mut h = clean();
    h.retain(|e| !drop(&e.op));
    h.extend(add);
    h
}

/// Nothing dropped from `clean()`.
fn none(_: &Op) -> bool {
    false
}

fn run(h: &[Entry]) -> Report {
    check(h, &Bounds::default())
}

/// Exactly one violation, of `inv`; returns its message.
fn only(r: &Report, inv: Invariant) -> String {
    assert_eq!(r.violations.len(), 1, "{r}");
    assert_eq!(r.violations[0].invariant, inv, "{r}");
    r.violations[0].message.clone()
}

#[test]
fn a_clean_history_passes_and_is_counted() {
    let r = run(&clean());
    assert!(r.ok(), "{r}");
    assert_eq!(r.entries, clean().len());
    assert_eq!(r.ops["write"], 4);
    assert_eq!(r.faults["lender-kill"], 1);
    let table = r.to_string();
    assert!(
        table.contains("| no acknowledged write lost | held |"),
        "{table}"
    );
}

#[test]
fn a_lost_write_is_reported() {
    // The read-back of block 1 finds seq 2, but seq 4 was acknowledged before it.
    let h = plant(
        |o| matches!(o, Op::Read { block: 1, .. }),
        [read(9_020, 9_030, 1, 2)],
    );
    let m = only(&run(&h), Invariant::LostWrite);
    assert!(
        m.contains("write seq 4") && m.contains("found seq 2"),
        "{m}"
    );

    // A block read as never written after an acknowledged write.
    let h = plant(
        |o| matches!(o, Op::Read { block: 1, .. }),
        [read(9_020, 9_030, 1, 0)],
    );
    let m = only(&run(&h), Invariant::LostWrite);
    assert!(m.contains("found seq 0"), "{m}");

    // An acknowledged write nobody read back.
    let mut h = clean();
    h.retain(|e| !matches!(e.op, Op::Read { block: 1, .. }));
    let r = run(&h);
    assert_eq!(r.count(Invariant::LostWrite), 2, "{r}");
    assert!(r.to_string().contains("never read back"), "{r}");
}

#[test]
fn a_lost_device_is_checked_in_the_lenders_backing_file() {
    let mut h = clean();
    h.retain(|e| !matches!(e.op, Op::Read { .. }));
    h.push(device(9_000, DeviceEvent::Lost));
    let backing = |block, seq| {
        Entry::span(
            71_000,
            71_001,
            Outcome::Ok,
            Op::BackingRead {
                lender: "l1".into(),
                device: DEV.into(),
                block,
                seq,
                sum: sum(block, seq),
            },
        )
    };
    h.push(backing(0, 1));
    h.push(backing(1, 4));
    assert!(run(&h).ok(), "{}", run(&h));
    h.pop();
    h.push(backing(1, 2));
    let m = only(&run(&h), Invariant::LostWrite);
    assert!(m.contains("backing-read by l1"), "{m}");
}

#[test]
fn a_read_of_what_nobody_wrote_is_reported() {
    let h = plant(
        |o| matches!(o, Op::Read { block: 1, .. }),
        [read_sum(9_020, 9_030, 1, 4, 0xdead_beef)],
    );
    let m = only(&run(&h), Invariant::CorruptRead);
    assert!(m.contains("checksum 0xdeadbeef"), "{m}");

    let h = plant(
        |o| matches!(o, Op::Read { block: 2, .. }),
        [read(9_040, 9_050, 2, 9)],
    );
    let m = only(&run(&h), Invariant::CorruptRead);
    assert!(m.contains("seq 9, which no write"), "{m}");
}

#[test]
fn a_double_lease_is_reported() {
    // The lender grants the device to another VM while lease 1 still runs.
    let mut h = clean();
    h.push(grant(1_500, 7, "b2/vm1", 5));
    h.push(end(1_600, 7));
    let m = only(&run(&h), Invariant::DoubleLease);
    assert!(
        m.contains("lease 7") && m.contains("b2/vm1") && m.contains("lease 1"),
        "{m}"
    );
}

#[test]
fn a_fence_that_does_not_grow_is_reported() {
    let h = plant(
        |o| matches!(o, Op::LeaseGrant { lease: 2, .. }),
        [grant(5_500, 2, "b1/vm0", 1)],
    );
    let m = only(&run(&h), Invariant::FenceOrder);
    assert!(m.contains("fence 1"), "{m}");
}

#[test]
fn a_fenced_lease_that_serves_is_reported() {
    // The paused lender comes back and serves lease 1 after it was fenced.
    let m = only(
        &run(&plant(none, [serve(6_000, 1)])),
        Invariant::FencedServe,
    );
    assert!(m.contains("after it ended at 2000 ms"), "{m}");

    let m = only(
        &run(&plant(none, [serve(6_000, 99)])),
        Invariant::FencedServe,
    );
    assert!(m.contains("never granted"), "{m}");
}

#[test]
fn a_stuck_or_slow_call_is_reported() {
    let m = only(&run(&plant(none, [api(3_000, None)])), Invariant::StuckCall);
    assert!(m.contains("never answered"), "{m}");

    let m = only(
        &run(&plant(none, [api(3_000, Some(20_000))])),
        Invariant::StuckCall,
    );
    assert!(m.contains("took 17000 ms"), "{m}");
}

#[test]
fn a_vm_that_neither_recovers_nor_is_told_is_reported() {
    // No successful I/O after the heal, no loss event.
    let mut h = clean();
    h.retain(|e| !matches!(e.op, Op::Write { seq: 4, .. } | Op::Read { .. }));
    let r = run(&h);
    assert_eq!(r.count(Invariant::Recovery), 1, "{r}");
    assert!(r.to_string().contains("neither used it"), "{r}");

    // Told in time: that is recovery too (the write lost with the device is then checked
    // in the backing file, absent here).
    h.push(device(30_000, DeviceEvent::Lost));
    assert_eq!(run(&h).count(Invariant::Recovery), 0, "{}", run(&h));

    // A fault never healed, and a history that stops before the bound ran out.
    let m = only(
        &run(&plant(none, [fault(60_000, "link-loss", "l1<->b1")])),
        Invariant::Recovery,
    );
    assert!(m.contains("never healed"), "{m}");
    // The run stops 900 ms after its heal, its blocks read back before the fault.
    let mut short: Vec<Entry> = clean()
        .into_iter()
        .filter(|e| e.start_ms < 6_000 && !matches!(e.op, Op::Write { seq: 3, .. }))
        .collect();
    short.push(read(1_500, 1_510, 0, 1));
    short.push(read(1_520, 1_530, 1, 2));
    short.push(resources(5_900, Phase::Final, 40, 10_000));
    let m = only(&run(&short), Invariant::Recovery);
    assert!(m.contains("before the 60000 ms bound ran out"), "{m}");
}

#[test]
fn a_leak_is_reported() {
    let is_final = |o: &Op| {
        matches!(
            o,
            Op::Resources {
                phase: Phase::Final,
                ..
            }
        )
    };
    let h = plant(is_final, [resources(70_100, Phase::Final, 41, 12_000)]);
    let m = only(&run(&h), Invariant::Leak);
    assert!(
        m.contains("fds is 41 at the end, 40 at the baseline"),
        "{m}"
    );

    // Memory may grow by the slack, not by more.
    let h = plant(
        is_final,
        [resources(70_100, Phase::Final, 40, 10_000 + (16 << 10) + 1)],
    );
    assert_eq!(run(&h).count(Invariant::Leak), 1, "{}", run(&h));

    let m = only(&run(&plant(is_final, [])), Invariant::Leak);
    assert!(m.contains("no baseline or no final"), "{m}");
}
