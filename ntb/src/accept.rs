//! The accepting side of the socket backends: every accepted connection runs its handshake
//! (TLS on tcp, then the fabric hello) on its own thread, bounded by `connect_timeout`, so a
//! silent or slow peer never delays the others; `accept` hands out whichever link is ready
//! first.
//!
//! Pre-authentication limits ([`PreauthLimits`], the cluster file's `[link]
//! max_pending_handshakes` and `max_pending_per_source`): at most that many handshakes at
//! once (default [`MAX_PENDING_HANDSHAKES`]), of which one source ([`source_key`]: an IPv4
//! address, an IPv6 /64) holds at most its share on tcp (default [`MAX_PENDING_PER_SOURCE`]),
//! so silent connections from one place cannot take every slot. Shm listeners have no
//! per-source share: their socket is 0600, so every peer is the listener's own uid, one
//! source.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

use crate::fabric::{FabricError, LinkConfig, NodeId, Result};
use crate::link::{
    establish, lock, new_eventfd, poll_fds, LinkEndpoint, LinkOpts, RateLimit, Stream,
};

/// A connection just accepted, before its handshake.
pub(crate) enum Accepted {
    /// Runs the fabric handshake as is (shm).
    Plain(Stream),
    /// Runs TLS first (tcp).
    Tls(TcpStream),
}

/// Most handshakes a listener runs at once by default; connections beyond are closed at once.
pub const MAX_PENDING_HANDSHAKES: usize = 64;
/// Most of those one source ([`source_key`]) may hold by default: an eighth, so a source that
/// keeps opening silent connections leaves the other 56 slots to everyone else.
pub const MAX_PENDING_PER_SOURCE: usize = 8;
/// The largest `max_pending_handshakes` a cluster file may set: each pending handshake is a
/// thread and a descriptor.
pub const MAX_PENDING_HANDSHAKES_LIMIT: usize = 4096;

/// How many fabric handshakes a listener runs at once, in all and per source (tcp). Borrowers
/// behind one NAT (or one IPv6 /64) are one source: an operator who has more of them than
/// `per_source` connecting at once (a boot storm) raises `per_source` towards `handshakes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreauthLimits {
    /// Handshakes at once (1..=[`MAX_PENDING_HANDSHAKES_LIMIT`]).
    pub handshakes: usize,
    /// Of those, from one source (1..=`handshakes`).
    pub per_source: usize,
}

impl Default for PreauthLimits {
    fn default() -> Self {
        PreauthLimits {
            handshakes: MAX_PENDING_HANDSHAKES,
            per_source: MAX_PENDING_PER_SOURCE,
        }
    }
}

impl PreauthLimits {
    /// Why these limits are not usable, if they are not.
    pub fn check(&self) -> std::result::Result<(), String> {
        if !(1..=MAX_PENDING_HANDSHAKES_LIMIT).contains(&self.handshakes) {
            return Err(format!(
                "max_pending_handshakes {} is not in 1..={MAX_PENDING_HANDSHAKES_LIMIT}",
                self.handshakes
            ));
        }
        if !(1..=self.handshakes).contains(&self.per_source) {
            return Err(format!(
                "max_pending_per_source {} is not in 1..={} (max_pending_handshakes)",
                self.per_source, self.handshakes
            ));
        }
        Ok(())
    }
}

/// The unit pre-authentication limits count per: the IPv4 address, the /64 of an IPv6
/// address (one host usually holds a whole /64, and rotates through it at will), `uid=N` of
/// a local peer (`unix:uid=N,pid=P`); anything else as given.
pub fn source_key(peer_addr: &str) -> String {
    if let Some(rest) = peer_addr.strip_prefix("unix:") {
        return rest.split(',').next().unwrap_or(rest).to_string();
    }
    let ip = match peer_addr.parse::<SocketAddr>() {
        Ok(a) => a.ip(),
        Err(_) => match peer_addr.parse::<IpAddr>() {
            Ok(ip) => ip,
            Err(_) => return peer_addr.to_string(),
        },
    };
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => {
                let s = v6.segments();
                format!("{:x}:{:x}:{:x}:{:x}::/64", s[0], s[1], s[2], s[3])
            }
        },
    }
}

/// Handshakes in flight, in total and per source.
struct Pending {
    limits: PreauthLimits,
    total: usize,
    /// Bounded by `limits.handshakes` entries (an entry exists only while its source has a
    /// handshake in flight).
    per_source: HashMap<String, usize>,
}

