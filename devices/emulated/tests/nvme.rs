//! The controller driven in-process by the guest-side test driver.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test/bench code

mod common;

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use emulated::nvme::spec::{admin, feat, io, status, Sqe};
use emulated::nvme::NvmeConfig;
use emulated::testing::{DataBuf, LocalRig, TestMemory, TrappedBar};
use emulated::{DeviceModel, InterruptMode, NotifyMode};
use rand::{Rng, SeedableRng};

use common::*;

/// Bring-up, identify, 2 queue pairs, 1000 random writes + read-back with checksums using
/// every PRP shape, flush, interrupt accounting, shutdown.
fn full_workload(notify: NotifyMode) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&dir, notify, 512, 64 << 20);
    let mut rig =
        LocalRig::with_memory(cfg, TestMemory::new(RAM), notify == NotifyMode::Interrupt).unwrap();
    let d = &mut rig.driver;
    d.enable(32).unwrap();
    let id = d.identify_controller().unwrap();
    assert_eq!(id.serial, "SN-TEST-42");
    assert_eq!(id.model, "lendvm test model");
    assert_eq!(id.firmware, "0.9");
    assert_eq!((id.sqes, id.cqes, id.nn, id.vid), (0x66, 0x44, 1, 0x1b36));
    assert_eq!(id.ver, 0x0001_0400);
    assert_eq!(id.vwc & 1, 1);
    assert_eq!(d.identify_namespace(1).unwrap(), ((64 << 20) / 512, 512));
    assert_eq!(d.active_namespaces().unwrap(), vec![1]);
    let descs = d.ns_descriptors(1).unwrap();
    assert!(descs
        .iter()
        .any(|(t, v)| *t == 2 && v.len() == 16 && v.iter().any(|&b| b != 0)));
    assert!(descs.iter().any(|(t, v)| *t == 3 && v.len() == 16));
    assert_eq!(d.set_num_queues(2).unwrap(), (2, 2));
    d.create_io_queue_pair(1, 64, 1).unwrap();
    d.create_io_queue_pair(2, 64, 2).unwrap();

    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    let slots = 1000usize;
    let nsze = (64u64 << 20) / 512;
    let slot_blocks = nsze / slots as u64; // 131
    let mut order: Vec<usize> = (0..slots).collect();
    for i in (1..slots).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    let mut expect: HashMap<u64, u32> = HashMap::new();
    let mut plan = Vec::new();
    for (i, &slot) in order.iter().enumerate() {
        let nlb = rng.random_range(1..=24u32);
        let lba = slot as u64 * slot_blocks + rng.random_range(0..slot_blocks - 24);
        let len = nlb as usize * 512;
        let (offset, scatter) = match i % 4 {
            0 => (0, false),
            1 => (512 * rng.random_range(0..8usize), false),
            2 => (4 * rng.random_range(0..1024usize), true),
            _ => (0, true),
        };
        plan.push((lba, nlb, len, offset, scatter));
    }
    // Writes, in batches of 32 spread over both queues.
    for chunk in plan.chunks(32) {
        let mut bufs: Vec<DataBuf> = Vec::new();
        for (j, &(lba, nlb, len, offset, scatter)) in chunk.iter().enumerate() {
            let b = d.alloc_data(len, offset, scatter).unwrap();
            let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            for k in 0..nlb as usize {
                expect.insert(
                    lba + k as u64,
                    crc32fast::hash(&data[k * 512..(k + 1) * 512]),
                );
            }
            b.fill(d.ram(), &data);
            let qid = 1 + (j % 2) as u16;
            d.push(
                qid,
                emulated::testing::NvmeDriver::rw_sqe(true, lba, nlb, &b),
            )
            .unwrap();
            bufs.push(b);
        }
        d.ring(1).unwrap();
        d.ring(2).unwrap();
        for q in 1..=2u16 {
            let n = d.outstanding(q);
            let mut out = Vec::new();
            d.wait(q, &mut out, n).unwrap();
            assert!(out.iter().all(|e| e.code() == status::SUCCESS), "{out:?}");
        }
    }
    d.flush(1).unwrap();
    // Read back everything, checksum every block.
    for chunk in plan.chunks(32) {
        let mut bufs = Vec::new();
        for (j, &(lba, nlb, len, offset, scatter)) in chunk.iter().enumerate() {
            let b = d
                .alloc_data(len, ((offset + 8) % 4096) & !3, !scatter)
                .unwrap();
            d.push(
                1 + (j % 2) as u16,
                emulated::testing::NvmeDriver::rw_sqe(false, lba, nlb, &b),
            )
            .unwrap();
            bufs.push((lba, nlb, b));
        }
        d.ring(1).unwrap();
        d.ring(2).unwrap();
        for q in 1..=2u16 {
            let n = d.outstanding(q);
            let mut out = Vec::new();
            d.wait(q, &mut out, n).unwrap();
            assert!(out.iter().all(|e| e.code() == status::SUCCESS), "{out:?}");
        }
        for (lba, nlb, b) in bufs {
            let data = b.read(d.ram());
            for k in 0..nlb as usize {
                let crc = crc32fast::hash(&data[k * 512..(k + 1) * 512]);
                assert_eq!(
                    Some(&crc),
                    expect.get(&(lba + k as u64)),
                    "lba {}",
                    lba + k as u64
                );
            }
        }
    }
    if notify == NotifyMode::Interrupt {
        assert!(rig.irq.count(0) > 0, "admin vector");
        assert!(rig.irq.count(1) > 0 && rig.irq.count(2) > 0, "io vectors");
    }
    assert_eq!(rig.irq.count(3), 0);
    assert_eq!(rig.mem.faults(), 0);
    assert_eq!(rig.ctrl.stats().dma_faults.load(Ordering::Relaxed), 0);
    rig.driver.shutdown().unwrap();
}

