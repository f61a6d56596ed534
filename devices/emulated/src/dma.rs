//! The DMA seam: every device memory access goes through [`DmaMemory`].

use thiserror::Error;

/// A DMA access the IOMMU refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("dma {kind} of {len:#x} bytes at iova {iova:#x} is outside the mapped window")]
pub struct DmaFault {
    /// First IOVA of the refused access.
    pub iova: u64,
    /// Length of the refused access.
    pub len: usize,
    /// "read" or "write".
    pub kind: &'static str,
}

impl DmaFault {
    /// A refused read of `len` bytes at `iova`.
    pub fn read(iova: u64, len: usize) -> Self {
        DmaFault {
            iova,
            len,
            kind: "read",
        }
    }

    /// A refused write of `len` bytes at `iova`.
    pub fn write(iova: u64, len: usize) -> Self {
        DmaFault {
            iova,
            len,
            kind: "write",
        }
    }
}

/// Device-visible memory (the borrower's RAM through the lender's IOMMU domain).
///
/// Implementations must check the whole range and either perform the full access or none of
/// it, returning [`DmaFault`] (and counting the fault) when any byte is unmapped.
pub trait DmaMemory: Send + Sync {
    /// Copy `buf.len()` bytes from device address `iova` into `buf`.
    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaFault>;
    /// Copy `buf` to device address `iova`.
    fn write(&self, iova: u64, buf: &[u8]) -> Result<(), DmaFault>;
}
