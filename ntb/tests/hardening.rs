//! Pre-authentication denial of service against a listening node (issue 13, item 3), driven
//! by a raw peer that speaks the wire format by hand:
//! - a silent peer does not delay another peer's handshake, and a peer that trickles its
//!   hello is cut off at `connect_timeout`;
//! - WINDOW_ADDs beyond the peer's announced window count are refused, and their fds closed;
//! - a WINDOW_READ of up to 4 GiB is refused before anything of that size is allocated;
//! - a read reply of the wrong length, or an error, fails that read by name, and the next
//!   read still lands in its buffer;
//! - a staged window's commits out of sequence, past the ring or the window, or to another
//!   window are refused by name, break only that window's ring, and never the link.
//!
//! The tests count fds (`/proc/self/fd`) and the largest allocation of this process, so they
//! run one at a time ([`SERIAL`]).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ntb::wire::{self, msg, op, ErrorReply, Header, FLAG_ERROR, FLAG_REPLY, HEADER_LEN};
use ntb::{
    connect_addr, listen_addr, ControlAddr, FabricKind, LinkConfig, Listener, NodeId, SharedMemory,
    WindowLimits,
};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// Records the largest single allocation of the process.
struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call unchanged to the system allocator; only records sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        // SAFETY: same layout contract as our caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from System with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LARGEST.fetch_max(new, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

