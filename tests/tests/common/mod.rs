//! Process harness shared by `remote_nvme.rs` and `hotplug.rs`: a temporary cluster file, the
//! real `lenderd` and `lendvm` binaries (found next to the test executable, built by
//! `cargo build --workspace --bins`), line-by-line access to the guest's console, the lender's
//! status, the VMM's REST API, and the `/proc` numbers leak checks need.
//!
//! Every wait is bounded; every child is SIGKILLed and reaped on drop.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::TcpListener;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use api::client::ApiClient;
use lending::protocol::{DeviceState, DeviceStatus, LenderStatus};
pub use lending::testing::Lenderd;
use lendvm_tests::capture::ProcessOutput;
use ntb::ClusterConfig;

pub use lendvm_tests::TEST_GUEST;

/// The cluster token every process of a test uses.
pub const TOKEN: &str = "lendvm-tests-cluster-token-8f3a61c2d4b7e9051a6c";
/// The lender's node name.
pub const LENDER: &str = "node1";
/// Lender-local PCI addresses of the devices it lends.
pub const NVME_BDF: &str = "0000:82:00.0";
pub const DMATEST_BDF: &str = "0000:83:00.0";
/// Identify data the lender's emulated NVMe reports (`lending::open_backends`): the default
/// model, and `LENDVM` + the lender-local address without separators as the serial.
pub const NVME_MODEL: &str = "lendvm NVMe Ctrl";
pub const NVME_SERIAL: &str = "LENDVM000082000";
/// Guest pattern seed used by the tests ("TEST").
pub const SEED: u32 = 0x5445_5354;
/// Generous bound for anything that involves booting the emulated guest.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(60);

/// A binary of this workspace next to the running test executable.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap();
    let bin = dir.join(name);
    assert!(
        bin.is_file(),
        "{} not found: run `cargo build --workspace --bins` (same profile and target dir) first",
        bin.display()
    );
    bin
}

/// Polls `f` every 20 ms until it returns `Some`, for at most `timeout`.
pub fn poll<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if t0.elapsed() > timeout {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Fabric of the lender node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fabric {
    Shm,
    Tcp,
    /// tcp with a shared region: `{dir}/{name}.region` ([`BAR_REGION_SIZE`] bytes, created
    /// here), which the lender maps as it would an NTB BAR and the VM's RAM lives in.
    Bar,
}

/// Size of a [`Fabric::Bar`] node's region file: two 64 MiB VMs (a migration's source and
/// destination) and the control rings at its end.
pub const BAR_REGION_SIZE: u64 = 256 << 20;

/// The `[[node]]` entry of lender `name` on `fabric`, its files in `dir`.
pub fn node_entry(fabric: Fabric, name: &str, dir: &Path) -> String {
    let d = dir.display();
    let body = match fabric {
        Fabric::Shm => format!("fabric = \"shm\"\ncontrol = \"{d}/{name}.sock\""),
        Fabric::Tcp => format!(
            "fabric = \"tcp\"\ncontrol = \"127.0.0.1:{}\"",
            free_tcp_port()
        ),
        Fabric::Bar => {
            let region = dir.join(format!("{name}.region"));
            std::fs::File::create(&region)
                .unwrap()
                .set_len(BAR_REGION_SIZE)
                .unwrap();
            format!(
                "fabric = \"bar\"\ncontrol = \"127.0.0.1:{}\"\nregion = \"{}\"",
                free_tcp_port(),
                region.display()
            )
        }
    };
    format!("[[node]]\nname = \"{name}\"\n{body}\n")
}

/// A temporary directory with `cluster.toml` (inline token) describing one lender node.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub path: PathBuf,
    pub cfg: ClusterConfig,
    pub fabric: Fabric,
}

