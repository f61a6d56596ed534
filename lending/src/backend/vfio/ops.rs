//! The VFIO device operations the backend needs, and their implementation on the kernel's
//! vfio-pci (through [`vfio_ioctls::VfioDevice`] for set-up and interrupts, and the device
//! fd itself for region accesses and reset, whose errors vfio-ioctls 0.10 only logs).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use thiserror::Error;
use vmm_sys_util::eventfd::EventFd;

/// A VFIO device operation that failed. vfio-pci refuses a BAR access with `EIO` while the
/// function's Memory Space bit is clear, and a reset with an error when the function has no
/// reset method: the caller must see it (a borrower's read must not come back as the bytes
/// its buffer held before).
#[derive(Debug, Error)]
pub enum VfioOpError {
    /// The device has no such region.
    #[error("vfio region {index} does not exist")]
    NoRegion {
        /// Region index.
        index: u32,
    },
    /// The access runs past the region's end.
    #[error(
        "{len} bytes at {offset:#x} run past the end of vfio region {index} ({size:#x} bytes)"
    )]
    OutOfRegion {
        /// Region index.
        index: u32,
        /// Offset in the region.
        offset: u64,
        /// Bytes.
        len: usize,
        /// The region's size.
        size: u64,
    },
    /// The kernel refused a region read or write.
    #[error("{op} of {len} bytes at {offset:#x} of vfio region {index}: {source}")]
    Region {
        /// "read" or "write".
        op: &'static str,
        /// Region index.
        index: u32,
        /// Offset in the region.
        offset: u64,
        /// Bytes.
        len: usize,
        /// The kernel's answer.
        #[source]
        source: io::Error,
    },
    /// `VFIO_DEVICE_SET_IRQS` failed.
    #[error("VFIO_DEVICE_SET_IRQS of irq index {index}: {source}")]
    Irqs {
        /// IRQ index (`VFIO_PCI_*_IRQ_INDEX`).
        index: u32,
        /// vfio-ioctls' error.
        #[source]
        source: vfio_ioctls::VfioError,
    },
    /// `VFIO_DEVICE_RESET` failed (or the device has no reset).
    #[error("VFIO_DEVICE_RESET: {0}")]
    Reset(#[source] io::Error),
}

/// Region information (`VFIO_DEVICE_GET_REGION_INFO`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfo {
    /// Size.
    pub size: u64,
    /// Offset in the device fd.
    pub offset: u64,
    /// `VFIO_REGION_INFO_FLAG_*`.
    pub flags: u32,
}

/// The VFIO device operations the backend needs.
pub trait VfioDeviceOps: Send + Sync {
    /// Region `index`, if the device has it.
    fn region(&self, index: u32) -> Option<RegionInfo>;
    /// Reads `buf.len()` bytes of a region, all or an error.
    fn region_read(&self, index: u32, offset: u64, buf: &mut [u8]) -> Result<(), VfioOpError>;
    /// Writes `data` to a region, all or an error.
    fn region_write(&self, index: u32, offset: u64, data: &[u8]) -> Result<(), VfioOpError>;
    /// Vectors of IRQ index `index`.
    fn irq_count(&self, index: u32) -> u32;
    /// `VFIO_DEVICE_SET_IRQS` with eventfds.
    fn enable_irq(&self, index: u32, fds: &[&EventFd]) -> Result<(), VfioOpError>;
    /// Disables IRQ index `index`.
    fn disable_irq(&self, index: u32) -> Result<(), VfioOpError>;
    /// `VFIO_DEVICE_RESET`.
    fn reset(&self) -> Result<(), VfioOpError>;
    /// The device fd. Never exported (see the module documentation); tests compare what is
    /// exported against it.
    fn device_fd(&self) -> BorrowedFd<'_>;
    /// How region `index` may be mmap'ed through the device fd, from its capabilities.
    fn mmap_caps(&self, index: u32) -> MmapCaps {
        let _ = index;
        MmapCaps::default()
    }
}

// `VFIO_DEVICE_RESET` = `_IO(VFIO_TYPE, VFIO_BASE + 11)` (<linux/vfio.h>).
vmm_sys_util::ioctl_io_nr!(VFIO_DEVICE_RESET, 0x3b /* ';' */, 100 + 11);

/// Where `len` bytes at `offset` of region `index` are in the device fd, or why not.
fn region_offset(
    dev: &vfio_ioctls::VfioDevice,
    index: u32,
    offset: u64,
    len: usize,
) -> Result<u64, VfioOpError> {
    let r = dev.region(index).ok_or(VfioOpError::NoRegion { index })?;
    if offset
        .checked_add(len as u64)
        .is_none_or(|end| end > r.size)
    {
        return Err(VfioOpError::OutOfRegion {
            index,
            offset,
            len,
            size: r.size,
        });
    }
    Ok(r.offset + offset)
}

