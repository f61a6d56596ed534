//! Peer-to-peer DMA across lenders (protocol version 6, [`crate::protocol::p2px`]).
//!
//! Source device S on this lender (A), target T on lender B, both borrowed by one VM.
//!
//! * On B, [`GrantTable`]: the borrower holding T asks for a grant of T's BAR for lender A
//!   (P2P_GRANT). A grant is a value ([`GrantHandle`], held in T's lease registration) with a
//!   random capability secret; dropping it (P2P_REVOKE, T reset, T's lease ending or moving)
//!   ends its attachment first. A presents the grant over a lender-to-lender link that
//!   authenticated as A (P2P_ATTACH); B checks the grantee and the secret (constant time) and
//!   exports T's peer memory as a *mediated* fabric window on that link: A reads and writes
//!   exactly that range through B, never holding an fd of the device's memory, so a
//!   revocation is B's to enforce ([`Attachment`]).
//! * On A, [`PeerLenders`]: one authenticated link per peer lender, opened on first use
//!   with the cluster token exactly as a borrower's ([`crate::LenderClient`]) and closed
//!   when its last mapping ends, and a watcher thread per link (ends with the link). [`RemoteP2pMapping`] maps the attached window into S's IOMMU domain at
//!   IOVA = T's BAR address + the memory's offset in the BAR; dropping it unmaps and detaches.
//!   When B revokes the window or the link dies, the watcher unmaps every mapping through it
//!   at once (and a DMA racing with that finds the severed window and faults): S's DMA then
//!   faults, counted, with an error status.
//!
//! Failures an outsider can cause repeatedly (bad grants) are counted and logged
//! rate-limited.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use ntb::{
    ClusterConfig, Endpoint, ExportedWindow, FabricError, Incoming, Message, NodeId, PeerWindow,
};
use thiserror::Error;

use super::p2p::{peer_region, P2pError};
use super::{BackingError, DmaBacking, IommuDomain, IommuError};
use crate::backend::DeviceBackend;
use crate::client::{ClientError, LenderClient};
use crate::directory::Directory;
use crate::protocol::p2px::{self, P2pAttach, P2pAttached, P2pDetach, SECRET_LEN};
use crate::protocol::{self, Request};

/// Most grants one target lease may hold.
pub const MAX_GRANTS_PER_LEASE: usize = 64;
/// Bound on a lender-to-lender request.
const PEER_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a link watcher looks at the stop flag.
const WATCH_POLL: Duration = Duration::from_millis(100);

