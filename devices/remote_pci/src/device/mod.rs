//! `RemotePciDevice`: a device borrowed from a lender, presented as a guest PCI function.
//!
//! * **Config space**: a shadow built from the lender's snapshot. The header (BARs, ROM,
//!   interrupt line, cache line…) is owned by the VMM; of Command only
//!   [`FORWARDED_COMMAND_BITS`] are forwarded (the lender itself enables decoding and bus
//!   mastering of the real device); Status RW1C writes are forwarded and Status reads merge
//!   the lender's live bits. The MSI and MSI-X capabilities are emulated here and never
//!   forwarded. The PCIe capability is passed through, except Device Control's Initiate
//!   FLR (bit 15), which performs a function reset (lender `reset()`, DMA torn down, MSI/MSI-X
//!   reset); its Device Capabilities advertise FLR. Every other write is forwarded to the
//!   lender and the touched dword is read back into the shadow.
//! * **BARs**: allocated by the VMM. A guest BAR move takes effect only once the VMM's
//!   buses accepted it ([`PciDevice::move_bar`]); a refused one
//!   ([`PciDevice::bar_move_refused`]: over RAM, another BAR, platform MMIO) leaves the BAR
//!   decoding where it was placed last, whatever the register says. A `Direct` BAR (shm) is
//!   mapped as KVM memslots at the
//!   guest address while Memory Space is enabled (read-only when stores must be notified),
//!   minus the pages holding the MSI-X table/PBA, which stay trapped. Trapped accesses go to
//!   `MsixConfig`, to the window through the host pointer (stores: then the notify eventfd),
//!   or to the lender (`Trapped` BARs, and stores into a write-notified BAR outside its
//!   doorbell range: control registers take the device's exact `bar_write`).
//! * **DMA**: Bus Master Enable 0→1 takes a share of the VM's pin of guest RAM
//!   ([`DmaPinSource`]: pinned by the first device, shared by the rest) and asks the lender
//!   to map it at IOVA = GPA; 1→0, FLR, reset and drop unmap first, then drop the share (the
//!   last share unpins). A failed pin or map leaves
//!   the guest running with DMA unmapped, logs an error and sets Status *Received Master
//!   Abort* (what a requester sees when its DMA is refused), visible to the guest.
//! * **Interrupts**: MSI-X/MSI/INTx groups from the VMM's `InterruptManager`; the lender is
//!   told (`set_irqs`) to signal the group's irqfd eventfds of the active mode: MSI-X if
//!   enabled, else MSI if enabled, else INTx (with the resample eventfd).

mod rebar;

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, error, info, warn};
use pci::configuration::{
    cap_id, command, status, PciBarConfiguration, PciBarRegionType, PciConfiguration, COMMAND_REG,
};
use pci::device::{
    BarAllocation, BarMove, BarRequest, BarResize, ConfigWriteEffects, PciDevice, PciDeviceError,
    SharedBarAllocators,
};
use pci::interrupt::{InterruptError, InterruptManager, InterruptSourceGroup};
use pci::msi::{MsiConfig, MsiError};
use pci::msix::{MsixCap, MsixConfig, MsixError, MSIX_CTL_ENABLE, MSIX_CTL_FUNCTION_MASK};
use pci::vm_ops::{IoEventAddress, IoEventGuard, MemslotGuard, VmOps};
use pci::ConfigError;

use crate::link::{
    BarAccess, BarKind, DirectWindow, DmaMapping, IrqKind, IrqTargets, KickDoorbells, LeaseState,
    LenderCounters, LinkError, RemoteBar, RemoteDeviceInfo, RemoteDeviceLink,
};
use crate::observer::DeviceObserver;
use crate::p2p::{P2pMember, P2pRouter};
use crate::pin::{DmaPin, DmaPinSource, MlockPinner, PinStats, Pinner, PrivatePins};

/// Granule of KVM memslots.
pub const PAGE_SIZE: u64 = 4096;
/// Direct BARs at least this large are mapped into the guest a chunk ([`LAZY_CHUNK`]) at a
/// time, at the first access into each chunk: that access traps, is served through the
/// window, and the chunk's memslots go in. A KVM memslot costs kernel memory and time in
/// proportion to its size (on this host's shadow MMU a 64 GiB slot took 130 ms and 160 MiB of
/// vmalloc'ed rmap, a 256 GiB one 865 ms and 643 MiB), and most of a GPU's aperture is never
/// touched: attaching, moving or removing such a BAR then costs what the guest used of it.
pub const LAZY_BAR_MIN: u64 = 1 << 30;
/// The chunk of a lazily mapped BAR (see [`LAZY_BAR_MIN`]).
pub const LAZY_CHUNK: u64 = 1 << 30;
/// Command bits the guest may change on the real device.
pub const FORWARDED_COMMAND_BITS: u16 =
    command::PARITY_ERROR_RESPONSE | command::SERR_ENABLE | command::INTX_DISABLE;
/// Status bits read live from the lender.
const REMOTE_STATUS_BITS: u16 = status::INTERRUPT | status::RW1C;
/// PCIe capability: Device Capabilities (offset) and its FLR Capable bit.
const PCIE_DEVCAP: usize = 4;
const PCIE_DEVCAP_FLR: u32 = 1 << 28;
/// PCIe capability: Device Control (offset) and Initiate Function Level Reset.
const PCIE_DEVCTL: usize = 8;
const PCIE_DEVCTL_FLR: u16 = 1 << 15;
/// Number of standard header registers (owned by the VMM).
const HEADER_REGS: usize = 16;
const MSIX_CAP_LEN: usize = 12;

/// Errors of building the device.
#[derive(Debug, thiserror::Error)]
pub enum RemotePciError {
    #[error("config snapshot of the lender's device {device}: {source}")]
    Snapshot {
        device: String,
        #[source]
        source: ConfigError,
    },
    #[error("bar {index} of {device}: {reason}")]
    Bar {
        device: String,
        index: u8,
        reason: String,
    },
    #[error("msi-x of {device}: {source}")]
    Msix {
        device: String,
        #[source]
        source: MsixError,
    },
    #[error("msi of {device}: {source}")]
    Msi {
        device: String,
        #[source]
        source: MsiError,
    },
    #[error("interrupt group for {device}: {source}")]
    Interrupt {
        device: String,
        #[source]
        source: InterruptError,
    },
}

/// What the device manager passes when it creates the device.
#[derive(Clone)]
pub struct RemotePciDeviceParams {
    /// API id of the device (`vm.add-remote-device`'s id).
    pub id: String,
    /// Requester id (bus << 8 | devfn) for MSI routes.
    pub devid: u32,
    /// IOAPIC pin for INTx, if the slot has one (ignored when the device has no pin).
    pub intx_irq: Option<u32>,
    /// How guest RAM is pinned on Bus Master Enable ([`MlockPinner`] by default) when
    /// `dma_pins` is not given: then the device pins RAM for itself alone.
    pub pinner: Arc<dyn Pinner>,
    /// The VM's shared pin of guest RAM (its DMA manager): every device with Bus Master
    /// Enable set holds one share of it, so RAM is pinned once per VM. Overrides `pinner`.
    pub dma_pins: Option<Arc<dyn DmaPinSource>>,
    /// Told when DMA is mapped and unmapped (the VMM's event stream).
    pub observer: Option<Arc<dyn DeviceObserver>>,
    /// The VM's peer-to-peer table: with it, devices of one lender reach each other's BARs
    /// by DMA ([`crate::p2p`]); without, DMA to a peer's BAR faults on the lender.
    pub p2p: Option<Arc<P2pRouter>>,
}

impl RemotePciDeviceParams {
    pub fn new(id: impl Into<String>, devid: u32, intx_irq: Option<u32>) -> Self {
        Self {
            id: id.into(),
            devid,
            intx_irq,
            pinner: Arc::new(MlockPinner),
            dma_pins: None,
            observer: None,
            p2p: None,
        }
    }
}

