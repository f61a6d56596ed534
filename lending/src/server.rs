//! lenderd's control-protocol server: one thread per fabric link (borrower session).
//!
//! A session must start with AUTH and a HELLO carrying the borrower's proof of the cluster
//! token (mutual challenge–response, [`crate::auth`]); a missing or wrong proof gets a
//! `bad token` error and the link is closed, and an address that fails too often is refused
//! for a while ([`crate::auth::FailureLimiter`]). Every lease belongs to the session that took
//! it; when the link goes down (orderly close, process death, or missed heartbeats detected by
//! the fabric within its peer timeout) the session ends and its leases are dropped, which
//! gives the devices back (see [`crate::inventory::Lease`]).
//!
//! How long a dead borrower's lease lasts: the link's end is seen at once on an orderly close
//! or a killed process (the socket closes), else within the link's `peer_timeout` of its last
//! heartbeat; the session then ends its leases after the request it is serving, if any (one
//! at a time per session; the long one is a DMA map of a large window), and each lease's
//! release (unmap, clear interrupts, reset) follows. From the moment the link is known down
//! until the device is available again it shows as `releasing` and a borrow is refused as
//! such ([`Inventory::release_unreachable`] covers the request still being served).
//!
//! With a cluster directory ([`Lender::with_claims`]) a device is lent only under a current
//! directory claim (`BORROW_CLAIMED` with the claim's revision as fencing token; a plain
//! `BORROW` is refused), and a lease whose claim this lender sees end (expired, released,
//! replaced) is ended with a `DeviceGone` event within one poll period ([`POLL`]).
//!
//! Before the HELLO proves the token a session is limited ([`PreAuth`]): at most
//! [`MAX_UNAUTHENTICATED`] such sessions at once, [`MAX_UNAUTHENTICATED_PER_SOURCE`] of them
//! from one tcp source ([`ntb::source_key`]), each closed if it has not authenticated within the
//! AUTH deadline ([`DEFAULT_AUTH_TIMEOUT`], [`Lender::set_auth_timeout`]). A peer that opens
//! links and never sends AUTH is thus bounded too, not only one that fails it.

use std::collections::HashMap;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ntb::wire::ErrorReply;
use ntb::{Endpoint, FabricError, FabricKind, Incoming, Listener, Message, WindowId};
use thiserror::Error;
use vmm_sys_util::eventfd::EventFd;

use crate::audit::{AuditLog, AuditedLease};
use crate::auth::{self, FailureLimiter, Role, Transcript};
use crate::backend::config::{virtualized_info, ConfigGate};
use crate::backend::irq::IrqRelay;
use crate::backend::{BackendError, DeviceBackend, IrqTrigger};
use crate::directory::ClaimAuthority;
use crate::inventory::{Inventory, InventoryError, Lease};
use crate::iommu::p2p::{P2pBook, P2pError, P2pMapping, P2pRegistration, MAX_P2P_PER_LEASE};
use crate::iommu::p2p_remote::{Attachments, GrantTable, PeerLenders};
use crate::iommu::{DmaBacking, IommuError, MAX_MAPPINGS};
use crate::protocol::{
    self, code, error, AuthChallenge, AuthResponse, Borrowed, DeviceGone, Event, HelloReply,
    IrqEvent, IrqKind, IrqTarget, LeaseCounters, LenderStatus, ProtocolError, Request,
    MAX_BAR_ACCESS, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};
pub use bars::BarPath;
use relays::{DoorbellTrigger, FaultRelay, FaultRelayGuard, MessageTrigger, ResampleTrigger};
use window::PeerWindowBacking;

mod bars;
mod migration;
mod p2px;
mod relays;
mod window;

pub use migration::TICKET_TTL;

/// How often idle loops look at the stop flag.
const POLL: Duration = Duration::from_millis(100);

/// Most sessions that have not authenticated yet, in total.
pub const MAX_UNAUTHENTICATED: usize = 64;
/// Most of those from one tcp source ([`ntb::source_key`]); shm peers are all the lender's
/// own uid (the socket is 0600), so only the total bounds them.
pub const MAX_UNAUTHENTICATED_PER_SOURCE: usize = 8;
/// How long a session may take from its link coming up to a HELLO that proves the token.
pub const DEFAULT_AUTH_TIMEOUT: Duration = Duration::from_secs(10);

/// The sessions that have not authenticated yet: counts (bounded by [`MAX_UNAUTHENTICATED`]
/// in total and [`MAX_UNAUTHENTICATED_PER_SOURCE`] per source; the map holds only sources
/// with a session in it) and the AUTH deadline.
struct PreAuth {
    counts: Mutex<(usize, HashMap<String, usize>)>,
    timeout_ms: AtomicU64,
    /// Refusals and deadline closes are peer-triggered: logged rate-limited.
    log: ntb::RateLimit,
}

impl Default for PreAuth {
    fn default() -> Self {
        PreAuth {
            counts: Mutex::default(),
            timeout_ms: AtomicU64::new(DEFAULT_AUTH_TIMEOUT.as_millis() as u64),
            log: ntb::RateLimit::new(Duration::from_secs(1)),
        }
    }
}

impl PreAuth {
    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }
}

/// One unauthenticated session's place in [`PreAuth`]; dropping it (HELLO done, or the
/// session over) gives the place back.
struct PreAuthSlot {
    pre: Arc<PreAuth>,
    source: String,
}

impl PreAuthSlot {
    /// `share`: the per-source share applies (tcp; a shm socket is 0600, so every shm peer
    /// is the lender's own uid, one source).
    fn take(pre: &Arc<PreAuth>, source: &str, share: bool) -> Result<PreAuthSlot, String> {
        let mut c = pre.counts.lock().unwrap_or_else(|e| e.into_inner());
        if c.0 >= MAX_UNAUTHENTICATED {
            return Err(format!(
                "{MAX_UNAUTHENTICATED} sessions are already waiting to authenticate"
            ));
        }
        let n = c.1.entry(source.to_string()).or_insert(0);
        if share && *n >= MAX_UNAUTHENTICATED_PER_SOURCE {
            return Err(format!(
                "{MAX_UNAUTHENTICATED_PER_SOURCE} sessions from {source} are already waiting \
                 to authenticate"
            ));
        }
        *n += 1;
        c.0 += 1;
        Ok(PreAuthSlot {
            pre: Arc::clone(pre),
            source: source.to_string(),
        })
    }
}

impl Drop for PreAuthSlot {
    fn drop(&mut self) {
        let mut c = self.pre.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.0 = c.0.saturating_sub(1);
        if let Some(n) = c.1.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                c.1.remove(&self.source);
            }
        }
    }
}

