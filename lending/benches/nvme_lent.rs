//! NVMe "local vs lent" benchmark.
//!
//! The same guest-role driver (`emulated::testing::NvmeDriver`) and the same parameters drive
//! (a) the controller in-process ("local") and (b) the controller inside a real `lenderd`,
//! borrowed over the shm fabric ("lent"), in interrupt and in polling mode. The two sides are
//! identical except for the lending path:
//!
//! * same controller config (`NvmeConfig` as lenderd builds it, same engine, same notify mode);
//! * guest RAM: lent, a memfd exported as a fabric window, mapped by lenderd and reached through
//!   its software IOMMU (part of the lending path); local, `TestMemory` (anonymous memory, no
//!   IOMMU);
//! * same BAR access (direct stores; in interrupt mode each store is followed by a write to the
//!   controller's doorbell eventfd, which on the lent side is the lease's notify eventfd);
//! * same interrupt delivery (one eventfd per MSI-X vector, waited on with `poll` by the same
//!   [`FdIrq`]) and the same driver wait (interrupts, or spin-then-yield in polling mode);
//! * same thread placement: the driver runs on CPU 0, every device-side thread (local
//!   controller and engine threads, the whole lenderd process) on CPU 1. Unpinned, the
//!   scheduler sometimes puts driver and controller on one CPU (wake-ups are cheap
//!   same-CPU switches) and sometimes on two (each wake-up is an IPI to a halted vCPU of this
//!   nested VM, tens of µs), independently for the two sides: that lottery, not the fabric,
//!   made single repetitions differ by up to 8x. `NVME_LENT_BENCH_PIN=0` turns pinning off.
//! * backing files on tmpfs (`/dev/shm`): the benchmark measures the lending path, not the
//!   disk (ext4 writeback and fdatasync would dominate the write cases).
//!
//! Each case is warmed up on both sides (`NVME_LENT_BENCH_WARMUP` s, default 0.2), then run
//! `NVME_LENT_BENCH_REPS` times (default 7) per side, local and lent interleaved and the order
//! alternated per repetition, `NVME_LENT_BENCH_SECS` seconds per case and side in total
//! (default 0.3 per repetition). Every figure is the median [min-max] over repetitions; p50
//! and p99 are computed per repetition; the lent/local ratio and the added p50 are paired per
//! repetition (so load from other processes that hits one repetition mostly hits both sides).
//!
//! `cargo bench -p lending` writes `target/bench/nvme-lent.json` and `nvme-lent.svg` at the
//! workspace root (override the JSON path with `NVME_LENT_BENCH_OUT`; the SVG goes next to
//! it; `NVME_LENT_BENCH_DIR` overrides where the backing files live), and the Markdown
//! fragment `lent.md` beside them (section `lent` of `scripts/bench.sh`).
//! `LENDVM_BENCH_QUICK=1`: 1 repetition of 0.05 s, 0.02 s warm-up (checks that it runs).

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code

#[path = "../tests/common/mod.rs"]
mod common;

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use common::{lent_rig, nvme_spec, start_lenderd, BarPath, FdIrq, TokenVia};
use emulated::nvme::{NvmeConfig, NvmeController, BAR0_SIZE};
use emulated::testing::{DataBuf, DirectBar, DriverConfig, NvmeDriver, TestMemory};
use emulated::workload::{self, Case, CASES};
use emulated::{DeviceModel, HeapRegisters, InterruptMode, InterruptSink, NotifyMode};
use ntb::FabricKind;
use std::sync::Arc;
use vmm_sys_util::eventfd::EventFd;

/// The local side's interrupts: one eventfd per vector, signalled by the controller and waited
/// on by the same [`FdIrq`] the lent side uses (like a KVM irqfd; no lender in between).
struct EventFdSink(Vec<EventFd>);

impl InterruptSink for EventFdSink {
    fn signal_msix(&self, vector: u16) {
        if let Some(e) = self.0.get(usize::from(vector)) {
            let _ = e.write(1);
        }
    }
    fn set_intx(&self, _asserted: bool) {}
    fn mode(&self) -> InterruptMode {
        InterruptMode::MsiX {
            vectors: self.0.len() as u16,
        }
    }
}

