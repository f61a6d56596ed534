//! Shadow doorbells (Doorbell Buffer Config, EventIdx) driven by the host-side test driver,
//! through a BAR that behaves like the borrower's VMM: kick-only doorbells lose their value.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use emulated::nvme::spec::{admin, cq_doorbell, sq_doorbell, status, Sqe};
use emulated::nvme::{NvmeConfig, NvmeController, BAR0_SIZE};
use emulated::testing::{
    CountingInterrupts, DataBuf, DriverConfig, KickBar, NvmeDriver, TestMemory,
};
use emulated::{DeviceModel, HeapRegisters, NotifyMode};

use common::*;

struct Rig {
    ctrl: Arc<NvmeController>,
    bar: Arc<KickBar>,
    d: NvmeDriver,
}

fn kick_rig(cfg: NvmeConfig, mem: Arc<TestMemory>) -> Rig {
    let regs = Arc::new(HeapRegisters::new(BAR0_SIZE as usize));
    let irq = CountingInterrupts::new(cfg.msix_vectors);
    let ctrl = Arc::new(NvmeController::new(cfg, regs.clone(), mem.clone(), irq.clone()).unwrap());
    ctrl.start().unwrap();
    let bar = Arc::new(KickBar::new(ctrl.clone(), regs));
    let d = NvmeDriver::new(
        bar.clone(),
        mem.clone(),
        irq,
        DriverConfig {
            ram_base: 1 << 20,
            ram_len: mem.len() as u64 - (2 << 20),
            use_interrupts: true,
            timeout: Duration::from_secs(10),
        },
    );
    Rig { ctrl, bar, d }
}

fn bring_up(d: &mut NvmeDriver, pairs: u16) {
    d.enable(32).unwrap();
    d.set_num_queues(pairs).unwrap();
    for q in 1..=pairs {
        d.create_io_queue_pair(q, 64, q).unwrap();
    }
}

/// `batches` rounds on `qid`: 8 writes, all reaped, then the same 8 blocks read back and
/// compared. `per_request`: one doorbell update per command (Linux without plugging); else
/// one per 8 (a plugged batch). Returns I/Os done.
fn io_rounds(d: &mut NvmeDriver, qid: u16, batches: u64, seed: u8, per_request: bool) -> u64 {
    let bufs: Vec<DataBuf> = (0..8)
        .map(|_| d.alloc_data(4096, 0, false).unwrap())
        .collect();
    let pat = |b: u64, i: usize| seed ^ (b as u8).wrapping_mul(31) ^ (i as u8);
    let lba = |b: u64, i: usize| (b * 8 + i as u64) * 8 % 8192;
    let mut ios = 0;
    for b in 0..batches {
        for write in [true, false] {
            for (i, buf) in bufs.iter().enumerate() {
                buf.fill(d.ram(), &[if write { pat(b, i) } else { 0 }; 4096]);
                d.push(qid, NvmeDriver::rw_sqe(write, lba(b, i), 8, buf))
                    .unwrap();
                if per_request {
                    d.ring(qid).unwrap();
                }
            }
            if !per_request {
                d.ring(qid).unwrap();
            }
            let mut out = Vec::new();
            d.wait(qid, &mut out, 8).unwrap();
            assert_eq!(out.len(), 8);
            assert!(out.iter().all(|e| e.code() == status::SUCCESS), "{out:?}");
            ios += 8;
        }
        for (i, buf) in bufs.iter().enumerate() {
            assert!(
                buf.read(d.ram()).iter().all(|&x| x == pat(b, i)),
                "batch {b} block {i} read back wrong data"
            );
        }
    }
    ios
}

