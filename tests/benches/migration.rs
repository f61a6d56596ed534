//! Live migration benchmark (not a test): `cargo build --release -p vmm -p lending --bins &&
//! cargo bench -p lendvm-tests --bench migration`.
//!
//! A VM holding a lent NVMe (shm fabric) is live-migrated between two lendvm processes on
//! this host over a unix socket, for each combination of
//! * guest RAM: 256 MiB and 1 GiB (`MIG_BENCH_SIZES`, e.g. `256M,1G`);
//! * path: RAM copied with dirty tracking (`copy`) or the memfd fast path (`local`);
//! * load: `idle` (the device attached and set up, no I/O) or `io` (the `nvme-loop` guest
//!   writing and reading a page every 2 ms: the device keeps writing guest RAM by DMA);
//!
//! `MIG_BENCH_N` trials each (default 3). Per trial: the API round trip of
//! `vm.send-migration` (`total_ms`), the source's `downtime_ms` (vCPUs parked → destination
//! acknowledged), `ram_bytes` sent, and the device hand-over on its own: the source's
//! hand-over quiesce (`quiesce_us`, DMA drained) plus the destination's take-over
//! (`takeover_us`: lease accept, device plugged, PCI state replayed, resumed). Each trial
//! checks the guest goes on verified on the destination.
//!
//! Writes `$MIG_BENCH_JSON`, else `$CARGO_TARGET_DIR/bench/migration-bench.json` (else
//! `target/bench/`), and an SVG and the Markdown fragment `migration.md` (section `migration`
//! of `scripts/bench.sh`) beside it. `LENDVM_BENCH_QUICK=1`: 64 MiB, one trial each (CI
//! checks that it runs: the copy path of a debug build moved ~14 MB/s on a loaded 2-core
//! machine, 20 s a trial at 256 MiB).

#![allow(clippy::expect_used, clippy::unwrap_used)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use api::types::{VmReceiveMigrationData, VmSendMigrationData};
use common::*;

const T: Duration = Duration::from_secs(120);