fn free_tcp_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Cluster {
    /// One lender, `node1`, on `fabric`; plus `node9`, a node nobody serves (unreachable).
    pub fn new(fabric: Fabric) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        let node1 = node_entry(fabric, LENDER, dir.path());
        let src = format!(
            "version = 1\ntoken = \"{TOKEN}\"\n\
             [link]\nheartbeat_ms = 100\npeer_timeout_ms = 1000\nconnect_timeout_ms = 2000\n\
             {node1}\
             [[node]]\nname = \"node9\"\nfabric = \"shm\"\ncontrol = \"{d}/node9.sock\"\n"
        );
        Cluster::from_text(dir, &src, fabric)
    }

    /// A cluster whose `cluster.toml` (mode 0600: it holds the token) is `src`, in `dir`.
    pub fn from_text(dir: tempfile::TempDir, src: &str, fabric: Fabric) -> Cluster {
        let path = dir.path().join("cluster.toml");
        ntb::config::write_private_file(&path, src).unwrap();
        let cfg = ClusterConfig::load(&path).unwrap();
        Cluster {
            dir,
            path,
            cfg,
            fabric,
        }
    }

    /// Two lender nodes, `node1` and `node2`, on `fabric`.
    pub fn two_lenders(fabric: Fabric) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let src = format!(
            "version = 1\ntoken = \"{TOKEN}\"\n\
             [link]\nheartbeat_ms = 100\npeer_timeout_ms = 1000\nconnect_timeout_ms = 2000\n{}{}",
            node_entry(fabric, "node1", dir.path()),
            node_entry(fabric, "node2", dir.path())
        );
        Cluster::from_text(dir, &src, fabric)
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `--memory` for a VM of `size` on this cluster: inside the lender's region on bar.
    pub fn memory(&self, size: &str) -> String {
        match self.fabric {
            Fabric::Bar => format!(
                "{size},shared={}",
                self.file(&format!("{LENDER}.region")).display()
            ),
            _ => size.to_string(),
        }
    }

    /// `lenderd --node node1` lending `devices` (`BDF=KIND[:OPTIONS]`), once it answers a
    /// status request (on tcp too).
    pub fn start_lenderd(&self, devices: &[String]) -> Lenderd {
        let _ = std::fs::remove_file(self.file("node1.sock"));
        Lenderd::command(binary("lenderd"), LENDER, &self.path)
            .log(self.file("lenderd.log"))
            .token(TOKEN)
            .devices(devices)
            .spawn_until("answering status requests", |_| self.status().is_ok())
    }

    /// The lender's status (a fresh control connection each time).
    pub fn status(&self) -> Result<LenderStatus, String> {
        let session = api::lenders::Session {
            local: ntb::NodeId::new("lendvm-tests").unwrap(),
            token: TOKEN.to_string(),
            connect_timeout: Duration::from_secs(2),
        };
        let node = api::lenders::lender(&self.cfg, LENDER).map_err(|e| e.to_string())?;
        let c = session
            .connect(&self.cfg, node)
            .map_err(|e| e.to_string())?;
        c.status().map_err(|e| e.to_string())
    }

    /// Status of the lender's device `bdf`.
    pub fn device(&self, bdf: &str) -> DeviceStatus {
        let st = self.status().unwrap();
        st.devices
            .into_iter()
            .find(|d| d.summary.id == bdf)
            .unwrap_or_else(|| panic!("lender has no device {bdf}"))
    }

    /// Waits until device `bdf` is in a state `pred` accepts.
    pub fn wait_device(&self, bdf: &str, what: &str, pred: impl Fn(&DeviceStatus) -> bool) {
        let mut last = None;
        let ok = poll(Duration::from_secs(10), || {
            let d = self.device(bdf);
            let ok = pred(&d);
            last = Some(d);
            ok.then_some(())
        });
        assert!(ok.is_some(), "device {bdf} not {what}: last {last:?}");
    }

    pub fn wait_available(&self, bdf: &str) {
        self.wait_device(bdf, "available", |d| {
            d.summary.state == DeviceState::Available
        });
    }

    /// The VM the lender says holds `bdf`, if it is lent.
    pub fn lent_to(&self, bdf: &str) -> Option<String> {
        match &self.device(bdf).summary.state {
            DeviceState::Lent { vm, .. } => Some(vm.clone()),
            _ => None,
        }
    }
}

/// A running `lendvm`: console lines as they arrive, stderr, the API socket. SIGKILLed on
/// drop.
pub struct Vm {
    pub child: Child,
    out: ProcessOutput,
    pub api_socket: Option<PathBuf>,
    status: Option<ExitStatus>,
}