/// Counters and state for `vm.info` and leak checks.
#[derive(Clone, Debug, PartialEq)]
pub struct RemoteDeviceStatus {
    pub id: String,
    /// The lender's id of the device.
    pub remote_id: String,
    pub lease: LeaseState,
    pub memory_enabled: bool,
    pub bus_master: bool,
    pub dma_mapped: bool,
    pub dma_bytes: u64,
    pub pinned_bytes: u64,
    pub pinned_ranges: usize,
    pub last_pin: Option<PinStats>,
    /// DMA mappings made / failed since creation.
    pub dma_maps: u64,
    pub dma_map_failures: u64,
    pub memslots: usize,
    pub ioevents: usize,
    /// Interrupt mode the lender was told to use.
    pub irq_mode: Option<IrqKind>,
    pub msix_enabled: bool,
    pub msi_enabled: bool,
    /// Interrupts per vector, when the link relays them.
    pub irq_counts: Option<Vec<u64>>,
    /// Function resets (FLR + device resets).
    pub resets: u64,
    /// Bus Master Enable changes (0→1 and 1→0) the guest made.
    pub bme_transitions: u64,
    /// Time guest RAM has been pinned for this device, the current pin included.
    pub pinned_time: Duration,
    /// Whether the VMM quiesced the device (`vm.pause`).
    pub quiesced: bool,
}

/// Per-device data-path counters, updated on the vCPU path (relaxed atomics) and readable
/// from any thread through [`RemotePciDevice::counters_handle`] without the device lock.
#[derive(Debug, Default)]
pub struct DeviceCounters {
    /// BAR reads that exited to the VMM (trapped BARs, MSI-X pages, read-only windows
    /// never exit on reads).
    pub trapped_reads: AtomicU64,
    /// BAR writes that exited to the VMM (control registers, doorbells without an
    /// ioeventfd or writable mapping, MSI-X table).
    pub trapped_writes: AtomicU64,
    /// Doorbell kicks the VMM signalled itself (store + notify on the exact path).
    pub kicks: AtomicU64,
    /// KVM ioeventfds registered for the device right now (kick-only doorbells and the
    /// link's static ones).
    pub ioeventfds: AtomicU64,
    /// MSI-X messages the VMM refused to route (not an x86 interrupt; see
    /// `pci::msix::msi_message_valid`).
    pub msix_refused: AtomicU64,
    /// Plain MSI messages the VMM refused to route (same rule as MSI-X).
    pub msi_refused: AtomicU64,
    /// Guest BAR moves the VMM refused (over RAM, another BAR, platform MMIO or outside
    /// the PCI windows): the BAR stayed where it was.
    pub bar_moves_refused: AtomicU64,
    /// Function level resets the guest asked for.
    pub flrs: AtomicU64,
    /// Config writes the lender refused (its filter: identity, BARs, capabilities it owns).
    pub config_writes_refused: AtomicU64,
}

/// A snapshot of [`DeviceCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceCountersSnapshot {
    pub trapped_reads: u64,
    pub trapped_writes: u64,
    pub kicks: u64,
    pub ioeventfds: u64,
    pub msix_refused: u64,
    pub msi_refused: u64,
    pub bar_moves_refused: u64,
    pub flrs: u64,
    pub config_writes_refused: u64,
}

impl DeviceCounters {
    pub fn snapshot(&self) -> DeviceCountersSnapshot {
        DeviceCountersSnapshot {
            trapped_reads: self.trapped_reads.load(Ordering::Relaxed),
            trapped_writes: self.trapped_writes.load(Ordering::Relaxed),
            kicks: self.kicks.load(Ordering::Relaxed),
            ioeventfds: self.ioeventfds.load(Ordering::Relaxed),
            msix_refused: self.msix_refused.load(Ordering::Relaxed),
            msi_refused: self.msi_refused.load(Ordering::Relaxed),
            bar_moves_refused: self.bar_moves_refused.load(Ordering::Relaxed),
            flrs: self.flrs.load(Ordering::Relaxed),
            config_writes_refused: self.config_writes_refused.load(Ordering::Relaxed),
        }
    }
}

/// The kick-only doorbells applied as KVM ioeventfds (see [`KickDoorbells`]).
#[derive(Default)]
struct KickState {
    /// What the link reported last (generation applied).
    doorbells: KickDoorbells,
    /// (BAR offset, guard) per registered doorbell; dropping a guard unregisters it. Bound:
    /// the lender's report, at most `lending::protocol::MAX_KICKS` (decoding refuses more).
    guards: Vec<(u64, IoEventGuard)>,
    log: LogLimit,
}

/// At most one log line per second; counts what it held back.
#[derive(Default)]
struct LogLimit {
    last: Option<std::time::Instant>,
    suppressed: u64,
}

