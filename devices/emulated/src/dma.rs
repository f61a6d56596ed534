//! The DMA seam: every device memory access goes through [`DmaMemory`].

use std::marker::PhantomData;
use std::ptr::NonNull;

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
    /// Copy `dst.len()` bytes from device address `iova` straight into device memory `dst`
    /// (a copy engine's own buffer), with the same all-or-nothing rule as
    /// [`DmaMemory::read`]. An implementation that reaches the memory behind `iova` in this
    /// process copies once; the default stages the bytes in `scratch` (kept by the caller
    /// between copies, so a copy does not allocate and fault in fresh pages each time).
    fn read_into(
        &self,
        iova: u64,
        dst: RawSpan<'_>,
        scratch: &mut Vec<u8>,
    ) -> Result<(), DmaFault> {
        let buf = staging(scratch, dst.len());
        self.read(iova, buf)?;
        dst.copy_from(buf);
        Ok(())
    }
    /// Copy device memory `src` to device address `iova` (see [`DmaMemory::read_into`]).
    fn write_from(
        &self,
        iova: u64,
        src: RawSpan<'_>,
        scratch: &mut Vec<u8>,
    ) -> Result<(), DmaFault> {
        let buf = staging(scratch, src.len());
        src.copy_to(buf);
        self.write(iova, buf)
    }
}

/// The first `len` bytes of `scratch`, grown (never shrunk) to hold them.
pub fn staging(scratch: &mut Vec<u8>, len: usize) -> &mut [u8] {
    if scratch.len() < len {
        scratch.resize(len, 0);
    }
    &mut scratch[..len]
}

/// Bytes of memory that others change under a copy (a device's buffer that a guest maps, a
/// fabric window): reached only through raw copies, never as a Rust slice, and valid for as
/// long as the memory it was taken from (`'a`).
#[derive(Clone, Copy, Debug)]
pub struct RawSpan<'a> {
    ptr: NonNull<u8>,
    len: usize,
    _memory: PhantomData<&'a ()>,
}

impl<'a> RawSpan<'a> {
    /// `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes for `'a`, and no Rust
    /// reference to those bytes may exist meanwhile (other processes, and raw copies, may
    /// change them at any time).
    pub unsafe fn new(ptr: NonNull<u8>, len: usize) -> Self {
        RawSpan {
            ptr,
            len,
            _memory: PhantomData,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the span is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte (for a raw copy by an implementation of [`DmaMemory`]).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The `n` bytes at `at` of the span, if they lie inside it.
    pub fn sub(&self, at: usize, n: usize) -> Option<RawSpan<'a>> {
        (at.checked_add(n)? <= self.len).then(|| RawSpan {
            // SAFETY: `at` lies inside the span (checked), so the sum stays in it; the
            // result is non-null because `ptr` is and `at <= len` does not wrap.
            ptr: unsafe { NonNull::new_unchecked(self.ptr.as_ptr().add(at)) },
            len: n,
            _memory: PhantomData,
        })
    }

    /// Copy the span into `out` (whose length must equal the span's).
    ///
    /// # Panics
    /// If the lengths differ (a caller bug, never input).
    pub fn copy_to(&self, out: &mut [u8]) {
        assert_eq!(out.len(), self.len, "RawSpan::copy_to: length mismatch");
        // SAFETY: `new`'s contract keeps `len` bytes at `ptr` valid for `'a`; `out` is a
        // distinct Rust buffer (it cannot alias memory no reference may point into).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), out.as_mut_ptr(), self.len) }
    }

    /// Copy `data` (whose length must equal the span's) into the span.
    ///
    /// # Panics
    /// If the lengths differ (a caller bug, never input).
    pub fn copy_from(&self, data: &[u8]) {
        assert_eq!(data.len(), self.len, "RawSpan::copy_from: length mismatch");
        // SAFETY: as in copy_to, writable per `new`'s contract.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr(), self.len) }
    }

    /// Copy the span into `dst` (the same length), which may overlap it (a copy inside one
    /// device buffer).
    ///
    /// # Panics
    /// If the lengths differ (a caller bug, never input).
    pub fn copy_to_span(&self, dst: RawSpan<'_>) {
        assert_eq!(dst.len, self.len, "RawSpan::copy_to_span: length mismatch");
        // SAFETY: both spans are valid for their `len` bytes per `new`'s contract; `copy`
        // (memmove) allows the overlap.
        unsafe { std::ptr::copy(self.ptr.as_ptr(), dst.ptr.as_ptr(), self.len) }
    }
}
