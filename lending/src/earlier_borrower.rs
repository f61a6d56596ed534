//! Test support (this crate's unit tests, and the cargo feature `testing`): a borrower that
//! keeps a duplicate of every fd it received, returns its lease, and after a second borrower
//! took the same device and wrote its registers, maps, reads and writes every kept fd. It
//! must get nothing of the device: a failed `mmap`, `SIGBUS`, or bytes that are not the
//! registers (docs/SECURITY.md, "Borrower vs later borrower").
//!
//! Shared by the fake-backed `server::bars::tests::an_earlier_borrower_keeps_nothing_of_a_vfio_bar`
//! and by `tests/vfio_kernel.rs`, which runs the same against Linux's vfio-pci inside L1
//! (scripts/test-vfio.sh). The earlier borrower is a child process: the test re-executes
//! itself with [`CHILD_ENV`] set, and the test function hands over to [`child`] first.
//!
//! Test-only code: failures panic.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::Arc;

use ntb::{ClusterConfig, Fabric, PeerWindow, SocketFabric};

use crate::client::Lease;
use crate::inventory::Inventory;
use crate::server::{BackgroundLender, Lender};
use crate::LenderClient;

/// Set (to the cluster file) in the re-executed test: it is the earlier borrower.
pub const CHILD_ENV: &str = "LENDING_BARS_EARLIER_BORROWER";
/// The cluster's token.
pub const TOKEN: &str = "bar-paths-cluster-token";
/// The lender's node; the earlier borrower's; the second borrower's.
pub const LENDER: &str = "lender";
pub const EARLIER: &str = "a";
pub const SECOND: &str = "b";

/// The device and what the second borrower writes to it.
#[derive(Debug, Clone, Copy)]
pub struct Setup<'a> {
    /// The device's id in the lender's inventory.
    pub device: &'a str,
    /// The BAR whose registers are written (it must have a fabric window).
    pub bar: u8,
    /// Where in that BAR (4-byte aligned).
    pub offset: u64,
    /// What the second borrower writes there (whole 32-bit words: plain read/write
    /// registers of the device).
    pub pattern: &'a [u8],
    /// What the earlier borrower writes through every kept fd (as long as `pattern`).
    pub attack: &'a [u8],
}

/// What a kept fd gave when mapped (offset 0, shared, read/write), read and written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tried {
    /// `mmap` refused it (the errno).
    NoMap(i32),
    /// Mapped, and the first access faulted.
    Sigbus,
    /// Mapped and read: the bytes are not the device's registers.
    OtherBytes,
    /// The second borrower's registers showed, through the mapping or `pread`.
    Registers,
    /// The probe ended otherwise (another signal, an exit code of nobody's).
    Odd(i32),
}

impl Tried {
    /// Nothing of the device: a failed map, a fault, or other bytes.
    pub fn got_nothing(self) -> bool {
        matches!(self, Tried::NoMap(_) | Tried::Sigbus | Tried::OtherBytes)
    }

    fn word(self) -> String {
        match self {
            Tried::NoMap(e) => format!("nomap:{e}"),
            Tried::Sigbus => "sigbus".into(),
            Tried::OtherBytes => "other-bytes".into(),
            Tried::Registers => "registers".into(),
            Tried::Odd(n) => format!("odd:{n}"),
        }
    }

    fn from_word(w: &str) -> Tried {
        let num = |s: &str| s.parse().unwrap();
        match w.split_once(':') {
            Some(("nomap", e)) => Tried::NoMap(num(e)),
            Some(("odd", n)) => Tried::Odd(num(n)),
            _ => match w {
                "sigbus" => Tried::Sigbus,
                "other-bytes" => Tried::OtherBytes,
                "registers" => Tried::Registers,
                _ => panic!("the earlier borrower said {w:?}"),
            },
        }
    }
}

impl std::fmt::Display for Tried {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.word())
    }
}

