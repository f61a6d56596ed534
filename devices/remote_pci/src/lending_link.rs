//! [`RemoteDeviceLink`] over `lending::client`: a [`Lease`] from a [`LenderClient`].
//!
//! * BARs with a fabric window are mapped into this process (shm) and reported as
//!   `Direct`; the windows stay mapped until the link is dropped. On tcp (no direct
//!   mappings) and for BARs without a window, accesses are `Trapped` (BAR_READ/BAR_WRITE).
//! * Write notification, per BAR (`BarDesc.notify`, protocol version 2): `None` maps the
//!   window read-write (VFIO BARs); `Doorbells` maps it read-only, stores inside the doorbell
//!   range are stored + notified through the lease's notify eventfd and every other store
//!   (control registers) goes to the lender's exact BAR_WRITE; `All` (a version 1 lender:
//!   every window of a lease with a notify eventfd) stores + notifies every store. A BAR
//!   that needs notification on a lease without a notify eventfd is trapped.
//! * DMA: each guest RAM region (must be memfd backed) is exported as a fabric window and
//!   mapped at IOVA = GPA; the returned handle unmaps and revokes on drop.
//! * Interrupts: on shm the irqfd eventfds are passed (SCM_RIGHTS) so the device signals KVM
//!   directly; on tcp the lender sends IRQ events that an event thread turns into eventfd
//!   writes (counted per vector). The same thread watches for DeviceGone/Fatal. INTx's
//!   resample eventfd goes to the lender too (passed on shm, forwarded as events by the
//!   client on tcp), so a still-pending INTx is asserted again after the guest's EOI.
//! * Teardown: the event thread blocks without a timeout on the client's event channel;
//!   dropping the link wakes it ([`EventWaker`]) and joins it, so nothing waits for a
//!   polling interval.
//! * Lease events ([`RemoteDeviceLink::set_event_hook`]): the event thread marks the lease
//!   lost on DeviceGone, on the link going down and on an event relay failure, and calls the
//!   hook's `lease_lost` exactly once per lease (at once from `set_event_hook` if the loss
//!   came first); IommuFault events (protocol version 3) go to `iommu_fault`. Without an own
//!   event thread, only what is fed to [`LendingLink::event_sink`] reaches the hook.
//! * Counters and quiesce: one control-protocol round trip each (protocol version 3);
//!   `lender_counters` is `Ok(None)` and `quiesce` `Unsupported` with an older lender.
//!
//! The event thread consumes all events of the client's connection, so use one
//! [`LenderClient`] per borrowed device, or run your own pump with
//! [`LendingLinkOptions::own_event_thread`] = false and feed [`LendingLink::event_sink`].

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use lending::client::{ClientError, ClientIrq, EventWaker, Lease, LenderClient};
use lending::protocol::{self, Event, NotifyWrites};
use log::{debug, error, info, warn};
use ntb::{ExportedWindow, FabricError, FabricKind, PeerWindow};
use pci::vm_ops::GuestRamRegion;
use vmm_sys_util::eventfd::EventFd;

use crate::link::{
    BarAccess, BarKind, DeviceDirtyPages, DirectWindow, DmaMapping, HandoverState,
    IommuFaultReport, IrqKind, IrqTargets, KickCell, KickDoorbells, LeaseMigration, LeaseState,
    LeaseTicket, LenderCounters, LinkError, LinkEventHook, RemoteBar, RemoteDeviceInfo,
    RemoteDeviceLink, RemoteMsix,
};

