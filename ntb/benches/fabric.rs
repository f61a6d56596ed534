//! Fabric benchmark (not a test): `cargo bench -p ntb` (section `fabric` of
//! `scripts/bench.sh`).
//!
//! * window copy bandwidth for 4 KiB … 64 MiB: a plain in-process memcpy (the limit of shm),
//!   shm peer-window writes and reads, a shm *mediated* window's writes (through the
//!   exporter's staging ring: the path of a cross-lender P2P copy); a plain rustls TLS 1.3 stream on loopback with the
//!   fabric's own TLS configuration (`ntb::tls::client_config`, so the same cipher suite: the
//!   limit of an encrypted link on this machine), and the tcp fabric's window writes and
//!   reads, interleaved in the same trials;
//! * doorbell round trip (`ring_peer` → the peer's `wait_doorbell` → ring back) and interrupt
//!   round trip (the way a lender's MSI-X reaches a VMM: the peer's doorbell *eventfd* fires,
//!   as an irqfd would; on shm the ring is the peer's eventfd itself, on tcp a message), p50 and
//!   p99, on shm and tcp.
//!
//! Writes `ntb.json`, `ntb.svg` and the Markdown fragment `fabric.md` into `$NTB_BENCH_DIR`,
//! else `$CARGO_TARGET_DIR/bench/`, else `target/bench/`. `LENDVM_BENCH_QUICK=1` runs a short
//! budget (checks that it runs; its figures mean little). Both nodes run in this process,
//! each with its own link threads; a shm peer window is still an mmap of the other node's
//! memfd.

// A benchmark harness, like a test: panicking on setup failure is the right behaviour.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ntb::{
    connect_addr, listen_addr, ControlAddr, Endpoint, FabricKind, LinkConfig, NodeId, PeerWindow,
    SharedMemory,
};
use rustls::pki_types::ServerName;
use rustls::{ClientConnection, ServerConnection, StreamOwned};

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;
const SIZES: [usize; 8] = [
    4 * KIB,
    16 * KIB,
    64 * KIB,
    256 * KIB,
    MIB,
    4 * MIB,
    16 * MIB,
    64 * MIB,
];

/// The short budget of `scripts/bench.sh --quick` (CI): everything runs, briefly.
fn quick() -> bool {
    std::env::var("LENDVM_BENCH_QUICK").is_ok_and(|v| v == "1")
}

/// A listener of `kind` as node "a" (shm: a socket `<name>-<kind>.sock` in `dir`) and its
/// address.
fn listener(
    kind: FabricKind,
    dir: &std::path::Path,
    name: &str,
    cfg: &LinkConfig,
) -> (Box<dyn ntb::Listener>, ControlAddr) {
    let addr = match kind {
        FabricKind::Shm => ControlAddr::Unix(dir.join(format!("{name}-{kind}.sock"))),
        FabricKind::Tcp | FabricKind::Bar => ControlAddr::Tcp("127.0.0.1:0".parse().expect("addr")),
    };
    let l = listen_addr(&addr, &NodeId::new("a").expect("id"), cfg).expect("listen");
    let addr = l.local_addr();
    (l, addr)
}

fn pair(kind: FabricKind, dir: &std::path::Path) -> (Box<dyn Endpoint>, Box<dyn Endpoint>) {
    let cfg = LinkConfig::default();
    let (l, addr) = listener(kind, dir, "bench", &cfg);
    let c2 = cfg.clone();
    let t = std::thread::spawn(move || {
        connect_addr(&addr, &NodeId::new("b").expect("id"), &c2).expect("connect")
    });
    let a = l.accept(Some(Duration::from_secs(5))).expect("accept");
    (a, t.join().expect("join"))
}

/// Bytes per second of `f` moving `size` bytes, over repeated calls within a budget.
fn rate(size: usize, budget: Duration, min_iters: u64, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    let mut n = 0u64;
    while n < min_iters || (start.elapsed() < budget && n < 100_000) {
        f();
        n += 1;
    }
    (size as f64 * n as f64) / start.elapsed().as_secs_f64()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(v, 0.5)
}

/// A plain rustls TLS 1.3 stream on loopback with the fabric's configuration: the client
/// sends a length and that many bytes, the server reads them into a buffer (as a window write
/// lands in the peer's memory) and answers one byte, like the reply that completes a window
/// write.
struct TlsStream {
    client: StreamOwned<ClientConnection, TcpStream>,
    server: Option<std::thread::JoinHandle<()>>,
    suite: String,
}

