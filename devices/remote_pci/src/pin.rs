//! Pinning guest RAM while the device may DMA into it (Bus Master Enable set).
//!
//! [`MlockPinner`] populates a range (`MADV_POPULATE_WRITE`) and `mlock`s it, after
//! checking `RLIMIT_MEMLOCK` so a too-small limit gives an error naming the limit and the
//! size needed. Every pinned range is a [`PinnedRange`] whose `Drop` undoes the pin.

use std::fmt;
use std::time::Instant;

/// `MADV_POPULATE_WRITE` (Linux 5.14); not exported by the `libc` crate yet.
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Errors of pinning.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    #[error(
        "pinning {needed:#x} bytes of guest ram needs RLIMIT_MEMLOCK of at least {required:#x} \
         bytes ({locked:#x} already locked), but it is {limit:#x}; raise it (ulimit -l / \
         LimitMEMLOCK=) or run with CAP_IPC_LOCK"
    )]
    MemlockLimit {
        needed: u64,
        locked: u64,
        required: u64,
        limit: u64,
    },
    #[error("range {addr:#x}+{len:#x} is not page aligned")]
    Unaligned { addr: u64, len: u64 },
    #[error("{op} of {addr:#x}+{len:#x} failed")]
    Os {
        op: &'static str,
        addr: u64,
        len: u64,
        #[source]
        source: std::io::Error,
    },
}

type Release = Box<dyn FnOnce() + Send>;

/// A pinned host range; dropping it unpins it.
pub struct PinnedRange {
    addr: u64,
    len: u64,
    release: Option<Release>,
}

impl PinnedRange {
    /// Wraps a pinned range; `release` runs exactly once, on drop.
    pub fn new(addr: u64, len: u64, release: impl FnOnce() + Send + 'static) -> Self {
        Self {
            addr,
            len,
            release: Some(Box::new(release)),
        }
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl fmt::Debug for PinnedRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedRange")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &format_args!("{:#x}", self.len))
            .finish()
    }
}

impl Drop for PinnedRange {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release();
        }
    }
}

/// Pins host ranges of guest RAM.
pub trait Pinner: Send + Sync {
    /// Checks up front that `total` more bytes can be pinned.
    fn check(&self, total: u64) -> Result<(), PinError>;

    /// Populates and pins `[addr, addr + len)`.
    fn pin(&self, addr: u64, len: u64) -> Result<PinnedRange, PinError>;
}

/// `madvise(MADV_POPULATE_WRITE)` + `mlock`; `munlock` on drop.
#[derive(Clone, Copy, Debug, Default)]
pub struct MlockPinner;

fn page_size() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(v).ok().filter(|v| *v > 0).unwrap_or(4096)
}

/// Bytes this process has locked (VmLck of /proc/self/status), 0 if unknown.
pub fn locked_bytes() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return 0;
    };
    s.lines()
        .find_map(|l| l.strip_prefix("VmLck:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn has_ipc_lock() -> bool {
    // CAP_IPC_LOCK is bit 14 of the effective capability set.
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    s.lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

impl Pinner for MlockPinner {
    fn check(&self, total: u64) -> Result<(), PinError> {
        let mut rl = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes into the rlimit we own.
        if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) } != 0 {
            log::warn!(
                "getrlimit(RLIMIT_MEMLOCK): {}",
                std::io::Error::last_os_error()
            );
            return Ok(());
        }
        if rl.rlim_cur == libc::RLIM_INFINITY || has_ipc_lock() {
            return Ok(());
        }
        let locked = locked_bytes();
        let required = locked.saturating_add(total);
        if required > rl.rlim_cur {
            return Err(PinError::MemlockLimit {
                needed: total,
                locked,
                required,
                limit: rl.rlim_cur,
            });
        }
        Ok(())
    }

    fn pin(&self, addr: u64, len: u64) -> Result<PinnedRange, PinError> {
        let ps = page_size();
        if !addr.is_multiple_of(ps) || !len.is_multiple_of(ps) {
            return Err(PinError::Unaligned { addr, len });
        }
        let os = |op| PinError::Os {
            op,
            addr,
            len,
            source: std::io::Error::last_os_error(),
        };
        let ptr = addr as *mut libc::c_void;
        let n = len as libc::size_t;
        // SAFETY: populating a range of our own mapping only faults pages in; it does not
        // change their contents. An invalid range fails with an error.
        if unsafe { libc::madvise(ptr, n, MADV_POPULATE_WRITE) } != 0 {
            let e = std::io::Error::last_os_error();
            // Older kernels: mlock below faults the pages in as well.
            log::debug!("madvise(MADV_POPULATE_WRITE) {addr:#x}+{len:#x}: {e}; relying on mlock");
        }
        // SAFETY: mlock only changes residency of our own mapping.
        if unsafe { libc::mlock(ptr, n) } != 0 {
            return Err(os("mlock"));
        }
        Ok(PinnedRange::new(addr, len, move || {
            // SAFETY: undoes the mlock above on the same range.
            if unsafe { libc::munlock(addr as *const libc::c_void, len as libc::size_t) } != 0 {
                log::error!(
                    "munlock {addr:#x}+{len:#x}: {}",
                    std::io::Error::last_os_error()
                );
            }
        }))
    }
}

