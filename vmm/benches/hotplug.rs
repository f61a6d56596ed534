//! Hot-add latency benchmark (not a test): `cargo build --release -p lending --bins && cargo
//! bench -p vmm --bench hotplug`.
//!
//! For each fabric, shm and tcp (TLS 1.3 on loopback), starts a `lenderd` lending three
//! emulated `dmatest` devices (the one added and removed has a 1 MiB BAR0, another a 64 GiB
//! one) and a `lendvm` whose guest idles (`cli; hlt` in a loop: the vCPU sleeps in KVM, no
//! guest time and no busy core in the numbers, and no guest ejects, so removals use
//! `force`). Then four cases of `HOTPLUG_N` (default 200; 8 with `LENDVM_BENCH_QUICK=1`)
//! `vm.add-remote-device` + `vm.remove-device {force}` each:
//!
//! * `new session`: lendvm runs with `--lender-idle-ms 0`, so the link to the lender closes
//!   with its last device and every add opens one (tcp: TCP connect + TLS handshake), runs
//!   AUTH and HELLO and starts the session's event pump, then borrows: what the first device
//!   of a lender costs;
//! * `re-add`: lendvm runs with `--lender-idle-ms 60000`, so each add reuses the session kept
//!   open since the previous removal (the default `vmm::remote::SESSION_IDLE`, 1 s, is shorter
//!   than a removal and the next add take on a loaded 2-core machine: one of 20 re-adds in a
//!   CI run beside a CPU load found its session closed);
//! * `re-add, 64 GiB BAR`: the same with the device whose BAR0 is 64 GiB (a GPU aperture's
//!   size, `dmatest:buf=`, sparse): nothing on the path may cost time or memory in
//!   proportion to a BAR (issue 33), so its p99 is held to 1.5x the 1 MiB BAR's, and both
//!   daemons' resident memory over the case is reported;
//! * `shared session`: a second device of the same lender stays attached throughout, so every
//!   add borrows over its authenticated session (`LenderSource` shares one session per
//!   lender among the devices borrowed there).
//!
//! Measured per add: the client's round trip (`api`), and the VMM's own phase timings from the
//! lines it logs (`hot-added ... in X ms (checks, borrow, device, bus, GED)`, `borrowed ...:
//! session new|shared X ms, borrow X ms, link X ms`, `new lender session: link, auth, hello,
//! event pump`). `api - vmm` is the API hop: HTTP over the unix socket, the API thread, the
//! control loop's wake-up and the reply.
//!
//! Writes `target/bench/hotplug.json`, `.svg` (latency distribution per fabric and case) and
//! `.md` (a Markdown fragment with the tables and one line per goal); `$HOTPLUG_BENCH_JSON`
//! moves all three. Goals (the p99 of the API round trip, n >= 200, one line per case): <= 2 ms
//! on shm, <= 5 ms on tcp+TLS.

// A benchmark harness, like a test: panicking on setup failure is the right behaviour.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use api::client::ApiClient;
use api::types::{VmAddRemoteDeviceData, VmRemoveDeviceData};

mod common;
use common::Kill;

const TOKEN: &str = "hotplug-bench-token-8f3a61c2d4b7e9051a6c";
/// The device added and removed: a dmatest with a 1 MiB BAR0 (4 KiB of registers, then its
/// buffer).
const DEV: &str = "0000:81:00.0";
const DEV_BUF: &str = "1020K";
/// The device of the large-BAR case: BAR0 64 GiB.
const BIG: &str = "0000:81:00.2";
const BIG_BUF: &str = "67108860K";
/// Goal of the large-BAR case: its p99 at most this many times the 1 MiB BAR's re-add p99.
const BIG_RATIO: f64 = 1.5;
/// The device kept attached in the shared-session case.
const ANCHOR: &str = "0000:81:00.1";

/// The cases (see the module docs).
const NEW: &str = "new session";
const READD: &str = "re-add";
const READD_BIG: &str = "re-add, 64 GiB BAR";
const SHARED: &str = "shared session";

/// (fabric, goal for the p99 of the API round trip in ms).
const GOALS: [(&str, f64); 2] = [("shm", 2.0), ("tcp", 5.0)];

