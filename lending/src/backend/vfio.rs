//! A real PCI function bound to vfio-pci.
//!
//! **Untested on hardware**: the development host has no `/dev/vfio`. The backend talks to
//! [`VfioDeviceOps`] (implemented for [`vfio_ioctls::VfioDevice`]) and is unit-tested with
//! [`fake::FakeVfioDevice`].
//!
//! * config space: VFIO config region (index 7), borrower writes filtered by the lender;
//! * BARs: mmap-able regions are exported as fabric windows straight from the device fd at the
//!   region offset; others use region read/write;
//! * interrupts: `VFIO_DEVICE_SET_IRQS` with the borrower's eventfds (shm) or with local
//!   eventfds relayed to doorbells/messages ([`super::irq::IrqRelay`]);
//! * reset: `VFIO_DEVICE_RESET` (FLR or whatever the kernel picks);
//! * DMA: one VFIO container per device ([`crate::iommu::vfio::VfioDomain`]).

use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::{Arc, Mutex};

use vfio_bindings::bindings::vfio::{
    VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX,
    VFIO_PCI_MSI_IRQ_INDEX, VFIO_REGION_INFO_FLAG_MMAP, VFIO_REGION_INFO_FLAG_WRITE,
};
use vmm_sys_util::eventfd::EventFd;

use super::config::CMD_BUS_MASTER;
use super::irq::IrqRelay;
use super::{BackendError, BarExport, DeviceBackend, IrqTrigger};
use crate::iommu::vfio::VfioDomain;
use crate::iommu::IommuDomain;
use crate::protocol::{BarDesc, DeviceInfo, IrqCounts, IrqKind, MsixDesc, NotifyWrites};

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
    /// The device fd (BAR mmaps).
    fn device_fd(&self) -> BorrowedFd<'_>;
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
}

fn irq_index(kind: IrqKind) -> u32 {
    match kind {
        IrqKind::Intx => VFIO_PCI_INTX_IRQ_INDEX,
        IrqKind::Msi => VFIO_PCI_MSI_IRQ_INDEX,
        IrqKind::Msix => VFIO_PCI_MSIX_IRQ_INDEX,
    }
}

/// What is wired for one IRQ kind: the eventfds VFIO signals and the relay, if any.
struct Wiring {
    _targets: Vec<Option<Arc<dyn IrqTrigger>>>,
    _local: Vec<EventFd>,
    _relay: Option<IrqRelay>,
}

/// A vfio-pci function as a [`DeviceBackend`].
pub struct VfioBackend<D: VfioDeviceOps> {
    name: String,
    dev: D,
    domain: Arc<dyn IommuDomain>,
    wiring: Mutex<Vec<(IrqKind, Wiring)>>,
}

impl VfioBackend<vfio_ioctls::VfioDevice> {
    /// Opens `/sys/bus/pci/devices/<bdf>` (bound to vfio-pci) in a container of its own.
    pub fn open(bdf: &str) -> Result<Self, BackendError> {
        let container = Arc::new(
            vfio_ioctls::VfioContainer::new(None).map_err(|e| BackendError::Vfio(e.to_string()))?,
        );
        let path = Path::new("/sys/bus/pci/devices").join(bdf);
        let dev = vfio_ioctls::VfioDevice::new(
            &path,
            Arc::clone(&container) as Arc<dyn vfio_ioctls::VfioOps>,
            false,
        )
        .map_err(|e| BackendError::Vfio(format!("{}: {e}", path.display())))?;
        let domain = Arc::new(VfioDomain::new(format!("vfio {bdf}"), container));
        Ok(VfioBackend::with_parts(bdf, dev, domain))
    }
}

impl<D: VfioDeviceOps> VfioBackend<D> {
    /// Assembles a backend (tests use a fake device and domain).
    pub fn with_parts(name: &str, dev: D, domain: Arc<dyn IommuDomain>) -> Self {
        VfioBackend {
            name: name.to_string(),
            dev,
            domain,
            wiring: Mutex::new(Vec::new()),
        }
    }

    fn config_size(&self) -> u64 {
        self.dev
            .region(VFIO_PCI_CONFIG_REGION_INDEX)
            .map_or(256, |r| r.size.min(4096))
    }

