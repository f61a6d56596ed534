//! Device-to-device copy bandwidth on one lender: peer-to-peer against a copy through the
//! borrower's RAM (the paper's Fig. 10 / Table 1, same-lender column).
//!
//! An in-process lender lends two dmatest engines A and B over the shm fabric; the bench
//! plays the VMM and the guest driver: one session per device, "guest RAM" in a memfd
//! exported and mapped at IOVA = GPA for both, B's BAR0 placed at a guest-physical address
//! and mapped into A's domain with P2P_MAP. A copy of `size` bytes from A's buffer to B's
//! buffer is then
//!
//! * **p2p**: one command on A, destination B's BAR (`CMD_SRC_BUF`, DST = B's buffer address);
//! * **through RAM**: A copies its buffer into guest RAM, then B copies guest RAM into its
//!   buffer (`CMD_SRC_BUF`, then `CMD_DST_BUF`): the data moves twice.
//!
//! Commands are programmed the way a guest's stores reach the device on shm (stores into
//! the BAR window, then the notify eventfd, as a KVM ioeventfd does) and completion is seen
//! by polling COMPLETED in the window, so the figure is the device path, not the control
//! protocol. Sizes: 4 KiB … the 60 KiB buffer. Median of interleaved repetitions.
//!
//! `cargo bench -p lending --bench p2p` writes `target/bench/p2p.json` and `p2p.svg`
//! (`P2P_BENCH_OUT` overrides the JSON path, `P2P_BENCH_REPS` the repetitions, default 7,
//! `P2P_BENCH_ITERS` the copies per repetition, default 400).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use emulated::dmatest::{
    BUF_OFFSET, BUF_SIZE, CMD_DST_BUF, CMD_SRC_BUF, CMD_START, REG_CMD, REG_COMPLETED, REG_DST,
    REG_LEN, REG_SRC, REG_STATUS, STATUS_ERROR,
};
use emulated::NotifyMode;
use lending::backend::emulated::EmulatedBackend;
use lending::client::Lease;
use lending::inventory::Inventory;
use lending::server::{BackgroundLender, Lender};
use lending::LenderClient;
use ntb::{ClusterConfig, Fabric, PeerWindow, SharedMemory, SocketFabric};
use vmm_sys_util::eventfd::EventFd;

const TOKEN: &str = "p2p-bench-token";
const RAM_GPA: u64 = 0x10_0000;
const RAM_SIZE: u64 = 1 << 20;
const BAR_GPA: u64 = 0xc000_0000;

/// One device as the guest driver sees it on shm.
struct Dev {
    lease: Lease,
    bar: Box<dyn PeerWindow>,
    notify: EventFd,
}

impl Dev {
    fn w32(&self, off: u64, v: u32) {
        self.bar.write_at(off, &v.to_le_bytes()).unwrap();
    }
    fn w64(&self, off: u64, v: u64) {
        self.bar.write_at(off, &v.to_le_bytes()).unwrap();
    }
    fn r32(&self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.bar.read_at(off, &mut b).unwrap();
        u32::from_le_bytes(b)
    }

    /// One copy; spins until COMPLETED moves (bounded), panics on a device error.
    fn copy(&self, cmd: u32, src: u64, dst: u64, len: u32) {
        let done = self.r32(REG_COMPLETED);
        self.w64(REG_SRC, src);
        self.w64(REG_DST, dst);
        self.w32(REG_LEN, len);
        self.w32(REG_CMD, CMD_START | cmd);
        self.notify.write(1).unwrap();
        let t0 = Instant::now();
        while self.r32(REG_COMPLETED) == done {
            assert!(t0.elapsed() < Duration::from_secs(10), "copy never ended");
            std::hint::spin_loop();
        }
        let st = self.r32(REG_STATUS);
        assert_eq!(st & STATUS_ERROR, 0, "copy failed: status {st:#x}");
        // No CMD_ACK needed: START sets STATUS anew.
    }
}

