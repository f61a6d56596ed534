//! Protocol version negotiation against an in-process lender: a version 1 borrower keeps
//! its layouts and meanings; a version 2 borrower gets per-BAR write notification, `()`
//! replies to BAR_WRITE/RESET, `Doorbells` for a polled BAR and none of version 3's counters,
//! quiesce or IOMMU fault events; a version 3 borrower gets all of them, `Polled` and the
//! kick-only doorbells in those replies; a version 3 borrower gets none of version 4's
//! migration requests (a clear "does not support migration" error), a version 4 borrower
//! gets the device dirty log, the hand-over quiesce and transfer tickets that expire, and is
//! told that peer-to-peer DMA (version 5) is not supported; its raw P2P requests are unknown
//! opcodes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use emulated::NotifyMode;
use lending::backend::emulated::EmulatedBackend;
use lending::backend::DeviceBackend;
use lending::client::ClientError;
use lending::inventory::Inventory;
use lending::iommu::IommuDomain;
use lending::protocol::{
    self, code, opcode, Borrow, Event, Hello, HelloReply, IrqKind, IrqTarget, LeaseCounters,
    LeaseRef, NotifyWrites, Quiesce, Request, SetIrqs,
};
use lending::server::{BackgroundLender, Lender};
use lending::LenderClient;
use ntb::wire::ErrorReply;
use ntb::{ClusterConfig, Endpoint, Fabric, FabricError, Message, NodeId, SocketFabric};

// The shared test harness (std only), as the other tests of this crate include it.
#[path = "../src/testing.rs"]
mod testing;

const TOKEN: &str = "v3rsions";
const DEV: &str = "0000:00:05.0";

fn lender() -> (tempfile::TempDir, ClusterConfig, BackgroundLender) {
    let (dir, cfg, l, _) = lender_with_backend(NotifyMode::Interrupt);
    (dir, cfg, l)
}

fn lender_with(mode: NotifyMode) -> (tempfile::TempDir, ClusterConfig, BackgroundLender) {
    let (dir, cfg, l, _) = lender_with_backend(mode);
    (dir, cfg, l)
}

fn lender_with_backend(
    mode: NotifyMode,
) -> (
    tempfile::TempDir,
    ClusterConfig,
    BackgroundLender,
    Arc<EmulatedBackend>,
) {
    let dir = tempfile::tempdir().unwrap();
    let path = testing::shm_cluster_file(dir.path(), &["lender", "vmm"]);
    let cfg = ClusterConfig::load(&path).unwrap();
    let backend = Arc::new(EmulatedBackend::dmatest("versions", mode).unwrap());
    let inv = Arc::new(Inventory::new(vec![(DEV.to_string(), backend.clone() as _)]).unwrap());
    let listener = SocketFabric::from_cluster(&cfg, "lender")
        .unwrap()
        .listen()
        .unwrap();
    let l = BackgroundLender::start(Lender::new(inv, "lender", TOKEN), listener).unwrap();
    (dir, cfg, l, backend)
}

/// Makes the lent dmatest DMA at an IOVA nothing maps: one IOMMU fault on the lender.
fn fault_once(b: &EmulatedBackend) {
    use emulated::dmatest::{CMD_ACK, CMD_START, REG_CMD, REG_DST, REG_LEN, REG_SRC};
    let before = b.soft_iommu().fault_count();
    b.bar_write(0, REG_CMD, &CMD_ACK.to_le_bytes()).unwrap();
    b.bar_write(0, REG_SRC, &0xdead_0000u64.to_le_bytes())
        .unwrap();
    b.bar_write(0, REG_DST, &0xbeef_0000u64.to_le_bytes())
        .unwrap();
    b.bar_write(0, REG_LEN, &64u32.to_le_bytes()).unwrap();
    b.bar_write(0, REG_CMD, &CMD_START.to_le_bytes()).unwrap();
    let t0 = std::time::Instant::now();
    while b.soft_iommu().fault_count() == before && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(b.soft_iommu().fault_count(), before + 1, "one dma refused");
}

/// Waits up to `t` for the next event, which must be an IOMMU fault.
fn fault_event(c: &LenderClient, t: Duration) -> Option<protocol::IommuFaultEvent> {
    match c.next_event(t).unwrap() {
        Some(Event::IommuFault(f)) => Some(f),
        Some(other) => panic!("unexpected event {other:?}"),
        None => None,
    }
}

