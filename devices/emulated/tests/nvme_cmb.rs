//! The Controller Memory Buffer of the emulated NVMe (NVMe 1.4 scheme): CAP.CMBS, CMBLOC and
//! CMBSZ hidden until CMBMSC.CRE, the host's bus address in CMBMSC.CBA with CMSE; an I/O
//! submission queue, PRP lists, write data and read data in the CMB (SQS, LISTS, WDS, RDS);
//! CMBMSC kept across a controller reset, cleared with the buffer's contents by a function
//! reset.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::FileExt;

use common::*;
use emulated::nvme::cmb::{CMBMSC_CMSE, CMBMSC_CRE, CMB_OFFSET};
use emulated::nvme::spec::{io, status, Sqe, REG_CAP, REG_CMBLOC, REG_CMBMSC, REG_CMBSZ};
use emulated::nvme::NvmeConfig;
use emulated::testing::TestMemory;
use emulated::{DeviceModel, NotifyMode};

const CMB: u64 = 2 << 20;
/// The bus address the "host" gives the CMB: far outside its RAM, so nothing there is RAM.
const CBA: u64 = 0x40_0000_0000;

fn cmb_config(dir: &tempfile::TempDir) -> NvmeConfig {
    NvmeConfig {
        cmb_size: CMB,
        ..config(dir, NotifyMode::Interrupt, 512, 8 << 20)
    }
}

#[test]
fn cmb_registers_follow_the_nvme_1_4_scheme() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = rig_with(cmb_config(&dir), TestMemory::new(RAM), true, 0);
    assert_eq!(rig.ctrl.bar0_size(), 4 << 20);
    assert_eq!(rig.ctrl.bars()[0].size, 4 << 20);
    let d = &mut rig.driver;
    assert_ne!(d.bar().read64(REG_CAP) & (1 << 57), 0, "cap.cmbs");
    assert_eq!(d.bar().read32(REG_CMBSZ), 0, "hidden before cre");
    assert_eq!(d.bar().read32(REG_CMBLOC), 0);
    let (off, size, sz) = d.enable_cmb(CBA).unwrap().unwrap();
    assert_eq!((off, size), (CMB_OFFSET, CMB));
    assert_eq!(sz & 0x1f, 0x1f, "sqs cqs lists rds wds");
    assert_eq!(d.bar().read32(REG_CMBLOC) & 7, 0, "bir 0");
    // CMBLOC/CMBSZ are read-only: an exact write is ignored.
    rig.ctrl.bar_write(0, REG_CMBSZ, &0u32.to_le_bytes());
    assert_eq!(rig.driver.bar().read32(REG_CMBSZ), sz);

    // Without a CMB: no CMBS, nothing to enable, the 16 KiB BAR.
    let dir2 = tempfile::tempdir().unwrap();
    let mut plain = rig_with(
        config(&dir2, NotifyMode::Interrupt, 512, 1 << 20),
        TestMemory::new(RAM),
        true,
        0,
    );
    assert_eq!(plain.ctrl.bar0_size(), 0x4000);
    assert_eq!(plain.driver.bar().read64(REG_CAP) & (1 << 57), 0);
    assert_eq!(plain.driver.enable_cmb(CBA).unwrap(), None);

    // A bad size is refused by name.
    let e = emulated::nvme::NvmeController::new(
        NvmeConfig {
            cmb_size: 3 << 20,
            ..cmb_config(&dir)
        },
        std::sync::Arc::new(emulated::HeapRegisters::new(8 << 20)),
        TestMemory::new(1 << 20),
        emulated::testing::CountingInterrupts::new(4),
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("cmb size 0x300000"), "{e}");
}

