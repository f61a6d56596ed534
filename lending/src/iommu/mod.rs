//! IOMMU domains: what a lent device may reach by DMA.
//!
//! Every lent device gets one domain per lease. The borrower exports a fabric window over
//! (part of) its guest RAM and asks the lender to map it at IOVA = guest-physical base, so the
//! unmodified guest driver's bus addresses are valid device addresses.
//!
//! * [`SoftIommu`]: used by emulated devices. Every DMA is translated and bounds-checked
//!   against the mapped windows *before* any byte moves; an access that is not entirely
//!   covered is refused, counted and logged, and touches nothing.
//! * [`vfio::VfioDomain`]: one VFIO container per lent device; windows are programmed into the
//!   hardware IOMMU with `VFIO_IOMMU_MAP_DMA` (behind [`vfio::VfioContainerOps`]).
//!
//! Accounting ([`IommuDomain::dma_bytes`], [`IommuDomain::fault_count`],
//! [`IommuDomain::set_fault_listener`]): the software domain sees every DMA, so it counts the
//! bytes moved and the faults, and tells a listener of each fault. A VFIO domain cannot: the
//! device's DMA goes through the hardware IOMMU without the lender seeing it, and its faults
//! are reported to the host kernel's log, not to userspace; it keeps the defaults (no byte
//! counts, no faults).

pub mod backing;
pub mod dirty;
pub mod p2p;
pub mod p2p_remote;
pub mod vfio;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use thiserror::Error;

pub use backing::{BackingError, DmaBacking, MmapBacking, VecBacking};
pub use dirty::{DirtyLogError, DirtyPages, PageBits, MAX_DIRTY_PAGES};

/// Granule of IOVA mappings (both size and IOVA must be multiples of it).
pub const IOMMU_PAGE_SIZE: u64 = 4096;
/// Most mappings one domain accepts (vfio-user's `max_dma_maps` plays the same role).
pub const MAX_MAPPINGS: usize = 1024;

/// Errors of IOMMU domain operations.
#[derive(Debug, Error)]
pub enum IommuError {
    /// Zero size or an IOVA range that wraps.
    #[error("dma mapping at iova {iova:#x} with size {size:#x} is empty or wraps")]
    BadRange {
        /// Start IOVA.
        iova: u64,
        /// Size.
        size: u64,
    },
    /// IOVA or size not page aligned.
    #[error("dma mapping at iova {iova:#x} size {size:#x} is not aligned to {align:#x}")]
    Unaligned {
        /// Start IOVA.
        iova: u64,
        /// Size.
        size: u64,
        /// Required alignment.
        align: u64,
    },
    /// The mapping is larger than its backing.
    #[error("dma mapping size {size:#x} exceeds its {backing:#x}-byte backing window")]
    BackingTooSmall {
        /// Size asked for.
        size: u64,
        /// Size of the backing.
        backing: u64,
    },
    /// The new mapping overlaps an existing one.
    #[error(
        "dma mapping {iova:#x}+{size:#x} overlaps existing mapping {other_iova:#x}+{other_size:#x}"
    )]
    Overlap {
        /// Start IOVA.
        iova: u64,
        /// Size.
        size: u64,
        /// Existing mapping start.
        other_iova: u64,
        /// Existing mapping size.
        other_size: u64,
    },
    /// Too many mappings in the domain.
    #[error("domain already holds the maximum of {0} dma mappings")]
    TooMany(usize),
    /// Unmap of something that is not mapped (exactly).
    #[error("no dma mapping at iova {iova:#x} with size {size:#x}")]
    NotMapped {
        /// Start IOVA.
        iova: u64,
        /// Size.
        size: u64,
    },
    /// A rebind to memory that is not provably the mapping's own (different or unknown
    /// [`DmaBacking::backing_id`]).
    #[error(
        "dma mapping at iova {iova:#x} size {size:#x}: the new backing is not the same memory \
         (rebind keeps the mapping only for another view of the same file range)"
    )]
    NotSameMemory {
        /// Start IOVA.
        iova: u64,
        /// Size.
        size: u64,
    },
    /// The backing cannot be handed to a hardware IOMMU (not mapped in this process).
    #[error("dma backing for iova {0:#x} has no host mapping; a hardware iommu needs one")]
    NotHostMapped(u64),
    /// The mapping reaches into IOVAs the IOMMU reserves (read from the kernel).
    #[error(
        "dma mapping at iova {iova:#x} size {size:#x} reaches into {start:#x}-{end:#x}, which \
         the iommu reserves (on x86 0xfee00000-0xfeefffff is the msi window): the borrower's \
         dma-able memory must stay out of it"
    )]
    ReservedIova {
        /// Start IOVA.
        iova: u64,
        /// Size.
        size: u64,
        /// First reserved IOVA reached.
        start: u64,
        /// Last IOVA of that reserved range (inclusive).
        end: u64,
    },
    /// The VFIO layer refused the operation.
    #[error("vfio {op} of iova {iova:#x} size {size:#x} failed: {source}")]
    Vfio {
        /// `map` or `unmap`.
        op: &'static str,
        /// Start IOVA.
        iova: u64,
        /// Size.
        size: u64,
        /// What the VFIO layer said.
        #[source]
        source: vfio::VfioOpError,
    },
}

