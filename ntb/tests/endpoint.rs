//! In-process checks of the Endpoint contract on both backends.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::fd::{AsFd, AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::time::Duration;

use ntb::{
    connect_addr, listen_addr, ClusterConfig, ControlAddr, Endpoint, Fabric, FabricError,
    FabricKind, Incoming, LinkConfig, Message, NodeId, SharedMemory, SocketFabric, WindowLimits,
};
use vmm_sys_util::eventfd::EventFd;

const T: Duration = Duration::from_secs(5);

struct Pair {
    a: Box<dyn Endpoint>,
    b: Box<dyn Endpoint>,
    _dir: tempfile::TempDir,
}

fn cfg() -> LinkConfig {
    LinkConfig {
        limits: WindowLimits {
            max_windows: 2,
            ..WindowLimits::default()
        },
        heartbeat: Duration::from_millis(50),
        peer_timeout: Duration::from_millis(2000),
        ..LinkConfig::default()
    }
}

fn pair(kind: FabricKind) -> Pair {
    let dir = tempfile::tempdir().unwrap();
    let addr = match kind {
        FabricKind::Shm => ControlAddr::Unix(dir.path().join("a.sock")),
        FabricKind::Tcp | FabricKind::Bar => ControlAddr::Tcp("127.0.0.1:0".parse().unwrap()),
    };
    let l = listen_addr(&addr, &NodeId::new("a").unwrap(), &cfg()).unwrap();
    let addr = l.local_addr();
    let t = std::thread::spawn(move || {
        connect_addr(&addr, &NodeId::new("b").unwrap(), &cfg()).unwrap()
    });
    let a = l.accept(Some(T)).unwrap();
    let b = t.join().unwrap();
    assert_eq!(a.peer_node().as_str(), "b");
    assert_eq!(b.peer_node().as_str(), "a");
    Pair { a, b, _dir: dir }
}

fn both(f: impl Fn(FabricKind, Pair)) {
    for k in [FabricKind::Shm, FabricKind::Tcp] {
        f(k, pair(k));
    }
}

#[test]
fn window_limits_and_alignment_are_enforced() {
    both(|kind, p| {
        let mem = SharedMemory::new("w", 64 << 10).unwrap();
        let e = p.a.export_window(mem.fd(), 100, 4096, "x").unwrap_err();
        assert!(
            matches!(e, FabricError::Misaligned { what: "offset", .. }),
            "{kind}: {e}"
        );
        assert_eq!(
            e.to_string(),
            "window offset 0x64 is not a multiple of the 0x1000 alignment"
        );
        let e = p.a.export_window(mem.fd(), 0, 5000, "x").unwrap_err();
        assert!(
            matches!(e, FabricError::Misaligned { what: "size", .. }),
            "{e}"
        );
        let e = p.a.export_window(mem.fd(), 0, 0, "x").unwrap_err();
        assert!(matches!(e, FabricError::ZeroSizeWindow), "{e}");
        let e = p.a.export_window(mem.fd(), 0, 128 << 30, "x").unwrap_err();
        assert!(matches!(e, FabricError::Oversized { .. }), "{e}");
        let e =
            p.a.export_window(mem.fd(), 60 << 10, 8192, "x")
                .unwrap_err();
        assert!(matches!(e, FabricError::RegionTooSmall { .. }), "{e}");
        let w1 = p.a.export_window(mem.fd(), 0, 4096, "one").unwrap();
        let w2 = p.a.export_window(mem.fd(), 4096, 4096, "two").unwrap();
        let e =
            p.a.export_window(mem.fd(), 8192, 4096, "three")
                .unwrap_err();
        assert!(matches!(e, FabricError::WindowLimit { max: 2 }), "{e}");
        assert_eq!(
            e.to_string(),
            "window limit reached: 2 windows already exported"
        );
        drop(w1);
        let w3 = p.a.export_window(mem.fd(), 8192, 4096, "three").unwrap();
        assert_ne!(w3.id(), w2.id());
        p.b.wait_peer_window("three", T).unwrap();
        let labels: Vec<_> = p.b.peer_windows().into_iter().map(|w| w.label).collect();
        assert_eq!(labels, ["two", "three"], "{kind}");
        let e = p.b.map_peer_window(999).err().unwrap();
        assert!(matches!(e, FabricError::UnknownWindow(999)), "{e}");
    });
}