fn out_path() -> PathBuf {
    if let Ok(p) = std::env::var("HOTPLUG_BENCH_JSON") {
        return PathBuf::from(p);
    }
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("bench/hotplug.json")
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

fn wait_port(port: u16) {
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "lenderd did not listen on 127.0.0.1:{port}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Time the threads of `pids` have waited on a run queue (runnable, not running), in ms:
/// the sum over their threads of the second field of `/proc/PID/task/TID/schedstat`.
/// Threads that ended meanwhile are not counted, so a difference is a lower bound.
fn run_delay_ms(pids: &[u32]) -> f64 {
    let mut ns = 0u64;
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
                ns += s
                    .split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
    }
    ns as f64 / 1e6
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[derive(Clone, Copy)]
struct Stats {
    n: usize,
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
    mean: f64,
}

fn stats(v: &[f64]) -> Stats {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    Stats {
        n: s.len(),
        p50: pct(&s, 0.5),
        p90: pct(&s, 0.9),
        p99: pct(&s, 0.99),
        max: s.last().copied().unwrap_or(f64::NAN),
        mean: s.iter().sum::<f64>() / s.len().max(1) as f64,
    }
}

impl Stats {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "n": self.n, "p50": self.p50, "p90": self.p90, "p99": self.p99,
            "max": self.max, "mean": self.mean,
        })
    }
}

/// What the VMM logged about one add.
#[derive(Clone, Debug, Default)]
struct Logged {
    /// name -> ms, for every phase found.
    phases: BTreeMap<&'static str, f64>,
    new_session: bool,
}

/// `... KEY X ms ...` -> X.
fn field(line: &str, key: &str) -> Option<f64> {
    let rest = line.split(&format!("{key} ")).nth(1)?;
    rest.split(' ').next()?.parse().ok()
}

/// Reads the VMM's log lines of each add, in order (the control thread does one add at a
/// time, so the session, borrow and hot-added lines of one add come together).
fn parse_logs(lines: &[String]) -> Vec<Logged> {
    let mut out = Vec::new();
    let mut cur = Logged::default();
    for l in lines {
        if l.contains(": new lender session: ") {
            cur.new_session = true;
            for (k, name) in [
                ("link", "session: link (connect, TLS)"),
                ("auth", "session: AUTH"),
                ("hello", "session: HELLO"),
                ("pump", "session: event pump"),
            ] {
                if let Some(v) = field(l.split(": new lender session: ").nth(1).unwrap(), k) {
                    cur.phases.insert(name, v);
                }
            }
        } else if let Some(rest) = l.split(" borrowed ").nth(1) {
            let rest = rest.split(": session ").nth(1).unwrap_or("");
            // "new X ms, borrow X ms, link X ms" / "shared X ms, ..."
            let session = rest.split(' ').nth(1).and_then(|s| s.parse::<f64>().ok());
            if let Some(v) = session {
                cur.phases.insert("session (total)", v);
            }
            if let Some(v) = field(rest, "borrow") {
                cur.phases.insert("borrow request", v);
            }
            if let Some(v) = field(rest, "link") {
                cur.phases.insert("lease link set-up", v);
            }
        } else if let Some(rest) = l.split(" hot-added ").nth(1) {
            let total = rest
                .split(" in ")
                .nth(1)
                .and_then(|s| s.split(' ').next())
                .and_then(|s| s.parse::<f64>().ok());
            if let Some(v) = total {
                cur.phases.insert("vmm total", v);
            }
            let inner = rest.split(" ms (").nth(1).unwrap_or("");
            for (k, name) in [
                ("checks", "checks"),
                ("borrow", "borrow (total)"),
                ("device", "device model"),
                ("bus", "PCI bus"),
                ("GED", "GED"),
            ] {
                if let Some(v) = field(inner, k) {
                    cur.phases.insert(name, v);
                }
            }
            out.push(std::mem::take(&mut cur));
        }
    }
    out
}