/// Errors of the server.
#[derive(Debug, Error)]
pub enum ServerError {
    /// The fabric failed.
    #[error("fabric: {0}")]
    Fabric(#[from] FabricError),
}

/// The lender: inventory plus the protocol.
pub struct Lender {
    inventory: Arc<Inventory>,
    node: String,
    token: String,
    stop: Arc<AtomicBool>,
    /// The cluster directory's claims, when lending is fenced by them.
    claims: Option<Arc<dyn ClaimAuthority>>,
    /// Failed authentications per peer address.
    auth_failures: FailureLimiter,
    /// Sessions not authenticated yet: their cap and deadline.
    preauth: Arc<PreAuth>,
    /// Every lease, across sessions, for peer-to-peer DMA between leases of one borrower.
    p2p: Arc<P2pBook>,
    /// Lease transfer tickets and hand-offs (live migration).
    transfers: migration::Transfers,
    /// Grants of leases' peer memory to other lenders (P2P across lenders, target side).
    grants: Arc<GrantTable>,
    /// Links to other lenders (P2P across lenders, source side).
    peers: Arc<PeerLenders>,
    /// Sessions running now and authentication failures by reason (metrics).
    stats: LenderStats,
    /// `lenderd --audit-log`: leases granted, served and ended.
    audit: std::sync::OnceLock<Arc<AuditLog>>,
}

/// Why an authentication failed (a fixed set: the metrics' `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    /// The peer's address failed too often and is refused for a while.
    RateLimited,
    /// A malformed AUTH (bad nonce, undecodable).
    Malformed,
    /// HELLO without AUTH first or without a proof.
    NoProof,
    /// A proof that does not verify (wrong token).
    BadProof,
    /// The link closed after the lender's challenge without a HELLO (a borrower that found
    /// the lender's proof wrong, i.e. a different token, leaves here).
    Unanswered,
}

impl AuthFailure {
    /// Every reason, in label order.
    pub const ALL: [AuthFailure; 5] = [
        AuthFailure::RateLimited,
        AuthFailure::Malformed,
        AuthFailure::NoProof,
        AuthFailure::BadProof,
        AuthFailure::Unanswered,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            AuthFailure::RateLimited => "rate_limited",
            AuthFailure::Malformed => "malformed",
            AuthFailure::NoProof => "no_proof",
            AuthFailure::BadProof => "bad_proof",
            AuthFailure::Unanswered => "unanswered",
        }
    }
}

#[derive(Default)]
struct LenderStats {
    sessions: AtomicU64,
    auth_failures: [AtomicU64; 5],
}

impl LenderStats {
    fn auth_failed(&self, why: AuthFailure) {
        self.auth_failures[why as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// Counts a running session while alive.
struct SessionCount<'a>(&'a AtomicU64);

impl<'a> SessionCount<'a> {
    fn new(n: &'a AtomicU64) -> Self {
        n.fetch_add(1, Ordering::Relaxed);
        SessionCount(n)
    }
}

impl Drop for SessionCount<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Lender {
    /// A lender named `node` that accepts borrowers presenting `token`.
    pub fn new(inventory: Arc<Inventory>, node: &str, token: &str) -> Arc<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        Arc::new(Lender {
            inventory,
            node: node.to_string(),
            token: token.to_string(),
            peers: Arc::new(PeerLenders::new(node, token, Arc::clone(&stop))),
            grants: Arc::default(),
            stop,
            claims: None,
            auth_failures: FailureLimiter::default(),
            preauth: Arc::default(),
            p2p: Arc::default(),
            transfers: migration::Transfers::default(),
            stats: LenderStats::default(),
            audit: std::sync::OnceLock::new(),
        })
    }

    /// Like [`Lender::new`], lending only under current directory claims (module docs).
    pub fn with_claims(
        inventory: Arc<Inventory>,
        node: &str,
        token: &str,
        claims: Arc<dyn ClaimAuthority>,
    ) -> Arc<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        Arc::new(Lender {
            inventory,
            node: node.to_string(),
            token: token.to_string(),
            peers: Arc::new(PeerLenders::new(node, token, Arc::clone(&stop))),
            grants: Arc::default(),
            stop,
            claims: Some(claims),
            auth_failures: FailureLimiter::default(),
            preauth: Arc::default(),
            p2p: Arc::default(),
            transfers: migration::Transfers::default(),
            stats: LenderStats::default(),
            audit: std::sync::OnceLock::new(),
        })
    }

    /// Records every lease's grant, serving and end in `log` (once; a second call is
    /// ignored and returns false).
    pub fn set_audit(&self, log: Arc<AuditLog>) -> bool {
        self.audit.set(log).is_ok()
    }

    pub(crate) fn audit(&self) -> Option<Arc<AuditLog>> {
        self.audit.get().cloned()
    }

