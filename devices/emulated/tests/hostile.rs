//! A hostile driver against the emulated NVMe controller: doorbell values outside their
//! queue, and the named regressions of `fuzz.rs`.
//!
//! NVMe 1.4 (3.1.x, 5.2): a doorbell write whose value lies outside the queue is ignored and,
//! with an Asynchronous Event Request outstanding, reported as an Error event "Invalid
//! Doorbell Write Value" (further error events are masked until the host reads the Error
//! Information log page). The controller counts each refused value
//! (`NvmeStats::invalid_doorbells`) and never fetches an entry outside the queue.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use emulated::nvme::spec::{admin, cq_doorbell, sq_doorbell, status, Cqe, Sqe};
use emulated::testing::LocalRig;
use emulated::NotifyMode;

/// Error event / Invalid Doorbell Write Value / Error Information log.
const AEN_INVALID_DOORBELL: u32 = 0x0001_0100;
/// Entries of the fixture's I/O queue pair (`common::rig_with`).
const IO_ENTRIES: u32 = 64;

fn invalid_doorbells(rig: &LocalRig) -> u64 {
    rig.ctrl.stats().invalid_doorbells.load(Ordering::Relaxed)
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(10), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Polls the admin CQ for the completion of `cid` (bounded).
fn admin_completion(rig: &mut LocalRig, cid: u16) -> Cqe {
    let mut out = Vec::new();
    let t0 = Instant::now();
    loop {
        rig.driver.poll(0, &mut out).unwrap();
        if let Some(e) = out.iter().find(|e| e.cid == cid) {
            return *e;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no completion for admin cid {cid}: {out:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// No completion for `cid` within `ms` (the event stayed masked).
fn no_admin_completion(rig: &mut LocalRig, cid: u16, ms: u64) {
    let mut out = Vec::new();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(ms) {
        rig.driver.poll(0, &mut out).unwrap();
        assert!(
            !out.iter().any(|e| e.cid == cid),
            "unexpected completion for admin cid {cid}: {out:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn io_works(rig: &mut LocalRig, lba: u64, seed: u8) {
    let data: Vec<u8> = (0..4096u32).map(|i| (i as u8).wrapping_mul(seed)).collect();
    let w = rig.driver.alloc_data(4096, 0, false).unwrap();
    w.fill(rig.driver.ram(), &data);
    let e = rig.driver.rw(1, true, lba, 8, &w).unwrap();
    assert_eq!(e.code(), status::SUCCESS, "write after the abuse");
    let r = rig.driver.alloc_data(4096, 0, false).unwrap();
    let e = rig.driver.rw(1, false, lba, 8, &r).unwrap();
    assert_eq!(e.code(), status::SUCCESS, "read after the abuse");
    assert_eq!(r.read(rig.driver.ram()), data, "data after the abuse");
}

fn read_error_log(rig: &mut LocalRig) {
    let buf = rig.driver.alloc_data(4096, 0, false).unwrap();
    let mut s = Sqe::new(admin::GET_LOG_PAGE, 0);
    // Error Information (01h), 64 bytes, Retain Asynchronous Event clear.
    s.set_nsid(0xffff_ffff)
        .set_prps(buf.prp1, buf.prp2)
        .set_cdw(10, 1 | (15 << 16));
    rig.driver.execute_ok(0, s).unwrap();
}

#[test]
fn sq_tail_and_cq_head_beyond_queue_size_are_ignored_counted_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = common::rig(&dir, NotifyMode::Interrupt, 1);
    let fetched = rig.ctrl.stats().commands.load(Ordering::Relaxed);
    let aer = rig
        .driver
        .submit(0, Sqe::new(admin::ASYNC_EVENT, 0))
        .unwrap();

    // SQ tail = queue size + 5: ignored (nothing fetched), counted once, AER completes.
    rig.driver.bar().write32(sq_doorbell(1), IO_ENTRIES + 5);
    let e = admin_completion(&mut rig, aer);
    assert_eq!(e.code(), status::SUCCESS);
    assert_eq!(e.dw0, AEN_INVALID_DOORBELL, "event {:#x}", e.dw0);
    assert_eq!(invalid_doorbells(&rig), 1);
    assert_eq!(
        rig.ctrl.stats().commands.load(Ordering::Relaxed),
        fetched + 1,
        "only the AER was fetched: nothing from the invalid tail"
    );
    // The same value written again is the same refusal: not counted again.
    rig.driver.bar().write32(sq_doorbell(1), IO_ENTRIES + 5);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(invalid_doorbells(&rig), 1);

    // A new bad value is counted, but error events stay masked until the log is read.
    let aer = rig
        .driver
        .submit(0, Sqe::new(admin::ASYNC_EVENT, 0))
        .unwrap();
    rig.driver.bar().write32(sq_doorbell(1), 0xffff_ffff);
    wait_for("second invalid doorbell counted", || {
        invalid_doorbells(&rig) == 2
    });
    no_admin_completion(&mut rig, aer, 50);

    // The queue still works from where it was (the driver's tail overwrites the bad one).
    io_works(&mut rig, 16, 3);

    // Reading the Error Information log re-arms error events: a bad CQ head is reported.
    read_error_log(&mut rig);
    rig.driver.bar().write32(cq_doorbell(1), IO_ENTRIES);
    let e = admin_completion(&mut rig, aer);
    assert_eq!(e.dw0, AEN_INVALID_DOORBELL, "event {:#x}", e.dw0);
    assert_eq!(invalid_doorbells(&rig), 3);
    io_works(&mut rig, 24, 5);
}

#[test]
fn invalid_doorbells_without_an_aer_are_reported_when_one_arrives() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = common::rig(&dir, NotifyMode::Interrupt, 1);
    rig.driver.bar().write32(cq_doorbell(1), 4096);
    wait_for("invalid cq head counted", || invalid_doorbells(&rig) == 1);
    // The event waited for an AER.
    let aer = rig
        .driver
        .submit(0, Sqe::new(admin::ASYNC_EVENT, 0))
        .unwrap();
    let e = admin_completion(&mut rig, aer);
    assert_eq!(e.dw0, AEN_INVALID_DOORBELL);
    io_works(&mut rig, 8, 7);
}

#[test]
fn a_doorbell_storm_is_bounded_and_the_queue_survives() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = common::rig(&dir, NotifyMode::Interrupt, 1);
    let t0 = Instant::now();
    for i in 0..1000u32 {
        rig.driver
            .bar()
            .write32(sq_doorbell(1), IO_ENTRIES + (i % 500));
        rig.driver
            .bar()
            .write32(cq_doorbell(1), IO_ENTRIES + (i % 300));
    }
    wait_for("storm processed", || {
        // Every distinct value is counted once it is seen; the controller may miss values
        // overwritten before it looked (doorbells are registers, not a queue).
        invalid_doorbells(&rig) >= 1 && t0.elapsed() > Duration::from_millis(50)
    });
    assert!(invalid_doorbells(&rig) <= 2000);
    io_works(&mut rig, 32, 9);
}

#[test]
fn a_controller_reset_rearms_error_events() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = common::rig(&dir, NotifyMode::Interrupt, 1);
    rig.driver.bar().write32(sq_doorbell(1), 999);
    wait_for("counted", || invalid_doorbells(&rig) == 1);
    // Re-enable: queues, AERs and the event mask start over.
    rig.driver.enable(32).unwrap();
    rig.driver.set_num_queues(1).unwrap();
    rig.driver.create_io_queue_pair(1, 64, 1).unwrap();
    let aer = rig
        .driver
        .submit(0, Sqe::new(admin::ASYNC_EVENT, 0))
        .unwrap();
    rig.driver.bar().write32(sq_doorbell(1), 998);
    let e = admin_completion(&mut rig, aer);
    assert_eq!(e.dw0, AEN_INVALID_DOORBELL);
    io_works(&mut rig, 40, 11);
}

/// A PRP list whose last slot chains to itself (and one that chains back to its start) is
/// walked a bounded number of steps: PRP Offset Invalid, counted, the controller goes on.
#[test]
fn looping_prp_lists_are_bounded_refused_and_counted() {
    use emulated::nvme::spec::io;
    let dir = tempfile::tempdir().unwrap();
    let mut rig = common::rig(&dir, NotifyMode::Interrupt, 1);
    let data = rig.driver.alloc(16 * 4096, 4096).unwrap();
    let list = rig.driver.alloc(4096, 4096).unwrap();
    let last = list + 4096 - 8;
    rig.driver.ram().write(last, &last.to_le_bytes());
    let prps = rig.ctrl.stats().invalid_prps.load(Ordering::Relaxed);
    let mut s = Sqe::new(io::READ, 0);
    s.set_nsid(1)
        .set_prps(data, last)
        .set_cdw(10, 0)
        .set_cdw(12, 8 * 3 - 1);
    let e = rig.driver.execute(1, s).unwrap();
    assert_eq!(e.code(), status::PRP_OFFSET_INVALID);
    assert_eq!(
        rig.ctrl.stats().invalid_prps.load(Ordering::Relaxed),
        prps + 1
    );
    // Two slots at the end of the page, the second chaining back to the first: the same
    // data page repeats, bounded by the walk's budget (16 pages: refused).
    let start = list + 4096 - 16;
    let mut b = (data + 4096).to_le_bytes().to_vec();
    b.extend_from_slice(&start.to_le_bytes());
    rig.driver.ram().write(start, &b);
    let mut s = Sqe::new(io::READ, 0);
    s.set_nsid(1)
        .set_prps(data, start)
        .set_cdw(10, 0)
        .set_cdw(12, 8 * 16 - 1);
    let e = rig.driver.execute(1, s).unwrap();
    assert_eq!(e.code(), status::PRP_OFFSET_INVALID);
    io_works(&mut rig, 48, 13);
}
