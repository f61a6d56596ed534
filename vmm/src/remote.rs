//! Borrowing remote devices: cluster-file resolution, one lender connection per device, the
//! link wrapper the VMM hands to `remote_pci::RemotePciDevice`, and the VMM-wide resource
//! counters used for leak accounting.
//!
//! * [`LenderSource`] resolves `node3:0000:81:00.0` through the cluster file, opens a fabric
//!   link straight to the node's control address under the VMM's own node name (`--node`,
//!   default `lendvm-<pid>`; the VMM need not be in the cluster file, like `lendctl`), says
//!   hello with the cluster token, borrows the device for the VM (`--name`, default
//!   `vm-<pid>`) and wraps the lease in a [`LendingLink`]. Every device borrowed from one
//!   lender shares one [`LenderSession`] (one link, one event pump, one export of guest
//!   RAM); the source keeps the sessions weakly, and a session whose link ended is never used
//!   again. A session whose last device went is kept idle for [`SESSION_IDLE`] by a reaper
//!   thread ([`SessionKeeper`]), so the next device borrowed there (a re-add, a replacement)
//!   reuses the authenticated link instead of setting up a new one; then its link closes.
//! * [`VmmLink`] wraps any [`RemoteDeviceLink`]: `mode=trapped` turns every BAR into a
//!   trapped one, and the wrapper counts live leases in [`ResourceCounters`] until it is
//!   dropped (after the inner link has returned the lease).
//! * [`CountingPinner`] wraps the pinner so pinned bytes are counted VMM-wide.
//! * With a cluster directory ([`LenderSource::with_directory`], etcd) the lender's address
//!   comes from the directory, the device is claimed there first (create-if-absent, under
//!   this VMM's own lease) and borrowed with the claim's revision as fencing token; the
//!   [`ClaimedLink`] reports the lease lost when the directory says the lender, the device or
//!   the claim is gone, so the event loop's lease check performs the usual surprise removal.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use api::types::{RemoteDeviceMode, RemoteDeviceSpec};
use lending::client::{ClientError, LenderClient};
use lending::directory::{ClaimHandle, Directory, DirectoryError};
use lending::protocol::code;
use ntb::{ClusterConfig, NodeConfig, NodeId};
use pci::vm_ops::GuestRamRegion;
use remote_pci::lending_link::{
    LenderSession, LendingLink, LendingLinkError, SessionCounters, SessionOptions,
};
use remote_pci::{
    BarAccess, DmaMapping, IrqTargets, KickDoorbells, LeaseState, LenderCounters, LinkError,
    LinkEventHook, PinError, PinnedRange, Pinner, RemoteDeviceInfo, RemoteDeviceLink,
};

/// Client name given in the lender hello (lenderd logs it).
pub const CLIENT_NAME: &str = "lendvm";

/// How long, by default (`lendvm --lender-idle-ms`), a lender session whose last device went
/// is kept for the next device borrowed there. A new session costs a link set-up (tcp: TCP and TLS handshakes), the AUTH and
/// HELLO round trips and about five thread starts on each side; on a busy host that was
/// where a hot-add's tail went (docs/BENCHMARKS.md, "Hot-add latency"). Short, so a lender
/// whose devices were all returned sees the link end soon after, and the borrower holds
/// no idle connection for long.
pub const SESSION_IDLE: Duration = Duration::from_millis(SESSION_IDLE_MS);
/// [`SESSION_IDLE`] in milliseconds.
pub const SESSION_IDLE_MS: u64 = 1000;
/// How soon the reaper looks again at a session that has no lease left but is still held
/// (a device being dropped right now).
const SESSION_RECHECK: Duration = Duration::from_millis(50);

/// Why a remote device could not be borrowed. Each names the node and the cause in one line.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("unknown node {node} (known: {known})")]
    UnknownNode { node: String, known: String },
    #[error("lender {node} is unreachable at {addr}: {reason}")]
    Unreachable {
        node: String,
        addr: String,
        reason: String,
    },
    #[error("lender {node} refused the connection: {reason}")]
    Refused { node: String, reason: String },
    #[error("node {node} has no device {bdf} to lend")]
    UnknownDevice { node: String, bdf: String },
    #[error("{node}:{bdf}: {message}")]
    Busy {
        node: String,
        bdf: String,
        message: String,
    },
    #[error("borrowing {node}:{bdf}: {reason}")]
    Borrow {
        node: String,
        bdf: String,
        reason: String,
    },
    #[error("setting up the link to {node}:{bdf}: {reason}")]
    Link {
        node: String,
        bdf: String,
        reason: String,
    },
    /// This VMM failed, not the lender (an fd or thread it could not create, a bad local
    /// node name).
    #[error("borrowing {node}:{bdf}: this vmm failed: {reason}")]
    Local {
        node: String,
        bdf: String,
        reason: String,
    },
}

