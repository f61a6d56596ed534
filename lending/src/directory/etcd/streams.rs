//! The long-running calls: lease keep-alive and watches that survive member failures and
//! leader changes.

use super::*;
use crate::directory::LossCell;
use std::sync::atomic::AtomicU64;

/// How a [`keep_alive`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KeepAliveEnd {
    Stopped,
    /// etcd answered that the lease no longer exists: its keys are gone.
    Expired,
}

/// What a [`keep_alive`] tells its owner while it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Renewal {
    /// A renewal succeeded.
    Renewed,
    /// No renewal succeeded for a whole TTL (etcd unreachable, or an election). The lease may
    /// still exist: etcd does not expire leases without a leader, and a new leader extends
    /// every lease by its election timeout on top of the TTL, so the keep-alive goes on.
    Unrenewed,
}

/// Keeps one lease alive until `stop` or until etcd says it is gone; `on` hears of every
/// renewal and of the first whole TTL without one.
///
/// The timing is the TTL's: a renewal every TTL/3, each attempt bounded by TTL/3, and a
/// failed stream (member killed, leader lost) re-opened at once, then every [`RETRY`]; the
/// client's balanced channel sends the new stream to a member that answers. Not hearing
/// from etcd never ends the keep-alive: giving the lease up while etcd still holds it (a new
/// leader extends it) would let it expire and take its keys away.
pub(super) async fn keep_alive(
    client: Client,
    lease: i64,
    ttl: Duration,
    mut stop: watch::Receiver<bool>,
    latency: Option<&AtomicU64>,
    mut on: impl FnMut(Renewal) + Send,
) -> KeepAliveEnd {
    let period = (ttl / 3).max(Duration::from_millis(300));
    let mut deadline = Instant::now() + ttl;
    let mut told_unrenewed = false;
    let mut failures = 0u32;
    loop {
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
                        if let Some(l) = latency {
                            l.store(sent.elapsed().as_micros() as u64, Ordering::Relaxed);
                        }
                        deadline = sent + Duration::from_secs(u64::try_from(r.ttl()).unwrap_or(0));
                        failures = 0;
                        told_unrenewed = false;
                        on(Renewal::Renewed);
                    }
                    Ok(Ok(Some(_))) => return KeepAliveEnd::Expired,
                    Ok(Ok(None)) | Ok(Err(_)) | Err(_) => {
                        log::debug!("etcd lease {lease:x}: keep-alive stream failed, re-opening");
                        break;
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(period) => {}
                    _ = stop.changed() => return KeepAliveEnd::Stopped,
                }
            }
        }
        if Instant::now() >= deadline && !told_unrenewed {
            told_unrenewed = true;
            on(Renewal::Unrenewed);
        }
        if told_unrenewed {
            // A lease that expired while etcd was out of reach: a unary question answers even
            // when the re-opened stream does not (yet), and ends the wait (etcd reports -1).
            let mut c = client.clone();
            if let Ok(Ok(r)) = tokio::time::timeout(period, c.lease_time_to_live(lease, None)).await
            {
                if r.ttl() <= 0 {
                    return KeepAliveEnd::Expired;
                }
            }
        }
        // The first re-open goes out at once (a dead member or a lost leader costs one
        // round trip, not a pause); later ones every RETRY.
        failures = failures.saturating_add(1);
        if failures > 1 {
            tokio::select! {
                _ = tokio::time::sleep(RETRY) => {}
                _ = stop.changed() => return KeepAliveEnd::Stopped,
            }
        }
    }
}

/// Keeps a borrower's claim lease alive. Only etcd's word that the lease is gone makes the
/// claim lost; not hearing from etcd does not (the lender ends the lease if the claim does
/// expire, and the claim watch sees the deletion once etcd is reachable again).
pub(super) async fn keep_claim(
    client: Client,
    lease: i64,
    ttl: Duration,
    stop: watch::Receiver<bool>,
    lost: Arc<LossCell>,
) {
    let on = move |r| {
        if r == Renewal::Unrenewed {
            log::warn!("claim lease {lease:x}: etcd unreachable for {ttl:?}; still trying");
        }
    };
    if keep_alive(client, lease, ttl, stop, None, on).await == KeepAliveEnd::Expired {
        lost.set(&format!("claim lease {lease:x} expired"));
    }
}

/// Watches `key` (`prefix`: every key below it) from `start`; calls `on` for every event
/// and re-opens the watch after failures from the revision after the last one seen. Runs
/// until `stop` or `on` returns false.
pub(super) async fn watch_from<F>(
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
