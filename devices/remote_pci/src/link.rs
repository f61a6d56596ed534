//! The seam between [`RemotePciDevice`](crate::RemotePciDevice) and whatever reaches the
//! lender: the [`RemoteDeviceLink`] trait and the plain data it describes a device with.
//!
//! `lending_link::LendingLink` implements it over `lending::client`; the unit tests use a
//! fake. Keeping the device model behind this trait means protocol changes touch only the
//! adapter.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use pci::vm_ops::GuestRamRegion;
use vmm_sys_util::eventfd::EventFd;

/// Errors reported by a link.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The lender refused or failed the request.
    #[error("lender refused {op}: {message}")]
    Remote { op: &'static str, message: String },
    /// The link to the lender is down.
    #[error("link to the lender is down: {0}")]
    Down(String),
    /// The request is not possible on this link (e.g. fd passing on tcp).
    #[error("{op} is not supported by this link: {reason}")]
    Unsupported { op: &'static str, reason: String },
    /// The lender's answer did not make sense.
    #[error("bad answer to {op}: {reason}")]
    BadReply { op: &'static str, reason: String },
}

/// Address space and width of a BAR.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarKind {
    Io,
    Mem32,
    Mem64,
}

/// A lender BAR window mapped into this process (shm fabric).
///
/// Built with the `unsafe` [`DirectWindow::new`]: the link guarantees the host range stays
/// mapped (readable and writable) for as long as the link value lives. The device drops
/// all memslots that point into it before it drops the link.
///
/// How guest stores reach the device is per BAR:
///
/// * no `write_notify`: the device sees stores by itself; the BAR is mapped read-write.
/// * `write_notify` alone: the BAR is mapped read-only; every store exits to the VMM, which
///   stores the value into the window and signals the eventfd (the device diffs its
///   registers, so a store that does not change a value is lost: only right for devices
///   whose every register is a doorbell).
/// * `write_notify` [with doorbells](DirectWindow::with_doorbells): read-only too; stores
///   entirely inside the doorbell range are stored + notified, every other store (control
///   registers) goes to [`RemoteDeviceLink::bar_write`], the device's exact write path.
#[derive(Clone)]
pub struct DirectWindow {
    host_addr: u64,
    len: u64,
    write_notify: Option<Arc<EventFd>>,
    /// `[offset, offset + len)` of the doorbells, when stores elsewhere must be exact.
    doorbells: Option<(u64, u64)>,
    /// `[offset, offset + len)` the device polls: whole pages inside it are mapped writable.
    writable: Option<(u64, u64)>,
}

impl fmt::Debug for DirectWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DirectWindow")
            .field("host_addr", &format_args!("{:#x}", self.host_addr))
            .field("len", &format_args!("{:#x}", self.len))
            .field("write_notify", &self.write_notify.is_some())
            .field("doorbells", &self.doorbells)
            .field("writable", &self.writable)
            .finish()
    }
}

impl DirectWindow {
    /// A window of `len` bytes at `host_addr`. With `write_notify`, guest stores must be
    /// seen by the device: the BAR is mapped read-only (stores exit to the VMM, which
    /// stores the value and signals the eventfd, or sends control-register stores to the
    /// lender, see [`DirectWindow::with_doorbells`]); without, it is mapped read-write.
    ///
    /// # Safety
    ///
    /// `[host_addr, host_addr + len)` must be a readable and writable mapping that stays
    /// valid until the link that reported it is dropped.
    pub unsafe fn new(host_addr: u64, len: u64, write_notify: Option<Arc<EventFd>>) -> Self {
        Self {
            host_addr,
            len,
            write_notify,
            doorbells: None,
            writable: None,
        }
    }

    /// The device polls `[offset, offset + len)` (a polling-mode device's doorbells): the
    /// pages entirely inside it are mapped writable, so guest stores there reach the device
    /// with no exit; stores elsewhere are handled as without this.
    pub fn with_writable(mut self, offset: u64, len: u64) -> Self {
        self.writable = Some((offset, len));
        self
    }

    /// The range the device polls, if any.
    pub fn writable(&self) -> Option<(u64, u64)> {
        self.writable
    }

    /// True when the page `[offset, offset + page)` may be mapped writable: a window nothing
    /// needs to be notified of, or a page inside the polled range.
    pub fn page_writable(&self, offset: u64, page: u64) -> bool {
        if self.write_notify.is_none() {
            return true;
        }
        self.writable.is_some_and(|(o, l)| {
            offset >= o
                && offset
                    .checked_add(page)
                    .is_some_and(|end| end <= o.saturating_add(l))
        })
    }