/// Errors of setting up the link.
#[derive(Debug, thiserror::Error)]
pub enum LendingLinkError {
    #[error("mapping bar {bar} window of lease {lease}: {source}")]
    BarWindow {
        lease: u64,
        bar: u8,
        #[source]
        source: ClientError,
    },
    #[error("starting the event thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("duplicating the notify eventfd: {0}")]
    Notify(#[source] std::io::Error),
    #[error("waking the event thread: {0}")]
    Waker(#[source] ClientError),
}

/// Options of [`LendingLink::new`].
#[derive(Clone, Copy, Debug)]
pub struct LendingLinkOptions {
    /// Run a thread that receives the connection's events (IRQ relay, device gone).
    pub own_event_thread: bool,
}

impl Default for LendingLinkOptions {
    fn default() -> Self {
        Self {
            own_event_thread: true,
        }
    }
}

fn proto_kind(k: IrqKind) -> protocol::IrqKind {
    match k {
        IrqKind::Intx => protocol::IrqKind::Intx,
        IrqKind::Msi => protocol::IrqKind::Msi,
        IrqKind::Msix => protocol::IrqKind::Msix,
    }
}

fn our_kind(k: protocol::IrqKind) -> IrqKind {
    match k {
        protocol::IrqKind::Intx => IrqKind::Intx,
        protocol::IrqKind::Msi => IrqKind::Msi,
        protocol::IrqKind::Msix => IrqKind::Msix,
    }
}

fn our_kicks(k: protocol::DoorbellKicks) -> KickDoorbells {
    KickDoorbells {
        generation: k.generation,
        bar: k.bar,
        offsets: k.offsets,
    }
}

fn link_err(op: &'static str, e: ClientError) -> LinkError {
    match e {
        ClientError::Remote { message, .. } => LinkError::Remote { op, message },
        ClientError::Fabric(FabricError::PeerGone { reason, .. }) => LinkError::Down(reason),
        ClientError::Fabric(FabricError::FdPassingUnsupported { .. }) => LinkError::Unsupported {
            op,
            reason: "no fd passing on this fabric".into(),
        },
        e @ ClientError::Unsupported { .. } => LinkError::Unsupported {
            op,
            reason: e.to_string(),
        },
        other => LinkError::BadReply {
            op,
            reason: other.to_string(),
        },
    }
}

/// The VMM's hook and whether it has been told of the loss (under one lock, so the loss is
/// reported exactly once whichever of the loss and `set_event_hook` comes first).
#[derive(Default)]
struct HookSlot {
    hook: Option<Arc<dyn LinkEventHook>>,
    lost_reported: bool,
}

/// Receives events of one lease (from the link's own thread or an external pump).
#[derive(Clone)]
pub struct LendingEventSink {
    lease: u64,
    /// Kick-only doorbells: from BAR_WRITE/RESET replies and KICKS events.
    kicks: Arc<KickCell>,
    state: Arc<Mutex<LeaseState>>,
    hook: Arc<Mutex<HookSlot>>,
    /// Held across a whole report of the loss, the hook's call included: a `set_event_hook`
    /// racing the event thread's report returns only once the hook has been told (the hook
    /// must not set a hook of this link from `lease_lost`).
    reporting: Arc<Mutex<()>>,
    /// Per kind: the eventfds to write on relayed interrupts (tcp).
    relay: Arc<Mutex<HashMap<IrqKind, Vec<EventFd>>>>,
    counts: Arc<Mutex<Vec<u64>>>,
    /// Times the link's own event thread returned from its wait (events, wake-ups).
    wakeups: Arc<AtomicU64>,
}

impl LendingEventSink {
    /// Handles `ev` if it belongs to this lease; returns whether it did.
    pub fn handle(&self, ev: &Event) -> bool {
        match ev {
            Event::Irq(i) if i.lease == self.lease => {
                let relay = self.relay.lock().unwrap_or_else(PoisonError::into_inner);
                let v = i.vector as usize;
                match relay.get(&our_kind(i.kind)).and_then(|fds| fds.get(v)) {
                    Some(fd) => {
                        if let Err(e) = fd.write(1) {
                            warn!("lease {}: relaying irq {v}: {e}", self.lease);
                        }
                        let mut c = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
                        if c.len() <= v {
                            c.resize(v + 1, 0);
                        }
                        c[v] += 1;
                    }
                    None => debug!(
                        "lease {}: irq {:?}/{v} with no target dropped",
                        self.lease, i.kind
                    ),
                }
                true
            }
            Event::DeviceGone(g) if g.lease == self.lease => {
                error!("lease {}: device gone: {}", self.lease, g.reason);
                self.lost(format!("device gone: {}", g.reason));
                true
            }
            Event::IommuFault(f) if f.lease == self.lease => {
                // The lender rate-limits these; `total` is exact.
                warn!(
                    "lease {}: iommu fault: dma {} of {:#x} bytes at iova {:#x} (fault #{})",
                    self.lease,
                    if f.write { "write" } else { "read" },
                    f.len,
                    f.iova,
                    f.total
                );
                let hook = self
                    .hook
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .hook
                    .clone();
                if let Some(h) = hook {
                    h.iommu_fault(&IommuFaultReport {
                        iova: f.iova,
                        len: f.len,
                        write: f.write,
                        total: f.total,
                    });
                }
                true
            }
            Event::Kicks(k) if k.lease == self.lease => {
                debug!(
                    "lease {}: {} kick-only doorbells (generation {})",
                    self.lease,
                    k.kicks.offsets.len(),
                    k.kicks.generation
                );
                self.kicks.offer(our_kicks(k.kicks.clone()));
                true
            }
            Event::LeaseMoved(m) if m.lease == self.lease => {
                // Live migration handed the lease to the destination: this end lets go of
                // the device, it is not lost (no lost-device report).
                info!("lease {}: moved to {}", self.lease, m.to);
                true
            }
            Event::Fatal(f) if f.lease == self.lease => {
                error!("lease {}: fatal device error: {}", self.lease, f.message);
                true
            }
            _ => false,
        }
    }

    /// Marks the lease lost (the first reason stays) and tells the hook, once.
    fn lost(&self, why: String) {
        let why = {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            match &*st {
                LeaseState::Lost(first) => first.clone(),
                _ => {
                    *st = LeaseState::Lost(why.clone());
                    why
                }
            }
        };
        self.report_lost(&why);
    }

    /// Calls the hook's `lease_lost` if there is a hook and it was not told yet.
    fn report_lost(&self, why: &str) {
        let _turn = self
            .reporting
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let hook = {
            let mut slot = self.hook.lock().unwrap_or_else(PoisonError::into_inner);
            if slot.lost_reported {
                return;
            }
            let Some(h) = slot.hook.clone() else {
                return;
            };
            slot.lost_reported = true;
            h
        };
        info!("lease {}: reporting the loss: {why}", self.lease);
        hook.lease_lost(why);
    }

    fn set_hook(&self, hook: Arc<dyn LinkEventHook>) {
        self.hook
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .hook = Some(hook);
        let lost = match &*self.state.lock().unwrap_or_else(PoisonError::into_inner) {
            LeaseState::Lost(why) => Some(why.clone()),
            _ => None,
        };
        if let Some(why) = lost {
            self.report_lost(&why);
        }
    }

    /// How often the link's own event thread woke up: once per event it handled plus once
    /// when the link was dropped. It never wakes on a timer.
    pub fn event_thread_wakeups(&self) -> u64 {
        self.wakeups.load(Ordering::SeqCst)
    }
}

struct EventThread {
    stop: Arc<AtomicBool>,
    waker: EventWaker,
    handle: Option<JoinHandle<()>>,
}

impl Drop for EventThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // The thread blocks without a timeout: wake it, so the join returns at once.
        self.waker.wake();
        if let Some(h) = self.handle.take() {
            if h.join().is_err() {
                error!("lending event thread panicked");
            }
        }
    }
}

