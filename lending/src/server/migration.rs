//! The lender's part of live migration (protocol version 4, [`crate::protocol::migration`]):
//! the device dirty log, the hand-over quiesce and the atomic lease transfer.
//!
//! A lease belongs to the session (link) that holds it, and only that session's thread
//! touches it. A transfer therefore goes through the [`Transfers`] registry: the source
//! creates a ticket (a random secret naming the destination); the destination's session
//! checks the ticket and posts a hand-off to the source session, whose loop
//! ([`Session::serve_handoffs`], every [`HANDOFF_POLL`] while the session has a ticket out)
//! moves the `SessionLease` into
//! the hand-off slot and tells its borrower [`LeaseMoved`]; the destination re-points the
//! lease at its own link (DMA windows at the same IOVAs, interrupt targets, BAR windows,
//! notify eventfd). The device is never reset: its state, its queues and the interrupts held
//! by the hand-over quiesce stay. The slot is decided under one lock: either the destination
//! takes the lease, or (it gave up waiting) the source keeps it; nothing is dropped between.
//!
//! Leases are not persisted: a lender that dies mid-hand-over loses every lease as usual
//! (the source sees the link go down), and restarts with every device available.

use std::collections::HashMap;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ntb::wire::ErrorReply;
use ntb::{FabricKind, Message};

use super::{
    backend_err, iommu_err, kick_listener, ok, proto_err, DmaEntry, FaultRelay, FaultRelayGuard,
    Reply, Session, SessionLease,
};
use crate::auth;
use crate::backend::config::virtualized_info;
use crate::iommu::{DirtyLogError, DmaBacking, IommuError, IOMMU_PAGE_SIZE};
use crate::protocol::migration::{code as mcode, TICKET_LEN};
use crate::protocol::{
    self, code, error, Borrowed, DirtyBitmap, DirtyLogFetch, DirtyLogStarted, Event,
    HandoverQuiesced, IrqKind, LeaseMoved, LeaseRef, QuiesceHandover, SetIrqs, TransferAccept,
    TransferCreate, TransferTicket,
};

/// How long a transfer ticket stays valid (default; [`super::Lender::set_ticket_ttl`]).
pub const TICKET_TTL: Duration = Duration::from_secs(30);
/// How long the destination waits for the source session to hand the lease over.
const HANDOFF_WAIT: Duration = Duration::from_secs(2);
/// How often a session with a transfer ticket out looks for a destination's accept.
pub(super) const HANDOFF_POLL: Duration = Duration::from_millis(2);

struct Ticket {
    secret: [u8; TICKET_LEN],
    to_node: String,
    to_vm: String,
    expires: Instant,
    /// The source session.
    session: u64,
    /// The leased device.
    device: String,
}

enum Slot {
    /// The destination waits for the source session.
    Waiting,
    /// The source moved the lease here.
    Delivered(Box<SessionLease>),
    /// The destination gave up: the source keeps the lease.
    Abandoned,
    /// The source no longer holds the lease (returned, ended, link down).
    Refused(String),
}

struct Handoff {
    lease: u64,
    /// `node/vm` of the destination.
    to: String,
    slot: Arc<(Mutex<Slot>, Condvar)>,
}