/// A DMA access refused by the IOMMU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("iommu fault: dma {} of {len:#x} bytes at iova {iova:#x} is outside the mapped windows", if *.write { "write" } else { "read" })]
pub struct IommuFault {
    /// Start IOVA of the access.
    pub iova: u64,
    /// Length of the access.
    pub len: u64,
    /// Whether the device tried to write memory.
    pub write: bool,
}

/// A mapping as listed by [`IommuDomain::mappings`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MappingInfo {
    /// Start IOVA (= guest-physical base of the window).
    pub iova: u64,
    /// Size in bytes.
    pub size: u64,
}

/// One device's DMA address space on the lender.
pub trait IommuDomain: Send + Sync {
    /// Makes `[iova, iova + size)` reach `backing[0..size)`.
    fn map(&self, iova: u64, size: u64, backing: Arc<dyn DmaBacking>) -> Result<(), IommuError>;
    /// Removes the mapping that starts at `iova` and has exactly `size` bytes.
    fn unmap(&self, iova: u64, size: u64) -> Result<(), IommuError>;
    /// Replaces the backing of the mapping that starts at `iova` and has exactly `size`
    /// bytes with `backing`, another view of the same memory (equal
    /// [`DmaBacking::backing_id`]; [`IommuError::NotSameMemory`] otherwise,
    /// [`IommuError::NotMapped`] without such a mapping). The mapping is never absent: DMA
    /// goes on through it, and the old backing is dropped once the new one is in place (a
    /// lease moving to a VMM that shares the old one's guest-RAM memfd keeps its window).
    fn rebind(&self, iova: u64, size: u64, backing: Arc<dyn DmaBacking>) -> Result<(), IommuError>;
    /// Removes every mapping; returns how many there were.
    fn unmap_all(&self) -> usize;
    /// Current mappings, sorted by IOVA.
    fn mappings(&self) -> Vec<MappingInfo>;
    /// DMA accesses refused so far.
    fn fault_count(&self) -> u64;
    /// Bytes the device read from and wrote to the mapped windows so far, `(read, written)`,
    /// when the domain sees the DMA. Default `None`: a hardware domain (VFIO) cannot count.
    fn dma_bytes(&self) -> Option<(u64, u64)> {
        None
    }
    /// Who to tell about each refused DMA from now on (`None`: nobody). Default: nothing (a
    /// domain that does not see faults).
    fn set_fault_listener(&self, _listener: Option<Arc<dyn FaultListener>>) {}
    /// Starts logging the pages the device writes ([`dirty`]); returns `true` when the
    /// domain tracks writes exactly, `false` when it cannot and every fetch reports the whole
    /// window. Default (a domain that does not see DMA): `false`.
    fn start_dirty_log(&self) -> bool {
        false
    }
    /// Stops logging and drops what was not fetched. Default: nothing.
    fn stop_dirty_log(&self) {}
    /// The pages of `[iova, iova + len)` written since the previous fetch (fetch-and-clear,
    /// see [`dirty`]). Default: every mapped page of the range, flagged
    /// [`DirtyPages::whole_window`] (the domain cannot see the device's writes).
    fn fetch_dirty(&self, iova: u64, len: u64) -> Result<DirtyPages, DirtyLogError> {
        let mut d = DirtyPages::empty(iova, len)?;
        for m in self.mappings() {
            d.set_covered(m.iova, m.size);
        }
        d.whole_window = true;
        Ok(d)
    }
}

/// Told about every DMA a domain refuses (from the device's worker thread: must not block
/// for long).
pub trait FaultListener: Send + Sync {
    /// `fault` was refused; `total` is the domain's [`IommuDomain::fault_count`] with it.
    fn fault(&self, fault: &IommuFault, total: u64);
}

struct Entry {
    size: u64,
    backing: Arc<dyn DmaBacking>,
    /// The mapping's dirty bits while logging is on (software domain).
    dirty: Option<Arc<PageBits>>,
}

/// Sorted, non-overlapping mapping table shared by the domain implementations.
#[derive(Default)]
struct MapTable {
    map: BTreeMap<u64, Entry>,
}

impl MapTable {
    fn check_new(&self, iova: u64, size: u64, backing_size: u64) -> Result<(), IommuError> {
        let end = iova
            .checked_add(size)
            .filter(|_| size > 0)
            .ok_or(IommuError::BadRange { iova, size })?;
        if !iova.is_multiple_of(IOMMU_PAGE_SIZE) || !size.is_multiple_of(IOMMU_PAGE_SIZE) {
            return Err(IommuError::Unaligned {
                iova,
                size,
                align: IOMMU_PAGE_SIZE,
            });
        }
        if size > backing_size {
            return Err(IommuError::BackingTooSmall {
                size,
                backing: backing_size,
            });
        }
        if self.map.len() >= MAX_MAPPINGS {
            return Err(IommuError::TooMany(MAX_MAPPINGS));
        }
        // The previous mapping (start <= iova) must end at or before iova; the next one must
        // start at or after end.
        if let Some((&s, e)) = self.map.range(..=iova).next_back() {
            if s + e.size > iova {
                return Err(IommuError::Overlap {
                    iova,
                    size,
                    other_iova: s,
                    other_size: e.size,
                });
            }
        }
        if let Some((&s, e)) = self.map.range(iova..).next() {
            if s < end {
                return Err(IommuError::Overlap {
                    iova,
                    size,
                    other_iova: s,
                    other_size: e.size,
                });
            }
        }
        Ok(())
    }

