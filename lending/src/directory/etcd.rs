//! The cluster directory on etcd (v3 API, `etcd-client`).
//!
//! The client is asynchronous; [`EtcdDirectory`] owns a small tokio runtime (one worker) and
//! offers the blocking [`Directory`] API on top, so lenderd, lendvm and lendctl stay
//! thread-based. Keep-alives and watches run as tasks on that runtime; the handles that own
//! them ([`Registration`], [`ClaimHandle`]) stop them and revoke their lease on drop.
//!
//! Every unary call is bounded by the directory's timeout. Streams (keep-alive, watch) are
//! re-opened when they fail (a member died, the leader changed): a keep-alive is declared
//! lost only when no renewal succeeded for a whole TTL, a watch resumes from the revision
//! after the last one it saw, so no deletion is missed across a leader change.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, PutOptions, Txn,
    TxnOp, TxnOpResponse, WatchOptions,
};
use ntb::{DirectoryConfig, NodeConfig};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use super::{
    Claim, ClaimAuthority, ClaimHandle, ClaimRecord, DeviceRecord, Directory, DirectoryError,
    DirectoryEvent, NodeRecord, Registration, Snapshot,
};

/// Bound on every unary etcd call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// Pause between attempts to re-open a failed stream.
const RETRY: Duration = Duration::from_millis(250);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Key layout below the prefix.
#[derive(Debug, Clone)]
struct Keys {
    prefix: String,
}

impl Keys {
    fn all(&self) -> String {
        format!("{}/", self.prefix)
    }
    fn node(&self, node: &str) -> String {
        format!("{}/nodes/{node}", self.prefix)
    }
    fn device(&self, node: &str, bdf: &str) -> String {
        format!("{}/devices/{node}/{bdf}", self.prefix)
    }
    fn claim(&self, node: &str, bdf: &str) -> String {
        format!("{}/claims/{node}/{bdf}", self.prefix)
    }
    fn claims_of(&self, node: &str) -> String {
        format!("{}/claims/{node}/", self.prefix)
    }
}

/// What a key below the prefix is.
enum KeyKind<'a> {
    Node(&'a str),
    Device(&'a str, &'a str),
    Claim(&'a str, &'a str),
    Other,
}

fn classify<'a>(keys: &Keys, key: &'a str) -> KeyKind<'a> {
    let Some(rest) = key
        .strip_prefix(keys.prefix.as_str())
        .and_then(|r| r.strip_prefix('/'))
    else {
        return KeyKind::Other;
    };
    let mut parts = rest.splitn(3, '/');
    match (parts.next(), parts.next(), parts.next()) {
        (Some("nodes"), Some(n), None) => KeyKind::Node(n),
        (Some("devices"), Some(n), Some(b)) => KeyKind::Device(n, b),
        (Some("claims"), Some(n), Some(b)) => KeyKind::Claim(n, b),
        _ => KeyKind::Other,
    }
}

fn decode<T: DeserializeOwned>(kv: &KeyValue) -> Result<T, DirectoryError> {
    serde_json::from_slice(kv.value()).map_err(|e| DirectoryError::BadRecord {
        key: String::from_utf8_lossy(kv.key()).into_owned(),
        message: e.to_string(),
    })
}

fn json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    // Records are plain structs of strings and numbers: serialization cannot fail.
    serde_json::to_vec(v).unwrap_or_default()
}

/// The client, its runtime and settings, shared by the directory and its handles.
struct Shared {
    rt: tokio::runtime::Runtime,
    client: Client,
    keys: Keys,
    cfg: DirectoryConfig,
}

