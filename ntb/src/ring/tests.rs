//! A borrower that speaks the ring by hand: one that stops reading.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::fabric::{FabricKind, LinkConfig, Listener, Message, NodeId, WindowLimits};
use crate::region::RegionSpec;
use crate::wire::{self, msg, op};

/// Pushes all of `frame` into the ring (kicking a sleeping lender), within 5 s.
fn push_all(rings: &mut Rings, conn: &mut Connection, tcp: &TcpStream, mut frame: &[u8]) {
    let t0 = Instant::now();
    while !frame.is_empty() {
        let n = rings.push(frame).unwrap();
        frame = &frame[n..];
        if rings.take_peer_sleeping() {
            send(
                conn,
                tcp,
                &[pump::KICK],
                Instant::now() + Duration::from_secs(5),
            )
            .unwrap();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the lender reads nothing"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A lender's link keeps writing to a borrower that still sends heartbeats but no longer
/// reads its ring: the ring fills, the pump stops taking the link's bytes, the link's writer
/// blocks in its socket, and after the peer timeout the link is down ("send failed"), as on
/// tcp when the peer stops reading its socket. Nothing queues without bound on the way.
#[test]
fn a_peer_that_stops_reading_costs_its_link_within_the_peer_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("region");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let spec = RegionSpec::file(&path).unwrap();
    let peer_timeout = Duration::from_millis(1500);
    let cfg = LinkConfig {
        heartbeat: Duration::from_millis(50),
        peer_timeout,
        region: Some(spec.clone()),
        ..LinkConfig::default()
    };
    let l = crate::tcp::TcpFabricListener::bind(
        "127.0.0.1:0".parse().unwrap(),
        &NodeId::new("a").unwrap(),
        &cfg,
    )
    .unwrap();
    let addr = match l.local_addr() {
        crate::ControlAddr::Tcp(a) => a,
        other => panic!("{other}"),
    };
    let accept = std::thread::spawn(move || l.accept(Some(Duration::from_secs(10))));

    // The borrower: TLS, the ring set-up, then the fabric hello by hand.
    let tcp = TcpStream::connect(addr).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let (mut conn, _binding) = crate::tls::handshake(&tcp, true, deadline).unwrap();
    let region = Region::open(&spec).unwrap();
    let ring = negotiate(&mut conn, &tcp, true, &region, deadline)
        .unwrap()
        .expect("a ring");
    let path = ring.path();
    let mut rings = ring.rings;
    let hello = msg::Hello {
        version: wire::VERSION,
        node: "b".into(),
        kind: FabricKind::Bar,
        limits: WindowLimits::default(),
        doorbells: 16,
        scratchpads: 16,
        heartbeat_ms: 50,
    };
    let frame =
        wire::encode_frame(0, op::HELLO, 1, &wire::encode_payload(&hello).unwrap(), 0).unwrap();
    push_all(&mut rings, &mut conn, &tcp, &frame);
    let lender = accept.join().unwrap().unwrap();
    assert_eq!(lender.control_path(), path);

    // Heartbeats only, never a read.
    let stop = Arc::new(AtomicBool::new(false));
    let beats = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let hb = wire::encode_frame(0, op::HEARTBEAT, 0, &[], 0).unwrap();
            let t0 = Instant::now();
            while !stop.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(20) {
                push_all(&mut rings, &mut conn, &tcp, &hb);
                std::thread::sleep(Duration::from_millis(50));
            }
            (rings, conn, tcp)
        })
    };
    let t0 = Instant::now();
    let mut sent = 0usize;
    let err = loop {
        match lender.send(Message::raw(0x100, vec![0x5a; 64 << 10])) {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "{sent} messages of 64 KiB sent to a peer that reads nothing"
        );
    };
    let took = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    let _ = beats.join();
    assert!(err.is_peer_gone(), "{err}");
    assert!(err.to_string().contains("send failed"), "{err}");
    // What the way holds before the writer blocks: the ring, the pump's one buffer and the
    // socket pair's buffers; never the whole stream.
    assert!(
        (sent as u64) < 64,
        "{sent} messages of 64 KiB went out before the link blocked"
    );
    assert!(
        took < peer_timeout + Duration::from_secs(3),
        "the link took {took:?} to give up (peer timeout {peer_timeout:?})"
    );
    assert!(!lender.is_up());
}

/// On a kernel whose timers are coarser than the pumps' naps (L1's, HZ=100 without
/// high-resolution timers), a pump does not nap: it marks itself asleep whenever it has
/// nothing to move and the peer kicks it for every message. Requests and replies still all
/// arrive, and the pumps took kicks for them.
#[test]
fn on_coarse_timers_the_pump_waits_for_kicks_and_nothing_is_lost() {
    use crate::{connect_addr, listen_addr, ControlAddr, ControlPath, Incoming};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("region");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    let cfg = || LinkConfig {
        heartbeat: Duration::from_millis(50),
        peer_timeout: Duration::from_millis(2000),
        region: Some(RegionSpec::file(&path).unwrap()),
        ..LinkConfig::default()
    };
    let kicks_before = pump::COARSE_KICKS_TAKEN.load(Ordering::Relaxed);
    let l = listen_addr(
        &ControlAddr::Tcp("127.0.0.1:0".parse().unwrap()),
        &NodeId::new("coarse-a").unwrap(),
        &cfg(),
    )
    .unwrap();
    let addr = l.local_addr();
    // The lender's pump (its connection's local end is the listener) has coarse timers; no
    // other pump does.
    let ControlAddr::Tcp(local) = addr.clone() else {
        panic!("{addr:?}")
    };
    *pump::COARSE_LOCAL.lock().unwrap() = Some(local);
    let bcfg = cfg();
    let t =
        std::thread::spawn(move || connect_addr(&addr, &NodeId::new("coarse-b").unwrap(), &bcfg));
    let lender = l.accept(Some(Duration::from_secs(5))).unwrap();
    let borrower = t.join().unwrap().unwrap();
    assert!(matches!(borrower.control_path(), ControlPath::Ring { .. }));
    let t5 = Duration::from_secs(5);
    let server = std::thread::spawn(move || {
        for _ in 0..30 {
            match lender.recv(t5).unwrap() {
                Incoming::Request { id, msg } => {
                    let mut p = msg.payload;
                    p.reverse();
                    lender.reply(id, Ok(Message::raw(0x101, p))).unwrap();
                }
                other => panic!("{other:?}"),
            }
            // Quiet between requests: the lender's pump goes back to waiting for a kick.
            std::thread::sleep(Duration::from_millis(2));
        }
        lender
    });
    for i in 0..30usize {
        let p: Vec<u8> = (0..i * 700).map(|b| (b * 3 + i) as u8).collect();
        let r = borrower
            .request(Message::raw(0x100, p.clone()), t5)
            .unwrap();
        let mut want = p;
        want.reverse();
        assert_eq!(r.payload, want, "reply {i}");
    }
    let lender = server.join().unwrap();
    *pump::COARSE_LOCAL.lock().unwrap() = None;
    let kicks = pump::COARSE_KICKS_TAKEN.load(Ordering::Relaxed) - kicks_before;
    assert!(
        kicks >= 30,
        "30 requests to a pump that waits for kicks took {kicks} kicks"
    );
    assert!(lender.is_up() && borrower.is_up());
}