/// The I/O SQ, PRP lists and data buffers in the CMB; completions in host RAM.
#[test]
fn sq_prp_lists_and_data_in_the_cmb() {
    let dir = tempfile::tempdir().unwrap();
    let mut rig = rig_with(cmb_config(&dir), TestMemory::new(RAM), true, 0);
    let d = &mut rig.driver;
    d.enable_cmb(CBA).unwrap().unwrap();
    let (sq, cq) = d.set_num_queues(1).unwrap();
    assert!(sq >= 1 && cq >= 1);
    // SQ at the start of the CMB.
    d.create_io_queue_pair_cmb(1, 16, 1, CMB_OFFSET, CBA)
        .unwrap();

    // 16 KiB of write data at CMB + 64 KiB (PRP1 + a PRP list at CMB + 32 KiB).
    let data: Vec<u8> = (0..16384u32).map(|i| (i * 7 + 3) as u8).collect();
    let (wdata, wlist) = (0x10000u64, 0x8000u64);
    d.bar_write_bytes(CMB_OFFSET + wdata, &data);
    let list: Vec<u8> = (1..4u64)
        .flat_map(|p| (CBA + wdata + p * 4096).to_le_bytes())
        .collect();
    d.bar_write_bytes(CMB_OFFSET + wlist, &list);
    let mut w = Sqe::new(io::WRITE, 0);
    w.set_nsid(1)
        .set_prps(CBA + wdata, CBA + wlist)
        .set_cdw(10, 100)
        .set_cdw(12, 31);
    assert_eq!(d.execute(1, w).unwrap().code(), status::SUCCESS);
    d.flush(1).unwrap();
    let f = std::fs::File::open(dir.path().join("disk.img")).unwrap();
    let mut got = vec![0u8; 16384];
    f.read_exact_at(&mut got, 100 * 512).unwrap();
    assert!(got == data, "the file holds the data written from the cmb");

    // Read it back into the CMB (another PRP list there).
    let (rdata, rlist) = (0x20000u64, 0x9000u64);
    let list: Vec<u8> = (1..4u64)
        .flat_map(|p| (CBA + rdata + p * 4096).to_le_bytes())
        .collect();
    d.bar_write_bytes(CMB_OFFSET + rlist, &list);
    let mut r = Sqe::new(io::READ, 0);
    r.set_nsid(1)
        .set_prps(CBA + rdata, CBA + rlist)
        .set_cdw(10, 100)
        .set_cdw(12, 31);
    assert_eq!(d.execute(1, r).unwrap().code(), status::SUCCESS);
    assert!(d.bar_read_bytes(CMB_OFFSET + rdata, 16384) == data);

    // Host RAM data through the same CMB-resident queue.
    let b = d.alloc_data(4096, 0, false).unwrap();
    assert_eq!(d.rw(1, false, 100, 8, &b).unwrap().code(), status::SUCCESS);
    assert!(b.read(d.ram()) == data[..4096]);

    // A buffer running past the end of the CMB: the page after it is the host's, where this
    // host has no RAM, so the command ends with Data Transfer Error.
    let mut bad = Sqe::new(io::WRITE, 0);
    bad.set_nsid(1)
        .set_prps(CBA + CMB - 2048, CBA + CMB)
        .set_cdw(10, 100)
        .set_cdw(12, 7);
    assert_eq!(
        d.execute(1, bad).unwrap().code(),
        status::DATA_TRANSFER_ERROR
    );

    // Controller reset (CC.EN 1 -> 0): CMBMSC and the buffer stay.
    d.disable().unwrap();
    assert_eq!(d.bar().read64(REG_CMBMSC), CMBMSC_CRE | CMBMSC_CMSE | CBA);
    assert_ne!(d.bar().read32(REG_CMBSZ), 0);
    assert!(d.bar_read_bytes(CMB_OFFSET + rdata, 16) == data[..16]);

    // Function reset: decoding off, registers hidden, contents zeroed.
    rig.ctrl.reset();
    let d = &rig.driver;
    assert_eq!(d.bar().read64(REG_CMBMSC), 0);
    assert_eq!(d.bar().read32(REG_CMBSZ), 0);
    assert!(d
        .bar_read_bytes(CMB_OFFSET + rdata, 16384)
        .iter()
        .all(|&x| x == 0));
    assert!(
        d.bar_read_bytes(CMB_OFFSET, 64).iter().all(|&x| x == 0),
        "sq gone"
    );
}