/// The rows of the phase table, in path order.
const PHASES: [&str; 14] = [
    "api round trip",
    "api hop (api - vmm)",
    "vmm total",
    "checks",
    "borrow (total)",
    "session (total)",
    "session: link (connect, TLS)",
    "session: AUTH",
    "session: HELLO",
    "session: event pump",
    "borrow request",
    "lease link set-up",
    "device model",
    "PCI bus",
];
/// After [`PHASES`].
const LAST_PHASES: [&str; 3] = ["GED", "run-queue wait (all threads)", "force remove (api)"];

struct CaseResult {
    name: &'static str,
    api: Vec<f64>,
    /// Run-queue wait of every thread of lendvm, lenderd and this bench during each add.
    waited: Vec<f64>,
    remove: Vec<f64>,
    logged: Vec<Logged>,
    /// Growth of resident memory over the case, kB: (lendvm, lenderd).
    rss_growth_kb: (i64, i64),
}

/// VmRSS of `pid` in kB (0 when unreadable).
fn rss_kb(pid: u32) -> i64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

impl CaseResult {
    /// Per phase: the values of every add that has it.
    fn phases(&self) -> Vec<(&'static str, Vec<f64>)> {
        let mut out = Vec::new();
        for name in PHASES.iter().chain(LAST_PHASES.iter()) {
            let v: Vec<f64> = match *name {
                "api round trip" => self.api.clone(),
                "force remove (api)" => self.remove.clone(),
                "run-queue wait (all threads)" => self.waited.clone(),
                "api hop (api - vmm)" => self
                    .api
                    .iter()
                    .zip(&self.logged)
                    .filter_map(|(a, l)| l.phases.get("vmm total").map(|v| a - v))
                    .collect(),
                other => self
                    .logged
                    .iter()
                    .filter_map(|l| l.phases.get(other).copied())
                    .collect(),
            };
            if !v.is_empty() {
                out.push((*name, v));
            }
        }
        out
    }

    /// The slowest adds: index, api ms and its three largest VMM phases.
    fn slowest(&self, k: usize) -> Vec<String> {
        let mut idx: Vec<usize> = (0..self.api.len()).collect();
        idx.sort_by(|a, b| self.api[*b].total_cmp(&self.api[*a]));
        idx.into_iter()
            .take(k)
            .map(|i| {
                let mut ph: Vec<(&str, f64)> = self
                    .logged
                    .get(i)
                    .map(|l| {
                        l.phases
                            .iter()
                            .filter(|(k, _)| {
                                !k.contains("total") && !k.starts_with("session (")
                            })
                            .map(|(k, v)| (*k, *v))
                            .collect()
                    })
                    .unwrap_or_default();
                ph.sort_by(|a, b| b.1.total_cmp(&a.1));
                let vmm = self
                    .logged
                    .get(i)
                    .and_then(|l| l.phases.get("vmm total").copied())
                    .unwrap_or(f64::NAN);
                let top: Vec<String> = ph
                    .iter()
                    .take(3)
                    .map(|(k, v)| format!("{k} {v:.2}"))
                    .collect();
                format!(
                    "#{i}: api {:.2} ms (run-queue wait {:.2} ms), vmm {vmm:.2} ms, hop {:.2} ms; {}",
                    self.api[i],
                    self.waited[i],
                    self.api[i] - vmm,
                    top.join(", ")
                )
            })
            .collect()
    }
}

