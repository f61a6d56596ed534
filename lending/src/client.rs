//! Borrower-side client of the lender control protocol (used by the VMM's `remote_pci` and by
//! `lendctl`).
//!
//! ```text
//! let c = LenderClient::connect(&cluster, "node1", "node3", token, "lendvm")?;
//! let lease = c.borrow("0000:81:00.0", "vm0")?;          // exclusive
//! let cfg = lease.config_read(0, 256)?;
//! let w = c.endpoint().export_window(memfd, 0, size, "vm0-ram")?;   // guest RAM window
//! lease.map_dma(gpa, size, w.id())?;                     // IOVA = GPA
//! lease.set_irqs(IrqKind::Msix, &[ClientIrq::EventFd(&irqfd)])?;
//! drop(lease);                                           // RETURN
//! ```
//!
//! On links that cannot pass file descriptors (tcp), [`ClientIrq::EventFd`] targets are sent
//! as [`IrqTarget::Event`] and the client starts one relay thread per session that takes the
//! lender's IRQ event messages off the link and signals the right eventfd; other events are
//! queued for [`LenderClient::next_event`]. An INTx resample eventfd
//! ([`Lease::set_irqs_resample`]) is passed on shm and watched by a forwarding thread that
//! sends [`Event::Resample`] on tcp. Callers use the same code on both fabrics.
//!
//! The relay thread is the only reader of the link once started ([`LenderClient::event_waker`]
//! starts it too); a thread blocked in [`LenderClient::wait_event`] returns at once when
//! woken, and dropping the last handle of the client closes the link, which ends the relay
//! thread at once (no polling interval on any teardown path).

use std::collections::HashMap;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ntb::{
    connect_addr, ClusterConfig, Endpoint, Fabric, FabricError, FabricKind, Incoming, Message,
    NodeConfig, NodeId, PeerWindow, SocketFabric,
};
use serde::de::DeserializeOwned;
use thiserror::Error;
use vmm_sys_util::eventfd::EventFd;

mod migration;

use crate::auth::{self, Role, Transcript};
use crate::backend::irq::IrqRelay;
use crate::protocol::{
    self, code, AuthChallenge, AuthResponse, BarRead, BarWrite, Borrow, ConfigRead, ConfigWrite,
    DeviceInfo, DeviceSummary, DmaMap, DmaUnmap, Event, Hello, HelloReply, IrqKind, IrqResample,
    IrqTarget, LeaseCounters, LeaseRef, LenderStatus, P2pMap, P2pUnmap, ProtocolError, Quiesce,
    Request, SetIrqs, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};

/// Default bound on one request.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors of the client.
#[derive(Debug, Error)]
pub enum ClientError {
    /// The lender answered with an error.
    #[error("lender {lender}: {message}")]
    Remote {
        /// Lender node.
        lender: String,
        /// Error code ([`protocol::code`]).
        code: u32,
        /// Message (`device busy, lent to node1/vm0`, `bad token`, …).
        message: String,
    },
    /// The fabric failed.
    #[error("fabric: {0}")]
    Fabric(#[from] FabricError),
    /// Encoding/decoding failed.
    #[error("protocol: {0}")]
    Protocol(#[from] ProtocolError),
    /// The reply lacked something.
    #[error("bad reply: {0}")]
    BadReply(String),
    /// Interrupts the lender relayed before a hand-over quiesce's reply did not reach their
    /// eventfds in time (the session's event consumer is not taking events).
    #[error(
        "lender {lender}, lease {lease}: interrupts relayed before the hand-over quiesce were \
         not delivered within {waited_ms} ms"
    )]
    EventsUnsettled {
        /// Lender node.
        lender: String,
        /// The lease.
        lease: u64,
        /// How long the client waited.
        waited_ms: u64,
    },
    /// The lender's control address could not be reached.
    #[error("connecting to {addr}: {source}")]
    Connect {
        /// The control address.
        addr: String,
        /// Why.
        source: FabricError,
    },
    /// Another node answered at the lender's control address.
    #[error("{addr} answered as {node}")]
    WrongLender {
        /// The control address.
        addr: String,
        /// The node that answered.
        node: String,
    },
    /// The lender's protocol version does not have the request.
    #[error("lender {lender} speaks protocol version {version}, {what} needs {needs}")]
    Unsupported {
        /// Lender node.
        lender: String,
        /// The request.
        what: &'static str,
        /// The session's version.
        version: u32,
        /// The version that has it.
        needs: u32,
    },
    /// The lender's session does not speak protocol version 4 (live migration).
    #[error(
        "lender {lender} speaks protocol version {version}: peer does not support migration \
         (dirty log, hand-over quiesce, lease transfer need version 4)"
    )]
    MigrationUnsupported {
        /// Lender node.
        lender: String,
        /// The session's version.
        version: u32,
    },
    /// The lender did not prove that it knows the cluster token (an impostor, or this node's
    /// token is wrong).
    #[error(
        "lender {lender} at {addr} did not prove that it knows the cluster token ({why}): \
         it is an impostor or this node's token differs; refusing it"
    )]
    LenderNotAuthenticated {
        /// The node that answered.
        lender: String,
        /// Its address.
        addr: String,
        /// What was wrong.
        why: String,
    },
    /// An fd operation failed.
    #[error("{what}: {source}")]
    Os {
        /// What.
        what: &'static str,
        /// OS error.
        source: std::io::Error,
    },
}

