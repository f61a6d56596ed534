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

/// Populates `[addr, addr + len)` with `MADV_POPULATE_WRITE`; where the kernel lacks it
/// (`EINVAL` before Linux 5.14), faults every page in by reading it, so the contents a running
/// guest may be writing are never rewritten. Any other failure (a hole in the range: `ENOMEM`)
/// is an error.
fn populate(addr: u64, len: u64) -> Result<(), PinError> {
    // SAFETY: populating a range of our own mapping only faults pages in; it does not change
    // their contents. An invalid range fails with an error.
    if unsafe {
        libc::madvise(
            addr as *mut libc::c_void,
            len as libc::size_t,
            MADV_POPULATE_WRITE,
        )
    } == 0
    {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EINVAL) {
        return Err(PinError::Os {
            op: "madvise(MADV_POPULATE_WRITE)",
            addr,
            len,
            source: e,
        });
    }
    let ps = page_size();
    let mut p = addr;
    while p < addr + len {
        // SAFETY: `p` lies in the caller's mapping, which madvise accepted as a range of
        // ours (EINVAL only means the advice is unknown); a volatile read faults it in.
        unsafe { std::ptr::read_volatile(p as *const u8) };
        p += ps;
    }
    Ok(())
}

/// Splits `[addr, addr + len)` into at most `n` consecutive pieces whose inner boundaries are
/// multiples of `align` and which are at least `min` bytes long (the last one may be shorter
/// than the others). Pure; unit-tested.
pub fn split_range(addr: u64, len: u64, n: usize, align: u64, min: u64) -> Vec<(u64, u64)> {
    let align = align.max(1);
    let n = (n.max(1) as u64).min(len / min.max(1)).max(1);
    let chunk = len.div_ceil(n).div_ceil(align) * align;
    let mut out = Vec::new();
    let mut a = addr;
    let end = addr + len;
    while a < end {
        let b = (a + chunk).min(end);
        out.push((a, b - a));
        a = b;
    }
    out
}

/// [`MlockPinner`] at memory bandwidth: the range is populated from up to `threads` threads
/// at once (page faults of one mapping run in parallel under the shared mmap lock), then
/// locked with one `mlock`, which then only walks present pages (it takes the mmap lock for
/// writing, so splitting it would not help). Nothing is locked unless everything populated.
#[derive(Clone, Copy, Debug)]
pub struct ParallelPinner {
    threads: usize,
    min_chunk: u64,
}

/// Pieces smaller than this are not worth a thread.
const MIN_CHUNK: u64 = 64 << 20;
/// Piece boundaries fall on huge page boundaries so no huge page is split between threads.
const CHUNK_ALIGN: u64 = 2 << 20;

impl ParallelPinner {
    /// Populates from up to `threads` threads (at least one).
    pub fn new(threads: usize) -> Self {
        Self {
            threads: threads.max(1),
            min_chunk: MIN_CHUNK,
        }
    }

    /// One thread per CPU this process may run on.
    pub fn available() -> Self {
        Self::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// Smallest piece given to a thread (default 64 MiB).
    pub fn with_min_chunk(mut self, min_chunk: u64) -> Self {
        self.min_chunk = min_chunk.max(page_size());
        self
    }

    pub fn threads(&self) -> usize {
        self.threads
    }
}

impl Pinner for ParallelPinner {
    fn check(&self, total: u64) -> Result<(), PinError> {
        MlockPinner.check(total)
    }

    fn pin(&self, addr: u64, len: u64) -> Result<PinnedRange, PinError> {
        let ps = page_size();
        if !addr.is_multiple_of(ps) || !len.is_multiple_of(ps) {
            return Err(PinError::Unaligned { addr, len });
        }
        let pieces = split_range(addr, len, self.threads, CHUNK_ALIGN, self.min_chunk);
        let results: Vec<Result<(), PinError>> = std::thread::scope(|s| {
            let handles: Vec<_> = pieces
                .iter()
                .skip(1)
                .map(|&(a, l)| s.spawn(move || populate(a, l)))
                .collect();
            let mut out = Vec::with_capacity(pieces.len());
            if let Some(&(a, l)) = pieces.first() {
                out.push(populate(a, l));
            }
            for h in handles {
                out.push(h.join().unwrap_or_else(|_| {
                    Err(PinError::Os {
                        op: "populate thread",
                        addr,
                        len,
                        source: std::io::Error::other("populate thread panicked"),
                    })
                }));
            }
            out
        });
        for r in results {
            r?;
        }
        let ptr = addr as *mut libc::c_void;
        let n = len as libc::size_t;
        // SAFETY: mlock only changes residency of our own mapping.
        if unsafe { libc::mlock(ptr, n) } != 0 {
            let source = std::io::Error::last_os_error();
            // A failed mlock may have locked a prefix: undo it so nothing stays pinned.
            // SAFETY: munlock only changes residency of our own mapping.
            unsafe { libc::munlock(ptr, n) };
            return Err(PinError::Os {
                op: "mlock",
                addr,
                len,
                source,
            });
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

/// A device's share of the pin of guest RAM. While any share is alive the RAM stays pinned;
/// dropping the last share of a [`DmaPinSource`] unpins it (RAII, like [`PinnedRange`]).
pub struct DmaPin {
    bytes: u64,
    fresh: Option<PinStats>,
    release: Option<Release>,
}

impl DmaPin {
    /// `fresh` is the cost of the pin if this share made it (the first one), `None` if it
    /// joined a pin that was already there. `release` runs exactly once, on drop.
    pub fn new(
        bytes: u64,
        fresh: Option<PinStats>,
        release: impl FnOnce() + Send + 'static,
    ) -> Self {
        Self {
            bytes,
            fresh,
            release: Some(Box::new(release)),
        }
    }

    /// Bytes of guest RAM this share keeps pinned (shared with the other holders).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The cost of pinning, if this share paid for it.
    pub fn fresh(&self) -> Option<PinStats> {
        self.fresh
    }
}

impl fmt::Debug for DmaPin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DmaPin")
            .field("bytes", &format_args!("{:#x}", self.bytes))
            .field("fresh", &self.fresh)
            .finish()
    }
}

impl Drop for DmaPin {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release();
        }
    }
}