impl Pending {
    fn new(limits: PreauthLimits) -> Pending {
        Pending {
            limits,
            total: 0,
            per_source: HashMap::new(),
        }
    }

    /// Takes a slot for `source` (`share`: the per-source share applies), or says why not.
    fn take(&mut self, source: &str, share: bool) -> std::result::Result<(), String> {
        let PreauthLimits {
            handshakes,
            per_source,
        } = self.limits;
        if self.total >= handshakes {
            return Err(format!("{handshakes} handshakes already pending"));
        }
        let n = self.per_source.entry(source.to_string()).or_insert(0);
        if share && *n >= per_source {
            return Err(format!(
                "{per_source} handshakes from {source} already pending"
            ));
        }
        *n += 1;
        self.total += 1;
        Ok(())
    }

    fn give(&mut self, source: &str) {
        self.total = self.total.saturating_sub(1);
        if let Some(n) = self.per_source.get_mut(source) {
            *n -= 1;
            if *n == 0 {
                self.per_source.remove(source);
            }
        }
    }
}

/// The accepting side's handshakes, each on its own thread and bounded by
/// `connect_timeout`, so a silent or slow peer never delays the others: `accept` hands out
/// whichever link finishes its handshake first.
pub(crate) struct Handshakes {
    local: NodeId,
    cfg: LinkConfig,
    tx: mpsc::Sender<Result<LinkEndpoint>>,
    rx: Mutex<mpsc::Receiver<Result<LinkEndpoint>>>,
    /// Written by a handshake thread when it has sent its result.
    done: Arc<EventFd>,
    pending: Arc<Mutex<Pending>>,
    /// Whether each source gets only its share of the slots (tcp).
    per_source: bool,
    log: Arc<RateLimit>,
}

impl Handshakes {
    /// Handshakes in progress now.
    pub(crate) fn pending(&self) -> usize {
        self.pending
            .lock()
            .map(|p| p.total)
            .unwrap_or_else(|e| e.into_inner().total)
    }

    /// Handshakes that may be in progress at once.
    pub(crate) fn slots(&self) -> usize {
        self.cfg.preauth.handshakes
    }

    /// `per_source`: each source holds at most its share (`cfg.preauth.per_source`) of the
    /// slots.
    pub(crate) fn new(local: &NodeId, cfg: &LinkConfig, per_source: bool) -> Result<Handshakes> {
        let (tx, rx) = mpsc::channel();
        Ok(Handshakes {
            local: local.clone(),
            cfg: cfg.clone(),
            tx,
            rx: Mutex::new(rx),
            done: Arc::new(new_eventfd()?),
            pending: Arc::new(Mutex::new(Pending::new(cfg.preauth))),
            per_source,
            log: Arc::new(RateLimit::new(Duration::from_secs(1))),
        })
    }

    /// Starts the handshake of a freshly accepted connection from `from`.
    fn start(&self, stream: Accepted, from: String) {
        let source = source_key(&from);
        if let Err(why) = lock(&self.pending).take(&source, self.per_source) {
            if let Some(n) = self.log.hit() {
                log::warn!(
                    "{why}, closing the connection from {from} ({n} more closed or failed \
                     since the last report)"
                );
            }
            return;
        }
        let (local, cfg, tx) = (self.local.clone(), self.cfg.clone(), self.tx.clone());
        let (done, pending, log) = (self.done.clone(), self.pending.clone(), self.log.clone());
        let source_of = source.clone();
        // Detached: the link it makes goes out through `tx`, and `done` says it ended.
        let spawned = crate::workers::spawn("ntb-handshake", move || {
            let deadline = Instant::now() + cfg.connect_timeout;
            let r = match stream {
                Accepted::Plain(s) => establish(
                    s,
                    &local,
                    &cfg,
                    false,
                    LinkOpts {
                        deadline: Some(deadline),
                        ..LinkOpts::default()
                    },
                ),
                Accepted::Tls(t) => LinkOpts::tls(t, false, deadline, &cfg)
                    .and_then(|(s, o)| establish(s, &local, &cfg, false, o)),
            };
            if let Err(e) = &r {
                if let Some(n) = log.hit() {
                    log::warn!(
                        "handshake with {from} failed: {e} ({n} more closed or failed since \
                             the last report)"
                    );
                }
            }
            lock(&pending).give(&source_of);
            if r.is_ok() {
                // Fails only when the listener is gone; the link then closes on drop.
                let _ = tx.send(r);
            }
            let _ = done.write(1);
        });
        if let Err(e) = spawned {
            lock(&self.pending).give(&source);
            log::warn!("cannot start a handshake thread: {e}");
        }
    }