/// Starts lenderd and lendvm for `fabric`, runs both cases, stops them.
fn run_fabric(
    fabric: &str,
    n: usize,
    warmup: usize,
    lender_idle_ms: Option<u64>,
    cases: &[&'static str],
) -> Vec<CaseResult> {
    let (lendvm, lenderd) = common::binaries();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let port = free_port();
    let control = match fabric {
        "shm" => d.join("node3.sock").display().to_string(),
        _ => format!("127.0.0.1:{port}"),
    };
    ntb::config::write_private_file(
        &d.join("cluster.toml"),
        &format!(
            "version = 1\ntoken = \"{TOKEN}\"\n[[node]]\nname = \"node3\"\nfabric = \"{fabric}\"\n\
             control = \"{control}\"\n"
        ),
    )
    .unwrap();
    std::fs::write(d.join("idle.elf"), common::guest_elf(&common::IDLE)).unwrap();
    let lender = Kill(
        Command::new(&lenderd)
            .args(["--node", "node3", "--cluster"])
            .arg(d.join("cluster.toml"))
            .args(["--device", &format!("{DEV}=dmatest:buf={DEV_BUF}")])
            .args(["--device", &format!("{ANCHOR}=dmatest")])
            .args(["--device", &format!("{BIG}=dmatest:buf={BIG_BUF}")])
            .args(["--token", TOKEN])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start lenderd"),
    );
    if fabric == "shm" {
        wait_for(&d.join("node3.sock"), "lenderd");
    } else {
        wait_port(port);
    }
    let sock = d.join("api.sock");
    let mut vmm = Command::new(&lendvm);
    if let Some(ms) = lender_idle_ms {
        vmm.args(["--lender-idle-ms", &ms.to_string()]);
    }
    let mut vmm = vmm
        .args(["--kernel"])
        .arg(d.join("idle.elf"))
        .args(["--serial", "off", "--memory", "256M", "--cluster"])
        .arg(d.join("cluster.toml"))
        .arg("--api-socket")
        .arg(&sock)
        .env("RUST_LOG", "warn,vmm::control=info,vmm::remote=info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start lendvm");
    let stderr = vmm.stderr.take().unwrap();
    let pids = [lender.0.id(), vmm.id(), std::process::id()];
    let _vmm = Kill(vmm);
    let lines: Arc<Mutex<Vec<String>>> = Arc::default();
    let reader = {
        let lines = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains(" hot-added ")
                    || line.contains(" borrowed ")
                    || line.contains(": new lender session: ")
                {
                    lines.lock().unwrap().push(line);
                } else if (line.contains("WARN") || line.contains("ERROR"))
                    // Expected: the halted guest never ejects a force-removed slot.
                    && !line.contains("the guest never ejected it")
                {
                    eprintln!("lendvm: {line}");
                }
            }
        })
    };
    wait_for(&sock, "lendvm");
    let client = ApiClient::new(&sock, Duration::from_secs(30));
    client.ping().expect("ping");

    let spec =
        |bdf: &str| -> api::types::RemoteDeviceSpec { format!("node3:{bdf}").parse().unwrap() };
    // (round trip, run-queue wait meanwhile)
    let add = |bdf: &str, id: String| -> (f64, f64) {
        let w = run_delay_ms(&pids);
        let t = Instant::now();
        client
            .add_remote_device(&VmAddRemoteDeviceData {
                device: spec(bdf),
                id: Some(id),
                mode: None,
                replace_lost: false,
                numa_node: None,
            })
            .expect("add");
        let ms = t.elapsed().as_secs_f64() * 1e3;
        (ms, run_delay_ms(&pids) - w)
    };
    let remove = |id: String| -> f64 {
        let t = Instant::now();
        client
            .remove_device(&VmRemoveDeviceData { id, force: true })
            .expect("remove");
        t.elapsed().as_secs_f64() * 1e3
    };
    // Adds logged so far (to find each case's lines).
    let logged_adds = || {
        lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(" hot-added "))
            .count()
    };
    let settle = |want: usize| {
        let t = Instant::now();
        while logged_adds() < want && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
    };

    let mut results = Vec::new();
    let mut adds = 0usize;
    let mut serial = 0usize;
    for &case in cases {
        if case == SHARED {
            add(ANCHOR, "anchor".into());
            adds += 1;
        }
        let mut api = Vec::with_capacity(n);
        let mut waited = Vec::with_capacity(n);
        let mut rem = Vec::with_capacity(n);
        let dev = if case == READD_BIG { BIG } else { DEV };
        let rss0 = (rss_kb(pids[1]), rss_kb(pids[0]));
        for i in 0..warmup + n {
            let id = format!("d{serial}");
            serial += 1;
            let (a, w) = add(dev, id.clone());
            let r = remove(id);
            if i >= warmup {
                api.push(a);
                waited.push(w);
                rem.push(r);
            }
        }
        adds += warmup + n;
        settle(adds);
        let all = parse_logs(&lines.lock().unwrap());
        assert_eq!(all.len(), adds, "one hot-added line per add");
        let logged = all[adds - n..].to_vec();
        let fresh = logged.iter().filter(|l| l.new_session).count();
        // New session: every add opens one; re-add: the session kept idle since the
        // previous removal serves it; shared: the anchor's session does.
        let want = if case == NEW { n } else { 0 };
        assert_eq!(
            fresh, want,
            "{fabric} {case}: {fresh} of {n} adds opened a lender session"
        );
        if case == SHARED {
            remove("anchor".into());
        }
        let rss1 = (rss_kb(pids[1]), rss_kb(pids[0]));
        results.push(CaseResult {
            name: case,
            api,
            waited,
            remove: rem,
            logged,
            rss_growth_kb: (rss1.0 - rss0.0, rss1.1 - rss0.1),
        });
    }
    let c = client.info().expect("info").counters.unwrap_or_default();
    assert_eq!(
        (c.devices, c.leases, c.lender_sessions),
        (0, 0, 0),
        "{fabric}: every device, lease and lender session is gone: {c:?}"
    );
    client.shutdown().expect("shutdown");
    let t = Instant::now();
    while !reader.is_finished() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    results
}