#[test]
fn workload_interrupt_mode() {
    full_workload(NotifyMode::Interrupt);
}

#[test]
fn workload_polling_mode() {
    full_workload(NotifyMode::Polling);
}

#[test]
fn lba_4096_namespace_roundtrip_thread_pool_engine() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(&dir, NotifyMode::Interrupt, 4096, 16 << 20);
    cfg.engine = emulated::engine::EngineKind::ThreadPool;
    let mut rig = rig_with(cfg, TestMemory::new(RAM), true, 1);
    assert_eq!(rig.ctrl.engine_name(), "thread-pool");
    let d = &mut rig.driver;
    assert_eq!(d.identify_namespace(1).unwrap(), (4096, 4096));
    let b = d.alloc_data(3 * 4096, 0, true).unwrap();
    let data: Vec<u8> = (0..3 * 4096).map(|i| (i * 7 % 251) as u8).collect();
    b.fill(d.ram(), &data);
    assert_eq!(d.rw(1, true, 4093, 3, &b).unwrap().code(), status::SUCCESS);
    let r = d.alloc_data(3 * 4096, 0, false).unwrap();
    assert_eq!(d.rw(1, false, 4093, 3, &r).unwrap().code(), status::SUCCESS);
    assert_eq!(r.read(d.ram()), data);
    assert_eq!(
        d.rw(1, false, 4094, 3, &r).unwrap().code(),
        status::LBA_OUT_OF_RANGE
    );
}

#[test]
fn unsupported_opcodes_are_invalid_opcode() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = rig(&dir, NotifyMode::Interrupt, 1);
    let d = &mut rig.driver;
    for op in [
        0x03u8,
        0x07,
        0x0d,
        0x10,
        admin::KEEP_ALIVE,
        // 0x7c (Doorbell Buffer Config) is supported: see nvme_dbbuf.rs.
        0x80,
        0xc1,
        0xff,
    ] {
        let e = d.execute(0, Sqe::new(op, 0)).unwrap();
        assert_eq!(e.code(), status::INVALID_OPCODE, "admin {op:#x}");
        assert!(e.dnr());
    }
    for op in [0x04u8, 0x05, 0x0a, 0x0c, 0x0d, 0x11, 0x7f, 0x99, 0xff] {
        let mut s = Sqe::new(op, 0);
        s.set_nsid(1);
        assert_eq!(
            d.execute(1, s).unwrap().code(),
            status::INVALID_OPCODE,
            "io {op:#x}"
        );
    }
    // Still alive.
    d.flush(1).unwrap();
}