/// Errors of cross-lender peer-to-peer DMA.
#[derive(Debug, Error)]
pub enum RemoteP2pError {
    /// The target's BAR cannot be granted (no such BAR, no peer memory).
    #[error(transparent)]
    Peer(#[from] P2pError),
    /// A lease cannot grant to its own lender.
    #[error("lender {0} cannot be granted its own lease's memory (use P2P_MAP)")]
    SelfGrant(String),
    /// Too many grants on one lease.
    #[error("lease {0} already holds the maximum of {MAX_GRANTS_PER_LEASE} grants")]
    TooManyGrants(u64),
    /// Unknown grant, wrong grantee or secret (answered alike).
    #[error("grant {0} is unknown, revoked, or not this lender's")]
    BadGrant(u64),
    /// The grant is attached already.
    #[error("grant {0} is already attached")]
    Attached(u64),
    /// No randomness.
    #[error("no random secret: {0}")]
    Random(String),
    /// The peer memory could not be exported on the link.
    #[error("exporting grant {grant} on the link to {peer}: {source}")]
    Export {
        /// Grant id.
        grant: u64,
        /// The grantee.
        peer: String,
        /// Why.
        #[source]
        source: FabricError,
    },
    /// The target's lender is not reachable.
    #[error("cannot reach lender {lender}: {why}")]
    PeerLender {
        /// Its node name.
        lender: String,
        /// Why.
        why: String,
    },
    /// The target's lender refused the attach.
    #[error("lender {lender} refused grant {grant}: {message}")]
    Refused {
        /// Its node name.
        lender: String,
        /// Grant id.
        grant: u64,
        /// Its error code.
        code: u32,
        /// Its message.
        message: String,
    },
    /// Mapping the attached window failed.
    #[error("mapping the window of grant {grant} from {lender}: {source}")]
    Window {
        /// Its node name.
        lender: String,
        /// Grant id.
        grant: u64,
        /// Why.
        #[source]
        source: FabricError,
    },
    /// The source's domain refused the mapping.
    #[error("lease {lease}: {source}")]
    Iommu {
        /// Source lease.
        lease: u64,
        /// Why.
        #[source]
        source: IommuError,
    },
}

impl RemoteP2pError {
    /// The protocol error code of the reply.
    pub fn code(&self) -> u32 {
        use crate::protocol::code;
        match self {
            RemoteP2pError::Peer(P2pError::UnknownLease(_)) => code::UNKNOWN_LEASE,
            RemoteP2pError::Peer(P2pError::NoSuchBar { .. }) => code::OUT_OF_RANGE,
            RemoteP2pError::Peer(_)
            | RemoteP2pError::SelfGrant(_)
            | RemoteP2pError::TooManyGrants(_)
            | RemoteP2pError::Attached(_)
            | RemoteP2pError::Iommu {
                source:
                    IommuError::Overlap { .. }
                    | IommuError::Unaligned { .. }
                    | IommuError::BadRange { .. },
                ..
            } => code::INVALID,
            RemoteP2pError::BadGrant(_) => p2px::code::BAD_GRANT,
            RemoteP2pError::Refused { code, .. } => *code,
            RemoteP2pError::PeerLender { .. } | RemoteP2pError::Window { .. } => {
                p2px::code::PEER_LENDER
            }
            RemoteP2pError::Iommu { .. } => code::IOMMU,
            RemoteP2pError::Random(_) | RemoteP2pError::Export { .. } => code::INTERNAL,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Counts a refusal a borrower can repeat (BAR writes in a loop) and logs the first 16,
/// then one in 1024.
pub fn log_refusal(counter: &AtomicU64, what: std::fmt::Arguments<'_>) {
    let n = counter.fetch_add(1, Ordering::Relaxed) + 1;
    if n <= 16 || n.is_multiple_of(1024) {
        log::info!("{what} (refusal #{n})");
    } else {
        log::debug!("{what} (refusal #{n})");
    }
}

// ---------------------------------------------------------------------------------------
// Target side (lender B)
// ---------------------------------------------------------------------------------------

/// One grant of a target lease's peer memory to another lender.
pub struct Grant {
    id: u64,
    target: u64,
    bar: u8,
    grantee: String,
    secret: [u8; SECRET_LEN],
    /// A duplicate of the device's peer memory fd.
    fd: OwnedFd,
    fd_offset: u64,
    bar_offset: u64,
    size: u64,
    /// The window exported to the grantee while attached.
    attachment: Mutex<Option<ExportedWindow>>,
}

impl Grant {
    /// Ends the attachment (revokes the window: the grantee's mapping is severed and it is
    /// told); returns whether there was one.
    fn detach(&self, why: &str) -> bool {
        let w = lock(&self.attachment).take();
        match w {
            Some(w) => {
                log::info!(
                    "grant {} (lease {} bar {}) to {}: window {} revoked ({why})",
                    self.id,
                    self.target,
                    self.bar,
                    self.grantee,
                    w.id()
                );
                drop(w);
                true
            }
            None => false,
        }
    }
}

/// The lender-wide table of grants (see the module docs).
#[derive(Default)]
pub struct GrantTable {
    next: AtomicU64,
    grants: Mutex<HashMap<u64, Weak<Grant>>>,
    /// Attaches refused (unknown grant, wrong lender or secret).
    refused: AtomicU64,
}

/// A grant held by its target lease; dropping it detaches and forgets it.
pub struct GrantHandle {
    table: Arc<GrantTable>,
    grant: Arc<Grant>,
}

impl GrantHandle {
    /// The grant id.
    pub fn id(&self) -> u64 {
        self.grant.id
    }

    /// The capability secret.
    pub fn secret(&self) -> &[u8] {
        &self.grant.secret
    }

    /// Whether a grantee has it attached now.
    pub fn attached(&self) -> bool {
        lock(&self.grant.attachment).is_some()
    }
}

impl Drop for GrantHandle {
    fn drop(&mut self) {
        lock(&self.table.grants).remove(&self.grant.id);
        self.grant.detach("grant revoked");
    }
}

/// What a lender-to-lender session holds for its peer: the grants it attached.
#[derive(Default)]
pub struct Attachments {
    held: Vec<Weak<Grant>>,
}

impl Attachments {
    /// Ends the attachment of `grant` if this session holds it.
    pub fn detach(&mut self, grant: u64) {
        self.held.retain(|w| match w.upgrade() {
            Some(g) if g.id == grant => {
                g.detach("detached by the grantee");
                false
            }
            Some(_) => true,
            None => false,
        });
    }
}

impl Drop for Attachments {
    fn drop(&mut self) {
        for g in self.held.drain(..).filter_map(|w| w.upgrade()) {
            g.detach("the grantee's link ended");
        }
    }
}

impl GrantTable {
    /// Grants lender `grantee` access to the peer memory of BAR `bar` of lease `target`.
    pub fn grant(
        self: &Arc<Self>,
        target: u64,
        bar: u8,
        grantee: &str,
        backend: &dyn DeviceBackend,
    ) -> Result<GrantHandle, RemoteP2pError> {
        let (export, size) = peer_region(backend, target, bar)?;
        let fd = export
            .fd
            .try_clone_to_owned()
            .map_err(|source| P2pError::Backing {
                lease: target,
                bar,
                source: BackingError::Mmap {
                    size,
                    offset: export.fd_offset,
                    source,
                },
            })?;
        let mut secret = [0u8; SECRET_LEN];
        getrandom::fill(&mut secret).map_err(|e| RemoteP2pError::Random(e.to_string()))?;
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let grant = Arc::new(Grant {
            id,
            target,
            bar,
            grantee: grantee.to_string(),
            secret,
            fd,
            fd_offset: export.fd_offset,
            bar_offset: export.bar_offset,
            size,
            attachment: Mutex::new(None),
        });
        lock(&self.grants).insert(id, Arc::downgrade(&grant));
        log::info!("lease {target}: bar {bar} granted to lender {grantee} (grant {id})");
        Ok(GrantHandle {
            table: Arc::clone(self),
            grant,
        })
    }

    /// Attaches grant `a.grant` for the peer of `ep` (authenticated as `ep.peer_node()`):
    /// checks grantee and secret, exports the peer memory on `ep`.
    pub fn attach(
        &self,
        ep: &dyn Endpoint,
        a: &P2pAttach,
        held: &mut Attachments,
    ) -> Result<P2pAttached, RemoteP2pError> {
        let peer = ep.peer_node().to_string();
        let g = lock(&self.grants).get(&a.grant).and_then(Weak::upgrade);
        let Some(g) =
            g.filter(|g| g.grantee == peer && crate::auth::same_secret(&g.secret, &a.secret))
        else {
            // Anyone authenticated can knock with made-up grants: count, log rate-limited.
            let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
            if n <= 16 || n.is_multiple_of(1024) {
                log::warn!(
                    "{peer}: p2p attach of grant {} refused (refusal #{n})",
                    a.grant
                );
            }
            return Err(RemoteP2pError::BadGrant(a.grant));
        };
        let mut slot = lock(&g.attachment);
        if slot.is_some() {
            return Err(RemoteP2pError::Attached(g.id));
        }
        let label = format!("p2p-grant{}-lease{}-bar{}", g.id, g.target, g.bar);
        // Mediated on every fabric: the grantee never receives the device's memfd (which
        // holds its registers too, and which it could keep past a revocation); it reads and
        // writes exactly the granted range through this lender, and the window's drop ends
        // that for good.
        let w = ep
            .export_window_mediated(g.fd.as_fd(), g.fd_offset, g.size, &label)
            .map_err(|source| RemoteP2pError::Export {
                grant: g.id,
                peer: peer.clone(),
                source,
            })?;
        let r = P2pAttached {
            window: w.id(),
            bar_offset: g.bar_offset,
            size: g.size,
        };
        log::info!(
            "grant {} (lease {} bar {}) attached by {peer}: window {}",
            g.id,
            g.target,
            g.bar,
            w.id()
        );
        *slot = Some(w);
        drop(slot);
        held.held.retain(|w| w.strong_count() > 0);
        held.held.push(Arc::downgrade(&g));
        Ok(r)
    }

    /// Whether `grant` is a live grant of (`target`, `bar`) to `grantee` with `secret`
    /// (same-lender capability check; a failure is counted like a refused attach).
    pub fn check(&self, grant: u64, target: u64, bar: u8, grantee: &str, secret: &[u8]) -> bool {
        let g = lock(&self.grants).get(&grant).and_then(Weak::upgrade);
        let ok = g.is_some_and(|g| {
            g.target == target
                && g.bar == bar
                && g.grantee == grantee
                && crate::auth::same_secret(&g.secret, secret)
        });
        if !ok {
            let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
            if n <= 16 || n.is_multiple_of(1024) {
                log::warn!(
                    "p2p capability of grant {grant} for lease {target} refused (refusal #{n})"
                );
            }
        }
        ok
    }

    /// Attaches refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Grants that are attached now (tests, status).
    pub fn attached(&self) -> usize {
        lock(&self.grants)
            .values()
            .filter_map(Weak::upgrade)
            .filter(|g| lock(&g.attachment).is_some())
            .count()
    }
}

// ---------------------------------------------------------------------------------------
// Source side (lender A)
// ---------------------------------------------------------------------------------------

/// A peer lender's window as DMA backing. Refuses every access once the window is severed
/// (revoked by its exporter or the link died), so a DMA racing with the unmap faults rather
/// than landing in the anonymous memory that replaces a severed mapping.
struct RemoteWindowBacking {
    win: Box<dyn PeerWindow>,
}

impl DmaBacking for RemoteWindowBacking {
    fn size(&self) -> u64 {
        self.win.len()
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackingError> {
        if !self.win.is_live() {
            return Err(BackingError::Transfer("peer window severed".into()));
        }
        self.win
            .read_at(offset, buf)
            .map_err(|e| BackingError::Transfer(e.to_string()))
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), BackingError> {
        if !self.win.is_live() {
            return Err(BackingError::Transfer("peer window severed".into()));
        }
        self.win
            .write_at(offset, data)
            .map_err(|e| BackingError::Transfer(e.to_string()))
    }

    /// The engine's buffer goes to the window without a staging copy here: a staged
    /// mediated window (shm) copies it once into the target lender's ring.
    fn write_from_raw(
        &self,
        offset: u64,
        src: emulated::RawSpan<'_>,
        _scratch: &mut Vec<u8>,
    ) -> Result<(), BackingError> {
        if !self.win.is_live() {
            return Err(BackingError::Transfer("peer window severed".into()));
        }
        // SAFETY: a RawSpan is valid for reads of its length for its lifetime, which spans
        // this call; the window reaches it by raw copies only.
        unsafe { self.win.write_raw(offset, src.as_ptr(), src.len()) }
            .map_err(|e| BackingError::Transfer(e.to_string()))
    }

    fn host_addr(&self) -> Option<std::ptr::NonNull<u8>> {
        self.win.as_ptr().ok().and_then(std::ptr::NonNull::new)
    }
}

/// The shared part of a remote mapping: its holder and the link watcher can end it.
struct RemoteMapped {
    domain: Arc<dyn IommuDomain>,
    iova: u64,
    size: u64,
    source: u64,
    lender: String,
    target: u64,
    bar: u8,
    grant: u64,
    window: u32,
    link: Weak<PeerLink>,
    live: Mutex<bool>,
}

impl RemoteMapped {
    /// Unmaps once (and, when the link is up and `detach`, tells the target's lender).
    fn revoke(&self, why: &str, detach: bool) -> bool {
        let mut live = lock(&self.live);
        if !*live {
            return false;
        }
        *live = false;
        if let Err(e) = self.domain.unmap(self.iova, self.size) {
            log::debug!(
                "lease {}: remote p2p mapping already gone: {e}",
                self.source
            );
        }
        log::info!(
            "lease {}: p2p mapping of lease {} bar {} on {} at iova {:#x} removed ({why})",
            self.source,
            self.target,
            self.bar,
            self.lender,
            self.iova
        );
        drop(live);
        if detach {
            if let Some(l) = self.link.upgrade() {
                l.detach(self.grant);
            }
        }
        true
    }
}

/// One mapping of another lender's peer memory in a source lease's domain; dropping it
/// unmaps it and ends the attachment.
pub struct RemoteP2pMapping {
    shared: Arc<RemoteMapped>,
}

impl RemoteP2pMapping {
    /// Whether it is still mapped (not revoked by the target's lender, link alive).
    pub fn is_live(&self) -> bool {
        *lock(&self.shared.live)
    }

    /// IOVA of the mapping.
    pub fn iova(&self) -> u64 {
        self.shared.iova
    }
}

impl Drop for RemoteP2pMapping {
    fn drop(&mut self) {
        self.shared.revoke("unmapped by its source", true);
        if let Some(l) = self.shared.link.upgrade() {
            l.release_if_idle();
        }
    }
}

/// One authenticated link to a peer lender.
struct PeerLink {
    node: String,
    client: LenderClient,
    mappings: Mutex<Vec<Weak<RemoteMapped>>>,
    dead: AtomicBool,
    /// Maps in progress over the link (it is not closed under them).
    pending: AtomicUsize,
    lenders: Weak<PeerLenders>,
}

/// A map in progress over a link; its end may leave the link idle.
struct Pending(Arc<PeerLink>);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.pending.fetch_sub(1, Ordering::AcqRel);
        self.0.release_if_idle();
    }
}

impl PeerLink {
    fn live_mappings(&self) -> usize {
        let mut g = lock(&self.mappings);
        g.retain(|w| w.strong_count() > 0);
        g.iter()
            .filter_map(Weak::upgrade)
            .filter(|m| *lock(&m.live))
            .count()
    }

    /// Closes the link once it carries no mapping and none is being made: a link's
    /// resources (socket, doorbells, the peer's session) live no longer than its use.
    fn release_if_idle(self: &Arc<Self>) {
        let Some(lenders) = self.lenders.upgrade() else {
            return;
        };
        {
            let mut links = lock(&lenders.links);
            if self.pending.load(Ordering::Acquire) > 0 || self.live_mappings() > 0 {
                return;
            }
            if links.get(&self.node).is_some_and(|x| Arc::ptr_eq(x, self)) {
                links.remove(&self.node);
            }
        }
        if !self.dead.swap(true, Ordering::AcqRel) {
            log::info!(
                "lender-to-lender link to {} closed: no peer-to-peer mapping left",
                self.node
            );
            self.ep().close();
        }
    }

    fn ep(&self) -> &Arc<dyn Endpoint> {
        self.client.endpoint()
    }

    fn request<T: serde::de::DeserializeOwned>(&self, r: &Request) -> Result<T, ClientError> {
        let (op, p) = r.encode()?;
        let reply = self
            .ep()
            .request(Message::raw(op, p), PEER_TIMEOUT)
            .map_err(|e| match e {
                FabricError::Remote(r) => ClientError::Remote {
                    lender: self.node.clone(),
                    code: r.code,
                    message: r.message,
                },
                other => ClientError::Fabric(other),
            })?;
        Ok(protocol::decode_reply(op, &reply.payload)?)
    }

    fn detach(&self, grant: u64) {
        if self.dead.load(Ordering::Acquire) {
            return;
        }
        if let Err(e) = self.request::<()>(&Request::P2pDetach(P2pDetach { grant })) {
            log::debug!("p2p detach of grant {grant} at {}: {e}", self.node);
        }
    }

    /// Revokes every mapping through the link whose window is `window` (all if `None`).
    fn revoke(&self, window: Option<u32>, why: &str) -> usize {
        let ms: Vec<Arc<RemoteMapped>> = {
            let mut g = lock(&self.mappings);
            g.retain(|w| w.strong_count() > 0);
            g.iter().filter_map(Weak::upgrade).collect()
        };
        ms.iter()
            .filter(|m| window.is_none_or(|w| m.window == w))
            .filter(|m| m.revoke(why, false))
            .count()
    }
}

/// This lender's links to other lenders, for cross-lender P2P (see the module docs).
pub struct PeerLenders {
    local: String,
    token: String,
    cluster: Mutex<Option<ClusterConfig>>,
    /// The cluster directory (etcd), for lenders the cluster file does not name, with the
    /// link settings to reach them.
    directory: Mutex<Option<(Arc<dyn Directory>, ClusterConfig)>>,
    links: Mutex<HashMap<String, Arc<PeerLink>>>,
    stop: Arc<AtomicBool>,
    /// Mappings ended because their link died or the target's lender revoked them.
    revoked: AtomicU64,
    /// Remote maps and grants this lender refused (for the log rate limit).
    pub(crate) refusals: AtomicU64,
}

impl PeerLenders {
    /// Links of lender `local` (authenticating with `token`), until `stop` is set.
    pub fn new(local: &str, token: &str, stop: Arc<AtomicBool>) -> Self {
        PeerLenders {
            local: local.to_string(),
            token: token.to_string(),
            cluster: Mutex::new(None),
            directory: Mutex::new(None),
            links: Mutex::default(),
            stop,
            revoked: AtomicU64::new(0),
            refusals: AtomicU64::new(0),
        }
    }

    /// Where the other lenders are (the cluster file). Without it or a directory,
    /// cross-lender P2P is refused with `PEER_LENDER`.
    pub fn set_cluster(&self, cluster: ClusterConfig) {
        *lock(&self.cluster) = Some(cluster);
    }

    /// Where lenders the cluster file does not name are found (the etcd directory they
    /// register in), and the link settings (`base`: timers, this node's) to reach them.
    pub fn set_directory(&self, directory: Arc<dyn Directory>, base: ClusterConfig) {
        *lock(&self.directory) = Some((directory, base));
    }

    /// Mappings the target side or a link loss ended so far.
    pub fn revoked(&self) -> u64 {
        self.revoked.load(Ordering::Relaxed)
    }

    /// Links up now.
    pub fn links(&self) -> usize {
        lock(&self.links).len()
    }

    /// Closes every link (the lender stops).
    pub fn close_all(&self) {
        let links: Vec<_> = lock(&self.links).drain().map(|(_, l)| l).collect();
        for l in links {
            l.revoke(None, "lender stopping");
            l.ep().close();
        }
    }

    /// The link to `lender` (opened if needed), marked busy until the returned value drops.
    fn link(self: &Arc<Self>, lender: &str) -> Result<Pending, RemoteP2pError> {
        let err = |why: String| RemoteP2pError::PeerLender {
            lender: lender.to_string(),
            why,
        };
        // Connect under the table's lock: two sources asking at once share one link.
        let mut links = lock(&self.links);
        if let Some(l) = links.get(lender) {
            if !l.dead.load(Ordering::Acquire) && l.ep().is_up() {
                l.pending.fetch_add(1, Ordering::AcqRel);
                return Ok(Pending(Arc::clone(l)));
            }
            links.remove(lender);
        }
        let name = format!("lenderd {} (p2p)", self.local);
        let cluster = lock(&self.cluster).clone();
        let directory = lock(&self.directory).clone();
        let client = match (cluster, directory) {
            (Some(c), _) if c.node(lender).is_some() => {
                LenderClient::connect(&c, &self.local, lender, &self.token, &name)
            }
            // Not in the file: the directory has every registered lender's address.
            (_, Some((dir, base))) => {
                let node = dir
                    .lender(lender)
                    .map_err(|e| err(format!("the cluster directory: {e}")))?;
                let local = NodeId::new(&self.local).map_err(|e| err(e.to_string()))?;
                LenderClient::connect_node(&base, &node, &local, PEER_TIMEOUT, &self.token, &name)
            }
            (Some(_), None) => return Err(err("it is not in this lender's cluster file".into())),
            (None, None) => {
                return Err(err(
                    "this lender has no cluster file or directory to find it in".into(),
                ))
            }
        }
        .map_err(|e| err(e.to_string()))?;
        if client.protocol_version() < p2px::P2PX_VERSION {
            return Err(err(format!(
                "it speaks protocol version {}, cross-lender p2p needs {}",
                client.protocol_version(),
                p2px::P2PX_VERSION
            )));
        }
        let link = Arc::new(PeerLink {
            node: lender.to_string(),
            client,
            mappings: Mutex::default(),
            dead: AtomicBool::new(false),
            pending: AtomicUsize::new(1),
            lenders: Arc::downgrade(self),
        });
        let (l, me) = (Arc::clone(&link), Arc::downgrade(self));
        std::thread::Builder::new()
            .name(format!("p2p-link-{lender}"))
            .spawn(move || watch(&l, &me))
            .map_err(|e| err(format!("no watcher thread: {e}")))?;
        log::info!("lender-to-lender link to {lender} up (peer-to-peer dma)");
        links.insert(lender.to_string(), Arc::clone(&link));
        Ok(Pending(link))
    }

    /// Maps BAR `bar` of lease `target` on lender `lender` (granted as `grant`/`secret`) into
    /// `domain` (lease `source`'s) at `iova` + the memory's offset in the BAR.
    #[allow(clippy::too_many_arguments)]
    pub fn map(
        self: &Arc<Self>,
        source: u64,
        domain: Arc<dyn IommuDomain>,
        lender: &str,
        target: u64,
        bar: u8,
        iova: u64,
        grant: u64,
        secret: &[u8],
    ) -> Result<RemoteP2pMapping, RemoteP2pError> {
        if lender == self.local {
            return Err(RemoteP2pError::SelfGrant(lender.to_string()));
        }
        let pending = self.link(lender)?;
        let link = Arc::clone(&pending.0);
        let attached: P2pAttached = link
            .request(&Request::P2pAttach(P2pAttach {
                grant,
                secret: secret.to_vec(),
            }))
            .map_err(|e| match e.code() {
                Some(code) => RemoteP2pError::Refused {
                    lender: lender.to_string(),
                    grant,
                    code,
                    message: e.to_string(),
                },
                None => RemoteP2pError::PeerLender {
                    lender: lender.to_string(),
                    why: e.to_string(),
                },
            })?;
        let detach_on_err = |e: RemoteP2pError| {
            link.detach(grant);
            e
        };
        let win = link
            .ep()
            .map_peer_window(attached.window)
            .map_err(|source| RemoteP2pError::Window {
                lender: lender.to_string(),
                grant,
                source,
            })
            .map_err(detach_on_err)?;
        if win.len() < attached.size {
            return Err(detach_on_err(RemoteP2pError::Iommu {
                lease: source,
                source: IommuError::BackingTooSmall {
                    size: attached.size,
                    backing: win.len(),
                },
            }));
        }
        let at = iova
            .checked_add(attached.bar_offset)
            .ok_or(RemoteP2pError::Iommu {
                lease: source,
                source: IommuError::BadRange {
                    iova,
                    size: attached.size,
                },
            })
            .map_err(detach_on_err)?;
        domain
            .map(at, attached.size, Arc::new(RemoteWindowBacking { win }))
            .map_err(|e| RemoteP2pError::Iommu {
                lease: source,
                source: e,
            })
            .map_err(detach_on_err)?;
        let shared = Arc::new(RemoteMapped {
            domain,
            iova: at,
            size: attached.size,
            source,
            lender: lender.to_string(),
            target,
            bar,
            grant,
            window: attached.window,
            link: Arc::downgrade(&link),
            live: Mutex::new(true),
        });
        lock(&link.mappings).push(Arc::downgrade(&shared));
        drop(pending);
        log::info!(
            "lease {source}: bar {bar} of lease {target} on {lender} mapped at iova {at:#x} size \
             {:#x} (peer-to-peer across lenders, grant {grant})",
            attached.size
        );
        Ok(RemoteP2pMapping { shared })
    }
}

/// The link's only reader: window revocations and the link's death unmap at once.
fn watch(link: &Arc<PeerLink>, lenders: &Weak<PeerLenders>) {
    let why = loop {
        let stop = lenders
            .upgrade()
            .is_none_or(|l| l.stop.load(Ordering::Relaxed));
        if stop {
            break "lender stopping".to_string();
        }
        match link.ep().recv(WATCH_POLL) {
            Ok(Incoming::WindowRemoved(id)) => {
                let n = link.revoke(Some(id), "revoked by the target's lender");
                if let Some(l) = lenders.upgrade() {
                    l.revoked.fetch_add(n as u64, Ordering::Relaxed);
                }
                link.release_if_idle();
            }
            Ok(Incoming::Request { id, .. }) => {
                let e = protocol::error(
                    protocol::code::UNKNOWN_OPCODE,
                    "a lender-to-lender link takes no requests",
                );
                let _ = link.ep().reply(id, Err(e));
            }
            Ok(_) | Err(FabricError::Timeout(_)) => {}
            Err(e) => break e.to_string(),
        }
    };
    link.dead.store(true, Ordering::Release);
    let n = link.revoke(None, &format!("link to lender {} down: {why}", link.node));
    if let Some(l) = lenders.upgrade() {
        l.revoked.fetch_add(n as u64, Ordering::Relaxed);
        let mut links = lock(&l.links);
        if links.get(&link.node).is_some_and(|x| Arc::ptr_eq(x, link)) {
            links.remove(&link.node);
        }
    }
    log::info!(
        "lender-to-lender link to {} ended ({why}); {n} p2p mappings unmapped",
        link.node
    );
}
