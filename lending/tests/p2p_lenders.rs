//! Peer-to-peer DMA between devices of one borrower on two different lenders (protocol
//! version 6), against two in-process lenders: lender A lends dmatest A (the source), lender
//! B lends dmatest B and an NVMe with a Controller Memory Buffer (the targets).
//!
//! The borrower plays the VMM: one session per device, guest RAM exported to A and mapped
//! at IOVA = GPA, the target's BAR0 "placed" at a guest-physical address it picks. It asks
//! B for a grant of the target's BAR for lender A and hands it to A (P2P_MAP_REMOTE); A
//! opens its own authenticated link to B, attaches the grant and maps B's window. The data
//! is verified in the target's BAR memory through the target's own BAR window.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use emulated::dmatest::{BUF_OFFSET, BUF_SIZE, CMD_SRC_BUF, REG_CMD};
use emulated::NotifyMode;
use lending::backend::emulated::EmulatedBackend;
use lending::backend::DeviceBackend;
use lending::client::Lease;
use lending::inventory::Inventory;
use lending::iommu::IommuDomain;
use lending::protocol::{code, p2px, P2pAttach, P2pGranted, Request};
use lending::server::{BackgroundLender, Lender};
use lending::LenderClient;
use ntb::{ClusterConfig, Fabric, Message, SocketFabric};

mod p2p_common;
use p2p_common::*;

const TOKEN: &str = "p2p-lenders-token-8f3a61c2d4b7e9051a6c";
const DEV_A: &str = "0000:00:0a.0";
const DEV_B: &str = "0000:00:0b.0";
const NVME: &str = "0000:00:0d.0";
const BAR_GPA: u64 = 0xc000_0000;
const BAR_GPA2: u64 = 0xc010_0000;
const HOLE_GPA: u64 = 0xd000_0000;
const CMB_SIZE: u64 = 2 << 20;

struct Side {
    lender: Arc<Lender>,
    bg: Option<BackgroundLender>,
}

struct Setup {
    dir: tempfile::TempDir,
    cfg: ClusterConfig,
    a: Side,
    b: Side,
    dev_a: Arc<EmulatedBackend>,
}

fn cluster_src(kind: ntb::FabricKind, dir: &std::path::Path) -> String {
    let d = dir.display();
    let nodes = ["lenderA", "lenderB", "vmm", "intruder"];
    let mut src = "version = 1\n".to_string();
    for n in nodes {
        let control = match kind {
            ntb::FabricKind::Shm => format!("{d}/{n}.sock"),
            ntb::FabricKind::Tcp | ntb::FabricKind::Bar => {
                let port = std::net::TcpListener::bind("127.0.0.1:0")
                    .unwrap()
                    .local_addr()
                    .unwrap()
                    .port();
                format!("127.0.0.1:{port}")
            }
        };
        src.push_str(&format!(
            "[[node]]\nname = \"{n}\"\nfabric = \"{kind}\"\ncontrol = \"{control}\"\n"
        ));
    }
    src
}

fn start(cfg: &ClusterConfig, node: &str, devices: Vec<(String, Arc<dyn DeviceBackend>)>) -> Side {
    let inv = Arc::new(Inventory::new(devices).unwrap());
    let listener = SocketFabric::from_cluster(cfg, node)
        .unwrap()
        .listen()
        .unwrap();
    let lender = Lender::new(inv, node, TOKEN);
    lender.set_cluster(cfg.clone());
    let bg = BackgroundLender::start(Arc::clone(&lender), listener).unwrap();
    Side {
        lender,
        bg: Some(bg),
    }
}