/// The controller in this process: heap registers, test RAM, eventfd interrupts, and the
/// driver with the same BAR access (direct stores + doorbell eventfd in interrupt mode).
struct Local {
    driver: NvmeDriver,
    ctrl: Arc<NvmeController>,
}

fn local_rig(cfg: NvmeConfig, polling: bool) -> Local {
    let vectors = cfg.msix_vectors;
    let fds: Vec<EventFd> = (0..vectors)
        .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
        .collect();
    let sink = EventFdSink(fds.iter().map(|e| e.try_clone().unwrap()).collect());
    let regs = Arc::new(HeapRegisters::new(BAR0_SIZE as usize));
    let mem = TestMemory::new(RAM as usize);
    let ctrl =
        Arc::new(NvmeController::new(cfg, regs.clone(), mem.clone(), Arc::new(sink)).unwrap());
    ctrl.start().unwrap();
    let doorbell = (!polling).then(|| ctrl.doorbell_event());
    let bar = DirectBar::new(regs, doorbell).unwrap();
    let driver = NvmeDriver::new(
        Arc::new(bar),
        mem,
        FdIrq::new(fds),
        DriverConfig {
            ram_base: common::RAM_BASE,
            ram_len: RAM - common::RAM_BASE,
            use_interrupts: !polling,
            timeout: Duration::from_secs(10),
        },
    );
    Local { driver, ctrl }
}

const DEV: &str = "0000:82:00.0";
const NS_BYTES: u64 = 256 << 20;
const RAM: u64 = 128 << 20;

/// Median, minimum and maximum of per-repetition values.
#[derive(Debug, Clone, Copy, Default)]
struct Spread {
    med: f64,
    min: f64,
    max: f64,
}

impl Spread {
    fn of(v: &[f64]) -> Spread {
        if v.is_empty() {
            return Spread::default();
        }
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let med = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Spread {
            med,
            min: v[0],
            max: v[n - 1],
        }
    }

    fn json(&self, prec: usize) -> String {
        format!(
            "{{\"median\": {:.p$}, \"min\": {:.p$}, \"max\": {:.p$}}}",
            self.med,
            self.min,
            self.max,
            p = prec
        )
    }
}

/// One side's per-repetition results of a case.
#[derive(Default)]
struct Acc {
    iops: Vec<f64>,
    p50_us: Vec<f64>,
    p99_us: Vec<f64>,
}

/// One timed run through the shared workload; with `acc` the repetition's IOPS and its own
/// p50/p99 are recorded, without it is a warm-up.
fn run_case(
    d: &mut NvmeDriver,
    bufs: &[DataBuf],
    c: &Case,
    secs: f64,
    seed: u64,
    lat: &mut Vec<u32>,
    acc: Option<&mut Acc>,
) {
    let st = workload::run_case(d, bufs, c, secs, seed, lat).unwrap();
    if let Some(acc) = acc {
        acc.iops.push(st.iops());
        acc.p50_us.push(st.p50_us);
        acc.p99_us.push(st.p99_us);
    }
}

/// One side of a row: spreads over the repetitions.
#[derive(Clone, Copy)]
struct SideSum {
    iops: Spread,
    mibps: Spread,
    p50: Spread,
    p99: Spread,
}

fn summarize(a: &Acc, bs: usize) -> SideSum {
    let mib: Vec<f64> = a
        .iops
        .iter()
        .map(|i| i * bs as f64 / f64::from(1u32 << 20))
        .collect();
    SideSum {
        iops: Spread::of(&a.iops),
        mibps: Spread::of(&mib),
        p50: Spread::of(&a.p50_us),
        p99: Spread::of(&a.p99_us),
    }
}

struct Row {
    mode: &'static str,
    case: &'static Case,
    /// lent/local IOPS of the same repetition (paired, so load from other processes that
    /// hits one repetition mostly hits both sides).
    ratio: Spread,
    /// lent p50 − local p50 of the same repetition (µs).
    added_p50: Spread,
    local: SideSum,
    lent: SideSum,
}