    /// How long a session may take from its link coming up to its HELLO (default
    /// [`DEFAULT_AUTH_TIMEOUT`]); a session past it is closed.
    pub fn set_auth_timeout(&self, timeout: Duration) {
        let ms = u64::try_from(timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        self.preauth.timeout_ms.store(ms, Ordering::Relaxed);
    }

    /// Set it to stop [`Lender::serve`] (sessions end, leases are taken back).
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.stop)
    }

    /// The inventory.
    pub fn inventory(&self) -> &Arc<Inventory> {
        &self.inventory
    }

    /// This lender's node name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Borrower sessions (fabric links past the handshake) running now.
    pub fn sessions(&self) -> u64 {
        self.stats.sessions.load(Ordering::Relaxed)
    }

    /// Authentication failures of `why` since the lender started.
    pub fn auth_failures(&self, why: AuthFailure) -> u64 {
        self.stats.auth_failures[why as usize].load(Ordering::Relaxed)
    }

    /// Peer-to-peer mappings into `lease`'s BARs that are live (tests, status).
    pub fn p2p_live_into(&self, lease: u64) -> usize {
        self.p2p.live_into(lease)
    }

    /// Where the other lenders are, for peer-to-peer DMA across lenders (lenderd passes
    /// its cluster file). Without it, P2P_MAP_REMOTE is refused with `PEER_LENDER`.
    pub fn set_cluster(&self, cluster: ntb::ClusterConfig) {
        self.peers.set_cluster(cluster);
    }

    /// Where lenders that the cluster file does not name are found, for peer-to-peer DMA
    /// across lenders (lenderd passes its etcd directory and its link settings).
    pub fn set_directory(
        &self,
        directory: Arc<dyn crate::directory::Directory>,
        base: ntb::ClusterConfig,
    ) {
        self.peers.set_directory(directory, base);
    }

    /// Grants of this lender's leases that another lender has attached now (tests,
    /// status).
    pub fn p2p_grants_attached(&self) -> usize {
        self.grants.attached()
    }

    /// Attaches of grants refused (unknown grant, wrong lender or secret).
    pub fn p2p_grants_refused(&self) -> u64 {
        self.grants.refused()
    }

    /// Links to other lenders up now (P2P across lenders).
    pub fn p2p_peer_links(&self) -> usize {
        self.peers.links()
    }

    /// Cross-lender mappings ended by the target's lender or a lost link, so far.
    pub fn p2p_remote_revoked(&self) -> u64 {
        self.peers.revoked()
    }

    /// Accepts links until the stop flag is set, then ends every session.
    pub fn serve(self: &Arc<Self>, listener: &dyn Listener) -> Result<(), ServerError> {
        // Session threads come from the link threads' park (`ntb::workers`): a borrower that
        // connects, borrows and leaves starts no thread on this side once some are parked.
        let mut sessions: Vec<ntb::workers::Worker> = Vec::new();
        while !self.stop.load(Ordering::Relaxed) {
            match listener.accept(Some(POLL)) {
                Ok(ep) => {
                    let ep: Arc<dyn Endpoint> = Arc::from(ep);
                    let me = Arc::clone(self);
                    let peer = ep.peer_node().to_string();
                    log::info!("link up from {peer} ({})", ep.kind());
                    match ntb::workers::spawn(format!("session-{peer}"), move || me.run_session(ep))
                    {
                        Ok(h) => sessions.push(h),
                        Err(e) => log::error!("cannot start session thread for {peer}: {e}"),
                    }
                }
                Err(FabricError::Timeout(_)) => {}
                Err(e) => {
                    log::warn!("accept failed: {e}");
                    std::thread::sleep(POLL);
                }
            }
            sessions.retain(|h| !h.is_finished());
            // A session inside a long request has not seen its link's end yet.
            self.inventory.release_unreachable();
        }
        log::info!("stopping: ending {} sessions", sessions.len());
        self.peers.close_all();
        for h in sessions {
            let _ = h.join();
        }
        Ok(())
    }

    /// Serves one link until it goes down or the lender stops.
    pub fn run_session(self: Arc<Self>, ep: Arc<dyn Endpoint>) {
        let me = Arc::clone(&self);
        let _counted = SessionCount::new(&me.stats.sessions);
        let source = ntb::source_key(&ep.peer_addr());
        let share = ep.kind().is_networked();
        let slot = match PreAuthSlot::take(&self.preauth, &source, share) {
            Ok(slot) => slot,
            Err(why) => {
                if let Some(n) = self.preauth.log.hit() {
                    log::warn!(
                        "{why}: closing the link from {} ({source}) ({n} more refused or timed \
                         out since the last report)",
                        ep.peer_node()
                    );
                }
                ep.close();
                return;
            }
        };
        let started = Instant::now();
        let mut s = Session {
            id: self.transfers.session_id(),
            lender: Arc::clone(&self),
            ep: Arc::clone(&ep),
            hello: false,
            preauth: Some(slot),
            challenge: None,
            rate_key: auth::rate_key(&ep.peer_addr()),
            version: PROTOCOL_VERSION,
            leases: HashMap::new(),
            peer_windows: HashMap::new(),
            attachments: Attachments::default(),
        };
        let peer = ep.peer_node().to_string();
        let reason = loop {
            if self.stop.load(Ordering::Relaxed) {
                self.transfers
                    .forget(s.id, None, "the lender is shutting down");
                s.end_all("lenderd shutting down", true);
                ep.close();
                break "lender stopping".to_string();
            }
            // With a transfer ticket out, a destination may be waiting for this loop to hand
            // the lease over: look often (the hand-over time is part of the VM's downtime).
            let wait = if self.transfers.has_ticket(s.id) {
                migration::HANDOFF_POLL
            } else {
                POLL
            };
            match ep.recv(wait) {
                Ok(Incoming::Request { id, msg }) => {
                    let (reply, close) = s.handle(msg);
                    if let Err(e) = ep.reply(id, reply) {
                        log::warn!("{peer}: reply failed: {e}");
                    }
                    if close {
                        // Let the error reply leave before the link goes down.
                        std::thread::sleep(Duration::from_millis(50));
                        ep.close();
                        break "closed after a refused authentication".into();
                    }
                }
                Ok(Incoming::Event(m)) => s.event(m),
                Ok(Incoming::WindowAdded(w)) => {
                    log::debug!("{peer}: window {} ({}) added", w.id, w.label)
                }
                Ok(Incoming::WindowRemoved(id)) => s.window_removed(id),
                Err(FabricError::Timeout(_)) => {}
                Err(e) => break e.to_string(),
            }
            if !s.hello {
                let limit = self.preauth.timeout();
                if started.elapsed() >= limit {
                    if let Some(n) = self.preauth.log.hit() {
                        log::warn!(
                            "{peer} ({}): no HELLO within {limit:?} of the link coming up, \
                             closing it ({n} more refused or timed out since the last report)",
                            ep.peer_addr()
                        );
                    }
                    ep.close();
                    break format!("not authenticated within {limit:?}");
                }
            }
            s.serve_handoffs();
            s.announce_kicks();
            s.end_stale_claims();
        };
        if s.challenge.is_some() && !s.hello {
            self.stats.auth_failed(AuthFailure::Unanswered);
        }
        self.transfers
            .forget(s.id, None, "the source's link is down");
        let n = s.leases.len();
        s.end_all(&format!("link to {peer} down: {reason}"), false);
        log::info!("session with {peer} ended ({reason}); {n} leases taken back");
    }
}

/// A DMA mapping of the lease: IOVA range and the borrower's window.
struct DmaEntry {
    iova: u64,
    size: u64,
    window: WindowId,
}

struct SessionLease {
    /// Peer-to-peer mappings this lease's domain holds, by (target lease, BAR). Bound:
    /// MAX_P2P_PER_LEASE (revoked ones count until unmapped).
    p2p_out: HashMap<(u64, u8), P2pMapping>,
    /// This lease in the lender's P2P book: mappings into its BARs are revoked before it
    /// ends.
    p2p: P2pRegistration,
    /// INTx resample eventfd watcher (shm); dropped (joined) before the lease ends.
    resample: Option<IrqRelay>,
    /// Reports the domain's faults to the borrower (version 3 sessions); removed from the
    /// domain before the lease ends.
    _faults: Option<FaultRelayGuard>,
    /// The device's counters when the lease was granted (LEASE_COUNTERS answers the
    /// difference).
    baseline: LeaseCounters,
    /// The lease's audit records: declared before `lease` so that its `end` is written
    /// before the device is given back (a next holder's `grant` always comes after it).
    audit: AuditedLease,
    lease: Lease,
    /// Bound: the domain's MAX_MAPPINGS (a DMA_MAP beyond it is refused before the push).
    maps: Vec<DmaEntry>,
    /// BAR index -> fabric window id exported for it. Bound: 6 BARs.
    bar_windows: HashMap<u8, u32>,
    /// The directory claim revision the lease was granted under (fenced leases only).
    claim: Option<i64>,
    /// Generation of the kick-only doorbells the borrower was last told (reply or event;
    /// shared with the device's kick listener).
    kicks_told: Arc<AtomicU64>,
    /// Every CONFIG_READ/CONFIG_WRITE of the lease passes here (filter, extended-space view,
    /// counts of refused/dropped writes).
    config: ConfigGate,
    /// This lease started the device's dirty log (stopped when the lease ends or moves).
    dirty_log: bool,
    /// The previous holder's DMA mappings (iova, size), left in the domain by a transfer
    /// whose accept named no windows, until this holder maps them (kept if the same memory)
    /// or resumes the device ([`migration`]). Bound: the previous holder's maps
    /// (MAX_MAPPINGS).
    parked: Vec<(u64, u64)>,
}

impl Drop for SessionLease {
    fn drop(&mut self) {
        // Peer-to-peer first: our mappings of other leases' BARs, then every mapping into our
        // BARs, all before the lease's drop resets the device and revokes its BAR windows.
        self.p2p_out.clear();
        self.p2p.revoke_all("target lease ending");
        self.stop_dirty_log();
        // The listener points at this session's link: gone before the device is lent again.
        self.lease.backend().set_kick_listener(None);
    }
}

