//! Device-to-device copy bandwidth: peer-to-peer against a copy through the borrower's RAM,
//! on one lender and across two lenders (the paper's Fig. 10 / Table 1).
//!
//! Two in-process lenders on the shm fabric: lender A lends dmatest engines A and A2, lender
//! B lends dmatest B, each with a 64 MiB buffer (`dmatest:buf=64M`). The bench plays the VMM
//! and the guest driver: one session per device, "guest RAM" (64 MiB) in a memfd exported
//! and mapped at IOVA = GPA for every device, the target's BAR0 placed at a guest-physical
//! address and mapped into A's domain (P2P_MAP for A2 on the same lender; P2P_GRANT on B +
//! P2P_MAP_REMOTE on A across lenders, through A's lender-to-lender link to B). A copy of
//! `size` bytes from A's buffer to the target's buffer is then
//!
//! * **p2p**: one command on A, destination the target's BAR (`CMD_SRC_BUF`, DST = the
//!   target's buffer address): the data moves once;
//! * **through RAM**: A copies its buffer into guest RAM, then the target copies guest RAM
//!   into its buffer (`CMD_SRC_BUF`, then `CMD_DST_BUF`): the data moves twice.
//!
//! Commands are programmed the way a guest's stores reach the device on shm (stores into
//! the BAR window, then the notify eventfd, as a KVM ioeventfd does) and completion is seen
//! by polling COMPLETED in the window, so the figure is the device path, not the control
//! protocol. Sizes 4 KiB … 64 MiB; per size and mode, copies until `P2P_BENCH_BYTES` (default
//! 32 MiB, at least 2 copies) have moved, median of `P2P_BENCH_REPS` (default 3) interleaved
//! repetitions; `P2P_BENCH_TOPOLOGY=same-lender` or `cross-lender` runs one topology alone
//! (to profile it).
//!
//! `cargo bench -p lending --bench p2p` writes `target/bench/p2p-bench.json`, `p2p-bench.svg`
//! and the Markdown fragment `p2p.md` (section `p2p` of `scripts/bench.sh`; `P2P_BENCH_OUT`
//! overrides the JSON path, the others go beside it). `LENDVM_BENCH_QUICK=1` (or
//! `cargo test --benches`) runs one small repetition (64 KiB per cell, sizes to 1 MiB).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use emulated::dmatest::{
    BUF_OFFSET, CMD_DST_BUF, CMD_SRC_BUF, CMD_START, REG_CMD, REG_COMPLETED, REG_DST, REG_LEN,
    REG_SRC, REG_STATUS, STATUS_ERROR,
};
use emulated::NotifyMode;
use lending::backend::emulated::EmulatedBackend;
use lending::client::Lease;
use lending::inventory::Inventory;
use lending::server::{BackgroundLender, Lender};
use lending::LenderClient;
use ntb::{ClusterConfig, Fabric, PeerWindow, SharedMemory, SocketFabric};
use vmm_sys_util::eventfd::EventFd;

const TOKEN: &str = "p2p-bench-token-8f3a61c2d4b7e9051a6c";
const RAM_GPA: u64 = 0x10_0000;
const RAM_SIZE: u64 = 64 << 20;
const BUF: u64 = 64 << 20;
/// Where the same-lender target's BAR0 (128 MiB) is placed, and the other lender's.
const BAR_GPA: u64 = 0xc000_0000;
const BAR_GPA_X: u64 = 0x1_0000_0000;

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
        // Polls COMPLETED as a driver would, but gives the CPU up after a short spin: on a
        // 2-CPU host a poll that never yields holds one of the two CPUs that the lenders'
        // worker and link threads need (and the copy then waits for the scheduler).
        let t0 = Instant::now();
        let mut spins = 0u32;
        while self.r32(REG_COMPLETED) == done {
            assert!(t0.elapsed() < Duration::from_secs(120), "copy never ended");
            spins += 1;
            if spins < 256 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        let st = self.r32(REG_STATUS);
        assert_eq!(st & STATUS_ERROR, 0, "copy failed: status {st:#x}");
        // No CMD_ACK needed: START sets STATUS anew.
    }
}

