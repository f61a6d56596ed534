//! Memory that a DMA mapping points at: the borrower's exported RAM window.
//!
//! On the shm fabric the borrower passes a memfd for its guest RAM window; the lender maps it
//! with [`MmapBacking`]. Other fabrics (tcp) implement [`DmaBacking`] with read/write messages.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Mutex;

use emulated::RawSpan;
use thiserror::Error;

/// Errors of DMA backings.
#[derive(Debug, Error)]
pub enum BackingError {
    /// An access does not fit in the backing.
    #[error(
        "access of {len:#x} bytes at offset {offset:#x} is outside the {size:#x}-byte backing"
    )]
    OutOfRange {
        /// Offset of the access.
        offset: u64,
        /// Length of the access.
        len: u64,
        /// Size of the backing.
        size: u64,
    },
    /// The backing size is not usable.
    #[error("backing size {0:#x} is invalid (zero or larger than the address space)")]
    BadSize(u64),
    /// mmap of the window failed.
    #[error("mmap of {size:#x} bytes at file offset {offset:#x} failed: {source}")]
    Mmap {
        /// Size requested.
        size: u64,
        /// File offset requested.
        offset: u64,
        /// OS error.
        source: std::io::Error,
    },
    /// A fabric-backed transfer failed.
    #[error("fabric transfer failed: {0}")]
    Transfer(String),
}

/// Memory a DMA mapping translates into. Offsets are relative to the start of the backing.
pub trait DmaBacking: Send + Sync {
    /// Size of the backing in bytes.
    fn size(&self) -> u64;
    /// Copy `buf.len()` bytes at `offset` into `buf`.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackingError>;
    /// Copy `data` to `offset`.
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BackingError>;
    /// Copy `dst.len()` bytes at `offset` into device memory `dst`. The default stages them
    /// in `scratch` through [`DmaBacking::read_at`]; memory mapped in this process copies
    /// once.
    fn read_into_raw(
        &self,
        offset: u64,
        dst: RawSpan<'_>,
        scratch: &mut Vec<u8>,
    ) -> Result<(), BackingError> {
        read_into_staged(self, offset, dst, scratch)
    }
    /// Copy device memory `src` to `offset` (see [`DmaBacking::read_into_raw`]).
    fn write_from_raw(
        &self,
        offset: u64,
        src: RawSpan<'_>,
        scratch: &mut Vec<u8>,
    ) -> Result<(), BackingError> {
        write_from_staged(self, offset, src, scratch)
    }
    /// Host virtual address of the start of the backing when it is mapped in this process
    /// (needed to program a hardware IOMMU with VFIO); `None` for message-based backings.
    fn host_addr(&self) -> Option<NonNull<u8>> {
        None
    }
    /// Which memory this is (a file and a range of it), when it is a mapping of a file; two
    /// backings with equal ids are the same bytes ([`super::IommuDomain::rebind`] swaps one
    /// for the other). `None` (the default): memory with no shareable identity (heap,
    /// message-based windows), never the same as another backing.
    fn backing_id(&self) -> Option<ntb::BackingId> {
        None
    }
}

/// [`DmaBacking::read_into_raw`] through `scratch` and [`DmaBacking::read_at`] (a backing that
/// cannot copy into the span directly).
pub fn read_into_staged<B: DmaBacking + ?Sized>(
    b: &B,
    offset: u64,
    dst: RawSpan<'_>,
    scratch: &mut Vec<u8>,
) -> Result<(), BackingError> {
    let buf = emulated::dma::staging(scratch, dst.len());
    b.read_at(offset, buf)?;
    dst.copy_from(buf);
    Ok(())
}

/// [`DmaBacking::write_from_raw`] through `scratch` and [`DmaBacking::write_at`].
pub fn write_from_staged<B: DmaBacking + ?Sized>(
    b: &B,
    offset: u64,
    src: RawSpan<'_>,
    scratch: &mut Vec<u8>,
) -> Result<(), BackingError> {
    let buf = emulated::dma::staging(scratch, src.len());
    src.copy_to(buf);
    b.write_at(offset, buf)
}

