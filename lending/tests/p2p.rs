//! Peer-to-peer DMA between two leases of one borrower on one lender (protocol version 5; shm),
//! against an in-process lender with three dmatest devices on the shm fabric.
//!
//! The borrower plays the VMM: one session per device (as lendvm keeps one link per
//! device), guest RAM in a memfd exported and mapped at IOVA = GPA for the source device, and
//! the target's BAR0 "placed" at a guest-physical address the borrower picks. The source
//! dmatest copies RAM → target BAR (and its own buffer → target BAR); the data is verified
//! in the target's BAR memory through the target's own BAR window.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use emulated::dmatest::{BUF_OFFSET, BUF_SIZE, CMD_SRC_BUF, REG_CMD};
use emulated::NotifyMode;
use lending::backend::emulated::EmulatedBackend;
use lending::client::ClientError;
use lending::inventory::Inventory;
use lending::iommu::IommuDomain;
use lending::protocol::{code, opcode, P2pMap, Request};
use lending::server::{BackgroundLender, Lender};
use lending::LenderClient;
use ntb::{ClusterConfig, Fabric, Message, SocketFabric};

// The shared test harness (std only), as the other tests of this crate include it.
#[path = "../src/testing.rs"]
mod testing;

mod p2p_common;
use p2p_common::*;

const TOKEN: &str = "p2p-cluster-token-8f3a61c2d4b7e9051a6c";
const DEV_A: &str = "0000:00:0a.0";
const DEV_B: &str = "0000:00:0b.0";
const DEV_C: &str = "0000:00:0c.0";
/// Where the borrower placed the target's BAR0.
const BAR_GPA: u64 = 0xc000_0000;
/// Where it moves it to.
const BAR_GPA2: u64 = 0xc010_0000;
/// Neither RAM nor a BAR.
const HOLE_GPA: u64 = 0xd000_0000;

struct Setup {
    _dir: tempfile::TempDir,
    cfg: ClusterConfig,
    lender: Arc<Lender>,
    _bg: BackgroundLender,
    a: Arc<EmulatedBackend>,
}

fn setup() -> Setup {
    let mk = |n: &str| Arc::new(EmulatedBackend::dmatest(n, NotifyMode::Interrupt).unwrap());
    let (a, b, c) = (mk("p2p-a"), mk("p2p-b"), mk("p2p-c"));
    setup_with(
        a.clone(),
        vec![(DEV_B.to_string(), b as _), (DEV_C.to_string(), c as _)],
        tempfile::tempdir().unwrap(),
    )
}

/// An in-process lender on the shm fabric lending dmatest `a` at [`DEV_A`] and `others`,
/// with the cluster file (nodes lender, vmm, intruder) in `dir`.
fn setup_with(
    a: Arc<EmulatedBackend>,
    others: Vec<(String, Arc<dyn lending::backend::DeviceBackend>)>,
    dir: tempfile::TempDir,
) -> Setup {
    let path = testing::shm_cluster_file(dir.path(), &["lender", "vmm", "intruder"]);
    let cfg = ClusterConfig::load(&path).unwrap();
    let mut devices: Vec<(String, Arc<dyn lending::backend::DeviceBackend>)> =
        vec![(DEV_A.to_string(), a.clone() as _)];
    devices.extend(others);
    let inv = Arc::new(Inventory::new(devices).unwrap());
    let listener = SocketFabric::from_cluster(&cfg, "lender")
        .unwrap()
        .listen()
        .unwrap();
    let lender = Lender::new(inv, "lender", TOKEN);
    let bg = BackgroundLender::start(Arc::clone(&lender), listener).unwrap();
    Setup {
        _dir: dir,
        cfg,
        lender,
        _bg: bg,
        a,
    }
}