fn region_err(
    op: &'static str,
    index: u32,
    offset: u64,
    len: usize,
    source: io::Error,
) -> VfioOpError {
    VfioOpError::Region {
        op,
        index,
        offset,
        len,
        source,
    }
}

/// Runs `step(done)` (one `pread`/`pwrite` of what is left, from `done`; its return value)
/// until `len` bytes are done: `EINTR` is retried, and a call that moves no byte is an error.
fn all_bytes(len: usize, mut step: impl FnMut(usize) -> isize) -> io::Result<()> {
    let mut done = 0;
    while done < len {
        match step(done) {
            n if n > 0 => done += n as usize,
            0 => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the device moved no bytes",
                ))
            }
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// The mmap capabilities of a region (`VFIO_REGION_INFO_CAP_SPARSE_MMAP`,
/// `VFIO_REGION_INFO_CAP_MSIX_MAPPABLE`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MmapCaps {
    /// The areas that may be mmap'ed, `(offset, size)`, when the region has a sparse-mmap
    /// capability (vfio-pci carves the MSI-X table out of its BAR so); `None`: no such
    /// capability (the whole region, if its MMAP flag is set).
    pub sparse: Option<Vec<(u64, u64)>>,
    /// The MSI-X table's BAR may be mmap'ed whole: the platform isolates MSI (interrupt
    /// remapping), so vfio-pci does not carve the table out.
    pub msix_mappable: bool,
}

impl VfioDeviceOps for vfio_ioctls::VfioDevice {
    fn region(&self, index: u32) -> Option<RegionInfo> {
        let size = self.get_region_size(index);
        (size > 0).then(|| RegionInfo {
            size,
            offset: self.get_region_offset(index),
            flags: self.get_region_flags(index),
        })
    }

    fn region_read(&self, index: u32, offset: u64, buf: &mut [u8]) -> Result<(), VfioOpError> {
        let at = region_offset(self, index, offset, buf.len())?;
        let len = buf.len();
        all_bytes(len, |done| {
            let rest = &mut buf[done..];
            // SAFETY: `rest` is a live, writable buffer of `rest.len()` bytes, and the fd
            // is the device's, open for the call.
            unsafe {
                libc::pread(
                    self.as_raw_fd(),
                    rest.as_mut_ptr().cast(),
                    rest.len(),
                    (at + done as u64) as libc::off_t,
                )
            }
        })
        .map_err(|e| region_err("read", index, offset, len, e))
    }

    fn region_write(&self, index: u32, offset: u64, data: &[u8]) -> Result<(), VfioOpError> {
        let at = region_offset(self, index, offset, data.len())?;
        all_bytes(data.len(), |done| {
            let rest = &data[done..];
            // SAFETY: `rest` is a live buffer of `rest.len()` bytes, and the fd is the
            // device's, open for the call.
            unsafe {
                libc::pwrite(
                    self.as_raw_fd(),
                    rest.as_ptr().cast(),
                    rest.len(),
                    (at + done as u64) as libc::off_t,
                )
            }
        })
        .map_err(|e| region_err("write", index, offset, data.len(), e))
    }

    fn irq_count(&self, index: u32) -> u32 {
        self.get_irq_info(index).map_or(0, |i| i.count)
    }

    fn enable_irq(&self, index: u32, fds: &[&EventFd]) -> Result<(), VfioOpError> {
        vfio_ioctls::VfioDevice::enable_irq(self, index, fds.to_vec())
            .map_err(|source| VfioOpError::Irqs { index, source })
    }

    fn disable_irq(&self, index: u32) -> Result<(), VfioOpError> {
        vfio_ioctls::VfioDevice::disable_irq(self, index)
            .map_err(|source| VfioOpError::Irqs { index, source })
    }

    fn reset(&self) -> Result<(), VfioOpError> {
        // SAFETY: VFIO_DEVICE_RESET takes no argument; the fd is the device's, open for the
        // call.
        let rc = unsafe { vmm_sys_util::ioctl::ioctl(&self.device_fd(), VFIO_DEVICE_RESET()) };
        if rc < 0 {
            return Err(VfioOpError::Reset(io::Error::last_os_error()));
        }
        Ok(())
    }

    fn device_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the raw fd belongs to `self`, which outlives the returned borrow.
        unsafe { BorrowedFd::borrow_raw(std::os::fd::AsRawFd::as_raw_fd(self)) }
    }

    fn mmap_caps(&self, index: u32) -> MmapCaps {
        let mut out = MmapCaps::default();
        for cap in self.get_region_caps(index) {
            match cap {
                vfio_ioctls::VfioRegionInfoCap::SparseMmap(s) => {
                    out.sparse = Some(s.areas.iter().map(|a| (a.offset, a.size)).collect());
                }
                vfio_ioctls::VfioRegionInfoCap::MsixMappable => out.msix_mappable = true,
                _ => {}
            }
        }
        out
    }
}