/// Checks that `[offset, offset + len)` lies inside a backing of `size` bytes.
pub fn check_range(offset: u64, len: usize, size: u64) -> Result<(), BackingError> {
    let len64 = len as u64;
    match offset.checked_add(len64) {
        Some(end) if end <= size => Ok(()),
        _ => Err(BackingError::OutOfRange {
            offset,
            len: len64,
            size,
        }),
    }
}

/// A shared mapping of (part of) a file, normally the borrower's guest-RAM memfd.
/// The mapping is removed when the value is dropped.
#[derive(Debug)]
pub struct MmapBacking {
    addr: NonNull<u8>,
    size: u64,
    // Keeps the file open as long as the mapping lives (not needed by mmap, but lets the
    // owner re-export or inspect it).
    _fd: Option<OwnedFd>,
    /// The file and range mapped (file mappings).
    id: Option<ntb::BackingId>,
}

// SAFETY: the mapping is process-wide shared memory; all accesses go through raw-pointer
// copies (no references are created), so moving the handle between threads is sound.
unsafe impl Send for MmapBacking {}
// SAFETY: as above; concurrent raw copies into shared memory are the DMA model (the device
// and the guest both write it) and never create Rust references to the memory.
unsafe impl Sync for MmapBacking {}

impl MmapBacking {
    /// Maps `size` bytes of `fd` starting at file offset `offset` (page aligned) shared and
    /// read/write.
    pub fn new(fd: OwnedFd, offset: u64, size: u64) -> Result<Self, BackingError> {
        let len = usize::try_from(size).map_err(|_| BackingError::BadSize(size))?;
        if len == 0 {
            return Err(BackingError::BadSize(size));
        }
        let off = libc::off_t::try_from(offset).map_err(|_| BackingError::BadSize(offset))?;
        // SAFETY: a fresh shared mapping chosen by the kernel (addr NULL) of a file we own; the
        // result is checked against MAP_FAILED before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                off,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(BackingError::Mmap {
                size,
                offset,
                source: std::io::Error::last_os_error(),
            });
        }
        let addr = NonNull::new(ptr.cast::<u8>()).ok_or(BackingError::BadSize(size))?;
        // fstat of the descriptor just mapped does not fail in practice; if it did, the
        // backing merely has no identity (it is never taken for another mapping's memory).
        let id = ntb::BackingId::of_file(fd.as_fd(), offset, size).ok();
        Ok(MmapBacking {
            addr,
            size,
            _fd: Some(fd),
            id,
        })
    }

    /// Anonymous shared memory of `size` bytes (tests, local buffers).
    pub fn anonymous(size: u64) -> Result<Self, BackingError> {
        let len = usize::try_from(size).map_err(|_| BackingError::BadSize(size))?;
        if len == 0 {
            return Err(BackingError::BadSize(size));
        }
        // SAFETY: fresh anonymous mapping; checked against MAP_FAILED.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(BackingError::Mmap {
                size,
                offset: 0,
                source: std::io::Error::last_os_error(),
            });
        }
        let addr = NonNull::new(ptr.cast::<u8>()).ok_or(BackingError::BadSize(size))?;
        Ok(MmapBacking {
            addr,
            size,
            _fd: None,
            id: None,
        })
    }
}