impl AttachError {
    /// Whether the lender (or the fabric path to it) failed, rather than the request (unknown
    /// node or device, device busy) or this VMM: unreachable, refused the connection, went
    /// away or failed during the borrow or while its windows were mapped. The API answers
    /// such failures with 502 Bad Gateway.
    pub fn is_lender_failure(&self) -> bool {
        match self {
            AttachError::Unreachable { .. }
            | AttachError::Refused { .. }
            | AttachError::Borrow { .. }
            | AttachError::Link { .. } => true,
            AttachError::UnknownNode { .. }
            | AttachError::UnknownDevice { .. }
            | AttachError::Busy { .. }
            | AttachError::Local { .. } => false,
        }
    }
}

/// Whether a client error is this process's own failure (an fd operation) rather than the
/// lender's or the fabric's.
fn is_local(e: &ClientError) -> bool {
    matches!(e, ClientError::Os { .. })
}

/// Where remote devices come from (the real lenders, or a fake in tests).
pub trait LinkSource: Send {
    /// Checks, without network traffic, that `node` is known.
    fn check_node(&self, node: &str) -> Result<(), AttachError> {
        let _ = node;
        Ok(())
    }

    /// Borrows `spec` for this VM; the returned link holds the lease.
    fn borrow(&self, spec: &RemoteDeviceSpec) -> Result<Box<dyn RemoteDeviceLink>, AttachError>;

    /// The guest NUMA node `node`'s devices go in when the request names none (the cluster
    /// file's `numa_node` of that lender).
    fn default_numa_node(&self, node: &str) -> Option<u32> {
        let _ = node;
        None
    }

    /// This VMM's fabric node and VM name, which a migration source names in the transfer
    /// tickets of its leases (`None`: this VMM cannot take leases over).
    fn identity(&self) -> Option<(String, String)> {
        None
    }

    /// Connections to lenders and exports of guest RAM alive now (leak accounting).
    fn fabric_counts(&self) -> FabricCounts {
        FabricCounts::default()
    }

    /// The longest a lender of this cluster may take to answer one request (the links'
    /// `request_timeout`): a migration source waits that long per lent device, on top of
    /// its stream timeout, for the destination to take the leases over and map their
    /// windows.
    fn request_timeout(&self) -> Duration {
        ntb::fabric::DEFAULT_REQUEST_TIMEOUT
    }

    /// A link this source gave out was dropped (a device torn down, an add that failed):
    /// sessions left without devices start their idle time now.
    fn released(&self) {}

    /// Takes over the lease of `spec` that a migration source authorised with `ticket`
    /// (live migration: the device is not reset). The lease comes without DMA windows and
    /// interrupt targets; the device is still quiesced for the hand-over.
    fn accept(
        &self,
        spec: &RemoteDeviceSpec,
        ticket: &remote_pci::LeaseTicket,
    ) -> Result<Box<dyn RemoteDeviceLink>, AttachError> {
        let _ = ticket;
        Err(AttachError::Local {
            node: spec.node.clone(),
            bdf: lender_device_id(spec),
            reason: "this vmm cannot take leases over".into(),
        })
    }
}

/// How a device's lease is obtained.
enum Take<'a> {
    /// A fresh borrow (under a directory claim's revision).
    Borrow(Option<i64>),
    /// A lease moved from a migration source.
    Accept(&'a remote_pci::LeaseTicket),
}

/// Who this VMM is on the fabric.
#[derive(Clone, Debug)]
pub struct FabricIdentity {
    /// Our node name in link handshakes.
    pub local: String,
    /// VM name given to lenders (shown in `device busy, lent to NODE/VM`).
    pub vm_name: String,
    /// Cluster auth token.
    pub token: String,
}

/// What [`LinkSource::fabric_counts`] reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FabricCounts {
    /// Sessions (connections to a lender) that devices hold; one kept idle for reuse
    /// ([`SESSION_IDLE`]) is not counted.
    pub sessions: u64,
    /// Exports of guest RAM as fabric windows alive (at most one per session).
    pub ram_exports: u64,
}

