//! [`RemoteDeviceLink`] over `lending::client`: a [`Lease`] from a [`LenderClient`].
//!
//! * Sessions ([`session`]): every lease a VM borrows from one lender travels over one
//!   [`LenderSession`] (one connection, one event pump, one export of guest RAM).
//! * BARs with a fabric window are mapped into this process (shm) and reported as
//!   `Direct`; the windows stay mapped until the link is dropped. On tcp (no direct
//!   mappings) and for BARs without a window, accesses are `Trapped` (BAR_READ/BAR_WRITE).
//! * Write notification, per BAR (`BarDesc.notify`, protocol version 2): `None` maps the
//!   window read-write (VFIO BARs); `Doorbells` maps it read-only, stores inside the doorbell
//!   range are stored + notified through the lease's notify eventfd and every other store
//!   (control registers) goes to the lender's exact BAR_WRITE; `All` (a version 1 lender:
//!   every window of a lease with a notify eventfd) stores + notifies every store. A BAR
//!   that needs notification on a lease without a notify eventfd is trapped.
//! * DMA: guest RAM (memfd backed) is exported once per session and each lease maps that
//!   export at IOVA = GPA; the returned handle unmaps the lease's mappings on drop and lets
//!   go of its share of the export (the last share revokes it).
//! * Interrupts: on shm the irqfd eventfds are passed (SCM_RIGHTS) so the device signals KVM
//!   directly; on tcp the lender sends IRQ events that the session's pump turns into eventfd
//!   writes (counted per vector). The same pump watches for DeviceGone/Fatal. INTx's
//!   resample eventfd goes to the lender too (passed on shm, forwarded as events by the
//!   client on tcp), so a still-pending INTx is asserted again after the guest's EOI.
//! * Teardown: the pump blocks without a timeout on the client's event channel; dropping
//!   the session wakes it ([`EventWaker`]) and joins it, so nothing waits for a polling
//!   interval.
//! * Lease events ([`RemoteDeviceLink::set_event_hook`], [`events`]): the pump marks the
//!   lease lost on DeviceGone, and every lease of the session on the link going down or an
//!   event relay failure; the hook's `lease_lost` is called exactly once per lease (at once
//!   from `set_event_hook` if the loss came first); IommuFault events (protocol version 3) go
//!   to `iommu_fault`. A session without a pump
//!   ([`LendingLinkOptions::own_event_thread`] = false) delivers only what is fed to
//!   [`LendingLink::event_sink`].
//! * Counters and quiesce: one control-protocol round trip each (protocol version 3);
//!   `lender_counters` is `Ok(None)` and `quiesce` `Unsupported` with an older lender.
//! * Migration ([`migration`]) and peer-to-peer ([`p2p`]) requests of the lease.

mod events;
mod migration;
mod p2p;
pub mod session;

use std::sync::{Arc, PoisonError};

use lending::client::{ClientError, ClientIrq, Lease, LenderClient};
use lending::protocol::{self, NotifyWrites};
use log::{debug, info, warn};
use ntb::{FabricError, FabricKind, PeerWindow};
use pci::vm_ops::GuestRamRegion;

pub use events::LendingEventSink;
use migration::{DmaRanges, LendingMigration};
use p2p::LendingP2p;
pub use session::{LenderSession, SessionCounters, SessionOptions};
use session::{RamExport, Registration};

