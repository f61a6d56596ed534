//! The cluster directory: `lendctl list` latency with an etcd directory (one range read)
//! against the static file (one fabric link per lender, in parallel), for 10, 100 and 1000
//! simulated lenders × 8 devices; claim throughput; and the time from a lender's death to
//! `device-lost` at a borrower (bound by the registration TTL).
//!
//! `cargo build --release -p lending --bins && cargo bench -p api --bench directory` writes
//! `target/bench/directory.json` and `directory.svg`. Needs `etcd` (scripts/setup.sh).
//!
//! * Simulated lenders: for etcd, 8 device records + 1 node record each, written under one
//!   lease (what 1000 registrations leave in etcd, without 1000 keep-alive streams); for the
//!   static file, one in-process fake lender per node on the shm fabric that answers HELLO
//!   and LIST with 8 devices (the fabric handshake and the protocol are the real ones).
//! * `lendctl` is the real binary, timed from spawn to exit (process start included, the
//!   same for both); `DIRECTORY_BENCH_REPS` repetitions (default 5), median with min/max.
//! * Bounded for a 2-core machine: `DIRECTORY_BENCH_SIZES` (default `10,100,1000`).
//! * Also writes the Markdown fragment `directory.md` (section `directory` of
//!   `scripts/bench.sh`). `LENDVM_BENCH_QUICK=1`: 10 lenders, 1 repetition, 16 claims, one
//!   lender death (checks that it runs).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lending::directory::etcd::EtcdDirectory;
use lending::directory::testing::EtcdCluster;
use lending::directory::{DeviceRecord, Directory, NodeRecord};
use lending::protocol::{
    self, opcode, DeviceState, DeviceSummary, HelloReply, Request, PROTOCOL_VERSION,
};
use lending::testing::{lenderd_binary, Lenderd};
use ntb::{ClusterConfig, Fabric, FabricError, Incoming, Message, SocketFabric};
use serde_json::json;

const DEVICES: usize = 8;
const TOKEN: &str = "bench-token-8f3a61c2d4b7e9051a6c";

fn env_usize(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn summary(i: usize, state: DeviceState) -> DeviceSummary {
    DeviceSummary {
        id: format!("0000:{:02x}:00.0", 0x80 + i),
        kind: "dmatest".into(),
        vendor_id: 0x1b36,
        device_id: 0x1105,
        class: 0xff0000,
        state,
    }
}

/// Median, min, max of `xs` (ms).
fn stats(mut xs: Vec<f64>) -> (f64, f64, f64) {
    xs.sort_by(f64::total_cmp);
    (xs[xs.len() / 2], xs[0], xs[xs.len() - 1])
}

/// Runs `lendctl --cluster C list --json` and returns (ms, number of devices listed).
fn time_list(cluster: &str) -> (f64, usize) {
    let t0 = Instant::now();
    let o = Command::new(env!("CARGO_BIN_EXE_lendctl"))
        .args(["--cluster", cluster, "--token", TOKEN, "--json", "list"])
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    assert!(
        o.status.success(),
        "lendctl list: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    (ms, v["devices"].as_array().unwrap().len())
}

/// Writes `n` simulated lenders (node + 8 device records) into the directory under one lease.
fn fill_etcd(etcd: &EtcdCluster, n: usize) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        use etcd_client::{PutOptions, Txn, TxnOp};
        let mut c = etcd_client::Client::connect(etcd.endpoints(), None)
            .await
            .unwrap();
        let lease = c.lease_grant(600, None).await.unwrap().id();
        let p = &etcd.prefix;
        let mut ops = Vec::new();
        for k in 0..n {
            let name = format!("sim{k:04}");
            let node = NodeRecord {
                name: name.clone(),
                fabric: "tcp".into(),
                control: format!("10.0.{}.{}:7700", k / 250, k % 250 + 1),
                windows: 8,
                window_align: 4096,
                max_window_size: 1 << 36,
                doorbells: 16,
                scratchpads: 16,
                heartbeat_ms: 250,
                peer_timeout_ms: 1500,
                connect_timeout_ms: 5000,
                require_sealed_windows: true,
            };
            let o = Some(PutOptions::new().with_lease(lease));
            ops.push(TxnOp::put(
                format!("{p}/nodes/{name}"),
                serde_json::to_vec(&node).unwrap(),
                o.clone(),
            ));
            for i in 0..DEVICES {
                let d = DeviceRecord {
                    node: name.clone(),
                    device: summary(i, DeviceState::Available),
                };
                ops.push(TxnOp::put(
                    format!("{p}/devices/{name}/{}", d.device.id),
                    serde_json::to_vec(&d).unwrap(),
                    o.clone(),
                ));
            }
        }
        // etcd allows 128 operations per transaction by default.
        for chunk in ops.chunks(120) {
            c.txn(Txn::new().and_then(chunk.to_vec())).await.unwrap();
        }
    });
}