    fn bar_region(&self, bar: u8) -> Result<RegionInfo, BackendError> {
        if bar > 5 {
            return Err(BackendError::NoSuchBar(bar));
        }
        self.dev
            .region(u32::from(bar))
            .ok_or(BackendError::NoSuchBar(bar))
    }

    fn check(r: &RegionInfo, bar: u8, offset: u64, len: usize) -> Result<(), BackendError> {
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

    fn wiring(&self) -> std::sync::MutexGuard<'_, Vec<(IrqKind, Wiring)>> {
        match self.wiring.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn config_u32(&self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.dev
            .region_read(VFIO_PCI_CONFIG_REGION_INDEX, off, &mut b);
        u32::from_le_bytes(b)
    }
}

impl<D: VfioDeviceOps> DeviceBackend for VfioBackend<D> {
    fn kind(&self) -> &str {
        "vfio"
    }

    fn describe(&self, id: &str) -> DeviceInfo {
        let mut config = vec![0u8; self.config_size() as usize];
        self.dev
            .region_read(VFIO_PCI_CONFIG_REGION_INDEX, 0, &mut config);
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
        let caps = super::capabilities(&config);
        let msix = caps.iter().find(|c| c.id == 0x11 && !c.extended).map(|c| {
            let o = u64::from(c.offset);
            let ctrl = self.config_u32(o) >> 16;
            let table = self.config_u32(o + 4);
            let pba = self.config_u32(o + 8);
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
        super::device_info(id, "vfio", config, bars, irqs, msix)
    }

    fn config_read(&self, offset: u16, buf: &mut [u8]) -> Result<(), BackendError> {
        let size = self.config_size();
        if u64::from(offset) + buf.len() as u64 > size {
            return Err(BackendError::OutOfRange {
                what: "config space".into(),
                offset: u64::from(offset),
                len: buf.len(),
                size,
            });
        }
        self.dev
            .region_read(VFIO_PCI_CONFIG_REGION_INDEX, u64::from(offset), buf);
        Ok(())
    }

    fn config_write(&self, offset: u16, data: &[u8]) -> Result<(), BackendError> {
        let size = self.config_size();
        if u64::from(offset) + data.len() as u64 > size {
            return Err(BackendError::OutOfRange {
                what: "config space".into(),
                offset: u64::from(offset),
                len: data.len(),
                size,
            });
        }
        self.dev
            .region_write(VFIO_PCI_CONFIG_REGION_INDEX, u64::from(offset), data);
        Ok(())
    }

    fn bar_export(&self, bar: u8) -> Option<BarExport<'_>> {
        let r = self.bar_region(bar).ok()?;
        (r.flags & VFIO_REGION_INFO_FLAG_MMAP != 0 && r.size >= 4096).then(|| BarExport {
            fd: self.dev.device_fd(),
            offset: r.offset,
            size: r.size,
        })
    }

    fn bar_read(&self, bar: u8, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        let r = self.bar_region(bar)?;
        Self::check(&r, bar, offset, buf.len())?;
        self.dev.region_read(u32::from(bar), offset, buf);
        Ok(())
    }

    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        let r = self.bar_region(bar)?;
        Self::check(&r, bar, offset, data.len())?;
        if r.flags & VFIO_REGION_INFO_FLAG_WRITE == 0 {
            return Err(BackendError::Vfio(format!("bar {bar} is read-only")));
        }
        self.dev.region_write(u32::from(bar), offset, data);
        Ok(())
    }

    fn notify_eventfd(&self) -> Option<EventFd> {
        None
    }