/// A lease as a [`RemoteDeviceLink`].
pub struct LendingLink {
    // Field order is drop order: the thread stops, BAR windows are unmapped, then the
    // lease (last reference) is returned.
    _events: Option<EventThread>,
    _windows: Vec<Box<dyn PeerWindow>>,
    sink: LendingEventSink,
    info: RemoteDeviceInfo,
    kind: FabricKind,
    /// Peer-to-peer side (lenders of protocol version 5 and later).
    p2p: Option<Arc<LendingP2p>>,
    client: Arc<LenderClient>,
    lease: Arc<Lease>,
}

impl LendingLink {
    /// Wraps `lease` (borrowed through `client`): maps its BAR windows and starts the event
    /// thread.
    pub fn new(
        client: Arc<LenderClient>,
        lease: Lease,
        opts: LendingLinkOptions,
    ) -> Result<Self, LendingLinkError> {
        let lease = Arc::new(lease);
        let kind = client.endpoint().kind();
        let pinfo = lease.info().clone();
        let notify = match lease.notify_eventfd() {
            Some(e) => Some(Arc::new(e.try_clone().map_err(LendingLinkError::Notify)?)),
            None => None,
        };
        let mut windows: Vec<Box<dyn PeerWindow>> = Vec::new();
        let mut bars = Vec::with_capacity(pinfo.bars.len());
        for b in &pinfo.bars {
            let bar_kind = if b.io {
                BarKind::Io
            } else if b.is_64bit {
                BarKind::Mem64
            } else {
                BarKind::Mem32
            };
            let mut access = BarAccess::Trapped;
            let mut polled = None;
            // How stores must reach the device; `None`: they cannot on this lease (trapped).
            let writes = match (b.notify, &notify) {
                (NotifyWrites::None, _) => Some((None, None)),
                (NotifyWrites::All, Some(n)) => Some((Some(Arc::clone(n)), None)),
                (NotifyWrites::Doorbells { offset, len }, Some(n)) => {
                    Some((Some(Arc::clone(n)), Some((offset, len))))
                }
                (NotifyWrites::Polled { offset, len }, Some(n)) => {
                    polled = Some((offset, len));
                    Some((Some(Arc::clone(n)), Some((offset, len))))
                }
                (_, None) => None,
            };
            if kind == FabricKind::Shm
                && b.window.is_some()
                && !b.emulated_by_borrower
                && !b.io
                && writes.is_none()
            {
                warn!(
                    "lease {}: bar {} needs write notification but the lease has no notify \
                     eventfd; trapped",
                    lease.id(),
                    b.index
                );
            }
            if let (FabricKind::Shm, Some(_), false, false, Some((wn, doorbells))) =
                (kind, b.window, b.emulated_by_borrower, b.io, writes)
            {
                let w =
                    lease
                        .bar_window(b.index)
                        .map_err(|source| LendingLinkError::BarWindow {
                            lease: lease.id(),
                            bar: b.index,
                            source,
                        })?;
                match w.as_ptr() {
                    Ok(p) if w.len() >= b.size => {
                        // SAFETY: the window stays mapped in `self.windows` until the link
                        // is dropped (and a severed window is replaced by zero memory, so
                        // the range never becomes unmapped while we hold it).
                        let mut dw = unsafe { DirectWindow::new(p as u64, w.len(), wn) };
                        if let Some((o, l)) = doorbells {
                            dw = dw.with_doorbells(o, l);
                        }
                        if let Some((o, l)) = polled {
                            dw = dw.with_writable(o, l);
                        }
                        access = BarAccess::Direct(dw);
                        windows.push(w);
                    }
                    Ok(_) => warn!(
                        "lease {}: bar {} window ({:#x}) smaller than the bar ({:#x}); trapped",
                        lease.id(),
                        b.index,
                        w.len(),
                        b.size
                    ),
                    Err(e) => debug!("lease {}: bar {} trapped: {e}", lease.id(), b.index),
                }
            }
            bars.push(RemoteBar {
                index: b.index,
                size: b.size,
                kind: bar_kind,
                prefetchable: b.prefetchable,
                access,
                ioevents: Vec::new(),
            });
        }
        let info = RemoteDeviceInfo {
            id: pinfo.id.clone(),
            config: pinfo.config.clone(),
            bars,
            msix: pinfo.msix.map(|m| RemoteMsix {
                vectors: m.vectors,
                table_bar: m.table_bar,
                table_offset: m.table_offset,
                pba_bar: m.pba_bar,
                pba_offset: m.pba_offset,
            }),
        };
        let sink = LendingEventSink {
            lease: lease.id(),
            kicks: Arc::default(),
            state: Arc::new(Mutex::new(LeaseState::Active)),
            hook: Arc::default(),
            reporting: Arc::default(),
            relay: Arc::default(),
            counts: Arc::default(),
            wakeups: Arc::default(),
        };
        let events = if opts.own_event_thread {
            let stop = Arc::new(AtomicBool::new(false));
            let waker = client.event_waker().map_err(LendingLinkError::Waker)?;
            let (s, c, st) = (sink.clone(), Arc::clone(&client), Arc::clone(&stop));
            let handle = std::thread::Builder::new()
                .name(format!("lease{}-events", lease.id()))
                .spawn(move || event_loop(&c, &s, &st))
                .map_err(LendingLinkError::Thread)?;
            Some(EventThread {
                stop,
                waker,
                handle: Some(handle),
            })
        } else {
            None
        };
        info!(
            "lease {}: {} on {kind:?}, {} bars ({} direct), notify eventfd {}",
            lease.id(),
            info.id,
            info.bars.len(),
            windows.len(),
            notify.is_some()
        );
        let p2p = (client.protocol_version() >= protocol::P2P_VERSION).then(|| {
            Arc::new(LendingP2p {
                lender: client.hello().node.clone(),
                capability: client.protocol_version() >= protocol::P2PX_VERSION
                    && kind == FabricKind::Tcp,
                bars: pinfo
                    .bars
                    .iter()
                    .filter(|b| !b.io && !b.emulated_by_borrower && b.window.is_some())
                    .map(|b| b.index)
                    .collect(),
                lease: Arc::clone(&lease),
            })
        });
        Ok(Self {
            _events: events,
            _windows: windows,
            sink,
            info,
            kind,
            p2p,
            client,
            lease,
        })
    }