    /// Waits up to `timeout` (`None`: forever) for a link whose handshake succeeded, starting
    /// the handshake of every connection `accept_one` takes from the readable `listener`.
    pub(crate) fn accept(
        &self,
        listener: BorrowedFd<'_>,
        mut accept_one: impl FnMut() -> io::Result<(Accepted, String)>,
        timeout: Option<Duration>,
    ) -> Result<LinkEndpoint> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Ok(r) = lock(&self.rx).try_recv() {
                return r;
            }
            let left = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(FabricError::Timeout(timeout.unwrap_or_default()));
                    }
                    left
                }
                None => Duration::from_secs(3600),
            };
            // SAFETY: the eventfd lives in self for the whole call.
            let done = unsafe { BorrowedFd::borrow_raw(self.done.as_raw_fd()) };
            if !poll_fds(&[listener, done], left)? {
                continue;
            }
            let _ = self.done.read();
            // The listener is non-blocking: take every waiting connection.
            loop {
                match accept_one() {
                    Ok((s, from)) => self.start(s, from),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        return Err(FabricError::Io {
                            op: "accept link",
                            source: e,
                        })
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_ipv4_addresses_ipv6_64s_and_local_uids() {
        assert_eq!(source_key("10.1.2.3:4000"), "10.1.2.3");
        assert_eq!(
            source_key("[2001:db8:1:2:aaaa::1]:4000"),
            source_key("[2001:db8:1:2:bbbb:cccc:dddd:eeee]:5000")
        );
        assert_eq!(source_key("[2001:db8:1:2::1]:1"), "2001:db8:1:2::/64");
        assert_ne!(
            source_key("[2001:db8:1:2::1]:1"),
            source_key("[2001:db8:1:3::1]:1")
        );
        assert_eq!(source_key("[::ffff:10.1.2.3]:7"), "10.1.2.3");
        assert_eq!(source_key("unix:uid=1000,pid=77"), "uid=1000");
        assert_eq!(source_key("odd"), "odd");
    }

    #[test]
    fn one_source_holds_at_most_its_share_of_the_handshake_slots() {
        let mut p = Pending::new(PreauthLimits::default());
        for _ in 0..MAX_PENDING_PER_SOURCE {
            p.take("10.0.0.9", true).unwrap();
        }
        let e = p.take("10.0.0.9", true).unwrap_err();
        assert!(e.contains("from 10.0.0.9"), "{e}");
        // Others still get in, up to the global bound.
        let mut n = MAX_PENDING_PER_SOURCE;
        let mut i = 0;
        while n < MAX_PENDING_HANDSHAKES {
            p.take(&format!("10.1.0.{}", i / MAX_PENDING_PER_SOURCE), true)
                .unwrap();
            n += 1;
            i += 1;
        }
        assert!(p.take("10.2.0.1", true).is_err());
        p.give("10.0.0.9");
        p.take("10.2.0.1", true).unwrap();
        assert_eq!(p.total, MAX_PENDING_HANDSHAKES);
        // Without shares (shm: one uid) one source may take every slot.
        let mut p = Pending::new(PreauthLimits::default());
        for _ in 0..MAX_PENDING_HANDSHAKES {
            p.take("uid=0", false).unwrap();
        }
        assert!(p.take("uid=0", false).is_err());
    }

    #[test]
    fn configured_limits_apply_and_bad_ones_are_named() {
        // Borrowers behind one NAT: a larger share for the one source.
        let limits = PreauthLimits {
            handshakes: 32,
            per_source: 24,
        };
        limits.check().unwrap();
        let mut p = Pending::new(limits);
        for _ in 0..24 {
            p.take("192.0.2.1", true).unwrap();
        }
        assert!(p
            .take("192.0.2.1", true)
            .unwrap_err()
            .contains("24 handshakes from"));
        for _ in 0..8 {
            p.take("192.0.2.2", true).unwrap();
        }
        assert!(p
            .take("192.0.2.3", true)
            .unwrap_err()
            .contains("32 handshakes already"));
        let e = PreauthLimits {
            handshakes: 0,
            per_source: 1,
        }
        .check()
        .unwrap_err();
        assert!(e.contains("max_pending_handshakes 0"), "{e}");
        let e = PreauthLimits {
            handshakes: 8,
            per_source: 9,
        }
        .check()
        .unwrap_err();
        assert!(
            e.contains("max_pending_per_source 9 is not in 1..=8"),
            "{e}"
        );
    }
}
