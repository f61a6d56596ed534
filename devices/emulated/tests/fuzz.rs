//! proptest: random SQEs and PRP lists never panic the controller nor let it touch memory
//! outside the DMA window. Case count: PROPTEST_CASES (default 64).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test/bench code

mod common;

use std::sync::OnceLock;

use emulated::nvme::spec::Sqe;
use emulated::testing::{LocalRig, TestMemory};
use emulated::NotifyMode;
use proptest::prelude::*;
use std::sync::Mutex;

const RAM: usize = 16 << 20;
const WIN: (u64, u64) = (1 << 20, 12 << 20);

struct Fixture {
    _dir: tempfile::TempDir,
    rig: LocalRig,
    ram_base: u64,
}

fn fixture() -> &'static Mutex<Fixture> {
    static F: OnceLock<Mutex<Fixture>> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = common::config(&dir, NotifyMode::Interrupt, 512, 4 << 20);
        cfg.mdts = 5;
        let mem = TestMemory::with_window(RAM, WIN.0, WIN.1);
        mem.fill(0, WIN.0 as usize, 0xc3);
        mem.fill(WIN.1, RAM - WIN.1 as usize, 0x3c);
        let mut rig = common::rig_with(cfg, mem, true, 1);
        let ram_base = rig.driver.alloc(4096 * 64, 4096).unwrap();
        Mutex::new(Fixture {
            _dir: dir,
            rig,
            ram_base,
        })
    })
}

/// The driver's own queues live in the first MiB of the window; random DMA must not clobber
/// them (that would only break the test driver, not the controller).
fn avoid_queues(a: u64) -> u64 {
    if (WIN.0..WIN.0 + (1 << 20)).contains(&a) {
        a + (1 << 20)
    } else {
        a
    }
}

fn addr() -> impl Strategy<Value = u64> {
    raw_addr().prop_map(avoid_queues)
}

fn raw_addr() -> impl Strategy<Value = u64> {
    prop_oneof![
        (0u64..RAM as u64).prop_map(|a| a & !3),
        (WIN.0..WIN.1).prop_map(|a| a & !0xfff),
        Just(0u64),
        any::<u64>(),
        Just(WIN.1 - 4096),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64),
        failure_persistence: None,
        .. ProptestConfig::default()
    })]

    #[test]
    fn random_commands_are_contained(
        admin_q in any::<bool>(),
        opcode in prop_oneof![0u8..0x10, Just(0x18u8), any::<u8>()],
        flags in 0u32..4,
        nsid in prop_oneof![Just(1u32), Just(0xffff_ffffu32), any::<u32>()],
        prp1 in addr(),
        prp2 in addr(),
        cdw in proptest::array::uniform6(prop_oneof![0u32..64, any::<u32>()]),
        list in proptest::collection::vec(addr(), 0..40),
    ) {
        let mut f = fixture().lock().unwrap();
        let base = f.ram_base;
        let d = &mut f.rig.driver;
        // A random PRP list in RAM that prp2 may point to.
        let bytes: Vec<u8> = list.iter().flat_map(|e| e.to_le_bytes()).collect();
        d.ram().write(base, &bytes);
        let prp2 = if flags & 1 != 0 { base } else { prp2 };
        let mut s = Sqe::new(opcode, 0);
        s.set_nsid(nsid).set_prps(prp1, prp2);
        for (i, v) in cdw.iter().enumerate() {
            s.set_cdw(10 + i, *v);
        }
        // Never delete/create the queues the fixture relies on or reset it.
        let op = s.opcode();
        let qid = if admin_q { 0 } else { 1 };
        if qid == 0 && matches!(op, 0x00 | 0x01 | 0x04 | 0x05 | 0x0c) {
            s.set_cdw(10, (s.dw[10] & !0xffff) | 2);
            if op == 0x0c { s = Sqe::new(0x0d, 0); }
        }
        if qid == 0 && op == 0x09 && (s.dw[10] & 0xff) == 7 {
            s.set_cdw(10, 0x06);
        }
        let e = d.execute(qid, s);
        prop_assert!(e.is_ok(), "no completion: {:?}", e);
        let mem = &f.rig.mem;
        prop_assert!(mem.check(0, WIN.0 as usize, 0xc3), "low guard touched");
        prop_assert!(mem.check(WIN.1, RAM - WIN.1 as usize, 0x3c), "high guard touched");
    }
}