    /// For an external event pump: feed it every event of the connection.
    pub fn event_sink(&self) -> LendingEventSink {
        self.sink.clone()
    }

    /// The lease.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }
}

fn event_loop(client: &LenderClient, sink: &LendingEventSink, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        // Blocks until an event, the link's end, or the link's drop wakes it: no timer.
        let r = client.wait_event();
        sink.wakeups.fetch_add(1, Ordering::SeqCst);
        match r {
            Ok(Some(ev)) => {
                if !sink.handle(&ev) {
                    debug!("lease {}: event for someone else: {ev:?}", sink.lease);
                }
            }
            Ok(None) => {}
            Err(ClientError::Fabric(FabricError::PeerGone { reason, .. })) => {
                if !stop.load(Ordering::SeqCst) {
                    error!("lease {}: lender link down: {reason}", sink.lease);
                    sink.lost(reason);
                }
                return;
            }
            Err(e) => {
                error!("lease {}: event thread ends: {e}", sink.lease);
                sink.lost(format!("event relay failed: {e}"));
                return;
            }
        }
    }
}

/// The lease's version 4 migration requests.
struct LendingMigration {
    lease: Arc<Lease>,
}

impl LeaseMigration for LendingMigration {
    fn lease_id(&self) -> u64 {
        self.lease.id()
    }