impl ClientError {
    /// The protocol error code when the lender refused the request.
    pub fn code(&self) -> Option<u32> {
        match self {
            ClientError::Remote { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// (lease, kind, vector) → eventfd signalled when the lender relays that vector as a message.
type IrqRoutes = Arc<Mutex<HashMap<(u64, IrqKind, u32), EventFd>>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// What the relay thread hands to [`LenderClient::next_event`] / [`LenderClient::wait_event`].
enum PumpMsg {
    Event(Event),
    /// An [`EventWaker`] asked the waiting thread to return.
    Wake,
    /// The link is down (the relay thread has ended).
    Down(String),
}

/// The receiving end of the relay thread's messages (waiters clone the `Arc` so they do not
/// hold the pump's lock while they block).
struct PumpRx {
    events: Mutex<mpsc::Receiver<PumpMsg>>,
    /// Why the link went down, once the relay thread saw it.
    down: Mutex<Option<String>>,
    /// Relayed interrupts (`Event::Irq`) handed to the consumer, and how many of them it had
    /// when it came back for more: by then it has handled them (its eventfd writes are done).
    irqs_taken: AtomicU64,
    irqs_handled: AtomicU64,
}

impl PumpRx {
    fn new(events: mpsc::Receiver<PumpMsg>) -> Self {
        Self {
            events: Mutex::new(events),
            down: Mutex::new(None),
            irqs_taken: AtomicU64::new(0),
            irqs_handled: AtomicU64::new(0),
        }
    }

    /// The next event (`Ok(None)`: woken, or `timeout` passed); `Err(reason)` once the link
    /// is down. Events the relay queued before the link went down come first: a lender's
    /// DeviceGone is followed at once by its goodbye, and the reason the borrower reports
    /// must be the lender's, not "peer closed the link". Only an empty queue reports the end
    /// (the one `Down` message may have gone to an earlier caller).
    fn next(&self, timeout: Option<Duration>) -> Result<Option<Event>, String> {
        // A consumer back for more has handled what it took before.
        self.irqs_handled
            .store(self.irqs_taken.load(Ordering::Acquire), Ordering::Release);
        let rx = lock(&self.events);
        let m = match rx.try_recv() {
            Ok(m) => m,
            Err(mpsc::TryRecvError::Disconnected) => return Err("link down".into()),
            Err(mpsc::TryRecvError::Empty) => {
                if let Some(r) = lock(&self.down).clone() {
                    return Err(r);
                }
                match timeout {
                    Some(t) => match rx.recv_timeout(t) {
                        Ok(m) => m,
                        Err(mpsc::RecvTimeoutError::Timeout) => return Ok(None),
                        Err(mpsc::RecvTimeoutError::Disconnected) => return Err("link down".into()),
                    },
                    None => rx
                        .recv()
                        .map_err(|mpsc::RecvError| "link down".to_string())?,
                }
            }
        };
        match m {
            PumpMsg::Event(e) => {
                if matches!(e, Event::Irq(_)) {
                    self.irqs_taken.fetch_add(1, Ordering::AcqRel);
                }
                Ok(Some(e))
            }
            PumpMsg::Wake => Ok(None),
            PumpMsg::Down(r) => Err(r),
        }
    }
}

/// The relay thread of a session: the only reader of the link's incoming queue once started.
struct EventPump {
    stop: Arc<AtomicBool>,
    rx: Arc<PumpRx>,
    /// For wakers.
    tx: mpsc::SyncSender<PumpMsg>,
    /// The link's `incoming_taken` count once the relay thread has handled what it took:
    /// everything up to there is an eventfd write done or a message in `tx`.
    handled: Arc<AtomicU64>,
    /// Interrupts the relay thread passed on to the consumer (no route of its own).
    irqs_relayed: Arc<AtomicU64>,
    thread: Option<ntb::workers::Worker>,
}

/// How long the relay thread sleeps in one `recv` before it looks at its stop flag. Only a
/// safety net: teardown closes the link, which ends the `recv` at once.
const PUMP_POLL: Duration = Duration::from_millis(500);

/// Messages the relay thread may have waiting for the event consumer. The events come from
/// the lender (a guest's device can raise interrupts as fast as it likes): once this many
/// wait, the relay stops reading the link, whose incoming queue is bounded in turn, so the
/// VMM never holds more than this many undelivered events per lender session.
pub const EVENT_QUEUE: usize = 4096;

/// Hands `m` to the consumer, waiting while [`EVENT_QUEUE`] messages are undelivered
/// (backpressure on the link); gives up when the relay is stopped or the consumer gone.
fn relay(tx: &mpsc::SyncSender<PumpMsg>, mut m: PumpMsg, stop: &AtomicBool) {
    loop {
        match tx.try_send(m) {
            Ok(()) | Err(mpsc::TrySendError::Disconnected(_)) => return,
            Err(mpsc::TrySendError::Full(back)) => {
                if stop.load(Ordering::Acquire) {
                    return;
                }
                m = back;
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

fn pump_loop(
    ep: &Arc<dyn Endpoint>,
    routes: &IrqRoutes,
    stop: &AtomicBool,
    tx: &mpsc::SyncSender<PumpMsg>,
    rx: &PumpRx,
    handled: &AtomicU64,
    irqs_relayed: &AtomicU64,
) {
    while !stop.load(Ordering::Acquire) {
        let r = ep.recv(PUMP_POLL);
        let took = r.is_ok();
        match r {
            Ok(Incoming::Event(m)) => match Event::decode(m.opcode, &m.payload) {
                Ok(Event::Irq(ev)) => {
                    let routes = lock(routes);
                    match routes.get(&(ev.lease, ev.kind, ev.vector)) {
                        Some(fd) => {
                            if let Err(e) = fd.write(1) {
                                log::warn!(
                                    "lease {}: {:?} vector {} eventfd write failed: {e}",
                                    ev.lease,
                                    ev.kind,
                                    ev.vector
                                );
                            }
                        }
                        None => {
                            drop(routes);
                            irqs_relayed.fetch_add(1, Ordering::AcqRel);
                            relay(tx, PumpMsg::Event(Event::Irq(ev)), stop);
                        }
                    }
                }
                Ok(other) => {
                    relay(tx, PumpMsg::Event(other), stop);
                }
                Err(e) => log::warn!("{}: undecodable event: {e}", ep.peer_node()),
            },
            Ok(_) | Err(FabricError::Timeout(_)) => {}
            Err(e) => {
                log::debug!("irq relay from {}: {e}", ep.peer_node());
                let reason = match e {
                    FabricError::PeerGone { reason, .. } => reason,
                    other => other.to_string(),
                };
                *lock(&rx.down) = Some(reason.clone());
                relay(tx, PumpMsg::Down(reason), stop);
                return;
            }
        }
        if took {
            // The only reader of the link's queue from its start (its count then is where
            // `handled` began), so counting here matches the link's own count without
            // reading it per interrupt.
            handled.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// Makes a [`LenderClient::wait_event`] (or `next_event`) blocked in another thread return
/// `Ok(None)` at once. Cheap to clone; outliving the client is harmless.
#[derive(Clone)]
pub struct EventWaker {
    tx: mpsc::SyncSender<PumpMsg>,
}

impl EventWaker {
    /// Wakes the thread waiting for events (or the next one to wait).
    pub fn wake(&self) {
        // The receiver is gone only when the client is: nothing left to wake.
        // A full queue already wakes the waiter (it has messages to take).
        let _ = self.tx.try_send(PumpMsg::Wake);
    }
}

/// Watches an INTx resample eventfd and sends [`Event::Resample`] for its lease (links
/// without fd passing). Dropping the relay stops and joins the thread at once.
fn forward_resamples(
    ep: Arc<dyn Endpoint>,
    lease: u64,
    fd: EventFd,
) -> Result<IrqRelay, ClientError> {
    IrqRelay::watch(
        format!("resample{lease}"),
        format!("lease {lease}: resample"),
        vec![fd],
        move |_| send_resample(&*ep, lease),
    )
    .map_err(|source| ClientError::Os {
        what: "starting the resample forwarding thread",
        source,
    })
}

/// Sends one [`Event::Resample`]; false once the lender is gone.
fn send_resample(ep: &dyn Endpoint, lease: u64) -> bool {
    let msg = Event::Resample(IrqResample { lease })
        .encode()
        .map(|(op, p)| Message::raw(op, p));
    match msg {
        Ok(m) => {
            if let Err(e) = ep.send(m) {
                log::debug!("lease {lease}: resample to {}: {e}", ep.peer_node());
                if e.is_peer_gone() {
                    return false;
                }
            }
        }
        Err(e) => log::error!("lease {lease}: resample event encode: {e}"),
    }
    true
}

struct Inner {
    ep: Arc<dyn Endpoint>,
    lender: String,
    timeout: Duration,
    /// Protocol version agreed at hello.
    version: AtomicU32,
    routes: IrqRoutes,
    /// Per lease: the INTx resample forwarder (tcp).
    resamplers: Mutex<HashMap<u64, IrqRelay>>,
    pump: Mutex<Option<EventPump>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        lock(&self.resamplers).clear();
        let pump = lock(&self.pump).take();
        if let Some(mut p) = pump {
            p.stop.store(true, Ordering::Release);
            // No lease is left (each holds this value): end the session now, which also
            // ends the relay thread's `recv` at once.
            self.ep.close();
            if let Some(t) = p.thread.take() {
                let _ = t.join();
            }
        }
    }
}

impl Inner {
    /// Starts the relay thread once.
    fn start_pump(&self) -> Result<(), ClientError> {
        let mut g = lock(&self.pump);
        if g.is_some() {
            return Ok(());
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, events) = mpsc::sync_channel(EVENT_QUEUE);
        let rx = Arc::new(PumpRx::new(events));
        let handled = Arc::new(AtomicU64::new(self.ep.stats().incoming_taken));
        let irqs_relayed = Arc::new(AtomicU64::new(0));
        let (ep, routes, stop2, tx2, rx2, handled2, relayed2) = (
            Arc::clone(&self.ep),
            Arc::clone(&self.routes),
            Arc::clone(&stop),
            tx.clone(),
            Arc::clone(&rx),
            Arc::clone(&handled),
            Arc::clone(&irqs_relayed),
        );
        let thread = ntb::workers::spawn(format!("irq-events-{}", self.lender), move || {
            pump_loop(&ep, &routes, &stop2, &tx2, &rx2, &handled2, &relayed2)
        })
        .map_err(|source| ClientError::Os {
            what: "starting the irq event relay thread",
            source,
        })?;
        *g = Some(EventPump {
            stop,
            rx,
            tx,
            handled,
            irqs_relayed,
            thread: Some(thread),
        });
        Ok(())
    }

    fn forget_routes(&self, lease: u64, kind: Option<IrqKind>) {
        lock(&self.routes).retain(|&(l, k, _), _| l != lease || kind.is_some_and(|x| x != k));
        if kind.is_none_or(|k| k == IrqKind::Intx) {
            let fwd = lock(&self.resamplers).remove(&lease);
            drop(fwd);
        }
    }

    fn version(&self) -> u32 {
        self.version.load(Ordering::Acquire)
    }

    fn gone(&self, reason: String) -> ClientError {
        ClientError::Fabric(FabricError::PeerGone {
            peer: self.lender.clone(),
            reason,
        })
    }

    /// Waits until every event the lender sent before the reply just received has been
    /// handled: a relayed interrupt's eventfd written, by the relay thread or by the
    /// consumer of [`LenderClient::wait_event`]. A reply overtakes events on their way (the
    /// link hands replies to the caller at once; events go through the relay thread and the
    /// consumer's), and after a hand-over quiesce an interrupt that lands late lands in a VM
    /// whose state has already been saved: lost to the guest. Bounded by `timeout`; returns
    /// whether everything settled. Without a relay thread nothing is on its way.
    fn settle_events(&self, timeout: Duration) -> bool {
        let (handled, relayed, rx, stop) = match lock(&self.pump).as_ref() {
            Some(p) => (
                Arc::clone(&p.handled),
                Arc::clone(&p.irqs_relayed),
                Arc::clone(&p.rx),
                Arc::clone(&p.stop),
            ),
            None => return true,
        };
        let deadline = Instant::now() + timeout;
        let wait = |done: &dyn Fn() -> bool| {
            while !done() {
                if Instant::now() >= deadline || stop.load(Ordering::Acquire) {
                    return false;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
            true
        };
        // The link's reader queued the events before it read the reply: all counted here.
        let mark = self.ep.stats().incoming_queued;
        // First the relay thread (routed interrupts written, the others passed on), then the
        // consumer, for the interrupts passed on to it.
        wait(&|| handled.load(Ordering::Acquire) >= mark || !self.ep.is_up())
            && wait(&|| rx.irqs_handled.load(Ordering::Acquire) >= relayed.load(Ordering::Acquire))
    }

    /// The relay thread's receiving end, if it runs.
    fn pump_rx(&self) -> Option<Arc<PumpRx>> {
        lock(&self.pump).as_ref().map(|p| Arc::clone(&p.rx))
    }

    /// Takes the next message from the relay thread, blocking up to `timeout` (`None`: until
    /// one comes).
    fn pump_recv(
        &self,
        p: &PumpRx,
        timeout: Option<Duration>,
    ) -> Result<Option<Event>, ClientError> {
        p.next(timeout).map_err(|r| self.gone(r))
    }

    fn call<T: DeserializeOwned>(
        &self,
        req: &Request,
        fds: Vec<OwnedFd>,
    ) -> Result<(T, Vec<OwnedFd>), ClientError> {
        let (op, payload, fds) = self.call_raw(req, fds)?;
        let v = protocol::decode_reply(op, &payload)?;
        Ok((v, fds))
    }

    /// A request in the agreed version; the reply's opcode, payload and fds.
    fn call_raw(
        &self,
        req: &Request,
        fds: Vec<OwnedFd>,
    ) -> Result<(u16, Vec<u8>, Vec<OwnedFd>), ClientError> {
        let (op, payload) = req.encode_versioned(self.version())?;
        let reply = self
            .ep
            .request(Message::raw(op, payload).with_fds(fds), self.timeout)
            .map_err(|e| match e {
                FabricError::Remote(r) => ClientError::Remote {
                    lender: self.lender.clone(),
                    code: r.code,
                    message: r.message,
                },
                other => ClientError::Fabric(other),
            })?;
        Ok((op, reply.payload, reply.fds))
    }
}

/// Runs AUTH on a fresh session over `ep`: checks the lender's proof of `token` and returns
/// the borrower's proof for HELLO's token field ([`crate::auth`]). [`LenderClient`] does this
/// itself; it is public for tests and tools that speak the protocol by hand.
pub fn authenticate(
    ep: &dyn Endpoint,
    token: &str,
    timeout: Duration,
) -> Result<String, ClientError> {
    let lender = ep.peer_node().to_string();
    let borrower = ep.local_node().to_string();
    let refuse = |why: String| ClientError::LenderNotAuthenticated {
        lender: lender.clone(),
        addr: ep.peer_addr(),
        why,
    };
    let auth_err = |e: auth::AuthError| ClientError::BadReply(e.to_string());
    let nb = auth::nonce().map_err(auth_err)?;
    let op = protocol::opcode::AUTH;
    let payload = protocol::encode_reply(op, &AuthChallenge { nonce: nb.to_vec() })?;
    let reply = ep
        .request(Message::raw(op, payload), timeout)
        .map_err(|e| match e {
            FabricError::Remote(r) if r.code == code::UNKNOWN_OPCODE => {
                refuse("it does not support challenge-response authentication".into())
            }
            FabricError::Remote(r) => ClientError::Remote {
                lender: lender.clone(),
                code: r.code,
                message: r.message,
            },
            other => ClientError::Fabric(other),
        })?;
    let r: AuthResponse =
        protocol::decode_reply(op, &reply.payload).map_err(|e| refuse(e.to_string()))?;
    if r.node != lender {
        return Err(refuse(format!(
            "it names itself {:?} in AUTH but {lender:?} on the fabric",
            r.node
        )));
    }
    let binding = ep.channel_binding();
    let t = Transcript {
        borrower_nonce: &nb,
        lender_nonce: &r.nonce,
        borrower: &borrower,
        lender: &lender,
        binding: &binding,
    };
    match t.verify(token, Role::Lender, &r.proof) {
        Ok(true) => {}
        Ok(false) => return Err(refuse("its proof does not verify".into())),
        Err(e) => return Err(refuse(e.to_string())),
    }
    let proof = t.prove(token, Role::Borrower).map_err(auth_err)?;
    Ok(auth::encode_proof(&proof))
}

/// How long the set-up of a [`LenderClient`] took, step by step (the hot-add profile).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SetupTimings {
    /// Opening the fabric link: connect, TLS on tcp, the fabric hello (`None`: the link was
    /// given, [`LenderClient::from_endpoint`]).
    pub link: Option<Duration>,
    /// The AUTH challenge-response round trip.
    pub auth: Duration,
    /// The HELLO round trip.
    pub hello: Duration,
}

/// A session with one lender.
pub struct LenderClient {
    inner: Arc<Inner>,
    hello: HelloReply,
    setup: SetupTimings,
}

impl LenderClient {
    /// Connects from `local` to `lender` as described by `cluster` and says hello.
    pub fn connect(
        cluster: &ClusterConfig,
        local: &str,
        lender: &str,
        token: &str,
        client: &str,
    ) -> Result<Self, ClientError> {
        let fabric = SocketFabric::from_cluster(cluster, local)?;
        let ep = fabric.connect(&NodeId::new(lender)?)?;
        Self::from_endpoint(ep, token, client)
    }

    /// Opens a link straight to `lender`'s control address under the name `local`, which
    /// need not be in `cluster` (the link settings are its own if it is, else the lender's;
    /// connecting takes at most `connect_timeout`), checks that `lender` is who answers, and
    /// says hello. Fails with [`ClientError::Connect`] or [`ClientError::WrongLender`] before
    /// the hello.
    pub fn connect_node(
        cluster: &ClusterConfig,
        lender: &NodeConfig,
        local: &NodeId,
        connect_timeout: Duration,
        token: &str,
        client: &str,
    ) -> Result<Self, ClientError> {
        let mut cfg = cluster
            .node(local.as_str())
            .map_or_else(|| lender.link.clone(), |n| n.link.clone());
        cfg.connect_timeout = cfg.connect_timeout.min(connect_timeout);
        let t = Instant::now();
        let ep =
            connect_addr(&lender.control, local, &cfg).map_err(|source| ClientError::Connect {
                addr: lender.control.to_string(),
                source,
            })?;
        if ep.peer_node() != &lender.name {
            return Err(ClientError::WrongLender {
                addr: lender.control.to_string(),
                node: ep.peer_node().to_string(),
            });
        }
        let link = t.elapsed();
        let mut c = Self::auth_and_hello(ep, token, client, PROTOCOL_VERSION, cfg.request_timeout)?;
        c.setup.link = Some(link);
        Ok(c)
    }

    /// Says hello over an existing link.
    pub fn from_endpoint(
        ep: Box<dyn Endpoint>,
        token: &str,
        client: &str,
    ) -> Result<Self, ClientError> {
        Self::from_endpoint_with_version(ep, token, client, PROTOCOL_VERSION)
    }

    /// Says hello over an existing link offering protocol `version` at most (clamped to
    /// [`MIN_PROTOCOL_VERSION`]..=[`PROTOCOL_VERSION`]): speaks as an older borrower would,
    /// for compatibility tests and for pinning a version.
    pub fn from_endpoint_with_version(
        ep: Box<dyn Endpoint>,
        token: &str,
        client: &str,
        version: u32,
    ) -> Result<Self, ClientError> {
        Self::auth_and_hello(ep, token, client, version, DEFAULT_TIMEOUT)
    }

    /// AUTH and HELLO over `ep`; every later request waits at most `timeout` for its answer
    /// (the link's `request_timeout`).
    fn auth_and_hello(
        ep: Box<dyn Endpoint>,
        token: &str,
        client: &str,
        version: u32,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        let offer = version.clamp(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION);
        let ep: Arc<dyn Endpoint> = Arc::from(ep);
        let inner = Arc::new(Inner {
            lender: ep.peer_node().to_string(),
            ep,
            timeout,
            version: AtomicU32::new(offer),
            routes: Arc::default(),
            resamplers: Mutex::default(),
            pump: Mutex::new(None),
        });
        let t = Instant::now();
        let proof = authenticate(&*inner.ep, token, inner.timeout)?;
        let auth = t.elapsed();
        let req = Request::Hello(Hello {
            version: offer,
            token: proof,
            client: client.to_string(),
        });
        let (hello, _): (HelloReply, _) = inner.call(&req, Vec::new())?;
        if !(MIN_PROTOCOL_VERSION..=offer).contains(&hello.version) {
            return Err(ClientError::BadReply(format!(
                "lender {} answered protocol version {}, this client offered \
                 {MIN_PROTOCOL_VERSION}..={offer}",
                hello.node, hello.version
            )));
        }
        inner.version.store(hello.version, Ordering::Release);
        let setup = SetupTimings {
            link: None,
            auth,
            hello: t.elapsed() - auth,
        };
        Ok(LenderClient {
            inner,
            hello,
            setup,
        })
    }

    /// How long this client's set-up took.
    pub fn setup_timings(&self) -> SetupTimings {
        self.setup
    }

    /// The protocol version agreed with the lender.
    pub fn protocol_version(&self) -> u32 {
        self.inner.version()
    }

    /// What the lender said at hello.
    pub fn hello(&self) -> &HelloReply {
        &self.hello
    }

    /// The fabric link (export guest RAM windows, map BAR windows, doorbells).
    pub fn endpoint(&self) -> &Arc<dyn Endpoint> {
        &self.inner.ep
    }

    /// The lender's devices.
    pub fn list(&self) -> Result<Vec<DeviceSummary>, ClientError> {
        Ok(self.inner.call(&Request::List, Vec::new())?.0)
    }

    /// The lender's status.
    pub fn status(&self) -> Result<LenderStatus, ClientError> {
        Ok(self.inner.call(&Request::Status, Vec::new())?.0)
    }

    /// Borrows `device` for `vm` (exclusive).
    pub fn borrow(&self, device: &str, vm: &str) -> Result<Lease, ClientError> {
        self.borrow_request(Request::Borrow(Borrow {
            device: device.to_string(),
            vm: vm.to_string(),
        }))
    }

    /// Borrows `device` for `vm` under the directory claim whose revision is `claim` (the
    /// fencing token; see [`crate::directory`]). A lender without a directory ignores the
    /// claim; one with a directory refuses a claim that is not current
    /// ([`crate::protocol::code::STALE_CLAIM`]).
    pub fn borrow_claimed(&self, device: &str, vm: &str, claim: i64) -> Result<Lease, ClientError> {
        self.borrow_request(Request::BorrowClaimed(crate::protocol::BorrowClaimed {
            device: device.to_string(),
            vm: vm.to_string(),
            claim,
        }))
    }

    fn borrow_request(&self, req: Request) -> Result<Lease, ClientError> {
        let (_, payload, mut fds) = self.inner.call_raw(&req, Vec::new())?;
        let b = protocol::decode_borrowed(&payload, self.inner.version())?;
        let notify = match b.notify_fd {
            Some(i) if usize::from(i) < fds.len() => {
                let fd = fds.swap_remove(usize::from(i));
                // SAFETY: the lender sent this fd as an eventfd; we own it exclusively.
                Some(unsafe { EventFd::from_raw_fd(fd.into_raw_fd()) })
            }
            Some(i) => {
                return Err(ClientError::BadReply(format!(
                    "notify eventfd #{i} missing from the borrow reply"
                )))
            }
            None => None,
        };
        Ok(Lease {
            inner: Arc::clone(&self.inner),
            id: b.lease,
            info: b.info,
            notify,
            returned: false,
            moved: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Next event from the lender (device gone, fatal error, relayed irq not routed to an
    /// eventfd), if one arrives within `timeout`. Window changes are skipped.
    ///
    /// Returns `Ok(None)` early when an [`EventWaker`] wakes it.
    pub fn next_event(&self, timeout: Duration) -> Result<Option<Event>, ClientError> {
        if let Some(p) = self.inner.pump_rx() {
            return self.inner.pump_recv(&p, Some(timeout));
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.inner.ep.recv(left) {
                Ok(Incoming::Event(m)) => return Ok(Some(Event::decode(m.opcode, &m.payload)?)),
                Ok(_) => {}
                Err(FabricError::Timeout(_)) => return Ok(None),
                Err(e) => return Err(e.into()),
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
        }
    }
}

impl LenderClient {
    /// A handle that makes [`LenderClient::wait_event`] return in another thread. Starts the
    /// relay thread (the link's only reader from then on) if it is not running.
    pub fn event_waker(&self) -> Result<EventWaker, ClientError> {
        self.inner.start_pump()?;
        let g = lock(&self.inner.pump);
        let p = g
            .as_ref()
            .ok_or_else(|| ClientError::BadReply("event relay thread not running".into()))?;
        Ok(EventWaker { tx: p.tx.clone() })
    }

    /// Waits, without a timeout, for the next event from the lender: `Ok(Some(event))`,
    /// `Ok(None)` when an [`EventWaker`] woke it, an error once the link is down. Starts the
    /// relay thread if it is not running.
    pub fn wait_event(&self) -> Result<Option<Event>, ClientError> {
        self.inner.start_pump()?;
        let p = self
            .inner
            .pump_rx()
            .ok_or_else(|| ClientError::BadReply("event relay thread not running".into()))?;
        self.inner.pump_recv(&p, None)
    }
}

/// Where the lender should deliver one interrupt vector.
#[derive(Debug, Clone, Copy)]
pub enum ClientIrq<'a> {
    /// Not wired.
    None,
    /// Signal this eventfd (shm: e.g. a KVM irqfd; a duplicate is sent and the lender signals
    /// it directly; tcp: the lender sends an IRQ event and this client's relay thread signals
    /// a duplicate).
    EventFd(&'a EventFd),
    /// Ring this doorbell bit of ours.
    Doorbell(u8),
    /// Send an IRQ event message.
    Event,
}

/// Eventfd targets sent with one SET_IRQS (shm): one frame carries at most ntb's `MAX_FDS`
/// descriptors, and one is kept for the INTx resample eventfd.
const DIRECT_IRQ_FDS: usize = ntb::wire::MAX_FDS - 1;

/// How one [`ClientIrq::EventFd`] vector reaches its eventfd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EventFdPath {
    /// A duplicate goes with the request; the lender signals it (shm).
    Passed,
    /// The lender sends an IRQ event; this client's relay signals it (tcp, and on shm the
    /// vectors past the `direct_max` eventfds one frame can carry: slower, but wired).
    Relayed,
}

/// The path of each of `targets` (meaningful for the eventfd ones): the first `direct_max`
/// eventfd vectors are passed, the rest relayed.
fn eventfd_paths(targets: &[ClientIrq<'_>], direct_max: usize) -> Vec<EventFdPath> {
    let mut passed = 0;
    targets
        .iter()
        .map(|t| match t {
            ClientIrq::EventFd(_) if passed < direct_max => {
                passed += 1;
                EventFdPath::Passed
            }
            _ => EventFdPath::Relayed,
        })
        .collect()
}

/// A borrowed device. Dropping it returns the device.
pub struct Lease {
    inner: Arc<Inner>,
    id: u64,
    info: DeviceInfo,
    notify: Option<EventFd>,
    returned: bool,
    /// The lease moved to another borrower ([`Lease::mark_moved`]): nothing to return.
    moved: std::sync::atomic::AtomicBool,
}

impl Lease {
    /// Lease id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Device information from the borrow.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Eventfd to signal after storing into a directly mapped BAR (shm).
    pub fn notify_eventfd(&self) -> Option<&EventFd> {
        self.notify.as_ref()
    }

    /// Fresh device information (config snapshot etc.).
    pub fn device_info(&self) -> Result<DeviceInfo, ClientError> {
        let r = Request::DeviceInfo(LeaseRef { lease: self.id });
        let (_, payload, _) = self.inner.call_raw(&r, Vec::new())?;
        Ok(protocol::decode_device_info(
            &payload,
            self.inner.version(),
            self.notify.is_some(),
        )?)
    }

    /// Reads `len` bytes of config space.
    pub fn config_read(&self, offset: u16, len: u16) -> Result<Vec<u8>, ClientError> {
        let r = Request::ConfigRead(ConfigRead {
            lease: self.id,
            offset,
            len,
        });
        Ok(self.inner.call(&r, Vec::new())?.0)
    }

    /// Writes config space (filtered by the lender).
    pub fn config_write(&self, offset: u16, data: &[u8]) -> Result<(), ClientError> {
        let r = Request::ConfigWrite(ConfigWrite {
            lease: self.id,
            offset,
            data: data.to_vec(),
        });
        self.inner.call::<()>(&r, Vec::new()).map(|_| ())
    }

    /// Slow-path BAR read.
    pub fn bar_read(&self, bar: u8, offset: u64, len: u32) -> Result<Vec<u8>, ClientError> {
        let r = Request::BarRead(BarRead {
            lease: self.id,
            bar,
            offset,
            len,
        });
        Ok(self.inner.call(&r, Vec::new())?.0)
    }

    /// Slow-path BAR write.
    pub fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), ClientError> {
        self.bar_write_kicks(bar, offset, data).map(|_| ())
    }

    /// Slow-path BAR write; also returns the device's kick-only doorbells after the write
    /// (`None` from a lender older than protocol version 3).
    pub fn bar_write_kicks(
        &self,
        bar: u8,
        offset: u64,
        data: &[u8],
    ) -> Result<Option<protocol::DoorbellKicks>, ClientError> {
        let r = Request::BarWrite(BarWrite {
            lease: self.id,
            bar,
            offset,
            data: data.to_vec(),
        });
        let (op, payload, _) = self.inner.call_raw(&r, Vec::new())?;
        Ok(protocol::decode_kicks_reply(
            op,
            &payload,
            self.inner.version(),
        )?)
    }

    /// Maps the lender's fabric window of `bar` (direct loads/stores on shm).
    pub fn bar_window(&self, bar: u8) -> Result<Box<dyn PeerWindow>, ClientError> {
        let id = self
            .info
            .bars
            .iter()
            .find(|b| b.index == bar)
            .and_then(|b| b.window)
            .ok_or_else(|| ClientError::BadReply(format!("bar {bar} has no fabric window")))?;
        // The window advertisement may trail the borrow reply by a moment.
        let label = format!("lease{}-bar{bar}", self.id);
        self.inner.ep.wait_peer_window(&label, self.inner.timeout)?;
        Ok(self.inner.ep.map_peer_window(id)?)
    }

    /// Maps our exported fabric window `window` (`size` bytes) at `iova` in the device's
    /// IOMMU domain.
    pub fn map_dma(&self, iova: u64, size: u64, window: u32) -> Result<(), ClientError> {
        let r = Request::DmaMap(DmaMap {
            lease: self.id,
            iova,
            size,
            window,
        });
        self.inner.call::<()>(&r, Vec::new()).map(|_| ())
    }

    /// Unmaps a DMA window.
    pub fn unmap_dma(&self, iova: u64, size: u64) -> Result<(), ClientError> {
        let r = Request::DmaUnmap(DmaUnmap {
            lease: self.id,
            iova,
            size,
        });
        self.inner.call::<()>(&r, Vec::new()).map(|_| ())
    }

    /// Sets where the vectors of `kind` go (empty: disable).
    pub fn set_irqs(&self, kind: IrqKind, targets: &[ClientIrq<'_>]) -> Result<(), ClientError> {
        self.set_irqs_resample(kind, targets, None)
    }

    /// As [`Lease::set_irqs`], plus (INTx with a target) the resample eventfd the borrower's
    /// interrupt controller signals after the guest's EOI, so the lender asserts INTx again
    /// while the device's condition is still pending. shm: a duplicate is sent; tcp: a thread
    /// of this client forwards each signal as an event. Ignored (logged) with a version 1
    /// lender, which cannot resample.
    pub fn set_irqs_resample(
        &self,
        kind: IrqKind,
        targets: &[ClientIrq<'_>],
        resample: Option<&EventFd>,
    ) -> Result<(), ClientError> {
        let dup = |e: &EventFd| {
            e.try_clone().map_err(|source| ClientError::Os {
                what: "duplicating an interrupt eventfd",
                source,
            })
        };
        let pass_fds = self.inner.ep.kind() == FabricKind::Shm;
        let mut fds: Vec<OwnedFd> = Vec::new();
        // Sends a duplicate of `e` with the request, as the next fd.
        let pass = |fds: &mut Vec<OwnedFd>, e: &EventFd| {
            let i = u8::try_from(fds.len()).map_err(|_| {
                ClientError::BadReply("more than 255 eventfds in one set_irqs".into())
            })?;
            let dup = dup(e)?;
            // SAFETY: `dup` is a fresh eventfd we own; ownership moves to the OwnedFd.
            fds.push(unsafe { OwnedFd::from_raw_fd(dup.into_raw_fd()) });
            Ok::<_, ClientError>(IrqTarget::Fd(i))
        };
        let mut relayed = Vec::new();
        let mut t = Vec::with_capacity(targets.len());
        let direct_max = if pass_fds { DIRECT_IRQ_FDS } else { 0 };
        for ((vector, x), how) in targets
            .iter()
            .enumerate()
            .zip(eventfd_paths(targets, direct_max))
        {
            t.push(match (x, how) {
                (ClientIrq::None, _) => IrqTarget::None,
                (ClientIrq::Doorbell(b), _) => IrqTarget::Doorbell(*b),
                (ClientIrq::Event, _) => IrqTarget::Event,
                (ClientIrq::EventFd(e), EventFdPath::Relayed) => {
                    relayed.push((vector as u32, dup(e)?));
                    IrqTarget::Event
                }
                (ClientIrq::EventFd(e), EventFdPath::Passed) => pass(&mut fds, e)?,
            });
        }
        // debug, not info: SET_IRQS follows every MSI-X enable and mask change of the
        // guest, which a guest can repeat at will.
        if pass_fds && !relayed.is_empty() {
            log::debug!(
                "lease {}: {} {kind:?} vectors past the {DIRECT_IRQ_FDS} a frame can carry as \
                 eventfds are relayed as events",
                self.id,
                relayed.len()
            );
        }
        let resample = match resample {
            Some(_) if self.inner.version() < 2 => {
                log::debug!(
                    "lease {}: lender speaks protocol version 1, no intx resample",
                    self.id
                );
                None
            }
            Some(_) if kind != IrqKind::Intx || targets.is_empty() => None,
            other => other,
        };
        let mut forwarder = None;
        let resample_target = match resample {
            None => IrqTarget::None,
            Some(e) if pass_fds => pass(&mut fds, e)?,
            Some(e) => {
                forwarder = Some(forward_resamples(
                    Arc::clone(&self.inner.ep),
                    self.id,
                    dup(e)?,
                )?);
                IrqTarget::Event
            }
        };
        if !relayed.is_empty() {
            self.inner.start_pump()?;
        }
        let r = Request::SetIrqs(SetIrqs {
            lease: self.id,
            kind,
            targets: t,
            resample: resample_target,
        });
        // Routes go in before the request so an event sent right after the lender switched
        // cannot miss its eventfd.
        self.inner.forget_routes(self.id, Some(kind));
        {
            let mut routes = lock(&self.inner.routes);
            for (vector, fd) in relayed {
                routes.insert((self.id, kind, vector), fd);
            }
        }
        let r = self.inner.call::<()>(&r, fds).map(|_| ());
        if r.is_err() {
            self.inner.forget_routes(self.id, Some(kind));
        } else if let Some(f) = forwarder {
            lock(&self.inner.resamplers).insert(self.id, f);
        }
        r
    }

    /// The lender's counters of this lease since it was granted (one round trip).
    /// `Ok(None)`: the lender does not report them (protocol version 2 or older, which is
    /// known from the hello without asking, or a lender answering `UNKNOWN_OPCODE`).
    pub fn counters(&self) -> Result<Option<LeaseCounters>, ClientError> {
        if self.inner.version() < 3 {
            return Ok(None);
        }
        let r = Request::LeaseCounters(LeaseRef { lease: self.id });
        match self.inner.call_raw(&r, Vec::new()) {
            Ok((_, payload, _)) => Ok(Some(protocol::decode_lease_counters(
                &payload,
                self.inner.version(),
            )?)),
            Err(e) if e.code() == Some(code::UNKNOWN_OPCODE) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Quiesces (`true`: the device stops fetching doorbells and descriptors) or resumes
    /// (`false`) the device. [`ClientError::Unsupported`] with a lender of protocol version 2
    /// or older (or one answering `UNKNOWN_OPCODE`).
    pub fn quiesce(&self, stop: bool) -> Result<(), ClientError> {
        let unsupported = |version| ClientError::Unsupported {
            lender: self.inner.lender.clone(),
            what: "quiesce",
            version,
            needs: 3,
        };
        let version = self.inner.version();
        if version < 3 {
            return Err(unsupported(version));
        }
        let r = Request::Quiesce(Quiesce {
            lease: self.id,
            stop,
        });
        match self.inner.call::<()>(&r, Vec::new()) {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some(code::UNKNOWN_OPCODE) => Err(unsupported(version)),
            Err(e) => Err(e),
        }
    }

    /// Lender node this lease is held from (its name from the hello).
    pub fn lender(&self) -> &str {
        &self.inner.lender
    }

    /// Peer-to-peer DMA: asks the lender to map BAR `bar` of our lease `target` (a device of
    /// the same lender, borrowed for the same VM over this or another session) at `iova` in
    /// this lease's IOMMU domain. [`ClientError::Unsupported`] with a lender older than
    /// protocol version 5 (or one answering `UNKNOWN_OPCODE`).
    pub fn p2p_map(&self, target: u64, bar: u8, iova: u64) -> Result<(), ClientError> {
        self.p2p_call(Request::P2pMap(P2pMap {
            source: self.id,
            target,
            bar,
            iova,
        }))
    }

    /// Undoes [`Lease::p2p_map`] (succeeds when the lender already revoked the mapping).
    pub fn p2p_unmap(&self, target: u64, bar: u8) -> Result<(), ClientError> {
        self.p2p_call(Request::P2pUnmap(P2pUnmap {
            source: self.id,
            target,
            bar,
        }))
    }

    /// Peer-to-peer DMA across lenders (protocol version 6), target side: lets lender
    /// `grantee` map the peer memory of this lease's BAR `bar`. The grant's id and secret go
    /// to the source's lender in [`Lease::p2p_map_remote`]; [`Lease::p2p_revoke`] ends it.
    pub fn p2p_grant(&self, bar: u8, grantee: &str) -> Result<protocol::P2pGranted, ClientError> {
        self.p2px_check()?;
        let r = Request::P2pGrant(protocol::P2pGrant {
            target: self.id,
            bar,
            grantee: grantee.to_string(),
        });
        Ok(self.inner.call(&r, Vec::new())?.0)
    }

    /// Withdraws grant `grant` of this lease (succeeds when the lender already ended it).
    pub fn p2p_revoke(&self, grant: u64) -> Result<(), ClientError> {
        self.p2px_check()?;
        let r = Request::P2pRevoke(protocol::P2pRevoke {
            target: self.id,
            grant,
        });
        self.inner.call::<()>(&r, Vec::new()).map(|_| ())
    }

    /// Peer-to-peer DMA across lenders, source side: maps BAR `bar` of lease `target` on
    /// lender `lender` (granted to this lease's lender as `granted`) at `iova` in this
    /// lease's IOMMU domain.
    pub fn p2p_map_remote(
        &self,
        lender: &str,
        target: u64,
        bar: u8,
        iova: u64,
        granted: &protocol::P2pGranted,
    ) -> Result<(), ClientError> {
        self.p2px_check()?;
        let r = Request::P2pMapRemote(protocol::P2pMapRemote {
            source: self.id,
            lender: lender.to_string(),
            target,
            bar,
            iova,
            grant: granted.grant,
            secret: granted.secret.clone(),
        });
        self.inner.call::<()>(&r, Vec::new()).map(|_| ())
    }

    /// Undoes [`Lease::p2p_map_remote`] (succeeds when it already ended).
    pub fn p2p_unmap_remote(&self, lender: &str, target: u64, bar: u8) -> Result<(), ClientError> {
        self.p2px_check()?;
        let r = Request::P2pUnmapRemote(protocol::P2pUnmapRemote {
            source: self.id,
            lender: lender.to_string(),
            target,
            bar,
        });
        self.inner.call::<()>(&r, Vec::new()).map(|_| ())
    }

    /// Same-lender P2P with the target's capability (protocol version 6; what a lender
    /// requires on tcp for a target borrowed at version 6): like [`Lease::p2p_map`], with
    /// `granted` from the target lease's [`Lease::p2p_grant`] to this same lender.
    pub fn p2p_map_granted(
        &self,
        target: u64,
        bar: u8,
        iova: u64,
        granted: &protocol::P2pGranted,
    ) -> Result<(), ClientError> {
        self.p2px_check()?;
        let r = Request::P2pMapGranted(protocol::P2pMapGranted {
            source: self.id,
            target,
            bar,
            iova,
            grant: granted.grant,
            secret: granted.secret.clone(),
        });
        self.inner.call::<()>(&r, Vec::new()).map(|_| ())
    }

    fn p2px_check(&self) -> Result<(), ClientError> {
        let version = self.inner.version();
        if version < protocol::P2PX_VERSION {
            return Err(ClientError::Unsupported {
                lender: self.inner.lender.clone(),
                what: "peer-to-peer dma across lenders",
                version,
                needs: protocol::P2PX_VERSION,
            });
        }
        Ok(())
    }

    fn p2p_call(&self, r: Request) -> Result<(), ClientError> {
        let unsupported = |version| ClientError::Unsupported {
            lender: self.inner.lender.clone(),
            what: "peer-to-peer dma",
            version,
            needs: protocol::P2P_VERSION,
        };
        let version = self.inner.version();
        if version < protocol::P2P_VERSION {
            return Err(unsupported(version));
        }
        match self.inner.call::<()>(&r, Vec::new()) {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some(code::UNKNOWN_OPCODE) => Err(unsupported(version)),
            Err(e) => Err(e),
        }
    }

    /// Resets the device (the lease stays; a quiesced device is resumed).
    pub fn reset(&self) -> Result<(), ClientError> {
        self.reset_kicks().map(|_| ())
    }

    /// Resets the device; also returns its kick-only doorbells after the reset (`None`
    /// from a lender older than protocol version 3).
    pub fn reset_kicks(&self) -> Result<Option<protocol::DoorbellKicks>, ClientError> {
        let r = Request::Reset(LeaseRef { lease: self.id });
        let (op, payload, _) = self.inner.call_raw(&r, Vec::new())?;
        Ok(protocol::decode_kicks_reply(
            op,
            &payload,
            self.inner.version(),
        )?)
    }

    /// Returns the device now and reports errors (dropping does it silently).
    pub fn return_device(mut self) -> Result<(), ClientError> {
        self.returned = true;
        self.inner.forget_routes(self.id, None);
        let r = Request::Return(LeaseRef { lease: self.id });
        self.inner.call::<()>(&r, Vec::new()).map(|_| ())
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.returned || self.is_moved() {
            return;
        }
        self.inner.forget_routes(self.id, None);
        let r = Request::Return(LeaseRef { lease: self.id });
        if let Err(e) = self.inner.call::<()>(&r, Vec::new()) {
            log::warn!("returning lease {} to {}: {e}", self.id, self.inner.lender);
        }
    }
}

#[cfg(test)]
mod relay_tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// On shm the first `direct_max` eventfd vectors go as descriptors with SET_IRQS and the
    /// rest are relayed as events; other targets take no descriptor. 252 is what a frame
    /// carries beside the resample eventfd.
    #[test]
    fn eventfd_vectors_past_what_a_frame_carries_are_relayed() {
        assert_eq!(DIRECT_IRQ_FDS, 252);
        let e = EventFd::new(0).unwrap();
        let t = [
            ClientIrq::EventFd(&e),
            ClientIrq::None,
            ClientIrq::EventFd(&e),
            ClientIrq::Doorbell(3),
            ClientIrq::EventFd(&e),
            ClientIrq::EventFd(&e),
        ];
        use EventFdPath::{Passed as P, Relayed as R};
        let paths = eventfd_paths(&t, 2);
        // Vectors 0 and 2 passed (the first two eventfds), 4 and 5 relayed; 1 and 3 take no fd.
        assert_eq!((paths[0], paths[2], paths[4], paths[5]), (P, P, R, R));
        assert!(eventfd_paths(&t, 0)
            .iter()
            .zip(&t)
            .all(|(p, x)| !matches!(x, ClientIrq::EventFd(_)) || *p == R));
        let many: Vec<ClientIrq<'_>> = (0..300).map(|_| ClientIrq::EventFd(&e)).collect();
        let paths = eventfd_paths(&many, DIRECT_IRQ_FDS);
        assert_eq!(paths.iter().filter(|p| **p == P).count(), 252);
        assert!(paths[..252].iter().all(|p| *p == P) && paths[252..].iter().all(|p| *p == R));
    }

    /// The relay saw a DeviceGone and then the goodbye (down is set, both are queued): the
    /// reader gets the DeviceGone first, then the end, and the end again on every later call.
    #[test]
    fn events_queued_before_the_link_went_down_come_first() {
        let (tx, rx) = mpsc::sync_channel(EVENT_QUEUE);
        let p = PumpRx::new(rx);
        let gone = Event::DeviceGone(protocol::DeviceGone {
            lease: 7,
            reason: "lender shutting down".into(),
        });
        tx.send(PumpMsg::Event(gone.clone())).unwrap();
        *lock(&p.down) = Some("peer closed the link".into());
        tx.send(PumpMsg::Down("peer closed the link".into()))
            .unwrap();
        assert_eq!(p.next(None), Ok(Some(gone)));
        assert_eq!(p.next(None), Err("peer closed the link".to_string()));
        assert_eq!(
            p.next(Some(Duration::from_millis(1))),
            Err("peer closed the link".to_string())
        );
        assert_eq!(p.next(None), Err("peer closed the link".to_string()));
    }

    /// The event relay holds at most EVENT_QUEUE undelivered messages: a full queue makes
    /// the relay wait (backpressure on the link) instead of growing, a stop ends the wait,
    /// and a waker's wake-up never blocks.
    #[test]
    fn the_event_relay_queue_is_bounded_and_a_stop_ends_the_wait() {
        let (tx, rx) = mpsc::sync_channel(EVENT_QUEUE);
        let stop = AtomicBool::new(false);
        for _ in 0..EVENT_QUEUE {
            relay(&tx, PumpMsg::Wake, &stop);
        }
        // Full: the next relay waits until the consumer takes one.
        std::thread::scope(|s| {
            let t = s.spawn(|| relay(&tx, PumpMsg::Down("gone".into()), &stop));
            std::thread::sleep(Duration::from_millis(20));
            assert!(!t.is_finished(), "the relay did not wait on a full queue");
            rx.recv().unwrap();
            t.join().unwrap();
        });
        assert!(matches!(
            tx.try_send(PumpMsg::Wake),
            Err(mpsc::TrySendError::Full(_))
        ));
        // A stopped relay gives up instead of waiting forever.
        stop.store(true, Ordering::Release);
        relay(&tx, PumpMsg::Wake, &stop);
        let waker = EventWaker { tx: tx.clone() };
        waker.wake();
        assert_eq!(rx.try_iter().count(), EVENT_QUEUE);
    }
}
