//! Pinning bandwidth against memset (not a test): `cargo bench -p vmm --bench pin`.
//!
//! For each size, in one run, each on a fresh guest-RAM memfd ([`vmm::memory::GuestRam`], the
//! VMM's own backing):
//! * `memset_fresh`: `memset` of the whole mapping (first touch: page faults + zeroing + the
//!   write, what populating costs at best from one thread);
//! * `memset_warm`: a second `memset` of the same, now resident, mapping (pure write
//!   bandwidth);
//! * `pin_1t`: `ParallelPinner::new(1)` (populate + mlock from one thread, what a lone device
//!   paid before);
//! * `pin_nt`: `ParallelPinner::available()` (one populating thread per CPU);
//! * `pin_nt_thp`: the same on `thp=on` RAM.
//!
//! Sizes 256 MiB and 1 GiB always; 4 and 8 GiB only when `PIN_BENCH_MAX` (GiB, default 1)
//! allows and MemAvailable is at least twice the size (the host is shared: a skipped size is
//! listed under `skipped`). Writes `$PIN_BENCH_JSON`, else `$CARGO_TARGET_DIR/bench/pin.json`,
//! else `target/bench/pin.json`, and an SVG and the Markdown fragment `pin.md` (section `pin`
//! of `scripts/bench.sh`) beside it. Target (reported, not asserted): `pin_nt` >= 0.5x
//! `memset_fresh`. `LENDVM_BENCH_QUICK=1` measures 256 MiB only (checks that it runs).
//!
//! Then, end to end at the same sizes: a `lendvm` with that much RAM borrows an emulated
//! `dmatest` over shm from a `lenderd` (release binaries, `cargo build --release -p lending
//! --bins` first), its guest sets Bus Master Enable and halts, and the VMM's log line gives
//! what the vCPU waited for: the pin of all guest RAM and the lender's map of it for DMA in
//! one lease (issue 33: a GPU's guest maps all of its RAM, 8 GiB and more).

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use remote_pci::{ParallelPinner, Pinner};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
use vmm::config::RamBacking;
use vmm::memory::GuestRam;

const TARGET_RATIO: f64 = 0.5;
const TOKEN: &str = "pin-bench-token-8f3a61c2d4b7e9051a6c3d2e";
const DEV: &str = "0000:81:00.0";

mod common;
use common::Kill;

/// The number before ` ms` after `key` in `line` (`... (pin 812.345 ms, lender map ...`).
fn ms_after(line: &str, key: &str) -> Option<f64> {
    let rest = &line[line.find(key)? + key.len()..];
    rest.split_whitespace().next()?.parse().ok()
}

/// A lendvm with `size` bytes of RAM borrows a dmatest over shm and its guest masters the
/// bus: (pin ms, lender map ms) from lendvm's `dma enabled` line.
fn bme_end_to_end(size: u64) -> (f64, f64) {
    let (lendvm, lenderd) = common::binaries();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sock = d.join("node3.sock");
    ntb::config::write_private_file(
        &d.join("cluster.toml"),
        &format!(
            "version = 1\ntoken = \"{TOKEN}\"\n[[node]]\nname = \"node3\"\nfabric = \"shm\"\n\
             control = \"{}\"\n",
            sock.display()
        ),
    )
    .unwrap();
    std::fs::write(
        d.join("bme.elf"),
        common::guest_elf(&common::BUS_MASTER_THEN_IDLE),
    )
    .unwrap();
    let _lender = Kill(
        Command::new(&lenderd)
            .args(["--node", "node3", "--cluster"])
            .arg(d.join("cluster.toml"))
            .args(["--device", &format!("{DEV}=dmatest")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start lenderd"),
    );
    let t = Instant::now();
    while !sock.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "lenderd did not listen"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut vmm = Command::new(&lendvm)
        .arg("--kernel")
        .arg(d.join("bme.elf"))
        .args(["--serial", "off", "--memory", &format!("{}M", size >> 20)])
        .arg("--cluster")
        .arg(d.join("cluster.toml"))
        .args(["--remote-device", &format!("node3:{DEV}")])
        .env("RUST_LOG", "warn,remote_pci=info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start lendvm");
    let stderr = vmm.stderr.take().unwrap();
    let _vmm = Kill(vmm);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("dma enabled:") || line.contains("ERROR") {
                let _ = tx.send(line);
            }
        }
    });
    let line = rx
        .recv_timeout(Duration::from_secs(300))
        .expect("lendvm logged no dma enabled line within 5 minutes");
    let pin = ms_after(&line, "(pin ");
    let map = ms_after(&line, "lender map ");
    match (pin, map) {
        (Some(p), Some(m)) => (p, m),
        _ => panic!("no pin and map times in: {line}"),
    }
}

