//! A real PCI function bound to vfio-pci.
//!
//! **Untested on hardware**: the development host has no `/dev/vfio`. The backend talks to
//! [`VfioDeviceOps`] (implemented for [`vfio_ioctls::VfioDevice`]) and is unit-tested with
//! [`fake::FakeVfioDevice`].
//!
//! * config space: VFIO config region (index 7), borrower accesses through the lender's
//!   [`super::config::ConfigGate`];
//! * BARs: a BAR is exported as a fabric window through the device's sysfs
//!   `/sys/bus/pci/devices/<BDF>/resourceN` file, which grants that BAR's memory and nothing
//!   else (no ioctls, no config space, no other BAR); the lender opens it when the backend is
//!   built and checks it (size exactly the BAR's, mmap-able). **Never the VFIO device fd**: on
//!   shm a window fd goes to the borrower, and the device fd would let it issue any VFIO
//!   ioctl and write config space past the lender's filter. A BAR without a usable resource
//!   file (missing, wrong size, not mmap-able, an I/O BAR, not mappable per VFIO, holding the
//!   MSI-X table or PBA) is *trapped*: BAR_READ/BAR_WRITE through VFIO region read/write. Why,
//!   is logged once per BAR;
//! * interrupts: `VFIO_DEVICE_SET_IRQS` with the borrower's eventfds (shm) or with local
//!   eventfds relayed to doorbells/messages ([`super::irq::IrqRelay`]);
//! * reset: `VFIO_DEVICE_RESET` (FLR or whatever the kernel picks);
//! * DMA: one VFIO container per device ([`crate::iommu::vfio::VfioDomain`]);
//! * live migration: the container API has no IOMMU dirty tracking, so the dirty log reports
//!   the whole window; the hand-over quiesce confirms the drain as PCIe software does before
//!   an FLR: Bus Master Enable cleared, then the PCI Express Device Status "Transactions
//!   Pending" bit polled until clear ([`VfioBackend::drain`]). A failed hand-over restores
//!   Bus Master Enable (`quiesce(false)`).

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vfio_bindings::bindings::vfio::{
    VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX,
    VFIO_PCI_MSI_IRQ_INDEX, VFIO_REGION_INFO_FLAG_MMAP, VFIO_REGION_INFO_FLAG_WRITE,
};
use vmm_sys_util::eventfd::EventFd;

use super::config::CMD_BUS_MASTER;
use super::irq::IrqRelay;
use super::{BackendError, BarExport, DeviceBackend, Drained, IrqTrigger};
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
    /// The device fd. Never exported (see the module documentation); tests compare what is
    /// exported against it.
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

/// Where the kernel shows PCI functions (`<BDF>/resourceN`).
pub const SYSFS_PCI_DEVICES: &str = "/sys/bus/pci/devices";

/// Capability ID of the PCI Express capability.
pub const CAP_ID_PCIE: u8 = 0x10;
/// Offset of Device Status in the PCI Express capability.
pub const PCIE_DEVSTA: u64 = 0x0a;
/// Device Status bit 5: Transactions Pending (non-posted requests of the function still
/// waiting for their completions).
pub const DEVSTA_TRANSACTIONS_PENDING: u16 = 1 << 5;

/// Longest pause between two Device Status polls of a drain.
const DRAIN_POLL_MAX: Duration = Duration::from_millis(1);

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

/// A vfio-pci function as a [`DeviceBackend`].
pub struct VfioBackend<D: VfioDeviceOps> {
    name: String,
    dev: D,
    domain: Arc<dyn IommuDomain>,
    wiring: Mutex<Vec<(IrqKind, Wiring)>>,
    /// BAR index -> how it is lent (BARs the device implements).
    bars: Vec<(u8, BarAccess)>,
    /// While a hand-over quiesce has Bus Master Enable cleared: whether it was set before
    /// (restored by `quiesce(false)`; forgotten when the lender sets it itself, after a
    /// transfer or a reset).
    handover_bme: Mutex<Option<bool>>,
    /// Offset of Device Status in the PCI Express capability (found once: the capability
    /// list is read-only), `None` for a conventional PCI function.
    devsta: Option<u64>,
    /// For an SR-IOV virtual function: its PF's BDF (sysfs `physfn`).
    physfn: Option<String>,
}

impl VfioBackend<vfio_ioctls::VfioDevice> {
    /// Opens `/sys/bus/pci/devices/<bdf>` (bound to vfio-pci) in a container of its own.
    pub fn open(bdf: &str) -> Result<Self, BackendError> {
        let container = Arc::new(
            vfio_ioctls::VfioContainer::new(None).map_err(|e| BackendError::Vfio(e.to_string()))?,
        );
        let path = Path::new(SYSFS_PCI_DEVICES).join(bdf);
        let dev = vfio_ioctls::VfioDevice::new(
            &path,
            Arc::clone(&container) as Arc<dyn vfio_ioctls::VfioOps>,
            false,
        )
        .map_err(|e| BackendError::Vfio(format!("{}: {e}", path.display())))?;
        let domain = Arc::new(VfioDomain::new(format!("vfio {bdf}"), container));
        Ok(VfioBackend::with_parts(
            bdf,
            dev,
            domain,
            Path::new(SYSFS_PCI_DEVICES),
        ))
    }
}

/// Whether `bdf` can name a directory under the sysfs root (no path tricks).
fn plain_name(bdf: &str) -> bool {
    !bdf.is_empty() && bdf != "." && bdf != ".." && !bdf.contains(['/', '\0'])
}