    fn start_dirty_log(&self) -> Result<bool, LinkError> {
        self.lease
            .start_dirty_log()
            .map_err(|e| link_err("dirty log start", e))
    }

    fn fetch_dirty_log(&self) -> Result<DeviceDirtyPages, LinkError> {
        let d = self
            .lease
            .fetch_dirty_log(0, 0)
            .map_err(|e| link_err("dirty log fetch", e))?;
        Ok(DeviceDirtyPages {
            iova: d.iova,
            pages: d.pages,
            bits: d.bits,
            whole_window: d.whole_window,
        })
    }

    fn stop_dirty_log(&self) -> Result<(), LinkError> {
        self.lease
            .stop_dirty_log()
            .map_err(|e| link_err("dirty log stop", e))
    }

    fn quiesce_for_handover(&self, timeout_ms: u32) -> Result<HandoverState, LinkError> {
        let q = self
            .lease
            .quiesce_for_handover(timeout_ms)
            .map_err(|e| link_err("hand-over quiesce", e))?;
        Ok(HandoverState {
            drained: q.drained,
            pending_msix: q.pending_msix,
            pending_intx: q.pending_intx,
        })
    }

    fn resume_after_handover(&self) -> Result<(), LinkError> {
        self.lease
            .quiesce(false)
            .map_err(|e| link_err("hand-over resume", e))
    }

    fn create_transfer(&self, to_node: &str, to_vm: &str) -> Result<LeaseTicket, LinkError> {
        let t = self
            .lease
            .create_transfer(to_node, to_vm)
            .map_err(|e| link_err("transfer create", e))?;
        Ok(LeaseTicket {
            lease: t.lease,
            ticket: t.ticket,
            expires_in_ms: t.expires_in_ms,
            // A claim is the directory's business, not the link's: the VMM adds it.
            claim: None,
        })
    }

    fn cancel_transfer(&self) -> Result<(), LinkError> {
        self.lease
            .cancel_transfer()
            .map_err(|e| link_err("transfer cancel", e))
    }

    fn mark_moved(&self) {
        self.lease.mark_moved();
    }
}

/// The lease's P2P_MAP/P2P_UNMAP, shared with the VM's P2P router.
struct LendingP2p {
    lender: String,
    /// Same-lender peers need this lease's capability (tcp, protocol version 6).
    capability: bool,
    /// BARs backed by lender memory (exported as windows, not emulated by the borrower).
    bars: Vec<u8>,
    lease: Arc<Lease>,
}

impl crate::P2pPort for LendingP2p {
    fn lender(&self) -> &str {
        &self.lender
    }

    fn lease(&self) -> u64 {
        self.lease.id()
    }

    fn peer_bars(&self) -> Vec<u8> {
        self.bars.clone()
    }

    fn map(
        &self,
        target: u64,
        bar: u8,
        iova: u64,
    ) -> Result<Box<dyn crate::PeerMapping>, crate::P2pMapError> {
        self.lease.p2p_map(target, bar, iova).map_err(|e| {
            // The lender's verdict on this BAR at this address (no peer memory, not a
            // memory BAR, overlaps RAM) does not change by asking again.
            let permanent = matches!(
                e.code(),
                Some(protocol::code::INVALID | protocol::code::OUT_OF_RANGE)
            );
            let e = link_err("p2p map", e);
            if permanent {
                crate::P2pMapError::Refused(e)
            } else {
                crate::P2pMapError::Failed(e)
            }
        })?;
        Ok(Box::new(LendingPeerMapping {
            lease: Arc::clone(&self.lease),
            target,
            bar,
        }))
    }