fn client(s: &Setup, node: &str) -> LenderClient {
    LenderClient::connect(&s.cfg, node, "lender", TOKEN, "p2p-test").unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn code_of(e: &ClientError) -> Option<u32> {
    e.code()
}

#[test]
fn p2p_copy_lands_in_the_target_bar() {
    let s = setup();
    let (ca, cb) = (client(&s, "vmm"), client(&s, "vmm"));
    let (la, lb) = (
        ca.borrow(DEV_A, "vm0").unwrap(),
        cb.borrow(DEV_B, "vm0").unwrap(),
    );
    let ram = ram_for(&ca, &la);
    let data = pattern(0x3000, 7);
    ram.mem.write_at(0x2000, &data).unwrap();
    la.p2p_map(lb.id(), 0, BAR_GPA).unwrap();
    assert_eq!(s.lender.p2p_live_into(lb.id()), 1);

    // RAM -> target's buffer, through the target's BAR at its guest-physical address.
    let dst = BAR_GPA + BUF_OFFSET + 0x100;
    let (err, faults) = copy(&la, 0, RAM_GPA + 0x2000, dst, 0x3000);
    assert!(!err, "p2p copy failed (faults {faults})");
    let b_bar = lb.bar_window(0).unwrap();
    assert_eq!(read_win(b_bar.as_ref(), BUF_OFFSET + 0x100, 0x3000), data);

    // The source's own buffer -> the target's buffer (device to device, no RAM at all).
    let a_bar = la.bar_window(0).unwrap();
    let data2 = pattern(BUF_SIZE as usize, 99);
    a_bar.write_at(BUF_OFFSET, &data2).unwrap();
    let (err, _) = copy(&la, CMD_SRC_BUF, 0, BAR_GPA + BUF_OFFSET, BUF_SIZE as u32);
    assert!(!err);
    assert_eq!(
        read_win(b_bar.as_ref(), BUF_OFFSET, BUF_SIZE as usize),
        data2
    );

    // Target BAR -> RAM (a peer read).
    let (err, _) = copy(&la, 0, BAR_GPA + BUF_OFFSET, RAM_GPA, 0x1000);
    assert!(!err);
    let mut back = vec![0; 0x1000];
    ram.mem.read_at(0, &mut back).unwrap();
    assert_eq!(back, data2[..0x1000]);
    assert_eq!(s.a.soft_iommu().fault_count(), 0);

    // Unmapped: gone from the source's domain.
    la.p2p_unmap(lb.id(), 0).unwrap();
    assert_eq!(s.lender.p2p_live_into(lb.id()), 0);
    let (err, faults) = copy(&la, 0, RAM_GPA, dst, 0x100);
    assert!(err && faults == 1, "after unmap: err {err} faults {faults}");
}

#[test]
fn dma_to_neither_ram_nor_a_borrowed_bar_is_refused_and_counted() {
    let s = setup();
    let (ca, cb) = (client(&s, "vmm"), client(&s, "vmm"));
    let (la, lb) = (
        ca.borrow(DEV_A, "vm0").unwrap(),
        cb.borrow(DEV_B, "vm0").unwrap(),
    );
    let ram = ram_for(&ca, &la);
    la.p2p_map(lb.id(), 0, BAR_GPA).unwrap();
    let before = la.counters().unwrap().unwrap().iommu_faults;
    ram.mem.write_at(0, &[0x5a; 0x100]).unwrap();
    // A hole, and a write that runs past the end of the mapped BAR.
    let (err, faults) = copy(&la, 0, RAM_GPA, HOLE_GPA, 0x100);
    assert!(err, "dma into a hole must fail");
    assert_eq!(faults, 1);
    let (err, faults) = copy(&la, 0, RAM_GPA, BAR_GPA + 0x10000 - 0x80, 0x100);
    assert!(err, "dma past the bar must fail");
    assert_eq!(faults, 2);
    // The target's registers are not peer memory: a write to its CMD register is refused
    // (it would bypass the device's register write path).
    let (err, faults) = copy(&la, 0, RAM_GPA, BAR_GPA + REG_CMD, 4);
    assert!(err, "dma into the peer's registers must fail");
    assert_eq!(faults, 3);
    let c = la.counters().unwrap().unwrap();
    assert_eq!(c.iommu_faults - before, 3, "{c:?}");
    // Nothing was written at the end of the target's BAR.
    let b_bar = lb.bar_window(0).unwrap();
    assert_eq!(
        read_win(b_bar.as_ref(), 0x10000 - 0x80, 0x80),
        vec![0; 0x80]
    );
}

#[test]
fn relocated_target_bar_works_at_the_new_address_and_not_the_old() {
    let s = setup();
    let (ca, cb) = (client(&s, "vmm"), client(&s, "vmm"));
    let (la, lb) = (
        ca.borrow(DEV_A, "vm0").unwrap(),
        cb.borrow(DEV_B, "vm0").unwrap(),
    );
    let ram = ram_for(&ca, &la);
    let data = pattern(0x800, 3);
    ram.mem.write_at(0, &data).unwrap();
    la.p2p_map(lb.id(), 0, BAR_GPA).unwrap();
    assert!(!copy(&la, 0, RAM_GPA, BAR_GPA + BUF_OFFSET, 0x800).0);
    // The borrower moves the BAR: unmap at the old address first, map at the new one.
    la.p2p_unmap(lb.id(), 0).unwrap();
    la.p2p_map(lb.id(), 0, BAR_GPA2).unwrap();
    let data2 = pattern(0x800, 4);
    ram.mem.write_at(0, &data2).unwrap();
    assert!(!copy(&la, 0, RAM_GPA, BAR_GPA2 + BUF_OFFSET + 0x800, 0x800).0);
    let b_bar = lb.bar_window(0).unwrap();
    assert_eq!(read_win(b_bar.as_ref(), BUF_OFFSET, 0x800), data);
    assert_eq!(read_win(b_bar.as_ref(), BUF_OFFSET + 0x800, 0x800), data2);
    let (err, faults) = copy(&la, 0, RAM_GPA, BAR_GPA + BUF_OFFSET, 0x800);
    assert!(err && faults == 1, "old address: err {err} faults {faults}");
    assert_eq!(
        read_win(b_bar.as_ref(), BUF_OFFSET, 0x800),
        data,
        "untouched"
    );
}

#[test]
fn target_reset_return_and_session_end_revoke_first() {
    let s = setup();
    let (ca, cb) = (client(&s, "vmm"), client(&s, "vmm"));
    let (la, lb) = (
        ca.borrow(DEV_A, "vm0").unwrap(),
        cb.borrow(DEV_B, "vm0").unwrap(),
    );
    let _ram = ram_for(&ca, &la);
    let dst = BAR_GPA + BUF_OFFSET;

    // Reset of the target: revoked, the source's DMA there fails; unmapping the revoked
    // mapping succeeds, and mapping again works.
    la.p2p_map(lb.id(), 0, BAR_GPA).unwrap();
    lb.reset().unwrap();
    assert_eq!(s.lender.p2p_live_into(lb.id()), 0);
    let (err, faults) = copy(&la, 0, RAM_GPA, dst, 0x100);
    assert!(err && faults == 1);
    // While revoked, mapping the same BAR again is allowed (the dead value is replaced).
    la.p2p_unmap(lb.id(), 0).unwrap();
    la.p2p_map(lb.id(), 0, BAR_GPA).unwrap();
    assert!(!copy(&la, 0, RAM_GPA, dst, 0x100).0);

    // Return of the target.
    let lb_id = lb.id();
    lb.return_device().unwrap();
    let (err, faults) = copy(&la, 0, RAM_GPA, dst, 0x100);
    assert!(err && faults == 2);
    la.p2p_unmap(lb_id, 0).unwrap();

    // End of the target's session (its link goes down).
    let lb = cb.borrow(DEV_B, "vm0").unwrap();
    la.p2p_map(lb.id(), 0, BAR_GPA).unwrap();
    assert!(!copy(&la, 0, RAM_GPA, dst, 0x100).0);
    let id = lb.id();
    std::mem::forget(lb); // no RETURN: the session ending must do it
    cb.endpoint().close();
    drop(cb);
    let t0 = Instant::now();
    while s.lender.p2p_live_into(id) > 0 {
        assert!(t0.elapsed() < Duration::from_secs(5), "not revoked");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (err, faults) = copy(&la, 0, RAM_GPA, dst, 0x100);
    assert!(err && faults == 3);
    // And the source ending drops its own mappings: map into a fresh target, then return the
    // source; the target's book has no live mapping left.
    let cc = client(&s, "vmm");
    let lc = cc.borrow(DEV_C, "vm0").unwrap();
    la.p2p_map(lc.id(), 0, BAR_GPA2).unwrap();
    assert_eq!(s.lender.p2p_live_into(lc.id()), 1);
    la.return_device().unwrap();
    assert_eq!(s.lender.p2p_live_into(lc.id()), 0);
}

#[test]
fn p2p_is_refused_across_borrowers_and_for_bad_bars() {
    let s = setup();
    let (ca, cb) = (client(&s, "vmm"), client(&s, "vmm"));
    let (la, lb) = (
        ca.borrow(DEV_A, "vm0").unwrap(),
        cb.borrow(DEV_B, "vm0").unwrap(),
    );
    let _ram = ram_for(&ca, &la);

    // Another borrower node with its own lease names ours as its target: unknown lease.
    let ci = client(&s, "intruder");
    let li = ci.borrow(DEV_C, "vm0").unwrap();
    let e = li.p2p_map(lb.id(), 0, BAR_GPA).unwrap_err();
    assert_eq!(code_of(&e), Some(code::UNKNOWN_LEASE), "{e}");
    // ... or forges our lease as the source (not on its session): unknown lease too.
    let forged = Request::P2pMap(P2pMap {
        source: la.id(),
        target: lb.id(),
        bar: 0,
        iova: BAR_GPA,
    });
    let (op, p) = forged.encode().unwrap();
    assert_eq!(op, opcode::P2P_MAP);
    match ci
        .endpoint()
        .request(Message::raw(op, p), Duration::from_secs(5))
    {
        Err(ntb::FabricError::Remote(e)) => assert_eq!(e.code, code::UNKNOWN_LEASE, "{e:?}"),
        other => panic!("forged p2p map answered {other:?}"),
    }
    assert_eq!(s.lender.p2p_live_into(lb.id()), 0);
    assert_eq!(s.lender.p2p_live_into(li.id()), 0);
    drop(li);

    // Same node, another VM: unknown lease as well.
    let cc = client(&s, "vmm");
    let lc = cc.borrow(DEV_C, "vm1").unwrap();
    let e = la.p2p_map(lc.id(), 0, BAR_GPA).unwrap_err();
    assert_eq!(code_of(&e), Some(code::UNKNOWN_LEASE), "{e}");
    let e = lc.p2p_map(lb.id(), 0, BAR_GPA).unwrap_err();
    assert_eq!(code_of(&e), Some(code::UNKNOWN_LEASE), "{e}");

    // Bad BARs: the MSI-X BAR the borrower emulates, one that does not exist.
    let e = la.p2p_map(lb.id(), 1, BAR_GPA).unwrap_err();
    assert_eq!(code_of(&e), Some(code::INVALID), "{e}");
    assert!(e.to_string().contains("emulated by the borrower"), "{e}");
    let e = la.p2p_map(lb.id(), 5, BAR_GPA).unwrap_err();
    assert_eq!(code_of(&e), Some(code::OUT_OF_RANGE), "{e}");
    // Over the RAM window, unaligned: invalid; a lease as its own peer: invalid.
    let e = la.p2p_map(lb.id(), 0, RAM_GPA).unwrap_err();
    assert_eq!(code_of(&e), Some(code::INVALID), "{e}");
    assert!(e.to_string().contains("overlaps"), "{e}");
    let e = la.p2p_map(lb.id(), 0, BAR_GPA + 0x10).unwrap_err();
    assert_eq!(code_of(&e), Some(code::INVALID), "{e}");
    let e = la.p2p_map(la.id(), 0, BAR_GPA).unwrap_err();
    assert_eq!(code_of(&e), Some(code::INVALID), "{e}");
    // Twice: invalid; unmapping what is not mapped: invalid.
    la.p2p_map(lb.id(), 0, BAR_GPA).unwrap();
    let e = la.p2p_map(lb.id(), 0, BAR_GPA2).unwrap_err();
    assert_eq!(code_of(&e), Some(code::INVALID), "{e}");
    let e = la.p2p_unmap(lc.id(), 0).unwrap_err();
    assert_eq!(code_of(&e), Some(code::INVALID), "{e}");
    assert_eq!(s.lender.p2p_live_into(lb.id()), 1);
}

/// A target lease transferred to another VM (live migration's TRANSFER_ACCEPT): the source's
/// mapping of it is revoked, and the source may not map it again (another holder now).
#[test]
fn transferred_target_is_revoked_and_no_longer_mappable() {
    let s = setup();
    let (ca, cb) = (client(&s, "vmm"), client(&s, "vmm"));
    let (la, lb) = (
        ca.borrow(DEV_A, "vm0").unwrap(),
        cb.borrow(DEV_B, "vm0").unwrap(),
    );
    let _ram = ram_for(&ca, &la);
    la.p2p_map(lb.id(), 0, BAR_GPA).unwrap();
    assert!(!copy(&la, 0, RAM_GPA, BAR_GPA + BUF_OFFSET, 0x100).0);
    let ticket = lb.create_transfer("vmm", "vm9").unwrap();
    let dst = client(&s, "vmm");
    let moved = dst.accept_transfer(&ticket, "vm9", &[], &[]).unwrap();
    assert_eq!(moved.id(), lb.id());
    assert_eq!(s.lender.p2p_live_into(moved.id()), 0, "revoked on transfer");
    let (err, faults) = copy(&la, 0, RAM_GPA, BAR_GPA + BUF_OFFSET, 0x100);
    assert!(err && faults == 1);
    la.p2p_unmap(moved.id(), 0).unwrap();
    let e = la.p2p_map(moved.id(), 0, BAR_GPA).unwrap_err();
    assert_eq!(code_of(&e), Some(code::UNKNOWN_LEASE), "{e}");
    std::mem::forget(lb); // its session no longer holds it
}

/// The emulated NVMe's Controller Memory Buffer is a P2P target: another device of the same
/// borrower DMAs straight into it at BAR0's guest-physical address + the CMB offset, while
/// the controller's registers and doorbells in front of it stay out of reach.
#[test]
fn a_dmatest_copies_into_an_nvme_controller_memory_buffer() {
    use emulated::nvme::{cmb::CMB_OFFSET, NvmeConfig};
    const NVME: &str = "0000:00:0d.0";
    let dir = tempfile::tempdir().unwrap();
    let a = Arc::new(EmulatedBackend::dmatest("p2p-cmb-a", NotifyMode::Interrupt).unwrap());
    let cmb_size = 2u64 << 20;
    let nvme = Arc::new(
        EmulatedBackend::nvme(
            "p2p-cmb-nvme",
            NvmeConfig {
                backing: dir.path().join("disk.img"),
                size: Some(1 << 20),
                cmb_size,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let s = setup_with(a, vec![(NVME.to_string(), nvme as _)], dir);
    let (ca, cn) = (client(&s, "vmm"), client(&s, "vmm"));
    let la = ca.borrow(DEV_A, "vm0").unwrap();
    let ln = cn.borrow(NVME, "vm0").unwrap();
    let ram = ram_for(&ca, &la);
    let data = pattern(0x2000, 3);
    ram.mem.write_at(0, &data).unwrap();
    la.p2p_map(ln.id(), 0, BAR_GPA).unwrap();
    assert_eq!(s.lender.p2p_live_into(ln.id()), 1);

    // RAM -> the CMB, through BAR0's guest-physical address.
    let (err, faults) = copy(&la, 0, RAM_GPA, BAR_GPA + CMB_OFFSET + 0x1000, 0x2000);
    assert!(!err, "copy into the CMB failed (faults {faults})");
    let bar = ln.bar_window(0).unwrap();
    assert_eq!(read_win(bar.as_ref(), CMB_OFFSET + 0x1000, 0x2000), data);
    // The source's own buffer -> the end of the CMB (device to device).
    let a_bar = la.bar_window(0).unwrap();
    let data2 = pattern(0x1000, 77);
    a_bar.write_at(BUF_OFFSET, &data2).unwrap();
    let end = BAR_GPA + CMB_OFFSET + cmb_size - 0x1000;
    let (err, _) = copy(&la, CMD_SRC_BUF, 0, end, 0x1000);
    assert!(!err);
    assert_eq!(
        read_win(bar.as_ref(), CMB_OFFSET + cmb_size - 0x1000, 0x1000),
        data2
    );
    assert_eq!(s.a.soft_iommu().fault_count(), 0);

    // The controller's registers (CAP at 0) and doorbells (0x1000) are not peer memory.
    let regs = read_win(bar.as_ref(), 0, 0x1008);
    for off in [0u64, 0x1000] {
        let (err, faults) = copy(&la, 0, RAM_GPA, BAR_GPA + off, 8);
        assert!(
            err && faults >= 1,
            "a copy to register {off:#x} was let through"
        );
    }
    assert_eq!(read_win(bar.as_ref(), 0, 0x1008), regs);
    assert_eq!(s.a.soft_iommu().fault_count(), 2);
}