#[test]
fn malformed_queue_creation_statuses() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = rig(&dir, NotifyMode::Interrupt, 0);
    let d = &mut rig.driver;
    assert_eq!(d.set_num_queues(2).unwrap(), (2, 2));
    let mem = d.alloc(64 * 1024, 4096).unwrap();
    let cq = |qid: u32, size: u32, flags: u32, iv: u32, prp: u64| {
        let mut s = Sqe::new(admin::CREATE_CQ, 0);
        s.set_prps(prp, 0)
            .set_cdw(10, qid | ((size - 1) << 16))
            .set_cdw(11, flags | (iv << 16));
        s
    };
    let sq = |qid: u32, size: u32, cqid: u32, prp: u64| {
        let mut s = Sqe::new(admin::CREATE_SQ, 0);
        s.set_prps(prp, 0)
            .set_cdw(10, qid | ((size - 1) << 16))
            .set_cdw(11, 1 | (cqid << 16));
        s
    };
    let code = |d: &mut emulated::testing::NvmeDriver, s| d.execute(0, s).unwrap().code();
    assert_eq!(code(d, cq(0, 16, 3, 0, mem)), status::INVALID_QID);
    assert_eq!(
        code(d, cq(3, 16, 3, 0, mem)),
        status::INVALID_QID,
        "beyond granted queues"
    );
    assert_eq!(code(d, cq(1, 1, 3, 0, mem)), status::INVALID_QSIZE);
    assert_eq!(
        code(d, cq(1, 257, 3, 0, mem)),
        status::INVALID_QSIZE,
        "beyond MQES"
    );
    assert_eq!(
        code(d, cq(1, 16, 2, 0, mem)),
        status::INVALID_FIELD,
        "not contiguous"
    );
    assert_eq!(code(d, cq(1, 16, 3, 4, mem)), status::INVALID_VECTOR);
    assert_eq!(
        code(d, cq(1, 16, 3, 0, mem + 8)),
        status::INVALID_FIELD,
        "unaligned base"
    );
    assert_eq!(code(d, cq(1, 16, 3, 1, mem)), status::SUCCESS);
    assert_eq!(code(d, cq(1, 16, 3, 1, mem)), status::INVALID_QID, "exists");
    assert_eq!(code(d, sq(1, 16, 0, mem + 8192)), status::CQ_INVALID);
    assert_eq!(code(d, sq(1, 16, 2, mem + 8192)), status::CQ_INVALID);
    assert_eq!(code(d, sq(0, 16, 1, mem + 8192)), status::INVALID_QID);
    assert_eq!(code(d, sq(1, 0x1000, 1, mem + 8192)), status::INVALID_QSIZE);
    assert_eq!(code(d, sq(1, 16, 1, mem + 8192)), status::SUCCESS);
    let del = |op, qid: u32| {
        let mut s = Sqe::new(op, 0);
        s.set_cdw(10, qid);
        s
    };
    assert_eq!(
        code(d, del(admin::DELETE_CQ, 1)),
        status::INVALID_QUEUE_DELETION
    );
    assert_eq!(code(d, del(admin::DELETE_SQ, 0)), status::INVALID_QID);
    assert_eq!(code(d, del(admin::DELETE_SQ, 2)), status::INVALID_QID);
    assert_eq!(code(d, del(admin::DELETE_CQ, 0)), status::INVALID_QID);
    assert_eq!(code(d, del(admin::DELETE_SQ, 1)), status::SUCCESS);
    assert_eq!(code(d, del(admin::DELETE_CQ, 1)), status::SUCCESS);
    // Number of queues 0xFFFF is invalid.
    let mut s = Sqe::new(admin::SET_FEATURES, 0);
    s.set_cdw(10, u32::from(feat::NUM_QUEUES))
        .set_cdw(11, 0xffff);
    assert_eq!(code(d, s), status::INVALID_FIELD);
}

#[test]
fn out_of_window_prp_is_data_transfer_error_and_ram_untouched() {
    let dir = tempfile::tempdir().unwrap();
    // DMA window: [1 MiB, RAM - 8 MiB); the top 8 MiB and the first MiB are "other memory".
    let win_end = (RAM - (8 << 20)) as u64;
    let mem = TestMemory::with_window(RAM, 1 << 20, win_end);
    mem.fill(0, 1 << 20, 0xa5);
    mem.fill(win_end, 8 << 20, 0x5a);
    let mut rig = rig_with(
        config(&dir, NotifyMode::Interrupt, 512, 8 << 20),
        mem.clone(),
        true,
        1,
    );
    let d = &mut rig.driver;
    let good = d.alloc_data(8192, 0, false).unwrap();
    good.fill(d.ram(), &[0x11; 8192]);
    assert_eq!(d.rw(1, true, 0, 16, &good).unwrap().code(), status::SUCCESS);
    let faults0 = mem.faults();
    let outside = [
        win_end,
        win_end + 4096,
        0x1000,
        u64::MAX - 4095,
        win_end - 4096,
    ];
    for (i, &addr) in outside.iter().enumerate() {
        // PRP1 outside (read => device writes there; write => device reads there).
        for write in [false, true] {
            let mut s = emulated::testing::NvmeDriver::rw_sqe(write, 0, 16, &good);
            s.set_prps(addr, good.prp2);
            let e = d.execute(1, s).unwrap();
            if i == 4 {
                // Straddles the window end: first page inside, PRP2 inside → fine.
                assert_eq!(e.code(), status::SUCCESS);
            } else {
                assert_eq!(
                    e.code(),
                    status::DATA_TRANSFER_ERROR,
                    "prp1 {addr:#x} write {write}"
                );
            }
        }
        // PRP2 as a list pointer outside the window.
        let mut s = emulated::testing::NvmeDriver::rw_sqe(false, 0, 24, &good);
        s.set_prps(good.prp1, addr & !7);
        let e = d.execute(1, s).unwrap();
        if i != 4 {
            assert_eq!(e.code(), status::DATA_TRANSFER_ERROR, "list {addr:#x}");
        }
    }
    // A PRP list inside the window whose entries point outside.
    let list = d.alloc(4096, 4096).unwrap();
    let entries: Vec<u8> = [win_end, win_end + 4096]
        .iter()
        .flat_map(|e| e.to_le_bytes())
        .collect();
    d.ram().write(list, &entries);
    let mut s = emulated::testing::NvmeDriver::rw_sqe(false, 0, 24, &good);
    s.set_prps(good.prp1, list);
    assert_eq!(d.execute(1, s).unwrap().code(), status::DATA_TRANSFER_ERROR);
    // Identify into a bad buffer.
    let mut s = Sqe::new(admin::IDENTIFY, 0);
    s.set_prps(0x2000, 0).set_cdw(10, 1);
    assert_eq!(d.execute(0, s).unwrap().code(), status::DATA_TRANSFER_ERROR);
    assert!(mem.faults() > faults0);
    assert!(rig.ctrl.stats().dma_faults.load(Ordering::Relaxed) > 0);
    assert!(mem.check(0, 1 << 20, 0xa5), "low guard touched");
    assert!(mem.check(win_end, 8 << 20, 0x5a), "high guard touched");
    // PRP offset rules.
    let mut s = emulated::testing::NvmeDriver::rw_sqe(false, 0, 16, &good);
    s.set_prps(good.prp1, good.prp2 + 8);
    assert_eq!(d.execute(1, s).unwrap().code(), status::PRP_OFFSET_INVALID);
    // Controller still works.
    assert_eq!(
        d.rw(1, false, 0, 16, &good).unwrap().code(),
        status::SUCCESS
    );
    assert_eq!(good.read(d.ram()), vec![0x11; 8192]);
}