struct Check {
    mode: &'static str,
    what: String,
    value: f64,
    target: String,
    pass: bool,
}

fn checks(rows: &[Row]) -> Vec<Check> {
    let mut v = Vec::new();
    for r in rows {
        let ratio = r.ratio.med;
        if r.case.bs == 4096 {
            v.push(Check {
                mode: r.mode,
                what: format!("{} IOPS lent/local", r.case.name),
                value: ratio,
                target: ">= 0.90".into(),
                pass: ratio >= 0.90,
            });
        } else {
            v.push(Check {
                mode: r.mode,
                what: format!("{} bandwidth lent/local", r.case.name),
                value: ratio,
                target: ">= 0.95".into(),
                pass: ratio >= 0.95,
            });
        }
        if r.case.qd == 1 {
            let added = r.added_p50.med;
            let max = if r.mode == "interrupt" { 5.0 } else { 1.0 };
            v.push(Check {
                mode: r.mode,
                what: format!("{} p50 added latency (us)", r.case.name),
                value: added,
                target: format!("<= {max:.1}"),
                pass: added <= max,
            });
        }
    }
    v
}

fn svg(rows: &[Row]) -> String {
    let (w, h) = (960.0, 420.0);
    let (left, top, bottom) = (60.0, 40.0, 120.0);
    let plot_h = h - top - bottom;
    let n = rows.len() as f64;
    let group = (w - left - 20.0) / n;
    let bar = group * 0.35;
    let max = 1.2f64;
    let y = |r: f64| top + plot_h * (1.0 - (r / max).min(1.0));
    let mut s = String::new();
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">"
    );
    let _ = writeln!(s, "<rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>");
    let _ = writeln!(
        s,
        "<text x=\"{left}\" y=\"20\" font-size=\"14\">NVMe lent (shm fabric) vs local: throughput relative to local (local = 1.0)</text>"
    );
    for t in [0.0, 0.5, 0.9, 0.95, 1.0] {
        let _ = writeln!(
            s,
            "<line x1=\"{left}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"{}\" stroke-dasharray=\"{}\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{t:.2}</text>",
            w - 20.0,
            if t == 0.9 || t == 0.95 { "#c00" } else { "#ccc" },
            if t == 0.9 || t == 0.95 { "4 3" } else { "" },
            left - 4.0,
            y(t) + 4.0,
            y = y(t),
        );
    }
    for (i, r) in rows.iter().enumerate() {
        let x0 = left + group * i as f64 + group * 0.15;
        let ratio = r.ratio.med;
        for (k, (val, color)) in [(1.0, "#7a9cc6"), (ratio, "#e08a3c")].iter().enumerate() {
            let x = x0 + bar * k as f64;
            let _ = writeln!(
                s,
                "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{color}\"/>",
                y(*val),
                bar - 2.0,
                y(0.0) - y(*val)
            );
        }
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{ratio:.2}</text>",
            x0 + bar * 1.5,
            y(ratio) - 3.0
        );
        let lx = x0 + bar;
        let ly = h - bottom + 10.0;
        let metric = if r.case.bs == 4096 {
            format!("{:.0}/{:.0} IOPS", r.local.iops.med, r.lent.iops.med)
        } else {
            format!("{:.0}/{:.0} MiB/s", r.local.mibps.med, r.lent.mibps.med)
        };
        let _ = writeln!(
            s,
            "<text transform=\"translate({lx:.1},{ly:.1}) rotate(40)\">{} {}</text><text transform=\"translate({:.1},{ly:.1}) rotate(40)\" fill=\"#666\">{metric}</text>",
            r.mode,
            r.case.name,
            lx - 11.0
        );
    }
    let _ = writeln!(
        s,
        "<rect x=\"{}\" y=\"28\" width=\"10\" height=\"10\" fill=\"#7a9cc6\"/><text x=\"{}\" y=\"37\">local</text><rect x=\"{}\" y=\"28\" width=\"10\" height=\"10\" fill=\"#e08a3c\"/><text x=\"{}\" y=\"37\">lent</text>",
        w - 150.0,
        w - 136.0,
        w - 90.0,
        w - 76.0
    );
    s.push_str("</svg>\n");
    s
}