#[test]
fn revoked_window_is_severed_at_the_mapper() {
    both(|kind, p| {
        let mem = SharedMemory::new("w", 8192).unwrap();
        let w = p.a.export_window(mem.fd(), 0, 8192, "buf").unwrap();
        let info = p.b.wait_peer_window("buf", T).unwrap();
        let m = p.b.map_peer_window(info.id).unwrap();
        m.write_at(8, b"hello").unwrap();
        let mut got = [0u8; 5];
        mem.read_at(8, &mut got).unwrap();
        assert_eq!(&got, b"hello", "{kind}");
        let e = m.write_at(8190, b"abc").unwrap_err();
        assert!(
            matches!(e, FabricError::OutOfRange { .. } | FabricError::Mem(_)),
            "{e}"
        );
        drop(w);
        loop {
            match p.b.recv(T).unwrap() {
                Incoming::WindowRemoved(id) => {
                    assert_eq!(id, info.id);
                    break;
                }
                Incoming::WindowAdded(_) => {}
                other => panic!("{other:?}"),
            }
        }
        assert!(!m.is_live());
        let e = m.write_at(0, b"late").unwrap_err();
        assert!(matches!(e, FabricError::WindowRevoked(_)), "{kind}: {e}");
        mem.read_at(0, &mut got[..4]).unwrap();
        assert_eq!(&got[..4], &[0, 0, 0, 0], "revoked writes must not land");
    });
}

/// A mediated window sends no fd of its memory, on shm too (there it sends only its staging
/// ring, which holds nothing of the exporter's): the mapper cannot map it directly, reaches
/// exactly the exported range of the file (nothing before or after it) through the
/// exporter, and loses it when the exporter drops the window, whatever it does.
#[test]
fn a_mediated_window_sends_no_fd_of_its_memory_and_is_the_exporters_to_revoke() {
    both(|kind, p| {
        let mem = SharedMemory::new("m", 3 * 4096).unwrap();
        mem.write_at(0, b"registers").unwrap();
        let w =
            p.a.export_window_mediated(mem.fd(), 4096, 4096, "peer")
                .unwrap();
        let info = p.b.wait_peer_window("peer", T).unwrap();
        let m = p.b.map_peer_window(info.id).unwrap();
        assert!(
            m.as_ptr().is_err(),
            "{kind}: a mediated window was directly mappable"
        );
        assert_eq!(m.len(), 4096);
        m.write_at(8, b"hello").unwrap();
        let mut got = [0u8; 9];
        mem.read_at(4096 + 8, &mut got[..5]).unwrap();
        assert_eq!(&got[..5], b"hello", "{kind}");
        // The range only: offsets are the window's, and past its end is refused.
        m.read_at(0, &mut got).unwrap();
        assert_ne!(&got, b"registers", "{kind}");
        assert!(m.write_at(4095, b"ab").is_err(), "{kind}");
        drop(w);
        loop {
            match p.b.recv(T).unwrap() {
                Incoming::WindowRemoved(id) => {
                    assert_eq!(id, info.id);
                    break;
                }
                Incoming::WindowAdded(_) => {}
                other => panic!("{other:?}"),
            }
        }
        assert!(m.write_at(0, b"late").is_err(), "{kind}");
        mem.write_at(4096 + 16, b"new").unwrap();
        let mut late = [0u8; 3];
        assert!(
            m.read_at(16, &mut late).is_err() || &late != b"new",
            "{kind}: the revoked window shows new data"
        );
        mem.read_at(4096, &mut got[..4]).unwrap();
        assert_eq!(
            &got[..4],
            &[0, 0, 0, 0],
            "{kind}: revoked writes must not land"
        );
    });
}

