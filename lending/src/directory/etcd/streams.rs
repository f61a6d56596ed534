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
    /// No renewal succeeded for a whole TTL (etcd unreachable, or an election). The lease may
    /// still exist: etcd does not expire leases without a leader, and a new leader extends
    /// them.
    Unrenewed,
}

/// Keeps one lease alive until `stop`, etcd says it is gone, or no renewal succeeded for a
/// whole TTL.
pub(super) async fn keep_alive(
    client: Client,
    lease: i64,
    ttl: Duration,
    mut stop: watch::Receiver<bool>,
    latency: Option<&AtomicU64>,
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
                        if let Some(l) = latency {
                            l.store(sent.elapsed().as_micros() as u64, Ordering::Relaxed);
                        }
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
pub(super) async fn keep_claim(
    client: Client,
    lease: i64,
    ttl: Duration,
    stop: watch::Receiver<bool>,
    lost: Arc<LossCell>,
) {
    loop {
        match keep_alive(client.clone(), lease, ttl, stop.clone(), None).await {
            KeepAliveEnd::Stopped => return,
            KeepAliveEnd::Expired => {
                lost.set(&format!("claim lease {lease:x} expired"));
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