/// `tried` in one line: how many fds of each kind gave what (`4 anon_inode:[eventfd]
/// nomap:19, 1 socket nomap:19`).
pub fn summary(tried: &[(String, Tried)]) -> String {
    let mut n = std::collections::BTreeMap::<(String, String), usize>::new();
    for (what, t) in tried {
        // Sockets and pipes differ only by their inode number.
        let kind = match what.split_once(":[") {
            Some((k, _)) if k == "socket" || k == "pipe" => k.to_string(),
            _ => what.clone(),
        };
        *n.entry((kind, t.word())).or_default() += 1;
    }
    n.iter()
        .map(|((kind, t), n)| format!("{n} {kind} {t}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A cluster file of three shm nodes (the lender and both borrowers) in `dir`. `sealed`:
/// `[link] require_sealed_windows` (real sysfs files pass the seal check as fixed-extent;
/// a fake resource file, a plain file, does not).
pub fn shm_cluster(dir: &Path, sealed: bool) -> PathBuf {
    let d = dir.display();
    let head = format!("version = 1\n[link]\nrequire_sealed_windows = {sealed}\n");
    let src = [LENDER, EARLIER, SECOND].iter().fold(head, |s, n| {
        s + &format!("[[node]]\nname = \"{n}\"\nfabric = \"shm\"\ncontrol = \"{d}/{n}.sock\"\n")
    });
    let path = dir.join("cluster.toml");
    std::fs::write(&path, src).unwrap();
    path
}

/// A real [`Lender`] of `inv` on the cluster's [`LENDER`] node, served in the background
/// until the result is dropped.
pub fn serve(cfg: &ClusterConfig, inv: Arc<Inventory>) -> BackgroundLender {
    let listener = SocketFabric::from_cluster(cfg, LENDER)
        .unwrap()
        .listen()
        .unwrap();
    BackgroundLender::start(Lender::new(inv, LENDER, TOKEN), listener).unwrap()
}

/// In the re-executed test (when [`CHILD_ENV`] is set): plays the earlier borrower and
/// returns true; the test function then returns. Otherwise returns false.
pub fn child(setup: &Setup<'_>) -> bool {
    let Ok(cluster) = std::env::var(CHILD_ENV) else {
        return false;
    };
    let cfg = ClusterConfig::load(Path::new(&cluster)).unwrap();
    let before = open_fds();
    let c = LenderClient::connect(&cfg, EARLIER, LENDER, TOKEN, EARLIER).unwrap();
    let lease = c.borrow(setup.device, "vm-a").unwrap();
    let window = lease.bar_window(setup.bar).unwrap();
    let kept: Vec<(String, OwnedFd)> = open_fds()
        .difference(&before)
        .filter_map(|&fd| {
            let what = std::fs::read_link(format!("/proc/self/fd/{fd}"))
                .map_or_else(|e| e.to_string(), |p| p.display().to_string());
            // SAFETY: F_DUPFD_CLOEXEC on an fd number of this process; a closed one
            // fails and is skipped.
            let d = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
            // SAFETY: `d` is a new fd owned by nothing else.
            (d >= 0).then(|| (what.replace(' ', "_"), unsafe { OwnedFd::from_raw_fd(d) }))
        })
        .collect();
    drop(window);
    lease.return_device().unwrap();
    drop(c);
    println!("RETURNED {}", kept.len());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    for (what, fd) in &kept {
        let t = try_fd(fd.as_fd(), setup.offset, setup.pattern, Some(setup.attack));
        println!("KEPT {} {what}", t.word());
    }
    println!("TRIED");
    std::io::stdout().flush().unwrap();
    true
}

/// The earlier borrower, a child process running the test `test` again.
pub struct EarlierBorrower {
    child: Child,
    out: BufReader<ChildStdout>,
    kept: usize,
}

impl EarlierBorrower {
    /// Starts it (`ignored`: the test is an ignored one) and waits until it has borrowed
    /// `setup.device` on `cluster`, kept its fds and returned the lease.
    pub fn spawn(test: &str, ignored: bool, cluster: &Path) -> EarlierBorrower {
        let mut args = vec![test, "--exact", "--nocapture", "--test-threads=1"];
        if ignored {
            args.push("--ignored");
        }
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(args)
            .env(CHILD_ENV, cluster)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let mut b = EarlierBorrower {
            child,
            out,
            kept: 0,
        };
        let said = b.said();
        let n = said.strip_prefix("RETURNED ");
        b.kept = n
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("it said {said:?}"));
        b
    }

    /// How many fds it kept.
    pub fn kept(&self) -> usize {
        self.kept
    }

    /// Tells it to try every kept fd; waits for it to end; returns what each fd (named by
    /// its `/proc/self/fd` link) gave.
    pub fn try_kept(mut self) -> Vec<(String, Tried)> {
        writeln!(self.child.stdin.as_mut().unwrap(), "go").unwrap();
        let mut tried = Vec::new();
        loop {
            let line = self.said();
            if line == "TRIED" {
                break;
            }
            if let Some(rest) = line.strip_prefix("KEPT ") {
                let (t, what) = rest.split_once(' ').unwrap_or((rest, ""));
                tried.push((what.to_string(), Tried::from_word(t)));
            }
        }
        let st = self.child.wait().unwrap();
        assert!(st.success(), "the earlier borrower ended with {st}");
        tried
    }

    /// The next line of its protocol (`RETURNED n`, `KEPT tried what`, `TRIED`), from
    /// where it starts: libtest's "test NAME ... " may begin the same line.
    fn said(&mut self) -> String {
        let mut line = String::new();
        for _ in 0..256 {
            line.clear();
            assert_ne!(
                self.out.read_line(&mut line).unwrap(),
                0,
                "the earlier borrower ended"
            );
            let at = ["RETURNED ", "KEPT ", "TRIED"]
                .iter()
                .filter_map(|w| line.find(w))
                .min();
            if let Some(at) = at {
                return line[at..].trim().to_string();
            }
        }
        panic!("the earlier borrower said nothing of its protocol");
    }
}

impl Drop for EarlierBorrower {
    fn drop(&mut self) {
        // Only when the test failed before it ended.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The second borrower: borrows the device, turns on memory space and bus master, and
/// writes its registers; the lease lasts as long as this value.
pub struct SecondBorrower {
    setup_offset: u64,
    len: usize,
    window: Box<dyn PeerWindow>,
    _lease: Lease,
    _client: LenderClient,
}

impl SecondBorrower {
    /// Borrows `setup.device`, enables it, writes `setup.pattern` at `setup.offset` of
    /// `setup.bar` and checks that the device holds it.
    pub fn start(cfg: &ClusterConfig, setup: &Setup<'_>) -> SecondBorrower {
        let c = LenderClient::connect(cfg, SECOND, LENDER, TOKEN, SECOND).unwrap();
        let lease = c.borrow(setup.device, "vm-b").unwrap();
        // Memory space and bus master on (the lender owns both bits and keeps decoding on).
        lease.config_write(4, &[0x06, 0x00]).unwrap();
        let window = lease.bar_window(setup.bar).unwrap();
        window.write_at(setup.offset, setup.pattern).unwrap();
        let b = SecondBorrower {
            setup_offset: setup.offset,
            len: setup.pattern.len(),
            window,
            _lease: lease,
            _client: c,
        };
        assert_eq!(
            b.registers(),
            setup.pattern,
            "the device holds what was written"
        );
        b
    }

    /// The registers written, read from the device now.
    pub fn registers(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        self.window.read_at(self.setup_offset, &mut v).unwrap();
        v
    }
}

/// The fds this process has open.
fn open_fds() -> BTreeSet<i32> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// Maps `fd` from offset 0 (shared, read/write; read-only if it must), reads `pattern.len()`
/// bytes at `offset` as 32-bit loads (registers are read so) and `pread`s them, then, with
/// `attack`, writes it there both ways. Runs in a forked process, so that a `SIGBUS` is an
/// answer and not the end of the caller.
pub fn try_fd(fd: BorrowedFd<'_>, offset: u64, pattern: &[u8], attack: Option<&[u8]>) -> Tried {
    assert!(offset.is_multiple_of(4) && pattern.len().is_multiple_of(4) && !pattern.is_empty());
    assert!(attack.is_none_or(|a| a.len() == pattern.len()));
    // SAFETY: sysconf has no memory effects.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap();
    let off = usize::try_from(offset).unwrap();
    let len = (off + pattern.len()).div_ceil(page) * page;
    // Allocated before the fork: the forked process may not allocate (another thread may
    // hold the allocator's lock).
    let mut seen = vec![0u8; pattern.len()];
    // SAFETY: fork; the new process only runs `probe` (system calls, volatile accesses,
    // no allocation) and `_exit`s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let code = probe(fd.as_raw_fd(), off, len, pattern, attack, &mut seen);
        // SAFETY: ends the forked process without running anything of the parent's.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child; `status` is a valid out-parameter.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(r, pid, "waitpid: {}", std::io::Error::last_os_error());
    if libc::WIFSIGNALED(status) {
        return match libc::WTERMSIG(status) {
            libc::SIGBUS => Tried::Sigbus,
            s => Tried::Odd(-s),
        };
    }
    match libc::WEXITSTATUS(status) {
        0 => Tried::OtherBytes,
        1 => Tried::Registers,
        c @ 2..=255 => Tried::NoMap(c - 2),
        c => Tried::Odd(c),
    }
}

/// The forked half of [`try_fd`]: exit code 0 other bytes, 1 the pattern, 2 + errno no map.
fn probe(
    fd: i32,
    off: usize,
    len: usize,
    pattern: &[u8],
    attack: Option<&[u8]>,
    seen: &mut [u8],
) -> i32 {
    let map = |prot| {
        // SAFETY: a fresh mapping at a kernel-chosen address; the result is checked.
        unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) }
    };
    let errno = || std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    let mut writable = attack.is_some();
    let mut p = map(libc::PROT_READ | libc::PROT_WRITE);
    if p == libc::MAP_FAILED && errno() == libc::EACCES {
        writable = false;
        p = map(libc::PROT_READ);
    }
    let mut shown = false;
    let no_map = if p == libc::MAP_FAILED {
        Some(errno())
    } else {
        let words = p.cast::<u8>().wrapping_add(off).cast::<u32>();
        for (i, w) in seen.chunks_exact_mut(4).enumerate() {
            // SAFETY: `off + pattern.len()` lies within the `len` mapped bytes, 4-byte
            // aligned (the map is page aligned, `off` a multiple of 4); a fault past the
            // file's end ends this process with SIGBUS, which is an answer.
            w.copy_from_slice(&unsafe { std::ptr::read_volatile(words.add(i)) }.to_ne_bytes());
        }
        shown = seen == pattern;
        if let Some(a) = attack.filter(|_| writable) {
            for (i, w) in a.chunks_exact(4).enumerate() {
                let v = u32::from_ne_bytes([w[0], w[1], w[2], w[3]]);
                // SAFETY: as for the loads above; the mapping is writable.
                unsafe { std::ptr::write_volatile(words.add(i), v) };
            }
        }
        None
    };
    let at = libc::off_t::try_from(off).unwrap_or(0);
    // SAFETY: pread writes at most `seen.len()` bytes into `seen`.
    let n = unsafe { libc::pread(fd, seen.as_mut_ptr().cast(), seen.len(), at) };
    shown |= usize::try_from(n) == Ok(seen.len()) && seen == pattern;
    if let Some(a) = attack {
        // SAFETY: pwrite reads `a.len()` bytes of `a`.
        unsafe { libc::pwrite(fd, a.as_ptr().cast(), a.len(), at) };
    }
    match (shown, no_map) {
        (true, _) => 1,
        (false, None) => 0,
        (false, Some(e)) => 2 + e.clamp(0, 253),
    }
}
