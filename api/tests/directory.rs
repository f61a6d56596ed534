//! The etcd cluster directory end to end: real `etcd` members started by the tests on
//! loopback (free ports, temporary data dirs, killed by pid on drop), the real `lenderd`
//! registering in them, `lendctl list|lenders|watch` reading them, borrowers claiming devices
//! through `lending::directory` and borrowing with the claim as fencing token.
//!
//! Needs `etcd` (Debian's etcd-server; scripts/setup.sh installs it) and lenderd built
//! (`cargo build --workspace --bins`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use lending::client::{ClientError, LenderClient};
use lending::directory::etcd::EtcdDirectory;
use lending::directory::testing::EtcdCluster;
use lending::directory::{cluster_of, ClaimHandle, Directory, DirectoryError};
use lending::protocol::{code, Event};
use lending::testing::{lenderd_binary, Lenderd};
use ntb::{DirectoryConfig, NodeId};
use serde_json::Value;

const TOKEN: &str = "directory-test-token-8f3a61c2d4b7e9051a6c";
/// Short leases so expiry tests take seconds (etcd's minimum is about 1.5 s).
const TTL: Duration = Duration::from_secs(2);
/// Slack on top of a TTL for expiry to be noticed (etcd checks expiry every 500 ms; the
/// lease may have just been renewed, and the watchers and pollers add their period).
const SLACK: Duration = Duration::from_secs(3);

fn dev(i: usize) -> String {
    format!("0000:00:{:02x}.0", 4 + i)
}

/// A temp dir with a cluster file whose `[directory]` table points at `etcd`.
struct Site {
    dir: tempfile::TempDir,
    path: PathBuf,
    cfg: DirectoryConfig,
}

fn site(etcd: &EtcdCluster) -> Site {
    site_with_ttl(etcd, TTL)
}

/// [`site`] with lease TTL `ttl`.
fn site_with_ttl(etcd: &EtcdCluster, ttl: Duration) -> Site {
    let dir = tempfile::tempdir().unwrap();
    let cfg = etcd.config(ttl);
    let eps: Vec<String> = cfg.etcd.iter().map(|e| format!("\"{e}\"")).collect();
    let src = format!(
        "version = 1\ntoken = \"{TOKEN}\"\n[directory]\netcd = [{}]\nprefix = \"{}\"\n\
         lease_ttl_s = {}\n",
        eps.join(", "),
        cfg.prefix,
        ttl.as_secs()
    );
    let path = dir.path().join("cluster.toml");
    ntb::config::write_private_file(&path, &format!("{src}{}", security_keys(&cfg))).unwrap();
    Site { dir, path, cfg }
}

/// The `[directory]` keys for the TLS files and etcd user of `cfg`.
fn security_keys(cfg: &DirectoryConfig) -> String {
    let mut keys = String::new();
    for (k, v) in [
        ("ca", &cfg.ca),
        ("cert", &cfg.cert),
        ("key", &cfg.key),
        ("password_file", &cfg.password_file),
    ] {
        if let Some(p) = v {
            keys.push_str(&format!("{k} = \"{}\"\n", p.display()));
        }
    }
    if let Some(u) = &cfg.user {
        keys.push_str(&format!("user = \"{u}\"\n"));
    }
    keys
}

/// lenderd `node` registered in the site's directory with `n` dmatest devices.
fn lenderd(s: &Site, node: &str, n: usize) -> Lenderd {
    let sock = s.dir.path().join(format!("{node}.sock"));
    let mut cmd = Lenderd::command(lenderd_binary(), node, &s.path)
        .log(s.dir.path().join(format!("{node}.log")))
        .arg("--control")
        .arg(&sock)
        .env_remove("LENDVM_TOKEN");
    for i in 0..n {
        cmd = cmd.device(format!("{}=dmatest", dev(i)));
    }
    let d = cmd.spawn_until_listening(&sock);
    // Listening comes just before the registration: wait for the node record.
    let dir = EtcdDirectory::connect(&s.cfg, Some(TOKEN)).unwrap();
    wait_for(
        &format!("{node} registered"),
        Duration::from_secs(10),
        || dir.lender(node).is_ok(),
    );
    d
}