impl Shared {
    /// Runs one etcd call to completion on the runtime, bounded by [`CALL_TIMEOUT`]. An
    /// unreachable member (`Unavailable`: a dead endpoint of the balanced channel, no leader
    /// during an election) is retried until the bound, so one dead member of three or a
    /// leader change costs time, not an error. Callers whose operation is not idempotent
    /// check for their own earlier success (see the claim).
    fn call<T, F, Fut>(&self, op: &str, mut f: F) -> Result<T, DirectoryError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.rt.block_on(async {
            let deadline = Instant::now() + CALL_TIMEOUT;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match tokio::time::timeout(left, f(self.client.clone())).await {
                    Ok(Ok(v)) => return Ok(v),
                    Ok(Err(e)) if transient(&e) && Instant::now() + RETRY < deadline => {
                        log::debug!("etcd {op}: {e}; retrying");
                        tokio::time::sleep(RETRY / 2).await;
                    }
                    Ok(Err(source)) => {
                        return Err(DirectoryError::Etcd {
                            op: op.to_string(),
                            source,
                        })
                    }
                    Err(_) => {
                        return Err(DirectoryError::Timeout {
                            op: op.to_string(),
                            timeout: CALL_TIMEOUT,
                            endpoints: self.cfg.etcd.join(","),
                        })
                    }
                }
            }
        })
    }

    fn ttl_secs(&self) -> i64 {
        i64::try_from(self.cfg.lease_ttl.as_secs())
            .unwrap_or(5)
            .max(1)
    }
}

/// Whether an etcd error may go away on its own (another member, a new leader).
fn transient(e: &etcd_client::Error) -> bool {
    match e {
        // gRPC UNAVAILABLE (14): connection refused or reset, no leader.
        etcd_client::Error::GRpcStatus(s) => i32::from(s.code()) == 14,
        etcd_client::Error::TransportError(_) => true,
        _ => false,
    }
}

/// The etcd directory.
pub struct EtcdDirectory {
    shared: Arc<Shared>,
}

impl EtcdDirectory {
    /// Connects to the endpoints of `cfg` (the connection is checked with one status call).
    pub fn connect(cfg: &DirectoryConfig) -> Result<Self, DirectoryError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("etcd-directory")
            .enable_all()
            .build()
            .map_err(DirectoryError::Runtime)?;
        let opts = ConnectOptions::new()
            .with_connect_timeout(CALL_TIMEOUT)
            .with_keep_alive(Duration::from_secs(1), Duration::from_secs(2))
            // A member cut off from the leader fails calls instead of serving stale data.
            .with_require_leader(true);
        let endpoints = cfg.etcd.clone();
        let client = rt.block_on(async {
            match tokio::time::timeout(CALL_TIMEOUT, Client::connect(endpoints, Some(opts))).await {
                Ok(r) => r.map_err(|source| DirectoryError::Etcd {
                    op: "connect".into(),
                    source,
                }),
                Err(_) => Err(DirectoryError::Timeout {
                    op: "connect".into(),
                    timeout: CALL_TIMEOUT,
                    endpoints: cfg.etcd.join(","),
                }),
            }
        })?;
        let shared = Arc::new(Shared {
            rt,
            client,
            keys: Keys {
                prefix: cfg.prefix.clone(),
            },
            cfg: cfg.clone(),
        });
        shared.call("status", |mut c| async move { c.status().await })?;
        Ok(EtcdDirectory { shared })
    }

    /// The settings.
    pub fn config(&self) -> &DirectoryConfig {
        &self.shared.cfg
    }
}

/// How a [`keep_alive`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeepAliveEnd {
    Stopped,
    /// etcd answered that the lease no longer exists: its keys are gone.
    Expired,
    /// No renewal succeeded for a whole TTL (etcd unreachable, or an election). The lease may
    /// still exist: etcd does not expire leases without a leader, and a new leader extends
    /// them.
    Unrenewed,
}