fn connect(cfg: &ClusterConfig) -> Box<dyn Endpoint> {
    SocketFabric::from_cluster(cfg, "vmm")
        .unwrap()
        .connect(&NodeId::new("lender").unwrap())
        .unwrap()
}

fn call(ep: &dyn Endpoint, r: &Request, version: u32) -> Result<Message, ErrorReply> {
    let (op, p) = r.encode_versioned(version).unwrap();
    match ep.request(Message::raw(op, p), Duration::from_secs(5)) {
        Ok(m) => Ok(m),
        Err(FabricError::Remote(e)) => Err(e),
        Err(e) => panic!("{e}"),
    }
}

/// AUTH on `ep`, then a HELLO of `version` carrying the borrower's proof.
fn hello(ep: &dyn Endpoint, version: u32) -> Request {
    use lending::auth::{self, Role, Transcript};
    let nb = auth::nonce().unwrap();
    let op = opcode::AUTH;
    let p = protocol::encode_reply(op, &protocol::AuthChallenge { nonce: nb.to_vec() }).unwrap();
    let m = ep
        .request(Message::raw(op, p), Duration::from_secs(5))
        .unwrap();
    let r: protocol::AuthResponse = protocol::decode_reply(op, &m.payload).unwrap();
    let (b, l) = (ep.local_node().to_string(), ep.peer_node().to_string());
    let t = Transcript {
        borrower_nonce: &nb,
        lender_nonce: &r.nonce,
        borrower: &b,
        lender: &l,
        binding: &[],
    };
    assert!(t.verify(TOKEN, Role::Lender, &r.proof).unwrap());
    Request::Hello(Hello {
        version,
        token: auth::encode_proof(&t.prove(TOKEN, Role::Borrower).unwrap()),
        client: "old".into(),
    })
}

#[test]
fn version_1_borrower_is_served_in_version_1() {
    let (_dir, cfg, _l) = lender();
    let ep = connect(&cfg);
    let m = call(&*ep, &hello(&*ep, 1), 1).unwrap();
    let h: HelloReply = protocol::decode_reply(opcode::HELLO, &m.payload).unwrap();
    assert_eq!(h.version, 1);
    let borrow = Request::Borrow(Borrow {
        device: DEV.into(),
        vm: "vm0".into(),
    });
    let m = call(&*ep, &borrow, 1).unwrap();
    let b = protocol::decode_borrowed(&m.payload, 1).unwrap();
    assert!(b.notify_fd.is_some());
    // Version 1 meaning: the register window is write-notified as a whole.
    let bar0 = b.info.bars.iter().find(|x| x.index == 0).unwrap();
    assert!(bar0.window.is_some());
    assert_eq!(bar0.notify, NotifyWrites::All);
    // Version 1 SET_IRQS (no resample field) is understood.
    let s = Request::SetIrqs(SetIrqs {
        lease: b.lease,
        kind: IrqKind::Msix,
        targets: vec![IrqTarget::None, IrqTarget::None],
        resample: IrqTarget::None,
    });
    call(&*ep, &s, 1).unwrap();
}

#[test]
fn version_2_borrower_gets_doorbell_ranges() {
    let (_dir, cfg, _l) = lender();
    let c = LenderClient::connect(&cfg, "vmm", "lender", TOKEN, "new").unwrap();
    assert_eq!(c.protocol_version(), protocol::PROTOCOL_VERSION);
    let lease = c.borrow(DEV, "vm0").unwrap();
    let bar0 = lease.info().bars.iter().find(|x| x.index == 0).unwrap();
    assert_eq!(
        bar0.notify,
        NotifyWrites::Doorbells {
            offset: emulated::dmatest::REG_SRC,
            len: emulated::dmatest::REG_CMD + 4 - emulated::dmatest::REG_SRC,
        }
    );
    let msix_bar = lease.info().bars.iter().find(|x| x.index == 1).unwrap();
    assert_eq!(msix_bar.notify, NotifyWrites::None);
    assert_eq!(lease.device_info().unwrap().bars, lease.info().bars);
}

