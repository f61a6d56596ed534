//! Integration tests for lendvm live in tests/tests; this library holds shared helpers.
//!
//! The bare-metal test guest is built by `build.rs`; its path is [`TEST_GUEST`].

pub mod capture;
pub mod chaos;
pub mod crash;
pub mod fio;
pub mod flake;

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Path of the test guest ELF built by `build.rs`.
pub const TEST_GUEST: &str = env!("LENDVM_TEST_GUEST");

/// The word the Linux guests' `barpoke` writes at `offset` of a BAR for `seed`
/// (tests/linux/initramfs/barpoke.c, `pattern`): the host looks for it in the guest's
/// console and in the memory behind the BAR.
pub fn barpoke_word(seed: u64, offset: u64) -> u64 {
    seed.wrapping_mul(0x0100_0000_01b3) ^ offset.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x4c45_4e44
}

/// Path of the `lendvm` binary next to the running test executable
/// (`target/<profile>/deps/<test>` -> `target/<profile>/lendvm`).
pub fn lendvm_binary() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .ok_or_else(|| format!("unexpected test executable path {}", exe.display()))?;
    let bin = profile_dir.join("lendvm");
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(format!(
            "{} not found: run `cargo build --workspace --bins` (same profile and target dir) first",
            bin.display()
        ))
    }
}

/// Result of one `lendvm` run.
#[derive(Debug)]
pub struct Run {
    /// `None` if the process was killed on timeout.
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Run {
    /// Exit code, or `None` if killed by a signal / timeout.
    pub fn code(&self) -> Option<i32> {
        self.status.and_then(|s| s.code())
    }

    /// Whether stdout has a line starting with `prefix`.
    pub fn has_line(&self, prefix: &str) -> bool {
        self.stdout.lines().any(|l| l.starts_with(prefix))
    }
}

fn drain(r: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        if let Some(mut r) = r {
            let _ = r.read_to_end(&mut v);
        }
        String::from_utf8_lossy(&v).into_owned()
    })
}

/// Runs `lendvm` with `args`, killing it after `timeout`.
pub fn run_lendvm(args: &[&str], timeout: Duration) -> Run {
    let bin = lendvm_binary().unwrap_or_else(|e| panic!("{e}"));
    let start = Instant::now();
    let mut child = Command::new(&bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    let out = drain(child.stdout.take());
    let err = drain(child.stderr.take());
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if start.elapsed() > timeout => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("waiting for lendvm: {e}"),
        }
    };
    let elapsed = start.elapsed();
    Run {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
        elapsed,
    }
}