/// Keeps one lease alive until `stop`, etcd says it is gone, or no renewal succeeded for a
/// whole TTL.
async fn keep_alive(
    client: Client,
    lease: i64,
    ttl: Duration,
    mut stop: watch::Receiver<bool>,
) -> KeepAliveEnd {
    let period = (ttl / 3).max(Duration::from_millis(300));
    let mut deadline = Instant::now() + ttl;
    'outer: loop {
        if *stop.borrow() {
            return KeepAliveEnd::Stopped;
        }
        let mut c = client.clone();
        let opened = tokio::time::timeout(period, c.lease_keep_alive(lease)).await;
        if let Ok(Ok((mut keeper, mut stream))) = opened {
            loop {
                let sent = Instant::now();
                let answer = tokio::time::timeout(period, async {
                    keeper.keep_alive().await?;
                    stream.message().await
                })
                .await;
                match answer {
                    Ok(Ok(Some(r))) if r.ttl() > 0 => {
                        deadline = sent + Duration::from_secs(u64::try_from(r.ttl()).unwrap_or(0));
                    }
                    Ok(Ok(Some(_))) => return KeepAliveEnd::Expired,
                    Ok(Ok(None)) | Ok(Err(_)) | Err(_) => {
                        log::debug!("etcd lease {lease:x}: keep-alive stream failed, re-opening");
                        break;
                    }
                }
                if Instant::now() >= deadline {
                    break 'outer;
                }
                tokio::select! {
                    _ = tokio::time::sleep(period) => {}
                    _ = stop.changed() => return KeepAliveEnd::Stopped,
                }
            }
        }
        if Instant::now() >= deadline {
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(RETRY) => {}
            _ = stop.changed() => return KeepAliveEnd::Stopped,
        }
    }
    KeepAliveEnd::Unrenewed
}

/// Keeps a borrower's claim lease alive. Only etcd's word that the lease is gone makes the
/// claim lost; not hearing from etcd does not (the lender ends the lease if the claim does
/// expire, and the claim watch sees the deletion once etcd is reachable again).
async fn keep_claim(
    client: Client,
    lease: i64,
    ttl: Duration,
    stop: watch::Receiver<bool>,
    lost: Arc<Mutex<Option<String>>>,
) {
    loop {
        match keep_alive(client.clone(), lease, ttl, stop.clone()).await {
            KeepAliveEnd::Stopped => return,
            KeepAliveEnd::Expired => {
                lock(&lost).get_or_insert_with(|| format!("claim lease {lease:x} expired"));
                return;
            }
            KeepAliveEnd::Unrenewed => {
                log::warn!("claim lease {lease:x}: etcd unreachable for {ttl:?}; still trying")
            }
        }
    }
}