    /// Only stores entirely inside `[offset, offset + len)` (the device's doorbells: absolute
    /// values) take store + notify; all others go to the lender's exact `bar_write`. Needs a
    /// `write_notify` eventfd (without one the window is read-write and nothing traps).
    pub fn with_doorbells(mut self, offset: u64, len: u64) -> Self {
        self.doorbells = Some((offset, len));
        self
    }

    /// The doorbell range, when stores outside it must take the exact path.
    pub fn doorbells(&self) -> Option<(u64, u64)> {
        self.doorbells
    }

    /// True when a trapped store of `len` bytes at `offset` may be stored into the window
    /// (and notified); false when it must go to [`RemoteDeviceLink::bar_write`].
    pub fn store_is_direct(&self, offset: u64, len: u64) -> bool {
        match (&self.write_notify, self.doorbells) {
            (Some(_), Some((o, l))) => {
                offset >= o
                    && offset
                        .checked_add(len)
                        .is_some_and(|end| end <= o.saturating_add(l))
            }
            _ => true,
        }
    }

    pub fn host_addr(&self) -> u64 {
        self.host_addr
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device's "register written" eventfd, if stores must be notified.
    pub fn write_notify(&self) -> Option<&Arc<EventFd>> {
        self.write_notify.as_ref()
    }
}

/// How guest accesses to a BAR reach the device.
#[derive(Clone, Debug)]
pub enum BarAccess {
    /// Loads/stores go straight to a mapped window (KVM memslot, no exits).
    Direct(DirectWindow),
    /// Every access exits to the VMM and is forwarded to the lender (`mode=trapped`).
    Trapped,
}

/// A guest write that should kick an eventfd in the kernel (KVM ioeventfd), e.g. a
/// doorbell whose value the device does not need (a "kick" register).
#[derive(Clone)]
pub struct RemoteIoEvent {
    /// Offset in the BAR.
    pub offset: u64,
    /// Match only writes of this value (and width); `None`: any write.
    pub datamatch: Option<pci::vm_ops::IoEventDatamatch>,
    /// The device's eventfd (received from the lender).
    pub fd: Arc<EventFd>,
}

impl fmt::Debug for RemoteIoEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteIoEvent")
            .field("offset", &format_args!("{:#x}", self.offset))
            .field("datamatch", &self.datamatch)
            .finish()
    }
}

/// Doorbells of the device whose stores are only kicks right now (the device reads the
/// values from shadow doorbells in guest memory): the VMM may register them as KVM
/// ioeventfds on the BAR's notify eventfd. `generation` grows with every change; empty
/// `offsets` means every doorbell needs its value (the exact path) again.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KickDoorbells {
    pub generation: u64,
    /// BAR index the offsets are in.
    pub bar: u8,
    /// Offsets of kick-only doorbell registers.
    pub offsets: Vec<u64>,
}

/// The newest [`KickDoorbells`] a link has seen, from replies (vCPU thread) and events
/// (event thread): an older generation never replaces a newer one, so a late event is
/// harmless. The generation is readable without the lock (checked on every trapped access).
#[derive(Debug, Default)]
pub struct KickCell {
    generation: AtomicU64,
    state: Mutex<KickDoorbells>,
}

impl KickCell {
    /// Keeps `k` if it is newer than what the cell holds.
    pub fn offer(&self, k: KickDoorbells) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if k.generation > s.generation {
            self.generation.store(k.generation, Ordering::Release);
            *s = k;
        }
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    pub fn get(&self) -> KickDoorbells {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// One BAR of the remote device.
#[derive(Clone, Debug)]
pub struct RemoteBar {
    /// BAR index (0..=5).
    pub index: u8,
    /// Size in bytes (power of two).
    pub size: u64,
    pub kind: BarKind,
    pub prefetchable: bool,
    pub access: BarAccess,
    /// ioeventfds to register at BAR offsets while the BAR is decoded.
    pub ioevents: Vec<RemoteIoEvent>,
}

/// Where the MSI-X table and PBA live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteMsix {
    pub vectors: u16,
    pub table_bar: u8,
    pub table_offset: u32,
    pub pba_bar: u8,
    pub pba_offset: u32,
}

/// Everything the VMM needs to present the device.
#[derive(Clone, Debug)]
pub struct RemoteDeviceInfo {
    /// Lender-side device id (for logs).
    pub id: String,
    /// Config space snapshot (256 or 4096 bytes).
    pub config: Vec<u8>,
    pub bars: Vec<RemoteBar>,
    /// MSI-X placement; when `None` it is read from the snapshot's MSI-X capability.
    pub msix: Option<RemoteMsix>,
}

/// Interrupt delivery mode the device is told to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IrqKind {
    Intx,
    Msi,
    Msix,
}

impl fmt::Display for IrqKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IrqKind::Intx => "intx",
            IrqKind::Msi => "msi",
            IrqKind::Msix => "msi-x",
        })
    }
}