impl TlsStream {
    fn new(max: usize) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let server = std::thread::spawn(move || {
            let (tcp, _) = l.accept().expect("accept");
            tcp.set_nodelay(true).expect("nodelay");
            let conn = ServerConnection::new(ntb::tls::server_config().expect("server config"))
                .expect("server conn");
            let mut s = StreamOwned::new(conn, tcp);
            let mut dst = vec![0u8; max];
            loop {
                let mut len = [0u8; 8];
                s.read_exact(&mut len).expect("read len");
                let len = u64::from_le_bytes(len) as usize;
                if len == 0 {
                    break;
                }
                s.read_exact(&mut dst[..len]).expect("read data");
                std::hint::black_box(&mut dst);
                s.write_all(&[1]).expect("ack");
                s.flush().expect("flush");
            }
        });
        let tcp = TcpStream::connect(addr).expect("connect");
        tcp.set_nodelay(true).expect("nodelay");
        let name = ServerName::try_from(ntb::tls::NAME).expect("name");
        let conn = ClientConnection::new(ntb::tls::client_config().expect("client config"), name)
            .expect("client conn");
        let mut client = StreamOwned::new(conn, tcp);
        // Complete the handshake before timing anything.
        client.write_all(&4u64.to_le_bytes()).expect("len");
        client.write_all(&[0; 4]).expect("data");
        let mut ack = [0u8; 1];
        client.read_exact(&mut ack).expect("ack");
        let suite = client
            .conn
            .negotiated_cipher_suite()
            .map(|s| format!("{:?}", s.suite()))
            .unwrap_or_else(|| "?".into());
        TlsStream {
            client,
            server: Some(server),
            suite,
        }
    }

    fn send(&mut self, data: &[u8]) {
        self.client
            .write_all(&(data.len() as u64).to_le_bytes())
            .expect("len");
        self.client.write_all(data).expect("data");
        self.client.flush().expect("flush");
        let mut ack = [0u8; 1];
        self.client.read_exact(&mut ack).expect("ack");
    }
}

impl Drop for TlsStream {
    fn drop(&mut self) {
        let _ = self.client.write_all(&0u64.to_le_bytes());
        let _ = self.client.flush();
        if let Some(t) = self.server.take() {
            let _ = t.join();
        }
    }
}

/// p50 and p99 in µs of `iters` round trips after as many warm-ups, at most 100.
fn round_trips(iters: usize, mut once: impl FnMut()) -> (f64, f64) {
    let warm = iters.min(100);
    let mut lat = Vec::with_capacity(iters);
    for i in 0..iters + warm {
        let t0 = Instant::now();
        once();
        if i >= warm {
            lat.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    lat.sort_by(f64::total_cmp);
    (percentile(&lat, 0.5), percentile(&lat, 0.99))
}

/// CPU time of this process so far (user + system, all threads), in ms.
fn cpu_ms() -> f64 {
    // SAFETY: all-zero is a valid rusage; getrusage fills it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid out-pointer.
    let r = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    assert_eq!(r, 0, "getrusage");
    let ms = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
    ms(u.ru_utime) + ms(u.ru_stime)
}

/// A link's set-up, what every new lender session starts with: connect, TLS on tcp (with the
/// resumption a repeat connection gets), the fabric handshake and both ends' link threads,
/// then its teardown. Both ends are in this process, so the CPU time per link is both ends'.
/// Returns (p50 ms, p99 ms, CPU ms per link).
fn link_setup(kind: FabricKind, dir: &std::path::Path, iters: usize) -> (f64, f64, f64) {
    let cfg = LinkConfig::default();
    let (l, addr) = listener(kind, dir, "setup", &cfg);
    let warm = iters.min(10);
    let mut lat = Vec::with_capacity(iters);
    let mut cpu = 0.0;
    for i in 0..iters + warm {
        let (c0, t0) = (cpu_ms(), Instant::now());
        let (a2, c2) = (addr.clone(), cfg.clone());
        let t = std::thread::spawn(move || {
            connect_addr(&a2, &NodeId::new("b").expect("id"), &c2).expect("connect")
        });
        let a = l.accept(Some(Duration::from_secs(5))).expect("accept");
        let b = t.join().expect("join");
        let up = t0.elapsed().as_secs_f64() * 1e3;
        drop((a, b));
        if i >= warm {
            lat.push(up);
            cpu += cpu_ms() - c0;
        }
    }
    lat.sort_by(f64::total_cmp);
    (
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        cpu / iters as f64,
    )
}

/// Doorbell round trip through the `Endpoint` API: ring bit 0, the peer's `wait_doorbell`
/// returns and it rings bit 0 back. Bit 1 stops the responder.
fn doorbell_rtt(
    a: &dyn Endpoint,
    b: Box<dyn Endpoint>,
    iters: usize,
) -> (f64, f64, Box<dyn Endpoint>) {
    let t = Duration::from_secs(5);
    let responder = std::thread::spawn(move || {
        loop {
            match b.wait_doorbell(0b11, t) {
                Ok(bits) if bits & 0b10 != 0 => break,
                Ok(_) => b.ring_peer(1).expect("ring back"),
                Err(e) => panic!("responder: {e}"),
            }
        }
        b
    });
    let (p50, p99) = round_trips(iters, || {
        a.ring_peer(1).expect("ring");
        a.wait_doorbell(1, t).expect("wait");
    });
    a.ring_peer(0b10).expect("stop");
    let b = responder.join().expect("responder");
    (p50, p99, b)
}

/// Waits for a (non-blocking) doorbell eventfd to fire and consumes it, as KVM's irqfd does.
fn wait_eventfd(fd: &vmm_sys_util::eventfd::EventFd) {
    use std::os::fd::AsRawFd;
    loop {
        if fd.read().is_ok() {
            return;
        }
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut p, 1, 5000) };
        assert!(
            r >= 0 || std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
        );
        assert!(r != 0, "interrupt round trip: no interrupt within 5 s");
    }
}