/// Watches `key` (`prefix`: every key below it) from `start`; calls `on` for every event
/// and re-opens the watch after failures from the revision after the last one seen. Runs
/// until `stop` or `on` returns false.
async fn watch_from<F>(
    client: Client,
    key: String,
    prefix: bool,
    mut start: i64,
    mut stop: watch::Receiver<bool>,
    mut on: F,
) where
    F: FnMut(EventType, &KeyValue, i64) -> bool + Send,
{
    loop {
        if *stop.borrow() {
            return;
        }
        let mut opts = WatchOptions::new().with_start_revision(start);
        if prefix {
            opts = opts.with_prefix();
        }
        let mut c = client.clone();
        match tokio::time::timeout(CALL_TIMEOUT, c.watch(key.clone(), Some(opts))).await {
            Ok(Ok(mut stream)) => loop {
                let msg = tokio::select! {
                    m = stream.message() => m,
                    _ = stop.changed() => return,
                };
                match msg {
                    Ok(Some(resp)) => {
                        if resp.canceled() {
                            log::debug!("watch {key}: canceled: {}", resp.cancel_reason());
                            if resp.compact_revision() > 0 {
                                start = resp.compact_revision();
                            }
                            break;
                        }
                        let rev = resp.header().map_or(0, |h| h.revision());
                        for ev in resp.events() {
                            if let Some(kv) = ev.kv() {
                                start = start.max(kv.mod_revision() + 1);
                                if !on(ev.event_type(), kv, kv.mod_revision()) {
                                    return;
                                }
                            }
                        }
                        if resp.events().is_empty() && rev > 0 && !resp.created() {
                            start = start.max(rev + 1);
                        }
                    }
                    Ok(None) | Err(_) => {
                        log::debug!("watch {key}: stream ended, re-opening from {start}");
                        break;
                    }
                }
            },
            Ok(Err(e)) => log::debug!("watch {key}: {e}"),
            Err(_) => log::debug!("watch {key}: no answer"),
        }
        tokio::select! {
            _ = tokio::time::sleep(RETRY) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Grants a lease of the directory's TTL.
fn grant(shared: &Shared) -> Result<i64, DirectoryError> {
    let ttl = shared.ttl_secs();
    let r = shared.call("lease grant", |mut c| async move {
        c.lease_grant(ttl, None).await
    })?;
    Ok(r.id())
}

/// Writes the node and device records under `lease` in one transaction.
fn put_records(
    shared: &Shared,
    lease: i64,
    node: &NodeRecord,
    devices: &[DeviceRecord],
) -> Result<(), DirectoryError> {
    let keys = &shared.keys;
    let opts = || Some(PutOptions::new().with_lease(lease));
    let mut ops = vec![TxnOp::put(keys.node(&node.name), json(node), opts())];
    for d in devices {
        ops.push(TxnOp::put(
            keys.device(&node.name, &d.device.id),
            json(d),
            opts(),
        ));
    }
    shared.call("register", |mut c| {
        let ops = ops.clone();
        async move { c.txn(Txn::new().and_then(ops)).await }
    })?;
    Ok(())
}

/// A lender's registration (see [`Registration`]).
struct EtcdRegistration {
    shared: Arc<Shared>,
    node: NodeRecord,
    lease: Arc<AtomicI64>,
    lost: Arc<Mutex<Option<String>>>,
    written: Mutex<HashMap<String, DeviceRecord>>,
    /// What a re-registration writes (the last states published).
    devices: Arc<Mutex<Vec<DeviceRecord>>>,
    claims: Arc<EtcdClaims>,
    stop: watch::Sender<bool>,
}

impl Registration for EtcdRegistration {
    fn update_devices(&self, devices: &[DeviceRecord]) {
        if self.lost().is_some() {
            return;
        }
        let mut written = lock(&self.written);
        let changed: Vec<DeviceRecord> = devices
            .iter()
            .filter(|d| written.get(&d.device.id) != Some(*d))
            .cloned()
            .collect();
        if changed.is_empty() {
            return;
        }
        let lease = self.lease.load(Ordering::SeqCst);
        let keys = &self.shared.keys;
        let ops: Vec<TxnOp> = changed
            .iter()
            .map(|d| {
                TxnOp::put(
                    keys.device(&d.node, &d.device.id),
                    json(d),
                    Some(PutOptions::new().with_lease(lease)),
                )
            })
            .collect();
        match self.shared.call("update devices", |mut c| {
            let ops = ops.clone();
            async move { c.txn(Txn::new().and_then(ops)).await }
        }) {
            Ok(_) => {
                for d in changed {
                    written.insert(d.device.id.clone(), d);
                }
                *lock(&self.devices) = devices.to_vec();
            }
            Err(e) => log::warn!("lender {}: publishing device states: {e}", self.node.name),
        }
    }

    fn lost(&self) -> Option<String> {
        lock(&self.lost).clone()
    }

    fn claim_authority(&self) -> Option<Arc<dyn ClaimAuthority>> {
        Some(self.claims.clone())
    }
}

impl Drop for EtcdRegistration {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        // A clean stop takes the lender out of the directory at once rather than after the
        // TTL: the revoke deletes every key under the lease.
        let lease = self.lease.load(Ordering::SeqCst);
        match self.shared.call("lease revoke", |mut c| async move {
            c.lease_revoke(lease).await
        }) {
            Ok(_) => log::info!("lender {} left the directory", self.node.name),
            Err(e) => log::warn!(
                "lender {}: revoking the registration (it expires within its ttl): {e}",
                self.node.name
            ),
        }
    }
}

/// Runs the registration's lease: keep-alive, and after a loss a fresh lease with the
/// records re-written, until stopped.
async fn registration_task(
    shared: Arc<Shared>,
    node: NodeRecord,
    devices: Arc<Mutex<Vec<DeviceRecord>>>,
    lease: Arc<AtomicI64>,
    lost: Arc<Mutex<Option<String>>>,
    stop: watch::Receiver<bool>,
) {
    let ttl = shared.cfg.lease_ttl;
    loop {
        let id = lease.load(Ordering::SeqCst);
        let why = match keep_alive(shared.client.clone(), id, ttl, stop.clone()).await {
            KeepAliveEnd::Stopped => return,
            KeepAliveEnd::Expired => format!("etcd lease {id:x} expired"),
            KeepAliveEnd::Unrenewed => format!("etcd lease {id:x} not renewed for {ttl:?}"),
        };
        *lock(&lost) = Some(why.clone());
        // Running leases continue (their claims have not been seen to end; a claim cannot
        // expire without an etcd leader either); only new borrows wait for etcd.
        log::error!(
            "lender {}: registration lost ({why}); re-registering",
            node.name
        );
        // Re-register until it works or we are stopped.
        loop {
            tokio::select! {
                _ = tokio::time::sleep(RETRY * 4) => {}
                _ = async { let mut s = stop.clone(); let _ = s.changed().await; } => return,
            }
            let mut c = shared.client.clone();
            let ttl_s = shared.ttl_secs();
            let granted = tokio::time::timeout(CALL_TIMEOUT, c.lease_grant(ttl_s, None)).await;
            let Ok(Ok(g)) = granted else { continue };
            let keys = &shared.keys;
            let opts = || Some(PutOptions::new().with_lease(g.id()));
            let mut ops = vec![TxnOp::put(keys.node(&node.name), json(&node), opts())];
            for d in lock(&devices).iter() {
                ops.push(TxnOp::put(
                    keys.device(&node.name, &d.device.id),
                    json(d),
                    opts(),
                ));
            }
            let put = tokio::time::timeout(CALL_TIMEOUT, c.txn(Txn::new().and_then(ops))).await;
            if matches!(put, Ok(Ok(_))) {
                lease.store(g.id(), Ordering::SeqCst);
                *lock(&lost) = None;
                log::info!(
                    "lender {}: registered again (lease {:x})",
                    node.name,
                    g.id()
                );
                // The keys now live under the new lease; the old one (if etcd still has it)
                // holds nothing any more.
                let _ = tokio::time::timeout(CALL_TIMEOUT, c.lease_revoke(id)).await;
                break;
            }
        }
    }
}

/// The lender's cache of the claims on its devices, fed by a watch.
struct EtcdClaims {
    shared: Arc<Shared>,
    node: String,
    /// Device → revision of its current claim.
    current: Mutex<HashMap<String, i64>>,
}

impl EtcdClaims {
    fn apply(&self, ev: EventType, kv: &KeyValue) {
        let key = String::from_utf8_lossy(kv.key());
        let KeyKind::Claim(_, bdf) = classify(&self.shared.keys, &key) else {
            return;
        };
        let mut cur = lock(&self.current);
        match ev {
            EventType::Put => {
                let rev = kv.create_revision();
                let e = cur.entry(bdf.to_string()).or_insert(rev);
                *e = (*e).max(rev);
            }
            EventType::Delete => {
                // A delete older than a claim verify() already saw must not remove it.
                if cur.get(bdf).is_some_and(|&r| r <= kv.mod_revision()) {
                    cur.remove(bdf);
                }
            }
        }
    }
}

impl ClaimAuthority for EtcdClaims {
    fn verify(&self, device: &str, holder: &str, vm: &str, revision: i64) -> Result<(), String> {
        let key = self.shared.keys.claim(&self.node, device);
        let r = self
            .shared
            .call("get claim", |mut c| {
                let k = key.clone();
                async move { c.get(k, None).await }
            })
            .map_err(|e| format!("cannot check the claim: {e}"))?;
        let Some(kv) = r.kvs().first() else {
            return Err("no current claim (expired or released)".into());
        };
        if kv.create_revision() != revision {
            return Err(format!(
                "stale claim: the current claim has revision {}",
                kv.create_revision()
            ));
        }
        let rec: ClaimRecord = decode(kv).map_err(|e| e.to_string())?;
        if rec.holder != holder || rec.vm != vm {
            return Err(format!(
                "the claim belongs to {}/{}, not {holder}/{vm}",
                rec.holder, rec.vm
            ));
        }
        let mut cur = lock(&self.current);
        let e = cur.entry(device.to_string()).or_insert(revision);
        *e = (*e).max(revision);
        Ok(())
    }

    fn is_current(&self, device: &str, revision: i64) -> bool {
        lock(&self.current).get(device) == Some(&revision)
    }
}

/// A borrower's claim.
struct EtcdClaim {
    shared: Arc<Shared>,
    key: String,
    lease: i64,
    revision: i64,
    lost: Arc<Mutex<Option<String>>>,
    stop: watch::Sender<bool>,
}

impl ClaimHandle for EtcdClaim {
    fn revision(&self) -> Option<i64> {
        Some(self.revision)
    }

    fn lost(&self) -> Option<String> {
        lock(&self.lost).clone()
    }
}

impl Drop for EtcdClaim {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        let lease = self.lease;
        if let Err(e) = self.shared.call("lease revoke", |mut c| async move {
            c.lease_revoke(lease).await
        }) {
            log::warn!(
                "releasing claim {} (it expires within its ttl): {e}",
                self.key
            );
        }
    }
}

impl EtcdDirectory {
    /// Keeps the claim's lease alive and watches the lender, the device and the claim.
    fn hold_claim(&self, node: &str, bdf: &str, lease: i64, revision: i64) -> Box<dyn ClaimHandle> {
        let shared = &self.shared;
        let keys = &shared.keys;
        let (ckey, nkey, dkey) = (
            keys.claim(node, bdf),
            keys.node(node),
            keys.device(node, bdf),
        );
        let (stop, stop_rx) = watch::channel(false);
        let lost = Arc::new(Mutex::new(None));
        shared.rt.spawn(keep_claim(
            shared.client.clone(),
            lease,
            shared.cfg.lease_ttl,
            stop_rx.clone(),
            Arc::clone(&lost),
        ));
        // The device is lost when its lender, its record or our claim leaves the directory.
        for (key, why) in [
            (nkey, format!("lender {node} left the directory")),
            (dkey, format!("device {node}:{bdf} left the directory")),
            (ckey.clone(), format!("claim on {node}:{bdf} ended")),
        ] {
            let lost = Arc::clone(&lost);
            shared.rt.spawn(watch_from(
                shared.client.clone(),
                key,
                false,
                revision + 1,
                stop_rx.clone(),
                move |ev, _, rev| {
                    if ev == EventType::Delete {
                        log::warn!("{why} (revision {rev})");
                        lock(&lost).get_or_insert_with(|| why.clone());
                        return false;
                    }
                    true
                },
            ));
        }
        Box::new(EtcdClaim {
            shared: Arc::clone(shared),
            key: ckey,
            lease,
            revision,
            lost,
            stop,
        })
    }
}

impl Directory for EtcdDirectory {
    fn describe(&self) -> String {
        format!(
            "etcd {} (prefix {})",
            self.shared.cfg.etcd.join(","),
            self.shared.cfg.prefix
        )
    }

    fn lender(&self, node: &str) -> Result<NodeConfig, DirectoryError> {
        let key = self.shared.keys.node(node);
        let r = self.shared.call("get node", |mut c| {
            let key = key.clone();
            async move { c.get(key, None).await }
        })?;
        let kv = r
            .kvs()
            .first()
            .ok_or_else(|| DirectoryError::UnknownLender {
                node: node.to_string(),
                known: String::new(),
            })?;
        decode::<NodeRecord>(kv)?.to_config()
    }

    fn snapshot(&self) -> Result<Snapshot, DirectoryError> {
        let key = self.shared.keys.all();
        let r = self.shared.call("list", |mut c| {
            let key = key.clone();
            async move { c.get(key, Some(GetOptions::new().with_prefix())).await }
        })?;
        let mut s = Snapshot {
            revision: r.header().map_or(0, |h| h.revision()),
            ..Snapshot::default()
        };
        for kv in r.kvs() {
            let key = String::from_utf8_lossy(kv.key());
            match classify(&self.shared.keys, &key) {
                KeyKind::Node(_) => s.nodes.push(decode(kv)?),
                KeyKind::Device(..) => s.devices.push(decode(kv)?),
                KeyKind::Claim(..) => s.claims.push(Claim {
                    record: decode(kv)?,
                    revision: kv.create_revision(),
                }),
                KeyKind::Other => {}
            }
        }
        Ok(s)
    }

    fn register(
        &self,
        node: &NodeRecord,
        devices: &[DeviceRecord],
    ) -> Result<Box<dyn Registration>, DirectoryError> {
        let shared = &self.shared;
        let lease = grant(shared)?;
        put_records(shared, lease, node, devices)?;
        log::info!(
            "lender {} registered in {} with {} devices (lease {lease:x}, ttl {:?})",
            node.name,
            self.describe(),
            devices.len(),
            shared.cfg.lease_ttl
        );
        let (stop, stop_rx) = watch::channel(false);
        let lost = Arc::new(Mutex::new(None));
        let lease = Arc::new(AtomicI64::new(lease));
        let claims = Arc::new(EtcdClaims {
            shared: Arc::clone(shared),
            node: node.name.clone(),
            current: Mutex::new(HashMap::new()),
        });
        // The claims already there, then every change after that read.
        let prefix = shared.keys.claims_of(&node.name);
        let r = shared.call("get claims", |mut c| {
            let p = prefix.clone();
            async move { c.get(p, Some(GetOptions::new().with_prefix())).await }
        })?;
        for kv in r.kvs() {
            claims.apply(EventType::Put, kv);
        }
        let start = r.header().map_or(0, |h| h.revision()) + 1;
        let cl = Arc::clone(&claims);
        shared.rt.spawn(watch_from(
            shared.client.clone(),
            prefix,
            true,
            start,
            stop_rx.clone(),
            move |ev, kv, _| {
                cl.apply(ev, kv);
                true
            },
        ));
        let current = Arc::new(Mutex::new(devices.to_vec()));
        shared.rt.spawn(registration_task(
            Arc::clone(shared),
            node.clone(),
            Arc::clone(&current),
            Arc::clone(&lease),
            Arc::clone(&lost),
            stop_rx,
        ));
        Ok(Box::new(EtcdRegistration {
            shared: Arc::clone(shared),
            node: node.clone(),
            lease,
            lost,
            written: Mutex::new(
                devices
                    .iter()
                    .map(|d| (d.device.id.clone(), d.clone()))
                    .collect(),
            ),
            devices: current,
            claims,
            stop,
        }))
    }

    fn claim(
        &self,
        node: &str,
        bdf: &str,
        holder: &str,
        vm: &str,
    ) -> Result<Box<dyn ClaimHandle>, DirectoryError> {
        let shared = &self.shared;
        let keys = &shared.keys;
        let (ckey, nkey, dkey) = (
            keys.claim(node, bdf),
            keys.node(node),
            keys.device(node, bdf),
        );
        let lease = grant(shared)?;
        let rec = ClaimRecord {
            node: node.to_string(),
            bdf: bdf.to_string(),
            holder: holder.to_string(),
            vm: vm.to_string(),
        };
        // Create-if-absent, and only for a device its lender has registered.
        let txn = Txn::new()
            .when([
                Compare::create_revision(ckey.clone(), CompareOp::Equal, 0),
                Compare::version(nkey.clone(), CompareOp::Greater, 0),
                Compare::version(dkey.clone(), CompareOp::Greater, 0),
            ])
            .and_then([TxnOp::put(
                ckey.clone(),
                json(&rec),
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([
                TxnOp::get(ckey.clone(), None),
                TxnOp::get(nkey.clone(), None),
                TxnOp::get(dkey.clone(), None),
            ]);
        let r = shared.call("claim", |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        });
        let r = match r {
            Ok(r) => r,
            Err(e) => {
                revoke_quietly(shared, lease);
                return Err(e);
            }
        };
        if !r.succeeded() {
            let got: Vec<Option<KeyValue>> = r
                .op_responses()
                .into_iter()
                .map(|o| match o {
                    TxnOpResponse::Get(g) => g.kvs().first().cloned(),
                    _ => None,
                })
                .collect();
            if let Some(Some(kv)) = got.first() {
                if kv.lease() == lease {
                    // A retried transaction whose first attempt did land: the claim is ours.
                    return Ok(self.hold_claim(node, bdf, lease, kv.create_revision()));
                }
            }
            revoke_quietly(shared, lease);
            if let Some(Some(kv)) = got.first() {
                let other: ClaimRecord = decode(kv)?;
                return Err(DirectoryError::Claimed {
                    node: node.to_string(),
                    bdf: bdf.to_string(),
                    holder: other.holder,
                    vm: other.vm,
                    revision: kv.create_revision(),
                });
            }
            if !matches!(got.get(1), Some(Some(_))) {
                return Err(DirectoryError::UnknownLender {
                    node: node.to_string(),
                    known: String::new(),
                });
            }
            return Err(DirectoryError::UnknownDevice {
                node: node.to_string(),
                bdf: bdf.to_string(),
            });
        }
        let revision = r.header().map_or(0, |h| h.revision());
        log::info!("claimed {node}:{bdf} for {holder}/{vm} (revision {revision})");
        Ok(self.hold_claim(node, bdf, lease, revision))
    }

    fn watch(
        &self,
    ) -> Result<std::sync::mpsc::Receiver<Result<DirectoryEvent, DirectoryError>>, DirectoryError>
    {
        let shared = &self.shared;
        let key = shared.keys.all();
        // The revision to start from: now.
        let r = shared.call("watch start", |mut c| {
            let k = key.clone();
            async move {
                c.get(k, Some(GetOptions::new().with_prefix().with_count_only()))
                    .await
            }
        })?;
        let start = r.header().map_or(0, |h| h.revision()) + 1;
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop, stop_rx) = watch::channel(false);
        let keys = shared.keys.clone();
        let client = shared.client.clone();
        shared.rt.spawn(async move {
            // The task owns the stop sender: it runs until the receiver of events is dropped.
            let _stop = stop;
            let on = move |ev, kv: &KeyValue, rev| {
                let k = String::from_utf8_lossy(kv.key()).into_owned();
                match event_of(&keys, ev, kv, &k, rev) {
                    Some(e) => tx.send(e).is_ok(),
                    None => true,
                }
            };
            watch_from(client, key, true, start, stop_rx, on).await;
        });
        Ok(rx)
    }
}

/// The [`DirectoryEvent`] of one watch event.
fn event_of(
    keys: &Keys,
    ev: EventType,
    kv: &KeyValue,
    key: &str,
    revision: i64,
) -> Option<Result<DirectoryEvent, DirectoryError>> {
    let put = ev == EventType::Put;
    Some(match classify(keys, key) {
        KeyKind::Node(_) if put => decode(kv).map(|node| DirectoryEvent::NodeUp { revision, node }),
        KeyKind::Node(n) => Ok(DirectoryEvent::NodeGone {
            revision,
            node: n.to_string(),
        }),
        KeyKind::Device(..) if put => {
            decode(kv).map(|device| DirectoryEvent::Device { revision, device })
        }
        KeyKind::Device(n, b) => Ok(DirectoryEvent::DeviceGone {
            revision,
            node: n.to_string(),
            bdf: b.to_string(),
        }),
        KeyKind::Claim(..) if put => decode(kv).map(|record| DirectoryEvent::Claimed {
            revision,
            claim: Claim {
                record,
                revision: kv.create_revision(),
            },
        }),
        KeyKind::Claim(n, b) => Ok(DirectoryEvent::Released {
            revision,
            node: n.to_string(),
            bdf: b.to_string(),
        }),
        KeyKind::Other => return None,
    })
}

/// Revokes a lease we no longer need; failure only delays its expiry.
fn revoke_quietly(shared: &Shared, lease: i64) {
    if let Err(e) = shared.call("lease revoke", |mut c| async move {
        c.lease_revoke(lease).await
    }) {
        log::debug!("revoking unused lease {lease:x}: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_classified_below_the_prefix_only() {
        let k = Keys {
            prefix: "/lendvm".into(),
        };
        assert!(matches!(classify(&k, &k.node("n3")), KeyKind::Node("n3")));
        assert!(matches!(
            classify(&k, &k.device("n3", "0000:81:00.0")),
            KeyKind::Device("n3", "0000:81:00.0")
        ));
        assert!(matches!(
            classify(&k, &k.claim("n3", "0000:81:00.0")),
            KeyKind::Claim("n3", "0000:81:00.0")
        ));
        assert!(k.claim("n3", "x").starts_with(&k.claims_of("n3")));
        // Another prefix that merely starts the same, or a foreign key, is not ours.
        assert!(matches!(classify(&k, "/lendvm2/nodes/n3"), KeyKind::Other));
        assert!(matches!(classify(&k, "/lendvm/nodes/n3/x"), KeyKind::Other));
        assert!(matches!(classify(&k, "/lendvm/other/n3"), KeyKind::Other));
    }
}