/// Tells a version 3 borrower at once when the device's kick-only doorbells change (called
/// on the device's threads; the session loop's [`Session::announce_kicks`] is the safety
/// net). Holds only weak references: the lease owns the device, not the other way round.
fn kick_listener(
    ep: &Arc<dyn Endpoint>,
    backend: &Arc<dyn DeviceBackend>,
    lease: u64,
    told: &Arc<AtomicU64>,
) -> ::emulated::KickListener {
    let (ep, backend, told) = (
        Arc::downgrade(ep),
        Arc::downgrade(backend),
        Arc::clone(told),
    );
    Arc::new(move || {
        let (Some(ep), Some(b)) = (ep.upgrade(), backend.upgrade()) else {
            return;
        };
        let kicks = b.kick_doorbells();
        if told.fetch_max(kicks.generation, Ordering::AcqRel) >= kicks.generation {
            return;
        }
        match Event::Kicks(protocol::KicksEvent { lease, kicks }).encode() {
            Ok((op, p)) => {
                if let Err(e) = ep.send(Message::raw(op, p)) {
                    log::debug!("kicks event to {}: {e}", ep.peer_node());
                }
            }
            Err(e) => log::error!("kicks event encode: {e}"),
        }
    })
}

struct Session {
    /// Identifies the session in the lender's transfer registry.
    id: u64,
    lender: Arc<Lender>,
    ep: Arc<dyn Endpoint>,
    hello: bool,
    /// Its place among the unauthenticated sessions, until the HELLO.
    preauth: Option<PreAuthSlot>,
    /// The nonces of the session's AUTH (borrower's, lender's), until HELLO uses them.
    challenge: Option<([u8; auth::NONCE_LEN], [u8; auth::NONCE_LEN])>,
    /// The peer's address as counted by the failure limiter.
    rate_key: String,
    /// Protocol version agreed at hello (layouts of versioned messages).
    version: u32,
    leases: HashMap<u64, SessionLease>,
    /// The borrower's windows this session mapped for DMA, by id: a window that several
    /// leases map (the borrower exports guest RAM once per session) is mapped into this
    /// process once and shared by their IOMMU domains.
    peer_windows: HashMap<WindowId, Weak<PeerWindowBacking>>,
    /// Grants of this lender's leases the peer (another lender) attached.
    attachments: Attachments,
}

type Reply = Result<Message, ErrorReply>;

fn backend_err(e: BackendError) -> ErrorReply {
    let c = match &e {
        BackendError::Forbidden(_) => code::FORBIDDEN,
        BackendError::NoSuchBar(_)
        | BackendError::BorrowerBar(_)
        | BackendError::OutOfRange { .. }
        | BackendError::BadAccess { .. } => code::OUT_OF_RANGE,
        BackendError::TooManyVectors { .. } | BackendError::BadConfigAccess { .. } => code::INVALID,
        _ => code::INTERNAL,
    };
    error(c, e.to_string())
}

fn p2p_err(e: P2pError) -> ErrorReply {
    let c = match &e {
        P2pError::UnknownLease(_) => code::UNKNOWN_LEASE,
        P2pError::NoSuchBar { .. } => code::OUT_OF_RANGE,
        P2pError::NotMemory { .. }
        | P2pError::AlreadyMapped { .. }
        | P2pError::NotMapped { .. }
        | P2pError::TooMany(_)
        | P2pError::Iommu {
            source:
                IommuError::Overlap { .. } | IommuError::Unaligned { .. } | IommuError::BadRange { .. },
            ..
        } => code::INVALID,
        P2pError::Iommu { .. } | P2pError::Backing { .. } => code::IOMMU,
    };
    error(c, e.to_string())
}

fn iommu_err(e: IommuError) -> ErrorReply {
    error(code::IOMMU, e.to_string())
}

fn inv_err(e: InventoryError) -> ErrorReply {
    let c = match &e {
        InventoryError::UnknownDevice(_) => code::UNKNOWN_DEVICE,
        // Releasing is busy for now, not unavailable: a borrower may retry it shortly (its
        // message says so, and older borrowers show the message as it is).
        InventoryError::Busy { .. }
        | InventoryError::Releasing { .. }
        | InventoryError::Family { .. }
        | InventoryError::PfWithVfs { .. } => code::DEVICE_BUSY,
        _ => code::DEVICE_UNAVAILABLE,
    };
    error(c, e.to_string())
}

fn proto_err(e: ProtocolError) -> ErrorReply {
    let c = match e {
        ProtocolError::UnknownOpcode(_) => code::UNKNOWN_OPCODE,
        _ => code::INVALID,
    };
    error(c, e.to_string())
}

fn ok<T: serde::Serialize>(op: u16, v: &T) -> Reply {
    protocol::encode_reply(op, v)
        .map(|p| Message::raw(op, p))
        .map_err(proto_err)
}

impl SessionLease {
    /// A BAR_WRITE/RESET reply with the device's kick-only doorbells (version 3).
    fn kicks_reply(&mut self, op: u16, version: u32) -> Reply {
        let k = self.lease.backend().kick_doorbells();
        if version >= 3 {
            self.kicks_told.fetch_max(k.generation, Ordering::AcqRel);
        }
        protocol::encode_kicks_reply(op, &k, version)
            .map(|p| Message::raw(op, p))
            .map_err(proto_err)
    }
}

impl Session {
    /// The borrower's window `id` as DMA backing: the mapping another lease of this session
    /// holds, or a new one.
    fn peer_window(&mut self, id: WindowId) -> Result<Arc<PeerWindowBacking>, ErrorReply> {
        self.peer_windows.retain(|_, w| w.strong_count() > 0);
        if let Some(b) = self.peer_windows.get(&id).and_then(Weak::upgrade) {
            log::debug!("borrower window {id} already mapped: shared");
            return Ok(b);
        }
        let win = self
            .ep
            .map_peer_window(id)
            .map_err(|e| error(code::UNKNOWN_WINDOW, format!("borrower window {id}: {e}")))?;
        let info = win.info();
        log::info!(
            "borrower window {id} ({:?}, {:#x} bytes) mapped {}",
            info.label,
            info.size,
            if win.as_ptr().is_ok() {
                "directly"
            } else {
                "by messages"
            }
        );
        let b = Arc::new(PeerWindowBacking { win });
        self.peer_windows.insert(id, Arc::downgrade(&b));
        Ok(b)
    }

    /// Tells the borrower (version 3) about kick-only doorbell changes it has not seen in a
    /// reply: shadow doorbells switched on by an admin command. Late is harmless (the
    /// exact doorbell path keeps working until the borrower registers its ioeventfds).
    fn announce_kicks(&mut self) {
        if self.version < 3 || !self.hello {
            return;
        }
        for (&id, sl) in self.leases.iter_mut() {
            let b = sl.lease.backend();
            if b.kick_generation() <= sl.kicks_told.load(Ordering::Acquire) {
                continue;
            }
            let kicks = b.kick_doorbells();
            if sl.kicks_told.fetch_max(kicks.generation, Ordering::AcqRel) >= kicks.generation {
                continue;
            }
            log::debug!(
                "lease {id}: {} kick-only doorbells (generation {})",
                kicks.offsets.len(),
                kicks.generation
            );
            match Event::Kicks(protocol::KicksEvent { lease: id, kicks }).encode() {
                Ok((op, p)) => {
                    if let Err(e) = self.ep.send(Message::raw(op, p)) {
                        log::debug!("kicks event to {}: {e}", self.ep.peer_node());
                    }
                }
                Err(e) => log::error!("kicks event encode: {e}"),
            }
        }
    }