/// A plain copy the optimiser cannot drop (the destination is read back through
/// `black_box`).
fn memcpy(dst: &mut [u8], src: &[u8]) {
    dst.copy_from_slice(src);
    std::hint::black_box(dst);
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
    topology: &'static str,
    size: u64,
    p2p_gbps: f64,
    ram_gbps: f64,
    p2p_us: f64,
    ram_us: f64,
    /// A plain `memcpy` of the same size between two buffers of this process, interleaved
    /// with the copies: the limit of a copy that moves the data once.
    memcpy_gbps: f64,
}

fn size_label(size: u64) -> String {
    if size >= 1 << 20 {
        format!("{} MiB", size >> 20)
    } else {
        format!("{} KiB", size >> 10)
    }
}

/// Grouped bars per size: P2P / through RAM, same lender and across lenders; the 1.8x
/// target as a dashed line.
fn svg(rows: &[Row]) -> String {
    let sizes: Vec<u64> = rows
        .iter()
        .filter(|r| r.topology == "same-lender")
        .map(|r| r.size)
        .collect();
    let ratio = |topo: &str, size: u64| {
        rows.iter()
            .find(|r| r.topology == topo && r.size == size)
            .map_or(0.0, |r| r.p2p_gbps / r.ram_gbps)
    };
    let (w, h) = (760.0, 380.0);
    let (left, top, bottom) = (60.0, 48.0, 60.0);
    let plot_h = h - top - bottom;
    let max = rows
        .iter()
        .map(|r| r.p2p_gbps / r.ram_gbps)
        .fold(2.0f64, f64::max)
        * 1.1;
    let y = |v: f64| top + plot_h * (1.0 - (v / max).min(1.0));
    let group = (w - left - 20.0) / sizes.len().max(1) as f64;
    let bar = group * 0.35;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>\n<text x=\"{left}\" y=\"20\" font-size=\"14\">dmatest buffer to buffer: P2P bandwidth / through-RAM bandwidth (1.0 = equal)</text>"
    );
    let mut ticks = vec![0.0, 1.0, 1.8];
    let mut t = 2.0;
    while t < max {
        ticks.push(t);
        t += 1.0;
    }
    for t in ticks {
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
    for (i, &size) in sizes.iter().enumerate() {
        let x0 = left + group * i as f64 + group * 0.15;
        for (k, (topo, color)) in [("same-lender", "#7a9cc6"), ("cross-lender", "#e08a3c")]
            .iter()
            .enumerate()
        {
            let v = ratio(topo, size);
            let _ = writeln!(
                s,
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{color}\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"9\">{v:.2}</text>",
                x0 + bar * k as f64,
                y(v),
                bar - 2.0,
                y(0.0) - y(v),
                x0 + bar * k as f64 + bar / 2.0,
                y(v) - 3.0
            );
        }
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
            x0 + bar,
            h - bottom + 16.0,
            size_label(size)
        );
    }
    let _ = writeln!(
        s,
        "<rect x=\"{}\" y=\"30\" width=\"10\" height=\"10\" fill=\"#7a9cc6\"/><text x=\"{}\" y=\"39\">same lender</text><rect x=\"{}\" y=\"30\" width=\"10\" height=\"10\" fill=\"#e08a3c\"/><text x=\"{}\" y=\"39\">across lenders</text><line x1=\"{}\" x2=\"{}\" y1=\"35\" y2=\"35\" stroke=\"#c00\" stroke-dasharray=\"4 3\"/><text x=\"{}\" y=\"39\">1.8x target</text>",
        w - 330.0,
        w - 316.0,
        w - 230.0,
        w - 216.0,
        w - 120.0,
        w - 100.0,
        w - 96.0
    );
    s.push_str("</svg>\n");
    s
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs it once, small.
    let quick = std::env::args().any(|a| a == "--test")
        || std::env::args().len() <= 1
        || std::env::var("LENDVM_BENCH_QUICK").is_ok_and(|v| v == "1");
    let reps = env_u("P2P_BENCH_REPS", if quick { 1 } else { 3 });
    // Quick (CI) checks that every cell runs, not its speed: a copy beside a busy machine
    // waits tens of ms for its completion whatever its size, and a 1 MiB budget (256 copies
    // of 4 KiB per mode and topology) took 96 s of a loaded CI run.
    let budget = env_u("P2P_BENCH_BYTES", if quick { 64 << 10 } else { 32 << 20 }) as u64;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    let out = std::env::var("P2P_BENCH_OUT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| {
            std::env::var("CARGO_TARGET_DIR")
                .map(std::path::PathBuf::from)
                .unwrap_or_else(|_| root.join("target"))
                .join("bench/p2p-bench.json")
        });

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let mut src = String::from("version = 1\n");
    for n in ["lenderA", "lenderB", "vmm"] {
        src.push_str(&format!(
            "[[node]]\nname = \"{n}\"\nfabric = \"shm\"\ncontrol = \"{d}/{n}.sock\"\n"
        ));
    }
    let path = dir.path().join("cluster.toml");
    std::fs::write(&path, src).unwrap();
    let cfg = ClusterConfig::load(&path).unwrap();
    let mk = |n: &str| {
        Arc::new(EmulatedBackend::dmatest_with_buffer(n, NotifyMode::Interrupt, BUF).unwrap())
    };
    let start = |node: &str, devs: Vec<(&str, Arc<EmulatedBackend>)>| {
        let inv = Arc::new(
            Inventory::new(
                devs.into_iter()
                    .map(|(id, b)| (id.to_string(), b as _))
                    .collect(),
            )
            .unwrap(),
        );
        let listener = SocketFabric::from_cluster(&cfg, node)
            .unwrap()
            .listen()
            .unwrap();
        let lender = Lender::new(inv, node, TOKEN);
        lender.set_cluster(cfg.clone());
        BackgroundLender::start(lender, listener).unwrap()
    };
    let _la = start(
        "lenderA",
        vec![
            ("0000:00:0a.0", mk("bench-a")),
            ("0000:00:0c.0", mk("bench-a2")),
        ],
    );
    let _lb = start("lenderB", vec![("0000:00:0b.0", mk("bench-b"))]);

    let ram = SharedMemory::new("p2p-bench-ram", RAM_SIZE).unwrap();
    let mut windows = Vec::new();
    let mut clients = Vec::new();
    let mut open = |lender: &str, dev: &str| {
        let c = LenderClient::connect(&cfg, "vmm", lender, TOKEN, "p2p-bench").unwrap();
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
    let a = open("lenderA", "0000:00:0a.0");
    let a2 = open("lenderA", "0000:00:0c.0");
    let b = open("lenderB", "0000:00:0b.0");
    a.lease.p2p_map(a2.lease.id(), 0, BAR_GPA).unwrap();
    let g = b.lease.p2p_grant(0, "lenderA").unwrap();
    a.lease
        .p2p_map_remote("lenderB", b.lease.id(), 0, BAR_GPA_X, &g)
        .unwrap();

    // A's buffer holds a pattern; checked in the target's after each mode once.
    let check_len = 1usize << 20;
    let pattern: Vec<u8> = (0..check_len).map(|i| (i * 7 + 3) as u8).collect();
    a.bar.write_at(BUF_OFFSET, &pattern).unwrap();
    let topologies: [(&'static str, &Dev, u64); 2] = [
        ("same-lender", &a2, BAR_GPA),
        ("cross-lender", &b, BAR_GPA_X),
    ];
    let p2p = |gpa: u64, len: u32| a.copy(CMD_SRC_BUF, 0, gpa + BUF_OFFSET, len);
    let through_ram = |t: &Dev, len: u32| {
        a.copy(CMD_SRC_BUF, 0, RAM_GPA, len);
        t.copy(CMD_DST_BUF, RAM_GPA, 0, len);
    };
    for &(topo, t, gpa) in &topologies {
        for mode in ["p2p", "through-ram"] {
            t.bar.write_at(BUF_OFFSET, &vec![0; check_len]).unwrap();
            if mode == "p2p" {
                p2p(gpa, check_len as u32);
            } else {
                through_ram(t, check_len as u32);
            }
            let mut got = vec![0; check_len];
            t.bar.read_at(BUF_OFFSET, &mut got).unwrap();
            assert_eq!(
                got, pattern,
                "{topo} {mode}: the target's buffer lacks A's data"
            );
        }
    }

    let sizes: Vec<u64> = vec![
        4 << 10,
        16 << 10,
        64 << 10,
        256 << 10,
        1 << 20,
        4 << 20,
        16 << 20,
        64 << 20,
    ];
    // The quick budget (CI) checks that it runs: sizes up to 1 MiB (a debug build moves the
    // dmatest buffer at a few tens of MB/s).
    let sizes: Vec<u64> = sizes
        .into_iter()
        .filter(|&s| !quick || s <= 1 << 20)
        .collect();
    // The memcpy reference's buffers, faulted in before they are timed.
    let max_size = sizes.iter().copied().max().unwrap_or(0) as usize;
    let mem_src: Vec<u8> = (0..max_size).map(|i| i as u8).collect();
    let mut mem_dst = vec![1u8; max_size];
    // `P2P_BENCH_TOPOLOGY=same-lender|cross-lender`: one topology alone (to profile it).
    let only = std::env::var("P2P_BENCH_TOPOLOGY").ok();
    let mut rows = Vec::new();
    for &(topo, t, gpa) in &topologies {
        if only.as_deref().is_some_and(|o| o != topo) {
            continue;
        }
        for &size in &sizes {
            let len = size as u32;
            let iters = (budget / size).max(2) as usize;
            // Warm-up, then interleaved repetitions (p2p, through RAM, p2p, ...).
            p2p(gpa, len);
            through_ram(t, len);
            let (mut tp, mut tr, mut tm) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..reps {
                let t0 = Instant::now();
                for _ in 0..iters {
                    memcpy(&mut mem_dst[..size as usize], &mem_src[..size as usize]);
                }
                tm.push(t0.elapsed().as_secs_f64() / iters as f64);
                let t0 = Instant::now();
                for _ in 0..iters {
                    p2p(gpa, len);
                }
                tp.push(t0.elapsed().as_secs_f64() / iters as f64);
                let t0 = Instant::now();
                for _ in 0..iters {
                    through_ram(t, len);
                }
                tr.push(t0.elapsed().as_secs_f64() / iters as f64);
            }
            let (p, r, m) = (median(tp), median(tr), median(tm));
            let row = Row {
                topology: topo,
                size,
                p2p_gbps: size as f64 / p / 1e9,
                ram_gbps: size as f64 / r / 1e9,
                p2p_us: p * 1e6,
                ram_us: r * 1e6,
                memcpy_gbps: size as f64 / m / 1e9,
            };
            eprintln!(
                "{topo} {}: p2p {:.2} GB/s, through RAM {:.2} GB/s ({iters} copies x {reps})",
                size_label(size),
                row.p2p_gbps,
                row.ram_gbps
            );
            rows.push(row);
        }
    }

    let mut json = String::from("{\n  \"bench\": \"p2p\",\n");
    let _ = writeln!(
        json,
        "  \"reps\": {reps},\n  \"bytes_per_rep\": {budget},\n  \"target_ratio_at_1mib_and_up\": 1.8,\n  \"rows\": ["
    );
    for (i, r) in rows.iter().enumerate() {
        let _ = writeln!(
            json,
            "    {{\"topology\": \"{}\", \"size\": {}, \"p2p_gbps\": {:.4}, \"through_ram_gbps\": {:.4}, \"p2p_us\": {:.2}, \"through_ram_us\": {:.2}, \"ratio\": {:.3}, \"memcpy_gbps\": {:.4}}}{}",
            r.topology,
            r.size,
            r.p2p_gbps,
            r.ram_gbps,
            r.p2p_us,
            r.ram_us,
            r.p2p_gbps / r.ram_gbps,
            r.memcpy_gbps,
            if i + 1 < rows.len() { "," } else { "" }
        );
    }
    json.push_str("  ]\n}\n");
    if let Some(p) = out.parent() {
        std::fs::create_dir_all(p).unwrap();
    }
    std::fs::write(&out, &json).unwrap();
    std::fs::write(out.with_extension("svg"), svg(&rows)).unwrap();
    let mut md = format!(
        "Per size and mode, copies until {budget} bytes have moved (at least 2), median of {reps} interleaved repetition(s); `memcpy`: a plain copy of the same size between two buffers of the bench's process, interleaved with them (the limit of a copy that moves the data once).\n\n| topology | size | p2p GB/s | through RAM GB/s | memcpy GB/s | p2p µs | through RAM µs | p2p / through RAM | memcpy / p2p | ≥ 1.8× (≥ 1 MiB) |\n|---|---|---|---|---|---|---|---|---|---|\n"
    );
    let (mut met, mut cells) = (0, 0);
    let (mut near, mut near_cells, mut worst_near) = (0, 0, 0.0f64);
    let mut slower: Vec<String> = Vec::new();
    for r in &rows {
        let ratio = r.p2p_gbps / r.ram_gbps;
        let to_memcpy = r.memcpy_gbps / r.p2p_gbps;
        let target = if r.size < 1 << 20 {
            "—"
        } else if ratio >= 1.8 {
            "met"
        } else {
            "missed"
        };
        if r.size >= 1 << 20 {
            cells += 1;
            met += usize::from(ratio >= 1.8);
            if r.topology == "same-lender" {
                near_cells += 1;
                near += usize::from(to_memcpy <= 2.0);
                worst_near = worst_near.max(to_memcpy);
            }
        }
        if r.topology == "cross-lender" && ratio < 1.0 {
            slower.push(format!("{} ({ratio:.2}×)", size_label(r.size)));
        }
        let _ = writeln!(
            md,
            "| {} | {} | {:.2} | {:.2} | {:.2} | {:.1} | {:.1} | {ratio:.2} | {to_memcpy:.2} | {target} |",
            r.topology,
            size_label(r.size),
            r.p2p_gbps,
            r.ram_gbps,
            r.memcpy_gbps,
            r.p2p_us,
            r.ram_us,
        );
    }
    let verdict = |ok: bool| if ok { "**met**" } else { "**missed**" };
    let _ = writeln!(
        md,
        "\n- Goal p2p ≥ 1.8× through RAM for transfers ≥ 1 MiB: {} (met in {met} of {cells} cells).",
        verdict(met == cells)
    );
    let _ = writeln!(
        md,
        "- Goal p2p within 2× of memcpy at ≥ 1 MiB on the same lender: {} (met in {near} of {near_cells} cells; largest memcpy / p2p {worst_near:.2}).",
        verdict(near == near_cells)
    );
    let _ = writeln!(
        md,
        "- Goal no cross-lender size where p2p is slower than through RAM: {}{}.",
        verdict(slower.is_empty()),
        if slower.is_empty() {
            String::new()
        } else {
            format!(" (slower at {})", slower.join(", "))
        }
    );
    print!("{md}");
    std::fs::write(out.with_file_name("p2p.md"), md).unwrap();
    println!("wrote {}", out.display());
    drop((a, a2, b));
}
