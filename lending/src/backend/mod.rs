//! Device backends: what the lender lends.
//!
//! * [`emulated::EmulatedBackend`] hosts any [`emulated::DeviceModel`] (NVMe, dmatest): the
//!   register BAR lives in a memfd exported as a fabric window, DMA goes through a
//!   [`crate::iommu::SoftIommu`], interrupts go to the borrower's targets.
//! * [`vfio::VfioBackend`]: a real device bound to vfio-pci (compiled and unit-tested with a
//!   fake VFIO layer; untested on hardware).
//!
//! Every backend owns one IOMMU domain for its whole life; a lease maps the borrower's windows
//! into it and unmaps them when it ends. Config accesses from a borrower pass the lender-side
//! [`config::ConfigGate`] (conventional filter, extended-space view) first.

pub mod config;
pub mod emulated;
pub mod irq;
pub mod vfio;

use std::os::fd::BorrowedFd;
use std::sync::Arc;

use thiserror::Error;
use vmm_sys_util::eventfd::EventFd;

use crate::iommu::IommuDomain;
use crate::protocol::{
    BarDesc, CapDesc, DeviceInfo, DoorbellKicks, IrqCounts, IrqKind, LeaseCounters, MsixDesc,
};

pub use irq::IrqTrigger;

/// Errors of device backends.
#[derive(Debug, Error)]
pub enum BackendError {
    /// BAR index not implemented by the device.
    #[error("bar {0} is not implemented by the device")]
    NoSuchBar(u8),
    /// BAR emulated by the borrower.
    #[error("bar {0} is emulated by the borrower (msi-x table/pba)")]
    BorrowerBar(u8),
    /// Access outside a region.
    #[error("access of {len:#x} bytes at {offset:#x} is outside the {size:#x}-byte {what}")]
    OutOfRange {
        /// Region.
        what: String,
        /// Offset.
        offset: u64,
        /// Length.
        len: usize,
        /// Region size.
        size: u64,
    },
    /// Access size the device does not support.
    #[error("{what} access of {len} bytes at {offset:#x} must be 4 or 8 bytes, naturally aligned")]
    BadAccess {
        /// Region.
        what: String,
        /// Offset.
        offset: u64,
        /// Length.
        len: usize,
    },
    /// A config write that no PCI config cycle can be.
    #[error(
        "config write of {len} bytes at {offset:#x} refused: config writes must be 1, 2 or 4 \
         bytes inside one dword"
    )]
    BadConfigAccess {
        /// Offset.
        offset: u16,
        /// Length.
        len: usize,
    },
    /// The config filter refused a write.
    #[error(transparent)]
    Forbidden(#[from] config::FilterError),
    /// A function that cannot be lent through VFIO (driver, IOMMU group).
    #[error(transparent)]
    Binding(#[from] vfio::BindingError),
    /// Interrupt kind/count the device does not have.
    #[error("{kind:?}: {count} vectors requested, the device has {max}")]
    TooManyVectors {
        /// Kind.
        kind: IrqKind,
        /// Requested.
        count: usize,
        /// Available.
        max: u32,
    },
    /// The device model failed.
    #[error("device model: {0}")]
    Model(String),
    /// `/dev/vfio/vfio` could not be opened or set up as a container.
    #[error("opening a vfio container: {0}")]
    VfioContainer(#[source] vfio_ioctls::VfioError),
    /// The function's VFIO group or device could not be opened.
    #[error("opening the vfio device {path}: {source}")]
    VfioDevice {
        /// Its sysfs directory.
        path: String,
        /// vfio-ioctls' error.
        #[source]
        source: vfio_ioctls::VfioError,
    },
    /// A write to a BAR whose VFIO region is read-only.
    #[error("bar {0} is read-only")]
    ReadOnlyBar(u8),
    /// The borrower asked a resizable BAR for a size the function does not offer, or
    /// the function cannot be resized here.
    #[error("resizable bar {bar}: {asked} refused; the function offers {offered}")]
    ResizeRefused {
        /// BAR index.
        bar: u8,
        /// The size asked for ("8 GiB").
        asked: String,
        /// What it offers ("1 MiB to 4 GiB", "only 256 MiB (its current size: ...)").
        offered: String,
    },
    /// A VFIO device operation failed (region access, interrupts, reset).
    #[error(transparent)]
    VfioOp(#[from] vfio::VfioOpError),
    /// An OS resource failed.
    #[error("{what}: {source}")]
    Os {
        /// What.
        what: &'static str,
        /// OS error.
        source: std::io::Error,
    },
}

/// Memory behind a BAR that can be exported as a fabric window.
#[derive(Debug, Clone, Copy)]
pub struct BarExport<'a> {
    /// mmap-able fd (memfd, VFIO device fd).
    pub fd: BorrowedFd<'a>,
    /// Offset of the BAR in the fd.
    pub offset: u64,
    /// Size.
    pub size: u64,
    /// Whether the lender can cut a borrower that kept this fd off from the device when its
    /// lease ends ([`DeviceBackend::renew_exports`] moves an emulated device's registers to
    /// a new memfd). Only then is the fd itself handed to a borrower (a shm link); any other
    /// is exported mediated: the lender maps it and serves the borrower's accesses.
    pub revocable: bool,
}

/// Memory of a BAR that another lease's device may reach by peer-to-peer DMA.
#[derive(Debug, Clone, Copy)]
pub struct PeerExport<'a> {
    /// mmap-able fd.
    pub fd: BorrowedFd<'a>,
    /// Offset of the memory in the fd.
    pub fd_offset: u64,
    /// Offset of the memory in the BAR (page aligned).
    pub bar_offset: u64,
    /// Size (page multiple).
    pub size: u64,
}

/// What [`DeviceBackend::quiesce_handover`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Drained {
    /// No DMA of the device is in flight (confirmed by the lender).
    pub drained: bool,
    /// MSI-X vectors raised since the quiesce began, held.
    pub pending_msix: Vec<u32>,
    /// INTx asserted since the quiesce began, held.
    pub pending_intx: bool,
}

