//! The emulated NVMe's Controller Memory Buffer through the real `lenderd` (`cmb=2M`): the
//! borrower turns it on with its own bus address for it (CMBMSC.CBA), puts its I/O
//! submission queue and a write buffer in it (stores through the lender's BAR window on
//! shm, BAR_WRITE messages on tcp), reads data back both into its RAM and into the CMB, and
//! checks every byte; the lease's end clears the buffer for the next borrower.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use emulated::nvme::cmb::CMB_OFFSET;
use emulated::nvme::spec::{io, Sqe};
use emulated::testing::NvmeDriver;
use ntb::FabricKind;

const DEV: &str = "0000:82:00.0";
const CMB: u64 = 2 << 20;
/// The borrower's bus address for the CMB: outside its RAM window (IOVA 0..RAM).
const CBA: u64 = 0x10_0000_0000;
const RAM: u64 = 16 << 20;

fn cmb_io(d: &mut NvmeDriver) {
    d.enable(32).unwrap();
    let (off, size, sz) = d
        .enable_cmb(CBA)
        .unwrap()
        .expect("the controller has a cmb");
    assert_eq!((off, size, sz & 0x1f), (CMB_OFFSET, CMB, 0x1f));
    d.set_num_queues(1).unwrap();
    d.create_io_queue_pair_cmb(1, 16, 1, CMB_OFFSET, CBA)
        .unwrap();
    // 8 KiB of write data in the CMB (PRP1 + PRP2, both there).
    let data: Vec<u8> = (0..8192u32).map(|i| (i ^ (i >> 8)) as u8).collect();
    d.bar_write_bytes(CMB_OFFSET + 0x4000, &data);
    let mut w = Sqe::new(io::WRITE, 0);
    w.set_nsid(1)
        .set_prps(CBA + 0x4000, CBA + 0x5000)
        .set_cdw(10, 40)
        .set_cdw(12, 15);
    assert_eq!(d.execute(1, w).unwrap().code(), 0);
    d.flush(1).unwrap();
    // Back into host RAM through the CMB-resident SQ.
    let b = d.alloc_data(8192, 0, false).unwrap();
    assert_eq!(d.rw(1, false, 40, 16, &b).unwrap().code(), 0);
    assert!(b.read(d.ram()) == data, "read into ram");
    // And into the CMB.
    let mut r = Sqe::new(io::READ, 0);
    r.set_nsid(1)
        .set_prps(CBA + 0x8000, CBA + 0x9000)
        .set_cdw(10, 40)
        .set_cdw(12, 15);
    assert_eq!(d.execute(1, r).unwrap().code(), 0);
    assert!(
        d.bar_read_bytes(CMB_OFFSET + 0x8000, 8192) == data,
        "read into the cmb"
    );
    d.shutdown().unwrap();
}

fn run(kind: FabricKind, bar: BarPath) {
    let c = cluster(kind);
    let disk = c.dir.path().join("disk.img");
    let _d = start_lenderd(
        &c,
        "cmb",
        &[format!("{DEV}=nvme:path={},size=8M,cmb=2M", disk.display())],
        TokenVia::Flag,
    );
    {
        let mut rig = lent_rig(&c, DEV, RAM, bar, &[], 2, true);
        let b0 = rig.lease.info().bars.iter().find(|b| b.index == 0).unwrap();
        assert_eq!(
            b0.size,
            4 << 20,
            "bar0 holds registers, doorbells and the cmb"
        );
        cmb_io(&mut rig.driver);
        let st = rig.client.status().unwrap();
        assert_eq!(st.devices[0].iommu_faults, 0, "{st:?}");
    }
    // The next borrower finds the CMB off and empty.
    let t0 = std::time::Instant::now();
    let rig = loop {
        let client = connect(&c);
        match client.borrow(DEV, "vm1") {
            Ok(l) => {
                drop(l);
                drop(client);
                break lent_rig(&c, DEV, RAM, bar, &[], 2, true);
            }
            Err(_) if t0.elapsed() < std::time::Duration::from_secs(10) => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            Err(e) => panic!("{e}"),
        }
    };
    let d = &rig.driver;
    assert_eq!(d.bar().read32(emulated::nvme::spec::REG_CMBSZ), 0);
    assert!(d.bar_read_bytes(CMB_OFFSET, 0x4000).iter().all(|&x| x == 0));
}

#[test]
fn cmb_over_shm_direct_window() {
    run(FabricKind::Shm, BarPath::Direct { notify: true });
}

#[test]
fn cmb_over_tcp_trapped() {
    run(FabricKind::Tcp, BarPath::Trapped);
}