    /// Swaps the backing of the mapping at exactly `[iova, iova + size)` for `backing`, which
    /// must be the same memory; returns the old one (the caller drops it after releasing the
    /// table's lock). Dirty bits stay with the entry.
    fn swap_backing(
        &mut self,
        iova: u64,
        size: u64,
        backing: Arc<dyn DmaBacking>,
    ) -> Result<Arc<dyn DmaBacking>, IommuError> {
        let e = match self.map.get_mut(&iova) {
            Some(e) if e.size == size => e,
            _ => return Err(IommuError::NotMapped { iova, size }),
        };
        match (e.backing.backing_id(), backing.backing_id()) {
            (Some(old), Some(new)) if old == new && backing.size() >= size => {
                Ok(std::mem::replace(&mut e.backing, backing))
            }
            _ => Err(IommuError::NotSameMemory { iova, size }),
        }
    }

    fn remove_exact(&mut self, iova: u64, size: u64) -> Result<Entry, IommuError> {
        match self.map.get(&iova) {
            Some(e) if e.size == size => self
                .map
                .remove(&iova)
                .ok_or(IommuError::NotMapped { iova, size }),
            _ => Err(IommuError::NotMapped { iova, size }),
        }
    }

    fn list(&self) -> Vec<MappingInfo> {
        self.map
            .iter()
            .map(|(&iova, e)| MappingInfo { iova, size: e.size })
            .collect()
    }

    /// The mapping that covers all of `[iova, iova+len)` and the offset into its backing (the
    /// common case: no allocation, no reference counting).
    fn covering(&self, iova: u64, len: u64) -> Option<(&Entry, u64)> {
        let end = iova.checked_add(len)?;
        let (&start, e) = self.map.range(..=iova).next_back()?;
        (end <= start + e.size).then_some((e, iova - start))
    }

