//! The borrower's exported window (its guest RAM) as the DMA backing of a lease's IOMMU
//! domain: on shm a mapping DMA copies into directly, on tcp messages.

use std::ptr::NonNull;

use ntb::PeerWindow;

use crate::iommu::{BackingError, DmaBacking};

/// The borrower's exported window as DMA backing.
pub(super) struct PeerWindowBacking {
    pub(super) win: Box<dyn PeerWindow>,
}

impl DmaBacking for PeerWindowBacking {
    fn size(&self) -> u64 {
        self.win.len()
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackingError> {
        self.win
            .read_at(offset, buf)
            .map_err(|e| BackingError::Transfer(e.to_string()))
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BackingError> {
        self.win
            .write_at(offset, data)
            .map_err(|e| BackingError::Transfer(e.to_string()))
    }

    fn read_into_raw(
        &self,
        offset: u64,
        dst: emulated::RawSpan<'_>,
        scratch: &mut Vec<u8>,
    ) -> Result<(), BackingError> {
        let Some(p) = self.mapped(offset, dst.len())? else {
            return crate::iommu::backing::read_into_staged(self, offset, dst, scratch);
        };
        // SAFETY: `mapped` checked that the range lies inside the window's mapping, which stays
        // valid while `self.win` lives (a severed window is replaced by anonymous memory, never
        // unmapped under us); `dst` is valid per RawSpan's contract.
        unsafe { std::ptr::copy(p, dst.as_ptr(), dst.len()) };
        Ok(())
    }

    fn write_from_raw(
        &self,
        offset: u64,
        src: emulated::RawSpan<'_>,
        scratch: &mut Vec<u8>,
    ) -> Result<(), BackingError> {
        let Some(p) = self.mapped(offset, src.len())? else {
            return crate::iommu::backing::write_from_staged(self, offset, src, scratch);
        };
        // SAFETY: as in read_into_raw; the window is mapped writable.
        unsafe { std::ptr::copy(src.as_ptr(), p, src.len()) };
        Ok(())
    }

    fn host_addr(&self) -> Option<NonNull<u8>> {
        self.win.as_ptr().ok().and_then(NonNull::new)
    }

    fn backing_id(&self) -> Option<ntb::BackingId> {
        self.win.backing_id()
    }
}

impl PeerWindowBacking {
    /// Where `[offset, offset + len)` of the window is mapped in this process (shm), so a DMA
    /// copies once; `None` for a window reached by messages. A severed window is an error,
    /// as its accessors report it.
    fn mapped(&self, offset: u64, len: usize) -> Result<Option<*mut u8>, BackingError> {
        let Ok(base) = self.win.as_ptr() else {
            return Ok(None);
        };
        if !self.win.is_live() {
            return Err(BackingError::Transfer("borrower window severed".into()));
        }
        crate::iommu::backing::check_range(offset, len, self.win.len())?;
        // SAFETY: the range lies inside the window's mapping (checked above).
        Ok(Some(unsafe { base.add(offset as usize) }))
    }
}
