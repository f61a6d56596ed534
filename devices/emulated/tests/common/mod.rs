#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;

use emulated::nvme::NvmeConfig;
use emulated::testing::{LocalRig, TestMemory};
use emulated::NotifyMode;

pub const RAM: usize = 96 << 20;

pub fn config(dir: &tempfile::TempDir, notify: NotifyMode, lba: u32, size: u64) -> NvmeConfig {
    NvmeConfig {
        backing: dir.path().join("disk.img"),
        size: Some(size),
        lba_size: lba,
        notify,
        model: "lendvm test model".into(),
        serial: "SN-TEST-42".into(),
        firmware: "0.9".into(),
        msix_vectors: 4,
        max_io_queues: 4,
        max_queue_entries: 256,
        io_threads: 2,
        ..NvmeConfig::default()
    }
}

/// Started controller + enabled driver with `pairs` I/O queue pairs (qid n on vector n).
pub fn rig_with(cfg: NvmeConfig, mem: Arc<TestMemory>, use_irq: bool, pairs: u16) -> LocalRig {
    let mut rig = LocalRig::with_memory(cfg, mem, use_irq).unwrap();
    rig.driver.enable(32).unwrap();
    if pairs > 0 {
        let (sq, cq) = rig.driver.set_num_queues(pairs).unwrap();
        assert!(sq >= pairs && cq >= pairs);
        for q in 1..=pairs {
            rig.driver.create_io_queue_pair(q, 64, q).unwrap();
        }
    }
    rig
}

pub fn rig(dir: &tempfile::TempDir, notify: NotifyMode, pairs: u16) -> LocalRig {
    rig_with(
        config(dir, notify, 512, 64 << 20),
        TestMemory::new(RAM),
        notify == NotifyMode::Interrupt,
        pairs,
    )
}

/// A hostile guest's flood on `qid`: `n` commands with the FUSE bits set (refused at once
/// with Invalid Field) pushed in rounds of one SQ's worth and rung, its CQ never consumed.
/// Returns the commands submitted (tail moves).
pub fn flood(d: &mut emulated::testing::NvmeDriver, qid: u16, n: u64) -> u64 {
    use emulated::nvme::spec::{io, Sqe};
    let mut fused = Sqe::new(io::FLUSH, 0);
    fused.set_nsid(1);
    // FUSE = 01b (first command of a fused operation): not supported, fails at once.
    fused.dw[0] |= 1 << 8;
    let mut submitted = 0;
    while submitted < n {
        for _ in 0..63 {
            d.push_unchecked(qid, fused).unwrap();
        }
        d.ring(qid).unwrap();
        submitted += 63;
    }
    submitted
}

/// Consumes `qid`'s CQ until the controller has fetched everything up to the driver's SQ
/// tail; every completion must be the fused commands' Invalid Field. Returns how many.
pub fn drain_flood(d: &mut emulated::testing::NvmeDriver, qid: u16) -> usize {
    use emulated::nvme::spec::status;
    let tail = d.sq_tail(qid).unwrap();
    let t0 = std::time::Instant::now();
    let mut seen = 0;
    loop {
        let mut out = Vec::new();
        d.poll(qid, &mut out).unwrap();
        for e in &out {
            assert_eq!(e.code(), status::INVALID_FIELD, "flood completion {e:?}");
        }
        seen += out.len();
        if out.last().is_some_and(|e| e.sq_head == tail) {
            return seen;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(20),
            "the controller did not resume on queue {qid} once its CQ head moved \
             ({seen} completions so far, sq tail {tail})"
        );
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}