#[test]
fn shadow_doorbells_suppress_mmio_and_survive_resets() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&dir, NotifyMode::Interrupt, 512, 8 << 20);
    let Rig { ctrl, bar, mut d } = kick_rig(cfg, TestMemory::new(RAM));
    bring_up(&mut d, 2);
    let id = d.identify_controller().unwrap();
    assert_ne!(
        id.oacs & (1 << 8),
        0,
        "OACS advertises Doorbell Buffer Config"
    );
    let k0 = ctrl.kick_doorbells();
    assert!(k0.offsets.is_empty(), "no kick-only doorbells before DBBUF");

    // Baseline without shadow doorbells: every SQ tail and CQ head update is an MMIO write.
    let c0 = d.doorbell_counts();
    let ios = io_rounds(&mut d, 1, 4, 1, false);
    let base = d.doorbell_counts().since(&c0);
    assert_eq!(base.writes(), base.updates());
    assert!(
        base.writes() >= ios / 8 + ios / 8,
        "{base:?} for {ios} i/os"
    );

    d.enable_dbbuf().unwrap();
    let k1 = ctrl.kick_doorbells();
    assert!(k1.generation > k0.generation);
    assert_eq!(k1.bar, 0);
    for q in 1..=4 {
        assert!(k1.offsets.contains(&sq_doorbell(q)) && k1.offsets.contains(&cq_doorbell(q)));
    }
    assert!(!k1.offsets.contains(&sq_doorbell(0)) && !k1.offsets.contains(&cq_doorbell(0)));

    // One doorbell update per request. The MMIO writes are only kicks (the value is
    // dropped), so the data coming back right proves the controller reads the shadow buffer.
    let (c1, kicks1) = (d.doorbell_counts(), bar.kicks());
    // 64 batches of 16 I/Os on a 64-entry queue pair: the CQ head wraps 16 times.
    let ios = io_rounds(&mut d, 1, 64, 2, true) + io_rounds(&mut d, 2, 8, 3, true);
    let c = d.doorbell_counts().since(&c1);
    eprintln!("per-request doorbells, shadowed: {c:?} for {ios} i/os");
    assert_eq!(
        bar.kicks() - kicks1,
        c.writes(),
        "every i/o doorbell write was a kick"
    );
    assert_eq!(c.sq_updates, ios);
    assert!(c.cq_updates >= ios / 8);
    // CQ heads: EventIdx stays one behind the head, so only a wrap of the ring can ring.
    assert!(c.cq_writes <= 16 + 2 + 2, "{c:?}");
    // SQ tails: a doorbell only when the controller had caught up (EventIdx == old tail);
    // pushes made while it was still fetching are suppressed.
    assert!(c.sq_writes < c.sq_updates, "{c:?}");

    // Plugged batches (one tail update per 8 commands): MMIO writes far fewer than I/Os.
    let c2 = d.doorbell_counts();
    let ios = io_rounds(&mut d, 1, 32, 4, false);
    let c = d.doorbell_counts().since(&c2);
    eprintln!("plugged doorbells, shadowed: {c:?} for {ios} i/os");
    assert!(c.writes() * 4 < ios, "{c:?} for {ios} i/os");
    assert!(c.cq_writes <= 8 + 2, "{c:?}");

    // Queue delete + re-create while shadowing: the new queue uses the shadow buffer too
    // (its MMIO writes are kicks whose value is dropped, so working I/O proves it).
    d.delete_io_queue_pair(2).unwrap();
    // 30 entries: EventIdx arithmetic on a ring that is not a power of two, wrapping twice.
    d.create_io_queue_pair(2, 30, 2).unwrap();
    let c5 = d.doorbell_counts();
    io_rounds(&mut d, 2, 4, 5, true);
    let c = d.doorbell_counts().since(&c5);
    assert!(c.cq_writes <= 2, "{c:?}");

    // Controller reset: shadowing ends, doorbells need their values again.
    d.disable().unwrap();
    let k2 = ctrl.kick_doorbells();
    assert!(k2.generation > k1.generation && k2.offsets.is_empty());
    bring_up(&mut d, 2);
    let c3 = d.doorbell_counts();
    io_rounds(&mut d, 1, 2, 6, true);
    let c = d.doorbell_counts().since(&c3);
    assert_eq!(
        c.writes(),
        c.updates(),
        "plain mmio doorbells after a reset"
    );
    // Re-enable.
    d.enable_dbbuf().unwrap();
    let k3 = ctrl.kick_doorbells();
    assert!(k3.generation > k2.generation && !k3.offsets.is_empty());
    io_rounds(&mut d, 2, 8, 7, true);

    // Function level reset ends shadowing as well; a driver that never enables it works.
    ctrl.reset();
    let k4 = ctrl.kick_doorbells();
    assert!(k4.generation > k3.generation && k4.offsets.is_empty());
    bring_up(&mut d, 1);
    assert!(!d.dbbuf_enabled());
    let c4 = d.doorbell_counts();
    io_rounds(&mut d, 1, 2, 8, true);
    let c = d.doorbell_counts().since(&c4);
    assert_eq!(c.writes(), c.updates());
}