static SERIAL: Mutex<()> = Mutex::new(());
const T: Duration = Duration::from_secs(10);

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The listening side's settings: a long peer timeout so a raw peer need not heartbeat.
fn victim_cfg(connect_timeout: Duration) -> LinkConfig {
    LinkConfig {
        peer_timeout: Duration::from_secs(30),
        connect_timeout,
        ..LinkConfig::default()
    }
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

enum RawStream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

/// A peer that speaks the wire format by hand.
struct Raw {
    s: RawStream,
    /// Kept open for the life of the link (its doorbells and scratchpad on shm).
    _keep: Vec<Box<dyn Send>>,
}

impl Raw {
    fn stream(&mut self) -> &mut dyn ReadWrite {
        match &mut self.s {
            RawStream::Unix(s) => s,
            RawStream::Tcp(s) => s,
        }
    }

    fn send(&mut self, flags: u8, opcode: u16, id: u64, payload: &[u8], fds: &[RawFd]) {
        let bytes = wire::encode_frame(flags, opcode, id, payload, fds.len()).unwrap();
        match &mut self.s {
            RawStream::Unix(s) if !fds.is_empty() => {
                let n = s.send_with_fds(&[&bytes[..]], fds).unwrap();
                s.write_all(&bytes[n..]).unwrap();
            }
            RawStream::Unix(s) => s.write_all(&bytes).unwrap(),
            RawStream::Tcp(s) => s.write_all(&bytes).unwrap(),
        }
    }

    /// Reads frames (fds attached to them are discarded by the kernel) until `want` says yes.
    fn read_until(&mut self, want: impl Fn(&Header) -> bool) -> (Header, Vec<u8>) {
        let t0 = Instant::now();
        loop {
            assert!(t0.elapsed() < T, "no wanted frame within {T:?}");
            let s = self.stream();
            let mut hb = [0u8; HEADER_LEN];
            s.read_exact(&mut hb).unwrap();
            let h = Header::decode(&hb).unwrap();
            let mut p = vec![0u8; h.len as usize];
            s.read_exact(&mut p).unwrap();
            if want(&h) {
                return (h, p);
            }
        }
    }

    /// Connects to `addr` as node `name` and completes the handshake.
    fn connect(addr: &ControlAddr, name: &str) -> Raw {
        let (s, kind) = match addr {
            ControlAddr::Unix(p) => (
                RawStream::Unix(UnixStream::connect(p).unwrap()),
                FabricKind::Shm,
            ),
            ControlAddr::Tcp(a) => {
                // tcp links run inside TLS: speak the frames through its plaintext end.
                let (plain, binding) = ntb::tls::client(TcpStream::connect(a).unwrap(), T).unwrap();
                assert_eq!(binding.len(), ntb::tls::BINDING_LEN);
                (RawStream::Unix(plain), FabricKind::Tcp)
            }
        };
        let mut raw = Raw {
            s,
            _keep: Vec::new(),
        };
        match &raw.s {
            RawStream::Unix(s) => s.set_read_timeout(Some(T)).unwrap(),
            RawStream::Tcp(s) => s.set_read_timeout(Some(T)).unwrap(),
        }
        let hello = msg::Hello {
            version: wire::VERSION,
            node: name.into(),
            kind,
            limits: WindowLimits::default(),
            doorbells: 4,
            scratchpads: 16,
            heartbeat_ms: 250,
        };
        let p = wire::encode_payload(&hello).unwrap();
        let mut fds = Vec::new();
        if kind == FabricKind::Shm {
            for _ in 0..4 {
                let e = EventFd::new(libc::EFD_CLOEXEC).unwrap();
                fds.push(e.as_raw_fd());
                raw._keep.push(Box::new(e));
            }
            let spad = SharedMemory::new("raw-spad", 4096).unwrap();
            fds.push(spad.fd().as_raw_fd());
            raw._keep.push(Box::new(spad));
        }
        raw.send(0, op::HELLO, 1, &p, &fds);
        let (h, _) = raw.read_until(|h| h.opcode == op::HELLO);
        assert!(h.is_reply() && !h.is_error(), "hello refused");
        raw
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

fn tcp_listener(name: &str, cfg: &LinkConfig) -> (Box<dyn Listener>, ControlAddr) {
    let l = listen_addr(
        &ControlAddr::Tcp("127.0.0.1:0".parse().unwrap()),
        &NodeId::new(name).unwrap(),
        cfg,
    )
    .unwrap();
    let addr = l.local_addr();
    (l, addr)
}

fn shm_listener(
    dir: &tempfile::TempDir,
    name: &str,
    cfg: &LinkConfig,
) -> (Box<dyn Listener>, ControlAddr) {
    let addr = ControlAddr::Unix(dir.path().join(format!("{name}.sock")));
    let l = listen_addr(&addr, &NodeId::new(name).unwrap(), cfg).unwrap();
    (l, addr)
}

/// A raw peer named `name` linked to a victim `victim` listening on tcp (TLS): (victim's
/// end, raw peer).
fn tcp_victim_and_raw(victim: &str, name: &'static str) -> (Box<dyn ntb::Endpoint>, Raw) {
    let (l, addr) = tcp_listener(victim, &victim_cfg(Duration::from_secs(5)));
    let raw = std::thread::spawn(move || Raw::connect(&addr, name));
    let ep = l.accept(Some(T)).unwrap();
    (ep, raw.join().unwrap())
}

/// A raw peer named `name` linked to a victim listening on shm as "lender": (victim's end,
/// raw peer, the socket's directory, kept for the link's life).
fn shm_victim_and_raw(name: &'static str) -> (Box<dyn ntb::Endpoint>, Raw, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let (l, addr) = shm_listener(&dir, "lender", &victim_cfg(Duration::from_secs(5)));
    let raw = std::thread::spawn(move || Raw::connect(&addr, name));
    let ep = l.accept(Some(T)).unwrap();
    (ep, raw.join().unwrap(), dir)
}

/// Whether the raw socket is still open (nothing to read yet, no EOF).
fn still_open(s: &RawStream) -> bool {
    let mut b = [0u8; 1];
    let r = match s {
        RawStream::Unix(s) => {
            s.set_nonblocking(true).unwrap();
            (&*s).read(&mut b)
        }
        RawStream::Tcp(s) => {
            s.set_nonblocking(true).unwrap();
            (&*s).read(&mut b)
        }
    };
    matches!(r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

fn silent_peer_does_not_delay(kind: FabricKind) {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    // A long handshake bound: on a listener that shakes hands on its accept thread the
    // second peer would wait for all of it.
    let cfg = victim_cfg(Duration::from_secs(60));
    let (l, addr) = match kind {
        FabricKind::Shm => shm_listener(&dir, "lender", &cfg),
        FabricKind::Tcp | FabricKind::Bar => tcp_listener("lender", &cfg),
    };
    let silent = match &addr {
        ControlAddr::Unix(p) => RawStream::Unix(UnixStream::connect(p).unwrap()),
        ControlAddr::Tcp(a) => RawStream::Tcp(TcpStream::connect(a).unwrap()),
    };
    let a2 = addr.clone();
    let good = std::thread::spawn(move || {
        let c = LinkConfig {
            connect_timeout: Duration::from_secs(60),
            ..LinkConfig::default()
        };
        connect_addr(&a2, &NodeId::new("borrower2").unwrap(), &c)
    });
    let ep = l.accept(Some(T)).expect("the second borrower's link");
    assert_eq!(ep.peer_node().as_str(), "borrower2");
    // The silent peer's handshake is still pending, not failed and not finished.
    assert!(still_open(&silent), "silent peer still waiting");
    let b = good.join().unwrap().unwrap();
    assert!(b.is_up() && ep.is_up());
}

#[test]
fn silent_peer_does_not_delay_another_hello_shm() {
    silent_peer_does_not_delay(FabricKind::Shm);
}

#[test]
fn silent_peer_does_not_delay_another_hello_tcp() {
    silent_peer_does_not_delay(FabricKind::Tcp);
}

/// A peer that sends its first bytes at 10 bytes/s: each read sees data well within any
/// per-read timeout, but the whole handshake would take several times `connect_timeout`.
fn trickled_handshake_is_cut_off(kind: FabricKind) {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let cfg = victim_cfg(Duration::from_millis(500));
    let (l, addr) = match kind {
        FabricKind::Shm => shm_listener(&dir, "lender", &cfg),
        FabricKind::Tcp | FabricKind::Bar => tcp_listener("lender", &cfg),
    };
    let acceptor = std::thread::spawn(move || l.accept(Some(Duration::from_secs(8))).err());
    let bytes: Vec<u8> = match kind {
        // The fabric hello.
        FabricKind::Shm => {
            let hello = msg::Hello {
                version: wire::VERSION,
                node: "slowloris".into(),
                kind,
                limits: WindowLimits::default(),
                doorbells: 4,
                scratchpads: 16,
                heartbeat_ms: 250,
            };
            wire::encode_frame(0, op::HELLO, 1, &wire::encode_payload(&hello).unwrap(), 0).unwrap()
        }
        // A TLS handshake record of 512 bytes, most of which never comes in time.
        FabricKind::Tcp | FabricKind::Bar => {
            let mut b = vec![0x16, 0x03, 0x01, 0x02, 0x00];
            b.resize(60, 0);
            b
        }
    };
    let mut s: Box<dyn Write> = match &addr {
        ControlAddr::Unix(p) => Box::new(UnixStream::connect(p).unwrap()),
        ControlAddr::Tcp(a) => Box::new(TcpStream::connect(a).unwrap()),
    };
    let mut cut_after = None;
    for (i, b) in bytes.iter().enumerate() {
        if s.write_all(&[*b]).is_err() {
            cut_after = Some(i);
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        cut_after.is_some(),
        "{} bytes trickled at 10 bytes/s were never cut off",
        bytes.len()
    );
    let e = acceptor.join().unwrap();
    assert!(e.is_some(), "accept handed out the slow peer's link");
}

#[test]
fn trickled_hello_is_cut_off_at_connect_timeout_shm() {
    trickled_handshake_is_cut_off(FabricKind::Shm);
}

#[test]
fn trickled_tls_handshake_is_cut_off_at_connect_timeout_tcp() {
    trickled_handshake_is_cut_off(FabricKind::Tcp);
}

#[test]
fn window_add_flood_is_capped_without_fd_leaks() {
    let _g = serial();
    let (ep, mut raw, _dir) = shm_victim_and_raw("flooder");
    let mem = SharedMemory::new("flood", 4096).unwrap();
    let spare: Vec<EventFd> = (0..8)
        .map(|_| EventFd::new(libc::EFD_CLOEXEC).unwrap())
        .collect();
    let before = open_fds();
    let max = WindowLimits::default().max_windows as usize;
    const FLOOD: u32 = 400;
    for id in 1..=FLOOD {
        let p = wire::encode_payload(&msg::WindowAdd {
            id,
            size: 4096,
            fd_offset: 0,
            label: format!("w{id}"),
        })
        .unwrap();
        // Every tenth frame also carries fds a window does not need.
        let mut fds = vec![mem.fd().as_raw_fd()];
        if id % 10 == 0 {
            fds.extend(spare.iter().map(|e| e.as_raw_fd()));
        }
        raw.send(0, op::WINDOW_ADD, 0, &p, &fds);
    }
    // A request after the flood: its reply means every WINDOW_ADD was handled.
    let p = wire::encode_payload(&msg::SpadRead { index: 0 }).unwrap();
    raw.send(0, op::SPAD_READ, 77, &p, &[]);
    raw.read_until(|h| h.id == 77 && h.is_reply());
    assert_eq!(
        ep.peer_windows().len(),
        max,
        "windows beyond the announced maximum"
    );
    let after = open_fds();
    assert!(
        after <= before + max + 4,
        "{FLOOD} WINDOW_ADDs left {} more fds open (windows kept: {max})",
        after.saturating_sub(before)
    );
    // The link still works, and closing it gives every window fd back.
    assert!(ep.is_up());
    drop(ep);
    drop(raw);
    let t0 = Instant::now();
    while open_fds() > before && t0.elapsed() < T {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(open_fds() <= before, "fds left after the link closed");
}

#[test]
fn huge_window_read_is_refused_before_allocating() {
    let _g = serial();
    let (ep, mut raw) = tcp_victim_and_raw("lender", "reader");
    let mem = SharedMemory::new("win", 4096).unwrap();
    let w = ep.export_window(mem.fd(), 0, 4096, "ram").unwrap();
    let id = w.info().id;
    raw.read_until(|h| h.opcode == op::WINDOW_ADD);
    let read = |raw: &mut Raw, rid: u64, offset: u64, len: u32| {
        let p = wire::encode_payload(&msg::WindowRead { id, offset, len }).unwrap();
        raw.send(0, op::WINDOW_READ, rid, &p, &[]);
        raw.read_until(|h| h.id == rid && h.flags & FLAG_REPLY != 0)
    };
    LARGEST.store(0, Ordering::Relaxed);
    for (rid, offset, len) in [
        (10, 0, u32::MAX),
        (11, 0, 4097),
        (12, 1 << 40, 4096),
        (13, 4095, 2),
    ] {
        let (h, p) = read(&mut raw, rid, offset, len);
        assert!(
            h.flags & FLAG_ERROR != 0,
            "read {offset:#x}+{len:#x} answered"
        );
        let e: ErrorReply = wire::decode_payload(&p).unwrap();
        assert_eq!(e.code, wire::code::OUT_OF_RANGE, "{e}");
    }
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(
        largest < 8 << 20,
        "refusing reads allocated {largest} bytes at once"
    );
    // A read inside the window is served.
    let (h, p) = read(&mut raw, 14, 4000, 96);
    assert!(h.flags & FLAG_ERROR == 0);
    assert_eq!(p.len(), 96);
}

/// A window read's reply data lands straight in the reader's buffer (`ntb::link::sink`); a
/// peer that answers with another length, or with an error, gets the read refused with the
/// reason, and the next read on the same window still lands.
#[test]
fn read_replies_of_the_wrong_length_or_an_error_fail_the_read_and_the_next_one_lands() {
    let _g = serial();
    let (ep, mut raw) = tcp_victim_and_raw("borrower", "exporter");
    let add = msg::WindowAdd {
        id: 7,
        size: 2 << 20,
        fd_offset: 0,
        label: "raw".into(),
    };
    raw.send(
        0,
        op::WINDOW_ADD,
        0,
        &wire::encode_payload(&add).unwrap(),
        &[],
    );
    let info = ep.wait_peer_window("raw", T).unwrap();
    let w = ep.map_peer_window(info.id).unwrap();
    let pattern = |off: u64, len: u32| -> Vec<u8> {
        (off..off + u64::from(len))
            .map(|i| (i * 13 + 5) as u8)
            .collect()
    };
    // Answers the next `n` window reads: `reply(request)` says with what.
    let answer = |raw: &mut Raw, n: usize, reply: &dyn Fn(&msg::WindowRead) -> (u8, Vec<u8>)| {
        for _ in 0..n {
            let (h, p) = raw.read_until(|h| h.opcode == op::WINDOW_READ && !h.is_reply());
            let r: msg::WindowRead = wire::decode_payload(&p).unwrap();
            assert_eq!(r.id, 7);
            let (flags, body) = reply(&r);
            raw.send(FLAG_REPLY | flags, op::WINDOW_READ, h.id, &body, &[]);
        }
    };

    // 1.5 MiB: two chunks; the second one's reply has 100 bytes.
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0xAAu8; 3 << 19];
        let r = w.read_at(0, &mut buf);
        (w, buf, r)
    });
    answer(&mut raw, 2, &|r| {
        let full = pattern(r.offset, r.len);
        if r.offset == 0 {
            (0, full)
        } else {
            (0, full[..100].to_vec())
        }
    });
    let (w, buf, r) = reader.join().unwrap();
    let e = r.expect_err("a short reply was taken").to_string();
    assert!(
        e.contains("read reply has 100 bytes, asked for 524288"),
        "the refusal names the lengths: {e}"
    );
    assert_eq!(
        &buf[..1 << 20],
        &pattern(0, 1 << 20)[..],
        "the chunk answered in full landed in place"
    );

    // An error reply names the window as gone.
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 4096];
        let r = w.read_at(4096, &mut buf);
        (w, r)
    });
    answer(&mut raw, 1, &|_| {
        let e = ErrorReply::new(wire::code::UNKNOWN_WINDOW, "no window 7".to_string());
        (FLAG_ERROR, wire::encode_payload(&e).unwrap())
    });
    let (w, r) = reader.join().unwrap();
    assert!(
        matches!(r, Err(ntb::FabricError::WindowRevoked(7))),
        "an unknown-window answer is a revoked window: {r:?}"
    );

    // The link and the window still work: a read answered in full lands.
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 8192];
        let r = w.read_at(8192, &mut buf);
        (buf, r)
    });
    answer(&mut raw, 1, &|r| (0, pattern(r.offset, r.len)));
    let (buf, r) = reader.join().unwrap();
    r.unwrap();
    assert_eq!(buf, pattern(8192, 8192));
}