/// A function's SR-IOV VF count (`sriov_numvfs`) exists but cannot be read or parsed, so
/// whether a reset would take VFs away cannot be told: the lease is refused (fails closed).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error(
    "{path}: cannot tell whether SR-IOV virtual functions are enabled ({detail}); a physical \
     function with VFs is never lent, so the lease is refused"
)]
pub struct SriovUnreadable {
    /// The `sriov_numvfs` file.
    pub path: String,
    /// What went wrong (`InvalidData`: not a count).
    pub kind: std::io::ErrorKind,
    /// The error or the content, for the operator.
    pub detail: String,
}

/// One lendable PCI function.
pub trait DeviceBackend: Send + Sync {
    /// `vfio`, `nvme`, `dmatest`.
    fn kind(&self) -> &str;
    /// Config snapshot (current), BARs (without window ids), capabilities, IRQ counts.
    fn describe(&self, id: &str) -> DeviceInfo;
    /// Size of the function's config space: 256 (conventional) or 4096 (PCIe extended).
    /// Default: 256.
    fn config_size(&self) -> u16 {
        256
    }
    /// Reads config space.
    fn config_read(&self, offset: u16, buf: &mut [u8]) -> Result<(), BackendError>;
    /// Writes config space. Callers pass borrower writes through [`config::ConfigFilter`]
    /// first (see [`filtered_config_write`]).
    fn config_write(&self, offset: u16, data: &[u8]) -> Result<(), BackendError>;
    /// Memory to export as the fabric window of `bar`, if it can be mapped directly.
    fn bar_export(&self, bar: u8) -> Option<BarExport<'_>>;
    /// The memory of `bar` a peer device may reach by peer-to-peer DMA (mapped into the
    /// peer's IOMMU domain). Default: none (peers' DMA to the BAR faults).
    fn peer_export(&self, _bar: u8) -> Option<PeerExport<'_>> {
        None
    }
    /// Slow-path BAR read.
    fn bar_read(&self, bar: u8, offset: u64, buf: &mut [u8]) -> Result<(), BackendError>;
    /// Slow-path BAR write.
    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), BackendError>;
    /// A duplicate of the eventfd that wakes the device after direct BAR stores.
    fn notify_eventfd(&self) -> Option<EventFd>;
    /// Replaces the targets of `kind` (one per vector from 0; `None` = not wired). An empty
    /// list disables the kind.
    fn set_irqs(
        &self,
        kind: IrqKind,
        targets: Vec<Option<Arc<dyn IrqTrigger>>>,
    ) -> Result<(), BackendError>;
    /// Drops all interrupt wiring.
    fn clear_irqs(&self);
    /// INTx resample: the borrower's guest EOIed the level-triggered line. Re-check the
    /// device's interrupt condition and signal the INTx target again if it is still pending.
    /// Default: nothing.
    fn intx_resample(&self) {}
    /// Sets or clears Bus Master Enable (only the lender does, when windows are mapped).
    fn set_bus_master(&self, enable: bool) -> Result<(), BackendError>;
    /// Function-level reset; the device comes back quiescent with a clean config space.
    fn reset(&self) -> Result<(), BackendError>;
    /// The device's IOMMU domain.
    fn domain(&self) -> Arc<dyn IommuDomain>;
    /// Quiesces (`true`) or resumes (`false`) the device for the borrower's pause: it stops
    /// fetching doorbells and descriptors until resumed. [`DeviceBackend::reset`] resumes it
    /// (so does the end of a lease, which resets). Default: nothing (the borrower masks its
    /// vectors). `quiesce(false)` also ends a hand-over quiesce that stayed here (the
    /// migration failed): the VFIO backend then sets Bus Master Enable as it was.
    fn quiesce(&self, _stop: bool) -> Result<(), BackendError> {
        Ok(())
    }
    /// Quiesce for a hand-over to another borrower (the extension of
    /// [`DeviceBackend::quiesce`] that live migration needs): stops the device fetching new
    /// work, holds its interrupts as pending (delivered to the then current targets by
    /// `quiesce(false)`), lets the work already fetched complete and waits, at most
    /// `timeout`, until no DMA is in flight. Default: quiesce only, drain unconfirmed (for a
    /// backend that cannot observe its device's DMA). The VFIO backend confirms it through
    /// the device: Bus Master Enable cleared, PCI Express Transactions Pending polled.
    fn quiesce_handover(&self, timeout: std::time::Duration) -> Result<Drained, BackendError> {
        let _ = timeout;
        self.quiesce(true)?;
        Ok(Drained::default())
    }
    /// The device's counters over its whole life (monotonic; per-lease values are
    /// differences, see [`LeaseCounters::since`]). Default: what the IOMMU domain counts (no
    /// DMA bytes on VFIO), no doorbells or interrupts (the lender does not see them).
    fn counters(&self) -> LeaseCounters {
        let dom = self.domain();
        let (dma_bytes_read, dma_bytes_written) = dom.dma_bytes().unwrap_or((0, 0));
        LeaseCounters {
            dma_bytes_read,
            dma_bytes_written,
            iommu_faults: dom.fault_count(),
            ..LeaseCounters::default()
        }
    }
    /// Doorbells whose stores are only kicks right now (shadow doorbells); see
    /// [`crate::protocol::DoorbellKicks`]. Default: none.
    fn kick_doorbells(&self) -> DoorbellKicks {
        DoorbellKicks::default()
    }
    /// Generation of [`DeviceBackend::kick_doorbells`], cheap enough to poll.
    fn kick_generation(&self) -> u64 {
        0
    }
    /// Calls `listener` after every change of the kick-only doorbells (`None` removes it).
    fn set_kick_listener(&self, listener: Option<::emulated::KickListener>) {
        let _ = listener;
    }
    /// At the end of a lease, after the reset: moves the memory the lease exported (BAR
    /// windows, peer memory granted to other lenders) to fresh memory with the same
    /// contents, so whoever kept the old memory (a borrower's or a grantee's mapping, an fd
    /// it kept on shm) no longer reaches the device, and what the next lease does never
    /// shows there. Default: nothing (a VFIO BAR is the device's own memory, which a
    /// holder's mapping reaches only through a live IOMMU and window mapping).
    fn renew_exports(&self) -> Result<(), BackendError> {
        Ok(())
    }
    /// For an SR-IOV virtual function: the id (BDF) of its physical function. The inventory
    /// never lends a PF and any of its VFs at the same time (a PF reset takes its VFs away).
    /// Default: none.
    fn physical_function(&self) -> Option<String> {
        None
    }

    /// Whether a borrower's write of a Resizable BAR control register resizes the BAR
    /// (`config_write` applies it). When false, the config gate shows each resizable BAR
    /// offering only its current size and refuses any other. Default: false (a function
    /// bound to vfio-pci: the kernel's vfio-pci does not resize a bound function's BARs).
    fn resizes_bars(&self) -> bool {
        false
    }

    /// Puts back what a lease changed that a function reset keeps (a resizable BAR's
    /// size): called when a lease ends, after the reset. Default: nothing to put back.
    fn restore_defaults(&self) -> Result<(), BackendError> {
        Ok(())
    }
    /// How many virtual functions a reset of this function would take away: a hardware PF's
    /// enabled VFs (sysfs `sriov_numvfs`), read live at every acquire, since the PF's driver
    /// may enable VFs after the lender opened it. The inventory never lends a PF while this
    /// is non-zero ([`crate::inventory::InventoryError::PfWithVfs`]), nor while it cannot be
    /// read ([`SriovUnreadable`]: fails closed). Default: 0 (the emulated PF's VFs are
    /// independent functions that its reset leaves alone).
    fn vfs_sharing_reset(&self) -> Result<u32, SriovUnreadable> {
        Ok(0)
    }
}