#[test]
fn too_old_a_version_is_refused() {
    let (_dir, cfg, _l) = lender();
    let ep = connect(&cfg);
    let e = call(&*ep, &hello(&*ep, 0), 1).unwrap_err();
    assert_eq!(e.code, code::VERSION);
    let range = format!("1..={}", protocol::PROTOCOL_VERSION);
    assert!(e.message.contains(&range), "{}", e.message);
}

/// A version 2 borrower of a version 3 lender: the session speaks 2; counters are `None`
/// without a round trip, quiesce is refused as unsupported, the version 3 opcodes are unknown
/// in the session, and a DMA fault sends no event it could not decode.
#[test]
fn version_2_borrower_sees_nothing_of_version_3() {
    let (_dir, cfg, _l, backend) = lender_with_backend(NotifyMode::Interrupt);
    let ep = connect(&cfg);
    let c = LenderClient::from_endpoint_with_version(ep, TOKEN, "v2", 2).unwrap();
    assert_eq!(c.protocol_version(), 2);
    let lease = c.borrow(DEV, "vm0").unwrap();
    assert_eq!(lease.counters().unwrap(), None);
    let e = lease.quiesce(true).unwrap_err();
    assert!(
        matches!(
            e,
            ClientError::Unsupported {
                version: 2,
                needs: 3,
                ..
            }
        ),
        "{e}"
    );
    fault_once(&backend);
    assert_eq!(fault_event(&c, Duration::from_millis(300)), None);

    // The same requests sent raw in a version 2 session: unknown opcodes.
    let ep = connect(&cfg);
    call(&*ep, &hello(&*ep, 2), 2).unwrap();
    for r in [
        Request::LeaseCounters(LeaseRef { lease: 1 }),
        Request::Quiesce(Quiesce {
            lease: 1,
            stop: true,
        }),
    ] {
        let e = call(&*ep, &r, 3).unwrap_err();
        assert_eq!(e.code, code::UNKNOWN_OPCODE, "{r:?}: {}", e.message);
    }
}

/// A version 3 borrower: counters since its lease was granted (a second lease starts from
/// zero), quiesce accepted, and each IOMMU fault reported with the lease's exact total.
#[test]
fn version_3_borrower_gets_counters_quiesce_and_fault_events() {
    let (_dir, cfg, _l, backend) = lender_with_backend(NotifyMode::Interrupt);
    let c = LenderClient::from_endpoint_with_version(connect(&cfg), TOKEN, "v3", 3).unwrap();
    assert_eq!(c.protocol_version(), 3);
    let lease = c.borrow(DEV, "vm0").unwrap();
    assert_eq!(
        lease.counters().unwrap(),
        Some(LeaseCounters {
            msix: vec![0, 0],
            ..LeaseCounters::default()
        })
    );
    fault_once(&backend);
    fault_once(&backend);
    for total in 1..=2 {
        let f = fault_event(&c, Duration::from_secs(5)).expect("iommu fault event");
        assert_eq!(
            (f.lease, f.iova, f.len, f.write, f.total),
            (lease.id(), 0xdead_0000, 64, false, total)
        );
    }
    let n = lease.counters().unwrap().unwrap();
    assert_eq!(n.iommu_faults, 2);
    assert!(n.doorbell_kicks >= 2, "{n:?}: each CMD write kicks");
    lease.quiesce(true).unwrap();
    lease.quiesce(false).unwrap();
    lease.return_device().unwrap();
    // The next lease counts from its own start.
    let lease = c.borrow(DEV, "vm0").unwrap();
    assert_eq!(lease.counters().unwrap().unwrap().iommu_faults, 0);
    fault_once(&backend);
    let f = fault_event(&c, Duration::from_secs(5)).expect("iommu fault event");
    assert_eq!((f.lease, f.total), (lease.id(), 1));
    assert_eq!(lease.counters().unwrap().unwrap().iommu_faults, 1);
}

