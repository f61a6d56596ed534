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
//!
//! `keys`: the key layout; `streams`: keep-alive and watch; `registration`: the lender
//! side (registration, claim checks); `claim`: the borrower side.

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

mod claim;
mod keys;
mod registration;
pub mod secure;
mod streams;

use keys::*;
use registration::*;
use secure::ClaimKey;
use streams::*;

/// Bound on every unary etcd call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// Pause between attempts to re-open a failed stream.
const RETRY: Duration = Duration::from_millis(250);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The client, its runtime and settings, shared by the directory and its handles.
struct Shared {
    rt: tokio::runtime::Runtime,
    client: Client,
    keys: Keys,
    cfg: DirectoryConfig,
    /// Signs this process's claims and checks those a lender fences with; `None`: opened
    /// without the cluster secret (lendctl's read-only views), which cannot claim.
    claim_key: Option<ClaimKey>,
}

impl Shared {
    /// Runs one etcd call to completion on the runtime, bounded by [`CALL_TIMEOUT`]. An
    /// unreachable member (`Unavailable`: a dead endpoint of the balanced channel, no leader
    /// during an election) is retried until the bound, so one dead member of three or a
    /// leader change costs time, not an error. Callers whose operation is not idempotent
    /// check for their own earlier success (see the claim).
    fn call<T, F, Fut>(&self, op: &str, f: F) -> Result<T, DirectoryError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.call_until(op, Instant::now() + CALL_TIMEOUT, f)
    }

    /// [`Shared::call`] bounded by `deadline`: the calls of one operation (a claim's lease
    /// grant and transaction) share one [`CALL_TIMEOUT`], so an etcd without quorum fails
    /// the operation in that time rather than in that time per call.
    fn call_until<T, F, Fut>(
        &self,
        op: &str,
        deadline: Instant,
        mut f: F,
    ) -> Result<T, DirectoryError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.rt.block_on(async {
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

/// The error of a first call that failed: the whole cause chain (the TLS alert is several
/// sources deep), with a hint at the usual cause.
fn connect_error(cfg: &DirectoryConfig, endpoints: &str, e: &etcd_client::Error) -> DirectoryError {
    let mut detail = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        let text = s.to_string();
        if !detail.contains(&text) {
            detail.push_str(": ");
            detail.push_str(&text);
        }
        src = s.source();
    }
    let low = detail.to_ascii_lowercase();
    let dropped = low.contains("broken pipe")
        || low.contains("connection reset")
        || low.contains("h2 protocol error");
    // etcd (Go's TLS) answers a missing or refused client certificate with the alert
    // `certificate_required` or `bad_certificate`, depending on when in the handshake it saw it.
    let refused_cert = low.contains("certificaterequired")
        || low.contains("certificate required")
        || low.contains("badcertificate")
        || low.contains("bad certificate");
    let hint = if refused_cert {
        if cfg.cert.is_some() {
            "; the members did not accept the client certificate (is it signed by their CA?)"
        } else {
            "; the members require a client certificate: set cert and key"
        }
    } else if low.contains("unknownissuer")
        || low.contains("unknown issuer")
        || low.contains("invalid peer certificate")
    {
        "; the members' certificate is not signed by the configured ca (or does not name this host)"
    } else if low.contains("authentication failed")
        || low.contains("user name is empty")
        || low.contains("user name not found")
        || low.contains("invalid auth token")
    {
        "; etcd refused the credentials: check user and password_file"
    } else if dropped && cfg.tls() && cfg.cert.is_none() {
        // TLS 1.3: the server checks the client certificate after the client considers the
        // handshake done, so a refusal shows as a dropped session.
        "; the members dropped the TLS session: they may require a client certificate \
         (etcd --client-cert-auth): set cert and key"
    } else if dropped && !cfg.tls() {
        "; do the members speak TLS? set ca (and cert/key)"
    } else {
        ""
    };
    DirectoryError::Connect {
        endpoints: endpoints.to_string(),
        detail,
        hint: hint.to_string(),
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
    /// Connects to the endpoints of `cfg` (over TLS with its CA and client certificate, as
    /// its etcd user, if it says so; the connection is checked with one status call).
    /// `claim_secret` is the cluster secret claims are signed and checked with.
    pub fn connect(
        cfg: &DirectoryConfig,
        claim_secret: Option<&str>,
    ) -> Result<Self, DirectoryError> {
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
        let opts = secure::apply_credentials(cfg, opts)?;
        let endpoints = secure::endpoint_urls(cfg);
        let shown = endpoints.join(",");
        let client = rt.block_on(async {
            match tokio::time::timeout(CALL_TIMEOUT, Client::connect(endpoints, Some(opts))).await {
                Ok(r) => r.map_err(|source| connect_error(cfg, &shown, &source)),
                Err(_) => Err(DirectoryError::Timeout {
                    op: "connect".into(),
                    timeout: CALL_TIMEOUT,
                    endpoints: shown.clone(),
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
            claim_key: claim_secret.map(ClaimKey::from_secret),
        });
        shared
            .call("status", |mut c| async move { c.status().await })
            .map_err(|e| match e {
                DirectoryError::Etcd { source, .. } => connect_error(cfg, &shown, &source),
                other => other,
            })?;
        Ok(EtcdDirectory { shared })
    }

    /// The settings.
    pub fn config(&self) -> &DirectoryConfig {
        &self.shared.cfg
    }

    /// The claim record of `holder`/`vm` on `node`'s `bdf` under etcd lease `lease`, signed
    /// with the claim key.
    fn signed(
        &self,
        node: &str,
        bdf: &str,
        holder: &str,
        vm: &str,
        lease: i64,
    ) -> Result<ClaimRecord, DirectoryError> {
        let key = self
            .shared
            .claim_key
            .as_ref()
            .ok_or_else(|| DirectoryError::NoClaimSecret {
                node: node.to_string(),
                bdf: bdf.to_string(),
            })?;
        Ok(key.sign(ClaimRecord {
            node: node.to_string(),
            bdf: bdf.to_string(),
            holder: holder.to_string(),
            vm: vm.to_string(),
            lease,
            mac: None,
        }))
    }
}

impl Directory for EtcdDirectory {
    fn describe(&self) -> String {
        format!(
            "etcd {} (prefix {}{})",
            self.shared.cfg.etcd.join(","),
            self.shared.cfg.prefix,
            if self.shared.cfg.tls() { ", tls" } else { "" }
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
            forged: ntb::RateLimit::new(Duration::from_secs(5)),
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
        let latency = Arc::new(std::sync::atomic::AtomicU64::new(0));
        shared.rt.spawn(registration_task(
            Arc::clone(shared),
            node.clone(),
            Arc::clone(&current),
            Arc::clone(&lease),
            Arc::clone(&lost),
            stop_rx,
            Arc::clone(&latency),
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
            latency,
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
        // Checked before a lease is granted: no secret, no lease to revoke.
        self.signed(node, bdf, holder, vm, 0)?;
        // The grant and the transaction share one bound (`Shared::call_until`).
        let deadline = Instant::now() + CALL_TIMEOUT;
        let ttl = shared.ttl_secs();
        let lease = shared
            .call_until("lease grant", deadline, |mut c| async move {
                c.lease_grant(ttl, None).await
            })?
            .id();
        let rec = self.signed(node, bdf, holder, vm, lease)?;
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
        let r = shared.call_until("claim", deadline, |mut c| {
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

    fn take_over_claim(
        &self,
        node: &str,
        bdf: &str,
        revision: i64,
        holder: &str,
        vm: &str,
    ) -> Result<Box<dyn ClaimHandle>, DirectoryError> {
        let shared = &self.shared;
        let ckey = shared.keys.claim(node, bdf);
        // Checked before a lease is granted: no secret, no lease to revoke.
        self.signed(node, bdf, holder, vm, 0)?;
        let lease = grant(shared)?;
        let rec = self.signed(node, bdf, holder, vm, lease)?;
        // Same claim (same create revision), new owner and etcd lease: a put keeps the create
        // revision, so it stays the lender's fencing token; the old owner's lease no longer
        // holds the key, so its release leaves the claim in place.
        let txn = Txn::new()
            .when([Compare::create_revision(
                ckey.clone(),
                CompareOp::Equal,
                revision,
            )])
            .and_then([TxnOp::put(
                ckey.clone(),
                json(&rec),
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(ckey.clone(), None)]);
        let r = match shared.call("take over claim", |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        }) {
            Ok(r) => r,
            Err(e) => {
                revoke_quietly(shared, lease);
                return Err(e);
            }
        };
        if !r.succeeded() {
            revoke_quietly(shared, lease);
            let now = r.op_responses().into_iter().find_map(|o| match o {
                TxnOpResponse::Get(g) => g.kvs().first().cloned(),
                _ => None,
            });
            return Err(match now {
                Some(kv) => {
                    let other: ClaimRecord = decode(&kv)?;
                    DirectoryError::Claimed {
                        node: node.to_string(),
                        bdf: bdf.to_string(),
                        holder: other.holder,
                        vm: other.vm,
                        revision: kv.create_revision(),
                    }
                }
                None => DirectoryError::ClaimGone {
                    node: node.to_string(),
                    bdf: bdf.to_string(),
                    revision,
                },
            });
        }
        let now = r.header().map_or(revision, |h| h.revision());
        log::info!("took over claim {node}:{bdf} (revision {revision}) for {holder}/{vm}");
        Ok(self.hold_claim_from(node, bdf, lease, revision, now + 1))
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
/// Revokes an unused lease in the background: the caller's answer does not wait for it (an
/// etcd without quorum would hold it for [`CALL_TIMEOUT`]), and a lease not revoked expires
/// after its TTL anyway.
fn revoke_quietly(shared: &Shared, lease: i64) {
    let mut c = shared.client.clone();
    shared.rt.spawn(async move {
        match tokio::time::timeout(CALL_TIMEOUT, c.lease_revoke(lease)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => log::debug!("revoking unused lease {lease:x}: {e}"),
            Err(_) => log::debug!("revoking unused lease {lease:x}: no answer in {CALL_TIMEOUT:?}"),
        }
    });
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