/// Pins all `ranges` (host address, length); all or nothing. Logs the time and rate.
pub fn pin_all(
    pinner: &dyn Pinner,
    ranges: &[(u64, u64)],
) -> Result<(Vec<PinnedRange>, PinStats), PinError> {
    let total: u64 = ranges.iter().map(|r| r.1).sum();
    pinner.check(total)?;
    let start = Instant::now();
    let mut pins = Vec::with_capacity(ranges.len());
    for &(addr, len) in ranges {
        pins.push(pinner.pin(addr, len)?);
    }
    let micros = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
    let stats = PinStats {
        bytes: total,
        micros,
    };
    log::info!(
        "pinned {} MiB of guest ram in {} ranges in {:.3} ms ({:.0} MiB/s)",
        total >> 20,
        pins.len(),
        micros as f64 / 1000.0,
        stats.mib_per_s()
    );
    Ok((pins, stats))
}

/// Serializes tests that measure the process-wide VmLck.
#[cfg(test)]
pub(crate) static VMLCK_TEST_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Cost of the last pin.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinStats {
    pub bytes: u64,
    pub micros: u64,
}

impl PinStats {
    pub fn mib_per_s(&self) -> f64 {
        if self.micros == 0 {
            return 0.0;
        }
        (self.bytes as f64 / (1 << 20) as f64) / (self.micros as f64 / 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    struct Map {
        addr: u64,
        len: u64,
    }

    impl Drop for Map {
        fn drop(&mut self) {
            // SAFETY: unmaps the mapping created in `memfd_map`.
            unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len as usize) };
        }
    }

    fn memfd_map(len: u64) -> (std::fs::File, Map) {
        let name = c"rpci-pin-test";
        // SAFETY: creates a new fd we own.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), 0) };
        assert!(fd >= 0);
        // SAFETY: fd is a fresh memfd we own.
        let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(len).unwrap();
        // SAFETY: new shared mapping of the memfd, unmapped by `Map`.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        (
            file,
            Map {
                addr: p as u64,
                len,
            },
        )
    }

    #[test]
    fn mlock_memfd_64mib_raises_and_restores_vmlck() {
        let _g = VMLCK_TEST_LOCK.lock().unwrap();
        let len = 64 << 20;
        let (_f, map) = memfd_map(len);
        let before = locked_bytes();
        let (pins, stats) = pin_all(&MlockPinner, &[(map.addr, map.len)]).unwrap();
        let during = locked_bytes();
        assert!(
            during >= before + len,
            "VmLck {before:#x} -> {during:#x}, expected +{len:#x}"
        );
        assert_eq!(stats.bytes, len);
        drop(pins);
        let after = locked_bytes();
        assert!(
            after <= during - len,
            "VmLck did not fall back: {during:#x} -> {after:#x}"
        );
    }

    #[test]
    fn unaligned_range_is_refused() {
        assert!(matches!(
            MlockPinner.pin(0x1001, 0x1000),
            Err(PinError::Unaligned { .. })
        ));
    }

    #[test]
    fn memlock_limit_error_names_the_limit() {
        let e = PinError::MemlockLimit {
            needed: 1 << 30,
            locked: 0,
            required: 1 << 30,
            limit: 8 << 20,
        };
        let s = e.to_string();
        assert!(s.contains("RLIMIT_MEMLOCK") && s.contains("0x800000") && s.contains("0x40000000"));
    }
}