/// A mediated window's large writes: on shm through the exporter's staging ring (one commit
/// per 256 KiB chunk, no reply when they land), on tcp as messages. Both land every byte, at odd
/// offsets, in writes that wrap the 2 MiB ring several times and from two writers at once;
/// a write after the window's revocation fails by name.
#[test]
fn mediated_writes_of_every_size_land_whole_from_concurrent_writers() {
    both(|kind, p| {
        let size = 16u64 << 20;
        let mem = SharedMemory::new("m", size).unwrap();
        let w =
            p.a.export_window_mediated(mem.fd(), 0, size, "staged")
                .unwrap();
        let info = p.b.wait_peer_window("staged", T).unwrap();
        let m: std::sync::Arc<dyn ntb::PeerWindow> = p.b.map_peer_window(info.id).unwrap().into();
        let pattern = |seed: u32, n: usize| -> Vec<u8> {
            (0..n as u32)
                .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8 ^ seed as u8)
                .collect()
        };
        let frames_before = p.b.stats().frames_sent;
        // 7 MiB + 3 bytes at an odd offset: wraps the ring three times.
        let big = pattern(1, (7 << 20) + 3);
        m.write_at(4097, &big).unwrap();
        let mut back = vec![0u8; big.len()];
        mem.read_at(4097, &mut back).unwrap();
        assert!(back == big, "{kind}: a 7 MiB write landed other bytes");
        if kind == FabricKind::Shm {
            // 28 commits of 256 KiB (the last one shorter) rather than 8 messages of 1 MiB
            // carrying the data: the frames say which path the bytes took.
            let sent = p.b.stats().frames_sent - frames_before;
            assert!(sent >= 28, "{kind}: {sent} frames for a staged 7 MiB write");
        }
        // Small writes, including one byte, after the ring's position went odd.
        for (off, n) in [(3u64, 1usize), (size - 5, 5), (1 << 20, 4096)] {
            let d = pattern(off as u32, n);
            m.write_at(off, &d).unwrap();
            let mut b = vec![0u8; n];
            mem.read_at(off, &mut b).unwrap();
            assert_eq!(b, d, "{kind}: write of {n} at {off:#x}");
        }
        // Two writers at once, each its own 3 MiB half, the second through a second mapping
        // of the window (one ring, one position): both land whole.
        let m2: std::sync::Arc<dyn ntb::PeerWindow> = p.b.map_peer_window(info.id).unwrap().into();
        let halves: Vec<_> = (0..2u32)
            .map(|k| {
                let m = if k == 0 { m.clone() } else { m2.clone() };
                std::thread::spawn(move || {
                    let d = pattern(10 + k, 3 << 20);
                    for _ in 0..3 {
                        m.write_at(u64::from(k) * (8 << 20), &d).unwrap();
                    }
                    d
                })
            })
            .collect();
        for (k, h) in halves.into_iter().enumerate() {
            let d = h.join().unwrap();
            let mut b = vec![0u8; d.len()];
            mem.read_at(k as u64 * (8 << 20), &mut b).unwrap();
            assert!(b == d, "{kind}: writer {k}'s bytes were not all its own");
        }
        // Past the end: refused before anything moves.
        assert!(m.write_at(size - 4, &[0u8; 8]).is_err(), "{kind}");
        drop(w);
        let t0 = std::time::Instant::now();
        let e = loop {
            match m.write_at(0, &big) {
                Err(e) => break e,
                Ok(()) => assert!(t0.elapsed() < T, "{kind}: writes go on after revocation"),
            }
        };
        assert!(
            matches!(e, FabricError::WindowRevoked(id) if id == info.id),
            "{kind}: {e}"
        );
        assert!(p.b.is_up() && p.a.is_up(), "{kind}: the link went down");
    });
}