/// Polls `f` every 50 ms until true; panics after `timeout`.
fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    loop {
        if f() {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < timeout, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn lendctl(s: &Site, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lendctl"))
        .arg("--cluster")
        .arg(&s.path)
        .args(args)
        .env("RUST_LOG", "off")
        .env_remove("LENDVM_TOKEN")
        .output()
        .unwrap()
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn listed(s: &Site) -> Vec<Value> {
    let v: Value = serde_json::from_str(&ok(&lendctl(s, &["--json", "list"]))).unwrap();
    v["devices"].as_array().unwrap().clone()
}

/// A borrower: its own directory connection and fabric name.
struct Borrower {
    dir: EtcdDirectory,
    name: String,
}

impl Borrower {
    fn new(s: &Site, name: &str) -> Self {
        Borrower {
            dir: EtcdDirectory::connect(&s.cfg, Some(TOKEN)).unwrap(),
            name: name.into(),
        }
    }

    fn connect(&self, lender: &str) -> LenderClient {
        let node = self.dir.lender(lender).unwrap();
        let cluster = cluster_of(node.clone());
        LenderClient::connect_node(
            &cluster,
            &node,
            &NodeId::new(&self.name).unwrap(),
            Duration::from_secs(5),
            TOKEN,
            "directory-test",
        )
        .unwrap()
    }
}

fn remote_code(e: &ClientError) -> Option<u32> {
    match e {
        ClientError::Remote { code, .. } => Some(*code),
        _ => None,
    }
}

#[test]
fn lender_registers_is_listed_and_vanishes_within_its_ttl_after_sigkill() {
    let etcd = EtcdCluster::single();
    let s = site(&etcd);
    let mut d = lenderd(&s, "node3", 2);
    let devs = listed(&s);
    assert_eq!(devs.len(), 2, "{devs:?}");
    assert!(devs
        .iter()
        .all(|d| d["node"] == "node3" && d["state"] == "available" && d["kind"] == "dmatest"));
    let t = ok(&lendctl(&s, &["lenders"]));
    let row = t.lines().find(|l| l.starts_with("node3")).unwrap();
    assert!(
        row.contains("shm") && row.contains("node3.sock") && row.contains(" 2 "),
        "{t}"
    );
    // Diagnosis still goes to the lender itself, its address taken from the directory.
    let t = ok(&lendctl(&s, &["--lender", "node3", "status"]));
    assert!(t.starts_with("lender node3: up"), "{t}");

    d.kill();
    // SIGKILL revokes nothing: the records stay until the lease expires...
    assert_eq!(
        listed(&s).len(),
        2,
        "records vanished before the ttl ran out"
    );
    // ...and then go, within the TTL (plus the expiry check's slack).
    wait_for("records expire", TTL + SLACK, || listed(&s).is_empty());
    let t = ok(&lendctl(&s, &["list"]));
    assert_eq!(t.trim(), "no devices");
}

#[test]
fn a_clean_stop_revokes_the_registration_at_once() {
    let etcd = EtcdCluster::single();
    let s = site(&etcd);
    let mut d = lenderd(&s, "node3", 1);
    assert_eq!(listed(&s).len(), 1);
    // SAFETY: plain kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(d.child.id() as i32, libc::SIGTERM) }, 0);
    let st = d.child.wait().unwrap();
    assert!(st.success(), "lenderd exit {st}: {}", d.log());
    // No waiting: the revoke deleted the records before lenderd exited.
    assert!(listed(&s).is_empty(), "{}", d.log());
    assert!(d.log().contains("left the directory"), "{}", d.log());
}

#[test]
fn twenty_borrowers_race_for_five_devices_and_exactly_five_win() {
    let etcd = EtcdCluster::single();
    let s = site(&etcd);
    let _d = lenderd(&s, "node3", 5);
    let start = Arc::new(Barrier::new(20));
    type Won = (
        String,
        String,
        Box<dyn ClaimHandle>,
        LenderClient,
        lending::client::Lease,
    );
    let results: Vec<(String, Option<Won>, Vec<String>)> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..20)
            .map(|i| {
                let start = Arc::clone(&start);
                let s = &s;
                sc.spawn(move || {
                    let b = Borrower::new(s, &format!("b{i:02}"));
                    let client = b.connect("node3");
                    let mut refusals = Vec::new();
                    start.wait();
                    // Every borrower tries the devices in its own order until one claim wins.
                    for k in 0..5 {
                        let bdf = dev((i + k) % 5);
                        match b.dir.claim("node3", &bdf, &b.name, "vm0") {
                            Ok(claim) => {
                                let lease = client
                                    .borrow_claimed(&bdf, "vm0", claim.revision().unwrap())
                                    .unwrap_or_else(|e| panic!("{}: borrow {bdf}: {e}", b.name));
                                return (
                                    b.name.clone(),
                                    Some((b.name.clone(), bdf, claim, client, lease)),
                                    refusals,
                                );
                            }
                            Err(e @ DirectoryError::Claimed { .. }) => refusals.push(e.to_string()),
                            Err(e) => panic!("{}: claim {bdf}: {e}", b.name),
                        }
                    }
                    (b.name.clone(), None, refusals)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let winners: Vec<&Won> = results.iter().filter_map(|(_, w, _)| w.as_ref()).collect();
    assert_eq!(winners.len(), 5, "exactly five claims win");
    let devices: HashSet<&str> = winners.iter().map(|w| w.1.as_str()).collect();
    assert_eq!(devices.len(), 5, "no device is claimed twice");
    for (name, won, refusals) in &results {
        if won.is_none() {
            assert_eq!(
                refusals.len(),
                5,
                "{name} was refused every device: {refusals:?}"
            );
        }
    }
    // The directory and the lender agree on who holds what: lent once, to the winner.
    let holder: HashMap<String, String> =
        winners.iter().map(|w| (w.1.clone(), w.0.clone())).collect();
    wait_for("device states published", Duration::from_secs(5), || {
        listed(&s).iter().all(|r| r["state"] == "lent")
    });
    let rows = listed(&s);
    assert_eq!(rows.len(), 5);
    for r in &rows {
        let bdf = r["bdf"].as_str().unwrap();
        assert_eq!(r["claim"]["node"], holder[bdf].as_str(), "{r}");
    }
    let st = winners[0].3.status().unwrap();
    for d in &st.devices {
        match &d.summary.state {
            lending::protocol::DeviceState::Lent { node, .. } => {
                assert_eq!(node, &holder[&d.summary.id])
            }
            other => panic!("{} is {other}", d.summary.id),
        }
        assert_eq!(d.leases_granted, 1, "{} lent more than once", d.summary.id);
    }
    // A borrow without a claim is refused; so is one with someone else's claim.
    let loser = results.iter().find(|r| r.1.is_none()).unwrap();
    let b = Borrower::new(&s, &loser.0);
    let c = b.connect("node3");
    let e = c.borrow(&dev(0), "vm0").err().unwrap();
    assert_eq!(remote_code(&e), Some(code::CLAIM_REQUIRED), "{e}");
    let w = winners.iter().find(|w| w.1 == dev(0)).unwrap();
    let e = c
        .borrow_claimed(&dev(0), "vm0", w.2.revision().unwrap())
        .err()
        .unwrap();
    assert_eq!(remote_code(&e), Some(code::STALE_CLAIM), "{e}");
    assert!(e.to_string().contains("belongs to"), "{e}");
}

/// Revokes the etcd lease behind `key` as its expiry would (etcd deletes the keys of a lease
/// the same way on expiry and on revoke).
fn expire_lease_of(cfg: &DirectoryConfig, key: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = etcd_client::Client::connect(cfg.etcd.clone(), None)
            .await
            .unwrap();
        let r = c.get(key, None).await.unwrap();
        let lease = r
            .kvs()
            .first()
            .unwrap_or_else(|| panic!("no {key}"))
            .lease();
        assert_ne!(lease, 0, "{key} has no lease");
        c.lease_revoke(lease).await.unwrap();
    });
}

/// Waits (bounded) for a DeviceGone event of `lease` on `client`.
fn wait_device_gone(client: &LenderClient, lease: u64, timeout: Duration) -> String {
    let t0 = Instant::now();
    while t0.elapsed() < timeout {
        if let Some(Event::DeviceGone(g)) = client.next_event(Duration::from_millis(200)).unwrap() {
            if g.lease == lease {
                return g.reason;
            }
        }
    }
    panic!("no device-gone for lease {lease} within {timeout:?}");
}

#[test]
fn an_expired_claim_is_refused_by_the_lender_and_its_lease_ends() {
    let etcd = EtcdCluster::single();
    let s = site(&etcd);
    let _d = lenderd(&s, "node3", 1);
    let a = Borrower::new(&s, "vmm-a");
    let ca = a.connect("node3");
    let claim = a.dir.claim("node3", &dev(0), "vmm-a", "vm0").unwrap();
    let rev = claim.revision().unwrap();
    let lease = ca.borrow_claimed(&dev(0), "vm0", rev).unwrap();
    assert_eq!(lease.config_read(0, 4).unwrap().len(), 4);

    // A's claim expires (as if vmm-a were cut off from etcd while its fabric link works).
    expire_lease_of(&s.cfg, &format!("{}/claims/node3/{}", s.cfg.prefix, dev(0)));
    // The lender fences: it ends the lease and tells the borrower.
    let why = wait_device_gone(&ca, lease.id(), Duration::from_secs(5));
    assert!(why.contains("no longer current"), "{why}");
    assert!(
        lease.config_read(0, 4).is_err(),
        "the ended lease still works"
    );
    // The borrower's claim handle says so too (what lendvm's lease check reads).
    wait_for("claim lost", Duration::from_secs(5), || {
        claim.lost().is_some()
    });
    // Presenting the expired claim again is refused.
    let e = ca.borrow_claimed(&dev(0), "vm0", rev).err().unwrap();
    assert_eq!(remote_code(&e), Some(code::STALE_CLAIM), "{e}");
    assert!(e.to_string().contains("no current claim"), "{e}");
    // Someone else claims it now and borrows it; A's old token stays refused.
    let b = Borrower::new(&s, "vmm-b");
    let cb = b.connect("node3");
    let claim_b = b.dir.claim("node3", &dev(0), "vmm-b", "vm1").unwrap();
    assert!(claim_b.revision().unwrap() > rev);
    let _lb = cb
        .borrow_claimed(&dev(0), "vm1", claim_b.revision().unwrap())
        .unwrap();
    let e = ca.borrow_claimed(&dev(0), "vm0", rev).err().unwrap();
    assert_eq!(remote_code(&e), Some(code::STALE_CLAIM), "{e}");
    assert!(e.to_string().contains("stale claim"), "{e}");
    drop(claim);
}

#[test]
fn a_borrower_sees_the_device_vanish_when_its_lender_dies() {
    let etcd = EtcdCluster::single();
    let s = site(&etcd);
    let mut d = lenderd(&s, "node3", 1);
    let a = Borrower::new(&s, "vmm-a");
    let claim = a.dir.claim("node3", &dev(0), "vmm-a", "vm0").unwrap();
    assert!(claim.lost().is_none());
    d.kill();
    wait_for("device lost", TTL + SLACK, || claim.lost().is_some());
    let why = claim.lost().unwrap();
    assert!(why.contains("left the directory"), "{why}");
    // Once A lets go, a claim on a device whose lender is gone is refused.
    drop(claim);
    let b = Borrower::new(&s, "vmm-b");
    match b.dir.claim("node3", &dev(0), "vmm-b", "vm0") {
        Err(DirectoryError::UnknownLender { .. }) => {}
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("claimed a device of a dead lender"),
    }
}

#[test]
fn watch_streams_registrations_claims_and_departures() {
    let etcd = EtcdCluster::single();
    let s = site(&etcd);
    let mut w = Command::new(env!("CARGO_BIN_EXE_lendctl"))
        .arg("--cluster")
        .arg(&s.path)
        .args(["--json", "watch", "--count", "6", "--seconds", "30"])
        .env("RUST_LOG", "off")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Let the watch start before the changes (it watches from "now").
    std::thread::sleep(Duration::from_millis(500));
    let d = lenderd(&s, "node3", 1);
    let a = Borrower::new(&s, "vmm-a");
    let claim = a.dir.claim("node3", &dev(0), "vmm-a", "vm0").unwrap();
    drop(claim);
    drop(d);
    let out = w.wait_with_output_bounded();
    let events: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert_eq!(kinds.len(), 6, "{out}");
    // Records written in one transaction (and deleted by one revoke) come in any order.
    let mut up = kinds[..2].to_vec();
    up.sort_unstable();
    assert_eq!(up, ["device", "node-up"], "{out}");
    assert_eq!(kinds[2..4], ["claimed", "released"], "{out}");
    let mut gone = kinds[4..].to_vec();
    gone.sort_unstable();
    assert_eq!(gone, ["device-gone", "node-gone"], "{out}");
    assert_eq!(events[2]["claim"]["holder"], "vmm-a");
}

trait BoundedWait {
    fn wait_with_output_bounded(&mut self) -> String;
}

impl BoundedWait for std::process::Child {
    /// stdout of a child that exits by itself within 40 s (killed and failed otherwise).
    fn wait_with_output_bounded(&mut self) -> String {
        let t0 = Instant::now();
        while self.try_wait().unwrap().is_none() {
            if t0.elapsed() > Duration::from_secs(40) {
                let _ = self.kill();
                panic!("lendctl watch did not stop");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut s = String::new();
        use std::io::Read;
        self.stdout.take().unwrap().read_to_string(&mut s).unwrap();
        s
    }
}

#[test]
fn a_borrower_keeps_its_device_through_an_etcd_leader_change() {
    let etcd = EtcdCluster::start(3);
    // A TTL sized to the members' election timeout (1 s): an election, with both cores
    // busy, must fit in it several times over (2 s left the keep-alive almost no slack).
    let ttl = Duration::from_secs(4);
    let s = site_with_ttl(&etcd, ttl);
    let _d = lenderd(&s, "node3", 2);
    let a = Borrower::new(&s, "vmm-a");
    let ca = a.connect("node3");
    let claim = a.dir.claim("node3", &dev(0), "vmm-a", "vm0").unwrap();
    let rev = claim.revision().unwrap();
    let lease = ca.borrow_claimed(&dev(0), "vm0", rev).unwrap();

    let mut etcd = etcd;
    let old = etcd.wait_leader(Duration::from_secs(10));
    etcd.members[old].kill();
    let new = etcd.wait_leader(Duration::from_secs(20));
    assert_ne!(old, new);
    // For two TTLs after the change: the device keeps working, nobody reports it lost,
    // and the directory still shows the lender and the same claim.
    let t0 = Instant::now();
    while t0.elapsed() < 2 * ttl {
        assert!(claim.lost().is_none(), "claim lost: {:?}", claim.lost());
        assert_eq!(lease.config_read(0, 4).unwrap().len(), 4);
        if let Some(Event::DeviceGone(g)) = ca.next_event(Duration::from_millis(100)).unwrap() {
            panic!("the lender ended the lease: {}", g.reason);
        }
    }
    let snap = a.dir.snapshot().unwrap();
    assert_eq!(snap.nodes.len(), 1);
    assert_eq!(snap.claim("node3", &dev(0)).unwrap().revision, rev);
    // And the directory still takes new claims.
    let other = a.dir.claim("node3", &dev(1), "vmm-a", "vm1").unwrap();
    let _l2 = ca
        .borrow_claimed(&dev(1), "vm1", other.revision().unwrap())
        .unwrap();
}

#[test]
fn etcd_unavailable_is_a_clear_error() {
    let mut etcd = EtcdCluster::single();
    let s = site(&etcd);
    let ep = etcd.members[0].endpoint();
    etcd.members[0].kill();
    let o = lendctl(&s, &["list"]);
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("directory") && e.contains(&ep), "{e}");
    // lenderd refuses to start rather than lend outside the directory.
    let st = Command::new(lenderd_binary())
        .args(["--node", "node3", "--cluster"])
        .arg(&s.path)
        .arg("--control")
        .arg(s.dir.path().join("node3.sock"))
        .args(["--device", "0000:00:04.0=dmatest"])
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    assert!(!st.status.success());
    assert!(String::from_utf8_lossy(&st.stderr).contains("directory"));
}

#[test]
fn an_etcd_outage_keeps_running_leases_and_refuses_new_borrows() {
    let mut etcd = EtcdCluster::single();
    let s = site(&etcd);
    let d = lenderd(&s, "node3", 2);
    let a = Borrower::new(&s, "vmm-a");
    let ca = a.connect("node3");
    let claim = a.dir.claim("node3", &dev(0), "vmm-a", "vm0").unwrap();
    let lease = ca
        .borrow_claimed(&dev(0), "vm0", claim.revision().unwrap())
        .unwrap();
    etcd.members[0].kill();
    // Nobody can renew anything, but no claim can expire without an etcd leader either:
    // the running lease goes on, for well over a TTL.
    let t0 = Instant::now();
    while t0.elapsed() < TTL + SLACK {
        assert_eq!(lease.config_read(0, 4).unwrap().len(), 4);
        if let Some(Event::DeviceGone(g)) = ca.next_event(Duration::from_millis(100)).unwrap() {
            panic!("the lender ended the lease: {}", g.reason);
        }
        assert!(claim.lost().is_none(), "{:?}", claim.lost());
    }
    assert!(d.log().contains("registration not in force"), "{}", d.log());
    // New borrows need a claim the lender can check: refused with the reason.
    let e = ca.borrow_claimed(&dev(1), "vm0", 1_000).err().unwrap();
    assert_eq!(remote_code(&e), Some(code::STALE_CLAIM), "{e}");
    assert!(e.to_string().contains("cannot check the claim"), "{e}");
    match a.dir.claim("node3", &dev(1), "vmm-a", "vm1") {
        Err(e) => assert!(e.to_string().contains("etcd"), "{e}"),
        Ok(_) => panic!("claimed without etcd"),
    }
}

/// A TCP proxy in front of one etcd member that the test can cut and restore: the lender's
/// only way to etcd, while its fabric link to the borrower keeps working.
struct Proxy {
    port: u16,
    cut: Arc<std::sync::atomic::AtomicBool>,
    conns: Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    fn start(target: String) -> Proxy {
        use std::sync::atomic::{AtomicBool, Ordering};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let port = l.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (c2, s2, k2) = (cut.clone(), stop.clone(), conns.clone());
        std::thread::spawn(move || {
            while !s2.load(Ordering::SeqCst) {
                let Ok((a, _)) = l.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                if c2.load(Ordering::SeqCst) {
                    drop(a);
                    continue;
                }
                a.set_nonblocking(false).unwrap();
                let Ok(b) = std::net::TcpStream::connect(&target) else {
                    continue;
                };
                let mut k = k2.lock().unwrap();
                k.push(a.try_clone().unwrap());
                k.push(b.try_clone().unwrap());
                for (mut from, mut to) in [(a.try_clone().unwrap(), b.try_clone().unwrap()), (b, a)]
                {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Proxy {
            port,
            cut,
            conns,
            stop,
        }
    }

    fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Drops every connection and refuses new ones.
    fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }

    fn restore(&self) {
        self.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn a_lender_cut_off_from_etcd_leaves_the_directory_although_its_fabric_works() {
    let etcd = EtcdCluster::single();
    let s = site(&etcd);
    // The lender reaches etcd only through the proxy; the borrower directly.
    let proxy = Proxy::start(etcd.members[0].endpoint());
    let lender_site = Site {
        path: s.dir.path().join("lender.toml"),
        cfg: DirectoryConfig {
            etcd: vec![proxy.endpoint()],
            ..s.cfg.clone()
        },
        dir: tempfile::tempdir().unwrap(),
    };
    let src = std::fs::read_to_string(&s.path)
        .unwrap()
        .replace(&etcd.members[0].endpoint(), &proxy.endpoint());
    ntb::config::write_private_file(&lender_site.path, &src).unwrap();
    let d = lenderd(&lender_site, "node3", 1);
    let a = Borrower::new(&s, "vmm-a");
    let ca = a.connect("node3");
    let claim = a.dir.claim("node3", &dev(0), "vmm-a", "vm0").unwrap();
    let lease = ca
        .borrow_claimed(&dev(0), "vm0", claim.revision().unwrap())
        .unwrap();

    proxy.cut();
    // The directory wins: the lender's registration expires, and the borrower, watching it,
    // is told the device is lost (lendvm then does its surprise removal) ...
    wait_for("borrower told", TTL + SLACK, || claim.lost().is_some());
    let why = claim.lost().unwrap();
    assert!(why.contains("left the directory"), "{why}");
    assert!(listed(&s).is_empty());
    // ... although the fabric link still works: it is not what decides membership.
    assert_eq!(lease.config_read(0, 4).unwrap().len(), 4);
    // The borrower lets go (as lendvm's teardown does): lease returned, claim released.
    lease.return_device().unwrap();
    drop(claim);

    // Back in touch, the lender registers again and the device can be claimed anew.
    proxy.restore();
    let t0 = Instant::now();
    while listed(&s).len() != 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "lender not re-registered within 15 s:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    wait_for("re-registration logged", Duration::from_secs(5), || {
        d.log().contains("registered again")
    });
    let claim = a.dir.claim("node3", &dev(0), "vmm-a", "vm1").unwrap();
    let _l = ca
        .borrow_claimed(&dev(0), "vm1", claim.revision().unwrap())
        .unwrap();
}

#[test]
fn the_static_file_directory_fans_out_to_every_lender() {
    use lending::directory::static_file::FanOut;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let path = dir.path().join("cluster.toml");
    ntb::config::write_private_file(
        &path,
        &format!(
            "version = 1\ntoken = \"{TOKEN}\"\n\
             [[node]]\nname = \"node3\"\nfabric = \"shm\"\ncontrol = \"{d}/node3.sock\"\n\
             [[node]]\nname = \"node2\"\nfabric = \"shm\"\ncontrol = \"{d}/node2.sock\"\n"
        ),
    )
    .unwrap();
    let _l = Lenderd::command(lenderd_binary(), "node3", &path)
        .log(dir.path().join("node3.log"))
        .device(format!("{}=dmatest", dev(0)))
        .spawn_until_listening(&dir.path().join("node3.sock"));
    let (dir_, file) = lending::directory::open(
        path.to_str().unwrap(),
        FanOut {
            local: "lendctl-test".into(),
            token: TOKEN.into(),
            client: "directory-test".into(),
            connect_timeout: Duration::from_secs(2),
        },
    )
    .unwrap();
    assert!(file.unwrap().directory.is_none());
    assert!(
        dir_.describe().starts_with("static file"),
        "{}",
        dir_.describe()
    );
    let snap = dir_.snapshot().unwrap();
    assert_eq!(snap.devices.len(), 1);
    assert_eq!(snap.devices[0].node, "node3");
    assert_eq!(snap.unreachable.len(), 1);
    assert_eq!(snap.unreachable[0].0, "node2");
    // No shared state: claims are the lender's inventory, watching is not possible.
    let c = dir_.claim("node3", &dev(0), "b", "vm0").unwrap();
    assert_eq!(c.revision(), None);
    assert!(dir_.claim("node9", &dev(0), "b", "vm0").is_err());
    assert!(dir_.watch().is_err());
}

/// A device claimed and borrowed through the site's directory by `vmm-a`: the directory
/// works end to end (lenderd registered, lendctl lists, the lender checks the claim).
fn claim_and_borrow_works(s: &Site) {
    let _d = lenderd(s, "node3", 1);
    assert_eq!(listed(s).len(), 1);
    let a = Borrower::new(s, "vmm-a");
    let ca = a.connect("node3");
    let claim = a.dir.claim("node3", &dev(0), "vmm-a", "vm0").unwrap();
    let lease = ca
        .borrow_claimed(&dev(0), "vm0", claim.revision().unwrap())
        .unwrap();
    assert_eq!(lease.config_read(0, 4).unwrap().len(), 4);
}

#[test]
fn the_directory_works_over_tls_with_client_certificates_and_refuses_a_client_without_one() {
    let etcd = EtcdCluster::start_tls(1, true);
    let s = site(&etcd);
    assert!(s.cfg.tls());
    claim_and_borrow_works(&s);
    // Without a client certificate the members refuse the TLS handshake: a clear error.
    let bare = DirectoryConfig {
        cert: None,
        key: None,
        ..s.cfg.clone()
    };
    let e = EtcdDirectory::connect(&bare, Some(TOKEN)).err().unwrap();
    let m = e.to_string();
    assert!(
        matches!(e, DirectoryError::Connect { .. }) && m.contains("client certificate"),
        "{m}"
    );
    // Without the CA (plain http) the members do not answer a directory either.
    let plain = DirectoryConfig {
        ca: None,
        cert: None,
        key: None,
        ..s.cfg.clone()
    };
    assert!(EtcdDirectory::connect(&plain, Some(TOKEN)).is_err());
    // lendctl says the same from a cluster file without cert and key.
    let src = std::fs::read_to_string(&s.path).unwrap();
    let no_cert: String = src
        .lines()
        .filter(|l| !l.starts_with("cert =") && !l.starts_with("key ="))
        .map(|l| format!("{l}\n"))
        .collect();
    let path = s.dir.path().join("no-cert.toml");
    ntb::config::write_private_file(&path, &no_cert).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_lendctl"))
        .arg("--cluster")
        .arg(&path)
        .arg("list")
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("client certificate"), "{e}");
}

#[test]
fn the_directory_works_with_etcd_users_and_refuses_a_wrong_password() {
    let mut etcd = EtcdCluster::single();
    etcd.enable_auth("lendvm", "directory-test-password");
    let s = site(&etcd);
    assert_eq!(s.cfg.user.as_deref(), Some("lendvm"));
    claim_and_borrow_works(&s);
    // A wrong password, or none, is refused with the reason.
    let wrong = s.dir.path().join("wrong.password");
    ntb::config::write_token_file(&wrong, "not-the-password").unwrap();
    let bad = DirectoryConfig {
        password_file: Some(wrong),
        ..s.cfg.clone()
    };
    let e = EtcdDirectory::connect(&bad, Some(TOKEN)).err().unwrap();
    assert!(e.to_string().contains("credentials"), "{e}");
    let anonymous = DirectoryConfig {
        user: None,
        password_file: None,
        ..s.cfg.clone()
    };
    let e = match EtcdDirectory::connect(&anonymous, Some(TOKEN)) {
        Err(e) => e.to_string(),
        Ok(d) => d
            .snapshot()
            .expect_err("an anonymous client read the directory")
            .to_string(),
    };
    assert!(e.contains("etcd"), "{e}");
    // A password file others may read is refused before anything is sent.
    let loose = s.dir.path().join("loose.password");
    std::fs::write(&loose, "directory-test-password").unwrap();
    let bad = DirectoryConfig {
        password_file: Some(loose),
        ..s.cfg.clone()
    };
    let e = EtcdDirectory::connect(&bad, Some(TOKEN)).err().unwrap();
    assert!(matches!(e, DirectoryError::CredentialMode { .. }), "{e}");
}

#[test]
fn a_forged_claim_record_written_into_etcd_is_ignored_by_the_lender() {
    let etcd = EtcdCluster::single();
    let s = site(&etcd);
    let d = lenderd(&s, "node3", 2);
    let a = Borrower::new(&s, "vmm-a");
    let ca = a.connect("node3");
    let claim = a.dir.claim("node3", &dev(0), "vmm-a", "vm0").unwrap();
    let rev = claim.revision().unwrap();
    let lease = ca.borrow_claimed(&dev(0), "vm0", rev).unwrap();
    // Someone with write access to etcd but without the cluster secret rewrites A's claim
    // to name them, and writes a claim of their own on the free device: one record without
    // a MAC, one with a made-up MAC.
    let ckey = |i| format!("{}/claims/node3/{}", s.cfg.prefix, dev(i));
    let forged = |i: usize, mac: Option<&str>| {
        let mut v = serde_json::json!({
            "node": "node3", "bdf": dev(i), "holder": "vmm-evil", "vm": "vm9",
        });
        if let Some(m) = mac {
            v["mac"] = m.into();
        }
        v.to_string()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let rev1 = rt.block_on(async {
        let mut c = etcd.raw_client().await;
        c.put(ckey(0), forged(0, None), None).await.unwrap();
        let r = c
            .put(ckey(1), forged(1, Some(&"ab".repeat(32))), None)
            .await
            .unwrap();
        r.header().unwrap().revision()
    });
    // The forged claims do not let their "holder" borrow, though it authenticates on the
    // fabric (a cluster member that etcd's writer names).
    let evil = Borrower::new(&s, "vmm-evil");
    let ce = evil.connect("node3");
    for (i, r) in [(1, rev1), (0, rev)] {
        let e = ce.borrow_claimed(&dev(i), "vm9", r).err().unwrap();
        assert_eq!(remote_code(&e), Some(code::STALE_CLAIM), "{e}");
        assert!(e.to_string().contains("MAC"), "{e}");
    }
    // A's lease is not ended: it keeps working while the lender's claim watch and its
    // fencing poll run many times over.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(2) {
        assert_eq!(lease.config_read(0, 4).unwrap().len(), 4);
        if let Some(Event::DeviceGone(g)) = ca.next_event(Duration::from_millis(100)).unwrap() {
            panic!("the lender ended the lease: {}", g.reason);
        }
    }
    wait_for("forgery logged", Duration::from_secs(5), || {
        d.log().contains("ignoring claim record")
    });
    assert!(d.log().contains("MAC"), "{}", d.log());
    drop(claim);
}

/// Issue 32, claim replay: someone with read and write access to etcd, but not the cluster
/// secret, keeps a signed claim record of A's and puts it back after A let the claim go.
/// The MAC still checks, but the record is bound to the etcd lease it was written under,
/// which is gone: the lender refuses it, so A cannot borrow without a real claim (which
/// would take the device past the directory's exclusivity), and the device stays free
/// for a real claim once the replayed key is gone.
#[test]
fn a_replayed_claim_record_is_refused_by_the_lender() {
    let etcd = EtcdCluster::single();
    let s = site(&etcd);
    let d = lenderd(&s, "node3", 1);
    let a = Borrower::new(&s, "vmm-a");
    let ca = a.connect("node3");
    let ckey = format!("{}/claims/node3/{}", s.cfg.prefix, dev(0));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let claim = a.dir.claim("node3", &dev(0), "vmm-a", "vm0").unwrap();
    let lease = ca
        .borrow_claimed(&dev(0), "vm0", claim.revision().unwrap())
        .unwrap();
    let old = rt.block_on(async {
        let mut c = etcd.raw_client().await;
        let r = c.get(ckey.clone(), None).await.unwrap();
        r.kvs()[0].value().to_vec()
    });
    assert!(String::from_utf8_lossy(&old).contains("\"lease\""));
    drop(lease);
    drop(claim);
    wait_for("claim released", Duration::from_secs(10), || {
        a.dir.snapshot().unwrap().claims.is_empty()
    });
    // The replay: the same bytes, without a lease (the old one is revoked: etcd would not
    // take a put under it) and under a lease of the writer's own.
    for with_lease in [false, true] {
        let rev = rt.block_on(async {
            let mut c = etcd.raw_client().await;
            let opts = if with_lease {
                let l = c.lease_grant(30, None).await.unwrap().id();
                Some(etcd_client::PutOptions::new().with_lease(l))
            } else {
                None
            };
            c.put(ckey.clone(), old.clone(), opts).await.unwrap();
            let r = c.get(ckey.clone(), None).await.unwrap();
            r.kvs()[0].create_revision()
        });
        let e = ca
            .borrow_claimed(&dev(0), "vm0", rev)
            .err()
            .unwrap_or_else(|| {
                panic!("a replayed claim (with a lease of its own: {with_lease}) lent the device")
            });
        assert_eq!(remote_code(&e), Some(code::STALE_CLAIM), "{e}");
        assert!(e.to_string().contains("replayed or moved claim"), "{e}");
        rt.block_on(async {
            let mut c = etcd.raw_client().await;
            c.delete(ckey.clone(), None).await.unwrap();
        });
    }
    wait_for("replay logged", Duration::from_secs(5), || {
        d.log().contains("replayed or moved claim")
    });
    // The device is free for a real claim.
    let claim = a.dir.claim("node3", &dev(0), "vmm-a", "vm0").unwrap();
    let _lease = ca
        .borrow_claimed(&dev(0), "vm0", claim.revision().unwrap())
        .unwrap();
}

#[test]
fn a_lender_address_from_the_directory_still_has_to_pass_the_fabrics_mutual_auth() {
    let etcd = EtcdCluster::single();
    let s = site(&etcd);
    let _d = lenderd(&s, "node3", 1);
    // An impostor lenderd (it does not know the cluster secret) on its own socket, and a
    // directory writer who points node3's record at it.
    let fake_dir = tempfile::tempdir().unwrap();
    let sock = fake_dir.path().join("fake.sock");
    let file = fake_dir.path().join("fake.toml");
    ntb::config::write_private_file(
        &file,
        &format!(
            "version = 1\ntoken = \"not-the-cluster-secret-but-as-long-as-one\"\n[[node]]\n\
             name = \"node3\"\nfabric = \"shm\"\ncontrol = \"{}\"\n",
            sock.display()
        ),
    )
    .unwrap();
    let _fake = Lenderd::command(lenderd_binary(), "node3", &file)
        .log(fake_dir.path().join("fake.log"))
        .env_remove("LENDVM_TOKEN")
        .device(format!("{}=dmatest", dev(0)))
        .spawn_until_listening(&sock);
    let a = Borrower::new(&s, "vmm-a");
    let mut rec = a.dir.snapshot().unwrap().nodes[0].clone();
    rec.control = sock.display().to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = etcd.raw_client().await;
        let key = format!("{}/nodes/node3", s.cfg.prefix);
        c.put(key, serde_json::to_string(&rec).unwrap(), None)
            .await
            .unwrap();
    });
    let node = a.dir.lender("node3").unwrap();
    assert_eq!(node.control.to_string(), sock.display().to_string());
    let e = LenderClient::connect_node(
        &cluster_of(node.clone()),
        &node,
        &NodeId::new("vmm-a").unwrap(),
        Duration::from_secs(5),
        TOKEN,
        "directory-test",
    )
    .err()
    .expect("connected to a lender that does not know the cluster secret");
    let m = e.to_string();
    assert!(m.contains("auth") || m.contains("token"), "{m}");
}

/// Chaos seed 8 (docs/RELIABILITY.md, "A cluster under fire"): a hot-add during an etcd
/// majority loss answered after 10 s. Without quorum, a lender lookup and a claim each fail
/// within one `CALL_TIMEOUT` (plus scheduling slack on a loaded host), with an error naming
/// etcd, rather than one timeout per call they make.
#[test]
fn without_quorum_a_lookup_and_a_claim_each_fail_within_one_call_timeout() {
    use lending::directory::etcd::CALL_TIMEOUT;
    let mut etcd = EtcdCluster::start(3);
    let s = site(&etcd);
    let _d = lenderd(&s, "node3", 1);
    let dir = EtcdDirectory::connect(&s.cfg, Some(TOKEN)).unwrap();
    let leader = etcd.wait_leader(Duration::from_secs(10));
    // Two of three members gone, the leader among them: no quorum.
    let other = (leader + 1) % 3;
    etcd.members[leader].kill();
    etcd.members[other].kill();
    let bound = CALL_TIMEOUT + Duration::from_secs(2);
    let t = Instant::now();
    let looked = dir.lender("node3");
    let lookup = t.elapsed();
    let t = Instant::now();
    let claimed = dir.claim("node3", &dev(0), "vmm-a", "vm0");
    let claim = t.elapsed();
    eprintln!(
        "without quorum: lookup {lookup:?} ({:?}), claim {claim:?}",
        looked.is_ok()
    );
    let e = claimed
        .err()
        .expect("a claim without quorum succeeded")
        .to_string();
    assert!(e.contains("etcd"), "{e}");
    assert!(lookup < bound, "the lookup took {lookup:?}");
    assert!(claim < bound, "the claim took {claim:?}: {e}");
}

#[test]
fn members_talk_to_each_other_over_tls_and_refuse_a_plain_peer() {
    // Three members with TLS elect a leader: their peer links (https, each showing its
    // certificate to the other: --peer-client-cert-auth) work.
    let etcd = EtcdCluster::start_tls(3, true);
    let s = site(&etcd);
    claim_and_borrow_works(&s);
    // A peer port does not answer a plain http request (a plain peer listener answers any
    // request with a status line: etcd's TLS listener drops the connection).
    use std::io::{Read, Write};
    let m = &etcd.members[0];
    let mut c = std::net::TcpStream::connect((m.host.ip.as_str(), m.peer_port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(c, "GET /members HTTP/1.0\r\n\r\n").unwrap();
    let mut reply = Vec::new();
    let _ = c.read_to_end(&mut reply);
    let reply = String::from_utf8_lossy(&reply);
    assert!(
        !reply.starts_with("HTTP/"),
        "the peer port answered plain http: {reply:?}"
    );
}