/// Applies the lender's filter to a borrower's config write, then performs it (a one-off
/// [`config::ConfigGate`]; the server keeps one per lease).
pub fn filtered_config_write(
    backend: &dyn DeviceBackend,
    offset: u16,
    data: &[u8],
) -> Result<config::WriteOutcome, BackendError> {
    config::ConfigGate::new(backend.kind(), backend)?.write(backend, offset, data)
}

/// Walks the standard capability list of a config snapshot (bounded, loop-safe).
pub fn capabilities(config: &[u8]) -> Vec<CapDesc> {
    let mut out = Vec::new();
    let status = config.get(6).copied().unwrap_or(0);
    if status & 0x10 == 0 {
        return out;
    }
    let mut ptr = usize::from(config.get(0x34).copied().unwrap_or(0) & 0xfc);
    let mut seen = 0;
    while ptr >= 0x40 && ptr + 1 < config.len().min(256) && seen < 48 {
        out.push(CapDesc {
            id: u16::from(config[ptr]),
            offset: ptr as u16,
            extended: false,
        });
        ptr = usize::from(config[ptr + 1] & 0xfc);
        seen += 1;
    }
    // Extended capabilities (4 KiB config only).
    let mut ext = 0x100usize;
    seen = 0;
    while ext >= 0x100 && ext + 4 <= config.len() && seen < 128 {
        let h = u32::from_le_bytes([
            config[ext],
            config[ext + 1],
            config[ext + 2],
            config[ext + 3],
        ]);
        if h == 0 || h == u32::MAX {
            break;
        }
        // ID 0 is a null capability (a placeholder the lender's view puts at 0x100 when the
        // device's first capability is hidden): walked past, not listed.
        if h & 0xffff != 0 {
            out.push(CapDesc {
                id: (h & 0xffff) as u16,
                offset: ext as u16,
                extended: true,
            });
        }
        ext = (h >> 20) as usize & 0xffc;
        seen += 1;
    }
    out
}