    fn peer(&self) -> String {
        self.ep.peer_node().to_string()
    }

    /// P2P identity of `lease` held on this session: node/vm as authenticated and named, and
    /// where the session comes from (shm: the same process, by SO_PEERCRED; tcp: the same
    /// IP), see docs/SECURITY.md.
    fn p2p_holder(&self, lease: &Lease) -> String {
        let origin = match self.ep.peer_addr() {
            a if a.starts_with("unix:") => a.trim_start_matches("unix:").to_string(),
            a => auth::rate_key(&a),
        };
        format!("{}@{origin}", lease.holder())
    }

    /// Handles one event from the borrower.
    fn event(&mut self, m: Message) {
        match Event::decode(m.opcode, &m.payload) {
            Ok(Event::Resample(r)) if self.hello => match self.leases.get(&r.lease) {
                Some(sl) => sl.lease.backend().intx_resample(),
                None => log::debug!("{}: resample for unknown lease {}", self.peer(), r.lease),
            },
            Ok(other) => log::debug!("{}: ignoring event {other:?}", self.peer()),
            Err(e) => log::debug!("{}: ignoring event {:#x}: {e}", self.peer(), m.opcode),
        }
    }

    /// Handles one request; returns the reply and whether to close the link.
    fn handle(&mut self, msg: Message) -> (Reply, bool) {
        let op = msg.opcode;
        if op == protocol::opcode::AUTH {
            return self.auth(&msg.payload);
        }
        // HELLO's layout never changes; everything else is read in the agreed version.
        let req = match Request::decode_versioned(op, &msg.payload, self.version) {
            Ok(r) => r,
            Err(e) => {
                log::warn!("{}: bad request: {e}", self.peer());
                return (Err(proto_err(e)), false);
            }
        };
        if let Request::Hello(h) = &req {
            if self.hello {
                return (Err(error(code::INVALID, "hello already done")), false);
            }
            if let Err(e) = self.check_proof(&h.token) {
                let why = if e.message.starts_with("bad token: ") {
                    AuthFailure::NoProof
                } else {
                    AuthFailure::BadProof
                };
                self.lender.stats.auth_failed(why);
                self.lender.auth_failures.fail(
                    &self.rate_key,
                    &format!("{} ({:?}): {}", self.peer(), h.client, e.message),
                );
                return (Err(e), true);
            }
            self.lender.auth_failures.succeed(&self.rate_key);
            let Some(version) = protocol::negotiate(h.version, PROTOCOL_VERSION) else {
                return (
                    Err(error(
                        code::VERSION,
                        format!(
                            "protocol version {} not supported (lender speaks \
                             {MIN_PROTOCOL_VERSION}..={PROTOCOL_VERSION})",
                            h.version
                        ),
                    )),
                    true,
                );
            };
            self.hello = true;
            self.preauth = None;
            self.version = version;
            log::info!(
                "{}: hello from {} (protocol version {version})",
                self.peer(),
                h.client
            );
            let r = HelloReply {
                version,
                node: self.lender.node.clone(),
                max_bar_access: MAX_BAR_ACCESS as u32,
                max_dma_maps: MAX_MAPPINGS as u32,
            };
            return (ok(op, &r), false);
        }
        if !self.hello {
            return (
                Err(error(code::NO_HELLO, "hello with the cluster token first")),
                false,
            );
        }
        (self.dispatch(op, req, msg.fds), false)
    }

    /// AUTH: answers the borrower's nonce with ours and our proof. Counts as a failure of the
    /// peer's address until a HELLO proves the token.
    fn auth(&mut self, payload: &[u8]) -> (Reply, bool) {
        let op = protocol::opcode::AUTH;
        if self.hello || self.challenge.is_some() {
            return (
                Err(error(code::INVALID, "authentication already started")),
                true,
            );
        }
        if let Err(l) = self.lender.auth_failures.check(&self.rate_key) {
            self.lender.stats.auth_failed(AuthFailure::RateLimited);
            return (
                Err(error(
                    code::BAD_TOKEN,
                    format!(
                        "too many failed authentications from {}; retry in {}s",
                        self.rate_key,
                        l.retry_in.as_secs() + 1
                    ),
                )),
                true,
            );
        }
        self.lender.auth_failures.fail(
            &self.rate_key,
            &format!("{}: challenge not (yet) answered", self.peer()),
        );
        let c: AuthChallenge = match protocol::decode_reply(op, payload) {
            Ok(c) => c,
            Err(e) => {
                self.lender.stats.auth_failed(AuthFailure::Malformed);
                return (Err(proto_err(e)), true);
            }
        };
        let Ok(nb) = <[u8; auth::NONCE_LEN]>::try_from(c.nonce.as_slice()) else {
            self.lender.stats.auth_failed(AuthFailure::Malformed);
            return (
                Err(error(
                    code::INVALID,
                    format!(
                        "auth nonce is {} bytes, expected {}",
                        c.nonce.len(),
                        auth::NONCE_LEN
                    ),
                )),
                true,
            );
        };
        let peer = self.peer();
        let binding = self.ep.channel_binding();
        let nl = match auth::nonce() {
            Ok(n) => n,
            Err(e) => return (Err(error(code::INTERNAL, e.to_string())), true),
        };
        let t = Transcript {
            borrower_nonce: &nb,
            lender_nonce: &nl,
            borrower: &peer,
            lender: &self.lender.node,
            binding: &binding,
        };
        let proof = match t.prove(&self.lender.token, Role::Lender) {
            Ok(p) => p,
            Err(e) => return (Err(error(code::INTERNAL, e.to_string())), true),
        };
        self.challenge = Some((nb, nl));
        let r = AuthResponse {
            node: self.lender.node.clone(),
            nonce: nl.to_vec(),
            proof: proof.to_vec(),
        };
        (ok(op, &r), false)
    }

    /// Checks HELLO's token field: the borrower's proof for this session's AUTH.
    fn check_proof(&mut self, token: &str) -> Result<(), ErrorReply> {
        let Some((nb, nl)) = self.challenge.take() else {
            return Err(error(
                code::BAD_TOKEN,
                "bad token: authenticate with AUTH before HELLO (this lender accepts no plain \
                 tokens; upgrade the borrower)",
            ));
        };
        let Some(proof) = auth::decode_proof(token) else {
            return Err(error(
                code::BAD_TOKEN,
                "bad token: HELLO carries no challenge-response proof",
            ));
        };
        let peer = self.peer();
        let binding = self.ep.channel_binding();
        let t = Transcript {
            borrower_nonce: &nb,
            lender_nonce: &nl,
            borrower: &peer,
            lender: &self.lender.node,
            binding: &binding,
        };
        match t.verify(&self.lender.token, Role::Borrower, &proof) {
            Ok(true) => Ok(()),
            Ok(false) => Err(error(code::BAD_TOKEN, "bad token")),
            Err(e) => Err(error(code::INTERNAL, e.to_string())),
        }
    }