/// Interrupt round trip on doorbell bit 2, consumed the way a VMM consumes a lender's MSI-X:
/// a read of the local doorbell *eventfd* (an irqfd's eventfd). The ring is the peer's
/// doorbell eventfd on shm (a lender's controller writes it directly) and a doorbell message
/// on tcp. Bit 3 stops the responder.
fn interrupt_rtt(a: &dyn Endpoint, b: Box<dyn Endpoint>, iters: usize) -> (f64, f64) {
    const IRQ: u32 = 2;
    const STOP: u32 = 3;
    let shm = a.kind() == FabricKind::Shm;
    let a_irq = a.doorbell_eventfd(IRQ).expect("eventfd");
    let b_irq = b.doorbell_eventfd(IRQ).expect("eventfd");
    let responder = std::thread::spawn(move || {
        let back = b.peer_doorbell_eventfd(IRQ).ok();
        loop {
            wait_eventfd(&b_irq);
            if b.wait_doorbell(1 << STOP, Duration::ZERO).is_ok() {
                break;
            }
            match &back {
                Some(fd) => fd.write(1).expect("eventfd write"),
                None => b.ring_peer(1 << IRQ).expect("ring back"),
            }
        }
    });
    let fwd = if shm {
        Some(a.peer_doorbell_eventfd(IRQ).expect("peer eventfd"))
    } else {
        None
    };
    let fire = || match &fwd {
        Some(fd) => fd.write(1).expect("eventfd write"),
        None => a.ring_peer(1 << IRQ).expect("ring"),
    };
    let r = round_trips(iters, || {
        fire();
        wait_eventfd(&a_irq);
    });
    a.ring_peer(1 << STOP).expect("stop");
    fire();
    responder.join().expect("responder");
    r
}

fn out_dir() -> PathBuf {
    if let Ok(p) = std::env::var("NTB_BENCH_DIR") {
        return PathBuf::from(p);
    }
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("bench")
}

fn fmt_size(s: usize) -> String {
    if s >= MIB {
        format!("{} MiB", s / MIB)
    } else {
        format!("{} KiB", s / KIB)
    }
}

