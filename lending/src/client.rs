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
//! queued for [`LenderClient::next_event`]. Callers use the same code on both fabrics.

use std::collections::HashMap;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ntb::{
    ClusterConfig, Endpoint, Fabric, FabricError, FabricKind, Incoming, Message, NodeId,
    PeerWindow, SocketFabric,
};
use serde::de::DeserializeOwned;
use thiserror::Error;
use vmm_sys_util::eventfd::EventFd;

use crate::protocol::{
    self, BarRead, BarWrite, Borrow, Borrowed, ConfigRead, ConfigWrite, DeviceInfo, DeviceSummary,
    DmaMap, DmaUnmap, Event, Hello, HelloReply, IrqKind, IrqTarget, LeaseRef, LenderStatus,
    ProtocolError, Request, SetIrqs, PROTOCOL_VERSION,
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

/// The relay thread of a session whose link cannot carry eventfds: the only reader of the
/// link's incoming queue once started.
struct EventPump {
    stop: Arc<AtomicBool>,
    events: Mutex<mpsc::Receiver<Event>>,
    thread: Option<JoinHandle<()>>,
}

/// How long the relay thread sleeps in one `recv` before it looks at its stop flag.
const PUMP_POLL: Duration = Duration::from_millis(50);

fn pump_loop(
    ep: &Arc<dyn Endpoint>,
    routes: &IrqRoutes,
    stop: &AtomicBool,
    tx: &mpsc::Sender<Event>,
) {
    while !stop.load(Ordering::Acquire) {
        match ep.recv(PUMP_POLL) {
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
                            let _ = tx.send(Event::Irq(ev));
                        }
                    }
                }
                Ok(other) => {
                    let _ = tx.send(other);
                }
                Err(e) => log::warn!("{}: undecodable event: {e}", ep.peer_node()),
            },
            Ok(_) | Err(FabricError::Timeout(_)) => {}
            Err(e) => {
                log::debug!("irq relay from {}: {e}", ep.peer_node());
                return;
            }
        }
    }
}

struct Inner {
    ep: Arc<dyn Endpoint>,
    lender: String,
    timeout: Duration,
    routes: IrqRoutes,
    pump: Mutex<Option<EventPump>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let pump = lock(&self.pump).take();
        if let Some(mut p) = pump {
            p.stop.store(true, Ordering::Release);
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
        let (tx, rx) = mpsc::channel();
        let (ep, routes, stop2) = (
            Arc::clone(&self.ep),
            Arc::clone(&self.routes),
            Arc::clone(&stop),
        );
        let thread = std::thread::Builder::new()
            .name(format!("irq-events-{}", self.lender))
            .spawn(move || pump_loop(&ep, &routes, &stop2, &tx))
            .map_err(|source| ClientError::Os {
                what: "starting the irq event relay thread",
                source,
            })?;
        *g = Some(EventPump {
            stop,
            events: Mutex::new(rx),
            thread: Some(thread),
        });
        Ok(())
    }

    fn forget_routes(&self, lease: u64, kind: Option<IrqKind>) {
        lock(&self.routes).retain(|&(l, k, _), _| l != lease || kind.is_some_and(|x| x != k));
    }

    fn call<T: DeserializeOwned>(
        &self,
        req: &Request,
        fds: Vec<OwnedFd>,
    ) -> Result<(T, Vec<OwnedFd>), ClientError> {
        let (op, payload) = req.encode()?;
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
        let v = protocol::decode_reply(op, &reply.payload)?;
        Ok((v, reply.fds))
    }
}

/// A session with one lender.
pub struct LenderClient {
    inner: Arc<Inner>,
    hello: HelloReply,
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