    fn set_irqs(
        &self,
        kind: IrqKind,
        targets: Vec<Option<Arc<dyn IrqTrigger>>>,
    ) -> Result<(), BackendError> {
        let index = irq_index(kind);
        let max = self.dev.irq_count(index);
        if targets.len() > max as usize {
            return Err(BackendError::TooManyVectors {
                kind,
                count: targets.len(),
                max,
            });
        }
        let mut wiring = self.wiring();
        wiring.retain(|(k, _)| *k != kind);
        if targets.is_empty() {
            self.dev.disable_irq(index).map_err(BackendError::Vfio)?;
            return Ok(());
        }
        // Borrower eventfds go to VFIO directly; anything else gets a local eventfd that a
        // relay thread forwards.
        let mut local = Vec::new();
        let mut relay_src = Vec::new();
        let mut relay_dst = Vec::new();
        let mut slots: Vec<Option<usize>> = Vec::new(); // index into `local`
        for t in &targets {
            match t {
                Some(t) if t.eventfd().is_none() => {
                    let e =
                        EventFd::new(libc::EFD_NONBLOCK).map_err(|source| BackendError::Os {
                            what: "irq relay eventfd",
                            source,
                        })?;
                    let dup = e.try_clone().map_err(|source| BackendError::Os {
                        what: "irq relay eventfd",
                        source,
                    })?;
                    relay_src.push(dup);
                    relay_dst.push(Arc::clone(t));
                    slots.push(Some(local.len()));
                    local.push(e);
                }
                _ => slots.push(None),
            }
        }
        // Unwired vectors still need an fd for VFIO: give them a local sink.
        let sink = EventFd::new(libc::EFD_NONBLOCK).map_err(|source| BackendError::Os {
            what: "irq sink eventfd",
            source,
        })?;
        let fds: Vec<&EventFd> = targets
            .iter()
            .zip(&slots)
            .map(|(t, s)| match (t, s) {
                (_, Some(i)) => &local[*i],
                (Some(t), None) => t.eventfd().unwrap_or(&sink),
                (None, None) => &sink,
            })
            .collect();
        self.dev
            .enable_irq(index, &fds)
            .map_err(BackendError::Vfio)?;
        drop(fds);
        let relay = if relay_src.is_empty() {
            None
        } else {
            Some(
                IrqRelay::start(&self.name, relay_src, relay_dst).map_err(|source| {
                    BackendError::Os {
                        what: "irq relay thread",
                        source,
                    }
                })?,
            )
        };
        local.push(sink);
        wiring.push((
            kind,
            Wiring {
                _targets: targets,
                _local: local,
                _relay: relay,
            },
        ));
        Ok(())
    }

    fn clear_irqs(&self) {
        let mut w = self.wiring();
        for (k, _) in w.iter() {
            if let Err(e) = self.dev.disable_irq(irq_index(*k)) {
                log::warn!("{}: disabling {k:?}: {e}", self.name);
            }
        }
        w.clear();
    }

    fn set_bus_master(&self, enable: bool) -> Result<(), BackendError> {
        let mut b = [0u8; 2];
        self.dev
            .region_read(VFIO_PCI_CONFIG_REGION_INDEX, 4, &mut b);
        let mut cmd = u16::from_le_bytes(b);
        if enable {
            cmd |= CMD_BUS_MASTER;
        } else {
            cmd &= !CMD_BUS_MASTER;
        }
        self.dev
            .region_write(VFIO_PCI_CONFIG_REGION_INDEX, 4, &cmd.to_le_bytes());
        Ok(())
    }

    fn reset(&self) -> Result<(), BackendError> {
        self.dev.reset();
        log::info!("{}: VFIO_DEVICE_RESET", self.name);
        Ok(())
    }

    fn domain(&self) -> Arc<dyn IommuDomain> {
        Arc::clone(&self.domain)
    }
}

/// A scripted VFIO device for tests.
pub mod fake {
    use std::collections::HashMap;
    use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
    use std::sync::Mutex;

    use vmm_sys_util::eventfd::EventFd;

    use super::{RegionInfo, VfioDeviceOps};

    /// Region contents in memory; records IRQ and reset calls.
    pub struct FakeVfioDevice {
        /// index -> (info, bytes)
        pub regions: Mutex<HashMap<u32, (RegionInfo, Vec<u8>)>>,
        /// index -> vector count
        pub irq_counts: HashMap<u32, u32>,
        /// index -> eventfds currently enabled (duplicates)
        pub enabled: Mutex<HashMap<u32, Vec<EventFd>>>,
        /// Resets so far.
        pub resets: Mutex<u32>,
        fd: OwnedFd,
    }