fn out_path() -> PathBuf {
    if let Ok(p) = std::env::var("PIN_BENCH_JSON") {
        return PathBuf::from(p);
    }
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("bench/pin.json")
}

fn mem_available() -> u64 {
    let s = std::fs::read_to_string("/proc/meminfo").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn regions(ram: &GuestRam) -> Vec<(u64, u64)> {
    ram.memory()
        .iter()
        .map(|r| (r.as_ptr() as u64, r.len()))
        .collect()
}

fn ram(size: u64, thp: bool) -> GuestRam {
    GuestRam::with_backing(
        size,
        RamBacking {
            hugepages: false,
            thp,
            shared: None,
        },
    )
    .unwrap()
}

/// GiB/s of `bytes` in `secs`.
fn gibs(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64 / secs
}

fn memset(ranges: &[(u64, u64)], v: u8) -> f64 {
    let t = Instant::now();
    for &(a, l) in ranges {
        // SAFETY: the range is guest RAM mapped read-write by the GuestRam this bench owns.
        unsafe { libc::memset(a as *mut libc::c_void, i32::from(v), l as usize) };
    }
    t.elapsed().as_secs_f64()
}

fn pin(ranges: &[(u64, u64)], p: &ParallelPinner) -> f64 {
    let t = Instant::now();
    let pins: Vec<_> = ranges.iter().map(|&(a, l)| p.pin(a, l).unwrap()).collect();
    let secs = t.elapsed().as_secs_f64();
    drop(pins);
    secs
}

fn svg(rows: &[serde_json::Value], threads: usize, notes: &[String]) -> String {
    let keys = [
        ("memset_fresh", "#888"),
        ("memset_warm", "#bbb"),
        ("pin_1t", "#d62728"),
        ("pin_nt", "#1f77b4"),
        ("pin_nt_thp", "#2ca02c"),
    ];
    let (w, h, l, t, b) = (820.0, 440.0, 60.0, 40.0, 90.0);
    let ymax = rows
        .iter()
        .flat_map(|r| keys.iter().map(move |k| r[k.0].as_f64().unwrap_or(0.0)))
        .fold(1.0, f64::max)
        * 1.1;
    let group = (w - l - 20.0) / rows.len().max(1) as f64;
    let bar = group / (keys.len() as f64 + 1.0);
    let y = |v: f64| t + (h - t - b) * (1.0 - v / ymax);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{l}\" y=\"22\" font-size=\"15\">populate+pin vs memset bandwidth (GiB/s), {threads} threads</text>\n"
    );
    for k in 0..=4 {
        let v = ymax * f64::from(k) / 4.0;
        s += &format!(
            "<line x1=\"{l}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"#eee\"/><text x=\"8\" y=\"{2}\">{v:.2}</text>\n",
            y(v),
            w - 20.0,
            y(v) + 4.0
        );
    }
    for (i, r) in rows.iter().enumerate() {
        let x0 = l + group * i as f64;
        for (j, (k, c)) in keys.iter().enumerate() {
            let v = r[*k].as_f64().unwrap_or(0.0);
            s += &format!(
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{c}\"/>\n",
                x0 + bar * (j as f64 + 0.5),
                y(v),
                bar * 0.9,
                h - b - y(v)
            );
        }
        s += &format!(
            "<text x=\"{:.1}\" y=\"{}\">{} MiB</text>\n",
            x0 + group / 3.0,
            h - b + 15.0,
            r["size_mib"]
        );
    }
    for (j, (k, c)) in keys.iter().enumerate() {
        s += &format!(
            "<text x=\"{}\" y=\"{}\" fill=\"{c}\">{k}</text>\n",
            l + 130.0 * j as f64,
            h - b + 35.0
        );
    }
    for (i, n) in notes.iter().enumerate() {
        s += &format!(
            "<text x=\"{l}\" y=\"{}\">{n}</text>\n",
            h - b + 55.0 + 15.0 * i as f64
        );
    }
    s + "</svg>\n"
}