#[test]
fn version_2_and_3_replies_and_polled_bars() {
    let (_dir, cfg, _l) = lender_with(NotifyMode::Polling);
    let range = NotifyWrites::Polled {
        offset: emulated::dmatest::REG_SRC,
        len: emulated::dmatest::REG_CMD + 4 - emulated::dmatest::REG_SRC,
    };
    // Version 2: the polled BAR is described as doorbells, BAR_WRITE/RESET answer `()`.
    let ep = connect(&cfg);
    let m = call(&*ep, &hello(&*ep, 2), 2).unwrap();
    let h: HelloReply = protocol::decode_reply(opcode::HELLO, &m.payload).unwrap();
    assert_eq!(h.version, 2);
    let borrow = Request::Borrow(Borrow {
        device: DEV.into(),
        vm: "vm0".into(),
    });
    let m = call(&*ep, &borrow, 2).unwrap();
    let b = protocol::decode_borrowed(&m.payload, 2).unwrap();
    let bar0 = b.info.bars.iter().find(|x| x.index == 0).unwrap();
    let NotifyWrites::Polled { offset, len } = range else {
        unreachable!()
    };
    assert_eq!(bar0.notify, NotifyWrites::Doorbells { offset, len });
    let w = Request::BarWrite(protocol::BarWrite {
        lease: b.lease,
        bar: 0,
        offset: 0,
        data: vec![0; 4],
    });
    let m = call(&*ep, &w, 2).unwrap();
    assert!(m.payload.is_empty(), "a version 2 BAR_WRITE reply is ()");
    let r = Request::Reset(protocol::LeaseRef { lease: b.lease });
    let m = call(&*ep, &r, 2).unwrap();
    assert!(m.payload.is_empty());
    let ret = Request::Return(protocol::LeaseRef { lease: b.lease });
    call(&*ep, &ret, 2).unwrap();
    drop(ep);
    // Version 3: Polled, and the kick-only doorbells (none for a dmatest) in the replies.
    let c = LenderClient::from_endpoint_with_version(connect(&cfg), TOKEN, "v3", 3).unwrap();
    assert_eq!(c.protocol_version(), 3);
    let lease = c.borrow(DEV, "vm1").unwrap();
    let bar0 = lease.info().bars.iter().find(|x| x.index == 0).unwrap();
    assert_eq!(bar0.notify, range);
    let k = lease.bar_write_kicks(0, 0, &[0; 4]).unwrap().unwrap();
    assert!(k.offsets.is_empty());
    assert!(lease.reset_kicks().unwrap().unwrap().offsets.is_empty());
}