    fn needs_capability(&self) -> bool {
        self.capability
    }

    fn map_granted(
        &self,
        target: u64,
        bar: u8,
        iova: u64,
        grant: &crate::PeerGrant,
    ) -> Result<Box<dyn crate::PeerMapping>, crate::P2pMapError> {
        let g = protocol::P2pGranted {
            grant: grant.grant,
            secret: grant.secret.clone(),
        };
        self.lease
            .p2p_map_granted(target, bar, iova, &g)
            .map_err(|e| p2p_map_err("p2p map", e))?;
        Ok(Box::new(LendingPeerMapping {
            lease: Arc::clone(&self.lease),
            target,
            bar,
        }))
    }

    fn grant(
        &self,
        bar: u8,
        grantee: &str,
    ) -> Result<(crate::PeerGrant, Box<dyn crate::PeerMapping>), crate::P2pMapError> {
        let g = self
            .lease
            .p2p_grant(bar, grantee)
            .map_err(|e| p2p_map_err("p2p grant", e))?;
        Ok((
            crate::PeerGrant {
                grant: g.grant,
                secret: g.secret,
            },
            Box::new(LendingGrant {
                lease: Arc::clone(&self.lease),
                grant: g.grant,
            }),
        ))
    }

    fn map_remote(
        &self,
        lender: &str,
        target: u64,
        bar: u8,
        iova: u64,
        grant: &crate::PeerGrant,
    ) -> Result<Box<dyn crate::PeerMapping>, crate::P2pMapError> {
        let g = protocol::P2pGranted {
            grant: grant.grant,
            secret: grant.secret.clone(),
        };
        self.lease
            .p2p_map_remote(lender, target, bar, iova, &g)
            .map_err(|e| p2p_map_err("p2p map remote", e))?;
        Ok(Box::new(LendingRemoteMapping {
            lease: Arc::clone(&self.lease),
            lender: lender.to_string(),
            target,
            bar,
        }))
    }
}

/// The lender's verdict on a BAR at an address (no peer memory, not a memory BAR, overlaps
/// RAM) does not change by asking again: `Refused`; anything else may: `Failed`.
fn p2p_map_err(op: &'static str, e: ClientError) -> crate::P2pMapError {
    let permanent = matches!(
        e.code(),
        Some(protocol::code::INVALID | protocol::code::OUT_OF_RANGE)
    );
    let e = link_err(op, e);
    if permanent {
        crate::P2pMapError::Refused(e)
    } else {
        crate::P2pMapError::Failed(e)
    }
}

/// A grant of this lease's BAR to another lender; dropping it sends P2P_REVOKE.
struct LendingGrant {
    lease: Arc<Lease>,
    grant: u64,
}

impl crate::PeerMapping for LendingGrant {}

impl Drop for LendingGrant {
    fn drop(&mut self) {
        if let Err(e) = self.lease.p2p_revoke(self.grant) {
            // The target's lender may be gone: its grants went with it.
            debug!(
                "lease {}: p2p revoke of grant {}: {e}",
                self.lease.id(),
                self.grant
            );
        }
    }
}

/// One P2P_MAP_REMOTE of the lease; dropping it sends P2P_UNMAP_REMOTE.
struct LendingRemoteMapping {
    lease: Arc<Lease>,
    lender: String,
    target: u64,
    bar: u8,
}

impl crate::PeerMapping for LendingRemoteMapping {}

impl Drop for LendingRemoteMapping {
    fn drop(&mut self) {
        if let Err(e) = self
            .lease
            .p2p_unmap_remote(&self.lender, self.target, self.bar)
        {
            warn!(
                "lease {}: p2p unmap of lease {} bar {} on {}: {e}",
                self.lease.id(),
                self.target,
                self.bar,
                self.lender
            );
        }
    }
}

/// One P2P_MAP of the lease; dropping it sends P2P_UNMAP.
struct LendingPeerMapping {
    lease: Arc<Lease>,
    target: u64,
    bar: u8,
}

impl crate::PeerMapping for LendingPeerMapping {}

impl Drop for LendingPeerMapping {
    fn drop(&mut self) {
        if let Err(e) = self.lease.p2p_unmap(self.target, self.bar) {
            warn!(
                "lease {}: p2p unmap of lease {} bar {}: {e}",
                self.lease.id(),
                self.target,
                self.bar
            );
        }
    }
}