/// `n` fake lenders on the shm fabric answering HELLO and LIST; stopped on drop.
struct FakeLenders {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    cluster_file: PathBuf,
}

impl FakeLenders {
    fn start(dir: &Path, n: usize) -> FakeLenders {
        let mut src = format!("version = 1\ntoken = \"{TOKEN}\"\n");
        // One doorbell and one scratchpad per link: an shm link passes an eventfd per
        // doorbell and the scratchpad memfd each way, and with the default 16 doorbells
        // 1000 links in parallel took ~35 descriptors each in this process and in lendctl,
        // past a 20000 descriptor limit (some handshakes then failed: "connection
        // closed"). LIST uses neither.
        for k in 0..n {
            src += &format!(
                "[[node]]\nname = \"sim{k:04}\"\nfabric = \"shm\"\ncontrol = \"{}/s{k}.sock\"\n\
                 doorbells = 1\nscratchpads = 1\n",
                dir.display()
            );
        }
        let cluster_file = dir.join(format!("static-{n}.toml"));
        ntb::config::write_private_file(&cluster_file, &src).unwrap();
        let cfg = ClusterConfig::load(&cluster_file).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for k in 0..n {
            let name = format!("sim{k:04}");
            let fabric = SocketFabric::from_cluster(&cfg, &name).unwrap();
            let listener = fabric.listen().unwrap();
            let stop = Arc::clone(&stop);
            threads.push(
                std::thread::Builder::new()
                    .stack_size(256 << 10)
                    .spawn(move || {
                        while !stop.load(Ordering::Relaxed) {
                            let ep = match listener.accept(Some(Duration::from_millis(200))) {
                                Ok(ep) => ep,
                                Err(_) => continue,
                            };
                            serve(&*ep, &name, &stop);
                        }
                    })
                    .unwrap(),
            );
        }
        FakeLenders {
            stop,
            threads,
            cluster_file,
        }
    }
}

/// Answers one lendctl session (HELLO, LIST) until it closes.
fn serve(ep: &dyn ntb::Endpoint, name: &str, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        match ep.recv(Duration::from_millis(200)) {
            Ok(Incoming::Request { id, msg }) if msg.opcode == opcode::AUTH => {
                let _ = ep.reply(id, Ok(Message::raw(msg.opcode, auth_reply(ep, name, &msg))));
            }
            Ok(Incoming::Request { id, msg }) => {
                let reply = match Request::decode(msg.opcode, &msg.payload) {
                    Ok(Request::Hello(_)) => protocol::encode_reply(
                        opcode::HELLO,
                        &HelloReply {
                            version: PROTOCOL_VERSION,
                            node: name.to_string(),
                            max_bar_access: 4096,
                            max_dma_maps: 64,
                        },
                    ),
                    Ok(Request::List) => protocol::encode_reply(
                        opcode::LIST,
                        &(0..DEVICES)
                            .map(|i| summary(i, DeviceState::Available))
                            .collect::<Vec<_>>(),
                    ),
                    _ => Ok(Vec::new()),
                };
                let _ = ep.reply(id, Ok(Message::raw(msg.opcode, reply.unwrap())));
            }
            Ok(_) | Err(FabricError::Timeout(_)) => {}
            Err(_) => return,
        }
    }
}

