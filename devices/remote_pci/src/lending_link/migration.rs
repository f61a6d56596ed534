//! The lease's live-migration requests (protocol version 4) as a [`LeaseMigration`].

use std::sync::{Arc, Mutex, PoisonError};

use lending::client::{ClientError, Lease};
use lending::iommu::MAX_DIRTY_PAGES;
use lending::protocol::migration::DirtyBitmap;

use super::link_err;
use crate::link::{DeviceDirtyPages, HandoverState, LeaseMigration, LeaseTicket, LinkError};

const PAGE: u64 = 4096;

/// The (GPA, size) ranges the lease has mapped for DMA now (kept by its `LendingDma`).
pub(super) type DmaRanges = Arc<Mutex<Vec<(u64, u64)>>>;

/// The lease's version 4 migration requests.
pub(super) struct LendingMigration {
    pub(super) lease: Arc<Lease>,
    pub(super) ranges: DmaRanges,
}

/// The dirty pages of `ranges`, fetched in pieces of at most `max_pages` pages (what one
/// DIRTY_LOG_FETCH may ask for) and merged into one bitmap from the lowest to the highest
/// address. No range: nothing the device can have written.
fn fetch_chunked(
    ranges: &[(u64, u64)],
    max_pages: u64,
    mut fetch: impl FnMut(u64, u64) -> Result<DirtyBitmap, ClientError>,
) -> Result<DeviceDirtyPages, ClientError> {
    let (Some(lo), Some(hi)) = (
        ranges.iter().map(|r| r.0).min(),
        ranges.iter().map(|r| r.0 + r.1).max(),
    ) else {
        return Ok(DeviceDirtyPages {
            iova: 0,
            pages: 0,
            bits: Vec::new(),
            whole_window: false,
        });
    };
    let pages = (hi - lo).div_ceil(PAGE);
    let mut out = DeviceDirtyPages {
        iova: lo,
        pages,
        bits: vec![0; pages.div_ceil(64) as usize],
        whole_window: false,
    };
    let step = max_pages.max(1) * PAGE;
    for &(gpa, size) in ranges {
        let mut at = gpa;
        while at < gpa + size {
            let len = step.min(gpa + size - at);
            let d = fetch(at, len)?;
            out.whole_window |= d.whole_window;
            for i in 0..d.pages.min(len / PAGE) {
                if d.bits
                    .get((i / 64) as usize)
                    .is_some_and(|w| w & (1 << (i % 64)) != 0)
                {
                    let page = (d.iova - lo) / PAGE + i;
                    if let Some(w) = out.bits.get_mut((page / 64) as usize) {
                        *w |= 1 << (page % 64);
                    }
                }
            }
            at += len;
        }
    }
    Ok(out)
}

impl LeaseMigration for LendingMigration {
    fn lease_id(&self) -> u64 {
        self.lease.id()
    }

    fn start_dirty_log(&self) -> Result<bool, LinkError> {
        self.lease
            .start_dirty_log()
            .map_err(|e| link_err("dirty log start", e))
    }

    fn fetch_dirty_log(&self) -> Result<DeviceDirtyPages, LinkError> {
        // Per mapped range and in bounded pieces: guest RAM above the 32-bit hole spans more
        // than one fetch may cover.
        let ranges = self
            .ranges
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        fetch_chunked(&ranges, MAX_DIRTY_PAGES, |iova, len| {
            self.lease.fetch_dirty_log(iova, len)
        })
        .map_err(|e| link_err("dirty log fetch", e))
    }

    fn stop_dirty_log(&self) -> Result<(), LinkError> {
        self.lease
            .stop_dirty_log()
            .map_err(|e| link_err("dirty log stop", e))
    }

    fn quiesce_for_handover(&self, timeout_ms: u32) -> Result<HandoverState, LinkError> {
        let q = self
            .lease
            .quiesce_for_handover(timeout_ms)
            .map_err(|e| link_err("hand-over quiesce", e))?;
        Ok(HandoverState {
            drained: q.drained,
            pending_msix: q.pending_msix,
            pending_intx: q.pending_intx,
        })
    }

    fn resume_after_handover(&self) -> Result<(), LinkError> {
        self.lease
            .quiesce(false)
            .map_err(|e| link_err("hand-over resume", e))
    }

    fn create_transfer(&self, to_node: &str, to_vm: &str) -> Result<LeaseTicket, LinkError> {
        let t = self
            .lease
            .create_transfer(to_node, to_vm)
            .map_err(|e| link_err("transfer create", e))?;
        Ok(LeaseTicket {
            lease: t.lease,
            ticket: t.ticket,
            expires_in_ms: t.expires_in_ms,
            // A claim is the directory's business, not the link's: the VMM adds it.
            claim: None,
        })
    }

    fn cancel_transfer(&self) -> Result<(), LinkError> {
        self.lease
            .cancel_transfer()
            .map_err(|e| link_err("transfer cancel", e))
    }

    fn mark_moved(&self) {
        self.lease.mark_moved();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lender that refuses more than `max` pages per fetch and reports every page of
    /// `written` (absolute page numbers).
    fn lender(
        max: u64,
        written: &[u64],
    ) -> impl FnMut(u64, u64) -> Result<DirtyBitmap, ClientError> + '_ {
        move |iova, len| {
            let pages = len / PAGE;
            assert!(pages <= max, "fetch of {pages} pages");
            let mut bits = vec![0u64; pages.div_ceil(64) as usize];
            for &p in written {
                if p >= iova / PAGE && p < iova / PAGE + pages {
                    let i = p - iova / PAGE;
                    bits[(i / 64) as usize] |= 1 << (i % 64);
                }
            }
            Ok(DirtyBitmap {
                iova,
                pages,
                bits,
                whole_window: false,
            })
        }
    }

    fn set(d: &DeviceDirtyPages) -> Vec<u64> {
        (0..d.pages)
            .filter(|i| d.bits[(i / 64) as usize] & (1 << (i % 64)) != 0)
            .map(|i| d.iova / PAGE + i)
            .collect()
    }

    /// RAM below and above a hole, wider than one fetch: every written page is found, at its
    /// own address, and no fetch asks for more than the lender allows.
    #[test]
    fn ranges_wider_than_one_fetch_are_fetched_in_pieces() {
        let ranges = [(0, 300 * PAGE), (1000 * PAGE, 250 * PAGE)];
        let written = [0, 99, 100, 299, 1000, 1133, 1249];
        let mut calls = 0;
        let mut f = lender(100, &written);
        let d = fetch_chunked(&ranges, 100, |i, l| {
            calls += 1;
            f(i, l)
        })
        .unwrap();
        assert_eq!(calls, 3 + 3);
        assert_eq!((d.iova, d.pages), (0, 1250));
        assert_eq!(set(&d), written);
        assert!(!d.whole_window);
    }

    #[test]
    fn no_dma_mapped_means_nothing_written() {
        let d = fetch_chunked(&[], 100, |_, _| panic!("nothing to fetch")).unwrap();
        assert_eq!((d.pages, d.bits.len()), (0, 0));
    }

    #[test]
    fn a_refused_piece_fails_the_fetch() {
        let e = fetch_chunked(&[(0, 10 * PAGE)], 4, |i, _| {
            if i >= 4 * PAGE {
                Err(ClientError::Unsupported {
                    lender: "l".into(),
                    what: "dirty log",
                    version: 3,
                    needs: 4,
                })
            } else {
                Ok(DirtyBitmap {
                    iova: i,
                    pages: 4,
                    bits: vec![0],
                    whole_window: true,
                })
            }
        });
        assert!(e.is_err());
    }
}
