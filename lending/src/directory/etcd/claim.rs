//! The borrower side: a claim's lease, and the watches that tell it the device is lost.

use super::*;
use crate::directory::{LossCallback, LossCell};

/// A borrower's claim.
pub(super) struct EtcdClaim {
    pub(super) shared: Arc<Shared>,
    pub(super) key: String,
    pub(super) lease: i64,
    pub(super) revision: i64,
    pub(super) lost: Arc<LossCell>,
    pub(super) stop: watch::Sender<bool>,
}

impl ClaimHandle for EtcdClaim {
    fn revision(&self) -> Option<i64> {
        Some(self.revision)
    }

    fn lost(&self) -> Option<String> {
        self.lost.get()
    }

    fn on_lost(&self, f: LossCallback) {
        self.lost.on_lost(f);
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
    pub(super) fn hold_claim(
        &self,
        node: &str,
        bdf: &str,
        lease: i64,
        revision: i64,
    ) -> Box<dyn ClaimHandle> {
        self.hold_claim_from(node, bdf, lease, revision, revision + 1)
    }

    /// [`Self::hold_claim`] whose watches start at etcd revision `watch_start` (a claim taken
    /// over: later than the claim's own revision).
    pub(super) fn hold_claim_from(
        &self,
        node: &str,
        bdf: &str,
        lease: i64,
        revision: i64,
        watch_start: i64,
    ) -> Box<dyn ClaimHandle> {
        let shared = &self.shared;
        let keys = &shared.keys;
        let (ckey, nkey, dkey) = (
            keys.claim(node, bdf),
            keys.node(node),
            keys.device(node, bdf),
        );
        let (stop, stop_rx) = watch::channel(false);
        let lost = Arc::new(LossCell::default());
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
                watch_start,
                stop_rx.clone(),
                move |ev, _, rev| {
                    if ev == EventType::Delete {
                        log::warn!("{why} (revision {rev})");
                        lost.set(&why);
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
