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

/// The line `barpoke` prints when the word at `offset` read back as written for `seed`.
pub fn barpoke_ok_line(seed: u64, offset: u64) -> String {
    format!(
        "BARPOKE {offset:#018x} {:#018x} ok",
        barpoke_word(seed, offset)
    )
}

/// Checks the Linux guests' `LENDVM-BAR ok dev=.. start=0x.. size=0x.. flags=0x..` line
/// (`/init`'s `lendvm_bar=`) as a GPU aperture must be placed: `size` bytes, past 4 GiB,
/// aligned to its size, 64-bit prefetchable (IORESOURCE_MEM_64 | IORESOURCE_PREFETCH in the
/// sysfs flags). Returns where the guest's kernel put it, or what is wrong.
pub fn check_bar_placement(line: &str, size: u64) -> Result<u64, String> {
    if !line.contains("LENDVM-BAR ok ") {
        return Err(format!("not an ok line: {line}"));
    }
    let hex = |k: &str| {
        let v = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix(k).and_then(|r| r.strip_prefix('=')))
            .ok_or_else(|| format!("no {k}= in {line}"))?;
        u64::from_str_radix(v.trim_start_matches("0x"), 16)
            .map_err(|e| format!("{k}={v} in {line}: {e}"))
    };
    let (start, got, flags) = (hex("start")?, hex("size")?, hex("flags")?);
    if got != size {
        return Err(format!("{got:#x} bytes, not {size:#x}: {line}"));
    }
    if start < 1 << 32 || !start.is_multiple_of(size) {
        return Err(format!(
            "at {start:#x}: not past 4 GiB and aligned to its size ({line})"
        ));
    }
    if flags & 0x10_2000 != 0x10_2000 {
        return Err(format!("not 64-bit prefetchable: {line}"));
    }
    Ok(start)
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

#[cfg(test)]
mod bar_line_tests {
    use super::*;

    const OK: &str = "LENDVM-BAR ok dev=0000:00:02.0 start=0x0000001000000000 \
                      size=0x1000000000 flags=0x000000000014220c";

    /// The placement check accepts what the busybox case's guest printed, and names each way
    /// a line can be wrong.
    #[test]
    fn a_bar_line_is_checked_for_size_place_alignment_and_kind() {
        assert_eq!(check_bar_placement(OK, 64 << 30), Ok(64 << 30));
        let err = |line: &str, size: u64| check_bar_placement(line, size).unwrap_err();
        assert!(err(OK, 16 << 30).contains("bytes, not 0x400000000"));
        let low = OK.replace("start=0x0000001000000000", "start=0x00000000c0000000");
        assert!(err(&low, 64 << 30).contains("not past 4 GiB"));
        let skew = OK.replace("start=0x0000001000000000", "start=0x0000001000001000");
        assert!(err(&skew, 64 << 30).contains("aligned to its size"));
        let plain = OK.replace("flags=0x000000000014220c", "flags=0x0000000000040200");
        assert!(err(&plain, 64 << 30).contains("not 64-bit prefetchable"));
        assert!(err("LENDVM-BAR fail no 1b36:1105 function", 1).contains("not an ok line"));
        let torn = OK.replace("size=0x1000000000", "size=0xzz");
        assert!(err(&torn, 64 << 30).contains("size=0xzz"));
        assert_eq!(
            barpoke_ok_line(0x4c45, 0),
            "BARPOKE 0x0000000000000000 0x004c45004cc4d77b ok"
        );
    }
}
