//! The lender side: its registration (records under a kept-alive lease, re-registration)
//! and its view of the claims on its devices (the fencing check).

use super::*;

/// Grants a lease of the directory's TTL.
pub(super) fn grant(shared: &Shared) -> Result<i64, DirectoryError> {
    let ttl = shared.ttl_secs();
    let r = shared.call("lease grant", |mut c| async move {
        c.lease_grant(ttl, None).await
    })?;
    Ok(r.id())
}

/// Writes the node and device records under `lease` in one transaction.
pub(super) fn put_records(
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
pub(super) struct EtcdRegistration {
    pub(super) shared: Arc<Shared>,
    pub(super) node: NodeRecord,
    pub(super) lease: Arc<AtomicI64>,
    pub(super) lost: Arc<Mutex<Option<String>>>,
    pub(super) written: Mutex<HashMap<String, DeviceRecord>>,
    /// What a re-registration writes (the last states published).
    pub(super) devices: Arc<Mutex<Vec<DeviceRecord>>>,
    pub(super) claims: Arc<EtcdClaims>,
    pub(super) stop: watch::Sender<bool>,
    /// The last keep-alive's round trip, in microseconds (0: none yet).
    pub(super) latency: Arc<std::sync::atomic::AtomicU64>,
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

    fn keepalive_latency(&self) -> Option<Duration> {
        match self.latency.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(us)),
        }
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

/// Runs the registration's lease: keep-alive (reporting, not giving up, a TTL without a
/// renewal), and once etcd says the lease is gone a fresh lease with the records re-written,
/// until stopped.
pub(super) async fn registration_task(
    shared: Arc<Shared>,
    node: NodeRecord,
    devices: Arc<Mutex<Vec<DeviceRecord>>>,
    lease: Arc<AtomicI64>,
    lost: Arc<Mutex<Option<String>>>,
    stop: watch::Receiver<bool>,
    latency: Arc<std::sync::atomic::AtomicU64>,
) {
    let ttl = shared.cfg.lease_ttl;
    loop {
        let id = lease.load(Ordering::SeqCst);
        let (l, name) = (Arc::clone(&lost), node.name.clone());
        let on = move |r| match r {
            Renewal::Renewed => {
                if lock(&l).take().is_some() {
                    log::info!("lender {name}: registration renewed again (lease {id:x})");
                }
            }
            Renewal::Unrenewed => {
                let why = format!("etcd lease {id:x} not renewed for {ttl:?}");
                // Running leases continue (their claims have not been seen to end; a claim
                // cannot expire without an etcd leader either); only new borrows wait.
                log::error!("lender {name}: registration not in force ({why}); still renewing");
                *lock(&l) = Some(why);
            }
        };
        match keep_alive(
            shared.client.clone(),
            id,
            ttl,
            stop.clone(),
            Some(&latency),
            on,
        )
        .await
        {
            KeepAliveEnd::Stopped => return,
            KeepAliveEnd::Expired => {}
        }
        let why = format!("etcd lease {id:x} expired");
        *lock(&lost) = Some(why.clone());
        log::error!(
            "lender {}: registration lost ({why}); re-registering",
            node.name
        );
        // Re-register until it works or we are stopped: at once, then every second.
        let mut first = true;
        loop {
            if !first {
                tokio::select! {
                    _ = tokio::time::sleep(RETRY * 4) => {}
                    _ = async { let mut s = stop.clone(); let _ = s.changed().await; } => return,
                }
            }
            first = false;
            if *stop.borrow() {
                return;
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
                break;
            }
        }
    }
}

/// The lender's cache of the claims on its devices, fed by a watch.
pub(super) struct EtcdClaims {
    pub(super) shared: Arc<Shared>,
    pub(super) node: String,
    /// Device → revision of its current claim.
    pub(super) current: Mutex<HashMap<String, i64>>,
    /// Log limit for claim records that do not check (anyone with etcd write access can
    /// write them at will).
    pub(super) forged: ntb::RateLimit,
}

impl EtcdClaims {
    /// Checks a claim record's MAC with the cluster secret (`secure`).
    fn authentic(&self, kv: &KeyValue) -> Result<ClaimRecord, String> {
        let rec: ClaimRecord = decode(kv).map_err(|e| e.to_string())?;
        let Some(key) = &self.shared.claim_key else {
            return Err("this lender has no cluster secret to check claims with".into());
        };
        key.check(&rec).map_err(|e| e.to_string())?;
        bound_to_its_lease(&rec, kv.lease())?;
        if rec.node != self.node {
            return Err(format!(
                "the record names lender {}, not {}",
                rec.node, self.node
            ));
        }
        Ok(rec)
    }

    fn log_forged(&self, key: &str, why: &str) {
        if let Some(held) = self.forged.hit() {
            log::warn!(
                "lender {}: ignoring claim record {key}: {why} ({held} more not logged)",
                self.node
            );
        }
    }

    pub(super) fn apply(&self, ev: EventType, kv: &KeyValue) {
        let key = String::from_utf8_lossy(kv.key());
        let KeyKind::Claim(_, bdf) = classify(&self.shared.keys, &key) else {
            return;
        };
        match ev {
            EventType::Put => {
                // Only a record signed with the cluster secret becomes the current claim
                // (a new revision here ends the lease fenced by the old one).
                let rec = match self.authentic(kv) {
                    Ok(r) => r,
                    Err(why) => return self.log_forged(&key, &why),
                };
                if rec.bdf != bdf {
                    return self.log_forged(&key, &format!("the record names device {}", rec.bdf));
                }
                let rev = kv.create_revision();
                let mut cur = lock(&self.current);
                let e = cur.entry(bdf.to_string()).or_insert(rev);
                *e = (*e).max(rev);
            }
            EventType::Delete => {
                // A delete older than a claim verify() already saw must not remove it.
                let mut cur = lock(&self.current);
                if cur.get(bdf).is_some_and(|&r| r <= kv.mod_revision()) {
                    cur.remove(bdf);
                }
            }
        }
    }
}

/// A signed claim record counts only on a key held by the etcd lease it names: a record
/// written again under another lease (or none) is a replay, or a claim moved onto another
/// borrower's key, and refused.
pub(super) fn bound_to_its_lease(rec: &ClaimRecord, key_lease: i64) -> Result<(), String> {
    if rec.lease == 0 {
        return Err(
            "the record names no etcd lease (written by a lendvm from before claims \
                    were bound to their lease: upgrade the borrower)"
                .into(),
        );
    }
    if rec.lease != key_lease {
        return Err(format!(
            "the record is bound to etcd lease {:x} but the key is held by lease {:x}: a \
             replayed or moved claim",
            rec.lease, key_lease
        ));
    }
    Ok(())
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
        let rec = self
            .authentic(kv)
            .inspect_err(|why| self.log_forged(&key, why))?;
        if rec.bdf != device || rec.holder != holder || rec.vm != vm {
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
