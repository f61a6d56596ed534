//! A cluster under fire (issue 34; docs/RELIABILITY.md, "A cluster under fire"): a real
//! cluster on this machine, faults from a seeded schedule, one history, the checker.
//!
//! * **Hosts** are network namespaces made here (`lvcNNNN-*`), joined by a bridge in a hub
//!   namespace, on link-local 169.254.91.0/24, deleted at the end (also after a failure):
//!   `e1`..`e3` run the 3 etcd members (clients over TLS with client certificates),
//!   `l1`..`l3` the lenders (tcp+TLS fabric, each lending two emulated NVMe disks, with
//!   `--audit-log`), `b1` and `b2` two VMs each (`lendvm` with the bare-metal guest).
//! * **Workload.** Each VM adds its disk through the REST API, its guest's hotplug loop
//!   writes the disk with data of its own (`seqio=1`: `seed ^ add number`) and reads it back,
//!   and the VM removes the disk again; then over. Every API call, every write and read,
//!   every device event goes into the history; the lenders' audit logs are read into it at
//!   the end (`lendvm_tests::chaos::audit`).
//! * **Faults** from `Schedule::generate(seed, ...)`, each injected and healed on time:
//!   lender SIGKILL + restart, lender SIGSTOP + SIGCONT, the etcd leader killed, a minority
//!   and a majority of etcd members stopped, partitions (iptables in the namespaces) between a
//!   lender and etcd, a lender and the borrower hosts, a borrower host and etcd, 30 % random
//!   packet loss on a lender-borrower link (iptables `statistic`), a lender's store (a
//!   tmpfs) full, faster hot-plug churn on a VM, a VM migrated live to the other borrower
//!   host or its VMM replaced through `--local` migration (mid-I/O, the disk attached), and
//!   a lender-borrower link delayed (150 ms) or jittered as reordering shows on a TCP stream
//!   (0-300 ms, order kept) by a fault proxy every borrower-to-lender connection passes
//!   through (an iptables DNAT in the borrower's namespace).
//! * **Verdict.** The checker (`lendvm_tests::chaos::check`) decides the history; the test
//!   fails on any violation and prints the report (also `OUT/report.md`).
//!
//! `scripts/chaos.sh --minutes N --seed S [--faults a,b]` runs it (root, etcd installed):
//! environment `LENDVM_CHAOS_SEED`, `LENDVM_CHAOS_MINUTES`, `LENDVM_CHAOS_FAULTS`,
//! `LENDVM_CHAOS_OUT` (default `target/chaos/seed-S`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use api::client::ApiClient;
use api::types::{LeaseState, VmAddRemoteDeviceData, VmRemoveDeviceData};
use common::*;
use lending::directory::testing::{in_netns, EtcdCluster, MemberHost};
use lendvm_tests::chaos::audit;
use lendvm_tests::chaos::check::{check, Bounds};
use lendvm_tests::chaos::history::{self, DeviceEvent, Op, Outcome, Phase};
use lendvm_tests::chaos::recorder::Recorder;
use lendvm_tests::chaos::schedule::{self, FaultKind, Schedule, Topology};

const NET: &str = "169.254.91";
const ETCD: [&str; 3] = ["e1", "e2", "e3"];
const LENDERS: [&str; 3] = ["l1", "l2", "l3"];
const BORROWERS: [&str; 2] = ["b1", "b2"];
const DISKS: [&str; 2] = ["0000:82:00.0", "0000:84:00.0"];
/// Each lender's dmatest engine; every third cycle of a VM copies with one.
const DMA: &str = "0000:83:00.0";
const LENDER_PORT: u16 = 7800;
/// Each lender's `--metrics` port, on its namespace's loopback: the leak check reads its
/// sessions and DMA windows there.
const METRICS_PORT: u16 = 9800;
/// The first LBA each guest writes: add `n` writes 64 LBAs of 512 bytes at
/// `LBA + (n % 1024) * 64` (`seqio=1`), so the lender's store grows for 1024 adds.
const LBA: u64 = 16;
/// Each lender's disks live on a tmpfs of this size (`lender-disk-full` fills it); two
/// images of [`IMAGE`], sparse, at most 32 MiB written each.
const STORE: &str = "96m";
const IMAGE: &str = "40M";
/// Quiet time after the last heal: the checker's recovery bound (60 s) and some.
const SETTLE_MS: u64 = 65_000;

fn host_ip(host: &str) -> String {
    let n = match host {
        "e1" => 11,
        "e2" => 12,
        "e3" => 13,
        "l1" => 21,
        "l2" => 22,
        "l3" => 23,
        "b1" => 31,
        "b2" => 32,
        _ => panic!("no host {host}"),
    };
    format!("{NET}.{n}")
}