#[test]
fn lba_out_of_range_and_bad_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = rig_with(
        config(&dir, NotifyMode::Interrupt, 512, 1 << 20),
        TestMemory::new(RAM),
        true,
        1,
    );
    let d = &mut rig.driver;
    let b = d.alloc_data(4096, 0, false).unwrap();
    let nsze = 2048;
    assert_eq!(
        d.rw(1, false, nsze - 8, 8, &b).unwrap().code(),
        status::SUCCESS
    );
    assert_eq!(
        d.rw(1, false, nsze - 7, 8, &b).unwrap().code(),
        status::LBA_OUT_OF_RANGE
    );
    assert_eq!(
        d.rw(1, true, u64::MAX - 2, 8, &b).unwrap().code(),
        status::LBA_OUT_OF_RANGE
    );
    let mut s = emulated::testing::NvmeDriver::rw_sqe(false, 0, 8, &b);
    s.set_nsid(2);
    assert_eq!(d.execute(1, s).unwrap().code(), status::INVALID_NAMESPACE);
    // Write zeroes range check and success.
    let mut s = Sqe::new(io::WRITE_ZEROES, 0);
    s.set_nsid(1).set_cdw(10, (nsze - 1) as u32).set_cdw(12, 1);
    assert_eq!(d.execute(1, s).unwrap().code(), status::LBA_OUT_OF_RANGE);
    // Too large for MDTS (128 pages of 4 KiB = 512 KiB at mdts 7): 0xffff+1 blocks.
    let mut s = emulated::testing::NvmeDriver::rw_sqe(false, 0, 1, &b);
    s.set_cdw(12, 0xffff);
    assert_eq!(d.execute(1, s).unwrap().code(), status::LBA_OUT_OF_RANGE);
}

#[test]
fn write_zeroes_dsm_and_flush_reach_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = rig(&dir, NotifyMode::Interrupt, 1);
    let d = &mut rig.driver;
    let b = d.alloc_data(16384, 0, true).unwrap();
    b.fill(d.ram(), &[0xee; 16384]);
    assert_eq!(d.rw(1, true, 64, 32, &b).unwrap().code(), status::SUCCESS);
    d.flush(1).unwrap();
    let f = std::fs::File::open(dir.path().join("disk.img")).unwrap();
    let mut v = vec![0u8; 16384];
    f.read_exact_at(&mut v, 64 * 512).unwrap();
    assert_eq!(v, vec![0xee; 16384]);
    let mut s = Sqe::new(io::WRITE_ZEROES, 0);
    s.set_nsid(1).set_cdw(10, 72).set_cdw(12, 7);
    assert_eq!(d.execute(1, s).unwrap().code(), status::SUCCESS);
    d.flush(1).unwrap();
    f.read_exact_at(&mut v, 64 * 512).unwrap();
    assert!(v[..4096].iter().all(|&x| x == 0xee));
    assert!(v[4096..8192].iter().all(|&x| x == 0));
    assert!(v[8192..].iter().all(|&x| x == 0xee));
    // DSM deallocate: two ranges, valid → success; out of range → LBA out of range.
    let ranges = d.alloc(4096, 4096).unwrap();
    let mut r = vec![0u8; 32];
    r[4..8].copy_from_slice(&8u32.to_le_bytes());
    r[8..16].copy_from_slice(&64u64.to_le_bytes());
    r[20..24].copy_from_slice(&8u32.to_le_bytes());
    r[24..32].copy_from_slice(&1000u64.to_le_bytes());
    d.ram().write(ranges, &r);
    let mut s = Sqe::new(io::DSM, 0);
    s.set_nsid(1)
        .set_prps(ranges, 0)
        .set_cdw(10, 1)
        .set_cdw(11, 4);
    assert_eq!(d.execute(1, s).unwrap().code(), status::SUCCESS);
    r[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    d.ram().write(ranges, &r);
    assert_eq!(d.execute(1, s).unwrap().code(), status::LBA_OUT_OF_RANGE);
}