impl<D: VfioDeviceOps> VfioBackend<D> {
    /// Assembles a backend for the function `name` (its BDF): `sysfs` is the directory that
    /// holds `<name>/resourceN` ([`SYSFS_PCI_DEVICES`]; tests pass a directory of fakes).
    /// Decides once, per BAR, whether it is exported or trapped, and logs why a BAR is
    /// trapped.
    pub fn with_parts(name: &str, dev: D, domain: Arc<dyn IommuDomain>, sysfs: &Path) -> Self {
        let mut b = VfioBackend {
            name: name.to_string(),
            dev,
            domain,
            wiring: Mutex::new(Vec::new()),
            bars: Vec::new(),
            handover_bme: Mutex::new(None),
            devsta: None,
            physfn: None,
        };
        // A VF's `physfn` link names its PF (the link's last component is the PF's BDF).
        if plain_name(name) {
            b.physfn = std::fs::read_link(sysfs.join(name).join("physfn"))
                .ok()
                .and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()));
        }
        b.bars = b.decide_bars(sysfs);
        b.devsta = b.devsta_offset();
        for (i, a) in &b.bars {
            match a {
                BarAccess::Direct { path, size, .. } => log::info!(
                    "{name}: bar {i} lent directly through {} ({size:#x} bytes)",
                    path.display()
                ),
                BarAccess::Trapped(why) => log::info!(
                    "{name}: bar {i} is trapped (every access a BAR_READ/BAR_WRITE through the \
                     lender): {why}"
                ),
            }
        }
        b
    }

    /// How bar `i` is lent, if the device implements it.
    pub fn bar_access(&self, bar: u8) -> Option<&BarAccess> {
        self.bars.iter().find(|(i, _)| *i == bar).map(|(_, a)| a)
    }

    fn decide_bars(&self, sysfs: &Path) -> Vec<(u8, BarAccess)> {
        let mut cfg = [0u8; 256];
        self.dev
            .region_read(VFIO_PCI_CONFIG_REGION_INDEX, 0, &mut cfg);
        let msix = super::capabilities(&cfg)
            .into_iter()
            .find(|c| c.id == 0x11 && !c.extended)
            .map(|c| {
                let o = u64::from(c.offset);
                (
                    (self.config_u32(o + 4) & 7) as u8,
                    (self.config_u32(o + 8) & 7) as u8,
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

    fn decide_bar(
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

    fn config_len(&self) -> u64 {
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

    fn config_u16(&self, off: u64) -> u16 {
        let mut b = [0u8; 2];
        self.dev
            .region_read(VFIO_PCI_CONFIG_REGION_INDEX, off, &mut b);
        u16::from_le_bytes(b)
    }

    /// Sets or clears Bus Master Enable in the physical command register; returns whether
    /// it was set.
    fn write_bme(&self, enable: bool) -> bool {
        let cmd = self.config_u16(4);
        let new = if enable {
            cmd | CMD_BUS_MASTER
        } else {
            cmd & !CMD_BUS_MASTER
        };
        if new != cmd {
            self.dev
                .region_write(VFIO_PCI_CONFIG_REGION_INDEX, 4, &new.to_le_bytes());
        }
        cmd & CMD_BUS_MASTER != 0
    }

    fn handover_bme(&self) -> std::sync::MutexGuard<'_, Option<bool>> {
        match self.handover_bme.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Offset of the PCI Express capability's Device Status register, if the function has
    /// the capability.
    fn devsta_offset(&self) -> Option<u64> {
        let mut cfg = [0u8; 256];
        self.dev
            .region_read(VFIO_PCI_CONFIG_REGION_INDEX, 0, &mut cfg);
        super::capabilities(&cfg)
            .into_iter()
            .find(|c| !c.extended && c.id == u16::from(CAP_ID_PCIE))
            .map(|c| u64::from(c.offset) + PCIE_DEVSTA)
    }

    /// Confirms that no DMA of the function is in flight, the way PCIe software does before
    /// a Function Level Reset: Bus Master Enable cleared (the function may start no new
    /// request), then Device Status polled until Transactions Pending clears (the requests
    /// it had started have completed), at most `timeout`. Returns whether it cleared.
    ///
    /// Every poll is a config read, a non-posted request to the function whose completion
    /// may not pass the function's earlier posted writes on their way upstream: once a
    /// read returns, every memory write the function made before has reached the root
    /// complex (and guest RAM). A function without a PCI Express capability has no
    /// Transactions Pending bit: it is a conventional PCI function. Only its writes change
    /// guest RAM, and a conventional PCI write is either finished on the bus or posted in a
    /// bridge's buffer; with Bus Master Enable clear it starts no new one, and the config
    /// read (whose completion pushes the bridges' posted writes ahead of it) flushes the
    /// posted ones. What may still be outstanding are reads, which write no guest RAM. So
    /// the cleared bit plus one config read is the drain.
    fn drain(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let was = self.write_bme(false);
        self.handover_bme().get_or_insert(was);
        let Some(devsta) = self.devsta else {
            let _ = self.config_u16(4);
            log::info!(
                "{}: bus master off; no pci express capability, drained by a config read",
                self.name
            );
            return true;
        };
        let mut pause = Duration::from_micros(10);
        let mut polls = 0u32;
        loop {
            polls += 1;
            if self.config_u16(devsta) & DEVSTA_TRANSACTIONS_PENDING == 0 {
                log::info!(
                    "{}: bus master off, no transaction pending ({polls} polls)",
                    self.name
                );
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                log::warn!(
                    "{}: transactions still pending {timeout:?} after bus master was \
                     cleared ({polls} polls): drain not confirmed",
                    self.name
                );
                return false;
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(DRAIN_POLL_MAX);
        }
    }
}

impl<D: VfioDeviceOps> DeviceBackend for VfioBackend<D> {
    fn kind(&self) -> &str {
        "vfio"
    }

    fn physical_function(&self) -> Option<String> {
        self.physfn.clone()
    }

    fn config_size(&self) -> u16 {
        self.config_len() as u16
    }

    fn describe(&self, id: &str) -> DeviceInfo {
        let mut config = vec![0u8; self.config_len() as usize];
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
        let size = self.config_len();
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
        let size = self.config_len();
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
        match self.bar_access(bar)? {
            // The resource file holds exactly this BAR, from offset 0.
            BarAccess::Direct { file, size, .. } => Some(BarExport {
                fd: file.as_fd(),
                offset: 0,
                size: *size,
            }),
            BarAccess::Trapped(_) => None,
        }
    }

    fn peer_export(&self, bar: u8) -> Option<super::PeerExport<'_>> {
        // A real device decodes peer TLPs like CPU accesses: the whole BAR.
        let x = self.bar_export(bar)?;
        Some(super::PeerExport {
            fd: x.fd,
            fd_offset: x.offset,
            bar_offset: 0,
            size: x.size,
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
        // The lender decides now (a destination took the lease over, windows came or
        // went): a hand-over's saved bit is stale.
        *self.handover_bme() = None;
        self.write_bme(enable);
        Ok(())
    }

    fn quiesce(&self, stop: bool) -> Result<(), BackendError> {
        // Pausing: nothing to tell a VFIO device (the borrower masks its vectors). Resuming
        // after a hand-over quiesce that stayed here: Bus Master Enable as it was.
        if !stop {
            if let Some(was) = self.handover_bme().take() {
                self.write_bme(was);
                log::info!(
                    "{}: hand-over quiesce ended here, bus master {}",
                    self.name,
                    if was { "on again" } else { "left off" }
                );
            }
        }
        Ok(())
    }

    fn quiesce_handover(&self, timeout: Duration) -> Result<Drained, BackendError> {
        self.quiesce(true)?;
        // Interrupts are not held here: a VFIO device's go straight to the borrower's
        // eventfds (or the relay), and the borrower has masked its vectors.
        Ok(Drained {
            drained: self.drain(timeout),
            ..Drained::default()
        })
    }

    fn reset(&self) -> Result<(), BackendError> {
        // A reset clears Bus Master Enable itself; whatever a hand-over saved is moot.
        *self.handover_bme() = None;
        self.dev.reset();
        log::info!("{}: VFIO_DEVICE_RESET", self.name);
        Ok(())
    }

    fn domain(&self) -> Arc<dyn IommuDomain> {
        Arc::clone(&self.domain)
    }
}

/// A scripted VFIO device for tests. Built for tests and with the `testing` feature only.
#[cfg(any(test, feature = "testing"))]
pub mod fake {
    use std::collections::HashMap;
    use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
    use std::sync::Mutex;

    use vmm_sys_util::eventfd::EventFd;

    use super::{RegionInfo, VfioDeviceOps};
    use vfio_bindings::bindings::vfio::VFIO_PCI_CONFIG_REGION_INDEX;

    /// How long the fake holds Device Status "Transactions Pending" set.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub enum TransactionsPending {
        /// Clear (the default).
        #[default]
        Clear,
        /// Set for the next `n` reads of Device Status, clear after.
        Reads(u32),
        /// Set on every read (a function that never completes its requests).
        Forever,
    }

    /// Region contents in memory; records IRQ and reset calls, config writes and reads of
    /// the PCI Express Device Status, whose Transactions Pending bit it can hold set.
    pub struct FakeVfioDevice {
        /// index -> (info, bytes)
        pub regions: Mutex<HashMap<u32, (RegionInfo, Vec<u8>)>>,
        /// index -> vector count
        pub irq_counts: HashMap<u32, u32>,
        /// index -> eventfds currently enabled (duplicates)
        pub enabled: Mutex<HashMap<u32, Vec<EventFd>>>,
        /// Resets so far.
        pub resets: Mutex<u32>,
        /// Every config region write, in order: (offset, bytes).
        pub config_writes: Mutex<Vec<(u64, Vec<u8>)>>,
        /// Transactions Pending as Device Status reads show it.
        pub pending: Mutex<TransactionsPending>,
        /// Reads of Device Status so far: whether Bus Master Enable was set at each.
        pub devsta_reads: Mutex<Vec<bool>>,
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
                config_writes: Mutex::new(Vec::new()),
                pending: Mutex::new(TransactionsPending::Clear),
                devsta_reads: Mutex::new(Vec::new()),
                fd,
            })
        }

        /// Holds Transactions Pending as `p` says from now on.
        pub fn hold_pending(&self, p: TransactionsPending) {
            if let Ok(mut g) = self.pending.lock() {
                *g = p;
            }
        }

        /// The values written to the command register (offset 4, 2 or 4 bytes), in order.
        pub fn command_writes(&self) -> Vec<u16> {
            self.config_writes.lock().map_or_else(
                |_| Vec::new(),
                |w| {
                    w.iter()
                        .filter(|(o, d)| *o == 4 && d.len() >= 2)
                        .map(|(_, d)| u16::from_le_bytes([d[0], d[1]]))
                        .collect()
                },
            )
        }

        /// Reads of Device Status so far: whether Bus Master Enable was set at each.
        pub fn devsta_reads(&self) -> Vec<bool> {
            self.devsta_reads
                .lock()
                .map_or_else(|_| Vec::new(), |g| g.clone())
        }

        /// Offset of Device Status in `cfg` (its PCI Express capability's), if any.
        fn devsta_in(cfg: &[u8]) -> Option<u64> {
            crate::backend::capabilities(cfg)
                .into_iter()
                .find(|c| !c.extended && c.id == u16::from(super::CAP_ID_PCIE))
                .map(|c| u64::from(c.offset) + super::PCIE_DEVSTA)
        }

        /// A config read covering Device Status: counted, and Transactions Pending set in
        /// `buf` while held.
        fn on_config_read(&self, cfg: &[u8], offset: u64, buf: &mut [u8]) {
            let Some(at) = Self::devsta_in(cfg) else {
                return;
            };
            if offset > at || offset + buf.len() as u64 <= at {
                return;
            }
            if let Ok(mut n) = self.devsta_reads.lock() {
                n.push(cfg.get(4).is_some_and(|c| c & 4 != 0));
            }
            let set = match self.pending.lock() {
                Ok(mut p) => match *p {
                    TransactionsPending::Forever => true,
                    TransactionsPending::Reads(n) if n > 0 => {
                        *p = if n == 1 {
                            TransactionsPending::Clear
                        } else {
                            TransactionsPending::Reads(n - 1)
                        };
                        true
                    }
                    _ => false,
                },
                Err(_) => false,
            };
            if set {
                // Bit 5 of the register's low byte.
                buf[(at - offset) as usize] |= super::DEVSTA_TRANSACTIONS_PENDING as u8;
            }
        }
    }

    /// A directory standing in for `/sys/bus/pci/devices`: `<bdf>/resourceN` files are plain
    /// files of the BAR's size (sized and mmap-able like the kernel's).
    #[cfg(any(test, feature = "testing"))]
    pub struct FakeSysfs {
        dir: tempfile::TempDir,
    }

    #[cfg(any(test, feature = "testing"))]
    impl FakeSysfs {
        /// An empty root (no device has resource files).
        pub fn new() -> std::io::Result<Self> {
            Ok(FakeSysfs {
                dir: tempfile::tempdir()?,
            })
        }

        /// The root to pass to [`super::VfioBackend::with_parts`].
        pub fn root(&self) -> &std::path::Path {
            self.dir.path()
        }

        /// Creates `<bdf>/resource<bar>` of `size` bytes.
        pub fn add_resource(
            &self,
            bdf: &str,
            bar: u8,
            size: u64,
        ) -> std::io::Result<std::path::PathBuf> {
            let d = self.dir.path().join(bdf);
            std::fs::create_dir_all(&d)?;
            let p = d.join(format!("resource{bar}"));
            std::fs::File::create(&p)?.set_len(size)?;
            Ok(p)
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
                        if index == VFIO_PCI_CONFIG_REGION_INDEX {
                            self.on_config_read(b, offset, buf);
                        }
                    }
                }
            }
        }

        fn region_write(&self, index: u32, offset: u64, data: &[u8]) {
            if index == VFIO_PCI_CONFIG_REGION_INDEX {
                if let Ok(mut w) = self.config_writes.lock() {
                    w.push((offset, data.to_vec()));
                }
            }
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
pub(crate) mod tests {
    use super::fake::{FakeSysfs, FakeVfioDevice};
    use super::*;
    use crate::backend::filtered_config_write;
    use crate::backend::test_log;
    use crate::iommu::vfio::fake::FakeVfioContainer;
    use crate::iommu::MmapBacking;
    use std::os::fd::AsRawFd;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::{Duration, Instant};
    use vfio_bindings::bindings::vfio::VFIO_REGION_INFO_FLAG_READ;

    pub(crate) const BDF: &str = "0000:81:00.0";

    /// Config space of the fake NIC: BAR0 64-bit prefetchable memory, BAR2 32-bit memory,
    /// MSI-X at 0x40 (8 vectors, table in BAR2 at 0, PBA in BAR2 at 0x800) → PCI Express at
    /// 0x60. With `ext`, 4 KiB with the extended chain of
    /// [`crate::backend::config::extended::tests::ext_chain`] (AER, ACS, SR-IOV, ATS, PRI,
    /// PASID, resizable BAR and an unknown one).
    pub(crate) fn nic_config(ext: bool) -> Vec<u8> {
        let mut cfg = vec![0u8; if ext { 4096 } else { 256 }];
        cfg[0..4].copy_from_slice(&[0x86, 0x80, 0x3e, 0x15]);
        cfg[6] = 0x10;
        cfg[0x10..0x14].copy_from_slice(&0x0000_000cu32.to_le_bytes()); // 64-bit prefetch
        cfg[0x18..0x1c].copy_from_slice(&0u32.to_le_bytes()); // BAR2 32-bit
        cfg[0x34] = 0x40;
        cfg[0x40] = 0x11; // MSI-X
        cfg[0x41] = 0x60;
        cfg[0x42..0x44].copy_from_slice(&7u16.to_le_bytes()); // 8 vectors
        cfg[0x44..0x48].copy_from_slice(&2u32.to_le_bytes()); // table in BAR2 @0
        cfg[0x48..0x4c].copy_from_slice(&(0x800u32 | 2).to_le_bytes());
        cfg[0x60] = 0x10; // PCI Express, device control at 0x68
        cfg[0x61] = 0;
        cfg[0x62] = 0x02;
        if ext {
            crate::backend::config::extended::tests::put_ext_chain(&mut cfg);
        }
        cfg
    }

    /// The fake NIC over `cfg`; BAR2 (MSI-X) is mmap-able per VFIO when `bar2_mmap`.
    pub(crate) fn nic_with(cfg: Vec<u8>, bar2_mmap: bool) -> FakeVfioDevice {
        let rw = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;
        let cfg_size = cfg.len() as u64;
        FakeVfioDevice::new(
            vec![
                (
                    VFIO_PCI_CONFIG_REGION_INDEX,
                    RegionInfo {
                        size: cfg_size,
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
                        flags: if bar2_mmap {
                            rw | VFIO_REGION_INFO_FLAG_MMAP
                        } else {
                            rw
                        },
                    },
                    vec![0; 0x1000],
                ),
            ],
            &[(VFIO_PCI_INTX_IRQ_INDEX, 1), (VFIO_PCI_MSIX_IRQ_INDEX, 8)],
        )
        .unwrap()
    }

    fn nic_like() -> FakeVfioDevice {
        nic_with(nic_config(false), false)
    }

    /// A backend over `dev` whose sysfs root is `sysfs`.
    pub(crate) fn backend_with(
        dev: FakeVfioDevice,
        sysfs: &FakeSysfs,
    ) -> (VfioBackend<FakeVfioDevice>, Arc<FakeVfioContainer>) {
        let c = Arc::new(FakeVfioContainer::default());
        let dom = Arc::new(VfioDomain::new("fake", Arc::clone(&c)));
        (VfioBackend::with_parts(BDF, dev, dom, sysfs.root()), c)
    }

    /// The fake NIC with a fake sysfs that has BAR0's resource file.
    fn backend() -> (
        VfioBackend<FakeVfioDevice>,
        Arc<FakeVfioContainer>,
        FakeSysfs,
    ) {
        let sysfs = FakeSysfs::new().unwrap();
        sysfs.add_resource(BDF, 0, 0x4000).unwrap();
        let (b, c) = backend_with(nic_like(), &sysfs);
        (b, c, sysfs)
    }

    fn stat(fd: BorrowedFd<'_>) -> libc::stat {
        let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
        // SAFETY: fstat writes into the properly sized buffer; the fd is borrowed live.
        assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) }, 0);
        // SAFETY: fstat succeeded.
        unsafe { st.assume_init() }
    }

    fn config_of(b: &VfioBackend<FakeVfioDevice>) -> Vec<u8> {
        b.dev.regions.lock().unwrap()[&VFIO_PCI_CONFIG_REGION_INDEX]
            .1
            .clone()
    }

    /// Peer-to-peer with VFIO on either side (no /dev/vfio here: the fake device and
    /// container). As a *target*, a VFIO device offers its whole BAR through the sysfs
    /// resource file: a peer's DMA through its IOMMU domain lands in the BAR. As a *source*,
    /// the peer BAR is handed to the type1 IOMMU as the lender's mapping of it (host address
    /// = that mapping, IOVA = the target's guest BAR address), and unmapped again when the
    /// mapping is dropped or the target revokes it.
    #[test]
    fn p2p_with_a_vfio_device_as_target_and_as_source() {
        use crate::iommu::p2p::P2pBook;
        use crate::iommu::vfio::fake::FakeOp;
        use crate::iommu::{IommuDomain, SoftIommu};
        const IOVA: u64 = 0xe000_0000;
        let (target, _c, sysfs) = backend();
        let target: Arc<dyn DeviceBackend> = Arc::new(target);
        let book = Arc::new(P2pBook::default());
        let reg = book.register(2, "borrower/vm@local", Arc::clone(&target), false);
        let resource0 = sysfs.root().join(BDF).join("resource0");

        // An emulated source (software domain) writes into the VFIO target's BAR.
        let soft = Arc::new(SoftIommu::new("emulated-source"));
        let m = book
            .map(1, "borrower/vm@local", soft.clone(), 2, 0, IOVA, false)
            .unwrap();
        soft.dma_write(IOVA + 0x10, &[0xca, 0xfe, 0xf0, 0x0d])
            .unwrap();
        assert_eq!(
            &std::fs::read(&resource0).unwrap()[0x10..0x14],
            &[0xca, 0xfe, 0xf0, 0x0d]
        );
        assert!(
            soft.dma_write(IOVA + 0x4000, &[0]).is_err(),
            "nothing past the BAR"
        );
        // Another holder's lease cannot map it.
        assert!(book
            .map(3, "borrower/other@local", soft.clone(), 2, 0, IOVA, false)
            .is_err());
        drop(m);
        assert!(
            soft.dma_write(IOVA + 0x10, &[0]).is_err(),
            "unmapped with its value"
        );

        // A VFIO source: the container is given the lender's mapping of the peer BAR.
        let c = Arc::new(FakeVfioContainer::default());
        let vdom: Arc<dyn IommuDomain> = Arc::new(VfioDomain::new("vfio-source", Arc::clone(&c)));
        let m = book
            .map(1, "borrower/vm@local", Arc::clone(&vdom), 2, 0, IOVA, false)
            .unwrap();
        let (size, host) = c.live.lock().unwrap()[&IOVA];
        assert_eq!(size, 0x4000);
        // What the IOMMU would translate IOVA to is the BAR: a store through the host
        // address reaches the resource file, i.e. the device.
        // SAFETY: `host` is the live mapping of the 16 KiB BAR that `m` keeps mapped.
        unsafe { std::ptr::write_volatile((host as *mut u8).add(0x20), 0x5a) };
        assert_eq!(std::fs::read(&resource0).unwrap()[0x20], 0x5a);
        // The target's reset/return revokes it: the container is unmapped before that returns.
        assert_eq!(reg.revoke_all("target reset"), 1);
        assert_eq!(
            c.calls(),
            vec![FakeOp::Map(IOVA, 0x4000), FakeOp::Unmap(IOVA, 0x4000)]
        );
        assert!(c.live().is_empty());
        drop(m);
        assert_eq!(
            c.calls().len(),
            2,
            "a revoked mapping is not unmapped twice"
        );
    }

    /// Live migration on a VFIO device: the lender cannot see its DMA, so the dirty log
    /// reports the whole window; the hand-over quiesce confirms the drain through the
    /// device itself (Bus Master Enable cleared, Transactions Pending clear).
    #[test]
    fn migration_reports_the_whole_window_and_drains_through_the_device() {
        let (b, c, _sysfs) = backend();
        let dom = b.domain();
        let mem = Arc::new(crate::iommu::MmapBacking::anonymous(0x4000).unwrap());
        dom.map(0x10_0000, 0x4000, mem).unwrap();
        b.set_bus_master(true).unwrap();
        assert!(!dom.start_dirty_log());
        let d = dom.fetch_dirty(0x10_0000, 0x8000).unwrap();
        assert!(d.whole_window);
        assert_eq!(d.count(), 4, "every mapped page, none beyond");
        let n0 = b.dev.devsta_reads().len();
        let q = b.quiesce_handover(Duration::from_millis(10)).unwrap();
        assert_eq!(
            q,
            crate::backend::Drained {
                drained: true,
                ..Default::default()
            },
            "nothing pending: drained at the first poll, no interrupt held"
        );
        assert_eq!(
            b.dev.devsta_reads()[n0..],
            [false],
            "polled once, with bus master off"
        );
        assert_eq!(command(&b) & CMD_BUS_MASTER, 0);
        dom.stop_dirty_log();
        assert_eq!(c.live(), vec![(0x10_0000, 0x4000)]);
    }

    fn command(b: &VfioBackend<FakeVfioDevice>) -> u16 {
        let mut v = [0u8; 2];
        b.config_read(4, &mut v).unwrap();
        u16::from_le_bytes(v)
    }

    /// Transactions Pending set for the first polls: the quiesce waits until it clears and
    /// confirms the drain; every poll came after Bus Master Enable was cleared.
    #[test]
    fn handover_drain_waits_for_transactions_pending_to_clear() {
        let (b, _, _sysfs) = backend();
        b.set_bus_master(true).unwrap();
        let before = command(&b);
        b.dev.hold_pending(fake::TransactionsPending::Reads(3));
        let n0 = b.dev.devsta_reads().len();
        let q = b.quiesce_handover(Duration::from_secs(5)).unwrap();
        assert!(q.drained, "{q:?}");
        assert_eq!(
            b.dev.devsta_reads()[n0..],
            [false; 4],
            "three polls saw it pending, the fourth clear, all with bus master off"
        );
        assert_eq!(
            b.dev.command_writes().last(),
            Some(&(before & !CMD_BUS_MASTER)),
            "only bus master cleared"
        );
        // The hand-over failed: the source keeps the device, bus master as it was.
        b.quiesce(false).unwrap();
        assert_eq!(command(&b), before);
        assert_ne!(before & CMD_BUS_MASTER, 0);
    }

    /// A function that never completes its requests: the drain is not confirmed, the
    /// quiesce returns once its timeout is up (no hang), and resuming sets bus master again.
    #[test]
    fn handover_drain_is_not_confirmed_while_transactions_stay_pending() {
        let (b, _, _sysfs) = backend();
        b.set_bus_master(true).unwrap();
        b.dev.hold_pending(fake::TransactionsPending::Forever);
        let n0 = b.dev.devsta_reads().len();
        let t0 = Instant::now();
        let q = b.quiesce_handover(Duration::from_millis(50)).unwrap();
        let took = t0.elapsed();
        assert!(!q.drained, "{q:?}");
        assert!(
            took >= Duration::from_millis(50) && took < Duration::from_secs(2),
            "{took:?}"
        );
        let reads = b.dev.devsta_reads()[n0..].to_vec();
        assert!(reads.len() > 1, "polled until the timeout: {reads:?}");
        assert!(reads.iter().all(|bme| !bme), "{reads:?}");
        assert_eq!(command(&b) & CMD_BUS_MASTER, 0, "stays off until resumed");
        // A second attempt keeps what the first saved (bus master was on).
        let q = b.quiesce_handover(Duration::ZERO).unwrap();
        assert!(!q.drained);
        b.quiesce(false).unwrap();
        assert_ne!(command(&b) & CMD_BUS_MASTER, 0, "restored");
        let writes = b.dev.command_writes();
        assert_eq!(
            writes
                .iter()
                .map(|c| c & CMD_BUS_MASTER != 0)
                .collect::<Vec<_>>(),
            vec![true, false, true],
            "set, cleared once for the hand-over, restored: {writes:x?}"
        );
        // Resumed again without a hand-over: nothing written.
        b.quiesce(false).unwrap();
        assert_eq!(b.dev.command_writes().len(), 3);
    }

    /// Bus master stays as the lender last set it: off before the hand-over stays off after
    /// it; a lender decision during the hand-over (the destination's accept sets it by its
    /// windows, a lease end clears it) is not undone by a later resume.
    #[test]
    fn handover_resume_restores_only_what_the_handover_changed() {
        let (b, _, _sysfs) = backend();
        assert_eq!(command(&b) & CMD_BUS_MASTER, 0);
        assert!(b.quiesce_handover(Duration::from_secs(1)).unwrap().drained);
        b.quiesce(false).unwrap();
        assert_eq!(command(&b) & CMD_BUS_MASTER, 0, "was off, stays off");
        assert!(b.dev.command_writes().is_empty(), "nothing to write");

        b.set_bus_master(true).unwrap();
        assert!(b.quiesce_handover(Duration::from_secs(1)).unwrap().drained);
        // The destination took the lease with its windows mapped: bus master on; its resume
        // leaves that alone.
        b.set_bus_master(true).unwrap();
        b.quiesce(false).unwrap();
        assert_ne!(command(&b) & CMD_BUS_MASTER, 0);
        // Quiesced again, then the lease ended (bus master off by the lender): a late
        // resume does not turn it back on.
        assert!(b.quiesce_handover(Duration::from_secs(1)).unwrap().drained);
        b.set_bus_master(false).unwrap();
        b.quiesce(false).unwrap();
        assert_eq!(command(&b) & CMD_BUS_MASTER, 0);
        // Nor after a reset.
        b.set_bus_master(true).unwrap();
        assert!(b.quiesce_handover(Duration::from_secs(1)).unwrap().drained);
        b.reset().unwrap();
        let n = b.dev.command_writes().len();
        b.quiesce(false).unwrap();
        assert_eq!(
            b.dev.command_writes().len(),
            n,
            "nothing written after the reset"
        );
    }

    /// A function without a PCI Express capability: bus master cleared and one config read
    /// are the drain (no Device Status to poll).
    #[test]
    fn handover_drain_of_a_conventional_pci_function() {
        let mut cfg = nic_config(false);
        cfg[0x41] = 0; // MSI-X is the last capability: no PCI Express.
        let sysfs = FakeSysfs::new().unwrap();
        let (b, _) = backend_with(nic_with(cfg, false), &sysfs);
        b.set_bus_master(true).unwrap();
        b.dev.hold_pending(fake::TransactionsPending::Forever);
        let q = b.quiesce_handover(Duration::from_secs(1)).unwrap();
        assert!(q.drained, "{q:?}");
        assert!(b.dev.devsta_reads().is_empty());
        assert_eq!(command(&b) & CMD_BUS_MASTER, 0);
        b.quiesce(false).unwrap();
        assert_ne!(command(&b) & CMD_BUS_MASTER, 0);
    }

    #[test]
    fn describe_reads_bars_caps_and_irqs() {
        let (b, _, _sysfs) = backend();
        let info = b.describe(BDF);
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

    /// What a shm borrower receives for a BAR is the BAR's resource file: sized exactly as the
    /// BAR, not the device fd, no VFIO ioctl works on it, and writing it at config offsets
    /// never reaches config space.
    #[test]
    fn bar_export_is_the_resource_file_never_the_device_fd() {
        let (b, _, sysfs) = backend();
        let path = sysfs.root().join(BDF).join("resource0");
        let cfg_before = config_of(&b);
        let x = b.bar_export(0).expect("bar 0 has a resource file");
        assert_eq!((x.offset, x.size), (0, 0x4000));
        let st = stat(x.fd);
        let file = std::fs::metadata(&path).unwrap();
        assert_eq!((st.st_dev, st.st_ino), (file.dev(), file.ino()));
        assert_eq!(st.st_size as u64, 0x4000, "exactly the bar's size");
        let dev = stat(b.dev.device_fd());
        assert_ne!(
            (st.st_dev, st.st_ino),
            (dev.st_dev, dev.st_ino),
            "the export is not the device fd"
        );
        // VFIO_DEVICE_GET_INFO = _IO(';', 100 + 7): not a VFIO device.
        const VFIO_DEVICE_GET_INFO: libc::Ioctl = 0x3b6b;
        let mut info = [16u32, 0, 0, 0];
        // SAFETY: an ioctl on a live fd with a 16-byte buffer the kernel may write.
        let r = unsafe { libc::ioctl(x.fd.as_raw_fd(), VFIO_DEVICE_GET_INFO, info.as_mut_ptr()) };
        assert_eq!(r, -1);
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::ENOTTY)
        );
        // pwrite at config offsets (command, BAR0, MSI-X control, the PCIe FLR bit) lands in
        // BAR memory, never in config space.
        for (off, data) in [
            (0x04i64, [0x07u8, 0x04, 0, 0]),
            (0x10, [0xff; 4]),
            (0x40, [0x11, 0, 0xff, 0xc0]),
            (0x68, [0, 0x80, 0, 0]),
        ] {
            // SAFETY: pwrite of a 4-byte buffer on a live fd.
            let n = unsafe { libc::pwrite(x.fd.as_raw_fd(), data.as_ptr().cast(), 4, off) };
            assert_eq!(n, 4);
            let mut back = [0u8; 4];
            // SAFETY: pread into a 4-byte buffer on a live fd.
            let n = unsafe { libc::pread(x.fd.as_raw_fd(), back.as_mut_ptr().cast(), 4, off) };
            assert_eq!((n, back), (4, data));
        }
        assert_eq!(config_of(&b), cfg_before, "config space untouched");
        // Nothing past the BAR: the file ends where the BAR does.
        let mut byte = [0u8; 1];
        // SAFETY: pread into a 1-byte buffer on a live fd.
        let n = unsafe { libc::pread(x.fd.as_raw_fd(), byte.as_mut_ptr().cast(), 1, 0x4000) };
        assert_eq!(n, 0);
    }

    /// Over a real shm link: the window the borrower maps for the BAR is the resource file.
    #[test]
    fn shm_window_of_a_bar_maps_the_resource_file() {
        use ntb::{connect_addr, listen_addr, ControlAddr, LinkConfig, NodeId};
        let (b, _, sysfs) = backend();
        let dir = tempfile::tempdir().unwrap();
        let addr = ControlAddr::Unix(dir.path().join("l.sock"));
        let l = listen_addr(
            &addr,
            &NodeId::new("lender").unwrap(),
            &LinkConfig::default(),
        )
        .unwrap();
        // The fake resource file is a plain file (real sysfs files pass the seal check as
        // fixed-extent files, see ntb::mem::fd_has_fixed_extent).
        let bcfg = LinkConfig {
            require_sealed_windows: false,
            ..LinkConfig::default()
        };
        let t = std::thread::spawn(move || {
            connect_addr(&addr, &NodeId::new("borrower").unwrap(), &bcfg).unwrap()
        });
        let lender = l.accept(Some(Duration::from_secs(5))).unwrap();
        let borrower = t.join().unwrap();
        // The size check stays meaningful: a device fd (size 0) cannot back any window.
        let Err(e) = lender.export_window(b.dev.device_fd(), 0, 0x4000, "device-fd") else {
            panic!("a size-0 fd must be refused as a window");
        };
        assert!(
            matches!(e, ntb::FabricError::RegionTooSmall { have: 0, .. }),
            "{e}"
        );
        let x = b.bar_export(0).unwrap();
        let w = lender
            .export_window(x.fd, x.offset, x.size, "bar0")
            .unwrap();
        let info = borrower
            .wait_peer_window("bar0", Duration::from_secs(5))
            .unwrap();
        assert_eq!(info.size, 0x4000);
        let win = borrower.map_peer_window(info.id).unwrap();
        let cfg_before = config_of(&b);
        win.write_at(0x10, &[0xde, 0xad, 0xbe, 0xef]).unwrap();
        win.write_at(0x3ffc, &[1, 2, 3, 4]).unwrap();
        assert!(
            win.write_at(0x3ffe, &[0; 4]).is_err(),
            "nothing past the bar"
        );
        let file = std::fs::read(sysfs.root().join(BDF).join("resource0")).unwrap();
        assert_eq!(&file[0x10..0x14], &[0xde, 0xad, 0xbe, 0xef]);
        assert_eq!(&file[0x3ffc..], &[1, 2, 3, 4]);
        assert_eq!(config_of(&b), cfg_before);
        drop(w);
    }

    /// Every way a BAR can lack a usable resource file leaves it trapped, says why once, and
    /// still works through BAR_READ/BAR_WRITE.
    #[test]
    fn bars_without_a_usable_resource_file_are_trapped_and_say_why() {
        test_log::init();
        let why = |b: &VfioBackend<FakeVfioDevice>, bar: u8| match b.bar_access(bar) {
            Some(BarAccess::Trapped(w)) => w.clone(),
            other => panic!("bar {bar}: {other:?}"),
        };
        // No resource file at all.
        let sysfs = FakeSysfs::new().unwrap();
        let (b, _) = backend_with(nic_like(), &sysfs);
        assert!(b.bar_export(0).is_none());
        let w = why(&b, 0);
        assert!(
            w.starts_with("cannot open ") && w.contains("resource0"),
            "{w}"
        );
        let logged = test_log::lines_with(&w);
        assert_eq!(logged.len(), 1, "logged once: {logged:?}");
        assert!(logged[0].contains("bar 0 is trapped"), "{}", logged[0]);
        b.bar_write(0, 0x20, &[9, 8, 7, 6]).unwrap();
        let mut v = [0u8; 4];
        b.bar_read(0, 0x20, &mut v).unwrap();
        assert_eq!(v, [9, 8, 7, 6], "trapped access reaches the device");
        // Smaller and larger than the BAR.
        for (size, says) in [(0x1000u64, "smaller than"), (0x8000, "larger than")] {
            let sysfs = FakeSysfs::new().unwrap();
            sysfs.add_resource(BDF, 0, size).unwrap();
            let (b, _) = backend_with(nic_like(), &sysfs);
            assert!(b.bar_export(0).is_none());
            assert!(why(&b, 0).contains(says), "{}", why(&b, 0));
        }
        // Not a file (a directory in its place), or a symlink to one of the right size.
        let sysfs = FakeSysfs::new().unwrap();
        std::fs::create_dir_all(sysfs.root().join(BDF).join("resource0")).unwrap();
        let (b, _) = backend_with(nic_like(), &sysfs);
        assert!(b.bar_export(0).is_none(), "{}", why(&b, 0));
        let sysfs = FakeSysfs::new().unwrap();
        let real = sysfs.add_resource("elsewhere", 0, 0x4000).unwrap();
        std::fs::create_dir_all(sysfs.root().join(BDF)).unwrap();
        std::os::unix::fs::symlink(&real, sysfs.root().join(BDF).join("resource0")).unwrap();
        let (b, _) = backend_with(nic_like(), &sysfs);
        assert!(why(&b, 0).starts_with("cannot open"), "{}", why(&b, 0));
        // The MSI-X BAR, even when VFIO would let it be mapped and its file exists.
        let sysfs = FakeSysfs::new().unwrap();
        sysfs.add_resource(BDF, 2, 0x1000).unwrap();
        let (b, _) = backend_with(nic_with(nic_config(false), true), &sysfs);
        assert!(b.bar_export(2).is_none());
        assert!(why(&b, 2).contains("msi-x"), "{}", why(&b, 2));
        // Not mappable per VFIO (BAR2 without the flag).
        let (b, _) = backend_with(nic_like(), &sysfs);
        assert!(why(&b, 2).contains("vfio does not allow"), "{}", why(&b, 2));
        // An I/O BAR.
        let mut cfg = nic_config(false);
        cfg[0x10..0x14].copy_from_slice(&0x0000_0001u32.to_le_bytes());
        let sysfs = FakeSysfs::new().unwrap();
        sysfs.add_resource(BDF, 0, 0x4000).unwrap();
        let (b, _) = backend_with(nic_with(cfg, false), &sysfs);
        assert!(why(&b, 0).contains("i/o bar"), "{}", why(&b, 0));
        // A name that is not a plain directory name.
        let c = Arc::new(FakeVfioContainer::default());
        let dom = Arc::new(VfioDomain::new("fake", c));
        let b = VfioBackend::with_parts("../x", nic_like(), dom, sysfs.root());
        assert!(why(&b, 0).contains("not a pci address"), "{}", why(&b, 0));
    }

    #[test]
    fn config_filter_bar_io_reset_and_dma() {
        let (b, c, _sysfs) = backend();
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
        let (b, _, _sysfs) = backend();
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

    /// A virtual function is an ordinary BDF to the VFIO backend. The VF addresses come
    /// from the PF's SR-IOV capability (Intel-style First VF Offset 0x80, stride 2: VFs of
    /// 81:00.0 at 81:10.0 and 81:10.2); each parses as a `--device` spec, names its own sysfs
    /// directory (BAR0 lent directly through `<sysfs>/<VF BDF>/resource0`) and, having no
    /// INTx (VFs have none), describes MSI-X only; its sysfs `physfn` link names its PF. The
    /// PF and both VFs sit in one inventory; the VFs go to two borrowers, and the PF is then
    /// refused to a third (resetting it would take the VFs away); returning one VF's lease
    /// resets that VF only, and the PF is lent once no VF is, its VFs then refused.
    #[test]
    fn virtual_functions_are_plain_bdfs_in_sysfs_and_the_inventory() {
        use crate::inventory::{Inventory, InventoryError};
        use crate::protocol::DeviceState;
        use crate::sriov::Bdf;

        let pf: Bdf = BDF.parse().unwrap();
        let cap = emulated::sriov::SriovCap::enabled(2, 0x80, 2, 0x154c, vec![]).unwrap();
        let vfs: Vec<String> = pf
            .vfs(&cap)
            .unwrap()
            .iter()
            .map(|b| b.to_string())
            .collect();
        assert_eq!(vfs, ["0000:81:10.0", "0000:81:10.2"]);
        let sysfs = FakeSysfs::new().unwrap();
        sysfs.add_resource(BDF, 0, 0x4000).unwrap();
        let (pf_b, _) = backend_with(nic_with(nic_config(true), false), &sysfs);
        let pf_b = Arc::new(pf_b);
        let mut devices: Vec<(String, Arc<dyn DeviceBackend>)> =
            vec![(BDF.to_string(), pf_b.clone() as Arc<dyn DeviceBackend>)];
        let mut vf_bs = Vec::new();
        for vf in &vfs {
            let spec: crate::spec::DeviceSpec = format!("{vf}=vfio").parse().unwrap();
            assert_eq!(spec.function_ids(), std::slice::from_ref(vf));
            sysfs.add_resource(vf, 0, 0x4000).unwrap();
            // As the kernel does: `<VF>/physfn -> ../<PF>`.
            std::os::unix::fs::symlink(format!("../{BDF}"), sysfs.root().join(vf).join("physfn"))
                .unwrap();
            // vfio-pci shows a VF's vendor and device id (the VF's own header reads
            // ffff:ffff); it has MSI-X and no INTx.
            let mut cfg = nic_config(false);
            cfg[2..4].copy_from_slice(&0x154cu16.to_le_bytes());
            let mut dev = nic_with(cfg, false);
            dev.irq_counts.remove(&VFIO_PCI_INTX_IRQ_INDEX);
            let c = Arc::new(FakeVfioContainer::default());
            let dom = Arc::new(VfioDomain::new(format!("vfio {vf}"), c));
            let b = Arc::new(VfioBackend::with_parts(vf, dev, dom, sysfs.root()));
            assert_eq!(b.physical_function().as_deref(), Some(BDF), "{vf}");
            match b.bar_access(0) {
                Some(BarAccess::Direct { path, .. }) => {
                    assert_eq!(path, &sysfs.root().join(vf).join("resource0"))
                }
                other => panic!("{vf}: bar 0 {other:?}"),
            }
            let info = b.describe(vf);
            assert_eq!((info.irqs.intx, info.irqs.msix), (0, 8), "{vf}");
            assert_eq!(&info.config[2..4], &[0x4c, 0x15]);
            devices.push((vf.clone(), b.clone() as Arc<dyn DeviceBackend>));
            vf_bs.push(b);
        }
        let inv = Inventory::new(devices).unwrap();
        let ids: Vec<String> = inv.list().into_iter().map(|d| d.id).collect();
        assert_eq!(ids, [BDF, "0000:81:10.0", "0000:81:10.2"]);
        let l1 = inv.acquire(&vfs[0], "node1", "vm-a").unwrap();
        let l2 = inv.acquire(&vfs[1], "node2", "vm-b").unwrap();
        assert_eq!(pf_b.physical_function(), None);
        let e = inv.acquire(BDF, "node4", "vm-c").err().unwrap();
        assert!(
            matches!(&e, InventoryError::Family { relative, .. } if *relative == vfs[0]),
            "{e:?}"
        );
        assert_eq!(inv.get(BDF).unwrap().state(), DeviceState::Available);
        assert_eq!(
            inv.acquire(&vfs[0], "node2", "vm-b").err(),
            Some(InventoryError::Busy {
                node: "node1".into(),
                vm: "vm-a".into()
            })
        );
        drop(l1);
        assert_eq!(*vf_bs[0].dev.resets.lock().unwrap(), 1);
        assert_eq!(*vf_bs[1].dev.resets.lock().unwrap(), 0, "vf 2 untouched");
        assert_eq!(*pf_b.dev.resets.lock().unwrap(), 0, "pf untouched");
        assert_eq!(inv.get(&vfs[0]).unwrap().state(), DeviceState::Available);
        assert!(matches!(
            inv.get(&vfs[1]).unwrap().state(),
            DeviceState::Lent { .. }
        ));
        drop(l2);
        assert_eq!(*pf_b.dev.resets.lock().unwrap(), 0, "pf untouched");
        let lp = inv.acquire(BDF, "node4", "vm-c").unwrap();
        let e = inv.acquire(&vfs[1], "node2", "vm-b").err().unwrap();
        assert!(
            e.to_string()
                .contains("its physical function 0000:81:00.0 is lent to node4/vm-c"),
            "{e}"
        );
        drop(lp);
        assert_eq!(*pf_b.dev.resets.lock().unwrap(), 1);
        inv.acquire(&vfs[1], "node2", "vm-b").unwrap();
    }
}