/// Latency distribution (the empirical CDF of the API round trip) per fabric and case.
fn svg(runs: &[(&str, Vec<CaseResult>)], notes: &[String]) -> String {
    let (w, h, l, r, t, b) = (820.0, 520.0, 60.0, 20.0, 40.0, 150.0);
    let mut xmax: f64 = GOALS.iter().map(|g| g.1).fold(0.0, f64::max);
    for (_, cases) in runs {
        for c in cases {
            let s = stats(&c.api);
            xmax = xmax.max(s.p99);
        }
    }
    xmax *= 1.15;
    let x = |v: f64| l + (w - l - r) * (v / xmax).min(1.0);
    let y = |q: f64| t + (h - t - b) * (1.0 - q);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{l}\" y=\"22\" font-size=\"15\">lendvm hot-add: API round trip, share of adds at or below (ms; past the right edge: clipped)</text>\n"
    );
    for k in 0..=4 {
        let q = f64::from(k) / 4.0;
        s += &format!(
            "<line x1=\"{l}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"#eee\"/><text x=\"8\" y=\"{2}\">{q:.2}</text>\n",
            y(q),
            w - r,
            y(q) + 4.0
        );
        let v = xmax * f64::from(k) / 4.0;
        s += &format!(
            "<text x=\"{}\" y=\"{}\">{v:.1}</text>\n",
            x(v) - 8.0,
            h - b + 15.0
        );
    }
    for (fabric, goal) in GOALS {
        s += &format!(
            "<line x1=\"{0}\" y1=\"{t}\" x2=\"{0}\" y2=\"{1}\" stroke=\"#999\" stroke-dasharray=\"4 3\"/>\n\
             <text x=\"{2}\" y=\"{3}\" fill=\"#999\">{fabric} goal p99 {goal} ms</text>\n",
            x(goal),
            h - b,
            x(goal) + 3.0,
            t + 12.0 + if fabric == "shm" { 0.0 } else { 14.0 }
        );
    }
    let colors = [
        "#1f77b4", "#6baed6", "#c6dbef", "#d62728", "#fc9272", "#fcbba1",
    ];
    let mut idx = 0;
    for (fabric, cases) in runs {
        for c in cases {
            let mut v = c.api.clone();
            v.sort_by(f64::total_cmp);
            let nn = v.len().max(1) as f64;
            let pts: Vec<String> = v
                .iter()
                .enumerate()
                .map(|(i, ms)| format!("{:.1},{:.1}", x(*ms), y((i + 1) as f64 / nn)))
                .collect();
            let color = colors[idx % colors.len()];
            s += &format!(
                "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"/>\n\
                 <text x=\"{}\" y=\"{}\" fill=\"{color}\">{fabric}, {}</text>\n",
                pts.join(" "),
                l + 10.0 + 240.0 * (idx % 3) as f64,
                h - b + 30.0 + 14.0 * (idx / 3) as f64,
                c.name
            );
            idx += 1;
        }
    }
    for (i, note) in notes.iter().enumerate() {
        s += &format!(
            "<text x=\"{l}\" y=\"{}\" font-size=\"11\">{note}</text>\n",
            h - b + 62.0 + 13.0 * i as f64
        );
    }
    s + "</svg>\n"
}

