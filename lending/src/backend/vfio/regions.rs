//! Regions and BARs: which BAR is exported through its sysfs resource file and which is
//! trapped, config space and BAR accesses through VFIO regions, and the device's
//! description for the borrower.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use vfio_bindings::bindings::vfio::{
    VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX,
    VFIO_PCI_MSI_IRQ_INDEX, VFIO_REGION_INFO_FLAG_MMAP,
};

use super::{plain_name, RegionInfo, VfioBackend, VfioDeviceOps, VfioOpError};
use crate::backend::BackendError;
use crate::protocol::{BarDesc, DeviceInfo, IrqCounts, MsixDesc, NotifyWrites};

/// How one BAR reaches the borrower.
#[derive(Debug)]
pub enum BarAccess {
    /// Exported as a fabric window: the BAR's sysfs resource file, opened and checked.
    Direct {
        /// The resource file (its fd is what a shm borrower receives).
        file: File,
        /// Its path, for logs.
        path: PathBuf,
        /// BAR size (= the file's size).
        size: u64,
    },
    /// BAR_READ/BAR_WRITE through the lender; why it is not exported.
    Trapped(String),
}

impl<D: VfioDeviceOps> VfioBackend<D> {
    /// How bar `i` is lent, if the device implements it.
    pub fn bar_access(&self, bar: u8) -> Option<&BarAccess> {
        self.bars.iter().find(|(i, _)| *i == bar).map(|(_, a)| a)
    }

    pub(super) fn decide_bars(&self, sysfs: &Path) -> Vec<(u8, BarAccess)> {
        let mut cfg = [0u8; 256];
        self.config_logged(0, &mut cfg);
        let msix = crate::backend::capabilities(&cfg)
            .into_iter()
            .find(|c| c.id == 0x11 && !c.extended)
            .map(|c| {
                let o = u64::from(c.offset);
                (
                    (self.config_u32_logged(o + 4) & 7) as u8,
                    (self.config_u32_logged(o + 8) & 7) as u8,
                )
            });
        (0..6u8)
            .filter_map(|i| {
                let r = self.dev.region(u32::from(i))?;
                let at = 0x10 + 4 * usize::from(i);
                let reg = u32::from_le_bytes([cfg[at], cfg[at + 1], cfg[at + 2], cfg[at + 3]]);
                Some((i, self.decide_bar(sysfs, i, &r, reg, msix)))
            })
            .collect()
    }

