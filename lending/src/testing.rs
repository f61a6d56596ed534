//! Test support (cargo feature `testing`): the real `lenderd` binary as a child process of an
//! integration test, shared by this crate's tests, `api/tests` and `lendvm-tests`.
//!
//! ```no_run
//! # use std::path::Path;
//! # let dir = Path::new("/tmp/t");
//! use lending::testing::{lenderd_binary, Lenderd};
//! let lender = Lenderd::command(lenderd_binary(), "node3", &dir.join("cluster.toml"))
//!     .log(dir.join("lenderd.log"))
//!     .device("0000:00:04.0=dmatest")
//!     .token("s3cret")
//!     .spawn_until_listening(&dir.join("node3.sock"));
//! // ... talk to it; it is SIGKILLed and reaped when `lender` is dropped.
//! # drop(lender);
//! ```
//!
//! Test-only code: failures panic with lenderd's log instead of returning errors, and every
//! wait is bounded ([`READY_TIMEOUT`] by default). Only `std` is used, so a test crate may also
//! compile this file directly (`#[path]`), as this crate's own integration tests do.

#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long [`LenderdCommand::spawn_until`] waits for lenderd to become ready by default.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// `lenderd` next to the running test executable (`target/<profile>/deps/<test>` →
/// `target/<profile>/lenderd`). Integration tests of other crates do not get it built by
/// `cargo test`: run `cargo build --workspace --bins` (same target dir and profile) first.
pub fn lenderd_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test executable has no target/<profile> directory");
    let p = profile_dir.join("lenderd");
    assert!(
        p.is_file(),
        "{} is missing: lenderd is a binary of the lending crate that `cargo test` of other \
         crates does not build; run `cargo build --workspace --bins` (with the same \
         CARGO_TARGET_DIR and profile) first",
        p.display()
    );
    p
}

/// A `lenderd` command line being put together; see [`Lenderd::command`].
pub struct LenderdCommand {
    cmd: Command,
    log: PathBuf,
    timeout: Duration,
}

impl LenderdCommand {
    /// Runs lenderd as user `uid` and group `gid`, no supplementary groups (the test must be
    /// root).
    pub fn user(mut self, uid: u32, gid: u32) -> Self {
        use std::os::unix::process::CommandExt;
        self.cmd.uid(uid).gid(gid);
        self
    }

    /// Where lenderd's stderr (its log) goes; default `lenderd.log` next to the cluster file.
    pub fn log(mut self, path: impl Into<PathBuf>) -> Self {
        self.log = path.into();
        self
    }

    /// `--device SPEC` (`BDF=KIND[:OPTIONS]`).
    pub fn device(mut self, spec: impl AsRef<OsStr>) -> Self {
        self.cmd.arg("--device").arg(spec);
        self
    }

    /// `--device SPEC` for each of `specs`.
    pub fn devices<S: AsRef<OsStr>>(mut self, specs: impl IntoIterator<Item = S>) -> Self {
        for s in specs {
            self = self.device(s);
        }
        self
    }

    /// `--token TOKEN`.
    pub fn token(mut self, token: &str) -> Self {
        self.cmd.args(["--token", token]);
        self
    }

    /// Any other argument.
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.cmd.arg(arg);
        self
    }

    /// Sets an environment variable (`RUST_LOG` is `info` unless set here).
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.cmd.env(key, value);
        self
    }

    /// Removes an inherited environment variable (e.g. `LENDVM_TOKEN`).
    pub fn env_remove(mut self, key: impl AsRef<OsStr>) -> Self {
        self.cmd.env_remove(key);
        self
    }

    /// Bound on the readiness wait of [`Self::spawn_until`] (default [`READY_TIMEOUT`]).
    pub fn ready_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Starts lenderd and polls `ready` every 20 ms until it returns true. Panics, with the
    /// log, if lenderd exits first or is not `what` (e.g. "listening") within the timeout.
    pub fn spawn_until(mut self, what: &str, mut ready: impl FnMut(&Lenderd) -> bool) -> Lenderd {
        let stderr = std::fs::File::create(&self.log)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", self.log.display()));
        let child = self
            .cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {:?}: {e}", self.cmd.get_program()));
        let mut d = Lenderd {
            child,
            log: self.log,
        };
        let t0 = Instant::now();
        while !ready(&d) {
            if let Ok(Some(st)) = d.child.try_wait() {
                panic!("lenderd exited with {st}: {}", d.log());
            }
            assert!(
                t0.elapsed() < self.timeout,
                "lenderd is not {what} after {:?}: {}",
                self.timeout,
                d.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    /// Removes a stale `socket`, starts lenderd and waits until `socket` exists (its shm
    /// control socket is bound).
    pub fn spawn_until_listening(self, socket: &Path) -> Lenderd {
        let _ = std::fs::remove_file(socket);
        self.spawn_until("listening", |_| socket.exists())
    }
}

/// A running lenderd; SIGKILLed and reaped on drop.
pub struct Lenderd {
    pub child: Child,
    /// lenderd's stderr.
    pub log: PathBuf,
}

impl Lenderd {
    /// `BINARY --node NODE --cluster CLUSTER` with `RUST_LOG=info`, stdin and stdout null and
    /// stderr into the log file. Add devices, a token etc., then spawn it.
    pub fn command(binary: impl AsRef<OsStr>, node: &str, cluster: &Path) -> LenderdCommand {
        let mut cmd = Command::new(binary);
        cmd.args(["--node", node, "--cluster"])
            .arg(cluster)
            .env("RUST_LOG", "info");
        LenderdCommand {
            cmd,
            log: cluster.with_file_name("lenderd.log"),
            timeout: READY_TIMEOUT,
        }
    }

    /// lenderd's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Lenderd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Writes `dir/cluster.toml`: a cluster of `nodes` on the shm fabric, each listening on
/// `dir/<node>.sock`; returns its path (load it with `ntb::ClusterConfig::load`).
pub fn shm_cluster_file(dir: &Path, nodes: &[&str]) -> PathBuf {
    let d = dir.display();
    let mut src = String::from("version = 1\n");
    for n in nodes {
        src.push_str(&format!(
            "[[node]]\nname = \"{n}\"\nfabric = \"shm\"\ncontrol = \"{d}/{n}.sock\"\n"
        ));
    }
    let path = dir.join("cluster.toml");
    std::fs::write(&path, src).unwrap();
    path
}