    /// Splits `[iova, iova+len)` into (backing, offset, start-in-buffer, length) pieces, or
    /// `None` if any byte is not covered.
    #[allow(clippy::type_complexity)]
    fn translate(
        &self,
        iova: u64,
        len: u64,
    ) -> Option<
        Vec<(
            Arc<dyn DmaBacking>,
            u64,
            usize,
            usize,
            Option<Arc<PageBits>>,
        )>,
    > {
        let end = iova.checked_add(len)?;
        let mut out = Vec::new();
        let mut cur = iova;
        while cur < end {
            let (&start, e) = self.map.range(..=cur).next_back()?;
            let map_end = start + e.size;
            if cur >= map_end {
                return None;
            }
            let piece_end = end.min(map_end);
            out.push((
                Arc::clone(&e.backing),
                cur - start,
                usize::try_from(cur - iova).ok()?,
                usize::try_from(piece_end - cur).ok()?,
                e.dirty.clone(),
            ));
            cur = piece_end;
        }
        Some(out)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    match l.read() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    match l.write() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Software IOMMU for emulated devices: every DMA is translated and bounds-checked.
///
/// DMA holds the table's read lock while it copies (DMAs do not wait for each other), so
/// once `unmap` returns no transfer into the removed window is still in progress.
pub struct SoftIommu {
    name: String,
    table: RwLock<MapTable>,
    faults: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    listener: RwLock<Option<Arc<dyn FaultListener>>>,
    /// Dirty logging is on: new mappings get [`PageBits`].
    logging: AtomicBool,
}

impl SoftIommu {
    /// An empty domain; `name` identifies the device in log lines.
    pub fn new(name: impl Into<String>) -> Self {
        SoftIommu {
            name: name.into(),
            table: RwLock::new(MapTable::default()),
            faults: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            listener: RwLock::new(None),
            logging: AtomicBool::new(false),
        }
    }

    /// Counts and logs a refused access and tells the listener (called without the table
    /// lock, so a listener that sends a message does not hold up map/unmap).
    fn fault(&self, iova: u64, len: u64, write: bool) -> IommuFault {
        let n = self.faults.fetch_add(1, Ordering::Relaxed) + 1;
        let f = IommuFault { iova, len, write };
        // A misbehaving guest can fault in a loop: log the first ones, then sample.
        if n <= 16 || n.is_multiple_of(1024) {
            log::warn!("{}: {f} (fault #{n})", self.name);
        } else {
            log::debug!("{}: {f} (fault #{n})", self.name);
        }
        let listener = read(&self.listener).clone();
        if let Some(l) = listener {
            l.fault(&f, n);
        }
        f
    }

    /// Reads through the table; `false` if any byte is not mapped or the backing failed.
    fn try_read(&self, iova: u64, buf: &mut [u8]) -> bool {
        self.try_read_with(iova, buf.len(), |b, off, at, n| {
            b.read_at(off, &mut buf[at..at + n])
        })
    }

    /// Reads through the table: `f(backing, offset, at, n)` for each mapped piece of
    /// `[iova, iova + len)` (`at`: where the piece starts in the access); `false` if any
    /// byte is not mapped (nothing read) or a backing failed.
    fn try_read_with(
        &self,
        iova: u64,
        len: usize,
        mut f: impl FnMut(&dyn DmaBacking, u64, usize, usize) -> Result<(), BackingError>,
    ) -> bool {
        let t = read(&self.table);
        if let Some((e, off)) = t.covering(iova, len as u64) {
            return f(e.backing.as_ref(), off, 0, len).is_ok();
        }
        let Some(pieces) = t.translate(iova, len as u64) else {
            return false;
        };
        pieces
            .into_iter()
            .all(|(backing, off, at, n, _)| f(backing.as_ref(), off, at, n).is_ok())
    }

    /// Writes through the table; `false` if any byte is not mapped (nothing written) or the
    /// backing failed.
    fn try_write(&self, iova: u64, data: &[u8]) -> bool {
        self.try_write_with(iova, data.len(), |b, off, at, n| {
            b.write_at(off, &data[at..at + n])
        })
    }

    /// Writes through the table, as [`SoftIommu::try_read_with`] reads.
    fn try_write_with(
        &self,
        iova: u64,
        len: usize,
        mut f: impl FnMut(&dyn DmaBacking, u64, usize, usize) -> Result<(), BackingError>,
    ) -> bool {
        let t = read(&self.table);
        // Dirty bits are set after the bytes landed ([`dirty`]), while the table's read lock
        // still keeps the mapping (and its bits) from being replaced.
        if let Some((e, off)) = t.covering(iova, len as u64) {
            let ok = f(e.backing.as_ref(), off, 0, len).is_ok();
            if let Some(d) = &e.dirty {
                d.mark(off, len as u64);
            }
            return ok;
        }
        let Some(pieces) = t.translate(iova, len as u64) else {
            return false;
        };
        pieces.into_iter().all(|(backing, off, at, n, dirty)| {
            let ok = f(backing.as_ref(), off, at, n).is_ok();
            if let Some(d) = dirty {
                d.mark(off, n as u64);
            }
            ok
        })
    }

    /// Device read of guest memory at `iova` (the whole range must be mapped).
    pub fn dma_read(&self, iova: u64, buf: &mut [u8]) -> Result<(), IommuFault> {
        let ok = self.try_read(iova, buf);
        self.account(iova, buf.len(), false, ok)
    }

    /// Device write of guest memory at `iova` (the whole range must be mapped; nothing is
    /// written otherwise).
    pub fn dma_write(&self, iova: u64, data: &[u8]) -> Result<(), IommuFault> {
        let ok = self.try_write(iova, data);
        self.account(iova, data.len(), true, ok)
    }

    /// Counts an access of `len` bytes at `iova` that moved its bytes (`ok`) or faulted.
    fn account(&self, iova: u64, len: usize, write: bool, ok: bool) -> Result<(), IommuFault> {
        if !ok {
            return Err(self.fault(iova, len as u64, write));
        }
        let moved = if write {
            &self.bytes_written
        } else {
            &self.bytes_read
        };
        moved.fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }
}

/// The `n` bytes at `at` of a raw DMA access's span (a piece the table translated).
fn piece<'a>(
    span: emulated::RawSpan<'a>,
    at: usize,
    n: usize,
) -> Result<emulated::RawSpan<'a>, BackingError> {
    span.sub(at, n).ok_or(BackingError::OutOfRange {
        offset: at as u64,
        len: n as u64,
        size: span.len() as u64,
    })
}

impl IommuDomain for SoftIommu {
    fn map(&self, iova: u64, size: u64, backing: Arc<dyn DmaBacking>) -> Result<(), IommuError> {
        let mut t = write(&self.table);
        t.check_new(iova, size, backing.size())?;
        // Under the table's write lock: a start/stop of logging cannot interleave.
        let dirty = self
            .logging
            .load(Ordering::Acquire)
            .then(|| Arc::new(PageBits::new(size)));
        t.map.insert(
            iova,
            Entry {
                size,
                backing,
                dirty,
            },
        );
        log::info!(
            "{}: mapped dma window iova {iova:#x} size {size:#x}",
            self.name
        );
        Ok(())
    }

    fn unmap(&self, iova: u64, size: u64) -> Result<(), IommuError> {
        write(&self.table).remove_exact(iova, size)?;
        log::info!(
            "{}: unmapped dma window iova {iova:#x} size {size:#x}",
            self.name
        );
        Ok(())
    }

    fn rebind(&self, iova: u64, size: u64, backing: Arc<dyn DmaBacking>) -> Result<(), IommuError> {
        // Under the write lock no DMA is between translation and copy, so each access goes
        // wholly to the old backing or wholly to the new one (the same bytes either way).
        let old = write(&self.table).swap_backing(iova, size, backing)?;
        drop(old);
        log::info!(
            "{}: dma window iova {iova:#x} size {size:#x} kept, rebound to another view of \
             the same memory",
            self.name
        );
        Ok(())
    }