/// Where the device's interrupts go: one eventfd per vector (KVM irqfds), and for INTx
/// the resample eventfd KVM signals after the guest's EOI.
pub struct IrqTargets<'a> {
    pub kind: IrqKind,
    /// Per vector, from vector 0. Empty: the kind is disabled.
    pub triggers: Vec<&'a EventFd>,
    pub resample: Option<&'a EventFd>,
}

/// State of the lease behind the link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseState {
    Active,
    /// The lender reported the device gone or the link went down.
    Lost(String),
    Returned,
}

/// The device's DMA window onto guest RAM (IOVA = GPA). Dropping it unmaps it on the
/// lender (and revokes any fabric window it exported).
pub trait DmaMapping: Send {
    /// Bytes mapped.
    fn size(&self) -> u64;
}

/// The lender, as the device model sees it.
pub trait RemoteDeviceLink: Send {
    /// What the lender told us about the device at borrow time.
    fn device_info(&self) -> RemoteDeviceInfo;

    /// Reads `data.len()` bytes of the real config space at `offset`.
    fn config_read(&self, offset: u16, data: &mut [u8]) -> Result<(), LinkError>;

    /// Writes the real config space (the lender filters too).
    fn config_write(&self, offset: u16, data: &[u8]) -> Result<(), LinkError>;

    /// Slow-path BAR read.
    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) -> Result<(), LinkError>;

    /// Slow-path BAR write: the device's exact write path (also used for stores into a
    /// direct BAR outside its doorbell range, see [`DirectWindow::with_doorbells`]).
    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), LinkError>;

    /// Makes guest RAM `regions` reachable by the device at IOVA = GPA.
    fn map_dma(&self, regions: &[GuestRamRegion]) -> Result<Box<dyn DmaMapping>, LinkError>;

    /// Tells the lender where the device's interrupts of `targets.kind` go (replacing the
    /// previous targets of that kind; empty triggers disable the kind).
    fn set_irqs(&self, targets: &IrqTargets<'_>) -> Result<(), LinkError>;

    /// Function-level reset of the real device (the lease stays).
    fn reset(&self) -> Result<(), LinkError>;

    fn lease_state(&self) -> LeaseState;

    /// Interrupts delivered per vector, when the link sees them (tcp relay).
    fn irq_counts(&self) -> Option<Vec<u64>> {
        None
    }

    /// Generation of [`RemoteDeviceLink::kick_doorbells`]; cheap (read on every trapped
    /// BAR access and after every exact write and reset).
    fn kick_generation(&self) -> u64 {
        0
    }

    /// The newest kick-only doorbells the lender reported. Default: none.
    fn kick_doorbells(&self) -> KickDoorbells {
        KickDoorbells::default()
    }
    /// Registers the VMM's hook for the lease's asynchronous events (loss, IOMMU faults).
    /// The hook is called from the link's event thread and must not block. If the lease is
    /// already lost when the hook is set, `lease_lost` has been called (exactly once, by this
    /// call or by the event thread) when this returns, so a loss is never missed. `lease_lost`
    /// must not set a hook of the same link. Links that cannot report events keep the default (the VMM then only learns of
    /// a loss when a request fails).
    fn set_event_hook(&self, _hook: Arc<dyn LinkEventHook>) {}

    /// The lender's counters for this lease since it was granted (DMA bytes, IOMMU faults,
    /// doorbell kicks, interrupts per vector): one control-protocol round trip. `Ok(None)`:
    /// the link or the lender does not report them.
    fn lender_counters(&self) -> Result<Option<LenderCounters>, LinkError> {
        Ok(None)
    }

    /// Quiesces (`true`) or resumes (`false`) the device on the lender for `vm.pause` /
    /// `vm.resume`: a polling-mode device stops fetching doorbells and descriptors until
    /// resumed; an interrupt-mode device needs nothing (its vectors are masked at the VMM).
    fn quiesce(&self, _stop: bool) -> Result<(), LinkError> {
        Ok(())
    }

    /// The lease's peer-to-peer side (protocol version 5), shareable with the VM's
    /// [`crate::P2pRouter`]. Default `None`: the link cannot map peers' BARs, and DMA to a
    /// peer's BAR faults on the lender.
    fn p2p_port(&self) -> Option<Arc<dyn crate::P2pPort>> {
        None
    }

    /// The lease's live-migration side. Default `None`: a VM holding this device cannot be
    /// live-migrated (its lender is older than protocol version 4, or the link is a fake).
    fn migration(&self) -> Option<Arc<dyn LeaseMigration>> {
        None
    }
    /// The cluster-directory claim revision the device is held under, if any (a migration
    /// moves the claim with the lease). Default: none.
    fn claim_revision(&self) -> Option<i64> {
        None
    }
}