/// Borrows from the lenders of a cluster file, or of a cluster directory.
pub struct LenderSource {
    cluster: ClusterConfig,
    id: FabricIdentity,
    directory: Option<Arc<dyn Directory>>,
    /// The session to each lender, by (node, control address): shared by the devices
    /// borrowed there, held by them (weak here).
    sessions: Mutex<HashMap<(String, String), Weak<LenderSession>>>,
    counters: Arc<SessionCounters>,
    keeper: SessionKeeper,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A session the keeper holds, and since when nothing else does.
struct Kept {
    session: Arc<LenderSession>,
    idle_since: Option<Instant>,
}

impl Kept {
    /// Whether only the keeper holds it (no device, no borrow in flight).
    fn idle(&self) -> bool {
        Arc::strong_count(&self.session) == 1
    }
}

#[derive(Default)]
struct KeeperState {
    /// At most one per (lender, address): bounded by the lenders this VMM borrowed from.
    sessions: HashMap<(String, String), Kept>,
    stop: bool,
}

#[derive(Default)]
struct KeeperShared {
    state: Mutex<KeeperState>,
    cond: Condvar,
}

/// Holds every session this source opened, so that one whose devices are all gone stays
/// open for the idle time ([`SESSION_IDLE`] by default); a reaper thread closes it then (or
/// at once if its link ended). The thread sleeps until told a link was released or an idle
/// time ends: no polling.
pub struct SessionKeeper {
    shared: Arc<KeeperShared>,
    reaper: Mutex<Option<JoinHandle<()>>>,
    idle: Duration,
}

impl Default for SessionKeeper {
    fn default() -> Self {
        Self {
            shared: Arc::default(),
            reaper: Mutex::default(),
            idle: SESSION_IDLE,
        }
    }
}

impl SessionKeeper {
    /// Keeps `session` under `key` (replacing a session whose link ended); false if idle
    /// sessions are not kept (idle time 0) or the reaper cannot run: the session then closes
    /// with its last device.
    fn keep(&self, key: (String, String), session: &Arc<LenderSession>) -> bool {
        if self.idle.is_zero() {
            return false;
        }
        {
            let mut r = lock(&self.reaper);
            if r.is_none() {
                let shared = Arc::clone(&self.shared);
                let idle = self.idle;
                match std::thread::Builder::new()
                    .name("lender-sessions".into())
                    .spawn(move || reap(&shared, idle))
                {
                    Ok(h) => *r = Some(h),
                    Err(e) => {
                        log::warn!("cannot start the idle lender session reaper: {e}");
                        return false;
                    }
                }
            }
        }
        let old = lock(&self.shared.state).sessions.insert(
            key,
            Kept {
                session: Arc::clone(session),
                idle_since: None,
            },
        );
        // Dropped outside the lock: closing a link joins its threads.
        drop(old);
        true
    }

    /// Sessions kept that no device holds now.
    fn idle(&self) -> usize {
        lock(&self.shared.state)
            .sessions
            .values()
            .filter(|k| k.idle())
            .count()
    }

    /// Makes the reaper look at the sessions again. Taken under the lock, so the wake-up
    /// cannot fall between a sweep that saw the old state and the reaper's wait.
    fn wake(&self) {
        let _st = lock(&self.shared.state);
        self.shared.cond.notify_all();
    }
}

impl Drop for SessionKeeper {
    fn drop(&mut self) {
        lock(&self.shared.state).stop = true;
        self.shared.cond.notify_all();
        if let Some(h) = lock(&self.reaper).take() {
            if h.join().is_err() {
                log::error!("the idle lender session reaper panicked");
            }
        }
        // The sessions still kept close as `shared` drops (their devices are gone by now).
    }
}

/// The reaper: closes sessions idle for `idle` or whose link ended.
fn reap(shared: &KeeperShared, idle: Duration) {
    let mut st = lock(&shared.state);
    loop {
        if st.stop {
            return;
        }
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        let mut closing = Vec::new();
        st.sessions.retain(|(node, _), k| {
            if !k.idle() {
                k.idle_since = None;
                if k.session.leases() == 0 {
                    // Its last device is being dropped right now: look again soon.
                    let t = now + SESSION_RECHECK;
                    next = Some(next.map_or(t, |n| n.min(t)));
                }
                return true;
            }
            let since = *k.idle_since.get_or_insert(now);
            if !k.session.is_usable() || now >= since + idle {
                log::debug!("{node}: closing the idle lender session");
                closing.push(Arc::clone(&k.session));
                return false;
            }
            let t = since + idle;
            next = Some(next.map_or(t, |n| n.min(t)));
            true
        });
        if !closing.is_empty() {
            // Closing joins the session's threads: not under the lock.
            drop(st);
            drop(closing);
            st = lock(&shared.state);
            continue;
        }
        st = match next {
            Some(t) => {
                shared
                    .cond
                    .wait_timeout(st, t.saturating_duration_since(now))
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            }
            None => shared.cond.wait(st).unwrap_or_else(PoisonError::into_inner),
        };
    }
}

impl LenderSource {
    pub fn new(cluster: ClusterConfig, id: FabricIdentity) -> Self {
        Self {
            cluster,
            id,
            directory: None,
            sessions: Mutex::default(),
            counters: Arc::default(),
            keeper: SessionKeeper::default(),
        }
    }