/// Guest RAM exported and mapped at IOVA = GPA.
struct LendingDma {
    lease: Arc<Lease>,
    maps: Vec<(u64, u64, ExportedWindow)>,
}

impl DmaMapping for LendingDma {
    fn size(&self) -> u64 {
        self.maps.iter().map(|m| m.1).sum()
    }
}

impl Drop for LendingDma {
    fn drop(&mut self) {
        for (gpa, size, window) in self.maps.drain(..) {
            if self.lease.is_moved() {
                // The lease is the migration destination's: its windows replaced ours.
                drop(window);
                continue;
            }
            if let Err(e) = self.lease.unmap_dma(gpa, size) {
                warn!(
                    "lease {}: unmap dma {gpa:#x}+{size:#x}: {e}",
                    self.lease.id()
                );
            }
            drop(window);
        }
    }
}

impl RemoteDeviceLink for LendingLink {
    fn device_info(&self) -> RemoteDeviceInfo {
        self.info.clone()
    }

    fn config_read(&self, offset: u16, data: &mut [u8]) -> Result<(), LinkError> {
        let len = u16::try_from(data.len()).map_err(|_| LinkError::BadReply {
            op: "config read",
            reason: format!("{} bytes is too long", data.len()),
        })?;
        let v = self
            .lease
            .config_read(offset, len)
            .map_err(|e| link_err("config read", e))?;
        if v.len() != data.len() {
            return Err(LinkError::BadReply {
                op: "config read",
                reason: format!("{} bytes for {} asked", v.len(), data.len()),
            });
        }
        data.copy_from_slice(&v);
        Ok(())
    }