/// Where a device gets its pin of guest RAM on Bus Master Enable. The VMM gives every device
/// of a VM the same source (its DMA manager), so RAM is pinned once however many devices
/// master the bus; remote_pci does not depend on the VMM for it.
pub trait DmaPinSource: Send + Sync {
    /// Takes a share of the pin of `ranges` (host address, length: all of guest RAM),
    /// pinning them if no share is alive.
    fn acquire(&self, ranges: &[(u64, u64)]) -> Result<DmaPin, PinError>;
}

/// A source that pins anew for every share: what a lone device does when it is given no
/// shared source (tests, a VMM with one DMA device).
pub struct PrivatePins(pub std::sync::Arc<dyn Pinner>);

impl DmaPinSource for PrivatePins {
    fn acquire(&self, ranges: &[(u64, u64)]) -> Result<DmaPin, PinError> {
        let (pins, stats) = pin_all(self.0.as_ref(), ranges)?;
        Ok(DmaPin::new(stats.bytes, Some(stats), move || drop(pins)))
    }
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
    fn split_range_covers_the_range_on_aligned_boundaries() {
        let mib = 1u64 << 20;
        let p = split_range(0x4000_0000, 1024 * mib, 4, 2 * mib, 64 * mib);
        assert_eq!(p.len(), 4);
        assert_eq!(p[0], (0x4000_0000, 256 * mib));
        for w in p.windows(2) {
            assert_eq!(w[0].0 + w[0].1, w[1].0, "pieces are contiguous: {p:x?}");
        }
        assert_eq!(p.iter().map(|x| x.1).sum::<u64>(), 1024 * mib);
        // Too small for more than one piece of the minimum size.
        assert_eq!(split_range(0, 100 * mib, 8, 2 * mib, 64 * mib).len(), 1);
        // Uneven: boundaries stay 2 MiB aligned, the last piece takes the rest.
        let p = split_range(0, 10 * mib + 4096, 3, 2 * mib, mib);
        assert!(p.len() <= 3 && p.len() >= 2, "{p:x?}");
        assert!(p[..p.len() - 1]
            .iter()
            .all(|x| (x.0 + x.1) % (2 * mib) == 0));
        assert_eq!(p.iter().map(|x| x.1).sum::<u64>(), 10 * mib + 4096);
    }

    /// Pages of `[addr, addr + len)` resident per mincore.
    fn resident_pages(addr: u64, len: u64) -> usize {
        let ps = page_size();
        let mut v = vec![0u8; (len / ps) as usize];
        // SAFETY: `v` has one byte per page of the range, which is our mapping.
        let r = unsafe { libc::mincore(addr as *mut libc::c_void, len as usize, v.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
        v.iter().filter(|b| **b & 1 != 0).count()
    }

    #[test]
    fn parallel_pinner_populates_every_piece_and_locks_once() {
        let _g = VMLCK_TEST_LOCK.lock().unwrap();
        let len = 16 << 20;
        let (_f, map) = memfd_map(len);
        assert_eq!(resident_pages(map.addr, len), 0);
        let pinner = ParallelPinner::new(4).with_min_chunk(2 << 20);
        assert_eq!(split_range(map.addr, len, 4, CHUNK_ALIGN, 2 << 20).len(), 4);
        let before = locked_bytes();
        let pin = pinner.pin(map.addr, len).unwrap();
        assert_eq!(resident_pages(map.addr, len) as u64, len / page_size());
        assert!(locked_bytes() >= before + len);
        drop(pin);
        assert!(locked_bytes() <= before, "VmLck did not fall back");
    }

    #[test]
    fn parallel_pinner_error_in_one_piece_fails_the_pin_and_locks_nothing() {
        let _g = VMLCK_TEST_LOCK.lock().unwrap();
        let len = 16 << 20;
        let (_f, map) = memfd_map(len);
        // A hole in the third piece: that thread's populate fails with ENOMEM.
        let hole = map.addr + (9 << 20);
        // SAFETY: unmaps 1 MiB inside our own test mapping (`Map` unmaps the whole range
        // again on drop, which is fine for a hole).
        let r = unsafe { libc::munmap(hole as *mut libc::c_void, 1 << 20) };
        assert_eq!(r, 0);
        let before = locked_bytes();
        let e = ParallelPinner::new(4)
            .with_min_chunk(2 << 20)
            .pin(map.addr, len)
            .unwrap_err();
        assert!(
            matches!(
                e,
                PinError::Os {
                    op: "madvise(MADV_POPULATE_WRITE)",
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(locked_bytes(), before, "a failed pin left pages locked");
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