/// A version 3 borrower has no migration: the client refuses without a round trip, and the
/// version 4 opcodes sent raw in a version 3 session are unknown.
#[test]
fn version_3_borrower_sees_nothing_of_version_4() {
    let (_dir, cfg, _l) = lender();
    let c = LenderClient::from_endpoint_with_version(connect(&cfg), TOKEN, "v3", 3).unwrap();
    let lease = c.borrow(DEV, "vm0").unwrap();
    for e in [
        lease.start_dirty_log().unwrap_err(),
        lease.quiesce_for_handover(100).unwrap_err(),
        lease.create_transfer("vmm", "vm1").unwrap_err(),
    ] {
        assert!(
            matches!(e, ClientError::MigrationUnsupported { version: 3, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("does not support migration"), "{e}");
    }
    drop(lease);
    let ep = connect(&cfg);
    call(&*ep, &hello(&*ep, 3), 3).unwrap();
    for r in [
        Request::DirtyLogStart(LeaseRef { lease: 1 }),
        Request::QuiesceHandover(protocol::QuiesceHandover {
            lease: 1,
            timeout_ms: 10,
        }),
        Request::TransferCancel(LeaseRef { lease: 1 }),
    ] {
        let e = call(&*ep, &r, 4).unwrap_err();
        assert_eq!(e.code, code::UNKNOWN_OPCODE, "{r:?}: {}", e.message);
    }
}

/// A version 4 borrower: a dmatest copy's destination page (and only it) is in the dirty
/// log; the hand-over quiesce confirms the drain; an unused transfer ticket expires.
#[test]
fn version_4_borrower_gets_dirty_log_handover_and_expiring_tickets() {
    use emulated::dmatest::{
        CMD_ACK, CMD_START, REG_CMD, REG_DST, REG_LEN, REG_SRC, REG_STATUS, STATUS_DONE,
    };
    let (_dir, cfg, l, backend) = lender_with_backend(NotifyMode::Interrupt);
    let c = LenderClient::from_endpoint_with_version(connect(&cfg), TOKEN, "v4", 4).unwrap();
    assert_eq!(c.protocol_version(), 4);
    let lease = c.borrow(DEV, "vm0").unwrap();
    let ram = ntb::SharedMemory::new("v4-ram", 0x10000).unwrap();
    let w = c
        .endpoint()
        .export_window(ram.fd(), 0, 0x10000, "v4-ram")
        .unwrap();
    lease.map_dma(0x10000, 0x10000, w.id()).unwrap();
    assert!(lease.start_dirty_log().unwrap());
    let w32 = |off, v: u32| backend.bar_write(0, off, &v.to_le_bytes()).unwrap();
    let w64 = |off, v: u64| backend.bar_write(0, off, &v.to_le_bytes()).unwrap();
    w32(REG_CMD, CMD_ACK);
    w64(REG_SRC, 0x10000);
    w64(REG_DST, 0x15000);
    w32(REG_LEN, 64);
    w32(REG_CMD, CMD_START);
    let t0 = std::time::Instant::now();
    loop {
        let mut s = [0u8; 4];
        backend.bar_read(0, REG_STATUS, &mut s).unwrap();
        if u32::from_le_bytes(s) & STATUS_DONE != 0 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "copy did not finish");
        std::thread::sleep(Duration::from_millis(1));
    }
    let d = lease.fetch_dirty_log(0, 0).unwrap();
    assert_eq!((d.iova, d.pages), (0x10000, 16));
    assert_eq!(d.iovas(), vec![0x15000]);
    assert!(lease
        .fetch_dirty_log(0x10000, 0x10000)
        .unwrap()
        .iovas()
        .is_empty());
    let q = lease.quiesce_for_handover(1000).unwrap();
    assert!(q.drained, "{q:?}");
    lease.quiesce(false).unwrap();
    // An unused ticket expires: the destination is refused, counted, the lease stays.
    l.lender().set_ticket_ttl(Duration::from_millis(50));
    let t = lease.create_transfer("vmm", "vm1").unwrap();
    assert_eq!(t.expires_in_ms, 50);
    std::thread::sleep(Duration::from_millis(120));
    let dst = LenderClient::connect(&cfg, "vmm", "lender", TOKEN, "dst").unwrap();
    match dst.accept_transfer(&t, "vm1", &[], &[]) {
        Ok(_) => panic!("an expired ticket was accepted"),
        Err(e) => assert_eq!(e.code(), Some(protocol::migration::code::BAD_TICKET), "{e}"),
    }
    assert!(
        lease.counters().unwrap().is_some(),
        "the lease is untouched"
    );
}

/// A version 4 borrower of a version 5 lender: the session speaks 4, so peer-to-peer DMA is
/// refused by the client as unsupported (no round trip), and the P2P opcodes sent raw in a
/// version 4 session are unknown to the lender, as they are to a version 4 lender.
#[test]
fn version_4_borrower_is_told_p2p_is_not_supported() {
    let (_dir, cfg, _l) = lender();
    let c = LenderClient::from_endpoint_with_version(connect(&cfg), TOKEN, "v4", 4).unwrap();
    assert_eq!(c.protocol_version(), 4);
    let lease = c.borrow(DEV, "vm0").unwrap();
    let e = lease.p2p_map(lease.id() + 1, 0, 0xc000_0000).unwrap_err();
    assert!(
        matches!(
            e,
            ClientError::Unsupported {
                version: 4,
                needs: 5,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("peer-to-peer dma"), "{e}");
    assert!(lease.p2p_unmap(lease.id() + 1, 0).is_err());
    let ep = connect(&cfg);
    call(&*ep, &hello(&*ep, 4), 4).unwrap();
    for r in [
        Request::P2pMap(protocol::P2pMap {
            source: 1,
            target: 2,
            bar: 0,
            iova: 0xc000_0000,
        }),
        Request::P2pUnmap(protocol::P2pUnmap {
            source: 1,
            target: 2,
            bar: 0,
        }),
    ] {
        let e = call(&*ep, &r, protocol::PROTOCOL_VERSION).unwrap_err();
        assert_eq!(e.code, code::UNKNOWN_OPCODE, "{r:?}: {}", e.message);
    }
}