    pub(super) fn decide_bar(
        &self,
        sysfs: &Path,
        i: u8,
        r: &RegionInfo,
        reg: u32,
        msix: Option<(u8, u8)>,
    ) -> BarAccess {
        let trapped = |why: String| BarAccess::Trapped(why);
        if reg & 1 != 0 {
            return trapped("it is an i/o bar (port space cannot be mapped)".into());
        }
        if r.flags & VFIO_REGION_INFO_FLAG_MMAP == 0 {
            return trapped("vfio does not allow mapping it".into());
        }
        if r.size < 4096 || !r.size.is_multiple_of(4096) {
            return trapped(format!(
                "its {:#x} bytes are not whole pages (fabric windows are)",
                r.size
            ));
        }
        if let Some((table, pba)) = msix {
            if i == table || i == pba {
                return trapped(
                    "it holds the msi-x table or pba, which the borrower emulates: mapping it \
                     would let the borrower program the device's real msi-x entries"
                        .into(),
                );
            }
        }
        if !plain_name(&self.name) {
            return trapped(format!(
                "{:?} is not a pci address that names a sysfs directory",
                self.name
            ));
        }
        let path = sysfs.join(&self.name).join(format!("resource{i}"));
        // Not through a symlink in the last component: the file must be the kernel's own.
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) => return trapped(format!("cannot open {}: {e}", path.display())),
        };
        let meta = match file.metadata() {
            Ok(m) => m,
            Err(e) => return trapped(format!("cannot stat {}: {e}", path.display())),
        };
        if !meta.file_type().is_file() {
            return trapped(format!("{} is not a regular file", path.display()));
        }
        let have = meta.size();
        if have != r.size {
            let how = if have < r.size {
                "smaller than"
            } else {
                "larger than (it would grant more than)"
            };
            return trapped(format!(
                "{} is {have:#x} bytes, {how} the {:#x}-byte bar",
                path.display(),
                r.size
            ));
        }
        // A trial mapping of the first page (no access): a kernel with
        // CONFIG_IO_STRICT_DEVMEM refuses to map a BAR that a driver (vfio-pci) claimed.
        if let Err(e) = ntb::mem::Mapping::map_shared(file.as_fd(), 0, 4096) {
            return trapped(format!("{} cannot be mapped: {e}", path.display()));
        }
        BarAccess::Direct {
            file,
            path,
            size: r.size,
        }
    }

    pub(super) fn config_len(&self) -> u64 {
        self.dev
            .region(VFIO_PCI_CONFIG_REGION_INDEX)
            .map_or(256, |r| r.size.min(4096))
    }

    pub(super) fn bar_region(&self, bar: u8) -> Result<RegionInfo, BackendError> {
        if bar > 5 {
            return Err(BackendError::NoSuchBar(bar));
        }
        self.dev
            .region(u32::from(bar))
            .ok_or(BackendError::NoSuchBar(bar))
    }

    pub(super) fn check(
        r: &RegionInfo,
        bar: u8,
        offset: u64,
        len: usize,
    ) -> Result<(), BackendError> {
        if offset.checked_add(len as u64).is_none_or(|e| e > r.size) {
            return Err(BackendError::OutOfRange {
                what: format!("bar {bar}"),
                offset,
                len,
                size: r.size,
            });
        }
        Ok(())
    }

    pub(super) fn config_u16(&self, off: u64) -> Result<u16, VfioOpError> {
        let mut b = [0u8; 2];
        self.dev
            .region_read(VFIO_PCI_CONFIG_REGION_INDEX, off, &mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    /// Reads config space where a failure cannot go up (assembling the backend, describing
    /// the device): logged, and `buf` left zeroed. The borrower's own accesses and the
    /// lender's writes return their errors.
    pub(super) fn config_logged(&self, off: u64, buf: &mut [u8]) {
        if let Err(e) = self.dev.region_read(VFIO_PCI_CONFIG_REGION_INDEX, off, buf) {
            buf.fill(0);
            log::warn!("{}: config space: {e}", self.name);
        }
    }

    fn config_u32_logged(&self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.config_logged(off, &mut b);
        u32::from_le_bytes(b)
    }

    /// The device as the borrower is told about it ([`crate::backend::DeviceBackend::describe`]).
    pub(super) fn describe_device(&self, id: &str) -> DeviceInfo {
        let mut config = vec![0u8; self.config_len() as usize];
        self.config_logged(0, &mut config);
        let mut bars = Vec::new();
        let mut i = 0u8;
        while i < 6 {
            let reg = u32::from_le_bytes([
                config[0x10 + 4 * usize::from(i)],
                config[0x11 + 4 * usize::from(i)],
                config[0x12 + 4 * usize::from(i)],
                config[0x13 + 4 * usize::from(i)],
            ]);
            let io = reg & 1 != 0;
            let is_64bit = !io && (reg >> 1) & 3 == 2;
            if let Some(r) = self.dev.region(u32::from(i)) {
                bars.push(BarDesc {
                    index: i,
                    size: r.size,
                    is_64bit,
                    prefetchable: !io && reg & 8 != 0,
                    io,
                    window: None,
                    emulated_by_borrower: false,
                    // Real device memory: the device sees every store itself.
                    notify: NotifyWrites::None,
                });
            }
            i += if is_64bit { 2 } else { 1 };
        }
        let caps = crate::backend::capabilities(&config);
        let msix = caps.iter().find(|c| c.id == 0x11 && !c.extended).map(|c| {
            let o = u64::from(c.offset);
            let ctrl = self.config_u32_logged(o) >> 16;
            let table = self.config_u32_logged(o + 4);
            let pba = self.config_u32_logged(o + 8);
            MsixDesc {
                vectors: ((ctrl & 0x7ff) + 1) as u16,
                table_bar: (table & 7) as u8,
                table_offset: table & !7,
                pba_bar: (pba & 7) as u8,
                pba_offset: pba & !7,
            }
        });
        // The borrower's VMM emulates the MSI-X table/PBA BARs itself.
        if let Some(m) = msix {
            for b in bars.iter_mut() {
                if b.index == m.table_bar || b.index == m.pba_bar {
                    b.emulated_by_borrower = true;
                }
            }
        }
        let irqs = IrqCounts {
            intx: self.dev.irq_count(VFIO_PCI_INTX_IRQ_INDEX),
            msi: self.dev.irq_count(VFIO_PCI_MSI_IRQ_INDEX),
            msix: self.dev.irq_count(VFIO_PCI_MSIX_IRQ_INDEX),
        };
        crate::backend::device_info(id, "vfio", config, bars, irqs, msix)
    }
}