#[test]
fn direct_io_backing_if_supported() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(&dir, NotifyMode::Interrupt, 4096, 8 << 20);
    cfg.direct_io = true;
    let mut rig = match LocalRig::with_memory(cfg, TestMemory::new(RAM), true) {
        Ok(r) => r,
        Err(e) => {
            // CI's work tree is on a filesystem with O_DIRECT: there this is a failure.
            assert!(
                std::env::var_os("CI").is_none(),
                "O_DIRECT unsupported in CI: {e}"
            );
            eprintln!("O_DIRECT unsupported here ({e}); skipping");
            return;
        }
    };
    let d = &mut rig.driver;
    d.enable(16).unwrap();
    d.set_num_queues(1).unwrap();
    d.create_io_queue_pair(1, 16, 1).unwrap();
    let b = d.alloc_data(8192, 512, false).unwrap();
    b.fill(d.ram(), &[0x42; 8192]);
    let e = d.rw(1, true, 10, 2, &b).unwrap();
    if e.code() == status::WRITE_FAULT {
        assert!(
            std::env::var_os("CI").is_none(),
            "O_DIRECT write refused in CI"
        );
        eprintln!("O_DIRECT write refused by this filesystem; skipping");
        return;
    }
    assert_eq!(e.code(), status::SUCCESS);
    d.flush(1).unwrap();
    let r = d.alloc_data(8192, 0, true).unwrap();
    assert_eq!(d.rw(1, false, 10, 2, &r).unwrap().code(), status::SUCCESS);
    assert_eq!(r.read(d.ram()), vec![0x42; 8192]);
}

#[test]
fn features_logs_aer_and_abort() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = rig(&dir, NotifyMode::Interrupt, 1);
    let d = &mut rig.driver;
    let set = |fid: u8, v: u32| {
        let mut s = Sqe::new(admin::SET_FEATURES, 0);
        s.set_cdw(10, u32::from(fid)).set_cdw(11, v);
        s
    };
    let get = |fid: u8, sel: u32| {
        let mut s = Sqe::new(admin::GET_FEATURES, 0);
        s.set_cdw(10, u32::from(fid) | (sel << 8));
        s
    };
    d.execute_ok(0, set(feat::VOLATILE_WC, 0)).unwrap();
    assert_eq!(d.execute_ok(0, get(feat::VOLATILE_WC, 0)).unwrap().dw0, 0);
    assert_eq!(
        d.execute_ok(0, get(feat::VOLATILE_WC, 1)).unwrap().dw0,
        1,
        "default"
    );
    d.execute_ok(0, set(feat::VOLATILE_WC, 1)).unwrap();
    d.execute_ok(0, set(feat::IRQ_COALESCING, 0x0203)).unwrap();
    assert_eq!(
        d.execute_ok(0, get(feat::IRQ_COALESCING, 0)).unwrap().dw0,
        0x0203
    );
    d.execute_ok(0, set(feat::IRQ_COALESCING, 0)).unwrap();
    d.execute_ok(0, set(feat::ASYNC_EVENT_CONFIG, 0x1ff))
        .unwrap();
    assert_eq!(
        d.execute_ok(0, get(feat::ASYNC_EVENT_CONFIG, 0))
            .unwrap()
            .dw0,
        0x1ff
    );
    assert_eq!(
        d.execute(0, set(0x7e, 1)).unwrap().code(),
        status::INVALID_FIELD
    );
    let mut saved = set(feat::VOLATILE_WC, 1);
    saved.set_cdw(10, u32::from(feat::VOLATILE_WC) | (1 << 31));
    assert_eq!(
        d.execute(0, saved).unwrap().code(),
        status::FEATURE_NOT_SAVEABLE
    );
    // Log pages.
    let buf = d.alloc_data(512, 0, false).unwrap();
    let log = |lid: u32, dwords: u32, buf: &DataBuf| {
        let mut s = Sqe::new(admin::GET_LOG_PAGE, 0);
        s.set_nsid(0xffff_ffff)
            .set_prps(buf.prp1, buf.prp2)
            .set_cdw(10, lid | ((dwords - 1) << 16));
        s
    };
    let b = d.alloc_data(4096, 0, false).unwrap();
    d.rw(1, true, 0, 8, &b).unwrap();
    d.execute_ok(0, log(2, 128, &buf)).unwrap();
    let smart = buf.read(d.ram());
    assert_eq!(smart[3], 100, "available spare");
    assert_eq!(
        u64::from_le_bytes(smart[80..88].try_into().unwrap()),
        1,
        "host writes"
    );
    d.execute_ok(0, log(3, 128, &buf)).unwrap();
    let fw = buf.read(d.ram());
    assert_eq!(fw[0], 1);
    assert_eq!(&fw[8..11], b"0.9");
    d.execute_ok(0, log(1, 16, &buf)).unwrap();
    assert_eq!(
        d.execute(0, log(0x42, 16, &buf)).unwrap().code(),
        status::INVALID_LOG_PAGE
    );
    // AERs stay outstanding; the fifth is refused.
    for _ in 0..4 {
        d.submit(0, Sqe::new(admin::ASYNC_EVENT, 0)).unwrap();
    }
    assert_eq!(
        d.execute(0, Sqe::new(admin::ASYNC_EVENT, 0))
            .unwrap()
            .code(),
        status::AER_LIMIT_EXCEEDED
    );
    let mut a = Sqe::new(admin::ABORT, 0);
    a.set_cdw(10, 1 | (5 << 16));
    assert_eq!(d.execute_ok(0, a).unwrap().dw0 & 1, 1, "not aborted");
    // Identify with bad CNS / nsid.
    let mut s = Sqe::new(admin::IDENTIFY, 0);
    s.set_prps(b.prp1, 0).set_cdw(10, 0x55);
    assert_eq!(d.execute(0, s).unwrap().code(), status::INVALID_FIELD);
    s.set_cdw(10, 0).set_nsid(7);
    assert_eq!(d.execute(0, s).unwrap().code(), status::INVALID_NAMESPACE);
}