fn run(prog: &str, args: &[&str]) {
    let out = Command::new(prog).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{prog} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Where each run notes its pid (first line) and its tmpfs mounts (one per line, added as
/// they are made), so that a later run can undo what a run killed by SIGKILL left (no `Drop`
/// runs then): the file is named after the run's namespace tag and removed last on drop.
const OWNERS: &str = "/run/lendvm-chaos";

/// Undoes what runs that are gone left behind: every process in their namespaces (killed),
/// the namespaces (deleted), their stores (unmounted). A run whose harness is alive is left
/// alone; a namespace of this harness's form with no owner file is from a run that is gone.
fn reap_stale_runs(ours: &str) {
    let alive = |pid: &str| {
        std::fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains("chaos_cluster"))
    };
    let list = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let names: Vec<String> = String::from_utf8_lossy(&list.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    let mut tags: std::collections::BTreeSet<String> = names
        .iter()
        .filter_map(|n| n.split_once('-').map(|(t, _)| t))
        .filter(|t| {
            t.len() == 7 && t.starts_with("lvc") && t[3..].bytes().all(|b| b.is_ascii_digit())
        })
        .map(str::to_string)
        .collect();
    if let Ok(dir) = std::fs::read_dir(OWNERS) {
        tags.extend(
            dir.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string()),
        );
    }
    for tag in tags.iter().filter(|t| t.as_str() != ours) {
        let owner = Path::new(OWNERS).join(tag);
        let text = std::fs::read_to_string(&owner).unwrap_or_default();
        let mut lines = text.lines();
        if lines.next().is_some_and(alive) {
            continue;
        }
        eprintln!("chaos: undoing what run {tag}, which is gone, left behind");
        for ns in names.iter().filter(|n| n.starts_with(&format!("{tag}-"))) {
            let pids = Command::new("ip")
                .args(["netns", "pids", ns])
                .output()
                .unwrap();
            for pid in String::from_utf8_lossy(&pids.stdout).split_whitespace() {
                if let Ok(pid) = pid.parse::<libc::pid_t>() {
                    // SAFETY: SIGKILL to a process of a stale namespace of ours.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        for mount in lines {
            let _ = Command::new("umount").arg("-l").arg(mount).status();
        }
        let _ = std::fs::remove_file(&owner);
    }
}

/// Notes `line` in this run's owner file (see [`OWNERS`]).
fn note_owned(tag: &str, line: &str) {
    use std::io::Write;
    std::fs::create_dir_all(OWNERS).unwrap();
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(Path::new(OWNERS).join(tag))
        .unwrap();
    writeln!(f, "{line}").unwrap();
}

/// The namespaces of one run; deleted on drop.
struct Net {
    tag: String,
    made: Vec<String>,
}

impl Net {
    fn ns(&self, host: &str) -> String {
        format!("{}-{host}", self.tag)
    }

    fn make() -> Net {
        let tag = format!("lvc{:04}", std::process::id() % 10_000);
        reap_stale_runs(&tag);
        // A file of a run that was ours by number but is gone (reaped above, or never made).
        let _ = std::fs::remove_file(Path::new(OWNERS).join(&tag));
        note_owned(&tag, &std::process::id().to_string());
        let mut net = Net {
            tag,
            made: Vec::new(),
        };
        let hub = net.ns("hub");
        run("ip", &["netns", "add", &hub]);
        net.made.push(hub.clone());
        run("ip", &["-n", &hub, "link", "add", "br0", "type", "bridge"]);
        run("ip", &["-n", &hub, "link", "set", "br0", "up"]);
        for h in ETCD.iter().chain(&LENDERS).chain(&BORROWERS) {
            let ns = net.ns(h);
            run("ip", &["netns", "add", &ns]);
            net.made.push(ns.clone());
            let port = format!("{}{h}", net.tag);
            run(
                "ip",
                &[
                    "link", "add", &port, "netns", &hub, "type", "veth", "peer", "name", "eth0",
                    "netns", &ns,
                ],
            );
            run(
                "ip",
                &["-n", &hub, "link", "set", &port, "master", "br0", "up"],
            );
            let addr = format!("{}/24", host_ip(h));
            run("ip", &["-n", &ns, "addr", "add", &addr, "dev", "eth0"]);
            run("ip", &["-n", &ns, "link", "set", "eth0", "up"]);
            run("ip", &["-n", &ns, "link", "set", "lo", "up"]);
        }
        net
    }

    /// Adds (`-A`) or deletes (`-D`) an iptables rule in `host`'s namespace.
    fn rule(&self, host: &str, op: &str, rule: &[&str]) {
        let ns = self.ns(host);
        let mut args = vec!["netns", "exec", &ns, "iptables-legacy", op];
        args.extend_from_slice(rule);
        run("ip", &args);
    }

    /// Cuts (`-A`) or heals (`-D`) all traffic between `host` and `peers`, on `host`'s side.
    fn cut(&self, host: &str, peers: &[&str], op: &str) {
        for p in peers {
            let ip = host_ip(p);
            self.rule(host, op, &["INPUT", "-s", &ip, "-j", "DROP"]);
            self.rule(host, op, &["OUTPUT", "-d", &ip, "-j", "DROP"]);
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.made.iter().rev() {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        let _ = std::fs::remove_file(Path::new(OWNERS).join(&self.tag));
    }
}

/// How a [`Proxy`] passes data on.
const PASS: u64 = 0;
/// `link-delay`: every chunk 150 ms late.
const DELAY: u64 = 1;
/// `link-reorder`: every chunk 0-300 ms late at random, the stream's order kept. TCP puts
/// reordered packets back in order before any application sees them; what a link that
/// reorders costs a TCP stream is this jitter (the receiver waits for the missing segment).
const JITTER: u64 = 2;
/// The mark of the proxy's own connections to the lender (not redirected again).
const PROXY_MARK: u32 = 0x4c;

/// The fault proxy between a borrower host and a lender: in the borrower's namespace, an
/// iptables DNAT sends every connection to the lender's control port through it, and it
/// passes the bytes on as [`Proxy::mode`] says (`link-delay`, `link-reorder`).
struct Proxy {
    mode: Arc<std::sync::atomic::AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    /// Starts the proxy for `borrower` -> `lender` (index `li`) and its DNAT rule.
    fn start(net: &Net, borrower: &str, lender: &str, li: usize) -> Proxy {
        let mode = Arc::new(std::sync::atomic::AtomicU64::new(PASS));
        let stop = Arc::new(AtomicBool::new(false));
        let port = 7810 + li as u16;
        let listen = format!("{}:{port}", host_ip(borrower));
        let upstream: std::net::SocketAddr = format!("{}:{LENDER_PORT}", host_ip(lender))
            .parse()
            .unwrap();
        let ns = net.ns(borrower);
        let listener = in_netns(Some(&ns), || std::net::TcpListener::bind(&listen).unwrap());
        listener.set_nonblocking(true).unwrap();
        let (m, st) = (mode.clone(), stop.clone());
        let ns2 = ns.clone();
        std::thread::spawn(move || {
            in_netns(Some(&ns2), || {
                while !st.load(Ordering::SeqCst) {
                    match listener.accept() {
                        Ok((down, _)) => {
                            down.set_nonblocking(false).unwrap();
                            if let Some(up) = marked_connect(upstream) {
                                pump(down.try_clone().unwrap(), up.try_clone().unwrap(), &m);
                                pump(up, down, &m);
                            }
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                }
            })
        });
        let to = listen.clone();
        let dst = host_ip(lender);
        let lport = LENDER_PORT.to_string();
        let mark = format!("{PROXY_MARK:#x}");
        net.rule(
            borrower,
            "-A",
            &[
                "OUTPUT",
                "-t",
                "nat",
                "-p",
                "tcp",
                "-d",
                &dst,
                "--dport",
                &lport,
                "-m",
                "mark",
                "!",
                "--mark",
                &mark,
                "-j",
                "DNAT",
                "--to-destination",
                &to,
            ],
        );
        Proxy { mode, stop }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// A tcp connection to `to` marked [`PROXY_MARK`] (so the DNAT leaves it alone).
fn marked_connect(to: std::net::SocketAddr) -> Option<std::net::TcpStream> {
    use std::os::fd::FromRawFd;
    // SAFETY: a new socket; checked.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0);
    // SAFETY: we own the new fd; TcpStream closes it.
    let s = unsafe { std::net::TcpStream::from_raw_fd(fd) };
    let mark = PROXY_MARK;
    // SAFETY: SO_MARK takes a u32 of the given size; the fd is ours.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_MARK,
            (&mark as *const u32).cast(),
            std::mem::size_of::<u32>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_MARK: {}", std::io::Error::last_os_error());
    let std::net::SocketAddr::V4(v4) = to else {
        return None;
    };
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: v4.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*v4.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: connect with a valid sockaddr_in of its size on our fd.
    let rc = unsafe {
        libc::connect(
            fd,
            (&sin as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    (rc == 0).then_some(s)
}

/// Copies `from` to `to` on two threads: one reads chunks and stamps when each is due (now,
/// 150 ms later, or 0-300 ms later but never before the one ahead of it), the other writes
/// each when due. Ends when either side closes.
fn pump(
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    mode: &Arc<std::sync::atomic::AtomicU64>,
) {
    use std::io::{Read, Write};
    // Bound: the reader stops reading when 256 chunks wait (a slow writer holds it back).
    let (tx, rx) = std::sync::mpsc::sync_channel::<(Instant, Vec<u8>)>(256);
    let mode = mode.clone();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        let mut last = Instant::now();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let now = Instant::now();
            let due = match mode.load(Ordering::SeqCst) {
                DELAY => now + Duration::from_millis(150),
                JITTER => {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (now + Duration::from_millis(x % 300)).max(last)
                }
                _ => now,
            };
            last = due;
            if tx.send((due, buf[..n].to_vec())).is_err() {
                break;
            }
        }
        let _ = from.shutdown(std::net::Shutdown::Both);
    });
    std::thread::spawn(move || {
        for (due, chunk) in rx {
            let wait = due.saturating_duration_since(Instant::now());
            std::thread::sleep(wait);
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Both);
    });
}

/// The lenders' stores: tmpfs mounts of [`STORE`], unmounted on drop.
struct Stores {
    /// The run's namespace tag: each mount is noted in its owner file (see [`OWNERS`]).
    tag: String,
    mounts: Vec<PathBuf>,
}

impl Stores {
    fn mount(&mut self, dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        let d = dir.display().to_string();
        note_owned(&self.tag, &d);
        run(
            "mount",
            &["-t", "tmpfs", "-o", &format!("size={STORE}"), "tmpfs", &d],
        );
        self.mounts.push(dir.to_path_buf());
    }
}

impl Drop for Stores {
    fn drop(&mut self) {
        for d in &self.mounts {
            let _ = Command::new("umount").arg("-l").arg(d).status();
        }
    }
}

/// Whether this process may make namespaces (root); the runner fails loudly otherwise.
fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "the chaos cluster makes network namespaces and iptables rules: run it as root \
         (scripts/chaos.sh)"
    );
}

/// A daemon's resource counts from /proc: open descriptors and resident memory.
fn proc_counts(pid: u32) -> std::collections::BTreeMap<String, u64> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count() as u64)
        .unwrap_or(0);
    let mut m = std::collections::BTreeMap::new();
    m.insert("fds".to_string(), fds);
    m.insert("rss_kib".to_string(), proc_status_kb(pid, "VmRSS"));
    m
}

/// What a lender holds for borrowers by its own `/metrics` (read on its namespace's loopback):
/// sessions, DMA windows over every device's IOMMU domain and their bytes, P2P mappings into
/// its BARs.
fn lender_gauges(ns: &str, host: &str) -> std::collections::BTreeMap<String, u64> {
    let (status, text) = in_netns(Some(ns), || http_get(METRICS_PORT, "/metrics", None))
        .unwrap_or_else(|e| panic!("{host}: GET /metrics: {e}"));
    assert_eq!(status, 200, "{host}: GET /metrics: {text}");
    let mut m = std::collections::BTreeMap::new();
    for (metric, key) in [
        ("lenderd_sessions", "sessions"),
        ("lenderd_dma_windows", "dma_windows"),
        ("lenderd_dma_window_bytes", "dma_window_bytes"),
        ("lenderd_lease_p2p_mappings", "p2p_mappings"),
    ] {
        let mut found = false;
        let sum: f64 = text
            .lines()
            .filter(|l| {
                l.strip_prefix(metric)
                    .is_some_and(|r| r.starts_with(['{', ' ']))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .inspect(|_| found = true)
            .sum();
        // A gauge with samples must be there; one per lease may have none.
        assert!(
            found || metric == "lenderd_lease_p2p_mappings",
            "{host}: /metrics has no {metric}:\n{text}"
        );
        m.insert(key.to_string(), sum as u64);
    }
    m
}

struct Lender {
    host: &'static str,
    ns: String,
    file: PathBuf,
    dir: PathBuf,
    proc: Mutex<Option<Lenderd>>,
    restarts: AtomicUsize,
}

impl Lender {
    fn start(&self) {
        let n = self.restarts.fetch_add(1, Ordering::SeqCst);
        let mut devices: Vec<String> = DISKS
            .iter()
            .map(|d| {
                format!(
                    "{d}=nvme:path={},size={IMAGE}",
                    self.store()
                        .join(format!("{}-{}.img", self.host, &d[5..7]))
                        .display()
                )
            })
            .collect();
        devices.push(format!("{DMA}=dmatest"));
        let control = format!("{}:{LENDER_PORT}", host_ip(self.host));
        // Loopback only (lenderd refuses another address for its unauthenticated endpoint):
        // the namespace's own.
        let metrics = format!("127.0.0.1:{METRICS_PORT}");
        let audit = self.dir.join(format!("{}.audit.jsonl", self.host));
        let log = self.dir.join(format!("{}-{n}.log", self.host));
        let l = in_netns(Some(&self.ns), || {
            Lenderd::command(binary("lenderd"), self.host, &self.file)
                .log(log)
                .arg("--control")
                .arg(&control)
                .arg("--audit-log")
                .arg(&audit)
                .arg("--metrics")
                .arg(&metrics)
                .devices(&devices)
                .spawn_until("listening", |d| d.log().contains("listening at"))
        });
        *self.proc.lock().unwrap() = Some(l);
    }

    /// Starts it again as systemd would (`Restart=on-failure`, `RestartSec=2`): a lenderd
    /// that cannot start (etcd out of its reach at start-up) is tried again every 2 s, for
    /// at most 2 minutes, on a thread of its own so that the schedule goes on.
    fn restart(self: &Arc<Self>) -> std::thread::JoinHandle<()> {
        let me = self.clone();
        std::thread::spawn(move || {
            for attempt in 1..=60 {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| me.start()));
                if r.is_ok() {
                    return;
                }
                eprintln!(
                    "chaos: {} did not start (attempt {attempt}); again in 2 s",
                    me.host
                );
                std::thread::sleep(Duration::from_secs(2));
            }
            panic!("{} did not start within 2 minutes", me.host);
        })
    }

    /// Where its disks' backing files are: a tmpfs of [`STORE`] of its own.
    fn store(&self) -> PathBuf {
        self.dir.join(format!("{}-store", self.host))
    }

    /// `lender-disk-full`: fills the store (a file taking every free block), so that the
    /// disks' writes to blocks not yet stored fail; healed by removing it.
    fn fill_store(&self, full: bool) {
        let filler = self.store().join("filler");
        if !full {
            std::fs::remove_file(&filler).unwrap();
            return;
        }
        let f = std::fs::File::create(&filler).unwrap();
        let c = std::ffi::CString::new(self.store().display().to_string()).unwrap();
        let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
        // SAFETY: statvfs writes into the valid, sized buffer; the path is NUL-terminated.
        assert_eq!(unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) }, 0);
        // SAFETY: statvfs succeeded.
        let st = unsafe { st.assume_init() };
        let free = (st.f_bavail * st.f_frsize) as libc::off_t;
        use std::os::fd::AsRawFd;
        // SAFETY: fallocate on our own open file; the result is checked below by statvfs.
        unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, free) };
    }

    fn pid(&self) -> Option<libc::pid_t> {
        self.proc
            .lock()
            .unwrap()
            .as_ref()
            .map(|l| l.child.id() as libc::pid_t)
    }

    /// Sends `sig`; a lender not running (its restart still being tried) gets nothing.
    fn signal(&self, sig: libc::c_int) {
        match self.pid() {
            // SAFETY: a signal to our own child, whose handle we hold.
            Some(pid) => assert_eq!(unsafe { libc::kill(pid, sig) }, 0),
            None => eprintln!("chaos: {} is not running: signal {sig} not sent", self.host),
        }
    }

    fn kill(&self) {
        if let Some(mut l) = self.proc.lock().unwrap().take() {
            l.kill();
        }
    }
}

/// One VM and its workload's state.
struct Guest {
    name: String,
    device: String,
    /// The dmatest engine it copies with (another lender's than its disk's).
    dma: String,
    /// `HOTPLUG io dma` lines read of the current console.
    dma_seen: AtomicUsize,
    /// Its API socket (a new one after each migration).
    sock: Mutex<PathBuf>,
    vm: Mutex<Vm>,
    /// The borrower host it runs on now (`b1`, `b2`).
    host: Mutex<&'static str>,
    /// `migrate` or `vmm-restart`, done at the next add (the disk attached, its I/O
    /// running).
    pending: Mutex<Option<FaultKind>>,
    /// Migrations so far (names the destinations' sockets and ports).
    moves: AtomicUsize,
    /// The namespaces' prefix, the cluster file and the run's directory (destinations).
    net_tag: String,
    file: PathBuf,
    out: PathBuf,
    /// `hotplug-churn`: no pause between cycles.
    churn: AtomicBool,
    cycles: AtomicUsize,
    /// The guest's pattern seed (`seed=`); add `n` writes `seed ^ n`.
    seed: u32,
    /// Adds that succeeded (the guest numbers its adds the same way, from 1).
    adds: std::sync::atomic::AtomicU64,
    /// Each block the guest wrote, with the add numbers that wrote it.
    written: Mutex<std::collections::BTreeMap<u64, Vec<u64>>>,
}

impl Guest {
    fn api(&self) -> ApiClient {
        ApiClient::new(self.sock.lock().unwrap().clone(), Duration::from_secs(60))
    }

    /// Moves the VM (`migrate`: live, over tcp, to the other borrower host; `vmm-restart`:
    /// `--local` migration to a new lendvm on the same host) while its disk is attached and
    /// its guest's I/O runs. Returns the source, which has exited, when it worked.
    fn migrate(&self, kind: FaultKind, rec: &Recorder) -> Option<Vm> {
        let gen = self.moves.fetch_add(1, Ordering::SeqCst) + 1;
        let from = *self.host.lock().unwrap();
        let to = match (kind, from) {
            (FaultKind::Migrate, "b1") => "b2",
            (FaultKind::Migrate, _) => "b1",
            _ => from,
        };
        let local = kind == FaultKind::VmmRestart;
        let sock = self.out.join(format!("{}-{gen}.sock", self.name));
        let url = if local {
            format!(
                "unix:{}",
                self.out.join(format!("{}-{gen}.mig", self.name)).display()
            )
        } else {
            format!("tcp:{}:{}", host_ip(to), 7900 + gen % 100)
        };
        let p = rec.begin(Op::Api {
            process: self.name.clone(),
            call: format!("{} to {to}", kind.name()),
        });
        let ns = format!("{}-{to}", self.net_tag);
        let mut dst = in_netns(Some(&ns), || {
            Vm::start_args(
                &[
                    "--cluster",
                    &self.file.display().to_string(),
                    "--api-socket",
                    &sock.display().to_string(),
                ],
                "warn",
            )
        });
        let dst_api = ApiClient::new(&sock, Duration::from_secs(60));
        // A destination may not start at all (lendvm refuses to start while etcd is out of
        // its reach): then the migration failed, and the source goes on.
        let up = poll(Duration::from_secs(20), || {
            if dst_api.ping().is_ok() {
                Some(true)
            } else if !dst.running() {
                Some(false)
            } else {
                None
            }
        });
        if up != Some(true) {
            rec.finish(p, Outcome::Fail, None).unwrap();
            eprintln!(
                "chaos: {} {} to {to}: the destination did not start: {}",
                self.name,
                kind.name(),
                dst.stderr().lines().last().unwrap_or_default()
            );
            return None;
        }
        let r = dst_api
            .receive_migration(&api::types::VmReceiveMigrationData {
                receiver_url: url.clone(),
            })
            .and_then(|()| {
                self.api().send_migration(&api::types::VmSendMigrationData {
                    destination_url: url.clone(),
                    local,
                })
            });
        rec.finish(
            p,
            if r.is_ok() {
                Outcome::Ok
            } else {
                Outcome::Fail
            },
            None,
        )
        .unwrap();
        if let Err(e) = r {
            eprintln!("chaos: {} {} to {to} failed: {e}", self.name, kind.name());
            return None;
        }
        let mut src = std::mem::replace(&mut *self.vm.lock().unwrap(), dst);
        if src.wait_exit(Duration::from_secs(30)).is_none() {
            eprintln!(
                "chaos: {}'s source did not exit after the migration",
                self.name
            );
        }
        *self.sock.lock().unwrap() = sock;
        *self.host.lock().unwrap() = to;
        self.dma_seen.store(0, Ordering::SeqCst);
        Some(src)
    }

    /// Device `id`'s lease state in `vm.info`, `None` when it is not there (or no answer).
    fn state(&self, id: &str) -> Option<LeaseState> {
        self.api().info().ok().and_then(|i| {
            i.remote_devices
                .iter()
                .find(|d| d.id == id)
                .map(|d| d.lease_state)
        })
    }

    /// A guest's write or read of `block` of `device`.
    fn io(&self, device: &str, read: bool, block: u64, seq: u64, sum: u32) -> Op {
        let (vm, device) = (self.name.clone(), device.to_string());
        if read {
            Op::Read {
                vm,
                device,
                block,
                seq,
                sum,
            }
        } else {
            Op::Write {
                vm,
                device,
                block,
                seq,
                sum,
            }
        }
    }

    fn device_event(&self, device: &str, event: DeviceEvent) -> Op {
        Op::Device {
            vm: self.name.clone(),
            device: device.to_string(),
            event,
        }
    }

    /// Adds `device` as `id` through the API (recorded); `attached` recorded when it worked.
    fn add(&self, rec: &Recorder, device: &str, id: &str) -> bool {
        let p = rec.begin(Op::Api {
            process: self.name.clone(),
            call: format!("add {device}"),
        });
        let added = self.api().add_remote_device(&VmAddRemoteDeviceData {
            device: device.parse().unwrap(),
            id: Some(id.into()),
            mode: None,
            replace_lost: true,
            numa_node: None,
        });
        let ok = added.is_ok();
        rec.finish(p, if ok { Outcome::Ok } else { Outcome::Fail }, None)
            .unwrap();
        if ok {
            rec.observe(
                Outcome::Ok,
                self.device_event(device, DeviceEvent::Attached),
            )
            .unwrap();
        } else {
            std::thread::sleep(Duration::from_millis(500));
        }
        ok
    }

    /// Removes `id` (`device`) through the API (recorded), waits until it is gone from
    /// `vm.info` (the guest ejected it, or the VMM took a lost one back) and records
    /// `detached`, or `lost` when `vm.info` showed it lost; ends the cycle.
    fn remove(&self, rec: &Recorder, device: &str, id: &str) {
        let mut saw_lost = self.state(id) == Some(LeaseState::Lost);
        let p = rec.begin(Op::Api {
            process: self.name.clone(),
            call: format!("remove {id}"),
        });
        let removed = self.api().remove_device(&VmRemoveDeviceData {
            id: id.into(),
            force: false,
        });
        rec.finish(
            p,
            if removed.is_ok() {
                Outcome::Ok
            } else {
                Outcome::Fail
            },
            None,
        )
        .unwrap();
        let gone = poll(Duration::from_secs(30), || match self.state(id) {
            None => Some(()),
            Some(LeaseState::Lost) => {
                saw_lost = true;
                None
            }
            Some(_) => None,
        });
        if gone.is_some() || saw_lost {
            let event = if saw_lost {
                DeviceEvent::Lost
            } else {
                DeviceEvent::Detached
            };
            rec.observe(Outcome::Ok, self.device_event(device, event))
                .unwrap();
        }
        self.cycles.fetch_add(1, Ordering::SeqCst);
    }

    fn wrote(&self, block: u64, seq: u64) {
        self.written
            .lock()
            .unwrap()
            .entry(block)
            .or_default()
            .push(seq);
    }

    /// A cycle with the dmatest engine: add it, the guest's verified copy (a page the engine
    /// copies into another, recorded as a write and a read of the VM's own block of the
    /// engine with the add's number), remove it.
    fn dma_cycle(&self, rec: &Recorder) {
        if !self.add(rec, &self.dma, "d1") {
            return;
        }
        let n = self.adds.fetch_add(1, Ordering::SeqCst) + 1;
        // The engine copies within this VM's memory: its "block" is the VM's own (two VMs
        // may take turns on one engine).
        let block = u64::from(self.seed & 0xff);
        let op =
            |read: bool, seq: u64| self.io(&self.dma, read, block, seq, self.seed ^ seq as u32);
        let w = rec.begin(op(false, n));
        let nth = self.dma_seen.load(Ordering::SeqCst);
        let line =
            self.vm
                .lock()
                .unwrap()
                .wait_nth_line("HOTPLUG io dma ", nth, Duration::from_secs(40));
        match line {
            Some(l) => {
                self.dma_seen.fetch_add(1, Ordering::SeqCst);
                let seq: u64 = field(&l, "seq").unwrap().parse().unwrap();
                self.adds.store(seq, Ordering::SeqCst);
                let ok = l.ends_with(" ok");
                let wo = if ok { Outcome::Ok } else { Outcome::Info };
                rec.finish(w, wo, Some(op(false, seq))).unwrap();
                // The guest checked the copy after the engine finished it: a read that
                // begins after the write's acknowledgement.
                std::thread::sleep(Duration::from_millis(2));
                let ro = if ok { Outcome::Ok } else { Outcome::Fail };
                rec.observe(ro, op(true, seq)).unwrap();
            }
            None => rec.finish(w, Outcome::Info, None).unwrap(),
        }
        self.remove(rec, &self.dma, "d1");
    }

    /// One cycle: add, the guest's write and read, remove.
    fn cycle(&self, rec: &Recorder, ios: &mut usize) {
        if !self.add(rec, &self.device, "d0") {
            return;
        }
        let rw = |read: bool, block: u64, seq: u64, sum: u32| {
            self.io(&self.device, read, block, seq, sum)
        };
        // What the guest will write: its add number is this add's (the line confirms it).
        let n = self.adds.fetch_add(1, Ordering::SeqCst) + 1;
        let place = |n: u64| LBA + (n % 1024) * 64;
        let (w, r) = (
            rec.begin(rw(false, place(n), n, self.seed ^ n as u32)),
            rec.begin(rw(true, place(n), n, self.seed ^ n as u32)),
        );
        // A migration due moves the VM now, its disk attached and the guest's I/O running.
        let pending = self.pending.lock().unwrap().take();
        let moved = pending.and_then(|k| self.migrate(k, rec));
        let line = match moved {
            // The guest's line came out of the source before the switch-over, or comes out
            // of the destination (a new console: nothing of it read yet).
            Some(src) => {
                let done = src.count_lines("HOTPLUG io seq=") > *ios;
                let from_src = src.wait_nth_line("HOTPLUG io seq=", *ios, Duration::ZERO);
                // The destination's console is new: nothing of it read yet.
                *ios = 0;
                if done {
                    return self.finish_io(rec, from_src, w, r, n, ios, true);
                } else {
                    let l = self.vm.lock().unwrap().wait_nth_line(
                        "HOTPLUG io seq=",
                        0,
                        Duration::from_secs(40),
                    );
                    if l.is_some() {
                        *ios = 1;
                    }
                    return self.finish_io(rec, l, w, r, n, ios, true);
                }
            }
            None => self.vm.lock().unwrap().wait_nth_line(
                "HOTPLUG io seq=",
                *ios,
                Duration::from_secs(40),
            ),
        };
        self.finish_io(rec, line, w, r, n, ios, false)
    }

    /// Records the guest's write and read of add `n` from its console line `line`, then
    /// removes the disk.
    #[allow(clippy::too_many_arguments)]
    fn finish_io(
        &self,
        rec: &Recorder,
        line: Option<String>,
        w: lendvm_tests::chaos::recorder::Pending,
        r: lendvm_tests::chaos::recorder::Pending,
        n: u64,
        ios: &mut usize,
        counted: bool,
    ) {
        let rw = |read: bool, block: u64, seq: u64, sum: u32| {
            self.io(&self.device, read, block, seq, sum)
        };
        let place = |n: u64| LBA + (n % 1024) * 64;
        match line {
            Some(l) => {
                if !counted {
                    *ios += 1;
                }
                let seq: u64 = field(&l, "seq").unwrap().parse().unwrap();
                let seed = field(&l, "seed").unwrap().trim_start_matches("0x");
                let sum = u32::from_str_radix(seed, 16).unwrap();
                let block: u64 = field(&l, "lba").unwrap().parse().unwrap();
                self.adds.store(seq, Ordering::SeqCst);
                self.wrote(block, seq);
                if l.ends_with(" ok") {
                    rec.finish(w, Outcome::Ok, Some(rw(false, block, seq, sum)))
                        .unwrap();
                    rec.finish(r, Outcome::Ok, Some(rw(true, block, seq, sum)))
                        .unwrap();
                } else {
                    // The guest's test failed somewhere: the write may or may not have
                    // landed, and the read did not verify.
                    rec.finish(w, Outcome::Info, Some(rw(false, block, seq, sum)))
                        .unwrap();
                    rec.finish(r, Outcome::Fail, Some(rw(true, block, seq, sum)))
                        .unwrap();
                }
            }
            None => {
                self.wrote(place(n), n);
                rec.finish(w, Outcome::Info, None).unwrap();
                rec.finish(r, Outcome::Fail, None).unwrap();
            }
        }
        self.remove(rec, &self.device, "d0");
    }
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

#[test]
#[ignore = "makes namespaces and a whole cluster (root): scripts/chaos.sh runs it"]
fn a_cluster_under_fire_keeps_every_promise() {
    require_root();
    let seed = schedule::parse_seed(&env_or("LENDVM_CHAOS_SEED", "1")).unwrap();
    let minutes = schedule::parse_minutes(&env_or("LENDVM_CHAOS_MINUTES", "3")).unwrap();
    let faults = match std::env::var("LENDVM_CHAOS_FAULTS") {
        Ok(s) => FaultKind::parse_list(&s).unwrap(),
        Err(_) => FaultKind::ALL.to_vec(),
    };
    let length_ms = minutes * 60_000;
    let plan =
        Schedule::generate(seed, length_ms, SETTLE_MS, &faults, &Topology::default()).unwrap();
    let out = PathBuf::from(env_or(
        "LENDVM_CHAOS_OUT",
        &format!("{}/../target/chaos/seed-{seed}", env!("CARGO_MANIFEST_DIR")),
    ));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    eprintln!(
        "chaos: seed {seed}, {minutes} min, {} faults, output in {}",
        plan.steps.len(),
        out.display()
    );

    // Declared first: dropped last, after every process in the namespaces is gone.
    let net = Net::make();
    let mut stores = Stores {
        tag: net.tag.clone(),
        mounts: Vec::new(),
    };
    let hosts: Vec<MemberHost> = ETCD
        .iter()
        .map(|h| MemberHost {
            ip: host_ip(h),
            netns: Some(net.ns(h)),
        })
        .collect();
    // As in production: clients over TLS with certificates, and an etcd user of their own.
    let mut members = EtcdCluster::start_on(&hosts, true, true);
    members.enable_auth("lendvm", "chaos-password-4d1f");
    let etcd = Mutex::new(members);
    let file = {
        let e = etcd.lock().unwrap();
        let t = e.tls.as_ref().unwrap();
        let (user, password) = e.user.clone().unwrap();
        let eps: Vec<String> = e.endpoints().iter().map(|x| format!("\"{x}\"")).collect();
        let src = format!(
            "version = 1\ntoken = \"{TOKEN}\"\n\
             [link]\nheartbeat_ms = 250\npeer_timeout_ms = 3000\nconnect_timeout_ms = 2000\n\
             [directory]\netcd = [{}]\nprefix = \"{}\"\nlease_ttl_s = 5\n\
             ca = \"{}\"\ncert = \"{}\"\nkey = \"{}\"\n\
             user = \"{user}\"\npassword_file = \"{}\"\n",
            eps.join(", "),
            e.prefix,
            t.ca.display(),
            t.client_cert.display(),
            t.client_key.display(),
            password.display()
        );
        let p = out.join("cluster.toml");
        ntb::config::write_private_file(&p, &src).unwrap();
        p
    };
    let lenders: Vec<Arc<Lender>> = LENDERS
        .iter()
        .map(|h| {
            let l = Arc::new(Lender {
                host: h,
                ns: net.ns(h),
                file: file.clone(),
                dir: out.clone(),
                proc: Mutex::new(None),
                restarts: AtomicUsize::new(0),
            });
            stores.mount(&l.store());
            l.start();
            l
        })
        .collect();
    // Every borrower host reaches every lender through a fault proxy (passing by default).
    let proxies: Vec<((&str, &str), Proxy)> = BORROWERS
        .iter()
        .flat_map(|b| LENDERS.iter().enumerate().map(move |(i, l)| (*b, *l, i)))
        .map(|(b, l, i)| ((l, b), Proxy::start(&net, b, l, i)))
        .collect();
    let mut guests = Vec::new();
    for (b, bh) in BORROWERS.iter().enumerate() {
        for v in 0..2 {
            let k = b * 2 + v;
            let name = format!("{bh}-vm{v}");
            let sock = out.join(format!("{name}.sock"));
            let seed = 0x4348_0000u32 + k as u32;
            let cmdline = format!(
                "tests=hotplug rounds=1000000 seqio=1 seed={seed:#x} lba={LBA} wait_ms=3600000 \
                 total_ms=3600000"
            );
            let vm = in_netns(Some(&net.ns(bh)), || {
                Vm::start(
                    "64M",
                    &[
                        "--cluster",
                        &file.display().to_string(),
                        "--api-socket",
                        &sock.display().to_string(),
                        "--cmdline",
                        &cmdline,
                    ],
                )
            });
            vm.wait_api();
            vm.expect_line("HOTPLUG ready", BOOT_TIMEOUT);
            guests.push(Arc::new(Guest {
                name,
                device: format!("{}:{}", LENDERS[k % 3], DISKS[k / 3]),
                dma: format!("{}:{DMA}", LENDERS[(k + 1) % 3]),
                dma_seen: AtomicUsize::new(0),
                sock: Mutex::new(sock.clone()),
                vm: Mutex::new(vm),
                host: Mutex::new(*bh),
                pending: Mutex::new(None),
                moves: AtomicUsize::new(0),
                net_tag: net.tag.clone(),
                file: file.clone(),
                out: out.clone(),
                churn: AtomicBool::new(false),
                cycles: AtomicUsize::new(0),
                seed,
                adds: std::sync::atomic::AtomicU64::new(0),
                written: Mutex::new(std::collections::BTreeMap::new()),
            }));
        }
    }

    let rec = Arc::new(Recorder::create(&out.join("history.jsonl")).unwrap());
    let t0_mono = audit::monotonic_ms().saturating_sub(rec.now_ms());
    let running = Arc::new(AtomicBool::new(true));
    let paused = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = guests
        .iter()
        .map(|g| {
            let (g, rec, running, paused) =
                (g.clone(), rec.clone(), running.clone(), paused.clone());
            std::thread::spawn(move || {
                let mut ios = 0;
                while running.load(Ordering::SeqCst) {
                    if paused.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(50));
                        continue;
                    }
                    // Every third cycle copies with a dmatest engine.
                    if g.cycles.load(Ordering::SeqCst) % 3 == 2 {
                        g.dma_cycle(&rec);
                    } else {
                        g.cycle(&rec, &mut ios);
                    }
                    if !g.churn.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(300));
                    }
                }
            })
        })
        .collect();

    // Baseline: every VM has done a cycle (first-use allocations are made), workloads
    // held between cycles, parked threads expired.
    let warm = poll(Duration::from_secs(120), || {
        guests
            .iter()
            .all(|g| g.cycles.load(Ordering::SeqCst) >= 1)
            .then_some(())
    });
    assert!(warm.is_some(), "the VMs did not complete a first cycle");
    let snapshot = |phase: Phase| {
        for l in &lenders {
            if let Some(pid) = l.pid() {
                let mut counts = proc_counts(pid as u32);
                counts.extend(lender_gauges(&l.ns, l.host));
                // The leases it holds by its own records: those of its audit log granted
                // and not ended.
                let a = std::fs::read_to_string(out.join(format!("{}.audit.jsonl", l.host)))
                    .unwrap_or_default();
                let open = audit::entries(&a, 0).unwrap().iter().fold(0i64, |n, e| {
                    n + match e.op {
                        Op::LeaseGrant { .. } => 1,
                        Op::LeaseEnd { .. } => -1,
                        _ => 0,
                    }
                });
                counts.insert("leases".into(), open.max(0) as u64);
                rec.observe(
                    Outcome::Ok,
                    Op::Resources {
                        daemon: l.host.to_string(),
                        phase,
                        counts,
                    },
                )
                .unwrap();
            }
        }
        for g in &guests {
            let pid = g.vm.lock().unwrap().pid();
            let mut counts = proc_counts(pid);
            // What the VMM holds for lent devices: leases, memslots, GSIs, irqfds,
            // ioeventfds, pinned guest RAM, P2P mappings.
            let c = g
                .api()
                .info()
                .ok()
                .and_then(|i| i.counters)
                .unwrap_or_else(|| panic!("{}: vm.info has no counters", g.name));
            for (k, v) in [
                ("devices", c.devices),
                ("leases", c.leases),
                ("memslots", c.memslots),
                ("gsis", c.gsis),
                ("irqfds", c.irqfds),
                ("ioeventfds", c.ioeventfds),
                ("pinned_bytes", c.pinned_bytes),
                ("p2p_mappings", c.p2p_mappings),
            ] {
                counts.insert(k.to_string(), v);
            }
            rec.observe(
                Outcome::Ok,
                Op::Resources {
                    daemon: g.name.clone(),
                    phase,
                    counts,
                },
            )
            .unwrap();
        }
    };
    let quiesce = |on: bool| {
        paused.store(on, Ordering::SeqCst);
        if on {
            // A cycle in progress ends within its bounds (40 s I/O, 30 s eject).
            std::thread::sleep(Duration::from_secs(12));
        }
    };
    quiesce(true);
    snapshot(Phase::Baseline);
    quiesce(false);

    // Faults, on the schedule's clock (ms since `start`).
    let start = Instant::now();
    let mut events: Vec<(u64, bool, usize)> = Vec::new();
    for (i, s) in plan.steps.iter().enumerate() {
        events.push((s.at_ms, true, i));
        events.push((s.heal_ms, false, i));
    }
    events.sort();
    let paused_etcd: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    let mut restarts = Vec::new();
    for (at, inject, i) in events {
        let s = &plan.steps[i];
        let wait = Duration::from_millis(at).saturating_sub(start.elapsed());
        std::thread::sleep(wait);
        let (kind, target) = (s.kind.name().to_string(), s.target.clone());
        let lender = |t: &str| {
            lenders
                .iter()
                .find(|l| l.host == t.split(['|', '<']).next().unwrap())
                .unwrap()
                .clone()
        };
        eprintln!(
            "chaos: {} ms {} {kind} on {target}",
            start.elapsed().as_millis(),
            if inject { "inject" } else { "heal" }
        );
        match (s.kind, inject) {
            (FaultKind::LenderKill, true) => lender(&target).kill(),
            (FaultKind::LenderKill, false) => restarts.push(lender(&target).restart()),
            (FaultKind::LenderPause, true) => lender(&target).signal(libc::SIGSTOP),
            (FaultKind::LenderPause, false) => lender(&target).signal(libc::SIGCONT),
            (FaultKind::EtcdLeaderKill, true) => {
                let mut e = etcd.lock().unwrap();
                let leader = e.wait_leader(Duration::from_secs(20));
                e.members[leader].kill();
                paused_etcd.lock().unwrap().push(leader);
            }
            (FaultKind::EtcdMinority, true) | (FaultKind::EtcdMajority, true) => {
                let n = if s.kind == FaultKind::EtcdMinority {
                    1
                } else {
                    2
                };
                let mut e = etcd.lock().unwrap();
                for m in 0..n {
                    e.members[m].kill();
                    paused_etcd.lock().unwrap().push(m);
                }
            }
            (
                FaultKind::EtcdLeaderKill | FaultKind::EtcdMinority | FaultKind::EtcdMajority,
                false,
            ) => {
                let mut e = etcd.lock().unwrap();
                for m in paused_etcd.lock().unwrap().drain(..) {
                    e.members[m].start();
                }
            }
            (FaultKind::PartitionLenderEtcd, inject) => net.cut(
                lender(&target).host,
                &ETCD,
                if inject { "-A" } else { "-D" },
            ),
            (FaultKind::PartitionLenderBorrowers, inject) => net.cut(
                lender(&target).host,
                &BORROWERS,
                if inject { "-A" } else { "-D" },
            ),
            (FaultKind::PartitionBorrowerEtcd, inject) => {
                let b = target.split('|').next().unwrap();
                net.cut(b, &ETCD, if inject { "-A" } else { "-D" })
            }
            (FaultKind::LinkLoss, inject) => {
                let (l, b) = target.split_once("<->").unwrap();
                let op = if inject { "-A" } else { "-D" };
                for (me, peer) in [(l, b), (b, l)] {
                    let ip = host_ip(peer);
                    net.rule(
                        me,
                        op,
                        &[
                            "INPUT",
                            "-s",
                            &ip,
                            "-m",
                            "statistic",
                            "--mode",
                            "random",
                            "--probability",
                            "0.3",
                            "-j",
                            "DROP",
                        ],
                    );
                }
            }
            (FaultKind::LenderDiskFull, inject) => lender(&target).fill_store(inject),
            (FaultKind::Migrate | FaultKind::VmmRestart, inject) => {
                if inject {
                    let g = guests.iter().find(|g| g.name == target).unwrap();
                    *g.pending.lock().unwrap() = Some(s.kind);
                }
            }
            (FaultKind::LinkDelay | FaultKind::LinkReorder, inject) => {
                let (l, b) = target.split_once("<->").unwrap();
                let p = &proxies.iter().find(|(k, _)| *k == (l, b)).unwrap().1;
                let mode = match (inject, s.kind) {
                    (false, _) => PASS,
                    (true, FaultKind::LinkDelay) => DELAY,
                    _ => JITTER,
                };
                p.mode.store(mode, Ordering::SeqCst);
            }
            (FaultKind::HotplugChurn, inject) => {
                let g = guests.iter().find(|g| g.name == target).unwrap();
                g.churn.store(inject, Ordering::SeqCst);
            }
        }
        let op = if inject {
            Op::Fault { kind, target }
        } else {
            Op::Heal { kind, target }
        };
        rec.observe(Outcome::Ok, op).unwrap();
    }
    let left = Duration::from_millis(plan.length_ms).saturating_sub(start.elapsed());
    std::thread::sleep(left);
    for r in restarts {
        r.join().expect("a lender did not start again");
    }
    running.store(false, Ordering::SeqCst);
    // A workload thread that panicked is a harness failure: counted, reported with the
    // history's verdict, and failing the run.
    let broken = workers.into_iter().filter_map(|w| w.join().err()).count();
    // Every written block, read from its lender's backing file: which write it holds.
    for g in &guests {
        let (lender, bdf) = g.device.split_once(':').unwrap();
        let img = out
            .join(format!("{lender}-store"))
            .join(format!("{lender}-{}.img", &bdf[5..7]));
        let data = std::fs::read(&img).unwrap();
        for (block, seqs) in g.written.lock().unwrap().iter() {
            let at = (block * 512) as usize;
            let here = &data[at..at + 4096];
            let (seq, sum) = seqs
                .iter()
                .map(|n| (*n, g.seed ^ *n as u32))
                .find(|(_, seed)| pattern(*seed, 4096) == here)
                .unwrap_or((0, 0));
            rec.observe(
                Outcome::Ok,
                Op::BackingRead {
                    lender: lender.to_string(),
                    device: g.device.clone(),
                    block: *block,
                    seq,
                    sum,
                },
            )
            .unwrap();
        }
    }
    // Parked threads (10 s) expire before the final count.
    std::thread::sleep(Duration::from_secs(12));
    snapshot(Phase::Final);
    let rec = Arc::try_unwrap(rec).ok().expect("recorder still shared");
    rec.close().unwrap();

    // The lenders' own records join the history.
    let mut text = std::fs::read_to_string(out.join("history.jsonl")).unwrap();
    for h in LENDERS {
        let a = std::fs::read_to_string(out.join(format!("{h}.audit.jsonl"))).unwrap();
        for e in audit::entries(&a, t0_mono).unwrap() {
            text.push_str(&serde_json::to_string(&e).unwrap());
            text.push('\n');
        }
    }
    std::fs::write(out.join("history.jsonl"), &text).unwrap();
    let entries = history::read(text.as_bytes()).unwrap();
    let report = check(&entries, &Bounds::default());
    let cycles: Vec<String> = guests
        .iter()
        .map(|g| format!("{} {}", g.name, g.cycles.load(Ordering::SeqCst)))
        .collect();
    let summary = format!(
        "seed {seed}, {minutes} min, cycles: {}\n\n{report}",
        cycles.join(", ")
    );
    std::fs::write(out.join("report.md"), &summary).unwrap();
    eprintln!("{summary}");
    drop(guests);
    for l in &lenders {
        l.kill();
    }
    drop(etcd);
    assert!(report.ok(), "the history broke invariants:\n{summary}");
    assert_eq!(
        broken, 0,
        "{broken} workload thread(s) panicked (above)\n{summary}"
    );
    drop(net);
}
