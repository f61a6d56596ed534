//! The VFIO device operations the backend needs, and their implementation on the kernel's
//! vfio-pci (through [`vfio_ioctls::VfioDevice`]).

use std::os::fd::BorrowedFd;

use vmm_sys_util::eventfd::EventFd;

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
    /// Reads a region.
    fn region_read(&self, index: u32, offset: u64, buf: &mut [u8]);
    /// Writes a region.
    fn region_write(&self, index: u32, offset: u64, data: &[u8]);
    /// Vectors of IRQ index `index`.
    fn irq_count(&self, index: u32) -> u32;
    /// `VFIO_DEVICE_SET_IRQS` with eventfds.
    fn enable_irq(&self, index: u32, fds: &[&EventFd]) -> Result<(), String>;
    /// Disables IRQ index `index`.
    fn disable_irq(&self, index: u32) -> Result<(), String>;
    /// `VFIO_DEVICE_RESET`.
    fn reset(&self);
    /// The device fd. Never exported (see the module documentation); tests compare what is
    /// exported against it.
    fn device_fd(&self) -> BorrowedFd<'_>;
    /// How region `index` may be mmap'ed through the device fd, from its capabilities.
    fn mmap_caps(&self, index: u32) -> MmapCaps {
        let _ = index;
        MmapCaps::default()
    }
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

    fn region_read(&self, index: u32, offset: u64, buf: &mut [u8]) {
        vfio_ioctls::VfioDevice::region_read(self, index, buf, offset)
    }

    fn region_write(&self, index: u32, offset: u64, data: &[u8]) {
        vfio_ioctls::VfioDevice::region_write(self, index, data, offset)
    }

    fn irq_count(&self, index: u32) -> u32 {
        self.get_irq_info(index).map_or(0, |i| i.count)
    }

    fn enable_irq(&self, index: u32, fds: &[&EventFd]) -> Result<(), String> {
        vfio_ioctls::VfioDevice::enable_irq(self, index, fds.to_vec()).map_err(|e| e.to_string())
    }

    fn disable_irq(&self, index: u32) -> Result<(), String> {
        vfio_ioctls::VfioDevice::disable_irq(self, index).map_err(|e| e.to_string())
    }

    fn reset(&self) {
        vfio_ioctls::VfioDevice::reset(self)
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