fn setup(kind: ntb::FabricKind) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cluster.toml");
    std::fs::write(&path, cluster_src(kind, dir.path())).unwrap();
    let cfg = ClusterConfig::load(&path).unwrap();
    let dev_a = Arc::new(EmulatedBackend::dmatest("x-a", NotifyMode::Interrupt).unwrap());
    let dev_b = Arc::new(EmulatedBackend::dmatest("x-b", NotifyMode::Interrupt).unwrap());
    let nvme = Arc::new(
        EmulatedBackend::nvme(
            "x-nvme",
            emulated::nvme::NvmeConfig {
                backing: dir.path().join("disk.img"),
                size: Some(1 << 20),
                cmb_size: CMB_SIZE,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let a = start(
        &cfg,
        "lenderA",
        vec![(DEV_A.to_string(), dev_a.clone() as _)],
    );
    let b = start(
        &cfg,
        "lenderB",
        vec![
            (DEV_B.to_string(), dev_b as _),
            (NVME.to_string(), nvme as _),
        ],
    );
    Setup {
        dir,
        cfg,
        a,
        b,
        dev_a,
    }
}

fn client(s: &Setup, node: &str, lender: &str) -> LenderClient {
    LenderClient::connect(&s.cfg, node, lender, TOKEN, "p2p-lenders-test").unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect()
}

fn wait_until(what: &str, f: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(10), "never: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Grants `target`'s BAR0 to lender A and maps it for `source` at `gpa`.
fn map_remote(source: &Lease, target: &Lease, gpa: u64) -> P2pGranted {
    let g = target.p2p_grant(0, "lenderA").unwrap();
    source
        .p2p_map_remote("lenderB", target.id(), 0, gpa, &g)
        .unwrap();
    g
}

fn unmap_remote(source: &Lease, target: &Lease, g: &P2pGranted) {
    source.p2p_unmap_remote("lenderB", target.id(), 0).unwrap();
    target.p2p_revoke(g.grant).unwrap();
}

fn cross_lender_copy(kind: ntb::FabricKind) {
    let s = setup(kind);
    let (ca, cb) = (client(&s, "vmm", "lenderA"), client(&s, "vmm", "lenderB"));
    let (la, lb) = (
        ca.borrow(DEV_A, "vm0").unwrap(),
        cb.borrow(DEV_B, "vm0").unwrap(),
    );
    let ram = ram_for(&ca, &la);
    let data = pattern(0x3000, 7);
    ram.mem.write_at(0x2000, &data).unwrap();
    let g = map_remote(&la, &lb, BAR_GPA);
    assert_eq!(s.b.lender.p2p_grants_attached(), 1);
    assert_eq!(s.a.lender.p2p_peer_links(), 1);

    // RAM on the borrower -> the buffer of the device on the other lender.
    let dst = BAR_GPA + BUF_OFFSET + 0x100;
    let (err, faults) = copy(&la, 0, RAM_GPA + 0x2000, dst, 0x3000);
    assert!(!err, "cross-lender p2p copy failed (faults {faults})");
    let b_bar = lb.bar_window(0).unwrap();
    assert_eq!(read_win(b_bar.as_ref(), BUF_OFFSET + 0x100, 0x3000), data);

    // A's own buffer -> B's buffer: device to device, no RAM.
    let a_bar = la.bar_window(0).unwrap();
    let data2 = pattern(BUF_SIZE as usize, 99);
    a_bar.write_at(BUF_OFFSET, &data2).unwrap();
    let (err, _) = copy(&la, CMD_SRC_BUF, 0, BAR_GPA + BUF_OFFSET, BUF_SIZE as u32);
    assert!(!err);
    assert_eq!(
        read_win(b_bar.as_ref(), BUF_OFFSET, BUF_SIZE as usize),
        data2
    );

    // B's buffer -> RAM (a peer read across lenders).
    let (err, _) = copy(&la, 0, BAR_GPA + BUF_OFFSET, RAM_GPA, 0x1000);
    assert!(!err);
    let mut back = vec![0; 0x1000];
    ram.mem.read_at(0, &mut back).unwrap();
    assert_eq!(back, data2[..0x1000]);
    assert_eq!(s.dev_a.soft_iommu().fault_count(), 0);

    // Neither RAM nor a borrowed BAR: refused, counted, error status; B's registers too.
    let before = la.counters().unwrap().unwrap().iommu_faults;
    let (err, faults) = copy(&la, 0, RAM_GPA, HOLE_GPA, 0x100);
    assert!(err && faults == 1, "hole: err {err} faults {faults}");
    let (err, faults) = copy(&la, 0, RAM_GPA, BAR_GPA + REG_CMD, 4);
    assert!(err && faults == 2, "registers: err {err} faults {faults}");
    assert_eq!(la.counters().unwrap().unwrap().iommu_faults - before, 2);

    // Unmapped and revoked: gone from A's domain, B's window withdrawn.
    unmap_remote(&la, &lb, &g);
    assert_eq!(s.b.lender.p2p_grants_attached(), 0);
    let (err, faults) = copy(&la, 0, RAM_GPA, dst, 0x100);
    assert!(err && faults == 3, "after unmap: err {err} faults {faults}");
    assert_eq!(
        s.dev_a.soft_iommu().mappings().len(),
        1,
        "only the RAM window is left"
    );
    // The lender-to-lender link ends with its last mapping.
    assert_eq!(s.a.lender.p2p_peer_links(), 0);
}

#[test]
fn cross_lender_copy_lands_in_the_target_bar_shm() {
    cross_lender_copy(ntb::FabricKind::Shm);
}

#[test]
fn cross_lender_copy_lands_in_the_target_bar_tcp() {
    cross_lender_copy(ntb::FabricKind::Tcp);
}

#[test]
fn relocated_target_on_another_lender_works_at_the_new_address_and_not_the_old() {
    let s = setup(ntb::FabricKind::Shm);
    let (ca, cb) = (client(&s, "vmm", "lenderA"), client(&s, "vmm", "lenderB"));
    let (la, lb) = (
        ca.borrow(DEV_A, "vm0").unwrap(),
        cb.borrow(DEV_B, "vm0").unwrap(),
    );
    let ram = ram_for(&ca, &la);
    let data = pattern(0x800, 3);
    ram.mem.write_at(0, &data).unwrap();
    let g = map_remote(&la, &lb, BAR_GPA);
    assert!(!copy(&la, 0, RAM_GPA, BAR_GPA + BUF_OFFSET, 0x800).0);
    // The VMM moves the BAR: unmap (and revoke) at the old address first, then map anew.
    unmap_remote(&la, &lb, &g);
    let g2 = map_remote(&la, &lb, BAR_GPA2);
    assert_ne!(g.grant, g2.grant);
    let data2 = pattern(0x800, 4);
    ram.mem.write_at(0, &data2).unwrap();
    assert!(!copy(&la, 0, RAM_GPA, BAR_GPA2 + BUF_OFFSET + 0x800, 0x800).0);
    let b_bar = lb.bar_window(0).unwrap();
    assert_eq!(read_win(b_bar.as_ref(), BUF_OFFSET, 0x800), data);
    assert_eq!(read_win(b_bar.as_ref(), BUF_OFFSET + 0x800, 0x800), data2);
    let (err, faults) = copy(&la, 0, RAM_GPA, BAR_GPA + BUF_OFFSET, 0x800);
    assert!(err && faults == 1, "old address: err {err} faults {faults}");
    assert_eq!(read_win(b_bar.as_ref(), BUF_OFFSET, 0x800), data);
    // One link to B carried both attachments.
    assert_eq!(s.a.lender.p2p_peer_links(), 1);
}

#[test]
fn a_dmatest_copies_into_an_nvme_cmb_on_another_lender() {
    use emulated::nvme::cmb::CMB_OFFSET;
    let s = setup(ntb::FabricKind::Shm);
    let (ca, cn) = (client(&s, "vmm", "lenderA"), client(&s, "vmm", "lenderB"));
    let la = ca.borrow(DEV_A, "vm0").unwrap();
    let ln = cn.borrow(NVME, "vm0").unwrap();
    let ram = ram_for(&ca, &la);
    let data = pattern(0x2000, 11);
    ram.mem.write_at(0, &data).unwrap();
    map_remote(&la, &ln, BAR_GPA);
    let (err, faults) = copy(&la, 0, RAM_GPA, BAR_GPA + CMB_OFFSET + 0x1000, 0x2000);
    assert!(!err, "copy into the remote CMB failed (faults {faults})");
    let bar = ln.bar_window(0).unwrap();
    assert_eq!(read_win(bar.as_ref(), CMB_OFFSET + 0x1000, 0x2000), data);
    // The controller's registers and doorbells stay out of reach.
    let regs = read_win(bar.as_ref(), 0, 0x1008);
    for off in [0u64, 0x1000] {
        let (err, _) = copy(&la, 0, RAM_GPA, BAR_GPA + off, 8);
        assert!(err, "a copy to register {off:#x} was let through");
    }
    assert_eq!(read_win(bar.as_ref(), 0, 0x1008), regs);
    assert_eq!(s.dev_a.soft_iommu().fault_count(), 2);
}

#[test]
fn target_reset_and_return_revoke_the_remote_mapping() {
    let s = setup(ntb::FabricKind::Shm);
    let (ca, cb) = (client(&s, "vmm", "lenderA"), client(&s, "vmm", "lenderB"));
    let (la, lb) = (
        ca.borrow(DEV_A, "vm0").unwrap(),
        cb.borrow(DEV_B, "vm0").unwrap(),
    );
    let _ram = ram_for(&ca, &la);
    let dst = BAR_GPA + BUF_OFFSET;
    let g = map_remote(&la, &lb, BAR_GPA);
    assert!(!copy(&la, 0, RAM_GPA, dst, 0x100).0);

    // B resets the target: the grant ends, its window is revoked, A unmaps.
    lb.reset().unwrap();
    assert_eq!(s.b.lender.p2p_grants_attached(), 0);
    wait_until("A unmapped the revoked window", || {
        s.a.lender.p2p_remote_revoked() == 1
    });
    let (err, faults) = copy(&la, 0, RAM_GPA, dst, 0x100);
    assert!(err && faults == 1, "after reset: err {err} faults {faults}");
    // The VMM's own unmap and revoke of what already ended succeed.
    unmap_remote(&la, &lb, &g);
    // Mapped again after the reset, then the target is returned.
    map_remote(&la, &lb, BAR_GPA);
    assert!(!copy(&la, 0, RAM_GPA, dst, 0x100).0);
    lb.return_device().unwrap();
    wait_until("A unmapped after the return", || {
        s.a.lender.p2p_remote_revoked() == 2
    });
    let (err, faults) = copy(&la, 0, RAM_GPA, dst, 0x100);
    assert!(err && faults == 2);
    assert_eq!(s.dev_a.soft_iommu().mappings().len(), 1, "only RAM left");
}

#[test]
fn target_lender_lost_unmaps_and_the_source_dma_faults() {
    target_lender_lost(ntb::FabricKind::Shm);
}

#[test]
fn target_lender_lost_unmaps_and_the_source_dma_faults_tcp() {
    target_lender_lost(ntb::FabricKind::Tcp);
}

fn target_lender_lost(kind: ntb::FabricKind) {
    let mut s = setup(kind);
    let (ca, cb) = (client(&s, "vmm", "lenderA"), client(&s, "vmm", "lenderB"));
    let (la, lb) = (
        ca.borrow(DEV_A, "vm0").unwrap(),
        cb.borrow(DEV_B, "vm0").unwrap(),
    );
    let _ram = ram_for(&ca, &la);
    let dst = BAR_GPA + BUF_OFFSET;
    map_remote(&la, &lb, BAR_GPA);
    assert!(!copy(&la, 0, RAM_GPA, dst, 0x100).0);
    let target_id = lb.id();
    std::mem::forget(lb);
    // Lender B goes away: every session and link of it ends.
    drop(s.b.bg.take());
    wait_until("A saw the lender-to-lender link die", || {
        s.a.lender.p2p_peer_links() == 0
    });
    assert_eq!(s.a.lender.p2p_remote_revoked(), 1);
    let before = la.counters().unwrap().unwrap().iommu_faults;
    let (err, faults) = copy(&la, 0, RAM_GPA, dst, 0x100);
    assert!(err && faults == 1, "after loss: err {err} faults {faults}");
    assert_eq!(la.counters().unwrap().unwrap().iommu_faults - before, 1);
    // Nothing left behind on A: only the RAM window is mapped, and the VMM's unmap of the
    // lost mapping succeeds.
    assert_eq!(s.dev_a.soft_iommu().mappings().len(), 1);
    la.p2p_unmap_remote("lenderB", target_id, 0).unwrap();
    // A new grant cannot be used: B is gone.
    let fake = P2pGranted {
        grant: 1,
        secret: vec![0; p2px::SECRET_LEN],
    };
    let e = la
        .p2p_map_remote("lenderB", target_id, 0, BAR_GPA, &fake)
        .unwrap_err();
    assert_eq!(e.code(), Some(p2px::code::PEER_LENDER), "{e}");
    drop(cb);
    let _ = &s.dir;
}

#[test]
fn grants_are_refused_to_other_lenders_wrong_secrets_and_other_borrowers() {
    let s = setup(ntb::FabricKind::Shm);
    let (ca, cb) = (client(&s, "vmm", "lenderA"), client(&s, "vmm", "lenderB"));
    let (la, lb) = (
        ca.borrow(DEV_A, "vm0").unwrap(),
        cb.borrow(DEV_B, "vm0").unwrap(),
    );
    let _ram = ram_for(&ca, &la);
    let g = lb.p2p_grant(0, "lenderA").unwrap();
    assert_eq!(g.secret.len(), p2px::SECRET_LEN);

    // Another node that authenticated with the cluster token presents the grant itself:
    // refused (it is not the grantee), counted.
    let ci = client(&s, "intruder", "lenderB");
    let attach = |secret: Vec<u8>| {
        let (op, p) = Request::P2pAttach(P2pAttach {
            grant: g.grant,
            secret,
        })
        .encode()
        .unwrap();
        ci.endpoint()
            .request(Message::raw(op, p), Duration::from_secs(5))
    };
    match attach(g.secret.clone()) {
        Err(ntb::FabricError::Remote(e)) => assert_eq!(e.code, p2px::code::BAD_GRANT, "{e:?}"),
        other => panic!("intruder attach answered {other:?}"),
    }
    assert_eq!(s.b.lender.p2p_grants_refused(), 1);
    // A wrong secret through lender A: refused by B, reported to the borrower.
    let bad = P2pGranted {
        grant: g.grant,
        secret: vec![0; p2px::SECRET_LEN],
    };
    let e = la
        .p2p_map_remote("lenderB", lb.id(), 0, BAR_GPA, &bad)
        .unwrap_err();
    assert_eq!(e.code(), Some(p2px::code::BAD_GRANT), "{e}");
    assert_eq!(s.b.lender.p2p_grants_refused(), 2);
    assert_eq!(s.b.lender.p2p_grants_attached(), 0);
    // A BAR without peer memory: invalid. (A grant to the target's own lender is the
    // same-lender capability: allowed, and useless to lender A.)
    let own = lb.p2p_grant(0, "lenderB").unwrap();
    let e = la
        .p2p_map_remote("lenderB", lb.id(), 0, BAR_GPA, &own)
        .unwrap_err();
    assert_eq!(e.code(), Some(p2px::code::BAD_GRANT), "{e}");
    let e = lb.p2p_grant(1, "lenderA").unwrap_err();
    assert_eq!(e.code(), Some(code::INVALID), "{e}");
    // Someone else's lease cannot be granted.
    let li = ci.borrow(NVME, "vm0").unwrap();
    let (op, p) = Request::P2pGrant(lending::protocol::P2pGrant {
        target: lb.id(),
        bar: 0,
        grantee: "lenderA".into(),
    })
    .encode()
    .unwrap();
    match ci
        .endpoint()
        .request(Message::raw(op, p), Duration::from_secs(5))
    {
        Err(ntb::FabricError::Remote(e)) => assert_eq!(e.code, code::UNKNOWN_LEASE, "{e:?}"),
        other => panic!("grant of another's lease answered {other:?}"),
    }
    drop(li);
    // The right grant through lender A works, and only once.
    la.p2p_map_remote("lenderB", lb.id(), 0, BAR_GPA, &g)
        .unwrap();
    let e = la
        .p2p_map_remote("lenderB", lb.id(), 0, BAR_GPA, &g)
        .unwrap_err();
    assert_eq!(e.code(), Some(code::INVALID), "{e}");
    assert_eq!(s.b.lender.p2p_grants_attached(), 1);
}

/// Same lender over tcp, protocol version 6: a target lease is mapped only with its
/// capability (a grant to its own lender), so another token holder at the same IP that
/// claims the borrower's node and VM names cannot map it (docs/SECURITY.md).
#[test]
fn same_lender_p2p_on_tcp_needs_the_targets_capability() {
    use emulated::nvme::cmb::CMB_OFFSET;
    let s = setup(ntb::FabricKind::Tcp);
    let (c1, c2) = (client(&s, "vmm", "lenderB"), client(&s, "vmm", "lenderB"));
    let src = c1.borrow(DEV_B, "vm0").unwrap();
    let ln = c2.borrow(NVME, "vm0").unwrap();
    let ram = ram_for(&c1, &src);
    // The identity rule alone (same node, VM and IP) no longer suffices on tcp.
    let e = src.p2p_map(ln.id(), 0, BAR_GPA).unwrap_err();
    assert_eq!(e.code(), Some(code::UNKNOWN_LEASE), "{e}");
    // A made-up capability is refused and counted.
    let forged = P2pGranted {
        grant: 77,
        secret: vec![1; p2px::SECRET_LEN],
    };
    let e = src
        .p2p_map_granted(ln.id(), 0, BAR_GPA, &forged)
        .unwrap_err();
    assert_eq!(e.code(), Some(p2px::code::BAD_GRANT), "{e}");
    let refused = s.b.lender.p2p_grants_refused();
    assert!(refused >= 1);
    // A grant for another BAR or to another lender is not this capability.
    let other = ln.p2p_grant(0, "lenderA").unwrap();
    let e = src
        .p2p_map_granted(ln.id(), 0, BAR_GPA, &other)
        .unwrap_err();
    assert_eq!(e.code(), Some(p2px::code::BAD_GRANT), "{e}");
    // The target's own capability works, and the data lands in the CMB.
    let g = ln.p2p_grant(0, "lenderB").unwrap();
    src.p2p_map_granted(ln.id(), 0, BAR_GPA, &g).unwrap();
    let data = pattern(0x1000, 21);
    ram.mem.write_at(0, &data).unwrap();
    let (err, faults) = copy(&src, 0, RAM_GPA, BAR_GPA + CMB_OFFSET, 0x1000);
    assert!(!err, "granted same-lender copy failed (faults {faults})");
    let bar = ln.bar_window(0).unwrap();
    assert_eq!(read_win(bar.as_ref(), CMB_OFFSET, 0x1000), data);
    // Revoking the capability does not unmap (it gates the map), the target's reset does.
    ln.p2p_revoke(g.grant).unwrap();
    assert!(!copy(&src, 0, RAM_GPA, BAR_GPA + CMB_OFFSET, 0x1000).0);
    ln.reset().unwrap();
    let (err, _) = copy(&src, 0, RAM_GPA, BAR_GPA + CMB_OFFSET, 0x1000);
    assert!(err, "the target's reset revokes");
}

/// The target lease moves to another VM (live migration's transfer): its grants end with
/// the old holder, and lender A unmaps.
#[test]
fn a_transferred_target_revokes_its_grants() {
    let s = setup(ntb::FabricKind::Shm);
    let (ca, cb) = (client(&s, "vmm", "lenderA"), client(&s, "vmm", "lenderB"));
    let (la, lb) = (
        ca.borrow(DEV_A, "vm0").unwrap(),
        cb.borrow(DEV_B, "vm0").unwrap(),
    );
    let _ram = ram_for(&ca, &la);
    map_remote(&la, &lb, BAR_GPA);
    assert!(!copy(&la, 0, RAM_GPA, BAR_GPA + BUF_OFFSET, 0x100).0);
    let ticket = lb.create_transfer("vmm", "vm9").unwrap();
    let dst = client(&s, "vmm", "lenderB");
    let moved = dst.accept_transfer(&ticket, "vm9", &[], &[]).unwrap();
    assert_eq!(moved.id(), lb.id());
    assert_eq!(s.b.lender.p2p_grants_attached(), 0);
    wait_until("A unmapped the transferred target", || {
        s.a.lender.p2p_remote_revoked() == 1
    });
    let (err, faults) = copy(&la, 0, RAM_GPA, BAR_GPA + BUF_OFFSET, 0x100);
    assert!(
        err && faults == 1,
        "after transfer: err {err} faults {faults}"
    );
    std::mem::forget(lb); // its session no longer holds it
}

/// On shm too, a grantee never receives the target's memory as an fd: it reaches exactly
/// the granted range through the target's lender (a mediated window, not directly
/// mappable), so the registers are never exposed, and once the grant is revoked the window
/// neither reaches the device nor shows its new state. Driven as the grantee lender itself.
#[test]
fn a_revoked_grant_leaves_the_grantee_nothing_on_shm() {
    use emulated::dmatest::BUF_OFFSET;
    let s = setup(ntb::FabricKind::Shm);
    let cb = client(&s, "vmm", "lenderB");
    let lb = cb.borrow(DEV_B, "vm0").unwrap();
    let g = lb.p2p_grant(0, "lenderA").unwrap();
    // The grantee's own authenticated link, as lender A opens it.
    let ga = client(&s, "lenderA", "lenderB");
    let (op, p) = Request::P2pAttach(P2pAttach {
        grant: g.grant,
        secret: g.secret.clone(),
    })
    .encode()
    .unwrap();
    let reply = ga
        .endpoint()
        .request(Message::raw(op, p), Duration::from_secs(5))
        .unwrap();
    let attached: p2px::P2pAttached = lending::protocol::decode_reply(op, &reply.payload).unwrap();
    assert_eq!(
        attached.bar_offset, BUF_OFFSET,
        "only the peer memory is granted"
    );
    let w = ga.endpoint().map_peer_window(attached.window).unwrap();
    assert!(
        w.as_ptr().is_err(),
        "the grantee received the device's memory as an fd it could keep"
    );
    assert_eq!(w.len(), attached.size);
    let device = |at: u64| {
        u64::from_le_bytes(
            lb.bar_read(0, BUF_OFFSET + at, 8)
                .unwrap()
                .try_into()
                .unwrap(),
        )
    };
    // While granted, the window is the device's buffer, both ways.
    w.write_at(0, &0x6b6b_0001u64.to_le_bytes()).unwrap();
    assert_eq!(device(0), 0x6b6b_0001);
    lb.bar_write(0, BUF_OFFSET + 8, &0x6b6b_0002u64.to_le_bytes())
        .unwrap();
    let mut v = [0u8; 8];
    w.read_at(8, &mut v).unwrap();
    assert_eq!(u64::from_le_bytes(v), 0x6b6b_0002);

    // Revoked by the target's holder: the lender ends it, whatever the grantee does.
    lb.p2p_revoke(g.grant).unwrap();
    lb.bar_write(0, BUF_OFFSET + 8, &0x6b6b_0003u64.to_le_bytes())
        .unwrap();
    assert!(
        w.write_at(0, &0x6b6b_0004u64.to_le_bytes()).is_err(),
        "a write through the revoked window was accepted"
    );
    assert_eq!(
        device(0),
        0x6b6b_0001,
        "a write through the revoked window reached the device"
    );
    let r = w.read_at(8, &mut v);
    assert!(
        r.is_err() || u64::from_le_bytes(v) != 0x6b6b_0003,
        "the revoked window shows the device's new data"
    );
}
