//! Hot-add latency benchmark (not a test): `cargo build --release -p lending --bins && cargo
//! bench -p vmm --bench hotplug`.
//!
//! Starts a `lenderd` lending one emulated device (`dmatest` by default, `HOTPLUG_DEVICE=nvme`
//! for an NVMe controller backed by a temp file) and a `lendvm` whose guest idles (a
//! two-instruction `pause; jmp` ELF written by the bench: no guest time in the numbers, and
//! no guest ejects, so removals use `force`). Then `HOTPLUG_N` (default 200) times:
//! `vm.add-remote-device`, `vm.remove-device {force}`.
//!
//! Measured per add:
//! * `api_add_ms`: the client's round trip (connect, HTTP request, VMM borrow + device model +
//!   bus + GED interrupt, reply);
//! * `vmm_add_ms`: the VMM's own timing of the same add (from the `hot-added ... in X ms`
//!   line it logs: lender connect + borrow, device model, bus + GED).
//!
//! Writes `$HOTPLUG_BENCH_JSON`, else `$CARGO_TARGET_DIR/bench/hotplug.json`, else
//! `target/bench/hotplug.json`, and an SVG beside it. Target: p50 of `api_add_ms` <= 20 ms.

// A benchmark harness, like a test: panicking on setup failure is the right behaviour.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use api::client::ApiClient;
use api::types::{VmAddRemoteDeviceData, VmRemoveDeviceData};

const TOKEN: &str = "hotplug-bench-token-8f3a61c2d4b7e9051a6c";
const DEV: &str = "0000:81:00.0";
const TARGET_MS: f64 = 20.0;

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn out_path() -> PathBuf {
    if let Ok(p) = std::env::var("HOTPLUG_BENCH_JSON") {
        return PathBuf::from(p);
    }
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("bench/hotplug.json")
}

/// `pause; jmp .-2` as an ELF64 loaded at 2 MiB.
fn spin_elf() -> Vec<u8> {
    let base: u64 = 0x20_0000;
    let mut e = Vec::new();
    e.extend_from_slice(b"\x7fELF\x02\x01\x01\x00");
    e.extend_from_slice(&[0; 8]);
    e.extend_from_slice(&2u16.to_le_bytes());
    e.extend_from_slice(&0x3eu16.to_le_bytes());
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&base.to_le_bytes());
    e.extend_from_slice(&64u64.to_le_bytes());
    e.extend_from_slice(&0u64.to_le_bytes());
    e.extend_from_slice(&0u32.to_le_bytes());
    for v in [64u16, 56, 1, 0, 0, 0] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&5u32.to_le_bytes());
    for v in [0x1000u64, base, base, 4, 4, 0x1000] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.resize(0x1000, 0);
    e.extend_from_slice(&[0xf3, 0x90, 0xeb, 0xfc]);
    e
}

fn wait_for(path: &Path, what: &str) {
    let t = Instant::now();
    while !path.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{what} did not create {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn stats(v: &[f64]) -> serde_json::Value {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    serde_json::json!({
        "n": s.len(),
        "p50": pct(&s, 0.5),
        "p99": pct(&s, 0.99),
        "min": s.first().copied().unwrap_or(f64::NAN),
        "max": s.last().copied().unwrap_or(f64::NAN),
        "mean": s.iter().sum::<f64>() / s.len().max(1) as f64,
    })
}

fn svg(series: &[(&str, &str, &[f64])], notes: &[String]) -> String {
    let (w, h, l, r, t, b) = (820.0, 440.0, 60.0, 20.0, 40.0, 70.0);
    let n = series.iter().map(|s| s.2.len()).max().unwrap_or(1).max(2);
    let ymax = series
        .iter()
        .flat_map(|s| s.2.iter().copied())
        .fold(TARGET_MS, f64::max)
        * 1.1;
    let x = |i: usize| l + (w - l - r) * i as f64 / (n - 1) as f64;
    let y = |v: f64| t + (h - t - b) * (1.0 - v / ymax);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{l}\" y=\"22\" font-size=\"15\">lendvm hot-add latency per iteration (ms)</text>\n\
         <line x1=\"{l}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#999\" stroke-dasharray=\"4 3\"/>\n\
         <text x=\"{}\" y=\"{}\" fill=\"#999\">target {TARGET_MS} ms</text>\n",
        y(TARGET_MS),
        w - r,
        y(TARGET_MS),
        w - r - 90.0,
        y(TARGET_MS) - 4.0
    );
    for k in 0..=4 {
        let v = ymax * f64::from(k) / 4.0;
        s += &format!(
            "<line x1=\"{l}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"#eee\"/><text x=\"8\" y=\"{2}\">{v:.1}</text>\n",
            y(v),
            w - r,
            y(v) + 4.0
        );
    }
    for (idx, (name, color, data)) in series.iter().enumerate() {
        let pts: Vec<String> = data
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{:.1},{:.1}", x(i), y(*v)))
            .collect();
        s += &format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.2\" points=\"{}\"/>\n\
             <text x=\"{}\" y=\"{}\" fill=\"{color}\">{name}</text>\n",
            pts.join(" "),
            l + 10.0 + 200.0 * idx as f64,
            h - b + 25.0
        );
    }
    for (i, note) in notes.iter().enumerate() {
        s += &format!(
            "<text x=\"{l}\" y=\"{}\">{note}</text>\n",
            h - b + 45.0 + 15.0 * i as f64
        );
    }
    s + "</svg>\n"
}