#[test]
fn dbbuf_with_buffers_outside_the_window_or_misaligned_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // DMA window: [1 MiB, RAM - 8 MiB); the driver allocates inside it.
    let win_end = (RAM - (8 << 20)) as u64;
    let mem = TestMemory::with_window(RAM, 1 << 20, win_end);
    let cfg = config(&dir, NotifyMode::Interrupt, 512, 8 << 20);
    let Rig { ctrl, mut d, .. } = kick_rig(cfg, mem.clone());
    bring_up(&mut d, 1);
    let good = d.alloc(4096, 4096).unwrap();
    let good2 = d.alloc(4096, 4096).unwrap();
    let faults = mem.faults();
    for (shadow, ei) in [(win_end, good2), (good, win_end + 0x1000), (0, good2)] {
        let e = d.dbbuf_config(shadow, ei).unwrap();
        assert_eq!(e.code(), status::DATA_TRANSFER_ERROR, "{shadow:#x}/{ei:#x}");
    }
    assert!(mem.faults() > faults, "the refused buffers were DMA faults");
    // The last page of the window: the slots of 5 queues fit; a buffer straddling the end
    // does not.
    let e = d.dbbuf_config(win_end - 0x1000, good2).unwrap();
    assert_eq!(
        e.code(),
        status::SUCCESS,
        "a buffer at the window's last page fits"
    );
    d.disable().unwrap();
    bring_up(&mut d, 1);
    let e = d.dbbuf_config(good + 8, good2).unwrap();
    assert_eq!(e.code(), status::INVALID_FIELD, "misaligned shadow buffer");
    assert!(!d.dbbuf_enabled());
    assert!(
        ctrl.kick_doorbells().offsets.is_empty(),
        "refused: no kick-only doorbells"
    );
    // The controller is fine and plain MMIO doorbells keep working.
    io_rounds(&mut d, 1, 2, 9, true);
    d.enable_dbbuf().unwrap();
    io_rounds(&mut d, 1, 2, 10, true);
    // A second config moves the shadowed queue to new buffers without losing its tail.
    let g = ctrl.kick_doorbells().generation;
    d.enable_dbbuf().unwrap();
    assert_eq!(
        ctrl.kick_doorbells().generation,
        g,
        "still on: no change to announce"
    );
    io_rounds(&mut d, 1, 3, 12, true);
}

#[test]
fn dbbuf_off_hides_oacs_and_refuses_the_opcode() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = NvmeConfig {
        dbbuf: false,
        ..config(&dir, NotifyMode::Interrupt, 512, 8 << 20)
    };
    let Rig { ctrl, mut d, .. } = kick_rig(cfg, TestMemory::new(RAM));
    bring_up(&mut d, 1);
    assert_eq!(d.identify_controller().unwrap().oacs & (1 << 8), 0);
    let a = d.alloc(4096, 4096).unwrap();
    let b = d.alloc(4096, 4096).unwrap();
    let mut s = Sqe::new(admin::DBBUF_CONFIG, 0);
    s.set_prps(a, b);
    assert_eq!(d.execute(0, s).unwrap().code(), status::INVALID_OPCODE);
    assert!(ctrl.kick_doorbells().offsets.is_empty());
    let c0 = d.doorbell_counts();
    io_rounds(&mut d, 1, 2, 11, true);
    let c = d.doorbell_counts().since(&c0);
    assert_eq!(c.writes(), c.updates());
}

/// The shadow-doorbell form of the CQ flood (`nvme_flood.rs`): a guest moves its SQ tail a
/// million times without an exit while never consuming its CQ. The controller fetches only
/// what the CQ can take, asks (EventIdx = head) for the next CQ head update, and resumes
/// when the host makes room; the other queue keeps working meanwhile.
#[test]
fn a_shadow_doorbell_flood_stops_at_the_full_cq_and_resumes_on_its_eventidx() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&dir, NotifyMode::Interrupt, 512, 8 << 20);
    let Rig {
        ctrl,
        bar: _,
        mut d,
    } = kick_rig(cfg, TestMemory::new(RAM));
    bring_up(&mut d, 2);
    d.enable_dbbuf().unwrap();
    let fetched0 = ctrl.stats().commands.load(Ordering::Relaxed);
    let mut submitted = 0;
    let mut ios = 0;
    for part in 0..8u8 {
        submitted += flood(&mut d, 1, 1_000_000 / 8);
        ios += io_rounds(&mut d, 2, 1, part, false);
    }
    let fetched = ctrl.stats().commands.load(Ordering::Relaxed) - fetched0;
    assert!(
        fetched <= 63 + ios,
        "{fetched} commands fetched for {submitted} submissions and {ios} i/os"
    );
    // The host consumes its CQ: the EventIdx the controller set makes the head update ring,
    // and the queue is fetched again up to its tail, then works normally.
    // Let the controller go idle first: only the head update's doorbell may wake it.
    std::thread::sleep(Duration::from_millis(20));
    let c0 = d.doorbell_counts();
    assert!(drain_flood(&mut d, 1) >= 63);
    let c = d.doorbell_counts().since(&c0);
    assert!(
        c.cq_writes >= 1,
        "EventIdx did not ask for the CQ head update that made room: {c:?}"
    );
    io_rounds(&mut d, 1, 2, 9, true);
}
