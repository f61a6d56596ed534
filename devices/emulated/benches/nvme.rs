//! Local NVMe benchmark: the controller driven in-process by the test driver.
//!
//! `cargo bench -p emulated` writes `target/bench/nvme-local.json` at the workspace root
//! (override with `EMULATED_BENCH_OUT`). `EMULATED_BENCH_SECS` sets seconds per case (1.0),
//! `EMULATED_BENCH_DIR` where the backing file lives (a temp dir). Also writes the Markdown
//! fragment `emulated.md` beside the JSON (section `emulated` of `scripts/bench.sh`);
//! `LENDVM_BENCH_QUICK=1` runs 0.05 s per case (checks that it runs).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test/bench code

use std::fmt::Write as _;

use emulated::nvme::NvmeConfig;
use emulated::testing::LocalRig;
use emulated::workload::{self, CASES};
use emulated::NotifyMode;

const NS_BYTES: u64 = 256 << 20;

fn main() {
    let quick = std::env::var("LENDVM_BENCH_QUICK").is_ok_and(|v| v == "1");
    let secs: f64 = std::env::var("EMULATED_BENCH_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 0.05 } else { 1.0 });
    let out_path = std::env::var("EMULATED_BENCH_OUT").unwrap_or_else(|_| {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .ancestors()
            .nth(2)
            .unwrap()
            .to_path_buf();
        std::env::var("CARGO_TARGET_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|_| root.join("target"))
            .join("bench/nvme-local.json")
            .display()
            .to_string()
    });
    let dir = match std::env::var("EMULATED_BENCH_DIR") {
        Ok(d) => tempfile::tempdir_in(d).unwrap(),
        Err(_) => tempfile::tempdir().unwrap(),
    };
    let mut md = format!(
        "One run of {secs} s per case, in-process (driver and controller threads not pinned; backing file in a temp dir). Reference figures, no goal: compare local with lent only in the `lent` section.\n\n| mode | engine | case | IOPS | MiB/s | p50 µs | p99 µs |\n|---|---|---|---|---|---|---|\n"
    );
    let mut json = String::from("{\n  \"bench\": \"nvme-local\",\n  \"runs\": [\n");
    for (mi, mode) in [NotifyMode::Interrupt, NotifyMode::Polling]
        .into_iter()
        .enumerate()
    {
        let cfg = NvmeConfig {
            backing: dir.path().join(format!("bench-{mi}.img")),
            size: Some(NS_BYTES),
            notify: mode,
            max_io_queues: 2,
            max_queue_entries: 256,
            ..NvmeConfig::default()
        };
        let mut rig = LocalRig::new(cfg, 128 << 20, mode == NotifyMode::Interrupt).unwrap();
        let engine = rig.ctrl.engine_name();
        let d = &mut rig.driver;
        let bufs = workload::prepare(d).unwrap();
        let mut lat = Vec::with_capacity(1 << 20);
        let mode_name = if mode == NotifyMode::Interrupt {
            "interrupt"
        } else {
            "polling"
        };
        let _ = writeln!(
            json,
            "    {{\"mode\": \"{mode_name}\", \"engine\": \"{engine}\", \"results\": ["
        );
        for (ci, c) in CASES.iter().enumerate() {
            let r = workload::run_case(d, &bufs, c, secs, 0x9e37_79b9_7f4a_7c15, &mut lat).unwrap();
            println!(
                "{mode_name:9} {engine:11} {:18} {:>10.0} IOPS {:>9.1} MiB/s {:>8.1} us avg {:>8.1} us p50",
                c.name,
                r.iops(),
                r.mib_per_s(c.bs),
                r.avg_us,
                r.p50_us
            );
            let _ = writeln!(
                md,
                "| {mode_name} | {engine} | {} | {:.0} | {:.1} | {:.1} | {:.1} |",
                c.name,
                r.iops(),
                r.mib_per_s(c.bs),
                r.p50_us,
                r.p99_us
            );
            let _ = writeln!(
                json,
                "      {{\"name\": \"{}\", \"iops\": {:.0}, \"mib_per_s\": {:.1}, \"avg_latency_us\": {:.2}, \"p50_us\": {:.2}, \"p99_us\": {:.2}}}{}",
                c.name,
                r.iops(),
                r.mib_per_s(c.bs),
                r.avg_us,
                r.p50_us,
                r.p99_us,
                if ci + 1 < CASES.len() { "," } else { "" }
            );
        }
        let _ = writeln!(json, "    ]}}{}", if mi == 0 { "," } else { "" });
        rig.driver.shutdown().unwrap();
    }
    json.push_str("  ]\n}\n");
    if let Some(p) = std::path::Path::new(&out_path).parent() {
        std::fs::create_dir_all(p).unwrap();
    }
    std::fs::write(&out_path, json).unwrap();
    let md_path = std::path::Path::new(&out_path).with_file_name("emulated.md");
    std::fs::write(&md_path, md).unwrap();
    println!("wrote {out_path}");
}