fn main() {
    let n: usize = std::env::var("HOTPLUG_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let device_kind = std::env::var("HOTPLUG_DEVICE").unwrap_or_else(|_| "dmatest".into());
    let lendvm = PathBuf::from(env!("CARGO_BIN_EXE_lendvm"));
    let lenderd = lendvm.with_file_name("lenderd");
    assert!(
        lenderd.is_file(),
        "{} is missing: run `cargo build --release -p lending --bins` (same CARGO_TARGET_DIR) first",
        lenderd.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    ntb::config::write_private_file(
        &d.join("cluster.toml"),
        &format!(
            "version = 1\ntoken = \"{TOKEN}\"\n[[node]]\nname = \"node3\"\nfabric = \"shm\"\ncontrol = \"{}\"\n",
            d.join("node3.sock").display()
        ),
    )
    .unwrap();
    std::fs::write(d.join("spin.elf"), spin_elf()).unwrap();
    let spec = match device_kind.as_str() {
        "nvme" => format!("{DEV}=nvme:path={},size=64M", d.join("disk.img").display()),
        _ => format!("{DEV}=dmatest"),
    };
    let _lender = Kill(
        Command::new(&lenderd)
            .args(["--node", "node3", "--cluster"])
            .arg(d.join("cluster.toml"))
            .args(["--device", &spec, "--token", TOKEN])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start lenderd"),
    );
    wait_for(&d.join("node3.sock"), "lenderd");
    let sock = d.join("api.sock");
    let mut vmm = Command::new(&lendvm)
        .args(["--kernel"])
        .arg(d.join("spin.elf"))
        .args(["--serial", "off", "--memory", "256M", "--cluster"])
        .arg(d.join("cluster.toml"))
        .arg("--api-socket")
        .arg(&sock)
        .env("RUST_LOG", "vmm::control=info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start lendvm");
    let stderr = vmm.stderr.take().unwrap();
    let _vmm = Kill(vmm);
    let vmm_ms: Arc<Mutex<Vec<f64>>> = Arc::default();
    let reader = {
        let vmm_ms = vmm_ms.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                // "... hot-added ID: SPEC at BDF (MODE) in X ms (borrow ..."
                if let Some(rest) = line.split(" hot-added ").nth(1) {
                    if let Some(ms) = rest
                        .split(" in ")
                        .nth(1)
                        .and_then(|s| s.split(' ').next())
                        .and_then(|s| s.parse::<f64>().ok())
                    {
                        vmm_ms.lock().unwrap().push(ms);
                    }
                }
            }
        })
    };
    wait_for(&sock, "lendvm");
    let client = ApiClient::new(&sock, Duration::from_secs(30));
    client.ping().expect("ping");

    let device: api::types::RemoteDeviceSpec = format!("node3:{DEV}").parse().unwrap();
    let mut add_ms = Vec::with_capacity(n);
    let mut remove_ms = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        let added = client
            .add_remote_device(&VmAddRemoteDeviceData {
                device: device.clone(),
                id: Some(format!("d{i}")),
                mode: None,
                replace_lost: false,
            })
            .expect("add");
        add_ms.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        client
            .remove_device(&VmRemoveDeviceData {
                id: added.id,
                force: true,
            })
            .expect("remove");
        remove_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let info = client.info().expect("info");
    let counters = info.counters.unwrap_or_default();
    client.shutdown().expect("shutdown");
    let t = Instant::now();
    while !reader.is_finished() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let vmm_ms = vmm_ms.lock().unwrap().clone();

    let a = stats(&add_ms);
    let p50 = a["p50"].as_f64().unwrap_or(f64::NAN);
    println!(
        "hot-add ({device_kind}, n={n}): api round trip p50 {p50:.3} ms p99 {:.3} ms; vmm-side p50 {:.3} ms; \
         force-remove p50 {:.3} ms; target p50 <= {TARGET_MS} ms: {}",
        a["p99"].as_f64().unwrap_or(f64::NAN),
        stats(&vmm_ms)["p50"].as_f64().unwrap_or(f64::NAN),
        stats(&remove_ms)["p50"].as_f64().unwrap_or(f64::NAN),
        if p50 <= TARGET_MS { "met" } else { "NOT met" }
    );
    let json = serde_json::json!({
        "bench": "lendvm hot-add",
        "device": device_kind,
        "n": n,
        "note": "api_add_ms: client round trip of vm.add-remote-device (lender connect + borrow, device model, PCI bus, GED interrupt, reply); vmm_add_ms: the VMM's own timing of the same work; the guest idles (pause/jmp) so no guest time is included; removals are forced (the idle guest never ejects)",
        "api_add_ms": a,
        "vmm_add_ms": stats(&vmm_ms),
        "api_force_remove_ms": stats(&remove_ms),
        "target_p50_ms": TARGET_MS,
        "target_met": p50 <= TARGET_MS,
        "counters_after": counters,
    });
    let path = out_path();
    if let Some(p) = path.parent() {
        std::fs::create_dir_all(p).expect("create bench dir");
    }
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).expect("write json");
    let svg_path = path.with_extension("svg");
    let notes = vec![format!(
        "{device_kind}, n={n}: api p50 {p50:.2} ms, p99 {:.2} ms; vmm p50 {:.2} ms",
        a["p99"].as_f64().unwrap_or(f64::NAN),
        stats(&vmm_ms)["p50"].as_f64().unwrap_or(f64::NAN)
    )];
    std::fs::write(
        &svg_path,
        svg(
            &[
                ("api round trip", "#d62728", &add_ms),
                ("vmm side", "#1f77b4", &vmm_ms),
            ],
            &notes,
        ),
    )
    .expect("write svg");
    println!("wrote {} and {}", path.display(), svg_path.display());
}