impl LogLimit {
    /// `Some(lines held back since the last one)` when a line may be logged now.
    fn allow(&mut self) -> Option<u64> {
        let now = std::time::Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < std::time::Duration::from_secs(1))
        {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

struct BarState {
    remote: RemoteBar,
    region_type: PciBarRegionType,
    /// Guest address the VMM's buses accepted for the BAR (0 before allocation). It differs
    /// from the BAR register after a refused move: the BAR keeps decoding here.
    placed: u64,
    /// Guest address the memslots/ioevents are installed at.
    mapped_at: Option<u64>,
    slots: Vec<MemslotGuard>,
    ioevents: Vec<IoEventGuard>,
    /// A lazily mapped BAR ([`LAZY_BAR_MIN`]): its pieces (start, end, read-only), mapped a
    /// chunk at a time, and the chunks mapped so far (indexes). Empty when mapped whole.
    lazy_pieces: Vec<(u64, u64, bool)>,
    lazy_chunks: std::collections::BTreeSet<u64>,
}

struct MsixState {
    cap: MsixCap,
    offset: usize,
    config: MsixConfig,
}

struct DmaState {
    // Field order is drop order: the lender unmaps before the share of the pin goes.
    mapping: Box<dyn DmaMapping>,
    pin: DmaPin,
    ranges: usize,
    since: Instant,
}

#[derive(Default)]
struct Counters {
    dma_maps: u64,
    dma_map_failures: u64,
    resets: u64,
    last_pin: Option<PinStats>,
    bme_transitions: u64,
    pinned_time: Duration,
}

/// A borrowed PCI function (see the module docs).
pub struct RemotePciDevice {
    id: String,
    remote_id: String,
    config: PciConfiguration,
    bars: Vec<BarState>,
    /// The BARs' address reservations: freed when the device is dropped.
    bar_allocs: Vec<BarAllocation>,
    msix: Option<MsixState>,
    msi: Option<MsiConfig>,
    msi_cap: Option<(usize, usize)>,
    /// The MSI group (`MsiConfig` keeps its own reference private).
    msi_group: Option<Arc<dyn InterruptSourceGroup>>,
    intx: Option<Arc<dyn InterruptSourceGroup>>,
    pcie_cap: Option<usize>,
    /// (mode, vectors) the lender was last told.
    wired: Option<(IrqKind, usize)>,
    dma: Option<DmaState>,
    counters: Counters,
    io_counters: Arc<DeviceCounters>,
    kicks: KickState,
    /// Function resets are guest-triggerable in a loop (FLR storms): logged rate-limited.
    reset_log: LogLimit,
    /// Refused config writes: the same.
    config_log: LogLimit,
    dma_pins: Arc<dyn DmaPinSource>,
    observer: Option<Arc<dyn DeviceObserver>>,
    quiesced: bool,
    /// Membership in the VM's P2P router (dropped before the link: peers stop reaching the
    /// BARs before the lease is returned).
    p2p: Option<P2pMember>,
    /// BARs a peer may map (lender memory behind them).
    p2p_bars: Vec<u8>,
    /// BARs whose move the guest wrote and the VMM has not applied or refused yet: their
    /// peer mappings are withdrawn until then.
    p2p_moving: Vec<usize>,
    vm: Arc<dyn VmOps>,
    /// Dropped last: returns the lease.
    link: Box<dyn RemoteDeviceLink>,
}

fn msi_cap_len(ctl: u16) -> usize {
    let base = if ctl & pci::msi::MSI_CTL_64_BIT != 0 {
        14
    } else {
        10
    };
    if ctl & pci::msi::MSI_CTL_PER_VECTOR_MASK != 0 {
        base + 10
    } else {
        base
    }
}

fn overlaps(a: usize, alen: usize, b: usize, blen: usize) -> bool {
    a < b + blen && b < a + alen
}

/// Page-aligned `[start, end)` covering `[off, off+len)`.
fn page_span(off: u64, len: u64) -> (u64, u64) {
    (
        off & !(PAGE_SIZE - 1),
        (off + len).div_ceil(PAGE_SIZE) * PAGE_SIZE,
    )
}

/// `[0, size)` minus the `holes`, as sorted non-empty ranges.
/// Splits `[start, end)` (page aligned) of a window into runs of pages with the same
/// mapping: `(start, end, readonly)`.
fn split_writable(w: &DirectWindow, start: u64, end: u64) -> Vec<(u64, u64, bool)> {
    let mut out: Vec<(u64, u64, bool)> = Vec::new();
    let mut p = start;
    while p < end {
        let ro = !w.page_writable(p, PAGE_SIZE);
        match out.last_mut() {
            Some(last) if last.2 == ro && last.1 == p => last.1 = p + PAGE_SIZE,
            _ => out.push((p, p + PAGE_SIZE, ro)),
        }
        p += PAGE_SIZE;
    }
    out
}

fn subtract(size: u64, holes: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut holes: Vec<(u64, u64)> = holes.to_vec();
    holes.sort_unstable();
    let mut out = Vec::new();
    let mut cur = 0;
    for (s, e) in holes {
        let s = s.min(size);
        if s > cur {
            out.push((cur, s));
        }
        cur = cur.max(e.min(size));
    }
    if cur < size {
        out.push((cur, size));
    }
    out
}

fn window_read(w: &DirectWindow, offset: u64, data: &mut [u8]) -> bool {
    let len = data.len() as u64;
    if offset.checked_add(len).is_none_or(|end| end > w.len()) {
        return false;
    }
    let p = (w.host_addr() + offset) as *const u8;
    // SAFETY: `DirectWindow::new`'s contract: the range is mapped while the link lives,
    // and the link outlives `self`; bounds checked above. Natural-width volatile accesses
    // when aligned so device registers see one access.
    unsafe {
        match data.len() {
            1 => data[0] = std::ptr::read_volatile(p),
            2 if (p as usize).is_multiple_of(2) => {
                data.copy_from_slice(&std::ptr::read_volatile(p as *const u16).to_le_bytes())
            }
            4 if (p as usize).is_multiple_of(4) => {
                data.copy_from_slice(&std::ptr::read_volatile(p as *const u32).to_le_bytes())
            }
            8 if (p as usize).is_multiple_of(8) => {
                data.copy_from_slice(&std::ptr::read_volatile(p as *const u64).to_le_bytes())
            }
            _ => {
                for (i, b) in data.iter_mut().enumerate() {
                    *b = std::ptr::read_volatile(p.add(i));
                }
            }
        }
    }
    true
}

fn window_write(w: &DirectWindow, offset: u64, data: &[u8]) -> bool {
    let len = data.len() as u64;
    if offset.checked_add(len).is_none_or(|end| end > w.len()) {
        return false;
    }
    let p = (w.host_addr() + offset) as *mut u8;
    // SAFETY: as in `window_read`.
    unsafe {
        match data.len() {
            1 => std::ptr::write_volatile(p, data[0]),
            2 if (p as usize).is_multiple_of(2) => {
                std::ptr::write_volatile(p as *mut u16, u16::from_le_bytes([data[0], data[1]]))
            }
            4 if (p as usize).is_multiple_of(4) => std::ptr::write_volatile(
                p as *mut u32,
                u32::from_le_bytes([data[0], data[1], data[2], data[3]]),
            ),
            8 if (p as usize).is_multiple_of(8) => {
                let mut b = [0u8; 8];
                b.copy_from_slice(data);
                std::ptr::write_volatile(p as *mut u64, u64::from_le_bytes(b))
            }
            _ => {
                for (i, b) in data.iter().enumerate() {
                    std::ptr::write_volatile(p.add(i), *b);
                }
            }
        }
    }
    true
}

impl RemotePciDevice {
    /// Builds the guest function for the lender's device behind `link`.
    ///
    /// Creates the interrupt groups (MSI-X, MSI, INTx as the device has them) and wires INTx
    /// to the lender if the device has a pin and `params.intx_irq` is set. BARs get
    /// addresses in [`PciDevice::allocate_bars`].
    pub fn new(
        params: RemotePciDeviceParams,
        link: Box<dyn RemoteDeviceLink>,
        vm: Arc<dyn VmOps>,
        irqs: &dyn InterruptManager,
    ) -> Result<Self, RemotePciError> {
        let info: RemoteDeviceInfo = link.device_info();
        let dev = info.id.clone();
        let mut config = PciConfiguration::from_snapshot(&info.config).map_err(|source| {
            RemotePciError::Snapshot {
                device: dev.clone(),
                source,
            }
        })?;
        let bars = Self::check_bars(&dev, &info.bars)?;

        // MSI-X: emulated from the snapshot's capability (or the lender's description).
        let msix = match (config.find_capability(cap_id::MSIX), info.msix) {
            (Some(offset), _) => Some((MsixCap::from_config(&config, offset), offset)),
            (None, Some(m)) => {
                let cap = MsixCap::new(
                    m.vectors,
                    m.table_bar,
                    m.table_offset,
                    m.pba_bar,
                    m.pba_offset,
                )
                .map_err(|source| RemotePciError::Msix {
                    device: dev.clone(),
                    source,
                })?;
                let offset =
                    cap.add_to(&mut config)
                        .map_err(|source| RemotePciError::Snapshot {
                            device: dev.clone(),
                            source,
                        })?;
                Some((cap, offset))
            }
            (None, None) => None,
        };
        let msix = match msix {
            Some((cap, offset)) => {
                // Start disabled and unmasked; only Enable and Function Mask are writable.
                let ctl = cap.msg_ctl & !(MSIX_CTL_ENABLE | MSIX_CTL_FUNCTION_MASK);
                config.write_bytes_raw(offset + 2, &ctl.to_le_bytes());
                let reg = offset / 4;
                let w = config.writable_bits(reg)
                    | u32::from(MSIX_CTL_ENABLE | MSIX_CTL_FUNCTION_MASK) << 16;
                config.set_writable_bits(reg, w);
                let cap = MsixCap {
                    msg_ctl: ctl,
                    ..cap
                };
                let group =
                    irqs.create_msi_group(u32::from(cap.table_size()))
                        .map_err(|source| RemotePciError::Interrupt {
                            device: dev.clone(),
                            source,
                        })?;
                let mc =
                    MsixConfig::new(cap.table_size(), group, params.devid).map_err(|source| {
                        RemotePciError::Msix {
                            device: dev.clone(),
                            source,
                        }
                    })?;
                Some(MsixState {
                    cap,
                    offset,
                    config: mc,
                })
            }
            None => None,
        };

        let (msi, msi_cap, msi_group) = match config.find_capability(cap_id::MSI) {
            Some(offset) => {
                let ctl = u16::from_le_bytes([
                    config.read_byte(offset + 2),
                    config.read_byte(offset + 3),
                ]);
                let len = msi_cap_len(ctl);
                // Start disabled with nothing programmed (keep the read-only bits).
                let clean = ctl & !(pci::msi::MSI_CTL_ENABLE | 7 << pci::msi::MSI_CTL_MME_SHIFT);
                config.write_bytes_raw(offset + 2, &clean.to_le_bytes());
                config.write_bytes_raw(offset + 4, &vec![0u8; len - 4]);
                let vectors = 1u32 << ((ctl >> pci::msi::MSI_CTL_MMC_SHIFT) & 7).min(5);
                let group =
                    irqs.create_msi_group(vectors)
                        .map_err(|source| RemotePciError::Interrupt {
                            device: dev.clone(),
                            source,
                        })?;
                let m = MsiConfig::attach(&mut config, offset, group.clone(), params.devid)
                    .map_err(|source| RemotePciError::Msi {
                        device: dev.clone(),
                        source,
                    })?;
                (Some(m), Some((offset, len)), Some(group))
            }
            None => (None, None, None),
        };

        let intx =
            match (config.interrupt_pin(), params.intx_irq) {
                (1..=4, Some(irq)) => Some(irqs.create_intx_group(irq).map_err(|source| {
                    RemotePciError::Interrupt {
                        device: dev.clone(),
                        source,
                    }
                })?),
                _ => None,
            };

        let pcie_cap = config.find_capability(cap_id::PCI_EXPRESS);
        if let Some(off) = pcie_cap {
            // We implement FLR (as a lender reset), so advertise it.
            let reg = (off + PCIE_DEVCAP) / 4;
            let devcap = config.read_reg(reg) | PCIE_DEVCAP_FLR;
            config.write_bytes_raw(off + PCIE_DEVCAP, &devcap.to_le_bytes());
        }

        info!(
            "{}: remote device {} ({:04x}:{:04x}), {} bars, msi-x {}, msi {}, intx {}",
            params.id,
            dev,
            config.vendor_id(),
            config.device_id(),
            bars.len(),
            msix.as_ref().map_or("no".to_string(), |m| format!(
                "{} vectors",
                m.cap.table_size()
            )),
            msi.is_some(),
            intx.is_some()
        );
        let (p2p, p2p_bars) = match (&params.p2p, link.p2p_port()) {
            (Some(router), Some(port)) => {
                let bars = port.peer_bars();
                (Some(router.join(&params.id, port)), bars)
            }
            _ => (None, Vec::new()),
        };
        let mut d = Self {
            id: params.id,
            remote_id: dev,
            config,
            bars,
            bar_allocs: Vec::new(),
            msix,
            msi,
            msi_cap,
            msi_group,
            intx,
            pcie_cap,
            wired: None,
            dma: None,
            counters: Counters::default(),
            io_counters: Arc::default(),
            kicks: KickState::default(),
            reset_log: LogLimit::default(),
            config_log: LogLimit::default(),
            dma_pins: params
                .dma_pins
                .unwrap_or_else(|| Arc::new(PrivatePins(params.pinner))),
            observer: params.observer,
            quiesced: false,
            p2p,
            p2p_bars,
            p2p_moving: Vec::new(),
            vm,
            link,
        };
        d.sync_irqs();
        Ok(d)
    }

    fn check_bars(dev: &str, bars: &[RemoteBar]) -> Result<Vec<BarState>, RemotePciError> {
        let mut out: Vec<BarState> = Vec::new();
        for b in bars {
            let err = |reason: String| RemotePciError::Bar {
                device: dev.to_string(),
                index: b.index,
                reason,
            };
            let min = if b.kind == BarKind::Io { 4 } else { 16 };
            if !b.size.is_power_of_two() || b.size < min {
                return Err(err(format!(
                    "size {:#x} is not a power of two of at least {min:#x}",
                    b.size
                )));
            }
            let last = if b.kind == BarKind::Mem64 { 4 } else { 5 };
            if b.index > last {
                return Err(err(format!("index is above {last} for a {:?} bar", b.kind)));
            }
            let used = |i: u8| {
                out.iter().any(|o| {
                    o.remote.index == i
                        || (o.remote.kind == BarKind::Mem64 && o.remote.index + 1 == i)
                })
            };
            if used(b.index) || (b.kind == BarKind::Mem64 && used(b.index + 1)) {
                return Err(err("overlaps another bar".into()));
            }
            if let BarAccess::Direct(w) = &b.access {
                if w.len() < b.size {
                    return Err(err(format!(
                        "window of {:#x} bytes is smaller than the bar ({:#x})",
                        w.len(),
                        b.size
                    )));
                }
            }
            out.push(BarState {
                remote: b.clone(),
                region_type: match b.kind {
                    BarKind::Io => PciBarRegionType::Io,
                    BarKind::Mem32 => PciBarRegionType::Memory32,
                    BarKind::Mem64 => PciBarRegionType::Memory64,
                },
                placed: 0,
                mapped_at: None,
                slots: Vec::new(),
                ioevents: Vec::new(),
                lazy_pieces: Vec::new(),
                lazy_chunks: Default::default(),
            });
        }
        Ok(out)
    }

    /// The device's API id.
    pub fn device_id(&self) -> &str {
        &self.id
    }

    /// The shadow configuration space (for tests and debugging).
    pub fn configuration(&self) -> &PciConfiguration {
        &self.config
    }

    /// Current counters and state.
    pub fn status(&self) -> RemoteDeviceStatus {
        RemoteDeviceStatus {
            id: self.id.clone(),
            remote_id: self.remote_id.clone(),
            lease: self.link.lease_state(),
            memory_enabled: self.config.memory_enabled(),
            bus_master: self.config.bus_master_enabled(),
            dma_mapped: self.dma.is_some(),
            dma_bytes: self.dma.as_ref().map_or(0, |d| d.mapping.size()),
            pinned_bytes: self.dma.as_ref().map_or(0, |d| d.pin.bytes()),
            pinned_ranges: self.dma.as_ref().map_or(0, |d| d.ranges),
            last_pin: self.counters.last_pin,
            dma_maps: self.counters.dma_maps,
            dma_map_failures: self.counters.dma_map_failures,
            memslots: self.bars.iter().map(|b| b.slots.len()).sum(),
            ioevents: self.bars.iter().map(|b| b.ioevents.len()).sum::<usize>()
                + self.kicks.guards.len(),
            irq_mode: self.wired.map(|w| w.0),
            msix_enabled: self.msix.as_ref().is_some_and(|m| m.config.enabled()),
            msi_enabled: self.msi.as_ref().is_some_and(MsiConfig::enabled),
            irq_counts: self.link.irq_counts(),
            resets: self.counters.resets,
            bme_transitions: self.counters.bme_transitions,
            pinned_time: self.counters.pinned_time
                + self
                    .dma
                    .as_ref()
                    .map_or(Duration::ZERO, |d| d.since.elapsed()),
            quiesced: self.quiesced,
        }
    }

    /// What the lender counted for this lease (one round trip; call it off the vCPU threads).
    pub fn lender_counters(&self) -> Result<Option<LenderCounters>, LinkError> {
        self.link.lender_counters()
    }

    /// `vm.pause` (`stop`) / `vm.resume`: masks every MSI-X vector at the VMM (signals stay
    /// pending in the irqfds and are delivered on resume) and tells the lender to stop or
    /// restart a polling device. Idempotent.
    pub fn quiesce(&mut self, stop: bool) -> Result<(), LinkError> {
        if self.quiesced == stop {
            return Ok(());
        }
        if stop {
            if let Some(m) = &mut self.msix {
                m.config.set_host_masked(true);
            }
            self.link.quiesce(true)?;
        } else {
            // Lender first, so the device runs again before its pending vectors unmask.
            let r = self.link.quiesce(false);
            if let Some(m) = &mut self.msix {
                m.config.set_host_masked(false);
            }
            r?;
        }
        self.quiesced = stop;
        info!("{}: {}", self.id, if stop { "quiesced" } else { "resumed" });
        Ok(())
    }

    /// Migration hand-over (VM paused, device quiesced): the MSI-X vectors that cannot be
    /// delivered now (masked by the guest, or by the VMM for a paused VM) yet have an
    /// interrupt waiting — their PBA bit, or a signal in their irqfd's eventfd — taken from
    /// here for the destination ([`RemotePciDevice::set_msix_pending`]; also the way to put
    /// them back if the migration fails).
    pub fn take_undelivered_msix(&mut self) -> Vec<u32> {
        let Some(m) = &mut self.msix else {
            return Vec::new();
        };
        if !m.config.enabled() {
            return Vec::new();
        }
        let mut out = Vec::new();
        for v in 0..m.config.vectors() {
            if !m.config.is_vector_masked(v) {
                // Deliverable: KVM already took any signal into the vCPU's LAPIC.
                continue;
            }
            // A masked vector's irqfd is not attached to KVM: its signals wait in the
            // eventfd (non-blocking: `Err` when none).
            let signalled = m
                .config
                .group()
                .notifier(v as u32)
                .is_some_and(|fd| matches!(fd.read(), Ok(n) if n > 0));
            if signalled || m.config.is_pending(v) {
                out.push(v as u32);
            }
        }
        out
    }

    /// Marks MSI-X `vectors` as having an interrupt waiting: a masked vector's PBA bit is set
    /// (delivered when unmasked), a deliverable one is injected.
    pub fn set_msix_pending(&mut self, vectors: &[u32]) {
        if let Some(m) = &mut self.msix {
            for &v in vectors {
                m.config.trigger(v as usize);
            }
        }
    }

    /// The lease's live-migration side (`None`: this device cannot be handed over).
    pub fn migration(&self) -> Option<Arc<dyn crate::LeaseMigration>> {
        self.link.migration()
    }

    /// The cluster-directory claim revision the device is held under, if any.
    pub fn claim_revision(&self) -> Option<i64> {
        self.link.claim_revision()
    }

    /// Data-path counters: trapped BAR reads/writes, VMM-signalled kicks, ioeventfds.
    pub fn counters(&self) -> DeviceCountersSnapshot {
        self.io_counters.snapshot()
    }

    /// The live counters, readable without holding the device.
    pub fn counters_handle(&self) -> Arc<DeviceCounters> {
        Arc::clone(&self.io_counters)
    }

    /// Kick-only doorbell offsets currently registered as ioeventfds (BAR index, offsets).
    pub fn kick_ioeventfds(&self) -> (u8, Vec<u64>) {
        let offs = self.kicks.guards.iter().map(|(o, _)| *o).collect();
        (self.kicks.doorbells.bar, offs)
    }

    /// The MSI-X state (table, PBA), if the device has MSI-X.
    pub fn msix(&self) -> Option<&MsixConfig> {
        self.msix.as_ref().map(|m| &m.config)
    }

    /// Device-side MSI-X interrupt that came through the VMM (e.g. a relay without an
    /// eventfd): injected, or recorded in the PBA while masked.
    pub fn trigger_msix(&mut self, vector: usize) -> bool {
        self.msix.as_mut().is_some_and(|m| m.config.trigger(vector))
    }

    // ---- BARs -------------------------------------------------------------------------

    fn bar_index_at(&self, base: u64) -> Option<usize> {
        self.bars
            .iter()
            .position(|b| !self.bar_allocs.is_empty() && b.placed == base)
    }

    /// MSI-X pages (BAR offsets, page aligned) inside BAR `idx`.
    fn msix_holes(&self, idx: usize) -> Vec<(u64, u64)> {
        let Some(m) = &self.msix else {
            return Vec::new();
        };
        let mut holes = Vec::new();
        if m.cap.table_bir() == idx {
            holes.push(page_span(m.cap.table_offset(), m.cap.table_len()));
        }
        if m.cap.pba_bir() == idx {
            holes.push(page_span(m.cap.pba_offset(), m.cap.pba_len()));
        }
        holes
    }

    /// Where BAR `i` should decode now: the address the VMM placed it at (not what the
    /// guest last wrote: a refused move), if decoding is on.
    fn bar_want(&self, i: usize) -> Option<u64> {
        let decoded = match self.bars[i].region_type {
            PciBarRegionType::Io => self.config.io_enabled(),
            _ => self.config.memory_enabled(),
        };
        let addr = self.bars[i].placed;
        (!self.bar_allocs.is_empty() && decoded && addr != 0).then_some(addr)
    }

    /// Tells the P2P router where the device's peer-mappable BARs decode. `settled_only`:
    /// leave out BARs about to change (their peers' mappings go before the memslots do).
    fn sync_p2p(&self, settled_only: bool) {
        let Some(member) = &self.p2p else {
            return;
        };
        let bars = (0..self.bars.len())
            .filter(|&i| {
                let b = &self.bars[i];
                b.region_type != PciBarRegionType::Io
                    && self.p2p_bars.contains(&b.remote.index)
                    && !self.p2p_moving.contains(&usize::from(b.remote.index))
                    && (!settled_only || b.mapped_at == self.bar_want(i))
            })
            .filter_map(|i| {
                self.bars[i]
                    .mapped_at
                    .map(|a| (self.bars[i].remote.index, a))
            })
            .collect();
        member.set_bars(bars);
    }

    /// Brings memslots and ioeventfds in line with Command and the BAR addresses.
    fn sync_bar_mappings(&mut self) {
        let mut changed = false;
        self.sync_p2p(true);
        for i in 0..self.bars.len() {
            let idx = usize::from(self.bars[i].remote.index);
            let want = self.bar_want(i);
            if self.bars[i].mapped_at == want {
                continue;
            }
            changed = true;
            // Kick ioeventfds point into the BAR's old address: gone before it moves.
            self.kicks.guards.clear();
            let holes = self.msix_holes(idx);
            let vm = Arc::clone(&self.vm);
            let bar = &mut self.bars[i];
            if let Some(old) = bar.mapped_at.take() {
                debug!(
                    "{}: bar {idx} unmapped from {old:#x} ({} slots)",
                    self.id,
                    bar.slots.len()
                );
                bar.ioevents.clear();
                bar.slots.clear();
                bar.lazy_pieces.clear();
                bar.lazy_chunks.clear();
            }
            let Some(gpa) = want else {
                continue;
            };
            bar.mapped_at = Some(gpa);
            if let (BarAccess::Direct(w), false) =
                (&bar.remote.access, bar.region_type == PciBarRegionType::Io)
            {
                if bar.remote.size < PAGE_SIZE || !w.host_addr().is_multiple_of(PAGE_SIZE) {
                    debug!(
                        "{}: bar {idx} ({:#x} bytes) stays trapped (not page granular)",
                        self.id, bar.remote.size
                    );
                } else {
                    // Read-only (stores exit and are notified or made exact) except pages the
                    // device polls (writable: no exit at all) or windows needing no notify.
                    let pieces: Vec<(u64, u64, bool)> = subtract(bar.remote.size, &holes)
                        .into_iter()
                        .flat_map(|(start, end)| split_writable(w, start, end))
                        .collect();
                    let writable_pages = pieces
                        .iter()
                        .filter(|p| !p.2)
                        .map(|p| (p.1 - p.0) / PAGE_SIZE)
                        .sum::<u64>();
                    if bar.remote.size >= LAZY_BAR_MIN {
                        debug!(
                            "{}: bar {idx} ({:#x} bytes) at {gpa:#x} is mapped {:#x} bytes at a \
                             time, at first touch",
                            self.id, bar.remote.size, LAZY_CHUNK
                        );
                        bar.lazy_pieces = pieces;
                        continue;
                    }
                    for (start, end, readonly) in pieces {
                        match vm.map_guest_region(
                            gpa + start,
                            end - start,
                            w.host_addr() + start,
                            readonly,
                        ) {
                            Ok(slot) => bar.slots.push(slot),
                            Err(e) => {
                                error!(
                                    "{}: mapping bar {idx} at {:#x}+{:#x}: {e}; the bar stays trapped",
                                    self.id,
                                    gpa + start,
                                    end - start
                                );
                                bar.slots.clear();
                                break;
                            }
                        }
                    }
                    debug!(
                        "{}: bar {idx} mapped at {gpa:#x} in {} slots ({writable_pages} writable pages)",
                        self.id,
                        bar.slots.len(),
                    );
                }
            }
            for ev in &bar.remote.ioevents {
                let a = gpa + ev.offset;
                let addr = if bar.region_type == PciBarRegionType::Io {
                    IoEventAddress::Pio(a)
                } else {
                    IoEventAddress::Mmio(a)
                };
                match vm.register_ioevent(&ev.fd, addr, ev.datamatch) {
                    Ok(g) => bar.ioevents.push(g),
                    Err(e) => warn!(
                        "{}: ioeventfd at bar {idx}+{:#x}: {e}; writes stay trapped",
                        self.id, ev.offset
                    ),
                }
            }
        }
        if changed {
            self.register_kicks();
        }
        self.sync_p2p(false);
    }

    /// Applies the link's kick-only doorbells if their generation changed. Runs on the
    /// vCPU thread after every exact BAR write and reset (whose replies carry the new
    /// state: leaving shadow mode unregisters the ioeventfds before the guest's next
    /// doorbell store) and before trapped writes (picks up an asynchronous "on").
    fn sync_kicks(&mut self) {
        if self.link.kick_generation() == self.kicks.doorbells.generation {
            return;
        }
        let k = self.link.kick_doorbells();
        debug!(
            "{}: {} kick-only doorbells in bar {} (generation {})",
            self.id,
            k.offsets.len(),
            k.bar,
            k.generation
        );
        self.kicks.doorbells = k;
        self.register_kicks();
    }

    /// (Re)registers one ioeventfd per kick-only doorbell, wired to the BAR's notify eventfd
    /// (on shm, the lender's own doorbell eventfd: a guest store wakes the device with no
    /// VMM hop). Only doorbells of a mapped direct BAR with a notify eventfd, inside its
    /// doorbell range and outside the MSI-X pages qualify; the others keep the exact path.
    fn register_kicks(&mut self) {
        let had = self.kicks.guards.len();
        self.kicks.guards.clear();
        // Offsets the lender named that are no doorbells of the window; a registration error.
        let mut refused: Vec<u64> = Vec::new();
        let mut failed = None;
        let bar_idx = self.kicks.doorbells.bar;
        let holes = self.msix_holes(usize::from(bar_idx));
        if let Some(bar) = self.bars.iter().find(|b| b.remote.index == bar_idx) {
            if let (BarAccess::Direct(w), Some(gpa), false) = (
                &bar.remote.access,
                bar.mapped_at,
                bar.region_type == PciBarRegionType::Io,
            ) {
                if let (Some(n), Some(_)) = (w.write_notify(), w.doorbells()) {
                    for &off in &self.kicks.doorbells.offsets {
                        let inside = off.checked_add(4).is_some_and(|e| e <= bar.remote.size)
                            && w.store_is_direct(off, 4)
                            && !holes.iter().any(|&(s, e)| off + 4 > s && off < e);
                        // A writable (polled) page never exits: nothing for KVM to catch.
                        if inside && w.page_writable(off & !(PAGE_SIZE - 1), PAGE_SIZE) {
                            continue;
                        }
                        if !inside {
                            refused.push(off);
                            continue;
                        }
                        match self
                            .vm
                            .register_ioevent(n, IoEventAddress::Mmio(gpa + off), None)
                        {
                            Ok(g) => self.kicks.guards.push((off, g)),
                            Err(e) => {
                                failed = Some((off, e));
                                break;
                            }
                        }
                    }
                }
            }
        }
        self.io_counters.ioeventfds.store(
            (self.kicks.guards.len() + self.bars.iter().map(|b| b.ioevents.len()).sum::<usize>())
                as u64,
            Ordering::Relaxed,
        );
        // Driver set-up, resets and BAR moves change this: rare, but a guest can loop on it,
        // hence the rate limit.
        let now = self.kicks.guards.len();
        if now == had && refused.is_empty() && failed.is_none() {
            return;
        }
        let Some(suppressed) = self.kicks.log.allow() else {
            return;
        };
        let gen = self.kicks.doorbells.generation;
        info!(
            "{}: {now} doorbell ioeventfds (kick-only doorbells, generation {gen}; {had} before){}",
            self.id,
            if suppressed > 0 {
                format!("; {suppressed} changes not logged")
            } else {
                String::new()
            }
        );
        if !refused.is_empty() {
            warn!(
                "{}: kick-only doorbells {refused:#x?} of bar {bar_idx} are no doorbells of \
                 the window; they stay exact",
                self.id
            );
        }
        if let Some((off, e)) = failed {
            warn!(
                "{}: ioeventfd for doorbell bar {bar_idx}+{off:#x}: {e}; it and the rest stay \
                 exact",
                self.id
            );
        }
    }

    fn bar_access(&mut self, base: u64, offset: u64, read: Option<&mut [u8]>, write: &[u8]) {
        let is_write = read.is_none();
        if is_write {
            self.io_counters
                .trapped_writes
                .fetch_add(1, Ordering::Relaxed);
            self.sync_kicks();
        } else {
            self.io_counters
                .trapped_reads
                .fetch_add(1, Ordering::Relaxed);
        }
        self.bar_access_inner(base, offset, read, write);
        if is_write {
            // An exact write's reply may have changed the kick-only doorbells (CC.EN 1 -> 0
            // ends shadow doorbells): apply before the vCPU runs the guest again.
            self.sync_kicks();
        }
    }

    fn bar_access_inner(&mut self, base: u64, offset: u64, read: Option<&mut [u8]>, write: &[u8]) {
        let Some(i) = self.bar_index_at(base) else {
            debug!("{}: access to unknown bar at {base:#x}", self.id);
            if let Some(d) = read {
                d.fill(0xff);
            }
            return;
        };
        let idx = usize::from(self.bars[i].remote.index);
        if let Some(m) = &mut self.msix {
            if let Some(o) = m.cap.table_hit(idx, offset) {
                match read {
                    Some(d) => m.config.read_table(o, d),
                    None => {
                        m.config.write_table(o, write);
                        self.io_counters
                            .msix_refused
                            .store(m.config.refused_messages(), Ordering::Relaxed);
                    }
                }
                return;
            }
            if let Some(o) = m.cap.pba_hit(idx, offset) {
                match read {
                    Some(d) => m.config.read_pba(o, d),
                    None => m.config.write_pba(o, write),
                }
                return;
            }
        }
        let bar = &self.bars[i];
        let ok = match (&bar.remote.access, read) {
            (BarAccess::Direct(w), Some(d)) => {
                let ok = window_read(w, offset, d);
                if !ok {
                    d.fill(0xff);
                }
                ok
            }
            (BarAccess::Direct(w), None) if !w.store_is_direct(offset, write.len() as u64) => {
                // A control register: the device's exact write path on the lender (a
                // round trip; a store + notify would be lost if it left the value as is).
                if let Err(e) = self.link.bar_write(bar.remote.index, offset, write) {
                    warn!("{}: bar {idx} write at {offset:#x}: {e}", self.id);
                }
                true
            }
            (BarAccess::Direct(w), None) => {
                let ok = window_write(w, offset, write);
                if ok {
                    if let Some(n) = w.write_notify() {
                        self.io_counters.kicks.fetch_add(1, Ordering::Relaxed);
                        if let Err(e) = n.write(1) {
                            warn!("{}: bar {idx} write notify: {e}", self.id);
                        }
                    }
                }
                ok
            }
            (BarAccess::Trapped, Some(d)) => {
                match self.link.bar_read(bar.remote.index, offset, d) {
                    Ok(()) => true,
                    Err(e) => {
                        warn!("{}: bar {idx} read at {offset:#x}: {e}", self.id);
                        d.fill(0xff);
                        true
                    }
                }
            }
            (BarAccess::Trapped, None) => {
                if let Err(e) = self.link.bar_write(bar.remote.index, offset, write) {
                    warn!("{}: bar {idx} write at {offset:#x}: {e}", self.id);
                }
                true
            }
        };
        if !ok {
            debug!(
                "{}: bar {idx} access at {offset:#x} outside the window ignored",
                self.id
            );
        } else {
            self.map_lazy_chunk(i, offset);
        }
    }

    /// Maps the chunk of lazily mapped BAR `i` that holds `offset` (see [`LAZY_BAR_MIN`]),
    /// unless it is mapped already or the BAR is not lazy. A chunk that cannot be mapped
    /// stays trapped (served through the window, as now), and is not tried again.
    fn map_lazy_chunk(&mut self, i: usize, offset: u64) {
        let BarState {
            remote,
            mapped_at,
            slots,
            lazy_pieces,
            lazy_chunks,
            ..
        } = &mut self.bars[i];
        let (Some(gpa), BarAccess::Direct(w)) = (*mapped_at, &remote.access) else {
            return;
        };
        let chunk = offset / LAZY_CHUNK;
        if lazy_pieces.is_empty() || !lazy_chunks.insert(chunk) {
            return;
        }
        let (from, to) = (
            chunk * LAZY_CHUNK,
            ((chunk + 1) * LAZY_CHUNK).min(remote.size),
        );
        let before = slots.len();
        for &(start, end, readonly) in lazy_pieces.iter() {
            let (s, e) = (start.max(from), end.min(to));
            if s >= e {
                continue;
            }
            match self
                .vm
                .map_guest_region(gpa + s, e - s, w.host_addr() + s, readonly)
            {
                Ok(slot) => slots.push(slot),
                Err(e) => {
                    warn!(
                        "{}: mapping bar {} chunk {chunk} at {:#x}: {e}; it stays trapped",
                        self.id,
                        remote.index,
                        gpa + s
                    );
                    slots.truncate(before);
                    return;
                }
            }
        }
        debug!(
            "{}: bar {} chunk {chunk} ({from:#x}..{to:#x}) mapped at first touch ({} slots)",
            self.id,
            remote.index,
            slots.len() - before
        );
    }

    // ---- DMA --------------------------------------------------------------------------

    fn enable_dma(&mut self) {
        if self.dma.is_some() {
            return;
        }
        let t0 = Instant::now();
        let regions = self.vm.guest_ram_regions();
        let ranges: Vec<(u64, u64)> = regions.iter().map(|r| (r.host_addr, r.size)).collect();
        // The first device of the VM to master the bus pins guest RAM; later ones share it.
        let pin = match self.dma_pins.acquire(&ranges) {
            Ok(p) => p,
            Err(e) => {
                self.dma_failed(&format!("pinning guest ram: {e}"));
                return;
            }
        };
        if let Some(stats) = pin.fresh() {
            self.counters.last_pin = Some(stats);
        }
        let pinned_in = t0.elapsed();
        let t_map = Instant::now();
        match self.link.map_dma(&regions) {
            Ok(mapping) => {
                // The two costs of the first Bus Master Enable, which the vCPU waits for
                // (the pin bench's end-to-end rows read this line).
                info!(
                    "{}: dma enabled: {:#x} bytes of guest ram mapped at iova = gpa (pin {:.3} \
                     ms{}, lender map {:.3} ms)",
                    self.id,
                    mapping.size(),
                    pinned_in.as_secs_f64() * 1e3,
                    if pin.fresh().is_some() {
                        ""
                    } else {
                        ", shared"
                    },
                    t_map.elapsed().as_secs_f64() * 1e3
                );
                self.counters.dma_maps += 1;
                let bytes = mapping.size();
                let pinned = pin.bytes();
                self.dma = Some(DmaState {
                    mapping,
                    pin,
                    ranges: ranges.len(),
                    since: Instant::now(),
                });
                if let Some(o) = &self.observer {
                    o.dma_mapped(&self.id, bytes, pinned, t0.elapsed());
                }
                // Peers' BARs (any lender), at their guest addresses.
                if let Some(m) = &self.p2p {
                    m.set_master(true);
                }
            }
            Err(e) => {
                drop(pin);
                self.dma_failed(&format!("lender dma map: {e}"));
            }
        }
    }

    fn dma_failed(&mut self, why: &str) {
        error!(
            "{}: bus master enabled but dma is not mapped ({why}); device dma will be \
             refused, Status.ReceivedMasterAbort set",
            self.id
        );
        self.counters.dma_map_failures += 1;
        self.config.set_status_bits(status::RECEIVED_MASTER_ABORT);
    }

    /// Unmaps (peers' BARs, then RAM on the lender) then unpins.
    fn disable_dma(&mut self) {
        if let Some(m) = &self.p2p {
            m.set_master(false);
        }
        if let Some(DmaState {
            mapping,
            pin,
            since,
            ..
        }) = self.dma.take()
        {
            let t0 = Instant::now();
            let size = mapping.size();
            drop(mapping);
            // Unpins only if this was the last device of the VM with DMA enabled.
            drop(pin);
            self.counters.pinned_time += since.elapsed();
            if let Some(o) = &self.observer {
                o.dma_unmapped(&self.id, size, t0.elapsed());
            }
            info!(
                "{}: dma disabled ({size:#x} bytes unmapped and unpinned)",
                self.id
            );
        }
    }

    // ---- interrupts -------------------------------------------------------------------

    fn desired_irqs(&self) -> Option<(IrqKind, usize)> {
        if let Some(m) = self.msix.as_ref().filter(|m| m.config.enabled()) {
            return Some((IrqKind::Msix, m.config.vectors()));
        }
        if let Some(m) = self.msi.as_ref().filter(|m| m.enabled()) {
            return Some((IrqKind::Msi, m.enabled_vectors() as usize));
        }
        self.intx.as_ref().map(|_| (IrqKind::Intx, 1))
    }

    /// Tells the lender where interrupts go when the active mode changed.
    fn sync_irqs(&mut self) {
        let want = self.desired_irqs();
        if want == self.wired {
            return;
        }
        if let Some((kind, _)) = self.wired.take() {
            let t = IrqTargets {
                kind,
                triggers: Vec::new(),
                resample: None,
            };
            if let Err(e) = self.link.set_irqs(&t) {
                warn!("{}: disabling {kind} on the lender: {e}", self.id);
            }
        }
        let Some((kind, n)) = want else {
            return;
        };
        let group: Option<&Arc<dyn InterruptSourceGroup>> = match kind {
            IrqKind::Msix => self.msix.as_ref().map(|m| m.config.group()),
            IrqKind::Msi => self.msi_group.as_ref(),
            IrqKind::Intx => self.intx.as_ref(),
        };
        let Some(group) = group else {
            return;
        };
        let triggers: Vec<_> = (0..n as u32).filter_map(|v| group.notifier(v)).collect();
        let t = IrqTargets {
            kind,
            triggers,
            resample: if kind == IrqKind::Intx {
                group.resample_notifier(0)
            } else {
                None
            },
        };
        match self.link.set_irqs(&t) {
            Ok(()) => {
                debug!("{}: lender signals {n} {kind} eventfds", self.id);
                self.wired = Some((kind, n));
            }
            Err(e) => error!("{}: wiring {n} {kind} vectors on the lender: {e}", self.id),
        }
    }

    // ---- reset ------------------------------------------------------------------------

    /// Function reset: DMA torn down, MSI/MSI-X reset, Command cleared (memslots dropped),
    /// the lender resets the real device, interrupts rewired (INTx). Returns the Command
    /// change.
    fn function_reset(&mut self, why: &str) -> ConfigWriteEffects {
        if let Some(held) = self.reset_log.allow() {
            info!(
                "{}: function reset ({why}; {} so far{})",
                self.id,
                self.counters.resets + 1,
                if held > 0 {
                    format!(", {held} not logged")
                } else {
                    String::new()
                }
            );
        }
        self.counters.resets += 1;
        self.disable_dma();
        if let Some(m) = &mut self.msix {
            m.config.reset();
            let ctl = m.cap.msg_ctl & !(MSIX_CTL_ENABLE | MSIX_CTL_FUNCTION_MASK);
            self.config
                .write_bytes_raw(m.offset + 2, &ctl.to_le_bytes());
        }
        if let (Some(m), Some((off, len))) = (&mut self.msi, self.msi_cap) {
            let ctl = u16::from_le_bytes([
                self.config.read_byte(off + 2),
                self.config.read_byte(off + 3),
            ]);
            let clean = ctl & !(pci::msi::MSI_CTL_ENABLE | 7 << pci::msi::MSI_CTL_MME_SHIFT);
            self.config.write_bytes_raw(off + 2, &clean.to_le_bytes());
            self.config.write_bytes_raw(off + 4, &vec![0u8; len - 4]);
            m.handle_config_write(&mut self.config, off / 4, 0, len);
        }
        let effects = self.config.reset();
        self.sync_bar_mappings();
        if let Err(e) = self.link.reset() {
            error!("{}: lender reset: {e}", self.id);
        }
        // The reset ended any shadow doorbells: the reply said so.
        self.sync_kicks();
        self.sync_irqs();
        effects
    }

    // ---- config space -----------------------------------------------------------------

    /// A refused config write: a guest can repeat one in a loop, so it is counted and
    /// logged rate-limited.
    fn config_refused(&mut self, what: std::fmt::Arguments<'_>) {
        self.io_counters
            .config_writes_refused
            .fetch_add(1, Ordering::Relaxed);
        if let Some(held) = self.config_log.allow() {
            if held > 0 {
                warn!("{}: {what} ({held} more not logged)", self.id);
            } else {
                warn!("{}: {what}", self.id);
            }
        }
    }

    fn forward_and_refresh(&mut self, abs: usize, data: &[u8]) {
        let Ok(off) = u16::try_from(abs) else {
            return;
        };
        if let Err(e) = self.link.config_write(off, data) {
            self.config_refused(format_args!("config write at {abs:#x}: {e}"));
        }
        let dword = abs & !3;
        let mut b = [0u8; 4];
        match u16::try_from(dword)
            .map_err(|_| LinkError::BadReply {
                op: "config read",
                reason: "offset".into(),
            })
            .and_then(|o| self.link.config_read(o, &mut b))
        {
            Ok(()) => self.config.write_bytes_raw(dword, &b),
            Err(e) => warn!("{}: config read back at {dword:#x}: {e}", self.id),
        }
    }

    fn write_header(&mut self, reg_idx: usize, offset: u64, data: &[u8]) -> ConfigWriteEffects {
        let effects = self.config.write_config_register(reg_idx, offset, data);
        if reg_idx == COMMAND_REG {
            let start = offset as usize;
            let end = start + data.len();
            if start < 2 {
                // Command: forward the bits the guest may change on the real device.
                let cmd = self.config.command() & FORWARDED_COMMAND_BITS;
                if let Err(e) = self.link.config_write(4, &cmd.to_le_bytes()) {
                    warn!("{}: forwarding command {cmd:#x}: {e}", self.id);
                }
            }
            if end > 2 {
                // Status: write-1-to-clear on the real device too.
                let mut b = [0u8; 4];
                b[start..end].copy_from_slice(data);
                let st = u16::from_le_bytes([b[2], b[3]]) & status::RW1C;
                if st != 0 {
                    if let Err(e) = self.link.config_write(6, &st.to_le_bytes()) {
                        warn!("{}: forwarding status clear {st:#x}: {e}", self.id);
                    }
                }
            }
        }
        effects
    }

    fn react_to_effects(&mut self, effects: &ConfigWriteEffects) {
        if let Some(c) = effects.command {
            if let Some(on) = c.bus_master() {
                self.counters.bme_transitions += 1;
                if on {
                    self.enable_dma();
                } else {
                    self.disable_dma();
                }
            }
        }
        if !effects.bar_moves.is_empty() && self.p2p.is_some() {
            // The guest wrote a new BAR address: peers stop reaching the old one now, before
            // the VMM moves the bus range; `move_bar` or `bar_move_refused` publishes again.
            self.p2p_moving
                .extend(effects.bar_moves.iter().map(|m| m.bar_idx));
            self.sync_p2p(false);
        }
        if effects.command.is_some() || !effects.bar_moves.is_empty() {
            self.sync_bar_mappings();
        }
    }
}

impl PciDevice for RemotePciDevice {
    fn id(&self) -> Option<String> {
        Some(self.id.clone())
    }

    fn allocate_bars(
        &mut self,
        allocators: &SharedBarAllocators,
    ) -> Result<Vec<PciBarConfiguration>, PciDeviceError> {
        if !self.bar_allocs.is_empty() {
            return Err(PciDeviceError::Device(format!(
                "{}: bars already allocated",
                self.id
            )));
        }
        let requests: Vec<BarRequest> = self
            .bars
            .iter()
            .map(|b| BarRequest {
                idx: usize::from(b.remote.index),
                size: b.remote.size,
                region_type: b.region_type,
                prefetchable: b.remote.prefetchable,
            })
            .collect();
        // On any error below `done` is dropped, which frees what was reserved.
        let done = BarAllocation::allocate_all(allocators, &requests)?;
        let configs: Vec<PciBarConfiguration> = done.iter().map(BarAllocation::config).collect();
        for (i, bar) in configs.iter().enumerate() {
            if let Err(e) = self.config.add_pci_bar(bar) {
                for b in &configs[..i] {
                    self.config.remove_pci_bar(b.idx);
                }
                return Err(e.into());
            }
        }
        for b in &configs {
            debug!(
                "{}: bar {} at {:#x} ({:#x} bytes, {:?})",
                self.id, b.idx, b.addr, b.size, b.region_type
            );
            if let Some(s) = self
                .bars
                .iter_mut()
                .find(|s| usize::from(s.remote.index) == b.idx)
            {
                s.placed = b.addr;
            }
        }
        self.bar_allocs = done;
        Ok(configs)
    }

    fn bar_allocations(&mut self) -> &mut [BarAllocation] {
        &mut self.bar_allocs
    }

    fn read_config_register(&mut self, reg_idx: usize) -> u32 {
        let v = self.config.read_reg(reg_idx);
        if reg_idx != COMMAND_REG {
            return v;
        }
        let mut b = [0u8; 2];
        match self.link.config_read(6, &mut b) {
            Ok(()) => {
                let remote = u16::from_le_bytes(b) & REMOTE_STATUS_BITS;
                v | u32::from(remote) << 16
            }
            Err(e) => {
                debug!("{}: status read from the lender: {e}", self.id);
                v
            }
        }
    }

    fn write_config_register(
        &mut self,
        reg_idx: usize,
        offset: u64,
        data: &[u8],
    ) -> ConfigWriteEffects {
        if !matches!(data.len(), 1 | 2 | 4) || offset as usize + data.len() > 4 {
            warn!(
                "{}: config write of {} bytes at register {reg_idx} offset {offset} ignored",
                self.id,
                data.len()
            );
            return ConfigWriteEffects::default();
        }
        let abs = reg_idx * 4 + offset as usize;
        let dword = reg_idx * 4;
        let mut effects = ConfigWriteEffects::default();
        if reg_idx < HEADER_REGS {
            effects = self.write_header(reg_idx, offset, data);
        } else if let Some(m) = self
            .msix
            .as_mut()
            .filter(|m| overlaps(dword, 4, m.offset, MSIX_CAP_LEN))
        {
            self.config.write_config_register(reg_idx, offset, data);
            m.config
                .handle_config_write(&self.config, m.offset, reg_idx, offset, data.len());
            self.io_counters
                .msix_refused
                .store(m.config.refused_messages(), Ordering::Relaxed);
            self.sync_irqs();
        } else if let (Some(m), Some((off, len))) = (self.msi.as_mut(), self.msi_cap) {
            if overlaps(dword, 4, off, len) {
                self.config.write_config_register(reg_idx, offset, data);
                m.handle_config_write(&mut self.config, reg_idx, offset, data.len());
                self.io_counters
                    .msi_refused
                    .store(m.refused_messages(), Ordering::Relaxed);
                self.sync_irqs();
            } else {
                effects = self.write_forwarded(abs, data);
            }
        } else {
            effects = self.write_forwarded(abs, data);
        }
        self.react_to_effects(&effects);
        effects
    }

    fn read_bar(&mut self, base: u64, offset: u64, data: &mut [u8]) {
        self.bar_access(base, offset, Some(data), &[]);
    }

    fn write_bar(&mut self, base: u64, offset: u64, data: &[u8]) {
        self.bar_access(base, offset, None, data);
    }

    fn move_bar(&mut self, old_base: u64, new_base: u64) -> Result<(), PciDeviceError> {
        debug!("{}: bar moved {old_base:#x} -> {new_base:#x}", self.id);
        // The VMM moved the bus range: the BAR whose register now holds `new_base` (and is
        // not already there) decodes at it.
        for i in 0..self.bars.len() {
            let idx = usize::from(self.bars[i].remote.index);
            let committed = self.config.bar(idx).map_or(0, |b| b.addr);
            if committed == new_base && self.bars[i].placed != new_base {
                self.bars[i].placed = new_base;
                break;
            }
        }
        // The write's move is applied (the bus calls this or `bar_move_refused` for every
        // move of a config write, under the device's lock), also when the BAR was already
        // placed at `new_base` (a register written back after a refused move).
        self.p2p_moving.clear();
        self.sync_bar_mappings();
        Ok(())
    }

    fn bar_move_refused(&mut self, mv: &BarMove) {
        // Nothing moves: the BAR's memslots and bus range stay at its placed address.
        self.io_counters
            .bar_moves_refused
            .fetch_add(1, Ordering::Relaxed);
        self.p2p_moving.clear();
        self.sync_p2p(false);
        debug!(
            "{}: bar {} stays at its placed address; {:#x} refused",
            self.id, mv.bar_idx, mv.new
        );
    }

    fn bar_resized(&mut self, rs: &BarResize, base: u64) {
        self.rebar_applied(rs, base);
    }

    fn bar_resize_refused(&mut self, rs: &BarResize, why: &PciDeviceError) {
        self.rebar_refused(rs, why);
    }

    fn reset(&mut self) -> Result<(), PciDeviceError> {
        let effects = self.function_reset("device reset");
        self.react_to_effects(&effects);
        Ok(())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl RemotePciDevice {
    /// A write outside the header and the emulated capabilities: FLR is handled here,
    /// everything else goes to the lender.
    fn write_forwarded(&mut self, abs: usize, data: &[u8]) -> ConfigWriteEffects {
        if let Some(bar_resizes) = self.rebar_write(abs, data) {
            return ConfigWriteEffects {
                bar_resizes,
                ..ConfigWriteEffects::default()
            };
        }
        if let Some(cap) = self.pcie_cap {
            let ctl = cap + PCIE_DEVCTL;
            // Byte holding bit 15 of Device Control.
            let hi = ctl + 1;
            if (abs..abs + data.len()).contains(&hi) && data[hi - abs] & 0x80 != 0 {
                let mut d = data.to_vec();
                d[hi - abs] &= !((PCIE_DEVCTL_FLR >> 8) as u8);
                self.forward_and_refresh(abs, &d);
                self.io_counters.flrs.fetch_add(1, Ordering::Relaxed);
                return self.function_reset("guest flr");
            }
        }
        self.forward_and_refresh(abs, data);
        ConfigWriteEffects::default()
    }
}

impl Drop for RemotePciDevice {
    fn drop(&mut self) {
        // DMA mapping (peers' BARs first), then pins.
        self.disable_dma();
        // Then peers stop reaching our BARs, before the lease is returned.
        self.p2p = None;
        // The lender stops signalling our eventfds, then the groups (GSIs, irqfds) go.
        if let Some((kind, _)) = self.wired.take() {
            let t = IrqTargets {
                kind,
                triggers: Vec::new(),
                resample: None,
            };
            if let Err(e) = self.link.set_irqs(&t) {
                debug!("{}: disabling {kind} on the lender: {e}", self.id);
            }
        }
        self.msix = None;
        self.msi = None;
        self.msi_group = None;
        self.intx = None;
        // Memslots and ioeventfds (before the link unmaps the windows they point into).
        self.kicks.guards.clear();
        self.io_counters.ioeventfds.store(0, Ordering::Relaxed);
        for b in &mut self.bars {
            b.ioevents.clear();
            b.slots.clear();
            b.mapped_at = None;
        }
        let c = self.io_counters.snapshot();
        info!(
            "{}: released; returning {} (trapped reads {}, trapped writes {}, vmm kicks {})",
            self.id, self.remote_id, c.trapped_reads, c.trapped_writes, c.kicks
        );
        // `link` is dropped after this: the lease is returned.
    }
}