    /// Says hello over an existing link.
    pub fn from_endpoint(
        ep: Box<dyn Endpoint>,
        token: &str,
        client: &str,
    ) -> Result<Self, ClientError> {
        let ep: Arc<dyn Endpoint> = Arc::from(ep);
        let inner = Arc::new(Inner {
            lender: ep.peer_node().to_string(),
            ep,
            timeout: DEFAULT_TIMEOUT,
            routes: Arc::default(),
            pump: Mutex::new(None),
        });
        let req = Request::Hello(Hello {
            version: PROTOCOL_VERSION,
            token: token.to_string(),
            client: client.to_string(),
        });
        let (hello, _): (HelloReply, _) = inner.call(&req, Vec::new())?;
        Ok(LenderClient { inner, hello })
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
        let req = Request::Borrow(Borrow {
            device: device.to_string(),
            vm: vm.to_string(),
        });
        let (b, mut fds): (Borrowed, _) = self.inner.call(&req, Vec::new())?;
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
        })
    }

    /// Next event from the lender (device gone, fatal error, relayed irq not routed to an
    /// eventfd), if one arrives within `timeout`. Window changes are skipped.
    pub fn next_event(&self, timeout: Duration) -> Result<Option<Event>, ClientError> {
        if let Some(p) = lock(&self.inner.pump).as_ref() {
            return match lock(&p.events).recv_timeout(timeout) {
                Ok(e) => Ok(Some(e)),
                Err(mpsc::RecvTimeoutError::Timeout) => Ok(None),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    Err(ClientError::Fabric(FabricError::PeerGone {
                        peer: self.inner.lender.clone(),
                        reason: "link down".into(),
                    }))
                }
            };
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

/// A borrowed device. Dropping it returns the device.
pub struct Lease {
    inner: Arc<Inner>,
    id: u64,
    info: DeviceInfo,
    notify: Option<EventFd>,
    returned: bool,
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
        Ok(self.inner.call(&r, Vec::new())?.0)
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
        let r = Request::BarWrite(BarWrite {
            lease: self.id,
            bar,
            offset,
            data: data.to_vec(),
        });
        self.inner.call::<()>(&r, Vec::new()).map(|_| ())
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
        let dup = |e: &EventFd| {
            e.try_clone().map_err(|source| ClientError::Os {
                what: "duplicating an interrupt eventfd",
                source,
            })
        };
        let pass_fds = self.inner.ep.kind() == FabricKind::Shm;
        let mut fds = Vec::new();
        let mut relayed = Vec::new();
        let mut t = Vec::with_capacity(targets.len());
        for (vector, x) in targets.iter().enumerate() {
            t.push(match x {
                ClientIrq::None => IrqTarget::None,
                ClientIrq::Doorbell(b) => IrqTarget::Doorbell(*b),
                ClientIrq::Event => IrqTarget::Event,
                ClientIrq::EventFd(e) if !pass_fds => {
                    relayed.push((vector as u32, dup(e)?));
                    IrqTarget::Event
                }
                ClientIrq::EventFd(e) => {
                    let i = u8::try_from(fds.len()).map_err(|_| {
                        ClientError::BadReply("more than 255 eventfds in one set_irqs".into())
                    })?;
                    let dup = dup(e)?;
                    // SAFETY: `dup` is a fresh eventfd we own; ownership moves to the OwnedFd.
                    fds.push(unsafe { OwnedFd::from_raw_fd(dup.into_raw_fd()) });
                    IrqTarget::Fd(i)
                }
            });
        }
        if !relayed.is_empty() {
            self.inner.start_pump()?;
        }
        let r = Request::SetIrqs(SetIrqs {
            lease: self.id,
            kind,
            targets: t,
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
        }
        r
    }

    /// Resets the device (the lease stays).
    pub fn reset(&self) -> Result<(), ClientError> {
        let r = Request::Reset(LeaseRef { lease: self.id });
        self.inner.call::<()>(&r, Vec::new()).map(|_| ())
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
        if self.returned {
            return;
        }
        self.inner.forget_routes(self.id, None);
        let r = Request::Return(LeaseRef { lease: self.id });
        if let Err(e) = self.inner.call::<()>(&r, Vec::new()) {
            log::warn!("returning lease {} to {}: {e}", self.id, self.inner.lender);
        }
    }
}