#[test]
fn tcp_batches_large_transfers_and_refuses_direct_mapping() {
    let p = pair(FabricKind::Tcp);
    let size = 6u64 << 20;
    let mem = SharedMemory::new("big", size).unwrap();
    let _w = p.a.export_window(mem.fd(), 0, size, "big").unwrap();
    let m =
        p.b.map_peer_window(p.b.wait_peer_window("big", T).unwrap().id)
            .unwrap();
    let e = m.as_ptr().unwrap_err();
    assert!(
        matches!(
            e,
            FabricError::DirectMappingUnsupported {
                kind: FabricKind::Tcp
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("use read/write"), "{e}");
    let data: Vec<u8> = (0..(5 << 20) + 123)
        .map(|i: usize| (i % 251) as u8)
        .collect();
    let before = p.b.stats().window_io_frames;
    m.write_at(77, &data).unwrap();
    assert_eq!(
        p.b.stats().window_io_frames - before,
        6,
        "5 MiB + 123 B in 1 MiB chunks"
    );
    let mut back = vec![0u8; data.len()];
    m.read_at(77, &mut back).unwrap();
    assert!(back == data);
    let mut direct = vec![0u8; data.len()];
    mem.read_at(77, &mut direct).unwrap();
    assert!(direct == data);
    let e = p.b.peer_doorbell_eventfd(0).unwrap_err();
    assert!(
        matches!(e, FabricError::DirectMappingUnsupported { .. }),
        "{e}"
    );
}

#[test]
fn doorbells_scratchpads_and_eventfds() {
    both(|kind, p| {
        p.a.ring_peer(0b101).unwrap();
        // Over tcp the bits of one ring may surface in two waits; collect them (bounded).
        let mut bits = 0;
        for _ in 0..2 {
            bits |= p.b.wait_doorbell(0xffff, T).unwrap();
            if bits == 0b101 {
                break;
            }
        }
        assert_eq!(bits, 0b101, "{kind}");
        let e = p.b.wait_doorbell(1, Duration::from_millis(20)).unwrap_err();
        assert!(matches!(e, FabricError::Timeout(_)), "{e}");
        let e = p.a.ring_peer(1 << 16).unwrap_err();
        assert!(
            matches!(e, FabricError::BadDoorbell { count: 16, .. }),
            "{e}"
        );
        // The local doorbell eventfd is what a KVM irqfd would use.
        let irq = p.b.doorbell_eventfd(7).unwrap();
        p.a.ring_peer(1 << 7).unwrap();
        let deadline = std::time::Instant::now() + T;
        loop {
            // Non-blocking eventfd: retry until the (tcp) message has been applied.
            if let Ok(v) = irq.read() {
                assert_eq!(v, 1);
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{kind}: doorbell 7 never fired"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        if kind == FabricKind::Shm {
            // ... and the peer's doorbell eventfd what a KVM ioeventfd would signal.
            p.a.peer_doorbell_eventfd(3).unwrap().write(1).unwrap();
            assert_eq!(p.b.wait_doorbell(1 << 3, T).unwrap(), 1 << 3);
        }
        p.a.write_peer_spad(3, 0xdead).unwrap();
        assert_eq!(p.a.read_peer_spad(3).unwrap(), 0xdead, "{kind}");
        assert_eq!(p.b.read_spad(3).unwrap(), 0xdead);
        p.b.write_spad(4, 9).unwrap();
        assert_eq!(p.a.read_peer_spad(4).unwrap(), 9);
        let e = p.a.write_peer_spad(16, 0).unwrap_err();
        assert!(matches!(e, FabricError::BadScratchpad { .. }), "{e}");
    });
}

#[test]
fn messages_requests_errors_and_fd_passing() {
    both(|kind, p| {
        let e = p.a.send(Message::raw(0x10, vec![])).unwrap_err();
        assert!(matches!(e, FabricError::ReservedOpcode(0x10)), "{e}");
        p.a.send(Message::new(0x200, &("ev", 7u32)).unwrap())
            .unwrap();
        match p.b.recv(T).unwrap() {
            Incoming::Event(m) => {
                assert_eq!(m.decode::<(String, u32)>().unwrap(), ("ev".into(), 7))
            }
            other => panic!("{other:?}"),
        }
        let efd = EventFd::new(0).unwrap();
        // SAFETY: into_raw_fd hands us sole ownership of the duplicated fd.
        let fd = unsafe { OwnedFd::from_raw_fd(efd.try_clone().unwrap().into_raw_fd()) };
        let msg = Message::raw(0x201, b"irq".to_vec()).with_fds(vec![fd]);
        if kind == FabricKind::Tcp {
            let e = p.a.send(msg).unwrap_err();
            assert!(matches!(e, FabricError::FdPassingUnsupported { .. }), "{e}");
            return;
        }
        let b = std::thread::scope(|s| {
            let h = s.spawn(|| p.a.request(msg, T));
            match p.b.recv(T).unwrap() {
                Incoming::Request { id, msg } => {
                    assert_eq!(msg.fds.len(), 1);
                    // Signal through the passed eventfd, as a lender would signal a KVM irqfd.
                    let n: u64 = 1;
                    // SAFETY: writing 8 bytes to an eventfd we own.
                    let r = unsafe {
                        libc::write(msg.fds[0].as_raw_fd(), (&n as *const u64).cast(), 8)
                    };
                    assert_eq!(r, 8);
                    p.b.reply(id, Err(ntb::ErrorReply::new(0x123, "no such device")))
                        .unwrap();
                }
                other => panic!("{other:?}"),
            }
            h.join().unwrap()
        });
        match b {
            Err(FabricError::Remote(e)) => {
                assert_eq!((e.code, e.message.as_str()), (0x123, "no such device"))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(efd.read().unwrap(), 1);
    });
}

/// One frame carries as many descriptors as one `sendmsg` may (`SCM_MAX_FD`, ntb's
/// `MAX_FDS`): a device's interrupts are wired with an eventfd per vector in one message, and
/// a GPU or a many-queue NVMe has far more than 32 vectors. Every one arrives usable, in
/// order; one more is refused before anything is sent, naming the count.
#[test]
fn a_frame_carries_as_many_descriptors_as_sendmsg_allows() {
    let p = pair(FabricKind::Shm);
    let max = ntb::wire::MAX_FDS;
    assert_eq!(max, 253, "the kernel's SCM_MAX_FD");
    let efds: Vec<EventFd> = (0..max).map(|_| EventFd::new(0).unwrap()).collect();
    let dup = |e: &EventFd| {
        // SAFETY: into_raw_fd hands us sole ownership of the duplicated fd.
        unsafe { OwnedFd::from_raw_fd(e.try_clone().unwrap().into_raw_fd()) }
    };
    let msg = Message::raw(0x202, b"irqs".to_vec()).with_fds(efds.iter().map(dup).collect());
    p.a.send(msg).unwrap();
    match p.b.recv(T).unwrap() {
        Incoming::Event(m) => {
            assert_eq!(m.fds.len(), max);
            // Signal vector i with i + 1: each fd is its own eventfd, in order.
            for (i, fd) in m.fds.iter().enumerate() {
                let n = i as u64 + 1;
                // SAFETY: writing 8 bytes to an eventfd we own.
                let r = unsafe { libc::write(fd.as_raw_fd(), (&n as *const u64).cast(), 8) };
                assert_eq!(r, 8);
            }
        }
        other => panic!("{other:?}"),
    }
    for (i, e) in efds.iter().enumerate() {
        assert_eq!(e.read().unwrap(), i as u64 + 1, "eventfd {i}");
    }
    let over = Message::raw(0x202, vec![]).with_fds(
        efds.iter()
            .chain(std::iter::once(&efds[0]))
            .map(dup)
            .collect(),
    );
    let e = p.a.send(over).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{} file descriptors attached, at most {max} allowed",
            max + 1
        )
    );
    // The link is still up: the refusal happened before anything was sent.
    p.a.send(Message::new(0x200, &("after", 1u32)).unwrap())
        .unwrap();
    assert!(matches!(p.b.recv(T).unwrap(), Incoming::Event(_)));
}

#[test]
fn close_is_seen_as_peer_gone_and_fails_further_calls() {
    both(|kind, p| {
        let mem = SharedMemory::new("w", 4096).unwrap();
        let _w = p.a.export_window(mem.fd(), 0, 4096, "buf").unwrap();
        let m =
            p.b.map_peer_window(p.b.wait_peer_window("buf", T).unwrap().id)
                .unwrap();
        p.a.close();
        let reason = p.b.wait_gone(T).unwrap();
        assert_eq!(reason, "peer closed the link", "{kind}");
        assert!(!p.b.is_up() && !m.is_live());
        let e = p.b.ring_peer(1).unwrap_err();
        assert!(e.is_peer_gone(), "{e}");
        assert_eq!(e.to_string(), "peer a is gone: peer closed the link");
        // Drain what arrived, then PeerGone.
        let mut n = 0;
        while let Ok(i) = p.b.recv(T) {
            assert!(matches!(i, Incoming::WindowAdded(_)), "{i:?}");
            n += 1;
            assert!(n < 10);
        }
        assert!(p.b.recv(T).unwrap_err().is_peer_gone());
        assert!(m.read_at(0, &mut [0u8; 4]).unwrap_err().is_peer_gone());
    });
}

#[test]
fn garbage_and_version_mismatch_do_not_take_down_the_listener() {
    use std::io::Write;
    let l = listen_addr(
        &ControlAddr::Tcp("127.0.0.1:0".parse().unwrap()),
        &NodeId::new("a").unwrap(),
        &cfg(),
    )
    .unwrap();
    let ControlAddr::Tcp(addr) = l.local_addr() else {
        panic!()
    };
    // Handshakes run off the accept thread: a failed one is logged and closed, and accept
    // goes on waiting for a good link.
    let closed = |s: &mut std::net::TcpStream| {
        use std::io::Read;
        s.set_read_timeout(Some(T)).unwrap();
        let mut b = [0u8; 64];
        loop {
            match s.read(&mut b) {
                Ok(0) | Err(_) => return true,
                Ok(_) => {} // an error reply, then the close
            }
        }
    };
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\n\r\nxxxxxxxxxxxxxxxxxxxxxxxx")
        .unwrap();
    let e = l.accept(Some(Duration::from_millis(300))).err().unwrap();
    assert!(matches!(e, FabricError::Timeout(_)), "{e}");
    assert!(closed(&mut s), "garbage peer closed");
    // A peer speaking another wire version is closed too.
    let mut bad = ntb::wire::encode_frame(0, ntb::wire::op::HELLO, 1, &[], 0).unwrap();
    bad[4] = 2;
    let mut s2 = std::net::TcpStream::connect(addr).unwrap();
    s2.write_all(&bad).unwrap();
    let e = l.accept(Some(Duration::from_millis(300))).err().unwrap();
    assert!(matches!(e, FabricError::Timeout(_)), "{e}");
    assert!(closed(&mut s2), "wrong-version peer closed");
    // The listener still works.
    let t = std::thread::spawn(move || {
        connect_addr(&ControlAddr::Tcp(addr), &NodeId::new("b").unwrap(), &cfg())
    });
    let a = l.accept(Some(T)).unwrap();
    let b = t.join().unwrap();
    assert!(b.is_ok() && a.is_up(), "{:?}", b.err());
}

#[test]
fn fabric_from_cluster_connects_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let p1 = dir.path().join("n1.sock");
    let src = format!(
        "[[node]]\nname = \"node1\"\nfabric = \"shm\"\ncontrol = \"{}\"\n\n[[node]]\nname = \"node2\"\nfabric = \"shm\"\ncontrol = \"{}\"\n",
        p1.display(),
        dir.path().join("n2.sock").display()
    );
    let c = ClusterConfig::parse(&src, "test").unwrap();
    let f1 = SocketFabric::from_cluster(&c, "node1").unwrap();
    let f2 = SocketFabric::from_cluster(&c, "node2").unwrap();
    assert_eq!(f2.peers().len(), 1);
    assert_eq!(f2.peers()[0].node.as_str(), "node1");
    let l = f1.listen().unwrap();
    let t = std::thread::spawn(move || {
        f2.connect(&NodeId::new("node1").unwrap())
            .map(|e| e.peer_node().clone())
    });
    let a = l.accept(Some(T)).unwrap();
    assert_eq!(a.peer_node().as_str(), "node2");
    assert_eq!(t.join().unwrap().unwrap().as_str(), "node1");
    let f3 = SocketFabric::from_cluster(&c, "node1").unwrap();
    let e = f3.connect(&NodeId::new("node9").unwrap()).err().unwrap();
    assert!(matches!(e, FabricError::UnknownPeer(_)), "{e}");
    assert_eq!(e.to_string(), "unknown peer node9");
    drop(l);
    assert!(!p1.exists(), "listener socket file removed on drop");
}

/// Two shm windows of the same file range are recognised as the same memory (a second VMM
/// exporting guest RAM's memfd it was handed); another range or another file is not; tcp
/// windows are reached by messages and never claim an identity.
#[test]
fn shm_windows_of_the_same_memory_share_a_backing_id() {
    both(|kind, p| {
        let mem = SharedMemory::new("ram", 16 << 10).unwrap();
        let other = SharedMemory::new("other", 16 << 10).unwrap();
        let w1 = p.a.export_window(mem.fd(), 4096, 8192, "one").unwrap();
        // The same memfd as a second process would hold it: another descriptor of the file.
        let dup = mem.fd().try_clone_to_owned().unwrap();
        let _w2 = p.b.export_window(dup.as_fd(), 4096, 8192, "same").unwrap();
        let one =
            p.b.map_peer_window(p.b.wait_peer_window("one", T).unwrap().id);
        let same =
            p.a.map_peer_window(p.a.wait_peer_window("same", T).unwrap().id);
        let (one, same) = (one.unwrap(), same.unwrap());
        match kind {
            FabricKind::Tcp | FabricKind::Bar => {
                assert_eq!(one.backing_id(), None);
                assert_eq!(same.backing_id(), None);
                return;
            }
            FabricKind::Shm => {}
        }
        let id = one.backing_id().expect("an shm window has an identity");
        assert_eq!((id.offset, id.len), (4096, 8192));
        assert_eq!(same.backing_id(), Some(id), "same file, same range");
        drop(w1);
        let _w3 = p.a.export_window(mem.fd(), 0, 8192, "shifted").unwrap();
        let _w4 = p.a.export_window(other.fd(), 4096, 8192, "other").unwrap();
        for label in ["shifted", "other"] {
            let w =
                p.b.map_peer_window(p.b.wait_peer_window(label, T).unwrap().id);
            let got = w.unwrap().backing_id().unwrap();
            assert_ne!(got, id, "{label}: not the same memory");
        }
    });
}

#[test]
fn the_bytes_waiting_on_a_link_are_bounded_not_just_their_count() {
    let p = pair(FabricKind::Shm);
    // 40 events of the largest payload the wire takes, none of them read yet: 40 MiB and
    // more if only their count (4096) were bounded.
    let big = ntb::wire::MAX_PAYLOAD;
    let n = 40;
    for _ in 0..n {
        p.b.send(Message::raw(
            ntb::wire::USER_OPCODE_BASE + 1,
            vec![7u8; big],
        ))
        .unwrap();
    }
    // Wait until the receiving side has taken every frame off the wire (nothing read yet).
    let t0 = std::time::Instant::now();
    while p.a.stats().frames_received < n as u64 {
        assert!(t0.elapsed() < T * 4, "{:?}", p.a.stats());
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut kept = 0usize;
    while let Ok(Incoming::Event(m)) = p.a.recv(Duration::from_millis(300)) {
        assert_eq!(m.payload.len(), big);
        kept += 1;
    }
    assert!(kept >= 1, "nothing was queued");
    assert!(
        kept * big <= 32 * big,
        "{kept} messages of {big} bytes were queued on one link"
    );
    // The link still works afterwards.
    p.b.send(Message::raw(ntb::wire::USER_OPCODE_BASE + 1, vec![1]))
        .unwrap();
    match p.a.recv(T).unwrap() {
        Incoming::Event(m) => assert_eq!(m.payload, [1]),
        _ => panic!("unexpected message"),
    }
}
