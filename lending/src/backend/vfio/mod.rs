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
//!
//! Files by concern: [`ops`] (the device operations and their vfio-pci implementation),
//! [`regions`] (BARs, config space, the description), `irqs`, `reset` (reset and the
//! hand-over drain), [`fake`] (test doubles, `testing` feature) and the tests.

use std::os::fd::AsFd;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vfio_bindings::bindings::vfio::{VFIO_PCI_CONFIG_REGION_INDEX, VFIO_REGION_INFO_FLAG_WRITE};
use vmm_sys_util::eventfd::EventFd;

use super::{BackendError, BarExport, DeviceBackend, Drained, IrqTrigger, SriovUnreadable};
use crate::iommu::vfio::VfioDomain;
use crate::iommu::IommuDomain;
use crate::protocol::{DeviceInfo, IrqKind};

#[cfg(any(test, feature = "testing"))]
pub mod fake;
mod irqs;
pub mod ops;
pub mod regions;
mod reset;
pub mod sysfs;
#[cfg(test)]
pub(crate) mod tests;

use irqs::Wiring;
pub use ops::{MmapCaps, RegionInfo, VfioDeviceOps, VfioOpError};
pub use regions::BarAccess;
pub use reset::{CAP_ID_PCIE, DEVSTA_TRANSACTIONS_PENDING, PCIE_DEVSTA};
pub use sysfs::{check_lendable, BindingError, PfWithVfs};

/// Where the kernel shows PCI functions (`<BDF>/resourceN`).
pub const SYSFS_PCI_DEVICES: &str = "/sys/bus/pci/devices";

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
    /// The sysfs directory of PCI functions it was assembled from (the live SR-IOV check).
    sysfs: std::path::PathBuf,
}

impl VfioBackend<vfio_ioctls::VfioDevice> {
    /// Opens `/sys/bus/pci/devices/<bdf>` (bound to vfio-pci) in a container of its own.
    pub fn open(bdf: &str) -> Result<Self, BackendError> {
        Ok(Self::open_with_container(bdf)?.0)
    }

    /// [`Self::open`], also returning the container (tests read its IOVA ranges and try
    /// raw maps). Refuses, naming the reason, a function that is not bound to vfio-pci or
    /// that shares its IOMMU group with another endpoint ([`check_lendable`]).
    pub fn open_with_container(
        bdf: &str,
    ) -> Result<(Self, Arc<vfio_ioctls::VfioContainer>), BackendError> {
        if !plain_name(bdf) {
            return Err(BindingError::BadName { bdf: bdf.into() }.into());
        }
        check_lendable(Path::new(SYSFS_PCI_DEVICES), bdf)?;
        let container =
            Arc::new(vfio_ioctls::VfioContainer::new(None).map_err(BackendError::VfioContainer)?);
        let path = Path::new(SYSFS_PCI_DEVICES).join(bdf);
        let dev = vfio_ioctls::VfioDevice::new(
            &path,
            Arc::clone(&container) as Arc<dyn vfio_ioctls::VfioOps>,
            false,
        )
        .map_err(|source| BackendError::VfioDevice {
            path: path.display().to_string(),
            source,
        })?;
        let domain = Arc::new(VfioDomain::new(
            format!("vfio {bdf}"),
            Arc::clone(&container),
        ));
        Ok((
            VfioBackend::with_parts(bdf, dev, domain, Path::new(SYSFS_PCI_DEVICES)),
            container,
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
            sysfs: sysfs.to_path_buf(),
        };
        // A VF's `physfn` link names its PF (the link's last component is the PF's BDF).
        if plain_name(name) {
            b.physfn = std::fs::read_link(sysfs.join(name).join("physfn"))
                .ok()
                .and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()));
        }
        b.bars = b.decide_bars(sysfs);
        b.devsta = b.devsta_offset();
        if let Err(e) = b.enable_decode() {
            // Every BAR access will fail with it, and say why.
            log::warn!("{name}: turning decoding on: {e}");
        }
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
}

impl<D: VfioDeviceOps> VfioBackend<D> {
    /// The device operations (the kernel test inspects regions through them).
    pub fn ops(&self) -> &D {
        &self.dev
    }
}

impl<D: VfioDeviceOps> DeviceBackend for VfioBackend<D> {
    fn kind(&self) -> &str {
        "vfio"
    }

    fn physical_function(&self) -> Option<String> {
        self.physfn.clone()
    }

    fn vfs_sharing_reset(&self) -> Result<u32, SriovUnreadable> {
        // A PF bound to vfio-pci with `enable_sriov=1` can get VFs after it was opened.
        if !plain_name(&self.name) {
            return Ok(0);
        }
        sysfs::enabled_vfs(&self.sysfs.join(&self.name))
    }

    fn config_size(&self) -> u16 {
        self.config_len() as u16
    }

    fn describe(&self, id: &str) -> DeviceInfo {
        self.describe_device(id)
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
            .region_read(VFIO_PCI_CONFIG_REGION_INDEX, u64::from(offset), buf)?;
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
            .region_write(VFIO_PCI_CONFIG_REGION_INDEX, u64::from(offset), data)?;
        Ok(())
    }

    fn bar_export(&self, bar: u8) -> Option<BarExport<'_>> {
        match self.bar_access(bar)? {
            // The resource file holds exactly this BAR, from offset 0.
            // Not revocable: no kernel path takes a mapping of a sysfs resource file away from
            // one process and not another (docs/SECURITY.md, "Borrower vs later borrower").
            BarAccess::Direct { file, size, .. } => Some(BarExport {
                fd: file.as_fd(),
                offset: 0,
                size: *size,
                revocable: false,
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
        self.dev.region_read(u32::from(bar), offset, buf)?;
        Ok(())
    }

    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        let r = self.bar_region(bar)?;
        Self::check(&r, bar, offset, data.len())?;
        if r.flags & VFIO_REGION_INFO_FLAG_WRITE == 0 {
            return Err(BackendError::ReadOnlyBar(bar));
        }
        self.dev.region_write(u32::from(bar), offset, data)?;
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
        self.wire_irqs(kind, targets)
    }

    fn clear_irqs(&self) {
        self.unwire_irqs()
    }

    fn set_bus_master(&self, enable: bool) -> Result<(), BackendError> {
        // The lender decides now (a destination took the lease over, windows came or
        // went): a hand-over's saved bit is stale.
        *self.handover_bme() = None;
        self.write_bme(enable)?;
        Ok(())
    }

    fn quiesce(&self, stop: bool) -> Result<(), BackendError> {
        // Pausing: nothing to tell a VFIO device (the borrower masks its vectors). Resuming
        // after a hand-over quiesce that stayed here: Bus Master Enable as it was.
        if !stop {
            if let Some(was) = self.handover_bme().take() {
                self.write_bme(was)?;
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
        // Whatever a hand-over saved is moot after a reset.
        *self.handover_bme() = None;
        self.dev.reset()?;
        // The device resets, but Linux saves the config header before and restores it after
        // (pci_try_reset_function: pci_dev_save_and_disable .. pci_dev_restore), Bus Master
        // Enable included: the function would come back able to DMA. It must come back
        // quiescent; the lender sets the bit again once the lease has windows.
        self.write_bme(false)?;
        // Decoding the lender's own: on (the kernel restores it too, but a reset of a
        // function whose saved state had it off must not leave BAR accesses failing).
        self.enable_decode()?;
        log::info!("{}: VFIO_DEVICE_RESET, bus master off", self.name);
        Ok(())
    }

    fn domain(&self) -> Arc<dyn IommuDomain> {
        Arc::clone(&self.domain)
    }
}
