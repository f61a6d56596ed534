//! Device dirty log: the guest pages a lent device wrote by DMA (for live migration of the
//! borrowing VM; KVM's dirty log cannot see these writes, they never pass through a vCPU).
//!
//! The software domain ([`super::SoftIommu`]) sees every DMA, so it logs exactly: each
//! mapping gets a [`PageBits`] while logging is on, and a completed device write sets the bits
//! of the pages it touched. A fetch clears exactly the bits it returns with one atomic
//! `fetch_and` per word, so a write racing with the fetch is either in this fetch or in the
//! next one, never lost. The bit is set *after* the bytes landed: a fetch that sees the bit
//! and copies the page sees the new bytes; a write whose bit is set after the fetch is
//! reported by the next fetch (the final fetch after the device is drained reports all).
//!
//! A domain that cannot see the device's writes (VFIO without IOMMU dirty tracking, which
//! iommufd offers and the container API does not) answers with every mapped page of the
//! range set and [`DirtyPages::whole_window`]: the VMM copies the whole window at the final
//! pass.
//!
//! Off by default; off, a DMA write costs one `Option` check.

use std::sync::atomic::{AtomicU64, Ordering};

use thiserror::Error;

use super::IOMMU_PAGE_SIZE;

/// Most pages one fetch covers (4 GiB of IOVA, a 128 KiB bitmap: well inside one message).
pub const MAX_DIRTY_PAGES: u64 = 1 << 20;

/// Errors of dirty-log requests.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum DirtyLogError {
    /// The range is empty, unaligned, wraps or is larger than [`MAX_DIRTY_PAGES`].
    #[error(
        "dirty log range iova {iova:#x} len {len:#x} is empty, not 4 KiB aligned, wraps or \
         exceeds {MAX_DIRTY_PAGES} pages"
    )]
    BadRange {
        /// Start IOVA.
        iova: u64,
        /// Length in bytes.
        len: u64,
    },
    /// A fetch before START (or after STOP).
    #[error("dirty logging is not started on this domain")]
    NotStarted,
}

/// The pages of `[iova, iova + pages * 4 KiB)` written since the previous fetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirtyPages {
    /// First IOVA of the range (page aligned).
    pub iova: u64,
    /// Pages in the range.
    pub pages: u64,
    /// Bit `i` (word `i / 64`, bit `i % 64`) = page `iova + i * 4 KiB` was written.
    pub bits: Vec<u64>,
    /// The domain cannot track writes: every mapped page of the range is reported, every
    /// time (the VMM copies the whole window at the final pass).
    pub whole_window: bool,
}

impl DirtyPages {
    /// An empty bitmap of the range (checked).
    pub fn empty(iova: u64, len: u64) -> Result<Self, DirtyLogError> {
        let bad = DirtyLogError::BadRange { iova, len };
        if len == 0
            || !iova.is_multiple_of(IOMMU_PAGE_SIZE)
            || !len.is_multiple_of(IOMMU_PAGE_SIZE)
            || iova.checked_add(len).is_none()
        {
            return Err(bad);
        }
        let pages = len / IOMMU_PAGE_SIZE;
        if pages > MAX_DIRTY_PAGES {
            return Err(bad);
        }
        Ok(DirtyPages {
            iova,
            pages,
            bits: vec![0; pages.div_ceil(64) as usize],
            whole_window: false,
        })
    }

    /// Marks page `i` of the range.
    pub fn set(&mut self, i: u64) {
        if let Some(w) = self.bits.get_mut((i / 64) as usize) {
            *w |= 1 << (i % 64);
        }
    }