    /// How long a session whose last device went stays open for the next device borrowed
    /// from its lender (default [`SESSION_IDLE`]; zero: it closes with its last device).
    /// Set before the first borrow.
    pub fn set_session_idle(&mut self, idle: Duration) {
        self.keeper.idle = idle;
    }

    /// Lenders are found, and devices claimed, in `directory`; `cluster` (possibly without
    /// nodes) still gives this VMM's own link settings if it names it.
    pub fn with_directory(
        cluster: ClusterConfig,
        id: FabricIdentity,
        directory: Arc<dyn Directory>,
    ) -> Self {
        Self {
            cluster,
            id,
            directory: Some(directory),
            sessions: Mutex::default(),
            counters: Arc::default(),
            keeper: SessionKeeper::default(),
        }
    }
}

/// Why a directory step failed, as an attach error of `node:bdf`.
fn directory_err(node: &str, bdf: &str, e: DirectoryError) -> AttachError {
    match e {
        DirectoryError::UnknownLender { .. } => AttachError::UnknownNode {
            node: node.to_string(),
            known: "not registered in the cluster directory".into(),
        },
        DirectoryError::UnknownDevice { .. } => AttachError::UnknownDevice {
            node: node.to_string(),
            bdf: bdf.to_string(),
        },
        DirectoryError::Claimed { .. } => AttachError::Busy {
            node: node.to_string(),
            bdf: bdf.to_string(),
            message: e.to_string(),
        },
        other => AttachError::Borrow {
            node: node.to_string(),
            bdf: bdf.to_string(),
            reason: format!("cluster directory: {other}"),
        },
    }
}

/// Writes `RemoteDeviceLink` methods of a wrapper that only hand the call to `self.inner`.
/// Several methods have default bodies, so a wrapper that forgets one compiles and silently
/// turns the feature off (it happened twice): wrappers list what they forward here and write
/// only what they change.
macro_rules! forward_link {
    ($($m:ident),* $(,)?) => { $(forward_link!(@ $m);)* };
    (@ device_info) => {
        fn device_info(&self) -> RemoteDeviceInfo {
            self.inner.device_info()
        }
    };
    (@ config_read) => {
        fn config_read(&self, offset: u16, data: &mut [u8]) -> Result<(), LinkError> {
            self.inner.config_read(offset, data)
        }
    };
    (@ config_write) => {
        fn config_write(&self, offset: u16, data: &[u8]) -> Result<(), LinkError> {
            self.inner.config_write(offset, data)
        }
    };
    (@ bar_read) => {
        fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) -> Result<(), LinkError> {
            self.inner.bar_read(bar, offset, data)
        }
    };
    (@ bar_write) => {
        fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), LinkError> {
            self.inner.bar_write(bar, offset, data)
        }
    };
    (@ map_dma) => {
        fn map_dma(&self, regions: &[GuestRamRegion]) -> Result<Box<dyn DmaMapping>, LinkError> {
            self.inner.map_dma(regions)
        }
    };
    (@ set_irqs) => {
        fn set_irqs(&self, targets: &IrqTargets<'_>) -> Result<(), LinkError> {
            self.inner.set_irqs(targets)
        }
    };
    (@ reset) => {
        fn reset(&self) -> Result<(), LinkError> {
            self.inner.reset()
        }
    };
    (@ irq_counts) => {
        fn irq_counts(&self) -> Option<Vec<u64>> {
            self.inner.irq_counts()
        }
    };
    (@ lender_counters) => {
        fn lender_counters(&self) -> Result<Option<LenderCounters>, LinkError> {
            self.inner.lender_counters()
        }
    };
    (@ quiesce) => {
        fn quiesce(&self, stop: bool) -> Result<(), LinkError> {
            self.inner.quiesce(stop)
        }
    };
    (@ kick_generation) => {
        fn kick_generation(&self) -> u64 {
            self.inner.kick_generation()
        }
    };
    (@ migration) => {
        fn migration(&self) -> Option<Arc<dyn remote_pci::LeaseMigration>> {
            self.inner.migration()
        }
    };
    (@ claim_revision) => {
        fn claim_revision(&self) -> Option<i64> {
            self.inner.claim_revision()
        }
    };
    (@ p2p_port) => {
        fn p2p_port(&self) -> Option<Arc<dyn remote_pci::P2pPort>> {
            self.inner.p2p_port()
        }
    };
    (@ lease_state) => {
        fn lease_state(&self) -> LeaseState {
            self.inner.lease_state()
        }
    };
    (@ set_event_hook) => {
        fn set_event_hook(&self, hook: Arc<dyn LinkEventHook>) {
            self.inner.set_event_hook(hook)
        }
    };
    (@ kick_doorbells) => {
        fn kick_doorbells(&self) -> KickDoorbells {
            self.inner.kick_doorbells()
        }
    };
}