    fn config_write(&self, offset: u16, data: &[u8]) -> Result<(), LinkError> {
        self.lease
            .config_write(offset, data)
            .map_err(|e| link_err("config write", e))
    }

    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) -> Result<(), LinkError> {
        let v = self
            .lease
            .bar_read(bar, offset, data.len() as u32)
            .map_err(|e| link_err("bar read", e))?;
        if v.len() != data.len() {
            return Err(LinkError::BadReply {
                op: "bar read",
                reason: format!("{} bytes for {} asked", v.len(), data.len()),
            });
        }
        data.copy_from_slice(&v);
        Ok(())
    }

    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), LinkError> {
        let k = self
            .lease
            .bar_write_kicks(bar, offset, data)
            .map_err(|e| link_err("bar write", e))?;
        if let Some(k) = k {
            self.sink.kicks.offer(our_kicks(k));
        }
        Ok(())
    }

    fn map_dma(&self, regions: &[GuestRamRegion]) -> Result<Box<dyn DmaMapping>, LinkError> {
        let mut dma = LendingDma {
            lease: Arc::clone(&self.lease),
            maps: Vec::with_capacity(regions.len()),
        };
        for r in regions {
            let Some((file, offset)) = &r.file else {
                return Err(LinkError::Unsupported {
                    op: "dma map",
                    reason: format!("guest ram at {:#x} is not file backed", r.gpa),
                });
            };
            let label = format!("lease{}-ram{:x}", self.lease.id(), r.gpa);
            let w = self
                .client
                .endpoint()
                .export_window(file.as_fd(), *offset, r.size, &label)
                .map_err(|e| link_err("export guest ram", ClientError::Fabric(e)))?;
            let id = w.id();
            // Keep the window before mapping so a failure revokes it via `dma`'s drop.
            self.lease
                .map_dma(r.gpa, r.size, id)
                .map_err(|e| link_err("dma map", e))?;
            dma.maps.push((r.gpa, r.size, w));
        }
        Ok(Box::new(dma))
    }

    fn set_irqs(&self, t: &IrqTargets<'_>) -> Result<(), LinkError> {
        let pk = proto_kind(t.kind);
        // INTx: the lender re-asserts a still-pending line after the guest's EOI.
        let resample = t
            .resample
            .filter(|_| t.kind == IrqKind::Intx && !t.triggers.is_empty());
        let res = if self.kind == FabricKind::Shm {
            let targets: Vec<ClientIrq<'_>> =
                t.triggers.iter().map(|e| ClientIrq::EventFd(e)).collect();
            self.lease.set_irqs_resample(pk, &targets, resample)
        } else {
            let mut fds = Vec::with_capacity(t.triggers.len());
            for e in &t.triggers {
                fds.push(e.try_clone().map_err(|e| LinkError::Unsupported {
                    op: "set irqs",
                    reason: format!("duplicating an irqfd: {e}"),
                })?);
            }
            self.sink
                .relay
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(t.kind, fds);
            let targets = vec![ClientIrq::Event; t.triggers.len()];
            self.lease.set_irqs_resample(pk, &targets, resample)
        };
        res.map_err(|e| link_err("set irqs", e))
    }

    fn reset(&self) -> Result<(), LinkError> {
        let k = self.lease.reset_kicks().map_err(|e| link_err("reset", e))?;
        if let Some(k) = k {
            self.sink.kicks.offer(our_kicks(k));
        }
        Ok(())
    }

    fn kick_generation(&self) -> u64 {
        self.sink.kicks.generation()
    }

    fn kick_doorbells(&self) -> KickDoorbells {
        // Only meaningful with a notify eventfd to wire the ioeventfds to (shm); on tcp the
        // doorbells stay trapped and exact.
        if self.kind == FabricKind::Shm {
            self.sink.kicks.get()
        } else {
            KickDoorbells {
                generation: self.sink.kicks.generation(),
                ..KickDoorbells::default()
            }
        }
    }

    fn lease_state(&self) -> LeaseState {
        let s = self
            .sink
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if s == LeaseState::Active && !self.client.endpoint().is_up() {
            return LeaseState::Lost("link down".into());
        }
        s
    }

    fn set_event_hook(&self, hook: Arc<dyn LinkEventHook>) {
        self.sink.set_hook(hook);
        // `lease_state` already answers Lost once the endpoint is down, possibly before the
        // event thread has recorded the loss: a hook set in that window is told now too
        // (`lost` records once and reports once, whoever comes first).
        if !self.client.endpoint().is_up() {
            self.sink.lost("link down".into());
        }
    }

    fn lender_counters(&self) -> Result<Option<LenderCounters>, LinkError> {
        let c = self
            .lease
            .counters()
            .map_err(|e| link_err("lease counters", e))?;
        Ok(c.map(|c| LenderCounters {
            dma_bytes_read: c.dma_bytes_read,
            dma_bytes_written: c.dma_bytes_written,
            iommu_faults: c.iommu_faults,
            doorbell_kicks: c.doorbell_kicks,
            msix: c.msix,
            intx: c.intx,
        }))
    }

    fn quiesce(&self, stop: bool) -> Result<(), LinkError> {
        self.lease.quiesce(stop).map_err(|e| link_err("quiesce", e))
    }

    fn p2p_port(&self) -> Option<Arc<dyn crate::P2pPort>> {
        self.p2p.clone().map(|p| p as Arc<dyn crate::P2pPort>)
    }

    fn migration(&self) -> Option<Arc<dyn LeaseMigration>> {
        (self.client.protocol_version() >= lending::protocol::migration::MIGRATION_VERSION).then(
            || {
                Arc::new(LendingMigration {
                    lease: Arc::clone(&self.lease),
                }) as Arc<dyn LeaseMigration>
            },
        )
    }

    fn irq_counts(&self) -> Option<Vec<u64>> {
        (self.kind == FabricKind::Tcp).then(|| {
            self.sink
                .counts
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sink(lease: u64) -> LendingEventSink {
        LendingEventSink {
            lease,
            kicks: Arc::default(),
            state: Arc::new(Mutex::new(LeaseState::Active)),
            hook: Arc::default(),
            reporting: Arc::default(),
            relay: Arc::default(),
            counts: Arc::default(),
            wakeups: Arc::default(),
        }
    }

    fn state(s: &LendingEventSink) -> LeaseState {
        s.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// A lease moved by live migration is handled but not lost; a gone device is lost.
    #[test]
    fn lease_moved_is_not_a_lost_device() {
        let s = sink(7);
        let moved = Event::LeaseMoved(protocol::LeaseMoved {
            lease: 7,
            to: "node2/vm0".into(),
        });
        assert!(s.handle(&moved));
        assert_eq!(state(&s), LeaseState::Active);
        let other = Event::LeaseMoved(protocol::LeaseMoved {
            lease: 8,
            to: "node2/vm0".into(),
        });
        assert!(!s.handle(&other), "another lease's event is not ours");
        let gone = Event::DeviceGone(protocol::DeviceGone {
            lease: 7,
            reason: "x".into(),
        });
        assert!(s.handle(&gone));
        assert!(matches!(state(&s), LeaseState::Lost(_)));
    }
}