    /// The lease `id` of this link, for a request it serves (noted in the audit log).
    fn lease(&mut self, id: u64) -> Result<&mut SessionLease, ErrorReply> {
        let l = self.leases.get_mut(&id).ok_or_else(|| {
            error(
                code::UNKNOWN_LEASE,
                format!("unknown lease {id} on this link"),
            )
        })?;
        l.audit.serve();
        Ok(l)
    }

    fn dispatch(&mut self, op: u16, req: Request, mut fds: Vec<OwnedFd>) -> Reply {
        if let Some(r) = self.dispatch_migration(op, &req, &mut fds) {
            return r;
        }
        if let Some(r) = self.dispatch_p2px(op, &req) {
            return r;
        }
        match req {
            Request::Hello(_) => Err(error(code::INVALID, "hello already done")),
            Request::List => ok(
                op,
                &protocol::devices_for_version(self.lender.inventory.list(), self.version),
            ),
            Request::Status => ok(
                op,
                &protocol::status_for_version(
                    LenderStatus {
                        node: self.lender.node.clone(),
                        uptime_secs: self.lender.inventory.uptime_secs(),
                        devices: self.lender.inventory.status(),
                    },
                    self.version,
                ),
            ),
            Request::Borrow(b) => {
                if self.lender.claims.is_some() {
                    log::info!(
                        "{}/{}: borrow {} refused: no directory claim",
                        self.peer(),
                        b.vm,
                        b.device
                    );
                    return Err(error(
                        code::CLAIM_REQUIRED,
                        format!(
                            "lender {} lends only under a cluster directory claim; claim {} first",
                            self.lender.node, b.device
                        ),
                    ));
                }
                self.borrow(op, &b.device, &b.vm, None)
            }
            Request::BorrowClaimed(b) => {
                let claim = match &self.lender.claims {
                    None => None,
                    Some(c) => {
                        let peer = self.peer();
                        c.verify(&b.device, &peer, &b.vm, b.claim).map_err(|why| {
                            log::warn!(
                                "{peer}/{}: borrow {} under claim {} refused: {why}",
                                b.vm,
                                b.device,
                                b.claim
                            );
                            error(
                                code::STALE_CLAIM,
                                format!("claim {} on {}: {why}", b.claim, b.device),
                            )
                        })?;
                        Some(b.claim)
                    }
                };
                self.borrow(op, &b.device, &b.vm, claim)
            }
            Request::DeviceInfo(l) => {
                let version = self.version;
                let sl = self.lease(l.lease)?;
                let mut info =
                    virtualized_info(sl.lease.backend().as_ref(), sl.lease.device().id());
                for b in info.bars.iter_mut() {
                    b.window = sl.bar_windows.get(&b.index).copied();
                }
                protocol::encode_device_info(&info, version)
                    .map(|p| Message::raw(op, p))
                    .map_err(proto_err)
            }
            Request::ConfigRead(r) => {
                let sl = self.lease(r.lease)?;
                let mut buf = vec![0u8; usize::from(r.len)];
                sl.config
                    .read(sl.lease.backend().as_ref(), r.offset, &mut buf)
                    .map_err(backend_err)?;
                ok(op, &buf)
            }
            Request::ConfigWrite(w) => {
                // The gate logs refused and dropped writes itself, rate-limited.
                let sl = self.lease(w.lease)?;
                sl.config
                    .write(sl.lease.backend().as_ref(), w.offset, &w.data)
                    .map_err(backend_err)?;
                ok(op, &())
            }
            Request::BarRead(r) => {
                let sl = self.lease(r.lease)?;
                let mut buf = vec![0u8; r.len as usize];
                sl.lease
                    .backend()
                    .bar_read(r.bar, r.offset, &mut buf)
                    .map_err(backend_err)?;
                ok(op, &buf)
            }
            Request::BarWrite(w) => {
                let version = self.version;
                let sl = self.lease(w.lease)?;
                sl.lease
                    .backend()
                    .bar_write(w.bar, w.offset, &w.data)
                    .map_err(backend_err)?;
                // The reply carries the kick-only doorbells as they are after this write (a
                // CC.EN 1->0 ends shadow doorbells): the borrower applies them before the
                // guest's next doorbell store.
                sl.kicks_reply(op, version)
            }
            Request::DmaMap(m) => {
                self.lease(m.lease)?;
                let lender = Arc::clone(&self.lender);
                // Shared with the session's other leases that map the same window.
                let backing: Arc<dyn DmaBacking> = self.peer_window(m.window)?;
                let sl = self.lease(m.lease)?;
                let dom = sl.lease.backend().domain();
                // After a transfer: the previous holder's mapping stays if this is its memory.
                if !sl.map_over_parked(&lender, m.lease, m.iova, m.size, &backing) {
                    dom.map(m.iova, m.size, backing).map_err(iommu_err)?;
                }
                sl.maps.push(DmaEntry {
                    iova: m.iova,
                    size: m.size,
                    window: m.window,
                });
                sl.lease
                    .backend()
                    .set_bus_master(true)
                    .map_err(backend_err)?;
                log::info!(
                    "lease {}: dma window {} mapped at iova {:#x} size {:#x}",
                    m.lease,
                    m.window,
                    m.iova,
                    m.size
                );
                ok(op, &())
            }
            Request::DmaUnmap(u) => {
                let sl = self.lease(u.lease)?;
                let last = sl.maps.iter().all(|e| e.iova == u.iova && e.size == u.size);
                if last {
                    // Bus Master off first: the model finishes the pass it is in and stops
                    // (doorbells written before this request wait), so nothing it does
                    // reaches for the window once it is gone.
                    sl.lease
                        .backend()
                        .set_bus_master(false)
                        .map_err(backend_err)?;
                }
                sl.lease
                    .backend()
                    .domain()
                    .unmap(u.iova, u.size)
                    .map_err(iommu_err)?;
                sl.maps.retain(|e| !(e.iova == u.iova && e.size == u.size));
                ok(op, &())
            }
            Request::SetIrqs(s) => self.set_irqs(op, s, fds),
            Request::LeaseCounters(l) => {
                let sl = self.lease(l.lease)?;
                sl.lease.count_counters_request();
                let c = sl.lease.backend().counters().since(&sl.baseline);
                protocol::encode_lease_counters(&c, self.version)
                    .map(|p| Message::raw(op, p))
                    .map_err(proto_err)
            }
            Request::Quiesce(q) => {
                let sl = self.lease(q.lease)?;
                if !q.stop {
                    sl.unmap_parked(q.lease, "the device resumes");
                }
                sl.lease.backend().quiesce(q.stop).map_err(backend_err)?;
                log::info!(
                    "lease {}: {}",
                    q.lease,
                    if q.stop { "quiesced" } else { "resumed" }
                );
                ok(op, &())
            }
            Request::Reset(l) => {
                let sl = self.lease(l.lease)?;
                // DMA of peers into the device's BARs ends before the device resets.
                sl.p2p.revoke_all("target reset");
                let b = sl.lease.backend();
                b.reset().map_err(backend_err)?;
                if !sl.maps.is_empty() {
                    b.set_bus_master(true).map_err(backend_err)?;
                }
                let version = self.version;
                let sl = self.lease(l.lease)?;
                sl.kicks_reply(op, version)
            }
            Request::P2pMap(m) => self.p2p_map(op, m, false),
            Request::P2pUnmap(u) => {
                let sl = self.lease(u.source)?;
                sl.p2p_out
                    .remove(&(u.target, u.bar))
                    .ok_or_else(|| {
                        p2p_err(P2pError::NotMapped {
                            source_lease: u.source,
                            target: u.target,
                            bar: u.bar,
                        })
                    })
                    .map(drop)?;
                ok(op, &())
            }
            Request::Return(l) => {
                let mut sl = self.leases.remove(&l.lease).ok_or_else(|| {
                    error(code::UNKNOWN_LEASE, format!("unknown lease {}", l.lease))
                })?;
                sl.lease.set_end_reason("returned by the borrower");
                sl.lease.begin_release();
                drop(sl);
                self.lender.transfers.forget(
                    self.id,
                    Some(l.lease),
                    "the source returned the lease",
                );
                ok(op, &())
            }
            other => Err(error(
                code::UNKNOWN_OPCODE,
                format!("request {:#x} not handled", other.opcode()),
            )),
        }
    }