    fn unmap_all(&self) -> usize {
        let old = std::mem::take(&mut write(&self.table).map);
        if !old.is_empty() {
            log::info!("{}: unmapped all {} dma windows", self.name, old.len());
        }
        old.len()
    }

    fn mappings(&self) -> Vec<MappingInfo> {
        read(&self.table).list()
    }

    fn fault_count(&self) -> u64 {
        self.faults.load(Ordering::Relaxed)
    }

    fn dma_bytes(&self) -> Option<(u64, u64)> {
        Some((
            self.bytes_read.load(Ordering::Relaxed),
            self.bytes_written.load(Ordering::Relaxed),
        ))
    }

    fn set_fault_listener(&self, listener: Option<Arc<dyn FaultListener>>) {
        *write(&self.listener) = listener;
    }

    fn start_dirty_log(&self) -> bool {
        let mut t = write(&self.table);
        if !self.logging.swap(true, Ordering::AcqRel) {
            for (_, e) in t.map.iter_mut() {
                e.dirty = Some(Arc::new(PageBits::new(e.size)));
            }
            log::info!("{}: dirty logging started", self.name);
        }
        true
    }

    fn stop_dirty_log(&self) {
        let mut t = write(&self.table);
        if self.logging.swap(false, Ordering::AcqRel) {
            for (_, e) in t.map.iter_mut() {
                e.dirty = None;
            }
            log::info!("{}: dirty logging stopped", self.name);
        }
    }

    fn fetch_dirty(&self, iova: u64, len: u64) -> Result<DirtyPages, DirtyLogError> {
        let mut out = DirtyPages::empty(iova, len)?;
        if !self.logging.load(Ordering::Acquire) {
            return Err(DirtyLogError::NotStarted);
        }
        let end = iova + len;
        let t = read(&self.table);
        // Mappings that overlap the range: the one that starts at or before `iova`, and the
        // ones that start inside.
        let first = t
            .map
            .range(..=iova)
            .next_back()
            .map(|(&s, _)| s)
            .unwrap_or(iova);
        for (&start, e) in t.map.range(first..end) {
            let (s, x) = (start.max(iova), start.saturating_add(e.size).min(end));
            if s >= x {
                continue;
            }
            if let Some(d) = &e.dirty {
                d.take_into(
                    (s - start) / IOMMU_PAGE_SIZE,
                    (x - s) / IOMMU_PAGE_SIZE,
                    &mut out,
                    (s - iova) / IOMMU_PAGE_SIZE,
                );
            }
        }
        Ok(out)
    }
}