/// Restricts the calling thread (and every thread or process it creates afterwards) to `cpu`.
fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it; the call
    // reads `size_of::<cpu_set_t>()` bytes of it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            eprintln!(
                "sched_setaffinity({cpu}): {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

fn fmt_spread(s: Spread, prec: usize) -> String {
    format!("{:.p$} [{:.p$}-{:.p$}]", s.med, s.min, s.max, p = prec)
}

fn main() {
    // `cargo bench` passes `--bench`; nothing to filter.
    let env_f = |k: &str, d: f64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let quick = std::env::var("LENDVM_BENCH_QUICK").is_ok_and(|v| v == "1");
    let (reps0, per0, warm0) = if quick {
        (1.0, 0.05, 0.02)
    } else {
        (7.0, 0.3, 0.2)
    };
    let reps = env_f("NVME_LENT_BENCH_REPS", reps0).max(1.0) as usize;
    let secs = env_f("NVME_LENT_BENCH_SECS", per0 * reps as f64);
    let warm = env_f("NVME_LENT_BENCH_WARMUP", warm0);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Driver ("guest") on CPU 0, every device-side thread (local controller + engine threads,
    // the whole lenderd) on CPU 1, for both sides: the scheduler may not put the driver and
    // the controller on one CPU for one side and on two for the other.
    let pin = cpus >= 2 && env_f("NVME_LENT_BENCH_PIN", 1.0) != 0.0;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    let out = std::env::var("NVME_LENT_BENCH_OUT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| {
            std::env::var("CARGO_TARGET_DIR")
                .map(std::path::PathBuf::from)
                .unwrap_or_else(|_| root.join("target"))
                .join("bench/nvme-lent.json")
        });
    let svg_path = out.with_extension("svg");
    // Backing files on tmpfs: the benchmark measures the lending path, not the disk (ext4
    // writeback and fdatasync would dominate and randomise the write cases).
    let dir = match std::env::var("NVME_LENT_BENCH_DIR") {
        Ok(d) => tempfile::tempdir_in(d).unwrap(),
        Err(_) if std::path::Path::new("/dev/shm").is_dir() => {
            tempfile::tempdir_in("/dev/shm").unwrap()
        }
        Err(_) => tempfile::tempdir().unwrap(),
    };
    let t_all = Instant::now();
    let mut rows = Vec::new();
    let mut engines = Vec::new();
    println!(
        "{reps} repetitions x {:.2} s per case and side (+{warm} s warm-up), backing dir {}, pinned: {pin}",
        secs / reps as f64,
        dir.path().display()
    );
    println!(
        "values: median [min-max] over repetitions; ratio and added p50 paired per repetition"
    );
    for mode in [NotifyMode::Interrupt, NotifyMode::Polling] {
        let polling = mode == NotifyMode::Polling;
        let mname = if polling { "polling" } else { "interrupt" };
        if pin {
            pin_to(1);
        }
        // Local: the controller in this process, NvmeConfig as lenderd builds it.
        let cfg = NvmeConfig {
            backing: dir.path().join(format!("local-{mname}.img")),
            size: Some(NS_BYTES),
            notify: mode,
            ..NvmeConfig::default()
        };
        let mut local = local_rig(cfg, polling);
        engines.push(local.ctrl.engine_name());
        // Lent: lenderd on the shm fabric, one lenderd per mode so an idle polling device
        // never competes with the interrupt-mode runs.
        let cdir = tempfile::tempdir_in(dir.path()).unwrap();
        let c = common::cluster_in(cdir, FabricKind::Shm);
        let disk = dir.path().join(format!("lent-{mname}.img"));
        let size = format!("{}M", NS_BYTES >> 20);
        let _lenderd = start_lenderd(
            &c,
            mname,
            &[nvme_spec(DEV, &disk, &size, polling)],
            TokenVia::File,
        );
        if pin {
            pin_to(0);
        }
        let mut lent = lent_rig(
            &c,
            DEV,
            RAM,
            BarPath::Direct { notify: !polling },
            &[],
            2,
            !polling,
        );
        let lbufs = workload::prepare(&mut local.driver).unwrap();
        let rbufs = workload::prepare(&mut lent.driver).unwrap();
        let mut lat = Vec::with_capacity(1 << 20);
        for case in CASES.iter() {
            let (mut a, mut b) = (Acc::default(), Acc::default());
            let per = secs / reps as f64;
            let seed0 = 0x9e37_79b9_7f4a_7c15u64;
            run_case(&mut local.driver, &lbufs, case, warm, seed0, &mut lat, None);
            run_case(&mut lent.driver, &rbufs, case, warm, seed0, &mut lat, None);
            for r in 0..reps {
                let seed = seed0 ^ ((r as u64 + 1) << 32);
                // Alternate who goes first.
                if r % 2 == 0 {
                    run_case(
                        &mut local.driver,
                        &lbufs,
                        case,
                        per,
                        seed,
                        &mut lat,
                        Some(&mut a),
                    );
                    run_case(
                        &mut lent.driver,
                        &rbufs,
                        case,
                        per,
                        seed,
                        &mut lat,
                        Some(&mut b),
                    );
                } else {
                    run_case(
                        &mut lent.driver,
                        &rbufs,
                        case,
                        per,
                        seed,
                        &mut lat,
                        Some(&mut b),
                    );
                    run_case(
                        &mut local.driver,
                        &lbufs,
                        case,
                        per,
                        seed,
                        &mut lat,
                        Some(&mut a),
                    );
                }
            }
            let paired: Vec<f64> = a
                .iops
                .iter()
                .zip(&b.iops)
                .map(|(l, r)| r / l.max(1e-9))
                .collect();
            let added: Vec<f64> = a.p50_us.iter().zip(&b.p50_us).map(|(l, r)| r - l).collect();
            let row = Row {
                mode: mname,
                case,
                ratio: Spread::of(&paired),
                added_p50: Spread::of(&added),
                local: summarize(&a, case.bs),
                lent: summarize(&b, case.bs),
            };
            let (unit, lv, rv, prec) = if case.bs == 4096 {
                ("IOPS", row.local.iops, row.lent.iops, 0)
            } else {
                ("MiB/s", row.local.mibps, row.lent.mibps, 0)
            };
            println!(
                "{mname:9} {:18} {unit:5} local {:>24} lent {:>24} ratio {:>18} | p50 us local {:>16} lent {:>16} added {:>16}",
                case.name,
                fmt_spread(lv, prec),
                fmt_spread(rv, prec),
                fmt_spread(row.ratio, 2),
                fmt_spread(row.local.p50, 1),
                fmt_spread(row.lent.p50, 1),
                fmt_spread(row.added_p50, 1),
            );
            rows.push(row);
        }
        lent.driver.shutdown().unwrap();
        local.driver.shutdown().unwrap();
    }
    let checks = checks(&rows);
    println!(
        "\n{:9} {:48} {:>9} {:>8}  result",
        "mode", "target", "value", "goal"
    );
    for c in &checks {
        println!(
            "{:9} {:48} {:>9.3} {:>8}  {}",
            c.mode,
            c.what,
            c.value,
            c.target,
            if c.pass { "PASS" } else { "MISS" }
        );
    }
    // JSON by hand (no serde dependency for one file).
    let mut j = String::new();
    let _ = writeln!(j, "{{\n  \"bench\": \"nvme-lent\",\n  \"fabric\": \"shm\",");
    let _ = writeln!(
        j,
        "  \"secs_per_case_and_side\": {secs},\n  \"warmup_secs\": {warm},\n  \"repetitions\": {reps},\n  \"statistic\": \"median, min and max over repetitions; ratio and p50_added paired per repetition\",\n  \"backing_dir\": \"{}\",\n  \"pinned\": {pin},\n  \"engine\": \"{}\",\n  \"host_cpus\": {cpus},",
        dir.path().parent().map_or(String::new(), |p| p.display().to_string()),
        engines.first().copied().unwrap_or("?"),
    );
    let _ = writeln!(j, "  \"cases\": [");
    for (i, r) in rows.iter().enumerate() {
        let side = |t: SideSum| {
            format!(
                "{{\"iops\": {}, \"mib_per_s\": {}, \"p50_us\": {}, \"p99_us\": {}}}",
                t.iops.json(0),
                t.mibps.json(1),
                t.p50.json(2),
                t.p99.json(2)
            )
        };
        let _ = writeln!(
            j,
            "    {{\"mode\": \"{}\", \"name\": \"{}\", \"bs\": {}, \"qd\": {}, \"local\": {}, \"lent\": {}, \"ratio\": {}, \"p50_added_us\": {}}}{}",
            r.mode,
            r.case.name,
            r.case.bs,
            r.case.qd,
            side(r.local),
            side(r.lent),
            r.ratio.json(4),
            r.added_p50.json(2),
            if i + 1 < rows.len() { "," } else { "" }
        );
    }
    let _ = writeln!(j, "  ],\n  \"targets\": [");
    for (i, c) in checks.iter().enumerate() {
        let _ = writeln!(
            j,
            "    {{\"mode\": \"{}\", \"what\": \"{}\", \"value\": {:.4}, \"target\": \"{}\", \"pass\": {}}}{}",
            c.mode,
            c.what,
            c.value,
            c.target,
            c.pass,
            if i + 1 < checks.len() { "," } else { "" }
        );
    }
    let _ = writeln!(
        j,
        "  ],\n  \"all_targets_met\": {},\n  \"wall_secs\": {:.1}\n}}",
        checks.iter().all(|c| c.pass),
        t_all.elapsed().as_secs_f64()
    );
    if let Some(p) = out.parent() {
        std::fs::create_dir_all(p).unwrap();
    }
    std::fs::write(&out, j).unwrap();
    std::fs::write(&svg_path, svg(&rows)).unwrap();
    std::fs::write(
        out.with_file_name("lent.md"),
        markdown(&rows, &checks, reps, secs, warm, pin),
    )
    .unwrap();
    println!(
        "wrote {} and {} in {:.0} s",
        out.display(),
        svg_path.display(),
        t_all.elapsed().as_secs_f64()
    );
}