    impl FakeVfioDevice {
        /// A device with the given regions and IRQ counts.
        pub fn new(
            regions: Vec<(u32, RegionInfo, Vec<u8>)>,
            irq_counts: &[(u32, u32)],
        ) -> std::io::Result<Self> {
            // Only a handle is needed; /dev/null stands in for the device fd.
            let fd = OwnedFd::from(std::fs::File::open("/dev/null")?);
            Ok(FakeVfioDevice {
                regions: Mutex::new(regions.into_iter().map(|(i, r, b)| (i, (r, b))).collect()),
                irq_counts: irq_counts.iter().copied().collect(),
                enabled: Mutex::new(HashMap::new()),
                resets: Mutex::new(0),
                fd,
            })
        }
    }

    impl VfioDeviceOps for FakeVfioDevice {
        fn region(&self, index: u32) -> Option<RegionInfo> {
            self.regions.lock().ok()?.get(&index).map(|(r, _)| *r)
        }

        fn region_read(&self, index: u32, offset: u64, buf: &mut [u8]) {
            if let Ok(r) = self.regions.lock() {
                if let Some((_, b)) = r.get(&index) {
                    let o = offset as usize;
                    if let Some(src) = b.get(o..o + buf.len()) {
                        buf.copy_from_slice(src);
                    }
                }
            }
        }

        fn region_write(&self, index: u32, offset: u64, data: &[u8]) {
            if let Ok(mut r) = self.regions.lock() {
                if let Some((_, b)) = r.get_mut(&index) {
                    let o = offset as usize;
                    if let Some(dst) = b.get_mut(o..o + data.len()) {
                        dst.copy_from_slice(data);
                    }
                }
            }
        }

        fn irq_count(&self, index: u32) -> u32 {
            self.irq_counts.get(&index).copied().unwrap_or(0)
        }

        fn enable_irq(&self, index: u32, fds: &[&EventFd]) -> Result<(), String> {
            let dups = fds
                .iter()
                .map(|f| f.try_clone().map_err(|e| e.to_string()))
                .collect::<Result<Vec<_>, _>>()?;
            self.enabled
                .lock()
                .map_err(|e| e.to_string())?
                .insert(index, dups);
            Ok(())
        }

        fn disable_irq(&self, index: u32) -> Result<(), String> {
            self.enabled
                .lock()
                .map_err(|e| e.to_string())?
                .remove(&index);
            Ok(())
        }

        fn reset(&self) {
            if let Ok(mut r) = self.resets.lock() {
                *r += 1;
            }
        }

        fn device_fd(&self) -> BorrowedFd<'_> {
            self.fd.as_fd()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fake::FakeVfioDevice;
    use super::*;
    use crate::backend::filtered_config_write;
    use crate::iommu::vfio::fake::FakeVfioContainer;
    use crate::iommu::MmapBacking;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::{Duration, Instant};
    use vfio_bindings::bindings::vfio::VFIO_REGION_INFO_FLAG_READ;

    fn nic_like() -> FakeVfioDevice {
        let mut cfg = vec![0u8; 256];
        cfg[0..4].copy_from_slice(&[0x86, 0x80, 0x3e, 0x15]);
        cfg[6] = 0x10;
        cfg[0x10..0x14].copy_from_slice(&0x0000_000cu32.to_le_bytes()); // 64-bit prefetch
        cfg[0x18..0x1c].copy_from_slice(&0u32.to_le_bytes()); // BAR2 32-bit
        cfg[0x34] = 0x40;
        cfg[0x40] = 0x11; // MSI-X
        cfg[0x41] = 0;
        cfg[0x42..0x44].copy_from_slice(&7u16.to_le_bytes()); // 8 vectors
        cfg[0x44..0x48].copy_from_slice(&2u32.to_le_bytes()); // table in BAR2 @0
        cfg[0x48..0x4c].copy_from_slice(&(0x800u32 | 2).to_le_bytes());
        let rw = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;
        FakeVfioDevice::new(
            vec![
                (
                    VFIO_PCI_CONFIG_REGION_INDEX,
                    RegionInfo {
                        size: 256,
                        offset: 7 << 40,
                        flags: rw,
                    },
                    cfg,
                ),
                (
                    0,
                    RegionInfo {
                        size: 0x4000,
                        offset: 0,
                        flags: rw | VFIO_REGION_INFO_FLAG_MMAP,
                    },
                    vec![0; 0x4000],
                ),
                (
                    2,
                    RegionInfo {
                        size: 0x1000,
                        offset: 2 << 40,
                        flags: rw,
                    },
                    vec![0; 0x1000],
                ),
            ],
            &[(VFIO_PCI_INTX_IRQ_INDEX, 1), (VFIO_PCI_MSIX_IRQ_INDEX, 8)],
        )
        .unwrap()
    }