    /// P2P_MAP (and P2P_MAP_GRANTED with `capability`: the target's grant was verified).
    fn p2p_map(&mut self, op: u16, m: protocol::P2pMap, capability: bool) -> Reply {
        let book = Arc::clone(&self.lender.p2p);
        let peers = Arc::clone(&self.lender.peers);
        let sl = self.lease(m.source)?;
        let key = (m.target, m.bar);
        if let Some(old) = sl.p2p_out.get(&key).filter(|o| o.is_live()) {
            return Err(p2p_err(P2pError::AlreadyMapped {
                source_lease: m.source,
                target: m.target,
                bar: m.bar,
                iova: old.iova(),
            }));
        }
        // Revoked mappings stay until unmapped: they count against the cap too.
        if !sl.p2p_out.contains_key(&key) && sl.p2p_out.len() >= MAX_P2P_PER_LEASE {
            return Err(p2p_err(P2pError::TooMany(m.source)));
        }
        let holder = sl.p2p.holder().to_string();
        let domain = sl.lease.backend().domain();
        let mapping = book
            .map(
                m.source, &holder, domain, m.target, m.bar, m.iova, capability,
            )
            .map_err(|e| {
                crate::iommu::p2p_remote::log_refusal(
                    &peers.refusals,
                    format_args!("{holder}: p2p map refused: {e}"),
                );
                p2p_err(e)
            })?;
        sl.p2p_out.insert(key, mapping);
        ok(op, &())
    }

    fn borrow(&mut self, op: u16, device: &str, vm: &str, claim: Option<i64>) -> Reply {
        let peer = self.peer();
        let mut lease = self
            .lender
            .inventory
            .acquire(device, &peer, vm)
            .map_err(|e| {
                log::info!("{peer}/{vm}: borrow {device} refused: {e}");
                inv_err(e)
            })?;
        let id = lease.id();
        lease.watch_holder(&self.ep);
        let backend = Arc::clone(lease.backend());
        // The filter is built from the device as the lease begins (see ConfigGate).
        let config = ConfigGate::new(
            &format!("{peer}/{vm}: lease {id} of {device}"),
            backend.as_ref(),
        )
        .map_err(backend_err)?;
        let mut info = virtualized_info(backend.as_ref(), device);
        let mut bar_windows = HashMap::new();
        let mut paths = Vec::new();
        for b in info.bars.iter_mut() {
            let Some(x) = backend.bar_export(b.index) else {
                paths.push((b.index, BarPath::Trapped));
                continue;
            };
            let label = format!("lease{id}-bar{}", b.index);
            let (w, path) = bars::export(self.ep.as_ref(), &x, &label).map_err(|e| {
                error(
                    code::INTERNAL,
                    format!("exporting bar {} as a fabric window: {e}", b.index),
                )
            })?;
            b.window = Some(w.id());
            bar_windows.insert(b.index, w.id());
            lease.add_bar_window(w);
            paths.push((b.index, path));
        }
        bars::log_paths(id, device, &paths);
        lease.set_bar_paths(paths);
        let mut fds = Vec::new();
        let mut notify_fd = None;
        if self.ep.kind() == FabricKind::Shm {
            if let Some(n) = backend.notify_eventfd() {
                // SAFETY: `into_raw_fd` hands over sole ownership of a valid eventfd.
                fds.push(unsafe { OwnedFd::from_raw_fd(n.into_raw_fd()) });
                notify_fd = Some(0);
            }
        }
        let reply = Borrowed {
            lease: id,
            info,
            notify_fd,
            notify_doorbell: None,
        };
        let msg = protocol::encode_borrowed(&reply, self.version)
            .map(|p| Message::raw(op, p).with_fds(fds))
            .map_err(proto_err)?;
        let baseline = backend.counters();
        // Only a version 3 borrower understands the fault event.
        let faults = (self.version >= 3).then(|| {
            let domain = backend.domain();
            domain.set_fault_listener(Some(Arc::new(FaultRelay {
                ep: Arc::downgrade(&self.ep),
                lease: id,
                base: baseline.iommu_faults,
                limit: Mutex::default(),
            })));
            FaultRelayGuard { domain }
        });
        let kicks_told = Arc::new(AtomicU64::new(0));
        if self.version >= 3 {
            backend.set_kick_listener(Some(kick_listener(&self.ep, &backend, id, &kicks_told)));
        }
        let p2p = self.lender.p2p.register(
            id,
            &self.p2p_holder(&lease),
            Arc::clone(&backend),
            // tcp: the identity rule's origin is only an IP (docs/SECURITY.md), so a
            // version 6 lease needs its capability; shm's origin is the process.
            self.version >= protocol::P2PX_VERSION && self.ep.kind().is_networked(),
        );
        let audit = AuditedLease::grant(
            self.lender.audit(),
            device,
            id,
            &format!("{peer}/{vm}"),
            claim,
        );
        self.leases.insert(
            id,
            SessionLease {
                p2p_out: HashMap::new(),
                p2p,
                resample: None,
                _faults: faults,
                baseline,
                audit,
                lease,
                maps: Vec::new(),
                bar_windows,
                kicks_told,
                claim,
                config,
                dirty_log: false,
                parked: Vec::new(),
            },
        );
        Ok(msg)
    }