fn main() {
    let quick = std::env::var("LENDVM_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let n: usize = std::env::var("HOTPLUG_N")
        .ok()
        .and_then(|v| v.parse().ok())
        // Quick (CI): enough adds per case for a p50 and a p99 to be printed, not measured.
        .unwrap_or(if quick { 8 } else { 200 });
    let warmup = if quick { 2 } else { 10 };
    let loadavg = || {
        std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|s| s.split_whitespace().next().map(str::to_string))
            .unwrap_or_else(|| "?".into())
    };
    let load_before = loadavg();
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let started = Instant::now();
    let mut runs = Vec::new();
    // HOTPLUG_FABRICS=shm (or tcp) runs one fabric only (profiling).
    let only = std::env::var("HOTPLUG_FABRICS").unwrap_or_default();
    for (fabric, _) in GOALS {
        if only.is_empty() || only.split(',').any(|f| f == fabric) {
            // lendvm closes a lender's link with its last device (`--lender-idle-ms 0`), so
            // every add sets one up; then with a minute's idle time, so that the removed
            // device's session is always still there for the re-add.
            let mut r = run_fabric(fabric, n, warmup, Some(0), &[NEW]);
            r.extend(run_fabric(
                fabric,
                n,
                warmup,
                Some(60_000),
                &[READD, READD_BIG, SHARED],
            ));
            runs.push((fabric, r));
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let load_after = loadavg();

    let mut json_runs = serde_json::Map::new();
    let mut md = String::new();
    let mut goal_lines = Vec::new();
    let mut notes = Vec::new();
    let _ = writeln!(
        md,
        "Hot-add of an emulated `dmatest` device (API call → lender borrow → device on the bus → \
         GED interrupt), the guest halted, n = {n} per case after {warmup} warm-up adds, \
         generated by `cargo bench -p vmm --bench hotplug` in {secs:.1} s{} on {cpus} CPUs with a \
         1-minute load average of {load_before} before and {load_after} after (other work on the \
         host; every figure includes its competition for the CPUs). *New session*: lendvm runs \
         with `--lender-idle-ms 0`, so every add opens a link to the lender (tcp: TLS 1.3), \
         runs AUTH and HELLO: the first device of a lender; *re-add*: `--lender-idle-ms 60000` \
         keeps the session of the removed device open, and the add reuses it; *shared \
         session*: another device of the same lender is attached and the add borrows over its \
         session. Figures in ms.\n",
        if quick { " (quick run)" } else { "" }
    );
    for (fabric, cases) in &runs {
        let goal = GOALS.iter().find(|g| g.0 == *fabric).unwrap().1;
        let fabric_name = if *fabric == "tcp" { "tcp+TLS" } else { "shm" };
        let mut jcases = serde_json::Map::new();
        let _ = writeln!(md, "**{fabric_name}**\n");
        let mut header = String::from("| phase |");
        let mut sep = String::from("|---|");
        for c in cases {
            let _ = write!(header, " {} p50 | p90 | p99 | max |", c.name);
            sep += "---:|---:|---:|---:|";
        }
        let _ = writeln!(md, "{header}\n{sep}");
        let per_case: Vec<Vec<(&str, Vec<f64>)>> = cases.iter().map(CaseResult::phases).collect();
        for name in PHASES.iter().chain(LAST_PHASES.iter()) {
            let mut row = format!("| {name} |");
            let mut any = false;
            for ph in &per_case {
                match ph.iter().find(|p| p.0 == *name) {
                    Some((_, v)) => {
                        any = true;
                        let s = stats(v);
                        let _ = write!(
                            row,
                            " {:.2} | {:.2} | {:.2} | {:.2} |",
                            s.p50, s.p90, s.p99, s.max
                        );
                    }
                    None => row += " – | – | – | – |",
                }
            }
            if any {
                let _ = writeln!(md, "{row}");
            }
        }
        let _ = writeln!(md);
        for (c, ph) in cases.iter().zip(&per_case) {
            let a = stats(&c.api);
            let met = a.p99 <= goal;
            let line = format!(
                "- Goal {fabric_name}, {}: p99 of the API round trip ≤ {goal} ms (n = {}): \
                 **{}** (p99 {:.2} ms, p50 {:.2} ms, max {:.2} ms).",
                c.name,
                a.n,
                if met { "met" } else { "missed" },
                a.p99,
                a.p50,
                a.max
            );
            goal_lines.push(line);
            notes.push(format!(
                "{fabric_name}, {}: p50 {:.2} ms, p90 {:.2}, p99 {:.2}, max {:.2} (n={})",
                c.name, a.p50, a.p90, a.p99, a.max, a.n
            ));
            if c.name == READD_BIG {
                let small = cases
                    .iter()
                    .find(|s| s.name == READD)
                    .map(|s| stats(&s.api));
                if let Some(small) = small {
                    let ratio = a.p99 / small.p99;
                    let met = ratio <= BIG_RATIO;
                    goal_lines.push(format!(
                        "- Goal {fabric_name}: a 64 GiB BAR's re-add p99 within {BIG_RATIO}× \
                         the 1 MiB BAR's: **{}** ({:.2} ms against {:.2} ms, {ratio:.2}×; p50 \
                         {:.2} against {:.2} ms). Resident memory over the {} adds of the 64 \
                         GiB BAR: lendvm {:+} kB, lenderd {:+} kB.",
                        if met { "met" } else { "missed" },
                        a.p99,
                        small.p99,
                        a.p50,
                        small.p50,
                        warmup + a.n,
                        c.rss_growth_kb.0,
                        c.rss_growth_kb.1
                    ));
                    jcases.insert(
                        "large_bar_goal".into(),
                        serde_json::json!({
                            "ratio_p99": ratio,
                            "goal_ratio": BIG_RATIO,
                            "goal_met": met,
                            "rss_growth_kb_lendvm": c.rss_growth_kb.0,
                            "rss_growth_kb_lenderd": c.rss_growth_kb.1,
                        }),
                    );
                }
            }
            let mut jph = serde_json::Map::new();
            for (name, v) in ph {
                jph.insert((*name).to_string(), stats(v).json());
            }
            jcases.insert(
                c.name.to_string(),
                serde_json::json!({
                    "api_add_ms": a.json(),
                    "goal_p99_ms": goal,
                    "goal_met": met,
                    "phases_ms": jph,
                    "api_add_ms_samples": c.api,
                    "slowest": c.slowest(5),
                }),
            );
        }
        json_runs.insert(fabric_name.to_string(), serde_json::Value::Object(jcases));
    }
    let _ = writeln!(md, "{}\n", goal_lines.join("\n"));
    let _ = writeln!(
        md,
        "The five slowest adds per case (their largest VMM-side phases):\n"
    );
    for (fabric, cases) in &runs {
        for c in cases {
            let _ = writeln!(md, "- {fabric}, {}:", c.name);
            for s in c.slowest(5) {
                let _ = writeln!(md, "  - {s}");
            }
        }
    }
    for g in &goal_lines {
        println!("{g}");
    }

    let json = serde_json::json!({
        "bench": "lendvm hot-add",
        "device": "dmatest",
        "n": n,
        "warmup": warmup,
        "quick": quick,
        "seconds": secs,
        "cpus": cpus,
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": load_after,
        "note": "api_add_ms: client round trip of vm.add-remote-device; phases_ms: the VMM's own timings of the same adds (its log lines); the guest is halted; removals are forced",
        "fabrics": json_runs,
    });
    let path = out_path();
    if let Some(p) = path.parent() {
        std::fs::create_dir_all(p).expect("create bench dir");
    }
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).expect("write json");
    let svg_path = path.with_extension("svg");
    std::fs::write(&svg_path, svg(&runs, &notes)).expect("write svg");
    let md_path = path.with_extension("md");
    std::fs::write(&md_path, md).expect("write md");
    println!(
        "wrote {}, {} and {}",
        path.display(),
        svg_path.display(),
        md_path.display()
    );
}
