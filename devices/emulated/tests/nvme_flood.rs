//! A hostile guest that never consumes its completion queue cannot grow the lender: the
//! controller stops fetching once the CQ could not take another completion, other queues
//! and other controllers (other leases of the same lender process) keep working, and the
//! queue resumes when the host advances its CQ head. Alone in its binary so the process's
//! RSS measures this controller only. The shadow-doorbell (EventIdx) variant is in
//! `nvme_dbbuf.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code

mod common;

use std::sync::atomic::Ordering;

use emulated::testing::LocalRig;
use emulated::NotifyMode;

/// Submissions of the flood.
const FLOOD: u64 = 1_000_000;
/// The fixture's I/O CQ holds 64 entries: 63 completions fit before it is full.
const CQ_ROOM: u64 = 63;

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn io_works(rig: &mut LocalRig, qid: u16, lba: u64, seed: u8) {
    use emulated::nvme::spec::status;
    let data: Vec<u8> = (0..4096u32).map(|i| (i as u8).wrapping_mul(seed)).collect();
    let w = rig.driver.alloc_data(4096, 0, false).unwrap();
    w.fill(rig.driver.ram(), &data);
    let e = rig.driver.rw(qid, true, lba, 8, &w).unwrap();
    assert_eq!(
        e.code(),
        status::SUCCESS,
        "write on queue {qid} during the flood"
    );
    let r = rig.driver.alloc_data(4096, 0, false).unwrap();
    let e = rig.driver.rw(qid, false, lba, 8, &r).unwrap();
    assert_eq!(
        e.code(),
        status::SUCCESS,
        "read on queue {qid} during the flood"
    );
    assert_eq!(r.read(rig.driver.ram()), data, "data on queue {qid}");
}

#[test]
fn a_million_submissions_against_a_never_consumed_cq_hold_no_lender_memory() {
    let dir = tempfile::tempdir().unwrap();
    let other_dir = tempfile::tempdir().unwrap();
    let mut rig = common::rig(&dir, NotifyMode::Interrupt, 2);
    let mut other = common::rig(&other_dir, NotifyMode::Interrupt, 1);
    // Warm both up (buffer pools, engine rings) before measuring.
    io_works(&mut rig, 2, 0, 1);
    io_works(&mut other, 1, 0, 2);
    let fetched0 = rig.ctrl.stats().commands.load(Ordering::Relaxed);
    let rss0 = rss_kib();

    // The flood in 16 parts; between them the other queue of this controller and the
    // other controller each write and read back.
    let mut submitted = 0;
    let mut other_ios = 0u64;
    for part in 0..16u8 {
        submitted += common::flood(&mut rig.driver, 1, FLOOD / 16);
        let lba = 8 + 8 * u64::from(part);
        io_works(&mut rig, 2, lba, part.wrapping_add(3));
        io_works(&mut other, 1, lba, part.wrapping_add(5));
        other_ios += 1;
    }
    assert!(submitted >= FLOOD);

    let fetched = rig.ctrl.stats().commands.load(Ordering::Relaxed) - fetched0;
    // Queue 1 fetched what its CQ could take; queue 2 fetched its own 2 commands a round.
    assert!(
        fetched <= CQ_ROOM + 2 * other_ios,
        "{fetched} commands fetched for {submitted} submissions to a CQ never consumed"
    );
    assert!(
        rig.ctrl.stats().fetch_stalls.load(Ordering::Relaxed) >= 1,
        "the stall was not counted"
    );
    let grown = rss_kib().saturating_sub(rss0);
    assert!(
        grown < 8 << 10,
        "the process grew by {grown} KiB during the flood"
    );

    // The host advances the CQ head: the queue resumes and works normally.
    let seen = common::drain_flood(&mut rig.driver, 1);
    assert!(seen as u64 >= CQ_ROOM, "only {seen} flood completions");
    io_works(&mut rig, 1, 0, 11);
    io_works(&mut other, 1, 0, 13);
}