    /// Whether page `i` of the range is marked.
    pub fn is_set(&self, i: u64) -> bool {
        self.bits
            .get((i / 64) as usize)
            .is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    /// IOVAs of the marked pages.
    pub fn iovas(&self) -> Vec<u64> {
        (0..self.pages)
            .filter(|&i| self.is_set(i))
            .map(|i| self.iova + i * IOMMU_PAGE_SIZE)
            .collect()
    }

    /// Number of marked pages.
    pub fn count(&self) -> u64 {
        self.bits.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// Marks every page of the range that `[m_iova, m_iova + m_size)` covers.
    pub fn set_covered(&mut self, m_iova: u64, m_size: u64) {
        let end = self.iova + self.pages * IOMMU_PAGE_SIZE;
        let (s, e) = (
            m_iova.max(self.iova),
            m_iova.saturating_add(m_size).min(end),
        );
        let mut a = s;
        while a < e {
            self.set((a - self.iova) / IOMMU_PAGE_SIZE);
            a += IOMMU_PAGE_SIZE;
        }
    }
}

/// One bit per page of one mapping, set by device writes, cleared by fetches.
#[derive(Debug)]
pub struct PageBits {
    words: Vec<AtomicU64>,
}

impl PageBits {
    /// Bits for a mapping of `size` bytes.
    pub fn new(size: u64) -> Self {
        let pages = size.div_ceil(IOMMU_PAGE_SIZE);
        PageBits {
            words: (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Marks the pages of `[off, off + len)` (offsets into the mapping) written. Called after
    /// the bytes landed (module docs).
    pub fn mark(&self, off: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = off / IOMMU_PAGE_SIZE;
        let last = (off + len - 1) / IOMMU_PAGE_SIZE;
        for p in first..=last {
            if let Some(w) = self.words.get((p / 64) as usize) {
                w.fetch_or(1 << (p % 64), Ordering::Release);
            }
        }
    }

    /// Moves the marks of the mapping's pages `[first, first + n)` into `out` (bit `at + i`
    /// for mapping page `first + i`) and clears exactly those, atomically per word.
    pub fn take_into(&self, first: u64, n: u64, out: &mut DirtyPages, at: u64) {
        let mut p = first;
        let end = first + n;
        while p < end {
            let word = (p / 64) as usize;
            let lo = p % 64;
            let hi = (end - (p - lo)).min(64);
            let mask = if hi - lo == 64 {
                u64::MAX
            } else {
                ((1u64 << (hi - lo)) - 1) << lo
            };
            let Some(w) = self.words.get(word) else {
                return;
            };
            let old = w.fetch_and(!mask, Ordering::AcqRel) & mask;
            let mut bits = old;
            while bits != 0 {
                let b = u64::from(bits.trailing_zeros());
                out.set(at + (p - first) + (b - lo));
                bits &= bits - 1;
            }
            p += hi - lo;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked() {
        assert!(DirtyPages::empty(0, 0).is_err());
        assert!(DirtyPages::empty(1, 4096).is_err());
        assert!(DirtyPages::empty(0, 4095).is_err());
        assert!(DirtyPages::empty(u64::MAX - 4095, 8192).is_err());
        assert!(DirtyPages::empty(0, (MAX_DIRTY_PAGES + 1) * 4096).is_err());
        let d = DirtyPages::empty(0x10000, 65 * 4096).unwrap();
        assert_eq!((d.pages, d.bits.len()), (65, 2));
    }

    #[test]
    fn take_clears_exactly_what_it_returns() {
        let b = PageBits::new(200 * 4096);
        b.mark(0, 1);
        b.mark(63 * 4096 + 4000, 200); // pages 63 and 64
        b.mark(130 * 4096, 3 * 4096); // 130..=132
                                      // Fetch pages 60..131 only: 63, 64, 130 come out; 0, 131, 132 stay.
        let mut out = DirtyPages::empty(60 * 4096, 71 * 4096).unwrap();
        b.take_into(60, 71, &mut out, 0);
        assert_eq!(out.iovas(), vec![63 * 4096, 64 * 4096, 130 * 4096]);
        let mut all = DirtyPages::empty(0, 200 * 4096).unwrap();
        b.take_into(0, 200, &mut all, 0);
        assert_eq!(all.iovas(), vec![0, 131 * 4096, 132 * 4096]);
        let mut again = DirtyPages::empty(0, 200 * 4096).unwrap();
        b.take_into(0, 200, &mut again, 0);
        assert_eq!(again.count(), 0);
    }
}
