//! Local NVMe benchmark: the controller driven in-process by the test driver.
//!
//! `cargo bench -p emulated` writes `target/bench/nvme-local.json` at the workspace root
//! (override with `EMULATED_BENCH_OUT`). `EMULATED_BENCH_SECS` sets seconds per case (1.0),
//! `EMULATED_BENCH_DIR` where the backing file lives (a temp dir).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test/bench code

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use emulated::nvme::NvmeConfig;
use emulated::testing::{DataBuf, LocalRig, NvmeDriver};
use emulated::NotifyMode;

const NS_BYTES: u64 = 256 << 20;
const SPAN_BLOCKS: u64 = (64 << 20) / 512;

struct Case {
    name: &'static str,
    write: bool,
    random: bool,
    bs: usize,
    qd: usize,
}

struct Result_ {
    name: String,
    iops: f64,
    mibps: f64,
    avg_lat_us: f64,
}

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

fn run_case(d: &mut NvmeDriver, c: &Case, secs: f64) -> Result_ {
    let nlb = (c.bs / 512) as u32;
    let bufs: Vec<DataBuf> = (0..c.qd)
        .map(|_| d.alloc_data(c.bs, 0, false).unwrap())
        .collect();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut seq = 0u64;
    let mut next_lba = |seed: &mut u64| {
        if c.random {
            (xorshift(seed) % (SPAN_BLOCKS / u64::from(nlb))) * u64::from(nlb)
        } else {
            let l = seq;
            seq = (seq + u64::from(nlb)) % SPAN_BLOCKS;
            l
        }
    };
    let mut owner: HashMap<u16, (usize, Instant)> = HashMap::new();
    for (i, b) in bufs.iter().enumerate() {
        let cid = d
            .push(1, NvmeDriver::rw_sqe(c.write, next_lba(&mut seed), nlb, b))
            .unwrap();
        owner.insert(cid, (i, Instant::now()));
    }
    d.ring(1).unwrap();
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(secs);
    let mut ops = 0u64;
    let mut lat = Duration::ZERO;
    let mut out = Vec::new();
    loop {
        out.clear();
        d.wait(1, &mut out, 1).unwrap();
        let now = Instant::now();
        let stop = now >= end;
        for e in &out {
            assert_eq!(e.code(), 0, "{} failed: {e:?}", c.name);
            let (i, t) = owner.remove(&e.cid).unwrap();
            ops += 1;
            lat += now - t;
            if !stop {
                let cid = d
                    .push(
                        1,
                        NvmeDriver::rw_sqe(c.write, next_lba(&mut seed), nlb, &bufs[i]),
                    )
                    .unwrap();
                owner.insert(cid, (i, Instant::now()));
            }
        }
        if stop {
            let n = d.outstanding(1);
            if n > 0 {
                let mut rest = Vec::new();
                d.wait(1, &mut rest, n).unwrap();
            }
            break;
        }
        d.ring(1).unwrap();
    }
    let el = start.elapsed().as_secs_f64();
    Result_ {
        name: c.name.to_string(),
        iops: ops as f64 / el,
        mibps: ops as f64 * c.bs as f64 / el / (1 << 20) as f64,
        avg_lat_us: lat.as_secs_f64() * 1e6 / ops.max(1) as f64,
    }
}

fn main() {
    let secs: f64 = std::env::var("EMULATED_BENCH_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1.0);
    let out_path = std::env::var("EMULATED_BENCH_OUT").unwrap_or_else(|_| {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .ancestors()
            .nth(2)
            .unwrap()
            .to_path_buf();
        root.join("target/bench/nvme-local.json")
            .display()
            .to_string()
    });
    let dir = match std::env::var("EMULATED_BENCH_DIR") {
        Ok(d) => tempfile::tempdir_in(d).unwrap(),
        Err(_) => tempfile::tempdir().unwrap(),
    };
    let cases = [
        Case {
            name: "randread-4k-qd1",
            write: false,
            random: true,
            bs: 4096,
            qd: 1,
        },
        Case {
            name: "randread-4k-qd32",
            write: false,
            random: true,
            bs: 4096,
            qd: 32,
        },
        Case {
            name: "randwrite-4k-qd1",
            write: true,
            random: true,
            bs: 4096,
            qd: 1,
        },
        Case {
            name: "randwrite-4k-qd32",
            write: true,
            random: true,
            bs: 4096,
            qd: 32,
        },
        Case {
            name: "seqread-128k-qd8",
            write: false,
            random: false,
            bs: 128 << 10,
            qd: 8,
        },
        Case {
            name: "seqwrite-128k-qd8",
            write: true,
            random: false,
            bs: 128 << 10,
            qd: 8,
        },
    ];
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
        d.enable(32).unwrap();
        d.set_num_queues(1).unwrap();
        d.create_io_queue_pair(1, 128, 1).unwrap();
        // Prefill the span so reads hit written data.
        let fill = d.alloc_data(128 << 10, 0, false).unwrap();
        fill.fill(d.ram(), &vec![0x5a; 128 << 10]);
        for i in 0..(SPAN_BLOCKS / 256) {
            d.rw(1, true, i * 256, 256, &fill).unwrap();
        }
        d.flush(1).unwrap();
        let mode_name = if mode == NotifyMode::Interrupt {
            "interrupt"
        } else {
            "polling"
        };
        let _ = writeln!(
            json,
            "    {{\"mode\": \"{mode_name}\", \"engine\": \"{engine}\", \"results\": ["
        );
        for (ci, c) in cases.iter().enumerate() {
            let r = run_case(d, c, secs);
            println!(
                "{mode_name:9} {engine:11} {:18} {:>10.0} IOPS {:>9.1} MiB/s {:>8.1} us avg",
                r.name, r.iops, r.mibps, r.avg_lat_us
            );
            let _ = writeln!(
                json,
                "      {{\"name\": \"{}\", \"iops\": {:.0}, \"mib_per_s\": {:.1}, \"avg_latency_us\": {:.2}}}{}",
                r.name,
                r.iops,
                r.mibps,
                r.avg_lat_us,
                if ci + 1 < cases.len() { "," } else { "" }
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
    println!("wrote {out_path}");
}