impl Vm {
    /// Starts `lendvm --kernel <test guest> --serial stdout --memory <mem>` plus `args`, with
    /// `RUST_LOG=warn` (stderr then holds only problems).
    pub fn start(memory: &str, args: &[&str]) -> Vm {
        Self::start_with_log(memory, args, "warn")
    }

    /// [`Vm::start`] with `RUST_LOG=<log>`.
    pub fn start_with_log(memory: &str, args: &[&str], log: &str) -> Vm {
        let mut full = vec![
            "--kernel", TEST_GUEST, "--serial", "stdout", "--memory", memory,
        ];
        full.extend_from_slice(args);
        Self::spawn(&full, log)
    }

    /// `lendvm --serial stdout` plus `args` and nothing else (no kernel: `--restore`).
    /// The test guest with two vCPUs (the second waits for INIT/SIPI, so saving and
    /// restoring covers more than one), its API on `dir/src.sock` (waited for) and its events
    /// in `dir/<events>`: the source VM of the snapshot and migration tests.
    pub fn start_source(dir: &Path, memory: &str, events: &str, cmdline: &str) -> Vm {
        let sock = dir.join("src.sock").display().to_string();
        let events = format!("path={}", dir.join(events).display());
        let vm = Vm::start(
            memory,
            &[
                "--cpus",
                "2",
                "--api-socket",
                &sock,
                "--event-monitor",
                &events,
                "--cmdline",
                cmdline,
            ],
        );
        vm.wait_api();
        vm
    }

    /// `lendvm` with exactly `args` (no `--serial` added).
    pub fn start_exact(args: &[&str], log: &str) -> Vm {
        Self::spawn(args, log)
    }

    pub fn start_args(args: &[&str], log: &str) -> Vm {
        let mut full = vec!["--serial", "stdout"];
        full.extend_from_slice(args);
        Self::spawn(&full, log)
    }