/// A peer's write into a mediated window on shm is read by the kernel straight into the
/// window (no payload buffer); a refused one (out of range, unknown window) is answered by
/// name and costs no allocation of its announced size, and the link goes on.
#[test]
fn mediated_writes_land_in_the_window_and_refused_ones_allocate_nothing() {
    let _g = serial();
    let (ep, mut raw, _dir) = shm_victim_and_raw("writer");
    let size = 2u64 << 20;
    let mem = SharedMemory::new("bar", size).unwrap();
    let w = ep.export_window_mediated(mem.fd(), 0, size, "bar").unwrap();
    let id = w.info().id;
    let (h, _) = raw.read_until(|h| h.opcode == op::WINDOW_ADD_STAGED);
    assert_eq!(
        h.fds, 1,
        "a mediated window travels with its staging ring only"
    );
    // Sends a write and returns its reply and the largest allocation of this process while
    // the victim took it (the frame is encoded before the count starts).
    let write = |raw: &mut Raw, rid: u64, win: u32, offset: u64, data: &[u8]| {
        let mut p = wire::encode_payload(&msg::WindowWrite { id: win, offset }).unwrap();
        p.extend_from_slice(data);
        let bytes = wire::encode_frame(0, op::WINDOW_WRITE, rid, &p, 0).unwrap();
        LARGEST.store(0, Ordering::Relaxed);
        raw.stream().write_all(&bytes).unwrap();
        let (h, p) = raw.read_until(|h| h.id == rid && h.flags & FLAG_REPLY != 0);
        (h, p, LARGEST.load(Ordering::Relaxed))
    };
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i * 7 + 3) as u8).collect();
    // Lands: a whole chunk at an odd offset, then a write shorter than the prefix buffer.
    let (h, _, largest) = write(&mut raw, 20, id, 4097, &data);
    assert!(h.flags & FLAG_ERROR == 0, "an in-range write was refused");
    assert!(
        largest < 64 << 10,
        "a 1 MiB write was read through a buffer of {largest} bytes"
    );
    let (h, _, _) = write(&mut raw, 21, id, 3, b"abc");
    assert!(h.flags & FLAG_ERROR == 0);
    let mut back = vec![0u8; data.len()];
    mem.read_at(4097, &mut back).unwrap();
    assert!(back == data, "the window holds other bytes than written");
    let mut small = [0u8; 3];
    mem.read_at(3, &mut small).unwrap();
    assert_eq!(&small, b"abc");
    // Refused, each by name, without allocating the announced size.
    for (rid, win, offset, code) in [
        (22, id, size - 10, wire::code::OUT_OF_RANGE),
        (23, id + 100, 0, wire::code::UNKNOWN_WINDOW),
    ] {
        let (h, p, largest) = write(&mut raw, rid, win, offset, &data);
        assert!(h.flags & FLAG_ERROR != 0, "write {rid} was taken");
        let e: ErrorReply = wire::decode_payload(&p).unwrap();
        assert_eq!(e.code, code, "{e}");
        assert!(
            largest < 64 << 10,
            "refusing a write allocated {largest} bytes at once"
        );
    }
    // The link goes on: a write after the refusals lands.
    let (h, _, _) = write(&mut raw, 24, id, 0, b"after");
    assert!(h.flags & FLAG_ERROR == 0);
    let mut after = [0u8; 5];
    mem.read_at(0, &mut after).unwrap();
    assert_eq!(&after, b"after");
}