    fn backend() -> (VfioBackend<FakeVfioDevice>, Arc<FakeVfioContainer>) {
        let c = Arc::new(FakeVfioContainer::default());
        let dom = Arc::new(VfioDomain::new("fake", Arc::clone(&c)));
        (VfioBackend::with_parts("0000:81:00.0", nic_like(), dom), c)
    }

    #[test]
    fn describe_reads_bars_caps_and_irqs() {
        let (b, _) = backend();
        let info = b.describe("0000:81:00.0");
        assert_eq!(info.bars.len(), 2);
        assert_eq!(info.bars[0].index, 0);
        assert!(info.bars[0].is_64bit && info.bars[0].prefetchable);
        assert!(info.bars[1].emulated_by_borrower);
        assert_eq!(info.irqs.msix, 8);
        let m = info.msix.unwrap();
        assert_eq!((m.vectors, m.table_bar, m.pba_offset), (8, 2, 0x800));
        assert!(b.bar_export(0).is_some());
        assert!(b.bar_export(2).is_none(), "not mmap-able");
    }

    #[test]
    fn config_filter_bar_io_reset_and_dma() {
        let (b, c) = backend();
        assert!(filtered_config_write(&b, 0x10, &[0; 4]).is_err());
        assert!(filtered_config_write(&b, 0x42, &[0; 2]).is_err());
        filtered_config_write(&b, 4, &[0x06, 0]).unwrap();
        let mut cmd = [0u8; 2];
        b.config_read(4, &mut cmd).unwrap();
        assert_eq!(cmd, [0x02, 0]);
        b.bar_write(0, 0x10, &[1, 2, 3, 4]).unwrap();
        let mut v = [0u8; 4];
        b.bar_read(0, 0x10, &mut v).unwrap();
        assert_eq!(v, [1, 2, 3, 4]);
        assert!(b.bar_read(0, 0x3ffe, &mut v).is_err());
        assert!(b.bar_read(1, 0, &mut v).is_err());
        b.reset().unwrap();
        assert_eq!(*b.dev.resets.lock().unwrap(), 1);
        let win = Arc::new(MmapBacking::anonymous(0x2000).unwrap());
        b.domain().map(0x10_0000, 0x2000, win).unwrap();
        assert_eq!(c.live(), vec![(0x10_0000, 0x2000)]);
        b.domain().unmap_all();
        assert!(c.live().is_empty());
    }

    #[derive(Default)]
    struct Count(AtomicU32);
    impl IrqTrigger for Count {
        fn trigger(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn irqs_go_direct_or_through_relay() {
        let (b, _) = backend();
        let direct = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let counted = Arc::new(Count::default());
        b.set_irqs(
            IrqKind::Msix,
            vec![
                Some(direct.clone() as Arc<dyn IrqTrigger>),
                None,
                Some(counted.clone() as Arc<dyn IrqTrigger>),
            ],
        )
        .unwrap();
        let enabled = b.dev.enabled.lock().unwrap();
        let fds = &enabled[&VFIO_PCI_MSIX_IRQ_INDEX];
        assert_eq!(fds.len(), 3);
        // "Kernel" signals vector 0: lands on the borrower's eventfd itself.
        fds[0].write(1).unwrap();
        assert_eq!(direct.read().unwrap(), 1);
        // Vector 2 goes through the relay.
        fds[2].write(1).unwrap();
        drop(enabled);
        let t0 = Instant::now();
        while counted.0.load(Ordering::SeqCst) == 0 && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(counted.0.load(Ordering::SeqCst), 1);
        assert!(b.set_irqs(IrqKind::Msix, vec![None; 9]).is_err());
        b.clear_irqs();
        assert!(b.dev.enabled.lock().unwrap().is_empty());
    }
}