/// A borrowed device held under a directory claim. Field order is drop order: the lease is
/// returned, then the claim is released.
pub struct ClaimedLink {
    inner: Box<dyn RemoteDeviceLink>,
    claim: Box<dyn ClaimHandle>,
}

impl ClaimedLink {
    pub fn new(inner: Box<dyn RemoteDeviceLink>, claim: Box<dyn ClaimHandle>) -> Self {
        Self { inner, claim }
    }
}

impl RemoteDeviceLink for ClaimedLink {
    forward_link!(
        device_info,
        config_read,
        config_write,
        bar_read,
        bar_write,
        map_dma,
        set_irqs,
        reset,
        irq_counts,
        lender_counters,
        quiesce,
        kick_generation,
        kick_doorbells,
        migration,
        p2p_port
    );

    fn claim_revision(&self) -> Option<i64> {
        self.claim.revision()
    }

    /// Lost when the link says so, or when the directory says the lender, the device or
    /// the claim is gone.
    fn lease_state(&self) -> LeaseState {
        match self.inner.lease_state() {
            LeaseState::Active => match self.claim.lost() {
                Some(why) => LeaseState::Lost(why),
                None => LeaseState::Active,
            },
            other => other,
        }
    }

    /// The link's own events, plus the directory's word that the device is gone, both as
    /// lease loss.
    fn set_event_hook(&self, hook: Arc<dyn LinkEventHook>) {
        self.inner.set_event_hook(hook.clone());
        self.claim
            .on_lost(Arc::new(move |why: &str| hook.lease_lost(why)));
    }
}