/// A log-scale plot (bandwidths span 0.01 … 100 GB/s) of each series against size.
fn svg(series: &[(&str, &str, Vec<f64>)], notes: &[String]) -> String {
    let (w, h, l, r, t, b) = (780.0, 460.0, 70.0, 200.0, 40.0, 60.0);
    let vals = || {
        series
            .iter()
            .flat_map(|s| s.2.iter().copied())
            .filter(|v| *v > 0.0)
    };
    let lo = vals()
        .fold(f64::INFINITY, f64::min)
        .max(1e-4)
        .log10()
        .floor();
    let hi = vals()
        .fold(0.0f64, f64::max)
        .max(1e-3)
        .log10()
        .ceil()
        .max(lo + 1.0);
    let x = |i: usize| l + (w - l - r) * i as f64 / (SIZES.len() - 1) as f64;
    let y = |v: f64| h - b - (h - t - b) * (v.max(1e-9).log10() - lo) / (hi - lo);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{l}\" y=\"22\" font-size=\"15\">ntb window bandwidth (GB/s, log scale) vs transfer size</text>\n"
    );
    let _ = writeln!(
        s,
        "<line x1=\"{l}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"black\"/><line x1=\"{l}\" y1=\"{t}\" x2=\"{l}\" y2=\"{0}\" stroke=\"black\"/>",
        h - b,
        w - r
    );
    let mut e = lo;
    while e <= hi {
        let v = 10f64.powf(e);
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{v}</text><line x1=\"{l}\" y1=\"{1}\" x2=\"{}\" y2=\"{1}\" stroke=\"#ddd\"/>",
            l - 6.0,
            y(v),
            w - r
        );
        e += 1.0;
    }
    for (i, sz) in SIZES.iter().enumerate() {
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            x(i),
            h - b + 18.0,
            fmt_size(*sz)
        );
    }
    for (k, (name, color, vals)) in series.iter().enumerate() {
        let pts: Vec<String> = vals
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{:.1},{:.1}", x(i), y(*v)))
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>",
            pts.join(" ")
        );
        let ly = t + 20.0 * k as f64;
        let _ = writeln!(
            s,
            "<line x1=\"{0}\" y1=\"{ly}\" x2=\"{1}\" y2=\"{ly}\" stroke=\"{color}\" stroke-width=\"3\"/><text x=\"{2}\" y=\"{3}\">{name}</text>",
            w - r + 10.0,
            w - r + 30.0,
            w - r + 36.0,
            ly + 4.0
        );
    }
    for (k, n) in notes.iter().enumerate() {
        let _ = writeln!(
            s,
            "<text x=\"{l}\" y=\"{}\">{n}</text>",
            h - 22.0 + 14.0 * k as f64 - 14.0 * (notes.len() as f64 - 1.0)
        );
    }
    s + "</svg>\n"
}

fn met(ok: bool) -> &'static str {
    if ok {
        "**met**"
    } else {
        "**missed**"
    }
}

/// One size's medians over the interleaved trials (GB/s; ratios are medians of per-trial
/// ratios, each against the neighbouring limit trial).
struct Row {
    size: usize,
    memcpy: f64,
    shm_write: f64,
    shm_read: f64,
    shm_vs_memcpy: f64,
    /// A mediated window's writes on shm, through its staging ring (a cross-lender P2P
    /// copy's path).
    mediated_write: f64,
    mediated_vs_memcpy: f64,
    tls: f64,
    tcp_write: f64,
    tcp_read: f64,
    tcp_write_vs_tls: f64,
    tcp_read_vs_tls: f64,
}