use crate::link::{
    BarAccess, BarKind, DirectWindow, DmaMapping, IrqKind, IrqTargets, KickDoorbells,
    LeaseMigration, LeaseState, LenderCounters, LinkError, LinkEventHook, RemoteBar,
    RemoteDeviceInfo, RemoteDeviceLink, RemoteMsix,
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
    #[error("starting the event pump: {0}")]
    Thread(#[source] std::io::Error),
    #[error("duplicating the notify eventfd: {0}")]
    Notify(#[source] std::io::Error),
    #[error("waking the event pump: {0}")]
    Waker(#[source] ClientError),
}

/// Options of [`LendingLink::new`].
#[derive(Clone, Copy, Debug)]
pub struct LendingLinkOptions {
    /// Run a thread that receives the connection's events (IRQ relay, device gone): the
    /// session's event pump ([`SessionOptions::event_pump`]).
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

/// A lease as a [`RemoteDeviceLink`].
pub struct LendingLink {
    // Field order is drop order: the lease leaves the session's event dispatch, BAR windows
    // are unmapped, the lease (last reference) is returned, then the session is let go (the
    // last link of a session closes its connection).
    _registration: Registration,
    _windows: Vec<Box<dyn PeerWindow>>,
    sink: LendingEventSink,
    info: RemoteDeviceInfo,
    kind: FabricKind,
    /// Peer-to-peer side (lenders of protocol version 5 and later).
    p2p: Option<Arc<LendingP2p>>,
    /// What the lease has mapped for DMA (the dirty log is fetched over these).
    dma_ranges: DmaRanges,
    lease: Arc<Lease>,
    session: Arc<LenderSession>,
}

impl LendingLink {
    /// Wraps `lease` (borrowed through `client`, which serves no other lease) in a session
    /// of its own: maps its BAR windows and, with `opts.own_event_thread`, starts the
    /// session's event pump.
    pub fn new(
        client: Arc<LenderClient>,
        lease: Lease,
        opts: LendingLinkOptions,
    ) -> Result<Self, LendingLinkError> {
        let session = LenderSession::shared(
            client,
            SessionOptions {
                event_pump: opts.own_event_thread,
                counters: None,
            },
        )?;
        Self::in_session(session, lease)
    }

    /// Wraps `lease`, borrowed through `session`'s client: maps its BAR windows and routes
    /// the lease's events from the session's pump.
    pub fn in_session(session: Arc<LenderSession>, lease: Lease) -> Result<Self, LendingLinkError> {
        let client = Arc::clone(session.client());
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
        let sink = session.sink(lease.id());
        let registration = session.register(&sink);
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
                    && kind.is_networked(),
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
            _registration: registration,
            _windows: windows,
            sink,
            info,
            kind,
            p2p,
            dma_ranges: DmaRanges::default(),
            lease,
            session,
        })
    }

    /// For an external event pump (a session without its own): feed it every event of this
    /// lease.
    pub fn event_sink(&self) -> LendingEventSink {
        self.sink.clone()
    }

    /// The lease.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// The session the lease travels over.
    pub fn session(&self) -> &Arc<LenderSession> {
        &self.session
    }
}

/// The session's export of guest RAM, mapped into this lease's IOMMU domain at IOVA = GPA.
struct LendingDma {
    lease: Arc<Lease>,
    /// (GPA, size) mapped so far.
    maps: Vec<(u64, u64)>,
    /// The lease's DMA ranges (read by its migration side): ours are in it while mapped.
    published: DmaRanges,
    /// Shared with the session's other leases; revoked after the last one unmaps.
    _export: Arc<RamExport>,
}

impl DmaMapping for LendingDma {
    fn size(&self) -> u64 {
        self.maps.iter().map(|m| m.1).sum()
    }
}

impl Drop for LendingDma {
    fn drop(&mut self) {
        let maps = std::mem::take(&mut self.maps);
        self.published
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|r| !maps.contains(r));
        if self.lease.is_moved() {
            // The lease is the migration destination's: its windows replaced ours.
            return;
        }
        for (gpa, size) in maps {
            if let Err(e) = self.lease.unmap_dma(gpa, size) {
                warn!(
                    "lease {}: unmap dma {gpa:#x}+{size:#x}: {e}",
                    self.lease.id()
                );
            }
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
        let export = self.session.ram_export(regions)?;
        let mut dma = LendingDma {
            lease: Arc::clone(&self.lease),
            maps: Vec::new(),
            published: Arc::clone(&self.dma_ranges),
            _export: Arc::clone(&export),
        };
        for (gpa, size, id) in export.windows() {
            // Each mapping is recorded as it succeeds: a failure unmaps the earlier ones
            // through `dma`'s drop.
            self.lease
                .map_dma(gpa, size, id)
                .map_err(|e| link_err("dma map", e))?;
            dma.maps.push((gpa, size));
            dma.published
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((gpa, size));
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
        if s == LeaseState::Active && !self.session.client().endpoint().is_up() {
            return LeaseState::Lost("link down".into());
        }
        s
    }

    fn set_event_hook(&self, hook: Arc<dyn LinkEventHook>) {
        self.sink.set_hook(hook);
        // `lease_state` already answers Lost once the endpoint is down, possibly before the
        // event pump has recorded the loss: a hook set in that window is told now too
        // (`lost` records once and reports once, whoever comes first).
        if !self.session.client().endpoint().is_up() {
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
            commands: c.commands,
            invalid_doorbells: c.invalid_doorbells,
            bad_prps: c.bad_prps,
        }))
    }

    fn quiesce(&self, stop: bool) -> Result<(), LinkError> {
        self.lease.quiesce(stop).map_err(|e| link_err("quiesce", e))
    }

    fn p2p_port(&self) -> Option<Arc<dyn crate::P2pPort>> {
        self.p2p.clone().map(|p| p as Arc<dyn crate::P2pPort>)
    }

    fn migration(&self) -> Option<Arc<dyn LeaseMigration>> {
        (self.session.client().protocol_version()
            >= lending::protocol::migration::MIGRATION_VERSION)
            .then(|| {
                Arc::new(LendingMigration {
                    lease: Arc::clone(&self.lease),
                    ranges: Arc::clone(&self.dma_ranges),
                }) as Arc<dyn LeaseMigration>
            })
    }

    fn irq_counts(&self) -> Option<Vec<u64>> {
        self.kind.is_networked().then(|| {
            self.sink
                .counts
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone()
        })
    }
}