impl emulated::DmaMemory for SoftIommu {
    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), emulated::DmaFault> {
        self.dma_read(iova, buf)
            .map_err(|f| emulated::DmaFault::read(f.iova, buf.len()))
    }

    fn write(&self, iova: u64, buf: &[u8]) -> Result<(), emulated::DmaFault> {
        self.dma_write(iova, buf)
            .map_err(|f| emulated::DmaFault::write(f.iova, buf.len()))
    }

    fn read_into(
        &self,
        iova: u64,
        dst: emulated::RawSpan<'_>,
        scratch: &mut Vec<u8>,
    ) -> Result<(), emulated::DmaFault> {
        let ok = self.try_read_with(iova, dst.len(), |b, off, at, n| {
            b.read_into_raw(off, piece(dst, at, n)?, scratch)
        });
        self.account(iova, dst.len(), false, ok)
            .map_err(|f| emulated::DmaFault::read(f.iova, dst.len()))
    }

    fn write_from(
        &self,
        iova: u64,
        src: emulated::RawSpan<'_>,
        scratch: &mut Vec<u8>,
    ) -> Result<(), emulated::DmaFault> {
        let ok = self.try_write_with(iova, src.len(), |b, off, at, n| {
            b.write_from_raw(off, piece(src, at, n)?, scratch)
        });
        self.account(iova, src.len(), true, ok)
            .map_err(|f| emulated::DmaFault::write(f.iova, src.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backing(size: usize, fill: u8) -> Arc<VecBacking> {
        let b = Arc::new(VecBacking::new(size));
        b.fill(fill);
        b
    }

    #[test]
    fn map_validation() {
        let d = SoftIommu::new("t");
        let b = backing(0x3000, 0);
        assert!(matches!(
            d.map(0x1000, 0, b.clone()),
            Err(IommuError::BadRange { .. })
        ));
        assert!(matches!(
            d.map(0x1001, 0x1000, b.clone()),
            Err(IommuError::Unaligned { .. })
        ));
        assert!(matches!(
            d.map(0x1000, 0x4000, b.clone()),
            Err(IommuError::BackingTooSmall { .. })
        ));
        assert!(matches!(
            d.map(u64::MAX - 0xfff, 0x2000, b.clone()),
            Err(IommuError::BadRange { .. })
        ));
        d.map(0x10000, 0x2000, b.clone()).unwrap();
        // Overlaps from below, above, inside and around.
        for (iova, size) in [
            (0xf000, 0x2000),
            (0x11000, 0x2000),
            (0x10000, 0x1000),
            (0xe000, 0x3000),
        ] {
            let e = d.map(iova, size, b.clone()).unwrap_err();
            assert!(matches!(e, IommuError::Overlap { .. }), "{iova:#x}: {e}");
        }
        // Adjacent is fine.
        d.map(0xe000, 0x2000, b.clone()).unwrap();
        d.map(0x12000, 0x1000, b.clone()).unwrap();
        assert_eq!(
            d.mappings(),
            vec![
                MappingInfo {
                    iova: 0xe000,
                    size: 0x2000
                },
                MappingInfo {
                    iova: 0x10000,
                    size: 0x2000
                },
                MappingInfo {
                    iova: 0x12000,
                    size: 0x1000
                },
            ]
        );
        assert!(matches!(
            d.unmap(0x10000, 0x1000),
            Err(IommuError::NotMapped { .. })
        ));
        d.unmap(0x10000, 0x2000).unwrap();
        assert_eq!(d.unmap_all(), 2);
        assert!(d.mappings().is_empty());
    }

    #[test]
    fn dma_is_bounds_checked_and_faults_touch_nothing() {
        let d = SoftIommu::new("t");
        let b = backing(0x3000, 0xAA);
        // Map only the middle page of the backing's first 0x2000 bytes... the window is the
        // first 0x1000 bytes mapped at 0x100000.
        d.map(0x100000, 0x1000, b.clone()).unwrap();
        d.dma_write(0x100ff0, &[1; 16]).unwrap();
        let mut buf = [0u8; 16];
        d.dma_read(0x100ff0, &mut buf).unwrap();
        assert_eq!(buf, [1; 16]);
        // Crossing the end of the window: refused, nothing written.
        let f = d.dma_write(0x100ff8, &[2; 16]).unwrap_err();
        assert_eq!(
            f,
            IommuFault {
                iova: 0x100ff8,
                len: 16,
                write: true
            }
        );
        assert!(d.dma_read(0xfffff, &mut buf).is_err());
        assert!(d.dma_read(u64::MAX - 4, &mut buf).is_err());
        assert_eq!(d.fault_count(), 3);
        let snap = b.snapshot();
        assert_eq!(&snap[0xff0..0x1000], &[1; 16]);
        assert!(snap[0x1000..].iter().all(|&x| x == 0xAA));
        // After unmap everything faults.
        d.unmap(0x100000, 0x1000).unwrap();
        assert!(d.dma_read(0x100000, &mut buf).is_err());
        assert_eq!(d.fault_count(), 4);
    }

    #[test]
    fn bytes_moved_and_faults_are_counted_and_reported() {
        struct Rec(Mutex<Vec<(IommuFault, u64)>>);
        impl FaultListener for Rec {
            fn fault(&self, f: &IommuFault, total: u64) {
                lock(&self.0).push((*f, total));
            }
        }
        let d = SoftIommu::new("t");
        d.map(0x10000, 0x2000, backing(0x2000, 0)).unwrap();
        let rec = Arc::new(Rec(Mutex::new(Vec::new())));
        d.set_fault_listener(Some(rec.clone()));
        d.dma_write(0x10ff0, &[1; 0x20]).unwrap();
        let mut buf = [0u8; 0x100];
        d.dma_read(0x10000, &mut buf).unwrap();
        d.dma_read(0x10000, &mut buf[..8]).unwrap();
        assert_eq!(d.dma_bytes(), Some((0x108, 0x20)));
        // Refused accesses move nothing and reach the listener with the running total.
        assert!(d.dma_write(0x11ff0, &[0; 0x20]).is_err());
        assert!(d.dma_read(0x2000, &mut buf).is_err());
        assert_eq!(d.dma_bytes(), Some((0x108, 0x20)));
        let seen = lock(&rec.0).clone();
        assert_eq!(
            seen,
            vec![
                (
                    IommuFault {
                        iova: 0x11ff0,
                        len: 0x20,
                        write: true
                    },
                    1
                ),
                (
                    IommuFault {
                        iova: 0x2000,
                        len: 0x100,
                        write: false
                    },
                    2
                ),
            ]
        );
        d.set_fault_listener(None);
        assert!(d.dma_read(0x2000, &mut buf).is_err());
        assert_eq!(lock(&rec.0).len(), 2, "no listener after it was removed");
        assert_eq!(d.fault_count(), 3);
    }

    #[test]
    fn dma_spans_adjacent_windows() {
        let d = SoftIommu::new("t");
        let a = backing(0x1000, 0);
        let b = backing(0x1000, 0);
        d.map(0x0, 0x1000, a.clone()).unwrap();
        d.map(0x1000, 0x1000, b.clone()).unwrap();
        d.dma_write(0xffe, &[7, 8, 9, 10]).unwrap();
        assert_eq!(&a.snapshot()[0xffe..], &[7, 8]);
        assert_eq!(&b.snapshot()[..2], &[9, 10]);
        let mut buf = [0u8; 4];
        d.dma_read(0xffe, &mut buf).unwrap();
        assert_eq!(buf, [7, 8, 9, 10]);
        // A gap after the second window faults even when partly covered.
        assert!(d.dma_write(0x1ffe, &[0; 4]).is_err());
        assert_eq!(&b.snapshot()[0xffe..], &[0, 0]);
    }

    #[test]
    fn dirty_log_records_device_writes_only_and_fetch_clears() {
        let d = SoftIommu::new("t");
        d.map(0x10000, 0x4000, backing(0x4000, 0)).unwrap();
        // Off: writes are not recorded, a fetch is refused.
        d.dma_write(0x10000, &[1; 8]).unwrap();
        assert_eq!(
            d.fetch_dirty(0x10000, 0x4000),
            Err(DirtyLogError::NotStarted)
        );
        assert!(d.start_dirty_log(), "the software domain tracks exactly");
        let mut buf = [0u8; 64];
        d.dma_read(0x11000, &mut buf).unwrap();
        d.dma_write(0x12ffc, &[2; 8]).unwrap(); // pages 2 and 3
        assert!(
            d.dma_write(0x13ffc, &[2; 8]).is_err(),
            "fault: nothing dirty"
        );
        // A window mapped while logging is on is logged too.
        d.map(0x20000, 0x1000, backing(0x1000, 0)).unwrap();
        d.dma_write(0x20010, &[3; 4]).unwrap();
        let got = d.fetch_dirty(0x10000, 0x11000).unwrap();
        assert!(!got.whole_window);
        assert_eq!(got.iovas(), vec![0x12000, 0x13000, 0x20000]);
        assert_eq!(d.fetch_dirty(0x10000, 0x11000).unwrap().count(), 0);
        // Part of the range: the rest stays for the next fetch.
        d.dma_write(0x10000, &[4; 4]).unwrap();
        d.dma_write(0x13000, &[4; 4]).unwrap();
        assert_eq!(
            d.fetch_dirty(0x13000, 0x1000).unwrap().iovas(),
            vec![0x13000]
        );
        assert_eq!(
            d.fetch_dirty(0x10000, 0x4000).unwrap().iovas(),
            vec![0x10000]
        );
        assert!(matches!(
            d.fetch_dirty(0x10001, 0x1000),
            Err(DirtyLogError::BadRange { .. })
        ));
        d.stop_dirty_log();
        d.dma_write(0x10000, &[5; 4]).unwrap();
        assert_eq!(
            d.fetch_dirty(0x10000, 0x4000),
            Err(DirtyLogError::NotStarted)
        );
        d.start_dirty_log();
        assert_eq!(
            d.fetch_dirty(0x10000, 0x4000).unwrap().count(),
            0,
            "a restart begins clean"
        );
    }

    /// A device buffer's bytes as the copy engines hand them to the domain.
    struct Buf(Box<[u64]>);
    impl Buf {
        fn new(len: usize, fill: u8) -> Self {
            Buf(vec![u64::from_ne_bytes([fill; 8]); len / 8].into_boxed_slice())
        }
        fn span(&mut self) -> emulated::RawSpan<'_> {
            let len = self.0.len() * 8;
            let p = std::ptr::NonNull::new(self.0.as_mut_ptr().cast::<u8>()).unwrap();
            // SAFETY: the boxed slice is valid for `len` bytes while `self` is borrowed.
            unsafe { emulated::RawSpan::new(p, len) }
        }
        fn bytes(&self) -> Vec<u8> {
            self.0.iter().flat_map(|w| w.to_ne_bytes()).collect()
        }
    }

    #[test]
    fn raw_copies_go_straight_to_mapped_memory_and_keep_every_rule_of_dma() {
        use emulated::DmaMemory;
        let mem = ntb::SharedMemory::new("ram", 0x4000).unwrap();
        let d = SoftIommu::new("t");
        // A mapping of a file (one copy) next to heap memory (staged through `scratch`).
        d.map(0x10000, 0x2000, view(&mem, 0, 0x2000)).unwrap();
        let heap = backing(0x1000, 0);
        d.map(0x12000, 0x1000, heap.clone()).unwrap();
        assert!(d.start_dirty_log());
        let mut scratch = Vec::new();
        let mut src = Buf::new(0x1000, 0x5a);
        // Across both windows: the file's last 0x800 bytes and the heap's first 0x800.
        d.write_from(0x11800, src.span(), &mut scratch).unwrap();
        let mut seen = vec![0u8; 0x1000];
        d.dma_read(0x11800, &mut seen).unwrap();
        assert!(seen.iter().all(|&x| x == 0x5a));
        assert!(heap.snapshot()[..0x800].iter().all(|&x| x == 0x5a));
        assert!(heap.snapshot()[0x800..].iter().all(|&x| x == 0));
        assert_eq!(
            d.fetch_dirty(0x10000, 0x3000).unwrap().iovas(),
            vec![0x11000, 0x12000],
            "raw writes are logged as writes"
        );
        // And back, into another buffer.
        let mut dst = Buf::new(0x1000, 0);
        d.read_into(0x11800, dst.span(), &mut scratch).unwrap();
        assert!(dst.bytes().iter().all(|&x| x == 0x5a));
        assert_eq!(d.dma_bytes(), Some((0x2000, 0x1000)));
        // Partly unmapped: refused whole, nothing moved, counted as a fault.
        let mut other = Buf::new(0x1000, 0x77);
        let f = d
            .write_from(0x12800, other.span(), &mut scratch)
            .unwrap_err();
        assert_eq!((f.iova, f.len, f.kind), (0x12800, 0x1000, "write"));
        assert!(heap.snapshot()[0x800..].iter().all(|&x| x == 0));
        assert!(d.read_into(0xf800, other.span(), &mut scratch).is_err());
        assert!(
            other.bytes().iter().all(|&x| x == 0x77),
            "a refused read writes nothing"
        );
        assert_eq!(d.fault_count(), 2);
        assert_eq!(d.dma_bytes(), Some((0x2000, 0x1000)));
    }

    /// A view of `[offset, offset + size)` of `mem` (each call maps it anew, as a second
    /// VMM's window of the same memfd does).
    fn view(mem: &ntb::SharedMemory, offset: u64, size: u64) -> Arc<MmapBacking> {
        let fd = mem.fd().try_clone_to_owned().unwrap();
        Arc::new(MmapBacking::new(fd, offset, size).unwrap())
    }

    #[test]
    fn rebind_keeps_the_mapping_and_its_dirty_bits_for_the_same_memory_only() {
        let mem = ntb::SharedMemory::new("ram", 0x8000).unwrap();
        let other = ntb::SharedMemory::new("other", 0x8000).unwrap();
        let d = SoftIommu::new("t");
        let old = view(&mem, 0, 0x4000);
        d.map(0x10000, 0x4000, old.clone()).unwrap();
        d.start_dirty_log();
        d.dma_write(0x11000, &[1; 8]).unwrap();
        // Not the same memory: another file, another range of the file, no identity, no
        // such mapping. Each leaves the mapping as it was.
        for (what, b) in [
            ("other file", view(&other, 0, 0x4000) as Arc<dyn DmaBacking>),
            ("other range", view(&mem, 0x4000, 0x4000)),
            ("heap", Arc::new(VecBacking::new(0x4000))),
        ] {
            let e = d.rebind(0x10000, 0x4000, b).unwrap_err();
            assert!(matches!(e, IommuError::NotSameMemory { .. }), "{what}: {e}");
        }
        assert!(matches!(
            d.rebind(0x10000, 0x2000, view(&mem, 0, 0x4000)),
            Err(IommuError::NotMapped { .. })
        ));
        assert_eq!(Arc::strong_count(&old), 2, "still the mapping's backing");
        d.rebind(0x10000, 0x4000, view(&mem, 0, 0x4000)).unwrap();
        assert_eq!(Arc::strong_count(&old), 1, "the old view is let go");
        assert_eq!(
            d.mappings(),
            vec![MappingInfo {
                iova: 0x10000,
                size: 0x4000
            }]
        );
        // DMA goes on through the new view, onto the same memory; the page written before
        // the rebind is still dirty, and so is the one written after.
        drop(old);
        d.dma_write(0x13000, &[2; 8]).unwrap();
        let mut got = [0u8; 8];
        mem.read_at(0x3000, &mut got).unwrap();
        assert_eq!(got, [2; 8]);
        mem.write_at(0x2000, &[3; 8]).unwrap();
        d.dma_read(0x12000, &mut got).unwrap();
        assert_eq!(got, [3; 8]);
        assert_eq!(
            d.fetch_dirty(0x10000, 0x4000).unwrap().iovas(),
            vec![0x11000, 0x13000]
        );
        assert_eq!(d.fault_count(), 0);
    }

    #[test]
    fn no_dirty_page_is_lost_under_concurrent_dma() {
        const PAGES: u64 = 512;
        let d = Arc::new(SoftIommu::new("t"));
        d.map(0, PAGES * 4096, backing((PAGES * 4096) as usize, 0))
            .unwrap();
        d.start_dirty_log();
        let stop = Arc::new(AtomicBool::new(false));
        // Other writers hammer every page (so fetches race with writes to the same words)...
        let writers: Vec<_> = (0..3u64)
            .map(|w| {
                let (d, stop) = (Arc::clone(&d), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let mut x = w * 7919 + 1;
                    while !stop.load(Ordering::Relaxed) {
                        x = x
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        let page = (x >> 33) % PAGES;
                        d.dma_write(page * 4096 + (x >> 20) % 4000, &[w as u8; 64])
                            .unwrap();
                    }
                })
            })
            .collect();
        // ...while every write that finished before a fetch must be in that fetch or an
        // earlier one: here, the fetch right after it (nobody else fetches).
        for round in 0..2000u64 {
            let page = (round * 37) % PAGES;
            d.dma_write(page * 4096, &[9; 8]).unwrap();
            let got = d.fetch_dirty(0, PAGES * 4096).unwrap();
            assert!(got.is_set(page), "round {round}: page {page} lost");
        }
        stop.store(true, Ordering::Relaxed);
        for w in writers {
            w.join().unwrap();
        }
    }
}
