//! The accepting side of the socket backends: every accepted connection runs its handshake
//! (TLS on tcp, then the fabric hello) on its own thread, bounded by `connect_timeout`, so a
//! silent or slow peer never delays the others; `accept` hands out whichever link is ready
//! first.

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
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

/// Most handshakes a listener runs at once; connections beyond are closed at once.
pub(crate) const MAX_PENDING_HANDSHAKES: usize = 64;

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
    pending: Arc<AtomicUsize>,
    log: Arc<RateLimit>,
}

impl Handshakes {
    /// Handshakes in progress now.
    pub(crate) fn pending(&self) -> usize {
        self.pending.load(Ordering::Acquire)
    }

    pub(crate) fn new(local: &NodeId, cfg: &LinkConfig) -> Result<Handshakes> {
        let (tx, rx) = mpsc::channel();
        Ok(Handshakes {
            local: local.clone(),
            cfg: cfg.clone(),
            tx,
            rx: Mutex::new(rx),
            done: Arc::new(new_eventfd()?),
            pending: Arc::default(),
            log: Arc::new(RateLimit::new(Duration::from_secs(1))),
        })
    }

    /// Starts the handshake of a freshly accepted connection from `from`.
    fn start(&self, stream: Accepted, from: String) {
        if self.pending.fetch_add(1, Ordering::AcqRel) >= MAX_PENDING_HANDSHAKES {
            self.pending.fetch_sub(1, Ordering::AcqRel);
            if let Some(n) = self.log.hit() {
                log::warn!(
                    "{MAX_PENDING_HANDSHAKES} handshakes already pending, closing the connection \
                     from {from} ({n} more closed or failed since the last report)"
                );
            }
            return;
        }
        let (local, cfg, tx) = (self.local.clone(), self.cfg.clone(), self.tx.clone());
        let (done, pending, log) = (self.done.clone(), self.pending.clone(), self.log.clone());
        let spawned = std::thread::Builder::new()
            .name("ntb-handshake".into())
            .spawn(move || {
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
                    Accepted::Tls(t) => LinkOpts::tls(t, false, deadline)
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
                pending.fetch_sub(1, Ordering::AcqRel);
                if r.is_ok() {
                    // Fails only when the listener is gone; the link then closes on drop.
                    let _ = tx.send(r);
                }
                let _ = done.write(1);
            });
        if let Err(e) = spawned {
            self.pending.fetch_sub(1, Ordering::AcqRel);
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