fn events(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn prop(evs: &[serde_json::Value], event: &str, phase: Option<&str>, key: &str) -> Option<u64> {
    evs.iter()
        .rfind(|e| e["event"] == event && phase.is_none_or(|p| e["properties"]["phase"] == p))
        .and_then(|e| e["properties"][key].as_u64())
}

fn io_rounds(text: &str) -> usize {
    text.lines().filter(|l| l.contains(" ok reinits=")).count()
}

#[derive(Clone, Debug)]
struct Trial {
    memory: String,
    path: &'static str,
    load: &'static str,
    total_ms: f64,
    downtime_ms: u64,
    ram_bytes: u64,
    quiesce_us: u64,
    takeover_us: u64,
    accept_us: u64,
    replay_us: u64,
    handover_ms: f64,
}

fn trial(memory: &str, local: bool, io: bool) -> Trial {
    let cluster = Cluster::new(Fabric::Shm);
    let disk = cluster.file("disk.img");
    let _lender =
        cluster.start_lenderd(&[format!("{NVME_BDF}=nvme:path={},size=4M", disk.display())]);
    let c = cluster.path.display().to_string();
    let sock = cluster.file("src.sock").display().to_string();
    let ev = format!("path={}", cluster.file("src-events.jsonl").display());
    let dev = format!("{LENDER}:{NVME_BDF},id=nvme0");
    let period = if io { 2 } else { 1_000_000 };
    let line = format!("tests=nvme-loop seed={SEED:#x} lba=16 period_ms={period}");
    let mut src = Vm::start(
        memory,
        &[
            "--cluster",
            &c,
            "--name",
            "vm-src",
            "--remote-device",
            &dev,
            "--api-socket",
            &sock,
            "--event-monitor",
            &ev,
            "--cmdline",
            &line,
        ],
    );
    src.wait_api();
    src.expect_line("MAILBOX ", T);
    if io {
        poll(T, || (io_rounds(&src.stdout()) >= 5).then_some(())).expect("no I/O rounds");
    }
    let dsock = cluster.file("dst.sock").display().to_string();
    let dev_ev = format!("path={}", cluster.file("dst-events.jsonl").display());
    let mut dst = Vm::start_args(
        &[
            "--cluster",
            &c,
            "--name",
            "vm-dst",
            "--api-socket",
            &dsock,
            "--event-monitor",
            &dev_ev,
        ],
        "warn",
    );
    dst.wait_api();
    let url = format!("unix:{}", cluster.file("dst.mig").display());
    dst.api()
        .receive_migration(&VmReceiveMigrationData {
            receiver_url: url.clone(),
        })
        .unwrap();
    let t0 = Instant::now();
    src.api()
        .send_migration(&VmSendMigrationData {
            destination_url: url,
            local,
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", src.stderr()));
    let total_ms = t0.elapsed().as_secs_f64() * 1e3;
    src.expect_exit(0, T);
    if io {
        poll(T, || (io_rounds(&dst.stdout()) >= 3).then_some(()))
            .expect("the guest's I/O does not go on at the destination");
        assert!(!dst.stdout().contains(" fail "), "{}", dst.stdout());
    }
    let sev = events(&cluster.file("src-events.jsonl"));
    let dev = events(&cluster.file("dst-events.jsonl"));
    let quiesce_us = prop(
        &sev,
        "migration-device-handover",
        Some("quiesced"),
        "took_us",
    )
    .unwrap();
    let takeover_us = prop(
        &dev,
        "migration-device-handover",
        Some("taken-over"),
        "took_us",
    )
    .unwrap();
    let t = Trial {
        memory: memory.to_string(),
        path: if local { "local" } else { "copy" },
        load: if io { "io" } else { "idle" },
        total_ms,
        downtime_ms: prop(&sev, "migration-completed", None, "downtime_ms").unwrap(),
        ram_bytes: prop(&sev, "migration-completed", None, "ram_bytes").unwrap(),
        quiesce_us,
        takeover_us,
        accept_us: prop(
            &dev,
            "migration-device-handover",
            Some("taken-over"),
            "accept_us",
        )
        .unwrap(),
        replay_us: prop(
            &dev,
            "migration-device-handover",
            Some("taken-over"),
            "replay_us",
        )
        .unwrap(),
        handover_ms: (quiesce_us + takeover_us) as f64 / 1e3,
    };
    let _ = dst.wait_exit(Duration::ZERO);
    eprintln!("{t:?}");
    t
}

impl Trial {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "memory": self.memory,
            "path": self.path,
            "load": self.load,
            "total_ms": self.total_ms,
            "downtime_ms": self.downtime_ms,
            "ram_bytes": self.ram_bytes,
            "quiesce_us": self.quiesce_us,
            "takeover_us": self.takeover_us,
            "accept_us": self.accept_us,
            "replay_us": self.replay_us,
            "handover_ms": self.handover_ms,
        })
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn out_path() -> PathBuf {
    std::env::var("MIG_BENCH_JSON")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            std::env::var("CARGO_TARGET_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
                .join("bench/migration-bench.json")
        })
}

fn svg(rows: &[serde_json::Value]) -> String {
    let w = 760.0;
    let bar_h = 18.0;
    let left = 230.0;
    let max = rows
        .iter()
        .map(|r| r["total_ms"].as_f64().unwrap())
        .fold(1.0, f64::max);
    let scale = (w - left - 90.0) / max;
    let h = 40.0 + rows.len() as f64 * (bar_h + 8.0) + 20.0;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n<text x=\"10\" y=\"20\" \
         font-size=\"14\">Live migration with a lent NVMe (median ms): total (light), \
         downtime (dark)</text>\n"
    );
    for (i, r) in rows.iter().enumerate() {
        let y = 36.0 + i as f64 * (bar_h + 8.0);
        let total = r["total_ms"].as_f64().unwrap();
        let down = r["downtime_ms"].as_f64().unwrap();
        let label = format!(
            "{} {} {}",
            r["memory"].as_str().unwrap(),
            r["path"].as_str().unwrap(),
            r["load"].as_str().unwrap()
        );
        s += &format!(
            "<text x=\"10\" y=\"{}\">{label}</text>\n<rect x=\"{left}\" y=\"{y}\" \
             width=\"{:.1}\" height=\"{bar_h}\" fill=\"#9ecae1\"/>\n<rect x=\"{left}\" \
             y=\"{y}\" width=\"{:.1}\" height=\"{bar_h}\" fill=\"#3182bd\"/>\n<text \
             x=\"{:.1}\" y=\"{}\">{total:.0} / {down:.0}</text>\n",
            y + 13.0,
            (total * scale).max(1.0),
            (down * scale).max(1.0),
            left + total * scale + 6.0,
            y + 13.0
        );
    }
    s += "</svg>\n";
    s
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else is accepted.
    let quick = std::env::var("LENDVM_BENCH_QUICK").is_ok_and(|v| v == "1");
    let n: usize = std::env::var("MIG_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 1 } else { 3 })
        .max(1);
    let sizes = std::env::var("MIG_BENCH_SIZES")
        .unwrap_or_else(|_| if quick { "64M" } else { "256M,1G" }.into());
    let mut trials = Vec::new();
    let mut rows = Vec::new();
    for memory in sizes.split(',') {
        for local in [false, true] {
            for io in [false, true] {
                let ts: Vec<Trial> = (0..n).map(|_| trial(memory, local, io)).collect();
                let med = |f: fn(&Trial) -> f64| median(ts.iter().map(f).collect());
                let row = serde_json::json!({
                    "memory": memory,
                    "path": ts[0].path,
                    "load": ts[0].load,
                    "trials": n,
                    "total_ms": med(|t| t.total_ms),
                    "downtime_ms": med(|t| t.downtime_ms as f64),
                    "ram_mib": med(|t| t.ram_bytes as f64) / 1048576.0,
                    "quiesce_ms": med(|t| t.quiesce_us as f64) / 1e3,
                    "takeover_ms": med(|t| t.takeover_us as f64) / 1e3,
                    "accept_ms": med(|t| t.accept_us as f64) / 1e3,
                    "replay_ms": med(|t| t.replay_us as f64) / 1e3,
                    "handover_ms": med(|t| t.handover_ms),
                });
                eprintln!("{row}");
                rows.push(row);
                trials.extend(ts.iter().map(Trial::json));
            }
        }
    }
    let out = out_path();
    let doc = serde_json::json!({
        "what": "live migration of a VM holding a lent NVMe (shm), two lendvm processes on one host, unix socket",
        "medians": rows,
        "trials": trials,
    });
    if let Some(d) = out.parent() {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(&out, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    std::fs::write(out.with_extension("svg"), svg(&rows)).unwrap();
    println!("wrote {} and its SVG", out.display());
    let mut md = format!(
        "Median of {n} trial(s) per row, lendvm and lenderd of the same build profile as this bench; two lendvm processes on this host over a unix socket, lent NVMe on shm.\n\n| RAM | path | load | total ms | downtime ms | RAM sent MiB | quiesce ms | take-over ms | of which accept ms | of which replay ms |\n|---|---|---|---|---|---|---|---|---|---|\n"
    );
    let mut downtime = (f64::INFINITY, 0.0f64);
    for r in &rows {
        let d = r["downtime_ms"].as_f64().unwrap();
        downtime = (downtime.0.min(d), downtime.1.max(d));
        md += &format!(
            "| {} | {} | {} | {:.0} | {:.0} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} |\n",
            r["memory"].as_str().unwrap(),
            r["path"].as_str().unwrap(),
            r["load"].as_str().unwrap(),
            r["total_ms"].as_f64().unwrap(),
            r["downtime_ms"].as_f64().unwrap(),
            r["ram_mib"].as_f64().unwrap(),
            r["quiesce_ms"].as_f64().unwrap(),
            r["takeover_ms"].as_f64().unwrap(),
            r["accept_ms"].as_f64().unwrap(),
            r["replay_ms"].as_f64().unwrap()
        );
    }
    md += &format!(
        "\n- Downtime {:.0}–{:.0} ms over these rows (no goal set; the device hand-over is quiesce + take-over).\n",
        downtime.0, downtime.1
    );
    print!("{md}");
    std::fs::write(out.with_file_name("migration.md"), md).unwrap();
}