    /// [`Vm::start`] with extra environment variables.
    pub fn start_env(memory: &str, args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> Vm {
        let mut full = vec![
            "--kernel", TEST_GUEST, "--serial", "stdout", "--memory", memory,
        ];
        full.extend_from_slice(args);
        Self::spawn_env(&full, "warn", env)
    }

    fn spawn(full: &[&str], log: &str) -> Vm {
        Self::spawn_env(full, log, &[])
    }

    fn spawn_env(full: &[&str], log: &str, env: &[(&str, &std::ffi::OsStr)]) -> Vm {
        let api_socket = full
            .iter()
            .position(|a| *a == "--api-socket")
            .and_then(|i| full.get(i + 1))
            .map(PathBuf::from);
        let mut child = Command::new(binary("lendvm"))
            .args(full)
            .envs(env.iter().copied())
            .env("RUST_LOG", log)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = ProcessOutput::capture(&mut child);
        Vm {
            child,
            out,
            api_socket,
            status: None,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the guest printed so far.
    pub fn stdout(&self) -> String {
        let mut s = self.out.lines().join("\n");
        s.push('\n');
        s
    }

    pub fn stderr(&self) -> String {
        self.out.stderr()
    }

    /// Console lines so far.
    pub fn lines(&self) -> Vec<String> {
        self.out.lines()
    }

    /// Waits for the `nth` (0-based) line starting with `prefix`; `None` on timeout or if the
    /// console closed first.
    pub fn wait_nth_line(&self, prefix: &str, nth: usize, timeout: Duration) -> Option<String> {
        self.out.wait_for(Instant::now() + timeout, |lines| {
            lines
                .iter()
                .filter(|(_, l)| l.starts_with(prefix))
                .nth(nth)
                .map(|(_, l)| l.clone())
        })
    }

    /// Waits for the first line starting with `prefix`, failing the test with the console and
    /// stderr if it does not come.
    pub fn expect_line(&self, prefix: &str, timeout: Duration) -> String {
        self.expect_nth_line(prefix, 0, timeout)
    }

    pub fn expect_nth_line(&self, prefix: &str, nth: usize, timeout: Duration) -> String {
        match self.wait_nth_line(prefix, nth, timeout) {
            Some(l) => l,
            None => panic!(
                "no line #{nth} starting with {prefix:?} within {timeout:?}\n--- console\n{}--- stderr\n{}",
                self.stdout(),
                self.stderr()
            ),
        }
    }

    pub fn count_lines(&self, prefix: &str) -> usize {
        self.out
            .lines()
            .iter()
            .filter(|l| l.starts_with(prefix))
            .count()
    }

    /// Waits for the process to exit (bounded); kills it on timeout.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        if self.status.is_some() {
            return self.status;
        }
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                self.status = Some(s);
                self.out.drain(Duration::from_secs(2));
                return self.status;
            }
            if t0.elapsed() > timeout {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Asserts the process exits with `code` in time and the guest reported no failure.
    pub fn expect_exit(&mut self, code: i32, timeout: Duration) {
        let st = self.wait_exit(timeout);
        let out = self.stdout();
        assert_eq!(
            st.and_then(|s| s.code()),
            Some(code),
            "lendvm status {st:?}\n--- console\n{out}--- stderr\n{}",
            self.stderr()
        );
        if code == 0 {
            assert!(
                !out.lines()
                    .any(|l| l.starts_with("TEST ") && l.contains(" fail ")),
                "a guest test failed:\n{out}"
            );
        }
    }

    /// Fails the test (with the console) unless the guest printed `TEST <name> ok`.
    pub fn expect_ok(&self, name: &str, timeout: Duration) -> String {
        let l = self.expect_line(&format!("TEST {name} "), timeout);
        assert!(
            l.starts_with(&format!("TEST {name} ok")),
            "{l}\n--- console\n{}--- stderr\n{}",
            self.stdout(),
            self.stderr()
        );
        l
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        self.status.is_none() && self.child.try_wait().unwrap().is_none()
    }

    /// REST client of this VM (`--api-socket`).
    pub fn api(&self) -> ApiClient {
        ApiClient::new(
            self.api_socket
                .clone()
                .expect("started without --api-socket"),
            Duration::from_secs(30),
        )
    }

    /// Waits until the API socket answers `vmm.ping`.
    pub fn wait_api(&self) {
        let api = self.api();
        let up = poll(Duration::from_secs(20), || api.ping().ok());
        assert!(
            up.is_some(),
            "API socket never answered\n--- stderr\n{}",
            self.stderr()
        );
    }

    /// A `kB` field of `/proc/<pid>/status` (`VmLck`, `VmRSS`, ...).
    pub fn proc_status_kb(&self, field: &str) -> u64 {
        proc_status_kb(self.pid(), field)
    }

    /// Open file descriptors of the VMM process.
    pub fn fd_count(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .unwrap()
            .count()
    }

    /// `fd -> link target` of every open descriptor of the VMM process, sorted.
    pub fn fds(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| {
                let t = std::fs::read_link(e.path()).unwrap_or_default();
                format!("{} -> {}", e.file_name().to_string_lossy(), t.display())
            })
            .collect();
        v.sort();
        v
    }

    /// Writes a little-endian u64 into guest RAM at `gpa` (below 3 GiB) through the VMM's
    /// guest-RAM memfd (`/proc/<pid>/fd/N` → `/memfd:lendvm-guest-ram`; file offset = GPA).
    pub fn write_guest_u64(&self, gpa: u64, v: u64) {
        let dir = format!("/proc/{}/fd", self.pid());
        let fd = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .find(|e| {
                std::fs::read_link(e.path())
                    .map(|t| t.to_string_lossy().starts_with("/memfd:lendvm-guest-ram"))
                    .unwrap_or(false)
            })
            .unwrap_or_else(|| panic!("no guest-ram memfd in {dir}"));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(fd.path())
            .unwrap();
        f.write_all_at(&v.to_le_bytes(), gpa).unwrap();
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A `kB` field of `/proc/<pid>/status`.
pub fn proc_status_kb(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// The guest's test pattern (`tests/guest/src/dma.rs`): u64 word `w` is `seed << 32 | w`.
pub fn pattern(seed: u32, bytes: usize) -> Vec<u8> {
    (0..bytes as u64 / 8)
        .flat_map(|w| ((u64::from(seed) << 32) | w).to_le_bytes())
        .collect()
}

/// Asserts `file` holds the guest's pattern for `lbas` 512-byte blocks from `slba`.
pub fn assert_backing_has_pattern(file: &Path, slba: u64, lbas: u64, seed: u32) {
    let data = std::fs::read(file).unwrap();
    let start = (slba * 512) as usize;
    let len = (lbas * 512) as usize;
    assert!(data.len() >= start + len, "backing file too short");
    let want = pattern(seed, len);
    let got = &data[start..start + len];
    if let Some(i) = (0..len).find(|&i| got[i] != want[i]) {
        panic!(
            "backing file differs from the guest's pattern at byte {:#x} of LBA {slba}+: got {:02x?}, want {:02x?}",
            i,
            &got[i..(i + 8).min(len)],
            &want[i..(i + 8).min(len)]
        );
    }
}

/// Parses `key=value` out of a console line.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// `LENDER:bdf` as an API device spec.
pub fn spec(bdf: &str) -> api::types::RemoteDeviceSpec {
    format!("{LENDER}:{bdf}").parse().unwrap()
}

/// Hot-adds `LENDER:bdf` as `id` through the API (panics with the API's message).
pub fn add(api: &ApiClient, bdf: &str, id: &str) -> api::types::PciDeviceInfo {
    api.add_remote_device(&api::types::VmAddRemoteDeviceData {
        device: spec(bdf),
        id: Some(id.to_string()),
        mode: None,
        replace_lost: false,
        numa_node: None,
    })
    .unwrap_or_else(|e| panic!("add {bdf} as {id}: {e}"))
}

/// Asks the guest to eject `id` (`vm.remove-device` without force).
pub fn remove(api: &ApiClient, id: &str) {
    api.remove_device(&api::types::VmRemoveDeviceData {
        id: id.to_string(),
        force: false,
    })
    .unwrap_or_else(|e| panic!("remove {id}: {e}"))
}

/// Boots the test guest with `cmdline`, the cluster file, an API socket and `extra`
/// arguments, and waits until the API answers.
pub fn boot_with_api(cluster: &Cluster, cmdline: &str, extra: &[&str]) -> Vm {
    boot_with_api_log(cluster, cmdline, extra, "warn")
}

/// [`boot_with_api`] with `RUST_LOG=<log>`.
pub fn boot_with_api_log(cluster: &Cluster, cmdline: &str, extra: &[&str], log: &str) -> Vm {
    let cluster_arg = cluster.path.display().to_string();
    let sock = cluster.file("api.sock").display().to_string();
    let mut args = vec![
        "--cluster",
        &cluster_arg,
        "--api-socket",
        &sock,
        "--cmdline",
        cmdline,
    ];
    args.extend_from_slice(extra);
    let vm = Vm::start_with_log("64M", &args, log);
    vm.wait_api();
    vm
}

/// A cluster file without nodes whose `[directory]` table names every member of `etcd`
/// (lenders register there and VMMs find them there), with `lease_ttl_s = ttl_s` and `extra`
/// TOML tables (e.g. `[link]` timers) before it.
pub fn directory_file(
    dir: &Path,
    etcd: &lending::directory::testing::EtcdCluster,
    ttl_s: u64,
    extra: &str,
) -> PathBuf {
    let eps: Vec<String> = etcd
        .endpoints()
        .iter()
        .map(|e| format!("\"{e}\""))
        .collect();
    let src = format!(
        "version = 1\ntoken = \"{TOKEN}\"\n{extra}\
         [directory]\netcd = [{}]\nprefix = \"{}\"\nlease_ttl_s = {ttl_s}\n",
        eps.join(", "),
        etcd.prefix
    );
    let p = dir.join("cluster.toml");
    ntb::config::write_private_file(&p, &src).unwrap();
    p
}

/// `GET path` over HTTP/1.0 on 127.0.0.1:`port` (of the calling thread's network
/// namespace): the status and the body.
pub fn http_get(port: u16, path: &str, accept: Option<&str>) -> Result<(u16, String), String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let accept = accept
        .map(|a| format!("Accept: {a}\r\n"))
        .unwrap_or_default();
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n{accept}\r\n")
        .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n").ok_or("no header end")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or("no status")?;
    Ok((status, body.to_string()))
}