fn unknown_node(cluster: &ClusterConfig, node: &str) -> AttachError {
    AttachError::UnknownNode {
        node: node.to_string(),
        known: cluster
            .nodes
            .iter()
            .map(|n| n.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
    }
}

/// Lender device ids are the lender-local BDF strings (`0000:81:00.0`).
pub fn lender_device_id(spec: &RemoteDeviceSpec) -> String {
    spec.bdf.to_string()
}

impl LinkSource for LenderSource {
    fn check_node(&self, node: &str) -> Result<(), AttachError> {
        if self.directory.is_some() {
            // Lenders come and go: the borrow asks the directory.
            return Ok(());
        }
        self.cluster
            .node(node)
            .map(|_| ())
            .ok_or_else(|| unknown_node(&self.cluster, node))
    }

    fn default_numa_node(&self, node: &str) -> Option<u32> {
        self.cluster.node(node).and_then(|n| n.numa_node)
    }

    fn request_timeout(&self) -> Duration {
        self.cluster
            .nodes
            .iter()
            .map(|n| n.link.request_timeout)
            .max()
            .unwrap_or(ntb::fabric::DEFAULT_REQUEST_TIMEOUT)
    }

    fn borrow(&self, spec: &RemoteDeviceSpec) -> Result<Box<dyn RemoteDeviceLink>, AttachError> {
        let node = spec.node.as_str();
        let bdf = lender_device_id(spec);
        let Some(dir) = &self.directory else {
            return Ok(Box::new(self.borrow_from(
                &self.cluster,
                self.file_lender(node)?,
                spec,
                Take::Borrow(None),
            )?));
        };
        let (cluster, lender) = self.directory_lender(dir.as_ref(), node, &bdf)?;
        let claim = dir
            .claim(node, &bdf, &self.id.local, &self.id.vm_name)
            .map_err(|e| directory_err(node, &bdf, e))?;
        let link = self.borrow_from(&cluster, &lender, spec, Take::Borrow(claim.revision()))?;
        Ok(Box::new(ClaimedLink::new(Box::new(link), claim)))
    }

    fn identity(&self) -> Option<(String, String)> {
        Some((self.id.local.clone(), self.id.vm_name.clone()))
    }

    fn fabric_counts(&self) -> FabricCounts {
        let idle = self.keeper.idle();
        FabricCounts {
            sessions: self
                .counters
                .sessions
                .load(Ordering::SeqCst)
                .saturating_sub(idle) as u64,
            ram_exports: self.counters.ram_exports.load(Ordering::SeqCst) as u64,
        }
    }

    fn released(&self) {
        self.keeper.wake();
    }

    fn accept(
        &self,
        spec: &RemoteDeviceSpec,
        ticket: &remote_pci::LeaseTicket,
    ) -> Result<Box<dyn RemoteDeviceLink>, AttachError> {
        let node = spec.node.as_str();
        let bdf = lender_device_id(spec);
        let Some(dir) = &self.directory else {
            if let Some(rev) = ticket.claim {
                // Taking the lease without its claim would leave the claim to the source,
                // whose exit releases it and makes the lender end the lease here.
                return Err(AttachError::Local {
                    node: node.to_string(),
                    bdf,
                    reason: format!(
                        "the lease is held under cluster directory claim {rev}, and this \
                         lendvm has no directory (start it with the source's --cluster)"
                    ),
                });
            }
            return Ok(Box::new(self.borrow_from(
                &self.cluster,
                self.file_lender(node)?,
                spec,
                Take::Accept(ticket),
            )?));
        };
        let (cluster, lender) = self.directory_lender(dir.as_ref(), node, &bdf)?;
        let link = self.borrow_from(&cluster, &lender, spec, Take::Accept(ticket))?;
        let Some(rev) = ticket.claim else {
            return Ok(Box::new(link));
        };
        // The lease is ours (the ticket was accepted); the claim follows it. Should taking it
        // fail, dropping `link` returns the lease to the lender: the source has already let
        // it go, so it reports the device lost (see "Life of a live migration").
        let claim = dir
            .take_over_claim(node, &bdf, rev, &self.id.local, &self.id.vm_name)
            .map_err(|e| directory_err(node, &bdf, e))?;
        Ok(Box::new(ClaimedLink::new(Box::new(link), claim)))
    }
}

impl LenderSource {
    /// Lender `node` of the cluster file.
    fn file_lender(&self, node: &str) -> Result<&NodeConfig, AttachError> {
        self.cluster
            .node(node)
            .ok_or_else(|| unknown_node(&self.cluster, node))
    }

    /// Lender `node` as the directory has it, and the cluster file with it in place of any
    /// entry of that name (link timers and token stay the file's).
    fn directory_lender(
        &self,
        dir: &dyn Directory,
        node: &str,
        bdf: &str,
    ) -> Result<(ClusterConfig, NodeConfig), AttachError> {
        let lender = dir.lender(node).map_err(|e| directory_err(node, bdf, e))?;
        let mut cluster = self.cluster.clone();
        cluster.nodes.retain(|n| n.name != lender.name);
        cluster.nodes.push(lender.clone());
        Ok((cluster, lender))
    }

    /// The live session to `lender`, or a new one (connected under our node name, the
    /// cluster token checked by its hello); true if new.
    fn session(
        &self,
        cluster: &ClusterConfig,
        lender: &NodeConfig,
        node: &str,
        local_err: &dyn Fn(String) -> AttachError,
    ) -> Result<(Arc<LenderSession>, bool), AttachError> {
        let key = (lender.name.to_string(), lender.control.to_string());
        let live = self
            .sessions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
            .and_then(Weak::upgrade);
        if let Some(s) = live {
            if s.is_usable() {
                log::debug!("{node}: sharing the session of {} lease(s)", s.leases());
                return Ok((s, false));
            }
            // Its link ended (the lender restarted or died): its leases are lost and go with
            // their devices; new ones need a new link.
            log::info!("{node}: the previous link to the lender ended; connecting anew");
        }
        let unreachable = |reason: String| AttachError::Unreachable {
            node: node.to_string(),
            addr: lender.control.to_string(),
            reason,
        };
        let local = NodeId::new(&self.id.local).map_err(|e| local_err(e.to_string()))?;
        let client = LenderClient::connect_node(
            cluster,
            lender,
            &local,
            // The cluster file's bound (`[link] connect_timeout_ms`, 5 s by default): a
            // lender busy with another borrower's teardown may answer late.
            lender.link.connect_timeout,
            &self.id.token,
            CLIENT_NAME,
        )
        .map_err(|e| match e {
            ClientError::Connect { source, .. } => unreachable(source.to_string()),
            ClientError::WrongLender { node: other, .. } => {
                unreachable(format!("it answered as {other}"))
            }
            ClientError::Remote { message, .. } => AttachError::Refused {
                node: node.to_string(),
                reason: message,
            },
            other => unreachable(other.to_string()),
        })?;
        let setup = client.setup_timings();
        let t = Instant::now();
        let session = LenderSession::new(
            client,
            SessionOptions {
                event_pump: true,
                counters: Some(Arc::clone(&self.counters)),
            },
        )
        .map_err(|e| local_err(e.to_string()))?;
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        log::info!(
            "{node}: new lender session: link {:.3} ms, auth {:.3} ms, hello {:.3} ms, \
             event pump {:.3} ms",
            ms(setup.link.unwrap_or_default()),
            ms(setup.auth),
            ms(setup.hello),
            ms(t.elapsed()),
        );
        {
            let mut map = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
            map.retain(|_, w| w.strong_count() > 0);
            map.insert(key.clone(), Arc::downgrade(&session));
        }
        self.keeper.keep(key, &session);
        Ok((session, true))
    }

    /// Connects to `lender`, borrows the device (under `claim` if given) and maps it.
    fn borrow_from(
        &self,
        cluster: &ClusterConfig,
        lender: &NodeConfig,
        spec: &RemoteDeviceSpec,
        take: Take<'_>,
    ) -> Result<LendingLink, AttachError> {
        let node = spec.node.as_str();
        let bdf = lender_device_id(spec);
        let local_err = |reason: String| AttachError::Local {
            node: node.to_string(),
            bdf: bdf.clone(),
            reason,
        };
        // Phase timings for the hot-add profile (logged below, read by benches/hotplug.rs).
        let t0 = Instant::now();
        let (session, fresh) = self.session(cluster, lender, node, &local_err)?;
        let t1 = Instant::now();
        let client = session.client();
        let lease = match take {
            Take::Borrow(Some(rev)) => client.borrow_claimed(&bdf, &self.id.vm_name, rev),
            Take::Borrow(None) => client.borrow(&bdf, &self.id.vm_name),
            Take::Accept(t) => {
                let ticket = lending::protocol::TransferTicket {
                    lease: t.lease,
                    ticket: t.ticket.clone(),
                    expires_in_ms: t.expires_in_ms,
                };
                client.accept_transfer(&ticket, &self.id.vm_name, &[], &[])
            }
        };
        let lease = lease.map_err(|e| match e {
            ClientError::Remote {
                code: c, message, ..
            } if c == code::UNKNOWN_DEVICE => {
                log::debug!("{node}: {message}");
                AttachError::UnknownDevice {
                    node: node.to_string(),
                    bdf: bdf.clone(),
                }
            }
            ClientError::Remote {
                code: c, message, ..
            } if c == code::DEVICE_BUSY
                || c == code::DEVICE_UNAVAILABLE
                || c == code::STALE_CLAIM
                || c == code::CLAIM_REQUIRED =>
            {
                AttachError::Busy {
                    node: node.to_string(),
                    bdf: bdf.clone(),
                    message,
                }
            }
            other if is_local(&other) => local_err(other.to_string()),
            other => AttachError::Borrow {
                node: node.to_string(),
                bdf: bdf.clone(),
                reason: other.to_string(),
            },
        })?;
        let lease_id = lease.id();
        let t2 = Instant::now();
        let link = LendingLink::in_session(session, lease).map_err(|e| match e {
            LendingLinkError::BarWindow { ref source, .. } if !is_local(source) => {
                AttachError::Link {
                    node: node.to_string(),
                    bdf: bdf.clone(),
                    reason: e.to_string(),
                }
            }
            _ => local_err(e.to_string()),
        })?;
        let t3 = Instant::now();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        log::info!(
            "borrowed {spec} (lease {lease_id}) for vm {}: session {} {:.3} ms, borrow {:.3} ms, \
             link {:.3} ms",
            self.id.vm_name,
            if fresh { "new" } else { "shared" },
            ms(t1 - t0),
            ms(t2 - t1),
            ms(t3 - t2),
        );
        Ok(link)
    }
}

/// VMM-wide counters of resources owned by remote devices (leak accounting). Memslots,
/// GSIs, irqfds and ioeventfds are counted by the KVM objects themselves
/// (`KvmVmOps`, `KvmInterruptManager`); these are the rest.
#[derive(Debug, Default)]
pub struct ResourceCounters {
    /// Bytes of guest RAM pinned for device DMA.
    pub pinned_bytes: AtomicU64,
    /// Leases held (links not yet dropped).
    pub leases: AtomicUsize,
}

/// Releases one lease count on drop.
struct LeaseToken(Arc<ResourceCounters>);

impl Drop for LeaseToken {
    fn drop(&mut self) {
        self.0.leases.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The link the VMM gives a `RemotePciDevice`: optional forced trapping and lease counting.
pub struct VmmLink {
    // Field order is drop order: the inner link returns the lease, then the count drops.
    inner: Box<dyn RemoteDeviceLink>,
    trapped: bool,
    _token: LeaseToken,
}

impl VmmLink {
    pub fn new(
        inner: Box<dyn RemoteDeviceLink>,
        mode: RemoteDeviceMode,
        counters: &Arc<ResourceCounters>,
    ) -> Self {
        counters.leases.fetch_add(1, Ordering::SeqCst);
        Self {
            inner,
            trapped: mode == RemoteDeviceMode::Trapped,
            _token: LeaseToken(counters.clone()),
        }
    }
}

/// The mode the guest actually gets: `Direct` if at least one BAR is mapped directly.
pub fn effective_mode(info: &RemoteDeviceInfo) -> RemoteDeviceMode {
    if info
        .bars
        .iter()
        .any(|b| matches!(b.access, BarAccess::Direct(_)))
    {
        RemoteDeviceMode::Direct
    } else {
        RemoteDeviceMode::Trapped
    }
}

impl RemoteDeviceLink for VmmLink {
    forward_link!(
        config_read,
        config_write,
        bar_read,
        bar_write,
        map_dma,
        set_irqs,
        reset,
        irq_counts,
        lender_counters,
        quiesce,
        kick_generation,
        migration,
        claim_revision,
        lease_state,
        set_event_hook,
        p2p_port
    );

    fn device_info(&self) -> RemoteDeviceInfo {
        let mut info = self.inner.device_info();
        if self.trapped {
            for b in &mut info.bars {
                b.access = BarAccess::Trapped;
                b.ioevents.clear();
            }
        }
        info
    }

    fn kick_doorbells(&self) -> KickDoorbells {
        // A trapped device has no direct window to put ioeventfds on (the device ignores
        // them then anyway); the generation still moves so nothing is re-applied.
        let k = self.inner.kick_doorbells();
        if self.trapped {
            return KickDoorbells {
                generation: k.generation,
                ..KickDoorbells::default()
            };
        }
        k
    }
}

impl Drop for VmmLink {
    fn drop(&mut self) {
        // The inner link returns the lease (a lender round trip) when it drops right after
        // this: never on a vCPU thread, which would stall the guest (see control.rs).
        crate::vcpu::assert_not_on_vcpu("returning a lease");
    }
}

/// A [`Pinner`] that counts pinned bytes in [`ResourceCounters`].
pub struct CountingPinner {
    inner: Arc<dyn Pinner>,
    counters: Arc<ResourceCounters>,
}

impl CountingPinner {
    pub fn new(inner: Arc<dyn Pinner>, counters: Arc<ResourceCounters>) -> Self {
        Self { inner, counters }
    }
}

impl Pinner for CountingPinner {
    fn check(&self, total: u64) -> Result<(), PinError> {
        self.inner.check(total)
    }

    fn pin(&self, addr: u64, len: u64) -> Result<PinnedRange, PinError> {
        let range = self.inner.pin(addr, len)?;
        self.counters.pinned_bytes.fetch_add(len, Ordering::SeqCst);
        let counters = self.counters.clone();
        Ok(PinnedRange::new(addr, len, move || {
            drop(range);
            counters.pinned_bytes.fetch_sub(len, Ordering::SeqCst);
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster() -> ClusterConfig {
        ClusterConfig::parse(
            "version = 1\n[[node]]\nname = \"node1\"\nfabric = \"shm\"\ncontrol = \"/nonexistent/lendvm-test/node1.sock\"\n\
             [[node]]\nname = \"node3\"\nfabric = \"tcp\"\ncontrol = \"127.0.0.1:1\"\n",
            "test",
        )
        .unwrap()
    }

    fn source() -> LenderSource {
        LenderSource::new(
            cluster(),
            FabricIdentity {
                local: "lendvm-test".into(),
                vm_name: "vm0".into(),
                token: "t".into(),
            },
        )
    }

    fn err(spec: &str) -> String {
        match source().borrow(&spec.parse().unwrap()) {
            Ok(_) => panic!("{spec}: borrowed from nowhere"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn unknown_node_names_the_known_ones() {
        let e = err("node9:0000:81:00.0");
        assert_eq!(e, "unknown node node9 (known: node1, node3)");
        assert!(source().check_node("node9").is_err());
        assert!(source().check_node("node1").is_ok());
    }

    #[test]
    fn unreachable_lender_names_node_and_address() {
        let e = err("node1:0000:81:00.0");
        assert!(
            e.starts_with("lender node1 is unreachable at /nonexistent/lendvm-test/node1.sock"),
            "{e}"
        );
        let e = err("node3:0000:81:00.0");
        assert!(
            e.starts_with("lender node3 is unreachable at 127.0.0.1:1"),
            "{e}"
        );
    }

    struct NullPinner;
    impl Pinner for NullPinner {
        fn check(&self, _: u64) -> Result<(), PinError> {
            Ok(())
        }
        fn pin(&self, addr: u64, len: u64) -> Result<PinnedRange, PinError> {
            Ok(PinnedRange::new(addr, len, || {}))
        }
    }

    #[test]
    fn counting_pinner_counts_until_drop() {
        let c = Arc::new(ResourceCounters::default());
        let p = CountingPinner::new(Arc::new(NullPinner), c.clone());
        let a = p.pin(0x1000, 0x2000).unwrap();
        let b = p.pin(0x8000, 0x1000).unwrap();
        assert_eq!(c.pinned_bytes.load(Ordering::SeqCst), 0x3000);
        drop(a);
        assert_eq!(c.pinned_bytes.load(Ordering::SeqCst), 0x1000);
        drop(b);
        assert_eq!(c.pinned_bytes.load(Ordering::SeqCst), 0);
    }
}