fn env_u(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

struct Row {
    size: u64,
    p2p_gbps: f64,
    ram_gbps: f64,
    p2p_us: f64,
    ram_us: f64,
}

fn svg(rows: &[Row]) -> String {
    let (w, h) = (720.0, 360.0);
    let (left, top, bottom) = (60.0, 40.0, 60.0);
    let plot_h = h - top - bottom;
    let max = rows
        .iter()
        .map(|r| r.p2p_gbps / r.ram_gbps)
        .fold(2.0f64, f64::max)
        * 1.1;
    let y = |v: f64| top + plot_h * (1.0 - (v / max).min(1.0));
    let group = (w - left - 20.0) / rows.len() as f64;
    let bar = group * 0.35;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>\n<text x=\"{left}\" y=\"20\" font-size=\"14\">dmatest buffer to buffer, one lender: P2P relative to a copy through RAM (= 1.0)</text>"
    );
    for t in [0.0, 1.0, 1.8, 2.0] {
        let (c, d) = if t == 1.8 {
            ("#c00", "4 3")
        } else {
            ("#ccc", "")
        };
        let _ = writeln!(
            s,
            "<line x1=\"{left}\" x2=\"{}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"{c}\" stroke-dasharray=\"{d}\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{t:.1}</text>",
            w - 20.0,
            left - 4.0,
            y(t) + 4.0,
            yy = y(t)
        );
    }
    for (i, r) in rows.iter().enumerate() {
        let x0 = left + group * i as f64 + group * 0.15;
        let ratio = r.p2p_gbps / r.ram_gbps;
        for (k, (v, color)) in [(1.0, "#7a9cc6"), (ratio, "#e08a3c")].iter().enumerate() {
            let _ = writeln!(
                s,
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{color}\"/>",
                x0 + bar * k as f64,
                y(*v),
                bar - 2.0,
                y(0.0) - y(*v)
            );
        }
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{ratio:.2}</text><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{} KiB</text>",
            x0 + bar * 1.5,
            y(ratio) - 3.0,
            x0 + bar,
            h - bottom + 16.0,
            r.size / 1024
        );
    }
    let _ = writeln!(
        s,
        "<rect x=\"{}\" y=\"28\" width=\"10\" height=\"10\" fill=\"#7a9cc6\"/><text x=\"{}\" y=\"37\">through RAM</text><rect x=\"{}\" y=\"28\" width=\"10\" height=\"10\" fill=\"#e08a3c\"/><text x=\"{}\" y=\"37\">p2p</text>",
        w - 200.0,
        w - 186.0,
        w - 90.0,
        w - 76.0
    );
    s.push_str("</svg>\n");
    s
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs it once, small.
    let quick = std::env::args().any(|a| a == "--test") || std::env::args().len() <= 1;
    let reps = env_u("P2P_BENCH_REPS", if quick { 1 } else { 7 });
    let iters = env_u("P2P_BENCH_ITERS", if quick { 5 } else { 400 });
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    let out = std::env::var("P2P_BENCH_OUT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| root.join("target/bench/p2p.json"));

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let src = format!(
        "version = 1\n\
         [[node]]\nname = \"lender\"\nfabric = \"shm\"\ncontrol = \"{d}/lender.sock\"\n\
         [[node]]\nname = \"vmm\"\nfabric = \"shm\"\ncontrol = \"{d}/vmm.sock\"\n"
    );
    let path = dir.path().join("cluster.toml");
    std::fs::write(&path, src).unwrap();
    let cfg = ClusterConfig::load(&path).unwrap();
    let mk = |n: &str| Arc::new(EmulatedBackend::dmatest(n, NotifyMode::Interrupt).unwrap());
    let inv = Arc::new(
        Inventory::new(vec![
            ("0000:00:0a.0".to_string(), mk("bench-a") as _),
            ("0000:00:0b.0".to_string(), mk("bench-b") as _),
        ])
        .unwrap(),
    );
    let listener = SocketFabric::from_cluster(&cfg, "lender")
        .unwrap()
        .listen()
        .unwrap();
    let _bg = BackgroundLender::start(Lender::new(inv, "lender", TOKEN), listener).unwrap();

    let ram = SharedMemory::new("p2p-bench-ram", RAM_SIZE).unwrap();
    let mut windows = Vec::new();
    let mut clients = Vec::new();
    let mut open = |dev: &str| {
        let c = LenderClient::connect(&cfg, "vmm", "lender", TOKEN, "p2p-bench").unwrap();
        let lease = c.borrow(dev, "vm0").unwrap();
        let w = c
            .endpoint()
            .export_window(ram.fd(), 0, RAM_SIZE, &format!("ram-{}", lease.id()))
            .unwrap();
        lease.map_dma(RAM_GPA, RAM_SIZE, w.id()).unwrap();
        windows.push(w);
        let bar = lease.bar_window(0).unwrap();
        let notify = lease.notify_eventfd().unwrap().try_clone().unwrap();
        clients.push(c);
        Dev { lease, bar, notify }
    };
    let a = open("0000:00:0a.0");
    let b = open("0000:00:0b.0");
    a.lease.p2p_map(b.lease.id(), 0, BAR_GPA).unwrap();

    // A's buffer holds a pattern; checked in B's after each mode once.
    let pattern: Vec<u8> = (0..BUF_SIZE).map(|i| (i * 7 + 3) as u8).collect();
    a.bar.write_at(BUF_OFFSET, &pattern).unwrap();
    let p2p = |len: u32| a.copy(CMD_SRC_BUF, 0, BAR_GPA + BUF_OFFSET, len);
    let through_ram = |len: u32| {
        a.copy(CMD_SRC_BUF, 0, RAM_GPA, len);
        b.copy(CMD_DST_BUF, RAM_GPA, 0, len);
    };
    for (name, f) in [
        ("p2p", &p2p as &dyn Fn(u32)),
        ("through-ram", &through_ram as &dyn Fn(u32)),
    ] {
        b.bar
            .write_at(BUF_OFFSET, &vec![0; BUF_SIZE as usize])
            .unwrap();
        f(BUF_SIZE as u32);
        let mut got = vec![0; BUF_SIZE as usize];
        b.bar.read_at(BUF_OFFSET, &mut got).unwrap();
        assert_eq!(got, pattern, "{name}: B's buffer does not hold A's data");
    }

    let sizes: Vec<u64> = [4u64 << 10, 8 << 10, 16 << 10, 32 << 10, BUF_SIZE].to_vec();
    let mut rows = Vec::new();
    for &size in &sizes {
        let len = size as u32;
        // Warm-up, then interleaved repetitions (p2p, through RAM, p2p, ...).
        for _ in 0..iters.min(50) {
            p2p(len);
            through_ram(len);
        }
        let (mut tp, mut tr) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            let t0 = Instant::now();
            for _ in 0..iters {
                p2p(len);
            }
            tp.push(t0.elapsed().as_secs_f64() / iters as f64);
            let t0 = Instant::now();
            for _ in 0..iters {
                through_ram(len);
            }
            tr.push(t0.elapsed().as_secs_f64() / iters as f64);
        }
        let (p, r) = (median(tp), median(tr));
        rows.push(Row {
            size,
            p2p_gbps: size as f64 / p / 1e9,
            ram_gbps: size as f64 / r / 1e9,
            p2p_us: p * 1e6,
            ram_us: r * 1e6,
        });
    }

    let mut json = String::from("{\n  \"bench\": \"p2p-same-lender\",\n");
    let _ = writeln!(
        json,
        "  \"reps\": {reps},\n  \"iters\": {iters},\n  \"rows\": ["
    );
    for (i, r) in rows.iter().enumerate() {
        let _ = writeln!(
            json,
            "    {{\"size\": {}, \"p2p_gbps\": {:.4}, \"through_ram_gbps\": {:.4}, \"p2p_us\": {:.2}, \"through_ram_us\": {:.2}, \"ratio\": {:.3}}}{}",
            r.size,
            r.p2p_gbps,
            r.ram_gbps,
            r.p2p_us,
            r.ram_us,
            r.p2p_gbps / r.ram_gbps,
            if i + 1 < rows.len() { "," } else { "" }
        );
    }
    json.push_str("  ]\n}\n");
    if let Some(p) = out.parent() {
        std::fs::create_dir_all(p).unwrap();
    }
    std::fs::write(&out, &json).unwrap();
    std::fs::write(out.with_extension("svg"), svg(&rows)).unwrap();
    println!(
        "| size | p2p GB/s | through RAM GB/s | p2p µs | through RAM µs | p2p / through RAM |"
    );
    println!("|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} KiB | {:.2} | {:.2} | {:.1} | {:.1} | {:.2} |",
            r.size / 1024,
            r.p2p_gbps,
            r.ram_gbps,
            r.p2p_us,
            r.ram_us,
            r.p2p_gbps / r.ram_gbps
        );
    }
    println!("wrote {}", out.display());
    drop((a, b));
}