    /// The triggers of `s`'s targets on this link, taking the eventfds they name out of
    /// `fds` (each at most once).
    fn irq_triggers(
        &self,
        s: &protocol::SetIrqs,
        fds: &mut [Option<OwnedFd>],
    ) -> Result<Vec<Option<Arc<dyn IrqTrigger>>>, ErrorReply> {
        let weak = Arc::downgrade(&self.ep);
        let doorbells = self.ep.doorbell_count();
        let mut targets: Vec<Option<Arc<dyn IrqTrigger>>> = Vec::new();
        for (vector, t) in s.targets.iter().enumerate() {
            let t: Option<Arc<dyn IrqTrigger>> = match *t {
                IrqTarget::None => None,
                IrqTarget::Fd(n) => {
                    let fd =
                        fds.get_mut(usize::from(n))
                            .and_then(Option::take)
                            .ok_or_else(|| {
                                error(
                            code::INVALID,
                            format!("vector {vector}: eventfd #{n} not attached (or used twice)"),
                        )
                            })?;
                    // SAFETY: the fd came from the borrower as an eventfd over SCM_RIGHTS; we
                    // own it, and EventFd only reads/writes 8-byte counters on it.
                    Some(Arc::new(unsafe { EventFd::from_raw_fd(fd.into_raw_fd()) }))
                }
                IrqTarget::Doorbell(bit) => {
                    if u32::from(bit) >= doorbells.min(64) {
                        return Err(error(
                            code::INVALID,
                            format!("vector {vector}: doorbell bit {bit} outside the link's {doorbells}"),
                        ));
                    }
                    Some(Arc::new(DoorbellTrigger {
                        ep: weak.clone(),
                        bit,
                    }))
                }
                IrqTarget::Event => Some(Arc::new(MessageTrigger {
                    ep: weak.clone(),
                    ev: IrqEvent {
                        lease: s.lease,
                        kind: s.kind,
                        vector: vector as u32,
                    },
                })),
            };
            targets.push(t);
        }
        Ok(targets)
    }

    fn set_irqs(&mut self, op: u16, s: protocol::SetIrqs, fds: Vec<OwnedFd>) -> Reply {
        let mut fds: Vec<Option<OwnedFd>> = fds.into_iter().map(Some).collect();
        let targets = self.irq_triggers(&s, &mut fds)?;
        let resample_fd = match s.resample {
            IrqTarget::Fd(n) => Some(
                fds.get_mut(usize::from(n))
                    .and_then(Option::take)
                    .ok_or_else(|| {
                        error(
                            code::INVALID,
                            format!("resample eventfd #{n} not attached (or used twice)"),
                        )
                    })?,
            ),
            _ => None,
        };
        let sl = self.lease(s.lease)?;
        let backend = Arc::clone(sl.lease.backend());
        if s.kind == IrqKind::Intx {
            // Stop watching the old resample eventfd before the targets change.
            sl.resample = None;
        }
        backend.set_irqs(s.kind, targets).map_err(backend_err)?;
        if let Some(fd) = resample_fd {
            // SAFETY: the fd came from the borrower as an eventfd over SCM_RIGHTS; we own it,
            // and EventFd only reads/writes 8-byte counters on it.
            let fd = unsafe { EventFd::from_raw_fd(fd.into_raw_fd()) };
            let trigger: Arc<dyn IrqTrigger> = Arc::new(ResampleTrigger { backend });
            let relay =
                IrqRelay::start(&format!("resample{}", s.lease), vec![fd], vec![trigger])
                    .map_err(|e| error(code::INTERNAL, format!("intx resample watcher: {e}")))?;
            sl.resample = Some(relay);
        }
        log::info!(
            "lease {}: {:?} wired to {} targets, resample {:?}",
            s.lease,
            s.kind,
            s.targets.len(),
            s.resample
        );
        ok(op, &())
    }

    fn window_removed(&mut self, window: WindowId) {
        for (id, sl) in self.leases.iter_mut() {
            let dom = sl.lease.backend().domain();
            sl.maps.retain(|e| {
                if e.window != window {
                    return true;
                }
                if let Err(err) = dom.unmap(e.iova, e.size) {
                    log::warn!("lease {id}: unmapping revoked window {window}: {err}");
                }
                log::info!(
                    "lease {id}: borrower revoked window {window}; iova {:#x} unmapped",
                    e.iova
                );
                false
            });
        }
    }

    /// Ends, with a `DeviceGone` event, every lease whose directory claim is no longer
    /// current (the fencing half that does not wait for the borrower to come back).
    fn end_stale_claims(&mut self) {
        let Some(claims) = self.lender.claims.clone() else {
            return;
        };
        let stale: Vec<u64> = self
            .leases
            .iter()
            .filter(|(_, sl)| {
                sl.claim
                    .is_some_and(|c| !claims.is_current(sl.lease.device().id(), c))
            })
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            if let Some(mut sl) = self.leases.remove(&id) {
                let reason = format!(
                    "directory claim {} on {} is no longer current",
                    sl.claim.unwrap_or_default(),
                    sl.lease.device().id()
                );
                log::warn!("lease {id} of {}: {reason}", self.peer());
                sl.lease.begin_release();
                self.lender.transfers.forget(self.id, Some(id), &reason);
                self.send_gone(id, &reason);
                sl.lease.set_end_reason(&reason);
            }
        }
    }

    fn send_gone(&self, id: u64, reason: &str) {
        let ev = Event::DeviceGone(DeviceGone {
            lease: id,
            reason: reason.to_string(),
        });
        if let Ok((op, p)) = ev.encode() {
            if let Err(e) = self.ep.send(Message::raw(op, p)) {
                log::debug!("device-gone event: {e}");
            }
        }
    }

    /// Ends every lease; optionally tells the borrower first. Every lease shows `releasing`
    /// before the first one's release starts (they are released one after the other).
    fn end_all(&mut self, reason: &str, notify: bool) {
        for sl in self.leases.values() {
            sl.lease.begin_release();
        }
        for (id, mut sl) in self.leases.drain() {
            if notify {
                let ev = Event::DeviceGone(DeviceGone {
                    lease: id,
                    reason: reason.to_string(),
                });
                if let Ok((op, p)) = ev.encode() {
                    if let Err(e) = self.ep.send(Message::raw(op, p)) {
                        log::debug!("device-gone event: {e}");
                    }
                }
            }
            sl.lease.set_end_reason(reason);
        }
    }
}

/// Shared flag set by SIGINT/SIGTERM handlers in `lenderd`.
pub type StopFlag = Arc<AtomicBool>;

/// A lender serving in a background thread (tests, embedding).
pub struct BackgroundLender {
    lender: Arc<Lender>,
    stop: StopFlag,
    thread: Mutex<Option<JoinHandle<Result<(), ServerError>>>>,
}

impl BackgroundLender {
    /// Serves `listener` on a new thread.
    pub fn start(lender: Arc<Lender>, listener: Box<dyn Listener>) -> std::io::Result<Self> {
        let stop = lender.stop_flag();
        let serving = Arc::clone(&lender);
        let thread = std::thread::Builder::new()
            .name("lender".into())
            .spawn(move || serving.serve(listener.as_ref()))?;
        Ok(BackgroundLender {
            lender,
            stop,
            thread: Mutex::new(Some(thread)),
        })
    }
}

impl BackgroundLender {
    /// The lender being served.
    pub fn lender(&self) -> &Arc<Lender> {
        &self.lender
    }
}

impl Drop for BackgroundLender {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let t = match self.thread.lock() {
            Ok(mut g) => g.take(),
            Err(p) => p.into_inner().take(),
        };
        if let Some(t) = t {
            let _ = t.join();
        }
    }
}
