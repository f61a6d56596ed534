//! tcp links run inside TLS: an eavesdropper on the path sees neither messages nor window
//! data, and both ends share a channel binding no other session has.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ntb::{
    connect_addr, listen_addr, ControlAddr, Incoming, LinkConfig, Message, NodeId, SharedMemory,
};

const T: Duration = Duration::from_secs(10);
const PATTERN: &[u8] = b"GUEST-RAM-SECRET-0123456789abcdef";

/// Forwards bytes between a client and `to`, recording what passes (both directions).
fn tap(to: std::net::SocketAddr) -> (std::net::SocketAddr, Arc<Mutex<Vec<u8>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = Arc::clone(&seen);
    std::thread::spawn(move || {
        let (c, _) = l.accept().unwrap();
        let s = TcpStream::connect(to).unwrap();
        let pipe = |mut a: TcpStream, mut b: TcpStream, seen: Arc<Mutex<Vec<u8>>>| {
            std::thread::spawn(move || {
                let mut buf = [0u8; 65536];
                while let Ok(n) = a.read(&mut buf) {
                    if n == 0 || b.write_all(&buf[..n]).is_err() {
                        break;
                    }
                    seen.lock().unwrap().extend_from_slice(&buf[..n]);
                }
                let _ = b.shutdown(std::net::Shutdown::Both);
            })
        };
        pipe(c.try_clone().unwrap(), s.try_clone().unwrap(), s2.clone());
        pipe(s, c, s2);
    });
    (addr, seen)
}

#[test]
fn eavesdropper_sees_no_plaintext_and_sessions_have_distinct_bindings() {
    let cfg = LinkConfig::default();
    let l = listen_addr(
        &ControlAddr::Tcp("127.0.0.1:0".parse().unwrap()),
        &NodeId::new("a").unwrap(),
        &cfg,
    )
    .unwrap();
    let ControlAddr::Tcp(real) = l.local_addr() else {
        panic!()
    };
    let (via, seen) = tap(real);
    let c2 = cfg.clone();
    let t = std::thread::spawn(move || {
        connect_addr(&ControlAddr::Tcp(via), &NodeId::new("b").unwrap(), &c2).unwrap()
    });
    let a = l.accept(Some(T)).unwrap();
    let b = t.join().unwrap();
    // Same binding on both ends of one link, 32 bytes.
    let bind = a.channel_binding();
    assert_eq!(bind.len(), ntb::tls::BINDING_LEN);
    assert_eq!(b.channel_binding(), bind);

    // A message and window data carrying the pattern, both ways.
    b.send(Message::raw(0x100, PATTERN.to_vec())).unwrap();
    match a.recv(T).unwrap() {
        Incoming::Event(m) => assert_eq!(m.payload, PATTERN),
        other => panic!("{other:?}"),
    }
    let mem = SharedMemory::new("tls-win", 4096).unwrap();
    let w = a.export_window(mem.fd(), 0, 4096, "ram").unwrap();
    let info = b.wait_peer_window("ram", T).unwrap();
    let pw = b.map_peer_window(info.id).unwrap();
    pw.write_at(100, PATTERN).unwrap();
    let mut back = vec![0u8; PATTERN.len()];
    pw.read_at(100, &mut back).unwrap();
    assert_eq!(back, PATTERN);
    drop(w);

    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.len() > 1000,
        "the tap saw the traffic ({} bytes)",
        seen.len()
    );
    assert_eq!(seen[0], 0x16, "the first bytes are a TLS handshake record");
    assert!(
        !seen.windows(PATTERN.len()).any(|w| w == PATTERN),
        "plaintext on the wire"
    );
    assert!(
        !seen.windows(4).any(|w| w == ntb::wire::MAGIC),
        "plain fabric frames on the wire"
    );

    // Another link has another binding.
    let t = std::thread::spawn(move || {
        connect_addr(&ControlAddr::Tcp(real), &NodeId::new("c").unwrap(), &cfg).unwrap()
    });
    let a2 = l.accept(Some(T)).unwrap();
    let _c = t.join().unwrap();
    assert_ne!(a2.channel_binding(), bind);
}

#[test]
fn shm_links_have_no_channel_binding() {
    let dir = tempfile::tempdir().unwrap();
    let addr = ControlAddr::Unix(dir.path().join("a.sock"));
    let l = listen_addr(&addr, &NodeId::new("a").unwrap(), &LinkConfig::default()).unwrap();
    let a2 = addr.clone();
    let t = std::thread::spawn(move || {
        connect_addr(&a2, &NodeId::new("b").unwrap(), &LinkConfig::default()).unwrap()
    });
    let a = l.accept(Some(T)).unwrap();
    let b = t.join().unwrap();
    assert!(a.channel_binding().is_empty() && b.channel_binding().is_empty());
}

/// Captures warnings (this test binary owns the global logger).
struct Capture(std::sync::Mutex<Vec<String>>);

static LOGS: Capture = Capture(std::sync::Mutex::new(Vec::new()));

impl log::Log for Capture {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::Level::Warn
    }
    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            self.0.lock().unwrap().push(r.args().to_string());
        }
    }
    fn flush(&self) {}
}

#[test]
fn a_peer_without_tls_is_refused_with_a_clear_reason() {
    let _ = log::set_logger(&LOGS).map(|()| log::set_max_level(log::LevelFilter::Warn));
    let l = listen_addr(
        &ControlAddr::Tcp("127.0.0.1:0".parse().unwrap()),
        &NodeId::new("a").unwrap(),
        &LinkConfig::default(),
    )
    .unwrap();
    let ControlAddr::Tcp(addr) = l.local_addr() else {
        panic!()
    };
    // What a node from before TLS sends first: a plain fabric frame.
    let mut s = TcpStream::connect(addr).unwrap();
    let frame = ntb::wire::encode_frame(0, ntb::wire::op::HELLO, 1, b"x", 0).unwrap();
    s.write_all(&frame).unwrap();
    assert!(l.accept(Some(Duration::from_millis(500))).is_err());
    // The connection is closed, and the reason is logged.
    s.set_read_timeout(Some(T)).unwrap();
    let mut b = [0u8; 16];
    assert!(matches!(s.read(&mut b), Ok(0) | Err(_)));
    let t0 = std::time::Instant::now();
    let found = loop {
        let hit = LOGS
            .0
            .lock()
            .unwrap()
            .iter()
            .any(|m| m.contains("speaks the fabric without TLS (an older lendvm)"));
        if hit || t0.elapsed() > T {
            break hit;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(found, "{:?}", LOGS.0.lock().unwrap());
}