/// The lender's side of the AUTH challenge-response (as lenderd answers it), so `lendctl`
/// accepts the fake lender: our nonce and our proof of the cluster token.
fn auth_reply(ep: &dyn ntb::Endpoint, name: &str, msg: &Message) -> Vec<u8> {
    use lending::auth::{self, Role, Transcript};
    use lending::protocol::{AuthChallenge, AuthResponse};
    let c: AuthChallenge = protocol::decode_reply(opcode::AUTH, &msg.payload).unwrap();
    let nonce = auth::nonce().unwrap();
    let borrower = ep.peer_node().to_string();
    let binding = ep.channel_binding();
    let t = Transcript {
        borrower_nonce: &c.nonce,
        lender_nonce: &nonce,
        borrower: &borrower,
        lender: name,
        binding: &binding,
    };
    let proof = t.prove(TOKEN, Role::Lender).unwrap();
    protocol::encode_reply(
        opcode::AUTH,
        &AuthResponse {
            node: name.to_string(),
            nonce: nonce.to_vec(),
            proof: proof.to_vec(),
        },
    )
    .unwrap()
}

impl Drop for FakeLenders {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn bar_svg(
    rows: &[(usize, f64, Option<f64>)],
    claim: &serde_json::Value,
    death: &serde_json::Value,
) -> String {
    let (w, h, l, t, b) = (720.0, 420.0, 70.0, 50.0, 70.0);
    let ymax = rows
        .iter()
        .flat_map(|r| [r.1, r.2.unwrap_or(0.0)])
        .fold(1.0f64, f64::max);
    let ly = |v: f64| (v.max(1.0)).log10() / ymax.log10().max(1.0);
    let y = |v: f64| h - b - (h - t - b) * ly(v);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{l}\" y=\"22\" font-size=\"15\">lendctl list latency (ms, log scale): etcd directory vs static-file fan-out</text>\n<text x=\"{l}\" y=\"40\" font-size=\"11\">claims: {} /s sequential; lender death to device-lost: median {} ms (ttl {} s)</text>\n",
        claim["sequential_per_s"], death["median_ms"], death["ttl_s"]
    );
    s += &format!(
        "<line x1=\"{l}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n",
        h - b,
        w - 20.0,
        h - b
    );
    let gw = (w - l - 40.0) / rows.len() as f64;
    for (i, (n, e, st)) in rows.iter().enumerate() {
        let x0 = l + 20.0 + gw * i as f64;
        for (j, (v, color, label)) in [(Some(*e), "#3a7", "etcd"), (*st, "#c63", "static")]
            .iter()
            .enumerate()
        {
            let x = x0 + j as f64 * (gw * 0.35);
            match v {
                Some(v) => {
                    s += &format!(
                        "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{color}\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"10\">{v:.0}</text>\n",
                        y(*v),
                        gw * 0.3,
                        h - b - y(*v),
                        x + gw * 0.15,
                        y(*v) - 4.0
                    );
                }
                None => {
                    s += &format!(
                        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"10\">n/a</text>\n",
                        x + gw * 0.15,
                        h - b - 4.0
                    );
                }
            }
            s += &format!(
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"10\">{label}</text>\n",
                x + gw * 0.15,
                h - b + 14.0
            );
        }
        s += &format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{n} lenders × {DEVICES}</text>\n",
            x0 + gw * 0.32,
            h - b + 34.0
        );
    }
    s += "</svg>\n";
    s
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let quick = std::env::var("LENDVM_BENCH_QUICK").is_ok_and(|v| v == "1");
    let reps = env_usize("DIRECTORY_BENCH_REPS", if quick { 1 } else { 5 }).max(1);
    let sizes: Vec<usize> = std::env::var("DIRECTORY_BENCH_SIZES")
        .unwrap_or_else(|_| if quick { "10" } else { "10,100,1000" }.into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let out = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("target"))
        .join("bench/directory.json");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();

    // 1. lendctl list latency.
    let mut list_rows = Vec::new();
    let mut chart = Vec::new();
    for &n in &sizes {
        let etcd = EtcdCluster::single();
        fill_etcd(&etcd, n);
        // The prefix of the test cluster is not the default: a file names it.
        let f = dir.path().join(format!("etcd-{n}.toml"));
        std::fs::write(
            &f,
            format!(
                "version = 1\n[directory]\netcd = [\"{}\"]\nprefix = \"{}\"\n",
                etcd.endpoints()[0],
                etcd.prefix
            ),
        )
        .unwrap();
        let mut e = Vec::new();
        for _ in 0..reps {
            let (ms, got) = time_list(f.to_str().unwrap());
            assert_eq!(got, n * DEVICES);
            e.push(ms);
        }
        let (em, emin, emax) = stats(e);
        drop(etcd);
        let fakes = FakeLenders::start(dir.path(), n);
        let mut st = Vec::new();
        let static_reps = if n >= 1000 { reps.min(3) } else { reps };
        for _ in 0..static_reps {
            let (ms, got) = time_list(fakes.cluster_file.to_str().unwrap());
            assert_eq!(got, n * DEVICES);
            st.push(ms);
        }
        drop(fakes);
        let (sm, smin, smax) = stats(st);
        eprintln!(
            "list {n:>5} lenders: etcd {em:8.1} ms ({emin:.1}..{emax:.1}), static {sm:8.1} ms ({smin:.1}..{smax:.1})"
        );
        chart.push((n, em, Some(sm)));
        list_rows.push(json!({
            "lenders": n, "devices": n * DEVICES,
            "etcd_ms": {"median": em, "min": emin, "max": emax, "reps": reps},
            "static_ms": {"median": sm, "min": smin, "max": smax, "reps": static_reps},
        }));
    }

    // 2. Claim throughput: one lender's worth of device records per claim target.
    let etcd = EtcdCluster::single();
    let claims_n = env_usize("DIRECTORY_BENCH_CLAIMS", if quick { 16 } else { 200 });
    fill_etcd(&etcd, claims_n.div_ceil(DEVICES));
    let cfg = etcd.config(Duration::from_secs(5));
    let d = EtcdDirectory::connect(&cfg, Some(TOKEN)).unwrap();
    let targets: Vec<(String, String)> = (0..claims_n)
        .map(|k| {
            (
                format!("sim{:04}", k / DEVICES),
                summary(k % DEVICES, DeviceState::Available).id,
            )
        })
        .collect();
    let t0 = Instant::now();
    let mut held = Vec::new();
    for (node, bdf) in &targets {
        held.push(d.claim(node, bdf, "bench", "vm0").unwrap());
    }
    let seq = t0.elapsed().as_secs_f64();
    drop(held);
    // The same claims again by 4 borrowers at once (each its own connection).
    let threads = 4;
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for tnum in 0..threads {
            let (cfg, targets) = (&cfg, &targets);
            s.spawn(move || {
                let d = EtcdDirectory::connect(cfg, Some(TOKEN)).unwrap();
                let mut held = Vec::new();
                for (node, bdf) in targets.iter().skip(tnum).step_by(threads) {
                    // A released claim may still be there for a moment (revoke in flight).
                    let t = Instant::now();
                    loop {
                        match d.claim(node, bdf, &format!("b{tnum}"), "vm0") {
                            Ok(c) => break held.push(c),
                            Err(_) if t.elapsed() < Duration::from_secs(5) => {
                                std::thread::sleep(Duration::from_millis(5))
                            }
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
            });
        }
    });
    let par = t0.elapsed().as_secs_f64();
    drop(d);
    drop(etcd);
    let claim = json!({
        "claims": claims_n,
        "sequential_s": seq, "sequential_per_s": (claims_n as f64 / seq).round(),
        "parallel_threads": threads, "parallel_s": par,
        "parallel_per_s": (claims_n as f64 / par).round(),
    });
    eprintln!("claims: {claim}");

    // 3. Lender death → device-lost at a borrower (TTL-bound).
    let ttl = Duration::from_secs(2);
    let mut lost_ms = Vec::new();
    let etcd = EtcdCluster::single();
    let cfg = etcd.config(ttl);
    let f = dir.path().join("death.toml");
    ntb::config::write_private_file(
        &f,
        &format!(
            "version = 1\ntoken = \"{TOKEN}\"\n[directory]\netcd = [\"{}\"]\nprefix = \"{}\"\nlease_ttl_s = {}\n",
            cfg.etcd[0],
            cfg.prefix,
            ttl.as_secs()
        ),
    )
    .unwrap();
    let b = EtcdDirectory::connect(&cfg, Some(TOKEN)).unwrap();
    for round in 0..env_usize("DIRECTORY_BENCH_DEATHS", if quick { 1 } else { 3 }).max(1) {
        let sock = dir.path().join(format!("death{round}.sock"));
        let mut l = Lenderd::command(lenderd_binary(), "victim", &f)
            .log(dir.path().join(format!("death{round}.log")))
            .arg("--control")
            .arg(&sock)
            .device("0000:00:04.0=dmatest")
            .spawn_until_listening(&sock);
        let t = Instant::now();
        while b.lender("victim").is_err() {
            assert!(t.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(20));
        }
        let claim = b.claim("victim", "0000:00:04.0", "bench", "vm0").unwrap();
        l.kill();
        let t0 = Instant::now();
        while claim.lost().is_none() {
            assert!(t0.elapsed() < Duration::from_secs(20), "never lost");
            std::thread::sleep(Duration::from_millis(5));
        }
        lost_ms.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    let (dm, dmin, dmax) = stats(lost_ms.clone());
    let death = json!({"ttl_s": ttl.as_secs(), "median_ms": dm.round(), "min_ms": dmin.round(), "max_ms": dmax.round(), "samples_ms": lost_ms});
    eprintln!("lender death to device-lost: {death}");
    drop(b);
    drop(etcd);

    let doc = json!({
        "bench": "directory",
        "devices_per_lender": DEVICES,
        "list": list_rows,
        "claim_throughput": claim,
        "lender_death_to_device_lost": death,
        "cpus": std::thread::available_parallelism().map_or(1, |n| n.get()),
    });
    std::fs::write(&out, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    std::fs::write(out.with_extension("svg"), bar_svg(&chart, &claim, &death)).unwrap();
    std::fs::write(out.with_file_name("directory.md"), markdown(&doc)).unwrap();
    eprintln!(
        "wrote {} and {}",
        out.display(),
        out.with_extension("svg").display()
    );
}

/// The fragment for docs/BENCHMARKS.md, from this run's JSON.
fn markdown(doc: &serde_json::Value) -> String {
    use std::fmt::Write as _;
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
    let mut md = String::from(
        "`lendctl list --json` (the real binary, spawn to exit) against one etcd member on loopback (one range read) and against the static file (one fabric link per lender, in parallel); median (min..max).\n\n| lenders × 8 devices | etcd directory | static-file fan-out | static / etcd |\n|---|---|---|---|\n",
    );
    for r in doc["list"].as_array().into_iter().flatten() {
        let (e, s) = (&r["etcd_ms"], &r["static_ms"]);
        let _ = writeln!(
            md,
            "| {} ({} devices) | {:.1} ms ({:.1}..{:.1}, n={}) | {:.1} ms ({:.1}..{:.1}, n={}) | {:.1}× |",
            r["lenders"],
            r["devices"],
            f(&e["median"]),
            f(&e["min"]),
            f(&e["max"]),
            e["reps"],
            f(&s["median"]),
            f(&s["min"]),
            f(&s["max"]),
            s["reps"],
            f(&s["median"]) / f(&e["median"])
        );
    }
    let c = &doc["claim_throughput"];
    let _ = writeln!(
        md,
        "\n| claims (create-if-absent txn + lease grant + keep-alive + watches) | |\n|---|---|\n| {} sequential, one borrower | {:.2} s = **{} claims/s** |\n| {} by {} borrowers at once | {:.2} s = **{} claims/s** |",
        c["claims"],
        f(&c["sequential_s"]),
        c["sequential_per_s"],
        c["claims"],
        c["parallel_threads"],
        f(&c["parallel_s"]),
        c["parallel_per_s"]
    );
    let d = &doc["lender_death_to_device_lost"];
    let n = d["samples_ms"].as_array().map_or(0, Vec::len);
    let _ = writeln!(
        md,
        "\n| lender SIGKILLed → `device-lost` at a borrower's claim watch (TTL {} s) | |\n|---|---|\n| median of {n} | **{} ms** ({}..{}) |",
        d["ttl_s"], d["median_ms"], d["min_ms"], d["max_ms"]
    );
    let ttl_ms = f(&d["ttl_s"]) * 1e3;
    let worst = f(&d["max_ms"]);
    let _ = writeln!(
        md,
        "\n- Expected bound for device loss: between the TTL and TTL + ~0.7 s (etcd's 500 ms expiry check and the keep-alive phase): {} (max {worst:.0} ms, bound {:.0} ms).",
        if worst <= ttl_ms + 700.0 { "**met**" } else { "**missed**" },
        ttl_ms + 700.0
    );
    md
}