/// Builds a [`DeviceInfo`] from its parts.
pub fn device_info(
    id: &str,
    kind: &str,
    config: Vec<u8>,
    bars: Vec<BarDesc>,
    irqs: IrqCounts,
    msix: Option<MsixDesc>,
) -> DeviceInfo {
    let caps = capabilities(&config);
    DeviceInfo {
        id: id.to_string(),
        kind: kind.to_string(),
        config,
        bars,
        caps,
        irqs,
        msix,
    }
}

/// A logger for the crate's unit tests that keeps every line at info and above, so tests can
/// check what was logged (and how often). Tests run in parallel: match on something unique
/// to the test (a device name, a path).
#[cfg(test)]
pub(crate) mod test_log {
    use std::sync::{Mutex, Once};

    struct Capture(Mutex<Vec<String>>);

    static LINES: Capture = Capture(Mutex::new(Vec::new()));
    static INIT: Once = Once::new();

    impl log::Log for Capture {
        fn enabled(&self, m: &log::Metadata<'_>) -> bool {
            m.level() <= log::Level::Info
        }
        fn log(&self, r: &log::Record<'_>) {
            if self.enabled(r.metadata()) {
                let line = format!("{} {}", r.level(), r.args());
                match self.0.lock() {
                    Ok(mut g) => g.push(line),
                    Err(p) => p.into_inner().push(line),
                }
            }
        }
        fn flush(&self) {}
    }

    /// Installs the capture (once per test binary; fails loudly if another logger is set).
    pub(crate) fn init() {
        INIT.call_once(|| {
            if let Err(e) = log::set_logger(&LINES) {
                panic!("test logger: {e}");
            }
            log::set_max_level(log::LevelFilter::Info);
        });
    }

    /// The captured lines that contain `needle`.
    pub(crate) fn lines_with(needle: &str) -> Vec<String> {
        let g = match LINES.0.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        g.iter().filter(|l| l.contains(needle)).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_walk_is_bounded_on_loops() {
        let mut c = vec![0u8; 256];
        c[6] = 0x10;
        c[0x34] = 0x40;
        c[0x40] = 0x01;
        c[0x41] = 0x50;
        c[0x50] = 0x11;
        c[0x51] = 0x40; // loop back
        let caps = capabilities(&c);
        assert!(caps.len() <= 48);
        assert_eq!(caps[0].id, 1);
        assert_eq!(caps[1].id, 0x11);
        // Extended list in a 4 KiB space.
        let mut c4 = c.clone();
        c4.resize(4096, 0);
        c4[0x100..0x104].copy_from_slice(&(0x0001_0001u32 | (0x140 << 20)).to_le_bytes());
        c4[0x140..0x144].copy_from_slice(&0x0001_0010u32.to_le_bytes());
        let ext: Vec<_> = capabilities(&c4)
            .into_iter()
            .filter(|c| c.extended)
            .collect();
        assert_eq!(ext.len(), 2);
        assert_eq!(ext[1].offset, 0x140);
    }
}