#[test]
fn interrupt_coalescing_aggregates() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = rig(&dir, NotifyMode::Interrupt, 1);
    let d = &mut rig.driver;
    // Threshold 8 (0-based 7), time 10 ms.
    let mut s = Sqe::new(admin::SET_FEATURES, 0);
    s.set_cdw(10, u32::from(feat::IRQ_COALESCING))
        .set_cdw(11, 7 | (100 << 8));
    d.execute_ok(0, s).unwrap();
    let before = rig.irq.count(1);
    let bufs: Vec<_> = (0..32)
        .map(|_| d.alloc_data(4096, 0, false).unwrap())
        .collect();
    for (i, b) in bufs.iter().enumerate() {
        d.push(
            1,
            emulated::testing::NvmeDriver::rw_sqe(false, i as u64 * 8, 8, b),
        )
        .unwrap();
    }
    d.ring(1).unwrap();
    let mut out = Vec::new();
    d.wait(1, &mut out, 32).unwrap();
    let irqs = rig.irq.count(1) - before;
    assert!(
        (1..=8).contains(&irqs),
        "{irqs} interrupts for 32 completions"
    );
    // A single command still completes (time limit fires).
    assert_eq!(
        d.rw(1, false, 0, 8, &bufs[0]).unwrap().code(),
        status::SUCCESS
    );
}

#[test]
fn intx_mode_and_masking() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&dir, NotifyMode::Interrupt, 512, 8 << 20);
    let mem = TestMemory::new(RAM);
    let mut rig = LocalRig::with_memory(cfg, mem, true).unwrap();
    rig.irq.set_mode(InterruptMode::Intx);
    let d = &mut rig.driver;
    d.enable(16).unwrap();
    d.identify_controller().unwrap();
    assert!(rig.irq.intx_assertions() >= 1);
    // After the CQ head doorbell the line drops.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while rig.irq.intx_level() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(!rig.irq.intx_level());
    // Masked (trapped INTMS write): completions do not assert.
    let trapped = TrappedBar(rig.ctrl.clone() as Arc<dyn DeviceModel>);
    use emulated::testing::GuestBar;
    trapped.write32(0x0c, 1);
    assert_eq!(trapped.read32(0x0c), 1);
    let n = rig.irq.intx_assertions();
    d.submit(0, Sqe::new(admin::IDENTIFY, 0)).unwrap(); // bad (no PRP) but completes
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(rig.irq.intx_assertions(), n);
    // Unmask: the pending completion asserts INTx.
    trapped.write32(0x10, 1);
    assert_eq!(trapped.read32(0x0c), 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while rig.irq.intx_assertions() == n && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(rig.irq.intx_assertions() > n);
}