fn main() {
    let max_gib: u64 = std::env::var("PIN_BENCH_MAX")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let quick = std::env::var("LENDVM_BENCH_QUICK").is_ok_and(|v| v == "1");
    let threads = ParallelPinner::available().threads();
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    for size in [256u64 << 20, 1 << 30, 4 << 30, 8 << 30] {
        let avail = mem_available();
        if size > max_gib << 30 || avail < 2 * size || (quick && size > 256 << 20) {
            let why = format!(
                "{} MiB skipped (PIN_BENCH_MAX={max_gib} GiB{}, MemAvailable {} MiB on a shared host)",
                size >> 20,
                if quick { ", LENDVM_BENCH_QUICK=1" } else { "" },
                avail >> 20
            );
            println!("{why}");
            skipped.push(why);
            continue;
        }
        let r = ram(size, false);
        let rg = regions(&r);
        let fresh = memset(&rg, 1);
        let warm = memset(&rg, 2);
        drop(r);
        let r = ram(size, false);
        let p1 = pin(&regions(&r), &ParallelPinner::new(1));
        drop(r);
        let r = ram(size, false);
        let pn = pin(&regions(&r), &ParallelPinner::available());
        drop(r);
        let r = ram(size, true);
        let pt = pin(&regions(&r), &ParallelPinner::available());
        drop(r);
        let row = serde_json::json!({
            "size_mib": size >> 20,
            "memset_fresh": gibs(size, fresh),
            "memset_warm": gibs(size, warm),
            "pin_1t": gibs(size, p1),
            "pin_nt": gibs(size, pn),
            "pin_nt_thp": gibs(size, pt),
            "ratio_pin_nt_to_memset_fresh": fresh / pn,
            "ratio_pin_nt_to_memset_warm": warm / pn,
            "ratio_pin_1t_to_memset_fresh": fresh / p1,
            "target_met": fresh / pn >= TARGET_RATIO,
        });
        let row = {
            let (pin_ms, map_ms) = bme_end_to_end(size);
            let mut row = row;
            row["bme_pin_ms"] = serde_json::json!(pin_ms);
            row["bme_map_ms"] = serde_json::json!(map_ms);
            row
        };
        println!("{row}");
        rows.push(row);
    }
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .unwrap_or_default();
    let json = serde_json::json!({
        "bench": "pin",
        "threads": threads,
        "target_ratio_pin_nt_to_memset_fresh": TARGET_RATIO,
        "thp_shmem_enabled": thp.trim(),
        "rows": rows,
        "skipped": skipped,
    });
    let path = out_path();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
    let svg_path = path.with_extension("svg");
    let mut notes = vec![format!("shmem THP: {}", thp.trim())];
    notes.extend(skipped);
    std::fs::write(&svg_path, svg(&rows, threads, &notes)).unwrap();
    std::fs::write(
        path.with_file_name("pin.md"),
        markdown(&rows, &skipped_of(&json), threads, thp.trim()),
    )
    .unwrap();
    println!("wrote {} and {}", path.display(), svg_path.display());
}

fn skipped_of(json: &serde_json::Value) -> Vec<String> {
    json["skipped"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// The fragment for docs/BENCHMARKS.md, from this run's rows.
fn markdown(rows: &[serde_json::Value], skipped: &[String], threads: usize, thp: &str) -> String {
    use std::fmt::Write as _;
    let mut md = format!(
        "GiB/s; `pin_nt` uses {threads} threads; shmem THP setting: `{thp}`.\n\n| size | memset_fresh | memset_warm | pin_1t | pin_nt | pin_nt_thp | pin_nt / memset_fresh | pin_nt / memset_warm |\n|---|---|---|---|---|---|---|---|\n"
    );
    let f = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    let mut all = true;
    for r in rows {
        all &= r["target_met"].as_bool().unwrap_or(false);
        let size = r["size_mib"].as_u64().unwrap_or(0);
        let label = if size >= 1024 {
            format!("{} GiB", size / 1024)
        } else {
            format!("{size} MiB")
        };
        let _ = writeln!(
            md,
            "| {label} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            f(r, "memset_fresh"),
            f(r, "memset_warm"),
            f(r, "pin_1t"),
            f(r, "pin_nt"),
            f(r, "pin_nt_thp"),
            f(r, "ratio_pin_nt_to_memset_fresh"),
            f(r, "ratio_pin_nt_to_memset_warm"),
        );
    }
    let _ = writeln!(
        md,
        "\nEnd to end: a `lendvm` with the RAM of the row borrows a `dmatest` over shm and its \
         guest sets Bus Master Enable; what the vCPU waits for, from lendvm's log (ms):\n\n\
         | guest RAM | pin all RAM | lender maps it for DMA (one lease) | total | GiB/s |\n\
         |---|---|---|---|---|"
    );
    for r in rows {
        let size = r["size_mib"].as_u64().unwrap_or(0);
        let (p, m) = (f(r, "bme_pin_ms"), f(r, "bme_map_ms"));
        let _ = writeln!(
            md,
            "| {} | {p:.1} | {m:.1} | {:.1} | {:.2} |",
            if size >= 1024 {
                format!("{} GiB", size / 1024)
            } else {
                format!("{size} MiB")
            },
            p + m,
            size as f64 / 1024.0 / ((p + m) / 1e3)
        );
    }
    for s in skipped {
        let _ = writeln!(md, "\n- {s}");
    }
    let _ = writeln!(
        md,
        "\n- Goal `pin_nt` ≥ {TARGET_RATIO}× `memset_fresh`: {}.",
        if all && !rows.is_empty() {
            "**met** at every size"
        } else {
            "**missed** at some size (see the table)"
        }
    );
    md
}