impl DmaBacking for MmapBacking {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackingError> {
        check_range(offset, buf.len(), self.size)?;
        // SAFETY: the range was checked to lie inside the live mapping (offset fits usize
        // because size does); the copy uses raw pointers only.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.addr.as_ptr().add(offset as usize),
                buf.as_mut_ptr(),
                buf.len(),
            );
        }
        Ok(())
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BackingError> {
        check_range(offset, data.len(), self.size)?;
        // SAFETY: the range was checked to lie inside the live, writable mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.addr.as_ptr().add(offset as usize),
                data.len(),
            );
        }
        Ok(())
    }

    fn read_into_raw(
        &self,
        offset: u64,
        dst: RawSpan<'_>,
        _scratch: &mut Vec<u8>,
    ) -> Result<(), BackingError> {
        check_range(offset, dst.len(), self.size)?;
        // SAFETY: the range lies inside the live mapping; `dst` is valid for its length
        // (RawSpan's contract). `copy` (memmove): a device may copy between its own buffer
        // and a mapping of that same memory.
        unsafe {
            std::ptr::copy(
                self.addr.as_ptr().add(offset as usize),
                dst.as_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }

    fn write_from_raw(
        &self,
        offset: u64,
        src: RawSpan<'_>,
        _scratch: &mut Vec<u8>,
    ) -> Result<(), BackingError> {
        check_range(offset, src.len(), self.size)?;
        // SAFETY: as in read_into_raw; the mapping is writable.
        unsafe {
            std::ptr::copy(
                src.as_ptr(),
                self.addr.as_ptr().add(offset as usize),
                src.len(),
            )
        };
        Ok(())
    }

    fn host_addr(&self) -> Option<NonNull<u8>> {
        Some(self.addr)
    }

    fn backing_id(&self) -> Option<ntb::BackingId> {
        self.id
    }
}

impl Drop for MmapBacking {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping this value created; no references into it
        // exist (all accesses are raw copies that have completed).
        let rc = unsafe { libc::munmap(self.addr.as_ptr().cast(), self.size as usize) };
        if rc != 0 {
            log::warn!(
                "munmap of {:#x}-byte dma backing failed: {}",
                self.size,
                std::io::Error::last_os_error()
            );
        }
    }
}

/// Heap memory behind a lock; used by tests and by fabrics that copy through messages.
#[derive(Debug)]
pub struct VecBacking {
    mem: Mutex<Vec<u8>>,
}

impl VecBacking {
    /// `size` zero bytes.
    pub fn new(size: usize) -> Self {
        VecBacking {
            mem: Mutex::new(vec![0; size]),
        }
    }

    /// A copy of the whole contents.
    pub fn snapshot(&self) -> Vec<u8> {
        match self.mem.lock() {
            Ok(m) => m.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Fills the whole backing with `byte`.
    pub fn fill(&self, byte: u8) {
        let mut m = match self.mem.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        m.iter_mut().for_each(|b| *b = byte);
    }
}

impl DmaBacking for VecBacking {
    fn size(&self) -> u64 {
        self.snapshot_len()
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackingError> {
        let m = match self.mem.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        check_range(offset, buf.len(), m.len() as u64)?;
        let o = offset as usize;
        buf.copy_from_slice(&m[o..o + buf.len()]);
        Ok(())
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BackingError> {
        let mut m = match self.mem.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        check_range(offset, data.len(), m.len() as u64)?;
        let o = offset as usize;
        m[o..o + data.len()].copy_from_slice(data);
        Ok(())
    }
}

impl VecBacking {
    fn snapshot_len(&self) -> u64 {
        match self.mem.lock() {
            Ok(m) => m.len() as u64,
            Err(p) => p.into_inner().len() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mmap_backing_bounds() {
        let b = MmapBacking::anonymous(4096).unwrap();
        b.write_at(4090, &[1, 2, 3, 4, 5, 6]).unwrap();
        let mut out = [0u8; 6];
        b.read_at(4090, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3, 4, 5, 6]);
        assert!(b.write_at(4091, &[0; 6]).is_err());
        assert!(b.read_at(u64::MAX, &mut out).is_err());
        assert!(MmapBacking::anonymous(0).is_err());
    }

    #[test]
    fn vec_backing_bounds() {
        let b = VecBacking::new(16);
        b.write_at(8, &[9; 8]).unwrap();
        assert!(b.write_at(9, &[9; 8]).is_err());
        assert_eq!(&b.snapshot()[8..], &[9; 8]);
    }
}
