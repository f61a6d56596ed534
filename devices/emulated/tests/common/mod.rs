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