#[test]
fn trapped_bar_path_and_reset() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&dir, NotifyMode::Interrupt, 512, 8 << 20);
    let mem = TestMemory::new(RAM);
    let regs = Arc::new(emulated::HeapRegisters::new(
        emulated::nvme::BAR0_SIZE as usize,
    ));
    let irq = emulated::testing::CountingInterrupts::new(4);
    let ctrl = Arc::new(
        emulated::nvme::NvmeController::new(cfg, regs.clone(), mem.clone(), irq.clone()).unwrap(),
    );
    ctrl.start().unwrap();
    let bar = Arc::new(TrappedBar(ctrl.clone()));
    let mut d = emulated::testing::NvmeDriver::new(
        bar.clone(),
        mem.clone(),
        irq.clone(),
        emulated::testing::DriverConfig {
            ram_base: 1 << 20,
            ram_len: 32 << 20,
            use_interrupts: true,
            timeout: std::time::Duration::from_secs(10),
        },
    );
    use emulated::testing::GuestBar;
    let cap = bar.read64(0);
    assert_eq!(cap & 0xffff, 255, "MQES");
    assert_ne!(cap & (1 << 37), 0, "CSS NVM");
    assert_eq!((cap >> 32) & 0xf, 0, "DSTRD");
    bar.write64(0, 0); // read-only
    assert_eq!(bar.read64(0), cap);
    // Enable without admin queue sizes: controller fatal status.
    bar.write32(0x14, 1);
    assert_ne!(bar.read32(0x1c) & 2, 0, "CFS");
    bar.write32(0x14, 0);
    d.enable(16).unwrap();
    d.set_num_queues(1).unwrap();
    d.create_io_queue_pair(1, 16, 1).unwrap();
    let b = d.alloc_data(4096, 0, false).unwrap();
    assert_eq!(d.rw(1, true, 0, 8, &b).unwrap().code(), status::SUCCESS);
    // FLR clears everything; re-enabling works.
    ctrl.reset();
    assert_eq!(bar.read32(0x14), 0);
    assert_eq!(bar.read32(0x1c), 0);
    d.enable(16).unwrap();
    d.identify_controller().unwrap();
    // Controller reset via CC.EN = 0 drops I/O queues.
    d.disable().unwrap();
    d.enable(16).unwrap();
    d.set_num_queues(1).unwrap();
    d.create_io_queue_pair(1, 16, 1).unwrap();
    assert_eq!(d.rw(1, false, 0, 8, &b).unwrap().code(), status::SUCCESS);
    d.shutdown().unwrap();
    drop(d);
    // The model surface.
    let cs = ctrl.config_space();
    assert_eq!(&cs[0x09..0x0c], &[0x02, 0x08, 0x01]);
    assert_eq!(ctrl.bars()[0].size, 0x4000);
    assert_eq!(ctrl.msix().unwrap().vectors, 4);
}

#[test]
fn polling_mode_without_notifications_and_queue_deletion() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = rig(&dir, NotifyMode::Polling, 2);
    let d = &mut rig.driver;
    let b = d.alloc_data(65536, 0, false).unwrap();
    for i in 0..20u64 {
        assert_eq!(
            d.rw(2, i % 2 == 0, i * 128, 128, &b).unwrap().code(),
            status::SUCCESS
        );
    }
    d.delete_io_queue_pair(2).unwrap();
    assert!(matches!(
        d.rw(2, false, 0, 8, &b),
        Err(emulated::testing::DriverError::NoQueue(2))
    ));
    d.create_io_queue_pair(2, 32, 2).unwrap();
    assert_eq!(d.rw(2, false, 0, 8, &b).unwrap().code(), status::SUCCESS);
}

#[test]
fn config_validation() {
    let dir = tempfile::tempdir().unwrap();
    let regs = Arc::new(emulated::HeapRegisters::new(0x4000));
    let mem = TestMemory::new(1 << 20);
    let irq = emulated::testing::CountingInterrupts::new(4);
    let mk = |c: NvmeConfig| {
        emulated::nvme::NvmeController::new(c, regs.clone(), mem.clone(), irq.clone())
    };
    let base = config(&dir, NotifyMode::Interrupt, 512, 1 << 20);
    assert!(mk(NvmeConfig {
        lba_size: 1024,
        ..base.clone()
    })
    .is_err());
    assert!(mk(NvmeConfig {
        size: Some(100),
        ..base.clone()
    })
    .is_err());
    assert!(mk(NvmeConfig {
        serial: "x".repeat(21),
        ..base.clone()
    })
    .is_err());
    let small = Arc::new(emulated::HeapRegisters::new(0x1000));
    let e = emulated::nvme::NvmeController::new(base.clone(), small, mem.clone(), irq.clone());
    assert!(matches!(
        e,
        Err(emulated::DeviceError::RegisterMemoryTooSmall { .. })
    ));
    assert!(mk(base).is_ok());
}