/// Maps the peer window `label` that `ep`'s peer exports.
fn map_window(ep: &dyn Endpoint, label: &str) -> Box<dyn PeerWindow> {
    let info = ep
        .wait_peer_window(label, Duration::from_secs(5))
        .expect("win");
    ep.map_peer_window(info.id).expect("map")
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` would pass nothing: do the same.
    let quick = quick();
    let (trials, budget, tcp_budget, min_iters) = if quick {
        (1, Duration::from_millis(2), Duration::from_millis(10), 1)
    } else {
        (7, Duration::from_millis(8), Duration::from_millis(150), 2)
    };
    // Quick (CI): enough round trips to show the path works. Beside a busy machine each one
    // waits for a scheduler slice, and 1,200 of them took 20 s of CI's time.
    let rtt_iters = if quick { 30 } else { 5000 };
    let dir = tempfile::tempdir().expect("tempdir");
    let (sa, sb) = pair(FabricKind::Shm, dir.path());
    let (ta, tb) = pair(FabricKind::Tcp, dir.path());
    let max = *SIZES.last().expect("sizes");
    let src: Vec<u8> = (0..max).map(|i| (i * 7) as u8).collect();
    let mut dst = vec![0u8; max];
    let shm_mem = SharedMemory::new("bench-shm", max as u64).expect("memfd");
    let _shm_win = sa
        .export_window(shm_mem.fd(), 0, max as u64, "bench")
        .expect("export");
    let shm_w = map_window(sb.as_ref(), "bench");
    let med_mem = SharedMemory::new("bench-mediated", max as u64).expect("memfd");
    let _med_win = sa
        .export_window_mediated(med_mem.fd(), 0, max as u64, "bench-mediated")
        .expect("export");
    let med_w = map_window(sb.as_ref(), "bench-mediated");
    let tcp_mem = SharedMemory::new("bench-tcp", max as u64).expect("memfd");
    let _tcp_win = ta
        .export_window(tcp_mem.fd(), 0, max as u64, "bench")
        .expect("export");
    let tcp_w = map_window(tb.as_ref(), "bench");
    let mut tls = TlsStream::new(max);
    println!(
        "plain TLS stream: {} (the fabric's ntb::tls configuration)",
        tls.suite
    );

    let mut rows = Vec::new();
    for &size in &SIZES {
        let mut rbuf = vec![0u8; size];
        // Warm up (fault in every page of every destination) once per size.
        dst[..size].copy_from_slice(&src[..size]);
        shm_w.write_at(0, &src[..size]).expect("shm write");
        shm_w.read_at(0, &mut rbuf).expect("shm read");
        med_w.write_at(0, &src[..size]).expect("mediated write");
        tcp_w.write_at(0, &src[..size]).expect("tcp write");
        tcp_w.read_at(0, &mut rbuf).expect("tcp read");
        tls.send(&src[..size]);
        // The machine is shared: alternate short trials so background load hits all alike,
        // and compare each trial with its neighbouring limit trial.
        let mut v: [Vec<f64>; 11] = Default::default();
        for _ in 0..trials {
            let tm = rate(size, budget, min_iters, || {
                // SAFETY: distinct buffers of at least `size` bytes.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr(), size) };
                std::hint::black_box(&mut dst);
            });
            let sw = rate(size, budget, min_iters, || {
                shm_w.write_at(0, &src[..size]).expect("shm write")
            });
            let sr = rate(size, budget, min_iters, || {
                shm_w.read_at(0, &mut rbuf).expect("shm read");
                std::hint::black_box(&mut rbuf);
            });
            let mw = rate(size, budget, min_iters, || {
                med_w.write_at(0, &src[..size]).expect("mediated write")
            });
            let tl = rate(size, tcp_budget, min_iters, || tls.send(&src[..size]));
            let tw = rate(size, tcp_budget, min_iters, || {
                tcp_w.write_at(0, &src[..size]).expect("tcp write")
            });
            let tr = rate(size, tcp_budget, min_iters, || {
                tcp_w.read_at(0, &mut rbuf).expect("tcp read");
                std::hint::black_box(&mut rbuf);
            });
            for (k, x) in [
                tm,
                sw,
                sr,
                tl,
                tw,
                tr,
                sw / tm,
                tw / tl,
                tr / tl,
                mw,
                mw / tm,
            ]
            .into_iter()
            .enumerate()
            {
                v[k].push(x);
            }
        }
        let [m, sw, sr, tl, tw, tr, r1, r2, r3, mw, r4] = v.map(|mut x| median(&mut x));
        let row = Row {
            size,
            memcpy: m / 1e9,
            shm_write: sw / 1e9,
            shm_read: sr / 1e9,
            shm_vs_memcpy: r1,
            mediated_write: mw / 1e9,
            mediated_vs_memcpy: r4,
            tls: tl / 1e9,
            tcp_write: tw / 1e9,
            tcp_read: tr / 1e9,
            tcp_write_vs_tls: r2,
            tcp_read_vs_tls: r3,
        };
        println!(
            "size {:>7}: memcpy {:6.2}  shm write {:6.2} ({:.2}x)  shm read {:6.2}  mediated write {:6.2} ({:.2}x) | TLS stream {:6.3}  tcp write {:6.3} ({:.2}x)  tcp read {:6.3} ({:.2}x) GB/s",
            fmt_size(size),
            row.memcpy,
            row.shm_write,
            row.shm_vs_memcpy,
            row.shm_read,
            row.mediated_write,
            row.mediated_vs_memcpy,
            row.tls,
            row.tcp_write,
            row.tcp_write_vs_tls,
            row.tcp_read,
            row.tcp_read_vs_tls
        );
        rows.push(row);
    }
    let suite = tls.suite.clone();
    drop((shm_w, med_w, tcp_w, tls));
    let (sd50, sd99, sb) = doorbell_rtt(sa.as_ref(), sb, rtt_iters);
    let (td50, td99, tb) = doorbell_rtt(ta.as_ref(), tb, rtt_iters);
    let (si50, si99) = interrupt_rtt(sa.as_ref(), sb, rtt_iters);
    let (ti50, ti99) = interrupt_rtt(ta.as_ref(), tb, rtt_iters);
    println!(
        "doorbell round trip: shm p50 {sd50:.1} us p99 {sd99:.1} us; tcp p50 {td50:.1} us p99 {td99:.1} us"
    );
    println!(
        "interrupt round trip: shm p50 {si50:.1} us p99 {si99:.1} us; tcp p50 {ti50:.1} us p99 {ti99:.1} us"
    );
    let setup_iters = if quick { 10 } else { 300 };
    let (ss50, ss99, scpu) = link_setup(FabricKind::Shm, dir.path(), setup_iters);
    let (ts50, ts99, tcpu) = link_setup(FabricKind::Tcp, dir.path(), setup_iters);
    println!(
        "link set-up: shm p50 {ss50:.2} ms p99 {ss99:.2} ms cpu {scpu:.2} ms; tcp+TLS p50 {ts50:.2} ms p99 {ts99:.2} ms cpu {tcpu:.2} ms"
    );
    let big = || rows.iter().filter(|r| r.size >= MIB);
    let shm_min = big().map(|r| r.shm_vs_memcpy).fold(f64::INFINITY, f64::min);
    let tcp_min = big()
        .map(|r| r.tcp_write_vs_tls)
        .fold(f64::INFINITY, f64::min);
    let tcp_read_min = big()
        .map(|r| r.tcp_read_vs_tls)
        .fold(f64::INFINITY, f64::min);
    println!(
        "shm write / memcpy >= 1 MiB: min {shm_min:.2} (goal >= 0.90); tcp write / TLS stream >= 1 MiB: min {tcp_min:.2}, read {tcp_read_min:.2} (goal >= 0.50 each)"
    );

    let json = serde_json::json!({
        "bench": "ntb fabric",
        "quick": quick,
        "trials": trials,
        "tls_cipher_suite": suite,
        "note": "both nodes in one process; GB/s = median of interleaved trials; ratios = median of per-trial ratios against the neighbouring limit trial (memcpy for shm, the plain TLS stream for tcp)",
        "bandwidth": rows.iter().map(|r| serde_json::json!({
            "size": r.size,
            "memcpy_gbps": r.memcpy,
            "shm_write_gbps": r.shm_write,
            "shm_read_gbps": r.shm_read,
            "shm_write_vs_memcpy": r.shm_vs_memcpy,
            "shm_mediated_write_gbps": r.mediated_write,
            "shm_mediated_write_vs_memcpy": r.mediated_vs_memcpy,
            "tls_stream_gbps": r.tls,
            "tcp_write_gbps": r.tcp_write,
            "tcp_read_gbps": r.tcp_read,
            "tcp_write_vs_tls": r.tcp_write_vs_tls,
            "tcp_read_vs_tls": r.tcp_read_vs_tls,
        })).collect::<Vec<_>>(),
        "shm_vs_memcpy_min_ge_1mib": shm_min,
        "tcp_write_vs_tls_min_ge_1mib": tcp_min,
        "tcp_read_vs_tls_min_ge_1mib": tcp_read_min,
        "goal_shm_vs_memcpy_ge_1mib": 0.9,
        "goal_tcp_write_vs_tls_ge_1mib": 0.5,
        "goal_tcp_read_vs_tls_ge_1mib": 0.5,
        "doorbell_rtt_us": {
            "shm": {"p50": sd50, "p99": sd99, "iters": rtt_iters},
            "tcp": {"p50": td50, "p99": td99, "iters": rtt_iters},
        },
        "interrupt_rtt_us": {
            "shm": {"p50": si50, "p99": si99, "iters": rtt_iters},
            "tcp": {"p50": ti50, "p99": ti99, "iters": rtt_iters},
        },
        "link_setup_ms": {
            "shm": {"p50": ss50, "p99": ss99, "cpu_per_link": scpu, "iters": setup_iters},
            "tcp": {"p50": ts50, "p99": ts99, "cpu_per_link": tcpu, "iters": setup_iters},
        },
    });
    let dir = out_dir();
    std::fs::create_dir_all(&dir).expect("create bench dir");
    let path = dir.join("ntb.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json).expect("json")).expect("write json");
    let notes = vec![
        format!("doorbell RTT: shm p50 {sd50:.1} / p99 {sd99:.1} us; tcp p50 {td50:.1} / p99 {td99:.1} us"),
        format!("interrupt RTT: shm p50 {si50:.1} / p99 {si99:.1} us; tcp p50 {ti50:.1} / p99 {ti99:.1} us"),
    ];
    let col = |f: fn(&Row) -> f64| rows.iter().map(f).collect::<Vec<_>>();
    let plot = svg(
        &[
            ("memcpy", "#222", col(|r| r.memcpy)),
            ("shm write", "#d62728", col(|r| r.shm_write)),
            ("shm read", "#ff9896", col(|r| r.shm_read)),
            ("shm mediated write", "#9467bd", col(|r| r.mediated_write)),
            ("TLS stream (limit)", "#2ca02c", col(|r| r.tls)),
            ("tcp write", "#1f77b4", col(|r| r.tcp_write)),
            ("tcp read", "#aec7e8", col(|r| r.tcp_read)),
        ],
        &notes,
    );
    std::fs::write(dir.join("ntb.svg"), plot).expect("write svg");

    // The Markdown fragment for docs/BENCHMARKS.md: every figure from this run.
    let mut md = String::new();
    let _ = writeln!(
        md,
        "Median of {trials} interleaved trials per size (GB/s); ratios are medians of per-trial ratios against the neighbouring limit trial. TLS: {suite}.\n"
    );
    md += "| size | memcpy | shm write | shm read | shm write / memcpy | shm mediated write | mediated / memcpy | TLS stream | tcp write | tcp read | tcp write / TLS | tcp read / TLS |\n";
    md += "|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for r in &rows {
        let _ = writeln!(
            md,
            "| {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} |",
            fmt_size(r.size),
            r.memcpy,
            r.shm_write,
            r.shm_read,
            r.shm_vs_memcpy,
            r.mediated_write,
            r.mediated_vs_memcpy,
            r.tls,
            r.tcp_write,
            r.tcp_read,
            r.tcp_write_vs_tls,
            r.tcp_read_vs_tls
        );
    }
    let _ = writeln!(
        md,
        "\n| round trip ({rtt_iters} each, µs) | shm p50 | shm p99 | tcp p50 | tcp p99 |\n|---|---|---|---|---|\n| doorbell (`ring_peer` → `wait_doorbell`) | {sd50:.1} | {sd99:.1} | {td50:.1} | {td99:.1} |\n| interrupt (ring → the peer's doorbell eventfd) | {si50:.1} | {si99:.1} | {ti50:.1} | {ti99:.1} |\n"
    );
    let _ = writeln!(
        md,
        "| link set-up ({setup_iters} each: connect → both ends up; both ends in this process) | shm | tcp+TLS |\n|---|---|---|\n| p50 (ms) | {ss50:.2} | {ts50:.2} |\n| p99 (ms) | {ss99:.2} | {ts99:.2} |\n| CPU per link, both ends (ms) | {scpu:.2} | {tcpu:.2} |\n"
    );
    let _ = writeln!(
        md,
        "- Goal shm write ≥ 0.9× memcpy at ≥ 1 MiB: {} (minimum {shm_min:.2}).",
        met(shm_min >= 0.9)
    );
    let _ = writeln!(
        md,
        "- Goal tcp write ≥ 0.5× the plain TLS stream at ≥ 1 MiB: {} (minimum {tcp_min:.2}).",
        met(tcp_min >= 0.5)
    );
    let _ = writeln!(
        md,
        "- Goal tcp read ≥ 0.5× the plain TLS stream at ≥ 1 MiB: {} (minimum {tcp_read_min:.2}).",
        met(tcp_read_min >= 0.5)
    );
    md += "- Doorbell and interrupt round trips reported with p50/p99: above.\n";
    std::fs::write(dir.join("fabric.md"), md).expect("write md");
    println!("wrote {}, ntb.svg and fabric.md", path.display());
}