impl Raw {
    /// Reads the next frame with its fds (shm): (header, payload, fds).
    fn read_with_fds(&mut self) -> (Header, Vec<u8>, Vec<std::os::fd::OwnedFd>) {
        use std::os::fd::FromRawFd;
        let RawStream::Unix(s) = &mut self.s else {
            panic!("fds travel on shm only")
        };
        let mut hb = [0u8; HEADER_LEN];
        let mut fds = [-1 as RawFd; 4];
        let mut iov = [libc::iovec {
            iov_base: hb.as_mut_ptr().cast(),
            iov_len: hb.len(),
        }];
        // SAFETY: the iovec points at `hb`, writable for its length.
        let (n, nfds) = unsafe { s.recv_with_fds(&mut iov, &mut fds) }.unwrap();
        s.read_exact(&mut hb[n..]).unwrap();
        let h = Header::decode(&hb).unwrap();
        let mut p = vec![0u8; h.len as usize];
        s.read_exact(&mut p).unwrap();
        // SAFETY: the kernel handed these fds to this process; nothing else owns them.
        let fds = fds[..nfds]
            .iter()
            .map(|&fd| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
            .collect();
        (h, p, fds)
    }

    /// Skips frames up to the next staged window's notice: (the notice, its ring fds).
    fn next_staged_window(&mut self) -> (msg::WindowAdd, Vec<std::os::fd::OwnedFd>) {
        loop {
            let (h, p, fds) = self.read_with_fds();
            if h.opcode == op::WINDOW_ADD_STAGED {
                return (wire::decode_payload(&p).unwrap(), fds);
            }
        }
    }
}

/// Maps a staged window's ring fd whole.
fn map_ring(fd: &std::os::fd::OwnedFd) -> ntb::mem::Mapping {
    use std::os::fd::AsFd;
    let len = ntb::mem::fd_size(fd.as_fd()).unwrap();
    ntb::mem::Mapping::map_shared(fd.as_fd(), 0, len).unwrap()
}

#[test]
fn staged_commits_are_checked_and_a_bad_one_breaks_only_its_ring() {
    use std::os::fd::AsFd;
    let _g = serial();
    let (ep, mut raw, _dir) = shm_victim_and_raw("stager");
    let size = 4u64 << 20;
    let mem = SharedMemory::new("bar", size).unwrap();
    let w1 = ep.export_window_mediated(mem.fd(), 0, size, "one").unwrap();
    let w2 = ep.export_window_mediated(mem.fd(), 0, size, "two").unwrap();
    let mut rings = Vec::new();
    while rings.len() < 2 {
        let (add, fds) = raw.next_staged_window();
        assert_eq!(fds.len(), 1, "window {} came without its ring", add.id);
        let fd = &fds[0];
        // The ring is sealed (the peer maps it safely) and is not the window's memory.
        let seals = ntb::mem::fd_seals(fd.as_fd()).unwrap().unwrap_or(0);
        assert_eq!(seals & ntb::mem::WINDOW_SEALS, ntb::mem::WINDOW_SEALS);
        assert_ne!(
            ntb::mem::fd_file_id(fd.as_fd()).unwrap(),
            ntb::mem::fd_file_id(mem.fd()).unwrap()
        );
        let map = map_ring(fd);
        let ring_len = map.len() as u64 - 4096;
        rings.push((add.id, map, ring_len));
    }
    let (id1, ring1, ring_len) = (&rings[0].0, &rings[0].1, rings[0].2);
    let (id1, id2) = (*id1, rings[1].0);
    assert_eq!((id1, id2), (w1.id(), w2.id()));
    let commit = |raw: &mut Raw, rid: u64, id: u32, offset: u64, pos: u64, len: u32| {
        let p = wire::encode_payload(&msg::WindowCommit {
            id,
            offset,
            pos,
            len,
        })
        .unwrap();
        raw.send(0, op::WINDOW_COMMIT, rid, &p, &[]);
        if rid == 0 {
            return None;
        }
        let (h, p) = raw.read_until(|h| h.id == rid && h.flags & FLAG_REPLY != 0);
        Some(if h.flags & FLAG_ERROR != 0 {
            Err(wire::decode_payload::<ErrorReply>(&p).unwrap())
        } else {
            Ok(())
        })
    };
    // The drained count in the ring's header, once it reaches `want`.
    let drained_to = |ring: &ntb::mem::Mapping, want: u64| {
        let t0 = Instant::now();
        loop {
            let mut d = [0u8; 8];
            ring.read_at(0, &mut d).unwrap();
            let d = u64::from_le_bytes(d);
            if d >= want || t0.elapsed() > T {
                return d;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    // Two chunks, the first posted, the last with an id: both land, the drained count says
    // so, and nothing is answered (an answer means a refusal).
    ring1.write_at(4096, &[7u8; 1000]).unwrap();
    ring1.write_at(4096 + 1000, &[9u8; 24]).unwrap();
    assert!(commit(&mut raw, 0, id1, 5000, 0, 1000).is_none());
    let p = wire::encode_payload(&msg::WindowCommit {
        id: id1,
        offset: 9000,
        pos: 1000,
        len: 24,
    })
    .unwrap();
    raw.send(0, op::WINDOW_COMMIT, 30, &p, &[]);
    assert_eq!(drained_to(ring1, 1024), 1024);
    let mut got = vec![0u8; 1000];
    mem.read_at(5000, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 7));
    mem.read_at(9000, &mut got[..24]).unwrap();
    assert!(got[..24].iter().all(|&b| b == 9));
    // Refused by name: a commit past the window's end. A writer's later commits follow from
    // a refused one, so the ring is broken from then on: every commit on it is refused.
    let e = commit(&mut raw, 31, id1, size - 8, 1024, 16)
        .unwrap()
        .unwrap_err();
    assert_eq!(e.code, wire::code::OUT_OF_RANGE, "{e}");
    let e = commit(&mut raw, 32, id1, 0, 1024, 16).unwrap().unwrap_err();
    assert!(e.message.contains("broken"), "{e}");
    // The other window's ring is its own: out of sequence, then past the ring's end.
    let e = commit(&mut raw, 33, id2, 0, 4096, 16).unwrap().unwrap_err();
    assert!(e.message.contains("expected 0"), "{e}");
    let w3 = ep
        .export_window_mediated(mem.fd(), 0, size, "three")
        .unwrap();
    let (add, fds) = raw.next_staged_window();
    let (id3, ring3) = (add.id, map_ring(&fds[0]));
    let e = commit(&mut raw, 34, id3, 0, 0, ring_len as u32 + 1)
        .unwrap()
        .unwrap_err();
    assert!(e.message.contains("past"), "{e}");
    // Unknown window, undecodable commit: refused, the link goes on.
    let e = commit(&mut raw, 35, id3 + 100, 0, 0, 1)
        .unwrap()
        .unwrap_err();
    assert_eq!(e.code, wire::code::UNKNOWN_WINDOW, "{e}");
    raw.send(0, op::WINDOW_COMMIT, 36, b"\xff", &[]);
    let (h, _) = raw.read_until(|h| h.id == 36 && h.flags & FLAG_REPLY != 0);
    assert!(h.flags & FLAG_ERROR != 0);
    // Posted garbage by the thousand costs nothing but rate-limited log lines.
    for i in 0..2000u64 {
        commit(&mut raw, 0, id2, i, i, 1);
    }
    // Still up: a message write lands, and a fresh window's staged write too.
    let w4 = ep
        .export_window_mediated(mem.fd(), 0, size, "four")
        .unwrap();
    let (add, fds) = raw.next_staged_window();
    let (id4, ring4) = (add.id, map_ring(&fds[0]));
    ring4.write_at(4096, b"still").unwrap();
    assert!(commit(&mut raw, 0, id4, 64, 0, 5).is_none());
    assert_eq!(drained_to(&ring4, 5), 5);
    // The ring counted the landed commit: the next one must follow it.
    let e = commit(&mut raw, 37, id4, 0, 0, 1).unwrap().unwrap_err();
    assert!(e.message.contains("expected 5"), "{e}");
    let mut s5 = [0u8; 5];
    mem.read_at(64, &mut s5).unwrap();
    assert_eq!(&s5, b"still");
    assert!(ep.is_up());
    drop((w1, w2, w3, w4, ring3));
}