/// INTx resample: after the guest's EOI the controller asserts again while a completion is
/// still unacknowledged (CQ head behind the tail), and not once the CQ is drained.
#[test]
fn intx_resample_reasserts_while_completions_are_pending() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&dir, NotifyMode::Interrupt, 512, 8 << 20);
    let mut rig = LocalRig::with_memory(cfg, TestMemory::new(RAM), true).unwrap();
    rig.irq.set_mode(InterruptMode::Intx);
    let d = &mut rig.driver;
    d.enable(16).unwrap();
    for _ in 0..2 {
        let mut s = Sqe::new(admin::GET_FEATURES, 0);
        s.dw[10] = u32::from(feat::NUM_QUEUES);
        d.push(0, s).unwrap();
    }
    d.ring(0).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while rig.ctrl.stats().completions.load(Ordering::Relaxed) < 2
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(rig.ctrl.stats().completions.load(Ordering::Relaxed), 2);
    assert!(rig.irq.intx_level());
    let trapped = TrappedBar(rig.ctrl.clone() as Arc<dyn DeviceModel>);
    use emulated::testing::GuestBar;
    // The guest took one completion (CQ0 head = 1) and EOIed: still pending, asserted again.
    trapped.write32(0x1004, 1);
    let n = rig.irq.intx_signals();
    rig.ctrl.intx_resample();
    assert_eq!(rig.irq.intx_signals(), n + 1);
    assert!(rig.irq.intx_level());
    // Both taken: the resample finds nothing pending and the line stays low.
    trapped.write32(0x1004, 2);
    rig.ctrl.intx_resample();
    assert_eq!(rig.irq.intx_signals(), n + 1);
    assert!(!rig.irq.intx_level());
}

/// A namespace at `ns_offset` (an SR-IOV function's slice of a shared backing file): LBA 0
/// is at the offset, writes land only inside the slice, the last block of the slice is the
/// last LBA, and nothing below or past the slice is read or written.
#[test]
fn namespace_slice_at_an_offset_stays_inside_it() {
    let dir = tempfile::tempdir().unwrap();
    let slice: u64 = 1 << 20;
    let off = 2 * slice;
    // The neighbours' bytes, which the controller must never touch.
    let path = dir.path().join("disk.img");
    std::fs::write(&path, vec![0x11u8; (4 * slice) as usize]).unwrap();
    let cfg = NvmeConfig {
        ns_offset: off,
        ..config(&dir, NotifyMode::Interrupt, 512, slice)
    };
    let mut rig = rig_with(cfg, TestMemory::new(RAM), true, 1);
    let d = &mut rig.driver;
    let (nsze, lba) = d.identify_namespace(1).unwrap();
    assert_eq!((nsze, lba), (slice / 512, 512));
    let b = d.alloc_data(4096, 0, false).unwrap();
    b.fill(d.ram(), &[0xab; 4096]);
    assert_eq!(d.rw(1, true, 0, 8, &b).unwrap().code(), status::SUCCESS);
    assert_eq!(
        d.rw(1, true, nsze - 8, 8, &b).unwrap().code(),
        status::SUCCESS
    );
    assert_eq!(
        d.rw(1, true, nsze - 7, 8, &b).unwrap().code(),
        status::LBA_OUT_OF_RANGE
    );
    let mut s = Sqe::new(io::WRITE_ZEROES, 0);
    s.set_nsid(1).set_cdw(10, 8).set_cdw(12, 7);
    assert_eq!(d.execute(1, s).unwrap().code(), status::SUCCESS);
    // A read of LBA 0 returns the slice's first block, not the file's.
    b.fill(d.ram(), &[0; 4096]);
    assert_eq!(d.rw(1, false, 0, 8, &b).unwrap().code(), status::SUCCESS);
    assert_eq!(b.read(d.ram()), vec![0xab; 4096]);
    d.flush(1).unwrap();
    let file = std::fs::read(&path).unwrap();
    assert_eq!(file.len() as u64, 4 * slice, "the file was not resized");
    let (o, s) = (off as usize, slice as usize);
    assert!(file[..o].iter().all(|&x| x == 0x11), "below the slice");
    assert!(file[o + s..].iter().all(|&x| x == 0x11), "past the slice");
    assert_eq!(&file[o..o + 4096], &[0xab; 4096][..]);
    assert!(file[o + 4096..o + 8192].iter().all(|&x| x == 0));
    assert_eq!(&file[o + s - 4096..o + s], &[0xab; 4096][..]);
    // A misaligned offset is refused by name.
    let regs = Arc::new(emulated::HeapRegisters::new(0x4000));
    let e = emulated::nvme::NvmeController::new(
        NvmeConfig {
            ns_offset: 100,
            ..config(&dir, NotifyMode::Interrupt, 512, slice)
        },
        regs,
        TestMemory::new(1 << 20),
        emulated::testing::CountingInterrupts::new(4),
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("namespace offset 0x64"), "{e}");
}