/// The fragment for docs/BENCHMARKS.md: every figure from this run's rows and checks.
fn markdown(
    rows: &[Row],
    checks: &[Check],
    reps: usize,
    secs: f64,
    warm: f64,
    pin: bool,
) -> String {
    let mut md = format!(
        "{reps} repetition(s) of {:.2} s per case and side after {warm} s warm-up, local and lent interleaved; threads pinned: {pin}; backing files on tmpfs. Median [min–max] over repetitions; the ratio and the added p50 are paired per repetition. Unit: IOPS for 4k, MiB/s for 128k.\n\n",
        secs / reps as f64
    );
    md += "| mode | case | local | lent | lent/local | p50 local / lent (µs) | added p50 (µs) |\n|---|---|---|---|---|---|---|\n";
    for r in rows {
        let (lv, rv) = if r.case.bs == 4096 {
            (r.local.iops, r.lent.iops)
        } else {
            (r.local.mibps, r.lent.mibps)
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {:.1} / {:.1} | {} |",
            r.mode,
            r.case.name,
            fmt_spread(lv, 0),
            fmt_spread(rv, 0),
            fmt_spread(r.ratio, 2),
            r.local.p50.med,
            r.lent.p50.med,
            fmt_spread(r.added_p50, 1)
        );
    }
    md += "\n| mode | goal | value | target | result |\n|---|---|---|---|---|\n";
    for c in checks {
        let _ = writeln!(
            md,
            "| {} | {} | {:.3} | {} | {} |",
            c.mode,
            c.what,
            c.value,
            c.target,
            if c.pass { "**met**" } else { "**missed**" }
        );
    }
    let _ = writeln!(
        md,
        "\nAll goals: {}.",
        if checks.iter().all(|c| c.pass) {
            "**met**"
        } else {
            "**not all met** (see the rows marked missed)"
        }
    );
    md
}