/// Transfer tickets and hand-offs of one lender.
#[derive(Default)]
pub(crate) struct Transfers {
    tickets: Mutex<HashMap<u64, Ticket>>,
    /// Source session id → hand-offs it must serve.
    handoffs: Mutex<HashMap<u64, Vec<Handoff>>>,
    /// TRANSFER_ACCEPTs refused (bad, expired, replayed or misdirected tickets).
    refused: AtomicU64,
    /// Leases moved.
    moved: AtomicU64,
    /// DMA windows a moved lease kept, rebound to the destination's view of the same memory.
    kept: AtomicU64,
    next_session: AtomicU64,
    /// Ticket lifetime in milliseconds (0: [`TICKET_TTL`]).
    ttl_ms: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Transfers {
    /// A fresh session id.
    pub(crate) fn session_id(&self) -> u64 {
        self.next_session.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn ttl(&self) -> Duration {
        match self.ttl_ms.load(Ordering::Relaxed) {
            0 => TICKET_TTL,
            ms => Duration::from_millis(ms),
        }
    }

    /// Whether `session` has a transfer ticket out (or a hand-off to serve).
    pub(crate) fn has_ticket(&self, session: u64) -> bool {
        lock(&self.tickets).values().any(|t| t.session == session)
            || lock(&self.handoffs).contains_key(&session)
    }

    /// TRANSFER_ACCEPTs refused so far.
    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Leases moved so far.
    pub(crate) fn moved(&self) -> u64 {
        self.moved.load(Ordering::Relaxed)
    }

    /// DMA windows kept across transfers so far.
    pub(crate) fn kept(&self) -> u64 {
        self.kept.load(Ordering::Relaxed)
    }

    /// Forgets the tickets and pending hand-offs of a session that ended (its leases end with
    /// it) or of one lease (returned or ended).
    pub(crate) fn forget(&self, session: u64, lease: Option<u64>, why: &str) {
        lock(&self.tickets).retain(|&l, t| !(t.session == session && lease.is_none_or(|x| x == l)));
        let mut h = lock(&self.handoffs);
        if let Some(v) = h.get_mut(&session) {
            v.retain(|x| {
                if lease.is_some_and(|l| l != x.lease) {
                    return true;
                }
                let (m, c) = &*x.slot;
                let mut s = lock(m);
                if matches!(*s, Slot::Waiting) {
                    *s = Slot::Refused(why.to_string());
                    c.notify_all();
                }
                false
            });
            if v.is_empty() {
                h.remove(&session);
            }
        }
    }

    fn refuse(&self, peer: &str, lease: u64, why: &str) -> ErrorReply {
        let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        // A peer can repeat this at will: first 16, then one in 1024.
        if n <= 16 || n.is_multiple_of(1024) {
            log::warn!("{peer}: transfer of lease {lease} refused: {why} (refusal #{n})");
        }
        error(
            mcode::BAD_TICKET,
            format!("transfer of lease {lease} refused: {why}"),
        )
    }
}

impl SessionLease {
    /// Stops the dirty log if this lease started it (the lease ends or moves).
    pub(super) fn stop_dirty_log(&mut self) {
        if self.dirty_log {
            self.lease.backend().domain().stop_dirty_log();
            self.dirty_log = false;
        }
    }

    /// DMA_MAP of `[iova, iova + size)` onto `backing` by the new holder of a moved lease:
    /// if the previous holder's parked mapping of exactly that range is the same memory
    /// (the memfd fast path), it is kept — rebound, never absent — and `true` returned.
    /// Otherwise this is a copied migration: every parked mapping is unmapped (the caller
    /// maps the new window), so the device never reaches the old holder's memory again.
    pub(super) fn map_over_parked(
        &mut self,
        lender: &super::Lender,
        lease: u64,
        iova: u64,
        size: u64,
        backing: &Arc<dyn DmaBacking>,
    ) -> bool {
        let Some(i) = self.parked.iter().position(|&p| p == (iova, size)) else {
            self.unmap_parked(lease, "the new holder maps another range");
            return false;
        };
        match self
            .lease
            .backend()
            .domain()
            .rebind(iova, size, Arc::clone(backing))
        {
            Ok(()) => {
                self.parked.swap_remove(i);
                lender.transfers.kept.fetch_add(1, Ordering::Relaxed);
                log::info!("lease {lease}: kept 1 dma window(s) across the transfer (same memory)");
                return true;
            }
            Err(IommuError::NotSameMemory { .. }) => {}
            Err(e) => log::warn!("lease {lease}: keeping the window at {iova:#x}: {e}"),
        }
        self.unmap_parked(lease, "the new holder maps other memory");
        false
    }

    /// Unmaps what is left of the previous holder's mappings (`why`: for the log).
    pub(super) fn unmap_parked(&mut self, lease: u64, why: &str) {
        if self.parked.is_empty() {
            return;
        }
        let dom = self.lease.backend().domain();
        let n = self.parked.len();
        for (iova, size) in self.parked.drain(..) {
            if let Err(e) = dom.unmap(iova, size) {
                log::warn!(
                    "lease {lease}: unmapping the previous holder's window at {iova:#x}: {e}"
                );
            }
        }
        log::info!("lease {lease}: the previous holder's {n} dma window(s) unmapped ({why})");
    }
}

impl Session {
    /// Handles a version 4 migration request (`None`: not one).
    pub(super) fn dispatch_migration(
        &mut self,
        op: u16,
        req: &protocol::Request,
        fds: &mut Vec<OwnedFd>,
    ) -> Option<Reply> {
        use protocol::Request as R;
        Some(match req {
            R::DirtyLogStart(l) => self.dirty_log_start(op, *l),
            R::DirtyLogFetch(f) => self.dirty_log_fetch(op, *f),
            R::DirtyLogStop(l) => self
                .lease(l.lease)
                .map(|sl| {
                    sl.stop_dirty_log();
                })
                .and_then(|()| ok(op, &())),
            R::QuiesceHandover(q) => self.quiesce_handover(op, *q),
            R::TransferCreate(t) => self.transfer_create(op, t),
            R::TransferCancel(l) => self.lease(l.lease).map(|_| ()).and_then(|()| {
                self.lender.transfers.forget(
                    self.id,
                    Some(l.lease),
                    "transfer cancelled by the source",
                );
                log::info!("lease {}: transfer cancelled by the source", l.lease);
                ok(op, &())
            }),
            R::TransferAccept(a) => self.transfer_accept(op, a, std::mem::take(fds)),
            _ => return None,
        })
    }

    fn dirty_log_start(&mut self, op: u16, l: LeaseRef) -> Reply {
        let sl = self.lease(l.lease)?;
        let exact = sl.lease.backend().domain().start_dirty_log();
        sl.dirty_log = true;
        log::info!(
            "lease {}: device dirty log started ({})",
            l.lease,
            if exact { "exact" } else { "whole window" }
        );
        ok(op, &DirtyLogStarted { exact })
    }

    fn dirty_log_fetch(&mut self, op: u16, f: DirtyLogFetch) -> Reply {
        let sl = self.lease(f.lease)?;
        if !sl.dirty_log {
            return Err(error(
                mcode::DIRTY_LOG_OFF,
                format!("lease {}: dirty log not started", f.lease),
            ));
        }
        sl.lease.count_dirty_log_fetch();
        let (iova, len) = if f.len == 0 {
            let lo = sl.maps.iter().map(|e| e.iova).min();
            let hi = sl.maps.iter().map(|e| e.iova + e.size).max();
            match (lo, hi) {
                (Some(lo), Some(hi)) => (lo, hi - lo),
                _ => {
                    return Err(error(
                        code::INVALID,
                        format!("lease {}: no dma window mapped", f.lease),
                    ))
                }
            }
        } else {
            (f.iova, f.len)
        };
        let d = sl
            .lease
            .backend()
            .domain()
            .fetch_dirty(iova, len)
            .map_err(|e| match e {
                DirtyLogError::NotStarted => error(mcode::DIRTY_LOG_OFF, e.to_string()),
                DirtyLogError::BadRange { .. } => error(code::INVALID, e.to_string()),
            })?;
        ok(
            op,
            &DirtyBitmap {
                iova: d.iova,
                pages: d.pages,
                bits: d.bits,
                whole_window: d.whole_window,
            },
        )
    }

    fn quiesce_handover(&mut self, op: u16, q: QuiesceHandover) -> Reply {
        let sl = self.lease(q.lease)?;
        let d = sl
            .lease
            .backend()
            .quiesce_handover(Duration::from_millis(u64::from(q.timeout_ms)))
            .map_err(backend_err)?;
        log::info!(
            "lease {}: quiesced for hand-over: drained {}, pending msi-x {:?}, intx {}",
            q.lease,
            d.drained,
            d.pending_msix,
            d.pending_intx
        );
        ok(
            op,
            &HandoverQuiesced {
                drained: d.drained,
                pending_msix: d.pending_msix,
                pending_intx: d.pending_intx,
            },
        )
    }

    fn transfer_create(&mut self, op: u16, t: &TransferCreate) -> Reply {
        let device = self.lease(t.lease)?.lease.device().id().to_string();
        let secret = auth::nonce().map_err(|e| error(code::INTERNAL, e.to_string()))?;
        let mut tickets = lock(&self.lender.transfers.tickets);
        let now = Instant::now();
        let ttl = self.lender.transfers.ttl();
        tickets.retain(|_, x| x.expires > now);
        if tickets.contains_key(&t.lease) {
            return Err(error(
                mcode::TRANSFER_PENDING,
                format!(
                    "lease {} already has a transfer ticket; cancel it first",
                    t.lease
                ),
            ));
        }
        tickets.insert(
            t.lease,
            Ticket {
                secret,
                to_node: t.to_node.clone(),
                to_vm: t.to_vm.clone(),
                expires: now + ttl,
                session: self.id,
                device,
            },
        );
        log::info!(
            "lease {}: transfer ticket for {}/{} (valid {ttl:?})",
            t.lease,
            t.to_node,
            t.to_vm,
        );
        ok(
            op,
            &TransferTicket {
                lease: t.lease,
                ticket: secret.to_vec(),
                expires_in_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
            },
        )
    }

    /// Checks the ticket and takes it (single use), posting the hand-off `h` to the source
    /// session under the same lock (so the source never looks without seeing either).
    fn take_ticket(&self, a: &TransferAccept, h: Handoff) -> Result<(), ErrorReply> {
        let peer = self.peer();
        let tr = &self.lender.transfers;
        let mut tickets = lock(&tr.tickets);
        let Some(t) = tickets.get(&a.lease) else {
            return Err(tr.refuse(
                &peer,
                a.lease,
                "no transfer ticket for it (never created, cancelled, used or expired)",
            ));
        };
        if !crate::auth::same_secret(&t.secret, &a.ticket) {
            return Err(tr.refuse(&peer, a.lease, "the ticket does not match"));
        }
        if t.expires <= Instant::now() {
            tickets.remove(&a.lease);
            return Err(tr.refuse(&peer, a.lease, "the ticket expired"));
        }
        if t.to_node != peer || t.to_vm != a.vm {
            return Err(tr.refuse(
                &peer,
                a.lease,
                &format!(
                    "the ticket names {}/{}, presented by {peer}/{}",
                    t.to_node, t.to_vm, a.vm
                ),
            ));
        }
        if t.session == self.id {
            return Err(tr.refuse(&peer, a.lease, "presented on the source's own link"));
        }
        // A well-formed accept that cannot be applied is refused before the ticket is used.
        let vectors = self
            .lender
            .inventory()
            .get(&t.device)
            .map(|d| d.backend().describe(&t.device).irqs.msix)
            .unwrap_or(0);
        if a.msix.len() > vectors as usize {
            return Err(error(
                code::INVALID,
                format!(
                    "{} msi-x targets for {}, which has {vectors} vectors",
                    a.msix.len(),
                    t.device
                ),
            ));
        }
        let session = t.session;
        lock(&tr.handoffs).entry(session).or_default().push(h);
        tickets.remove(&a.lease);
        Ok(())
    }

    fn transfer_accept(&mut self, op: u16, a: &TransferAccept, fds: Vec<OwnedFd>) -> Reply {
        // Everything that can fail on our side is checked before the source lets go.
        let mut wins = Vec::new();
        let mut sorted: Vec<_> = a.maps.clone();
        sorted.sort_by_key(|m| m.iova);
        for (i, m) in sorted.iter().enumerate() {
            if !m.iova.is_multiple_of(IOMMU_PAGE_SIZE) || !m.size.is_multiple_of(IOMMU_PAGE_SIZE) {
                return Err(error(
                    code::INVALID,
                    format!(
                        "window at iova {:#x} size {:#x} is not page aligned",
                        m.iova, m.size
                    ),
                ));
            }
            if sorted.get(i + 1).is_some_and(|n| n.iova < m.iova + m.size) {
                return Err(error(
                    code::INVALID,
                    format!("windows overlap at iova {:#x}", m.iova),
                ));
            }
            // Shared with the session's other leases that map the same window.
            let w = self.peer_window(m.window)?;
            if w.size() < m.size {
                return Err(error(
                    code::INVALID,
                    format!(
                        "window {} is {:#x} bytes, smaller than {:#x}",
                        m.window,
                        w.size(),
                        m.size
                    ),
                ));
            }
            wins.push((*m, w));
        }
        // Interrupt targets are built (eventfds, doorbell bits checked) before the ticket is
        // used, and their number checked against the device.
        let irqs = SetIrqs {
            lease: a.lease,
            kind: IrqKind::Msix,
            targets: a.msix.clone(),
            resample: protocol::IrqTarget::None,
        };
        let mut fds: Vec<Option<OwnedFd>> = fds.into_iter().map(Some).collect();
        let triggers = self.irq_triggers(&irqs, &mut fds)?;
        let to = format!("{}/{}", self.peer(), a.vm);
        let slot = Arc::new((Mutex::new(Slot::Waiting), Condvar::new()));
        self.take_ticket(
            a,
            Handoff {
                lease: a.lease,
                to: to.clone(),
                slot: Arc::clone(&slot),
            },
        )?;
        let mut sl = {
            let (m, c) = &*slot;
            let deadline = Instant::now() + HANDOFF_WAIT;
            let mut s = lock(m);
            loop {
                match std::mem::replace(&mut *s, Slot::Waiting) {
                    Slot::Delivered(sl) => break sl,
                    Slot::Refused(why) => {
                        return Err(error(
                            code::UNKNOWN_LEASE,
                            format!("lease {}: {why}", a.lease),
                        ))
                    }
                    Slot::Abandoned | Slot::Waiting => {}
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    *s = Slot::Abandoned;
                    return Err(error(
                        code::BUSY,
                        format!(
                            "lease {}: the source did not hand it over within {HANDOFF_WAIT:?}; \
                             it keeps the lease",
                            a.lease
                        ),
                    ));
                }
                s = match c.wait_timeout(s, left) {
                    Ok((g, _)) => g,
                    Err(p) => p.into_inner().0,
                };
            }
        };
        // The lease is ours now: re-point it at this link. The device keeps running state.
        let id = a.lease;
        let backend = Arc::clone(sl.lease.backend());
        let dom = backend.domain();
        sl.stop_dirty_log();
        sl.resample = None;
        backend.clear_irqs();
        // The source's mappings are parked, and each destination window goes the way of a
        // DMA_MAP after a transfer ([`SessionLease::map_over_parked`]): one that is the
        // source's memory at the same range (the memfd fast path: the same file and range,
        // by `PeerWindow::backing_id`) keeps its mapping — the domain swaps the backing, no
        // IOMMU unmap and re-pin, no gap in which DMA faults — and anything else unmaps
        // what is parked and maps anew. A destination that names no windows here maps them
        // after the accept (lendvm does, when the guest's Bus Master Enable is replayed):
        // the source's mappings stay parked, with Bus Master off, until then, or until the
        // device resumes.
        sl.parked
            .extend(sl.maps.drain(..).map(|e| (e.iova, e.size)));
        let mut map_err = None;
        for (m, w) in wins {
            let backing: Arc<dyn DmaBacking> = w;
            if !sl.map_over_parked(&self.lender, id, m.iova, m.size, &backing) {
                if let Err(e) = dom.map(m.iova, m.size, backing) {
                    log::error!("lease {id}: mapping the destination's window: {e}");
                    map_err.get_or_insert(iommu_err(e));
                    continue;
                }
            }
            sl.maps.push(DmaEntry {
                iova: m.iova,
                size: m.size,
                window: m.window,
            });
        }
        if a.maps.is_empty() {
            if !sl.parked.is_empty() {
                log::info!(
                    "lease {id}: the source's {} dma window(s) stay mapped until this \
                     borrower maps its own (kept if the same memory)",
                    sl.parked.len()
                );
            }
        } else {
            sl.unmap_parked(id, "the destination mapped its own windows");
        }
        if let Err(e) = backend.set_bus_master(!sl.maps.is_empty()) {
            log::warn!("lease {id}: bus master after transfer: {e}");
        }
        let baseline_faults = sl.baseline.iommu_faults;
        // The old guard removes the domain's listener when dropped: before the new one.
        sl._faults = None;
        sl._faults = Some({
            dom.set_fault_listener(Some(Arc::new(FaultRelay {
                ep: Arc::downgrade(&self.ep),
                lease: id,
                base: baseline_faults,
                limit: Mutex::default(),
            })));
            FaultRelayGuard {
                domain: Arc::clone(&dom),
            }
        });
        sl.kicks_told = Arc::new(AtomicU64::new(0));
        backend.set_kick_listener(Some(kick_listener(&self.ep, &backend, id, &sl.kicks_told)));
        let peer = self.peer();
        sl.lease.set_holder(&peer, &a.vm);
        sl.audit.rehold(&format!("{peer}/{}", a.vm));
        sl.lease.watch_holder(&self.ep);
        // Peer-to-peer: the source borrower's mappings (of other leases and into this one)
        // end here; the destination maps again under its own identity.
        sl.p2p_out.clear();
        let holder = self.p2p_holder(&sl.lease);
        sl.p2p.rehold(&holder);
        // BAR windows: exported on this link; the source's are revoked.
        let mut info = virtualized_info(backend.as_ref(), sl.lease.device().id());
        let mut bar_windows = HashMap::new();
        let mut exported = Vec::new();
        let mut paths = Vec::new();
        for b in info.bars.iter_mut() {
            let Some(x) = backend.bar_export(b.index) else {
                paths.push((b.index, super::BarPath::Trapped));
                continue;
            };
            let label = format!("lease{id}-bar{}", b.index);
            match super::bars::export(self.ep.as_ref(), &x, &label) {
                Ok((w, path)) => {
                    b.window = Some(w.id());
                    bar_windows.insert(b.index, w.id());
                    exported.push(w);
                    paths.push((b.index, path));
                }
                Err(e) => {
                    log::error!("lease {id}: exporting bar {}: {e}", b.index);
                    map_err.get_or_insert(error(
                        code::INTERNAL,
                        format!("exporting bar {} as a fabric window: {e}", b.index),
                    ));
                }
            }
        }
        super::bars::log_paths(id, sl.lease.device().id(), &paths);
        sl.lease.set_bar_paths(paths);
        sl.lease.replace_bar_windows(exported);
        sl.bar_windows = bar_windows;
        let mut out_fds = Vec::new();
        let mut notify_fd = None;
        if self.ep.kind() == FabricKind::Shm {
            if let Some(n) = backend.notify_eventfd() {
                // SAFETY: `into_raw_fd` hands over sole ownership of a valid eventfd.
                out_fds.push(unsafe { OwnedFd::from_raw_fd(n.into_raw_fd()) });
                notify_fd = Some(0);
            }
        }
        self.leases.insert(id, *sl);
        self.lender.transfers.moved.fetch_add(1, Ordering::Relaxed);
        log::info!("lease {id}: transferred to {to}; device not reset");
        if !triggers.is_empty() {
            if let Err(e) = backend.set_irqs(IrqKind::Msix, triggers) {
                log::error!("lease {id}: wiring the destination's interrupts: {e}");
                map_err.get_or_insert(backend_err(e));
            }
        }
        if let Some(e) = map_err {
            return Err(e);
        }
        let reply = Borrowed {
            lease: id,
            info,
            notify_fd,
            notify_doorbell: None,
        };
        protocol::encode_borrowed(&reply, self.version)
            .map(|p| Message::raw(op, p).with_fds(out_fds))
            .map_err(proto_err)
    }

    /// Hands the leases that destinations accepted over to them (called by the session loop).
    pub(super) fn serve_handoffs(&mut self) {
        let pending = lock(&self.lender.transfers.handoffs).remove(&self.id);
        for h in pending.into_iter().flatten() {
            let (m, c) = &*h.slot;
            let mut s = lock(m);
            if !matches!(*s, Slot::Waiting) {
                continue;
            }
            match self.leases.remove(&h.lease) {
                Some(mut sl) => {
                    sl.stop_dirty_log();
                    *s = Slot::Delivered(Box::new(sl));
                    c.notify_all();
                    drop(s);
                    log::info!("lease {}: handed over to {}", h.lease, h.to);
                    let ev = Event::LeaseMoved(LeaseMoved {
                        lease: h.lease,
                        to: h.to.clone(),
                    });
                    if let Ok((op, p)) = ev.encode() {
                        if let Err(e) = self.ep.send(Message::raw(op, p)) {
                            log::debug!("lease-moved event: {e}");
                        }
                    }
                }
                None => {
                    *s = Slot::Refused("the source no longer holds it".into());
                    c.notify_all();
                }
            }
        }
    }
}

impl super::Lender {
    /// TRANSFER_ACCEPTs refused so far (bad, expired, replayed or misdirected tickets).
    pub fn transfers_refused(&self) -> u64 {
        self.transfers.refused()
    }

    /// Leases moved between borrowers so far.
    pub fn transfers_done(&self) -> u64 {
        self.transfers.moved()
    }

    /// DMA windows that moved leases kept so far: the destination's window was the source's
    /// memory (the memfd fast path), so the mapping stayed and only its backing changed.
    pub fn dma_windows_kept(&self) -> u64 {
        self.transfers.kept()
    }

    /// How long transfer tickets created from now on stay valid (default [`TICKET_TTL`];
    /// tests shorten it). Zero restores the default.
    pub fn set_ticket_ttl(&self, ttl: Duration) {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        self.transfers.ttl_ms.store(ms, Ordering::Relaxed);
    }
}