/// The pages a lent device wrote by DMA since the previous fetch (IOVA = GPA).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceDirtyPages {
    /// First IOVA of the range.
    pub iova: u64,
    /// Pages in the range.
    pub pages: u64,
    /// Bit `i % 64` of word `i / 64`: page `iova + i * 4 KiB` was written.
    pub bits: Vec<u64>,
    /// The lender cannot track the device's writes: every mapped page is reported.
    pub whole_window: bool,
}

/// What the lender answered to a hand-over quiesce.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HandoverState {
    /// No DMA of the device is in flight (the lender confirms).
    pub drained: bool,
    /// MSI-X vectors raised since the quiesce began, held by the lender.
    pub pending_msix: Vec<u32>,
    /// INTx asserted since the quiesce began (held).
    pub pending_intx: bool,
}

/// A single-use authorisation to move the lease to another borrower.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseTicket {
    pub lease: u64,
    pub ticket: Vec<u8>,
    pub expires_in_ms: u64,
    /// The cluster-directory claim revision the lease is held under (fenced lenders), which
    /// the taker takes over with the lease; `None` without a claim.
    pub claim: Option<i64>,
}

/// The lease's live-migration side (lender protocol version 4): the device dirty log, the
/// hand-over quiesce and the lease transfer. See docs/ARCHITECTURE.md, "Life of a migration".
pub trait LeaseMigration: Send + Sync {
    /// The lease id on its lender.
    fn lease_id(&self) -> u64;
    /// Starts the device dirty log; `Ok(true)` when the lender logs page by page.
    fn start_dirty_log(&self) -> Result<bool, LinkError>;
    /// The pages written since the previous fetch (cleared by the fetch), over the span of
    /// the lease's DMA windows.
    fn fetch_dirty_log(&self) -> Result<DeviceDirtyPages, LinkError>;
    /// Stops the device dirty log.
    fn stop_dirty_log(&self) -> Result<(), LinkError>;
    /// Stops the device fetching work, holds its interrupts on the lender and waits up to
    /// `timeout_ms` for its DMA to drain.
    fn quiesce_for_handover(&self, timeout_ms: u32) -> Result<HandoverState, LinkError>;
    /// Ends a hand-over quiesce here: the device runs again and the interrupts held are
    /// delivered to the targets wired now (on the destination: its irqfds).
    fn resume_after_handover(&self) -> Result<(), LinkError>;
    /// Authorises moving the lease to `to_node`/`to_vm`.
    fn create_transfer(&self, to_node: &str, to_vm: &str) -> Result<LeaseTicket, LinkError>;
    /// Withdraws the ticket. An error means the lease is no longer ours (moved or lost).
    fn cancel_transfer(&self) -> Result<(), LinkError>;
    /// The destination took the lease: tearing the device down here returns nothing and
    /// unmaps nothing on the lender (it knows the lease only on the destination's link).
    fn mark_moved(&self);
}

/// Asynchronous lease events, delivered by the link to the VMM (see
/// [`RemoteDeviceLink::set_event_hook`]). Implementations must not block.
pub trait LinkEventHook: Send + Sync {
    /// The lease is lost (lender gone, link down, device gone); `why` says which.
    fn lease_lost(&self, why: &str);
    /// The lender's IOMMU refused a DMA of the device (rate-limited by the lender).
    fn iommu_fault(&self, fault: &IommuFaultReport);
}

/// One IOMMU fault the lender reported.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IommuFaultReport {
    pub iova: u64,
    pub len: u64,
    pub write: bool,
    /// Faults of this lease so far (the lender reports a sample when faults come fast).
    pub total: u64,
}

/// What the lender counted for one lease since it was granted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LenderCounters {
    /// Bytes the device read from / wrote to the borrower's memory through its IOMMU domain
    /// (0 where the domain cannot count, e.g. VFIO).
    pub dma_bytes_read: u64,
    pub dma_bytes_written: u64,
    /// DMAs the IOMMU domain refused.
    pub iommu_faults: u64,
    /// Doorbell notifications the device received (the value of each notify-eventfd read,
    /// i.e. every store+notify or ioeventfd kick, coalesced or not).
    pub doorbell_kicks: u64,
    /// Interrupts the lender signalled, per MSI-X vector.
    pub msix: Vec<u64>,
    /// INTx assertions the lender signalled.
    pub intx: u64,
    /// Commands the device model fetched (lenders of protocol version 7; else 0).
    pub commands: u64,
    /// Doorbell writes the model refused for a value outside the queue (version 7).
    pub invalid_doorbells: u64,
    /// Commands the model refused for their PRPs (version 7).
    pub bad_prps: u64,
}
