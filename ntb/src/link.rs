//! The link core shared by the shm and tcp backends: framing over a stream socket, the
//! handshake ([`crate::accept`] runs it off the accepting thread), request/reply routing,
//! heartbeats and peer-gone detection, window tables, doorbells and scratchpads.
//!
//! Each link runs two threads: a reader (never blocks on writes; it answers fabric-internal
//! requests through the service thread) and a service thread (sends those replies and the
//! heartbeats).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::fabric::{
    BackingId, Endpoint, ExportedWindow, FabricError, FabricKind, Incoming, LinkConfig, LinkStats,
    Message, NodeId, PeerWindow, RequestId, Result, WindowId, WindowInfo, WindowLimits,
};
use crate::mem::{fd_has_fixed_extent, fd_seals, fd_size, Mapping, SharedMemory};
use crate::wire::{
    self, code, msg, op, ErrorReply, Header, FLAG_ERROR, FLAG_REPLY, HEADER_LEN, MAX_FDS, VERSION,
};

/// Bound on one window read/write message round trip.
pub(crate) const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest window label.
pub const MAX_LABEL: usize = 256;
/// Most received messages (requests, events, window notices) waiting for the user.
pub(crate) const MAX_INCOMING: usize = 4096;
/// Most payload bytes of those messages (4096 messages of up to ~1 MiB would be 4 GiB): 32
/// maximal messages. A message is always taken when nothing waits, whatever its size.
pub(crate) const MAX_INCOMING_BYTES: usize = 32 * wire::MAX_PAYLOAD;

/// What a waiting message counts against [`MAX_INCOMING_BYTES`].
fn incoming_bytes(i: &Incoming) -> usize {
    match i {
        Incoming::Request { msg, .. } | Incoming::Event(msg) => msg.payload.len(),
        Incoming::WindowAdded(w) => w.label.len(),
        Incoming::WindowRemoved(_) => 0,
    }
}

/// Lets a log line through at most once per `every`; counts the ones held back. Public so the
/// lender's own peer-triggerable logs (config filter) use the same pattern.
#[derive(Debug)]
pub struct RateLimit {
    every: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl RateLimit {
    pub fn new(every: Duration) -> RateLimit {
        RateLimit {
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(held back since the last line)` when a line may be logged now.
    pub fn hit(&self) -> Option<u64> {
        let now = Instant::now();
        let mut st = lock(&self.state);
        match st.0 {
            Some(t) if now.duration_since(t) < self.every => {
                st.1 += 1;
                None
            }
            _ => {
                st.0 = Some(now);
                Some(std::mem::take(&mut st.1))
            }
        }
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A connected stream socket.
#[derive(Debug)]
pub(crate) enum Stream {
    Unix(UnixStream),
    /// A tcp link's plaintext, through the TLS pump ([`crate::tls`]).
    Tls(UnixStream),
}

impl Stream {
    pub(crate) fn kind(&self) -> FabricKind {
        match self {
            Stream::Unix(_) => FabricKind::Shm,
            Stream::Tls(_) => FabricKind::Tcp,
        }
    }

    /// The peer's address (see [`crate::Endpoint::peer_addr`]).
    pub(crate) fn peer_desc(&self) -> String {
        match self {
            Stream::Tls(_) => String::new(),
            Stream::Unix(s) => match crate::sock::peer_cred(s) {
                Ok(cred) => format!("unix:uid={},pid={}", cred.uid, cred.pid),
                Err(_) => "unix:unknown".into(),
            },
        }
    }

    fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tls(s) => Stream::Tls(s.try_clone()?),
        })
    }

    fn shutdown(&self) {
        let _ = match self {
            Stream::Unix(s) | Stream::Tls(s) => s.shutdown(Shutdown::Both),
        };
    }

    fn set_timeouts(&self, t: Duration) -> io::Result<()> {
        match self {
            Stream::Unix(s) | Stream::Tls(s) => {
                s.set_read_timeout(Some(t))?;
                s.set_write_timeout(Some(t))
            }
        }
    }

    fn write_frame(&self, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
        match self {
            Stream::Unix(s) => {
                let mut off = 0;
                if !fds.is_empty() {
                    off = s
                        .send_with_fds(&[bytes], fds)
                        .map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
                }
                (&*s).write_all(bytes.get(off..).unwrap_or_default())
            }
            Stream::Tls(s) => (&*s).write_all(bytes),
        }
    }

    fn read_some(&self, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
        match self {
            Stream::Tls(s) => (&*s).read(buf),
            Stream::Unix(s) => {
                let mut raw = [-1 as RawFd; MAX_FDS];
                let mut iov = [libc::iovec {
                    iov_base: buf.as_mut_ptr().cast(),
                    iov_len: buf.len(),
                }];
                // SAFETY: the iovec points at `buf`, which we borrow mutably for the call.
                let (n, nfds) = unsafe { s.recv_with_fds(&mut iov, &mut raw) }
                    .map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
                for &fd in raw.iter().take(nfds) {
                    // SAFETY: recvmsg gave us these new fds; we are their only owner.
                    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
                    // SAFETY: fcntl on a valid fd we own.
                    unsafe { libc::fcntl(owned.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
                    fds.push(owned);
                }
                Ok(n)
            }
        }
    }

    fn set_read_timeout(&self, t: Duration) -> io::Result<()> {
        match self {
            Stream::Unix(s) | Stream::Tls(s) => s.set_read_timeout(Some(t)),
        }
    }

    /// Reads all of `buf`; with a `deadline`, the whole read ends by then however slowly the
    /// peer trickles bytes (each read's timeout is the time left).
    fn read_exact(
        &self,
        mut buf: &mut [u8],
        fds: &mut Vec<OwnedFd>,
        deadline: Option<Instant>,
    ) -> io::Result<()> {
        while !buf.is_empty() {
            if let Some(d) = deadline {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::Error::from(io::ErrorKind::TimedOut));
                }
                self.set_read_timeout(left)?;
            }
            match self.read_some(buf, fds) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
                Ok(n) => buf = &mut buf[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Why reading a frame failed.
enum ReadError {
    Closed,
    TimedOut,
    Io(io::Error),
    Protocol(String),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Closed => write!(f, "connection closed"),
            ReadError::TimedOut => write!(f, "no heartbeat within the peer timeout"),
            ReadError::Io(e) => write!(f, "receive failed: {e}"),
            ReadError::Protocol(m) => write!(f, "protocol error: {m}"),
        }
    }
}

fn read_frame(s: &Stream) -> std::result::Result<(Header, Vec<u8>, Vec<OwnedFd>), ReadError> {
    read_frame_until(s, None)
}

/// [`read_frame`] that fails once `deadline` passes (the handshake's bound).
fn read_frame_until(
    s: &Stream,
    deadline: Option<Instant>,
) -> std::result::Result<(Header, Vec<u8>, Vec<OwnedFd>), ReadError> {
    let conv = |e: io::Error| match e.kind() {
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => ReadError::Closed,
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ReadError::TimedOut,
        _ => ReadError::Io(e),
    };
    let mut fds = Vec::new();
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb, &mut fds, deadline).map_err(conv)?;
    let h = Header::decode(&hb).map_err(|e| ReadError::Protocol(e.to_string()))?;
    let mut payload = vec![0u8; h.len as usize];
    s.read_exact(&mut payload, &mut fds, deadline)
        .map_err(conv)?;
    if fds.len() != h.fds as usize {
        return Err(ReadError::Protocol(format!(
            "frame announces {} fds but {} arrived",
            h.fds,
            fds.len()
        )));
    }
    Ok((h, payload, fds))
}

fn send_raw(
    s: &Stream,
    flags: u8,
    opcode: u16,
    id: u64,
    payload: &[u8],
    fds: &[RawFd],
) -> Result<()> {
    let bytes = wire::encode_frame(flags, opcode, id, payload, fds.len())?;
    s.write_frame(&bytes, fds)
        .map_err(FabricError::io("send frame"))
}

struct PeerWin {
    info: WindowInfo,
    fd: Option<Arc<OwnedFd>>,
    fd_offset: u64,
}

#[derive(Default)]
struct State {
    pending: HashMap<u64, mpsc::Sender<Result<Message>>>,
    incoming: VecDeque<Incoming>,
    /// Payload bytes of `incoming` (bounded by [`MAX_INCOMING_BYTES`]).
    incoming_bytes: usize,
    /// Local exports; on tcp with the mapping that serves the peer's accesses.
    exported: HashMap<WindowId, Option<Arc<Mapping>>>,
    next_window: WindowId,
    peer_windows: BTreeMap<WindowId, PeerWin>,
    live: Vec<(WindowId, Weak<Mapping>)>,
    gone_reason: Option<String>,
}

enum Svc {
    Frame {
        flags: u8,
        opcode: u16,
        id: u64,
        payload: Vec<u8>,
    },
}

#[derive(Default)]
struct Counters {
    frames_sent: AtomicU64,
    frames_received: AtomicU64,
    heartbeats_sent: AtomicU64,
    heartbeats_received: AtomicU64,
    window_io_frames: AtomicU64,
}

pub(crate) struct Inner {
    kind: FabricKind,
    local: NodeId,
    peer: NodeId,
    peer_addr: String,
    /// The TLS channel binding (empty on shm).
    binding: Vec<u8>,
    cfg: LinkConfig,
    peer_hello: msg::Hello,
    writer: Mutex<Stream>,
    ctl: Stream,
    state: Mutex<State>,
    cond: Condvar,
    gone: AtomicBool,
    gone_evt: EventFd,
    next_id: AtomicU64,
    doorbells: Vec<EventFd>,
    peer_doorbells: Vec<EventFd>,
    spads: SharedMemory,
    peer_spads: Option<Mapping>,
    stats: Counters,
    svc_tx: Mutex<Option<mpsc::Sender<Svc>>>,
    /// Rate limit of the warnings about a misbehaving peer.
    abuse_log: RateLimit,
}

fn spad_bytes(n: u32) -> u64 {
    (u64::from(n) * 4).div_ceil(4096) * 4096
}

fn atomic_at(base: *mut u8, index: u32) -> *const AtomicU32 {
    base.wrapping_add(index as usize * 4).cast::<AtomicU32>()
}

impl Inner {
    fn is_gone(&self) -> bool {
        self.gone.load(Ordering::Acquire)
    }

    pub(crate) fn gone_err(&self) -> FabricError {
        let reason = lock(&self.state)
            .gone_reason
            .clone()
            .unwrap_or_else(|| "link down".into());
        FabricError::PeerGone {
            peer: self.peer.to_string(),
            reason,
        }
    }

    fn check_up(&self) -> Result<()> {
        if self.is_gone() {
            Err(self.gone_err())
        } else {
            Ok(())
        }
    }

    /// Waits on the state condvar until `ready` yields a value; fails when the link goes down
    /// first (unless `ready` answers that too) or `timeout` passes.
    fn wait_for<R>(
        &self,
        timeout: Duration,
        mut ready: impl FnMut(&mut State) -> Option<R>,
    ) -> Result<R> {
        let deadline = Instant::now() + timeout;
        let mut st = lock(&self.state);
        loop {
            if let Some(r) = ready(&mut st) {
                return Ok(r);
            }
            if self.is_gone() {
                drop(st);
                return Err(self.gone_err());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(FabricError::Timeout(timeout));
            }
            st = self
                .cond
                .wait_timeout(st, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    fn mark_gone(&self, reason: &str) {
        if self.gone.swap(true, Ordering::AcqRel) {
            return;
        }
        log::info!("ntb link {} -> {} down: {reason}", self.local, self.peer);
        let live = {
            let mut st = lock(&self.state);
            st.gone_reason = Some(reason.to_string());
            st.pending.clear();
            st.exported.clear();
            st.peer_windows.clear();
            std::mem::take(&mut st.live)
        };
        for (_, w) in live {
            if let Some(m) = w.upgrade() {
                m.sever();
            }
        }
        let _ = self.gone_evt.write(1);
        self.cond.notify_all();
        self.ctl.shutdown();
        lock(&self.svc_tx).take();
    }

    fn send_frame(
        &self,
        flags: u8,
        opcode: u16,
        id: u64,
        payload: &[u8],
        fds: &[RawFd],
    ) -> Result<()> {
        self.check_up()?;
        let bytes = wire::encode_frame(flags, opcode, id, payload, fds.len())?;
        let res = lock(&self.writer).write_frame(&bytes, fds);
        if let Err(e) = res {
            self.mark_gone(&format!("send failed: {e}"));
            return Err(self.gone_err());
        }
        let c = &self.stats;
        if opcode == op::HEARTBEAT && flags == 0 {
            c.heartbeats_sent.fetch_add(1, Ordering::Relaxed);
        } else {
            c.frames_sent.fetch_add(1, Ordering::Relaxed);
            if matches!(opcode, op::WINDOW_READ | op::WINDOW_WRITE) && flags == 0 {
                c.window_io_frames.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    pub(crate) fn start_request(
        &self,
        opcode: u16,
        payload: &[u8],
        fds: &[RawFd],
    ) -> Result<(u64, mpsc::Receiver<Result<Message>>)> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        {
            let mut st = lock(&self.state);
            if self.is_gone() {
                drop(st);
                return Err(self.gone_err());
            }
            st.pending.insert(id, tx);
        }
        if let Err(e) = self.send_frame(0, opcode, id, payload, fds) {
            lock(&self.state).pending.remove(&id);
            return Err(e);
        }
        Ok((id, rx))
    }

    pub(crate) fn wait_reply(
        &self,
        id: u64,
        rx: &mpsc::Receiver<Result<Message>>,
        timeout: Duration,
    ) -> Result<Message> {
        match rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                lock(&self.state).pending.remove(&id);
                Err(FabricError::Timeout(timeout))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(self.gone_err()),
        }
    }

    fn queue_reply(&self, id: u64, opcode: u16, r: std::result::Result<Vec<u8>, ErrorReply>) {
        let (flags, payload) = match r {
            Ok(p) => (FLAG_REPLY, p),
            Err(e) => (
                FLAG_REPLY | FLAG_ERROR,
                wire::encode_payload(&e).unwrap_or_default(),
            ),
        };
        if let Some(tx) = lock(&self.svc_tx).as_ref() {
            let _ = tx.send(Svc::Frame {
                flags,
                opcode,
                id,
                payload,
            });
        }
    }

    /// Queues a message for the user; refuses (false) when [`MAX_INCOMING`] wait already, so
    /// a peer that sends faster than the user reads cannot grow memory or hold fds without
    /// bound.
    fn push_incoming(&self, i: Incoming) -> bool {
        {
            let mut st = lock(&self.state);
            let bytes = incoming_bytes(&i);
            let full = st.incoming.len() >= MAX_INCOMING
                || (!st.incoming.is_empty() && st.incoming_bytes + bytes > MAX_INCOMING_BYTES);
            if full {
                let (n_msgs, n_bytes) = (st.incoming.len(), st.incoming_bytes);
                drop(st);
                if let Some(n) = self.abuse_log.hit() {
                    log::warn!(
                        "peer {}: {n_msgs} messages ({n_bytes} bytes) already wait to be read \
                         (bounds {MAX_INCOMING} messages, {MAX_INCOMING_BYTES} bytes), dropping \
                         more ({n} more dropped or refused since the last report)",
                        self.peer
                    );
                }
                return false;
            }
            st.incoming_bytes += bytes;
            st.incoming.push_back(i);
        }
        self.cond.notify_all();
        true
    }

    fn serve_mapping(&self, id: WindowId) -> std::result::Result<Arc<Mapping>, ErrorReply> {
        match lock(&self.state).exported.get(&id) {
            Some(Some(m)) => Ok(m.clone()),
            Some(None) => Err(ErrorReply::new(
                code::UNSUPPORTED,
                format!("window {id} is directly mapped on this link"),
            )),
            None => Err(ErrorReply::new(
                code::UNKNOWN_WINDOW,
                format!("no window {id}"),
            )),
        }
    }

    fn window_read(&self, p: &[u8]) -> std::result::Result<Vec<u8>, ErrorReply> {
        let r: msg::WindowRead =
            wire::decode_payload(p).map_err(|e| ErrorReply::new(code::INVALID, e.to_string()))?;
        let m = self.serve_mapping(r.id)?;
        // Check before allocating: the peer chooses `len` (up to 4 GiB).
        if r.len as usize > wire::MAX_DATA_CHUNK {
            return Err(ErrorReply::new(
                code::OUT_OF_RANGE,
                format!(
                    "read of {} bytes exceeds the largest transfer of {} bytes",
                    r.len,
                    wire::MAX_DATA_CHUNK
                ),
            ));
        }
        crate::mem::check_range(r.offset, u64::from(r.len), m.len() as u64)
            .map_err(|e| ErrorReply::new(code::OUT_OF_RANGE, e.to_string()))?;
        let mut out = vec![0u8; r.len as usize];
        m.read_at(r.offset, &mut out)
            .map_err(|e| ErrorReply::new(code::OUT_OF_RANGE, e.to_string()))?;
        Ok(out)
    }

    fn window_write(&self, p: &[u8]) -> std::result::Result<Vec<u8>, ErrorReply> {
        let (w, data): (msg::WindowWrite, &[u8]) =
            wire::decode_prefix(p).map_err(|e| ErrorReply::new(code::INVALID, e.to_string()))?;
        let m = self.serve_mapping(w.id)?;
        m.write_at(w.offset, data)
            .map_err(|e| ErrorReply::new(code::OUT_OF_RANGE, e.to_string()))?;
        Ok(Vec::new())
    }

    /// Whether the peer may add window `a`: within the limits it announced at the handshake
    /// (at most `max_windows` at once, aligned, not oversized), with exactly one fd on shm.
    /// A shm window without an fd is a mediated one (`export_window_mediated`): read and
    /// written through the exporter, as on tcp.
    fn check_window_add(&self, a: &msg::WindowAdd) -> std::result::Result<(), String> {
        if a.label.len() > MAX_LABEL {
            return Err(format!(
                "label of {} bytes exceeds {MAX_LABEL}",
                a.label.len()
            ));
        }
        let limits = self.peer_hello.limits;
        limits
            .check_window(a.fd_offset, a.size)
            .map_err(|e| e.to_string())?;
        let st = lock(&self.state);
        if !st.peer_windows.contains_key(&a.id)
            && st.peer_windows.len() >= limits.max_windows as usize
        {
            return Err(format!(
                "the peer already has {} windows, its announced maximum",
                limits.max_windows
            ));
        }
        Ok(())
    }

    fn spad_ptr(&self, index: u32) -> Result<*const AtomicU32> {
        if index >= self.cfg.scratchpads {
            return Err(FabricError::BadScratchpad {
                index,
                count: self.cfg.scratchpads,
            });
        }
        Ok(atomic_at(self.spads.as_ptr(), index))
    }

    /// Checks `index` against the peer's scratchpads and that the link is up: the peer's
    /// scratchpad when its page is mapped here (shm), `None` when messages reach it (tcp).
    fn peer_spad(&self, index: u32) -> Result<Option<&AtomicU32>> {
        let count = self.peer_hello.scratchpads;
        if index >= count {
            return Err(FabricError::BadScratchpad { index, count });
        }
        self.check_up()?;
        Ok(self.peer_spads.as_ref().map(|m| {
            // SAFETY: index < peer count; the mapping covers spad_bytes(count) and lives as
            // long as self.
            unsafe { &*atomic_at(m.as_ptr(), index) }
        }))
    }

    fn set_local_spad(&self, index: u32, value: u32) -> Result<()> {
        let p = self.spad_ptr(index)?;
        // SAFETY: index < count, inside our page-aligned spad mapping which lives as long as self.
        unsafe { (*p).store(value, Ordering::SeqCst) };
        Ok(())
    }

    fn get_local_spad(&self, index: u32) -> Result<u32> {
        let p = self.spad_ptr(index)?;
        // SAFETY: as in set_local_spad.
        Ok(unsafe { (*p).load(Ordering::SeqCst) })
    }

    /// Handles one frame; returns false when the link must stop.
    fn dispatch(&self, h: Header, payload: Vec<u8>, fds: Vec<OwnedFd>) -> bool {
        let c = &self.stats;
        if h.opcode == op::HEARTBEAT && !h.is_reply() {
            c.heartbeats_received.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        c.frames_received.fetch_add(1, Ordering::Relaxed);
        if h.is_reply() {
            let tx = lock(&self.state).pending.remove(&h.id);
            let Some(tx) = tx else {
                log::debug!("reply to unknown or expired request {}", h.id);
                return true;
            };
            let r = if h.is_error() {
                Err(FabricError::Remote(
                    wire::decode_payload::<ErrorReply>(&payload).unwrap_or_else(|e| {
                        ErrorReply::new(code::INTERNAL, format!("undecodable error reply: {e}"))
                    }),
                ))
            } else {
                Ok(Message {
                    opcode: h.opcode,
                    payload,
                    fds,
                })
            };
            let _ = tx.send(r);
            return true;
        }
        if h.opcode >= wire::USER_OPCODE_BASE {
            let m = Message {
                opcode: h.opcode,
                payload,
                fds,
            };
            let id = h.id;
            let queued = self.push_incoming(if id != 0 {
                Incoming::Request {
                    id: RequestId(id),
                    msg: m,
                }
            } else {
                Incoming::Event(m)
            });
            if !queued && id != 0 {
                self.queue_reply(
                    id,
                    h.opcode,
                    Err(ErrorReply::new(
                        code::BUSY,
                        format!(
                            "the link's queue is full ({MAX_INCOMING} requests or \
                             {MAX_INCOMING_BYTES} bytes wait)"
                        ),
                    )),
                );
            }
            return true;
        }
        match h.opcode {
            op::GOODBYE => {
                self.mark_gone("peer closed the link");
                return false;
            }
            op::WINDOW_ADD => match wire::decode_payload::<msg::WindowAdd>(&payload) {
                Ok(a) => {
                    // Any fd beyond the window's one is closed here (dropped with `fds`).
                    let mut fds = fds;
                    let fd = if self.kind == FabricKind::Shm && fds.len() == 1 {
                        fds.pop().map(Arc::new)
                    } else {
                        None
                    };
                    if let Err(why) = self.check_window_add(&a) {
                        if let Some(n) = self.abuse_log.hit() {
                            log::warn!(
                                "peer {}: refusing window {} ({:?}): {why} ({n} more refused \
                                 since the last report)",
                                self.peer,
                                a.id,
                                a.label
                            );
                        }
                        return true;
                    }
                    let info = WindowInfo {
                        id: a.id,
                        size: a.size,
                        label: a.label,
                    };
                    {
                        let mut st = lock(&self.state);
                        // The count was checked above; this thread is the only inserter.
                        st.peer_windows.insert(
                            a.id,
                            PeerWin {
                                info: info.clone(),
                                fd,
                                fd_offset: a.fd_offset,
                            },
                        );
                    }
                    self.push_incoming(Incoming::WindowAdded(info));
                }
                Err(e) => log::warn!("bad window add from {}: {e}", self.peer),
            },
            op::WINDOW_REMOVE => match wire::decode_payload::<msg::WindowRemove>(&payload) {
                Ok(r) => {
                    let severed: Vec<_> = {
                        let mut st = lock(&self.state);
                        st.peer_windows.remove(&r.id);
                        let (hit, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut st.live)
                            .into_iter()
                            .partition(|(id, _)| *id == r.id);
                        st.live = keep;
                        hit
                    };
                    for (_, w) in severed {
                        if let Some(m) = w.upgrade() {
                            m.sever();
                        }
                    }
                    self.push_incoming(Incoming::WindowRemoved(r.id));
                }
                Err(e) => log::warn!("bad window remove from {}: {e}", self.peer),
            },
            op::WINDOW_READ if h.id != 0 => {
                let r = self.window_read(&payload);
                self.queue_reply(h.id, h.opcode, r);
            }
            op::WINDOW_WRITE if h.id != 0 => {
                let r = self.window_write(&payload);
                self.queue_reply(h.id, h.opcode, r);
            }
            op::DOORBELL => match wire::decode_payload::<msg::Doorbell>(&payload) {
                Ok(d) => {
                    for (bit, e) in self.doorbells.iter().enumerate() {
                        if d.bits & (1u64 << bit) != 0 {
                            let _ = e.write(1);
                        }
                    }
                }
                Err(e) => log::warn!("bad doorbell from {}: {e}", self.peer),
            },
            op::SPAD_WRITE => match wire::decode_payload::<msg::SpadWrite>(&payload) {
                Ok(w) => {
                    if let Err(e) = self.set_local_spad(w.index, w.value) {
                        log::warn!("peer {} wrote a bad scratchpad: {e}", self.peer);
                    }
                }
                Err(e) => log::warn!("bad scratchpad write from {}: {e}", self.peer),
            },
            op::SPAD_READ if h.id != 0 => {
                let r = wire::decode_payload::<msg::SpadRead>(&payload)
                    .map_err(|e| ErrorReply::new(code::INVALID, e.to_string()))
                    .and_then(|r| {
                        self.get_local_spad(r.index)
                            .map_err(|e| ErrorReply::new(code::OUT_OF_RANGE, e.to_string()))
                    })
                    .and_then(|v| {
                        wire::encode_payload(&v)
                            .map_err(|e| ErrorReply::new(code::INTERNAL, e.to_string()))
                    });
                self.queue_reply(h.id, h.opcode, r);
            }
            other => {
                if h.id != 0 {
                    self.queue_reply(
                        h.id,
                        other,
                        Err(ErrorReply::new(
                            code::UNKNOWN_OPCODE,
                            format!("unknown fabric opcode {other:#x}"),
                        )),
                    );
                } else {
                    log::warn!(
                        "ignoring unknown fabric opcode {other:#x} from {}",
                        self.peer
                    );
                }
            }
        }
        true
    }
}

fn reader_loop(inner: Arc<Inner>, stream: Stream) {
    loop {
        match read_frame(&stream) {
            Ok((h, p, fds)) => {
                if !inner.dispatch(h, p, fds) {
                    break;
                }
            }
            Err(e) => {
                inner.mark_gone(&e.to_string());
                break;
            }
        }
    }
}

fn service_loop(inner: Arc<Inner>, rx: mpsc::Receiver<Svc>) {
    let hb = inner.cfg.heartbeat;
    let mut next_hb = Instant::now();
    loop {
        let now = Instant::now();
        if now >= next_hb {
            if inner.send_frame(0, op::HEARTBEAT, 0, &[], &[]).is_err() {
                break;
            }
            next_hb = now + hb;
        }
        match rx.recv_timeout(next_hb.saturating_duration_since(Instant::now())) {
            Ok(Svc::Frame {
                flags,
                opcode,
                id,
                payload,
            }) => {
                if inner.send_frame(flags, opcode, id, &payload, &[]).is_err() {
                    break;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
}

pub(crate) fn new_eventfd() -> Result<EventFd> {
    EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).map_err(FabricError::io("eventfd"))
}

fn check_hello(
    h: &msg::Hello,
    kind: FabricKind,
    nfds: usize,
    cfg: &LinkConfig,
) -> std::result::Result<NodeId, String> {
    if h.version != VERSION {
        return Err(format!(
            "peer speaks version {}, this node {VERSION}",
            h.version
        ));
    }
    if h.kind != kind {
        return Err(format!("peer expects a {} link, this is {kind}", h.kind));
    }
    let node = NodeId::new(&h.node).map_err(|e| e.to_string())?;
    let peer_cfg = LinkConfig {
        limits: h.limits,
        doorbells: h.doorbells,
        scratchpads: h.scratchpads,
        heartbeat: Duration::from_millis(u64::from(h.heartbeat_ms)),
        peer_timeout: Duration::from_millis(u64::from(h.heartbeat_ms) * 2 + 1),
        connect_timeout: cfg.connect_timeout,
        require_sealed_windows: cfg.require_sealed_windows,
    };
    peer_cfg.validate().map_err(|e| e.to_string())?;
    if peer_cfg.heartbeat * 2 >= cfg.peer_timeout {
        return Err(format!(
            "peer heartbeat {:?} is too slow for this node's peer timeout {:?}",
            peer_cfg.heartbeat, cfg.peer_timeout
        ));
    }
    let want = match kind {
        FabricKind::Shm => h.doorbells as usize + 1,
        FabricKind::Tcp => 0,
    };
    if nfds != want {
        return Err(format!("hello carries {nfds} fds, expected {want}"));
    }
    Ok(node)
}

/// Checks that a peer's memory fd cannot shrink under a mapping of it: a memfd must carry
/// `F_SEAL_SHRINK`; fds that cannot be sealed pass only if their extent is fixed (sysfs BAR
/// resource files, character devices). Otherwise the mapping is refused when
/// [`LinkConfig::require_sealed_windows`] is set, and logged as a warning when not.
pub(crate) fn check_sealed(
    fd: BorrowedFd<'_>,
    cfg: &LinkConfig,
    peer: &NodeId,
    what: &str,
) -> Result<()> {
    let problem = match fd_seals(fd)? {
        Some(s) if s & libc::F_SEAL_SHRINK != 0 => return Ok(()),
        Some(s) => format!("a memfd without F_SEAL_SHRINK (seals {s:#x})"),
        None if fd_has_fixed_extent(fd)? => return Ok(()),
        None => "a file that cannot be sealed and can be truncated".to_string(),
    };
    if cfg.require_sealed_windows {
        return Err(FabricError::UnsealedWindow {
            what: what.to_string(),
            peer: peer.to_string(),
            problem,
        });
    }
    log::warn!(
        "mapping {what} from {peer}, {problem}: if the exporter shrinks it, accesses raise \
         SIGBUS here (set require_sealed_windows to refuse such windows)"
    );
    Ok(())
}

/// What the caller knows about a connection beyond its stream.
#[derive(Default)]
pub(crate) struct LinkOpts {
    /// Names the peer when the caller knows better than the socket (a Unix socket's peer
    /// name is where it was bound, not the path it was connected by; a TLS link's plaintext
    /// end has no peer).
    pub(crate) peer_addr: Option<String>,
    /// The TLS session's channel binding (tcp).
    pub(crate) binding: Vec<u8>,
    /// The TLS pump thread (tcp), joined with the link's threads.
    pub(crate) pump: Option<JoinHandle<()>>,
    /// When the handshake must be done (default: `connect_timeout` from now).
    pub(crate) deadline: Option<Instant>,
}

impl LinkOpts {
    /// A tcp connection: runs the TLS handshake by `deadline` and returns the plaintext
    /// stream with its options.
    pub(crate) fn tls(
        tcp: TcpStream,
        initiator: bool,
        deadline: Instant,
    ) -> Result<(Stream, LinkOpts)> {
        let peer_addr = tcp.peer_addr().map(|a| a.to_string()).ok();
        let t = crate::tls::wrap(tcp, initiator, deadline)?;
        Ok((
            Stream::Tls(t.plain),
            LinkOpts {
                peer_addr,
                binding: t.binding,
                pump: Some(t.pump),
                deadline: Some(deadline),
            },
        ))
    }
}

/// Runs the handshake on a connected stream and starts the link.
pub(crate) fn establish(
    stream: Stream,
    local: &NodeId,
    cfg: &LinkConfig,
    initiator: bool,
    opts: LinkOpts,
) -> Result<LinkEndpoint> {
    cfg.validate()?;
    let kind = stream.kind();
    let doorbells = (0..cfg.doorbells)
        .map(|_| new_eventfd())
        .collect::<Result<Vec<_>>>()?;
    let spads = SharedMemory::new("ntb-spad", spad_bytes(cfg.scratchpads))?;
    let hello = msg::Hello {
        version: VERSION,
        node: local.to_string(),
        kind,
        limits: cfg.limits,
        doorbells: cfg.doorbells,
        scratchpads: cfg.scratchpads,
        heartbeat_ms: u32::try_from(cfg.heartbeat.as_millis()).unwrap_or(u32::MAX),
    };
    let hello_bytes = wire::encode_payload(&hello)?;
    let my_fds: Vec<RawFd> = match kind {
        FabricKind::Shm => doorbells
            .iter()
            .map(|e| e.as_raw_fd())
            .chain(std::iter::once(spads.fd().as_raw_fd()))
            .collect(),
        FabricKind::Tcp => Vec::new(),
    };
    stream
        .set_timeouts(cfg.connect_timeout)
        .map_err(FabricError::io("set socket timeouts"))?;
    // The whole handshake ends within connect_timeout, however slowly the peer sends.
    let deadline = opts
        .deadline
        .unwrap_or_else(|| Instant::now() + cfg.connect_timeout);
    let hs_err = |m: String| FabricError::Handshake(m);
    let read = |what: &str| {
        read_frame_until(&stream, Some(deadline))
            .map_err(|e| hs_err(format!("waiting for {what}: {e}")))
    };
    let (peer_hello, peer_fds) = if initiator {
        send_raw(&stream, 0, op::HELLO, 1, &hello_bytes, &my_fds)?;
        let (h, p, fds) = read("the hello reply")?;
        if h.opcode != op::HELLO || !h.is_reply() || h.id != 1 {
            return Err(hs_err(format!(
                "unexpected frame opcode {:#x} in handshake",
                h.opcode
            )));
        }
        if h.is_error() {
            let e: ErrorReply = wire::decode_payload(&p)?;
            return Err(hs_err(format!("peer refused: {}", e.message)));
        }
        let ph: msg::Hello = wire::decode_payload(&p)?;
        (ph, fds)
    } else {
        let (h, p, fds) = read("the hello")?;
        if h.opcode != op::HELLO || h.is_reply() {
            return Err(hs_err(format!(
                "expected hello, got opcode {:#x}",
                h.opcode
            )));
        }
        // Tells the peer why its hello is refused (best effort: we fail either way).
        let refuse = |code: u32, message: String| -> Result<()> {
            let r = wire::encode_payload(&ErrorReply::new(code, message))?;
            let _ = send_raw(&stream, FLAG_REPLY | FLAG_ERROR, op::HELLO, h.id, &r, &[]);
            Ok(())
        };
        let ph: msg::Hello = match wire::decode_payload(&p) {
            Ok(v) => v,
            Err(e) => {
                refuse(code::INVALID, e.to_string())?;
                return Err(e.into());
            }
        };
        if let Err(m) = check_hello(&ph, kind, fds.len(), cfg) {
            refuse(code::VERSION, m.clone())?;
            return Err(hs_err(m));
        }
        send_raw(&stream, FLAG_REPLY, op::HELLO, h.id, &hello_bytes, &my_fds)?;
        (ph, fds)
    };
    let peer = check_hello(&peer_hello, kind, peer_fds.len(), cfg).map_err(hs_err)?;
    let (peer_doorbells, peer_spads) = match kind {
        FabricKind::Shm => {
            let mut fds = peer_fds;
            let spad_fd = fds.pop().ok_or_else(|| hs_err("no scratchpad fd".into()))?;
            let spad_len = spad_bytes(peer_hello.scratchpads);
            check_sealed(spad_fd.as_fd(), cfg, &peer, "scratchpad memfd")?;
            let have = fd_size(spad_fd.as_fd())?;
            if have < spad_len {
                return Err(hs_err(format!(
                    "peer scratchpad memfd is {have:#x} bytes, need {spad_len:#x}"
                )));
            }
            let map = Mapping::map_shared(spad_fd.as_fd(), 0, spad_len)?;
            let dbs = fds
                .into_iter()
                .map(|fd| {
                    // SAFETY: the fd came to us over SCM_RIGHTS; we own it and hand it to EventFd.
                    unsafe { EventFd::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(fd)) }
                })
                .collect();
            (dbs, Some(map))
        }
        FabricKind::Tcp => (Vec::new(), None),
    };
    stream
        .set_timeouts(cfg.peer_timeout)
        .map_err(FabricError::io("set socket timeouts"))?;
    let reader_stream = stream
        .try_clone()
        .map_err(FabricError::io("clone socket"))?;
    let ctl = stream
        .try_clone()
        .map_err(FabricError::io("clone socket"))?;
    let (svc_tx, svc_rx) = mpsc::channel();
    let inner = Arc::new(Inner {
        kind,
        local: local.clone(),
        peer: peer.clone(),
        peer_addr: opts.peer_addr.unwrap_or_else(|| stream.peer_desc()),
        binding: opts.binding,
        cfg: cfg.clone(),
        peer_hello,
        writer: Mutex::new(stream),
        ctl,
        state: Mutex::new(State {
            next_window: 1,
            ..State::default()
        }),
        cond: Condvar::new(),
        gone: AtomicBool::new(false),
        gone_evt: new_eventfd()?,
        next_id: AtomicU64::new(2),
        doorbells,
        peer_doorbells,
        spads,
        peer_spads,
        stats: Counters::default(),
        svc_tx: Mutex::new(Some(svc_tx)),
        abuse_log: RateLimit::new(Duration::from_secs(1)),
    });
    let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
        std::thread::Builder::new()
            .name(name)
            .spawn(f)
            .map_err(FabricError::io("spawn link thread"))
    };
    let i1 = inner.clone();
    let t1 = spawn(
        format!("ntb-rx-{peer}"),
        Box::new(move || reader_loop(i1, reader_stream)),
    )?;
    let i2 = inner.clone();
    let t2 = spawn(
        format!("ntb-svc-{peer}"),
        Box::new(move || service_loop(i2, svc_rx)),
    )?;
    log::info!("ntb {kind} link {local} <-> {peer} up");
    let mut threads = vec![t1, t2];
    threads.extend(opts.pump);
    Ok(LinkEndpoint {
        inner,
        threads: Mutex::new(threads),
    })
}

/// The endpoint of both socket backends.
pub(crate) struct LinkEndpoint {
    inner: Arc<Inner>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for LinkEndpoint {
    fn drop(&mut self) {
        self.close();
        for t in lock(&self.threads).drain(..) {
            let _ = t.join();
        }
    }
}

/// A peer window mapped with `mmap` (shm).
struct DirectWindow {
    inner: Arc<Inner>,
    info: WindowInfo,
    map: Arc<Mapping>,
    /// The exporter's file and range, taken when it was mapped.
    backing: BackingId,
}

impl DirectWindow {
    fn check(&self) -> Result<()> {
        if self.map.is_severed() {
            if self.inner.is_gone() {
                return Err(self.inner.gone_err());
            }
            return Err(FabricError::WindowRevoked(self.info.id));
        }
        Ok(())
    }
}

impl PeerWindow for DirectWindow {
    fn info(&self) -> &WindowInfo {
        &self.info
    }
    fn as_ptr(&self) -> Result<*mut u8> {
        self.check()?;
        Ok(self.map.as_ptr())
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check()?;
        Ok(self.map.read_at(offset, buf)?)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check()?;
        Ok(self.map.write_at(offset, data)?)
    }
    fn is_live(&self) -> bool {
        !self.map.is_severed()
    }
    fn backing_id(&self) -> Option<BackingId> {
        Some(self.backing)
    }
}

/// A peer window reached by messages (tcp).
struct MessageWindow {
    inner: Arc<Inner>,
    info: WindowInfo,
}

type ReplyRx = mpsc::Receiver<Result<Message>>;

/// Requests kept in flight by batched window transfers.
const PIPELINE: usize = 4;

impl MessageWindow {
    fn check(&self, offset: u64, len: usize) -> Result<()> {
        self.inner.check_up()?;
        if !lock(&self.inner.state)
            .peer_windows
            .contains_key(&self.info.id)
        {
            return Err(FabricError::WindowRevoked(self.info.id));
        }
        crate::mem::check_range(offset, len as u64, self.info.size).map_err(|_| {
            FabricError::OutOfRange {
                offset,
                len: len as u64,
                size: self.info.size,
            }
        })
    }

    fn finish(&self, id: u64, rx: &mpsc::Receiver<Result<Message>>) -> Result<Message> {
        self.inner
            .wait_reply(id, rx, IO_TIMEOUT)
            .map_err(|e| match e {
                FabricError::Remote(r) if r.code == code::UNKNOWN_WINDOW => {
                    FabricError::WindowRevoked(self.info.id)
                }
                e => e,
            })
    }
}

impl PeerWindow for MessageWindow {
    fn info(&self) -> &WindowInfo {
        &self.info
    }
    fn as_ptr(&self) -> Result<*mut u8> {
        Err(FabricError::DirectMappingUnsupported {
            kind: self.inner.kind,
        })
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check(offset, buf.len())?;
        let mut inflight: VecDeque<(u64, ReplyRx, &mut [u8])> = VecDeque::new();
        let mut off = offset;
        for chunk in buf.chunks_mut(wire::MAX_DATA_CHUNK) {
            let req = msg::WindowRead {
                id: self.info.id,
                offset: off,
                len: chunk.len() as u32,
            };
            off += chunk.len() as u64;
            let (id, rx) =
                self.inner
                    .start_request(op::WINDOW_READ, &wire::encode_payload(&req)?, &[])?;
            inflight.push_back((id, rx, chunk));
            if inflight.len() >= PIPELINE {
                if let Some((id, rx, dst)) = inflight.pop_front() {
                    copy_reply(self.finish(id, &rx)?, dst)?;
                }
            }
        }
        while let Some((id, rx, dst)) = inflight.pop_front() {
            copy_reply(self.finish(id, &rx)?, dst)?;
        }
        Ok(())
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        let mut inflight = VecDeque::new();
        let mut off = offset;
        for chunk in data.chunks(wire::MAX_DATA_CHUNK) {
            let mut p = wire::encode_payload(&msg::WindowWrite {
                id: self.info.id,
                offset: off,
            })?;
            p.extend_from_slice(chunk);
            off += chunk.len() as u64;
            inflight.push_back(self.inner.start_request(op::WINDOW_WRITE, &p, &[])?);
            if inflight.len() >= PIPELINE {
                if let Some((id, rx)) = inflight.pop_front() {
                    self.finish(id, &rx)?;
                }
            }
        }
        while let Some((id, rx)) = inflight.pop_front() {
            self.finish(id, &rx)?;
        }
        Ok(())
    }
    fn is_live(&self) -> bool {
        !self.inner.is_gone()
            && lock(&self.inner.state)
                .peer_windows
                .contains_key(&self.info.id)
    }
}

fn copy_reply(m: Message, dst: &mut [u8]) -> Result<()> {
    if m.payload.len() != dst.len() {
        return Err(FabricError::Remote(ErrorReply::new(
            code::INTERNAL,
            format!(
                "read reply has {} bytes, asked for {}",
                m.payload.len(),
                dst.len()
            ),
        )));
    }
    dst.copy_from_slice(&m.payload);
    Ok(())
}

/// `bits` must name at least one doorbell and only doorbells below `count`.
fn check_doorbell_bits(bits: u64, count: u32) -> Result<()> {
    let valid = if count >= 64 {
        u64::MAX
    } else {
        (1u64 << count) - 1
    };
    if bits == 0 || bits & !valid != 0 {
        return Err(FabricError::BadDoorbell { bits, count });
    }
    Ok(())
}

pub(crate) fn poll_fds(fds: &[BorrowedFd<'_>], timeout: Duration) -> Result<bool> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|f| libc::pollfd {
            fd: f.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = i32::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
    // SAFETY: pfds is a valid array of pollfd of the given length.
    let r = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(FabricError::Io {
            op: "poll",
            source: e,
        });
    }
    Ok(r > 0)
}

impl LinkEndpoint {
    /// Exports a window: with `mediated` (always on tcp) this end serves the peer's reads
    /// and writes from its own mapping of the range and the fd never leaves; else (shm) the
    /// peer receives the fd.
    fn export(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        size: u64,
        label: &str,
        mediated: bool,
    ) -> Result<ExportedWindow> {
        let inner = &self.inner;
        inner.check_up()?;
        inner.cfg.limits.check_window(offset, size)?;
        if label.len() > MAX_LABEL {
            return Err(FabricError::BadLimits(format!(
                "window label of {} bytes exceeds {MAX_LABEL}",
                label.len()
            )));
        }
        let need = offset.checked_add(size).ok_or(FabricError::Oversized {
            size,
            max: inner.cfg.limits.max_size,
        })?;
        let have = fd_size(fd)?;
        if have < need {
            return Err(FabricError::RegionTooSmall { have, need });
        }
        // Served by this end (tcp, or mediated): map exactly the window's range.
        let map = if mediated {
            Some(Arc::new(Mapping::map_shared(fd, offset, size)?))
        } else {
            None
        };
        let id = {
            let mut st = lock(&inner.state);
            let max = inner.cfg.limits.max_windows;
            if st.exported.len() >= max as usize {
                return Err(FabricError::WindowLimit { max });
            }
            let id = st.next_window;
            st.next_window = st.next_window.wrapping_add(1).max(1);
            st.exported.insert(id, map);
            id
        };
        let add = msg::WindowAdd {
            id,
            size,
            fd_offset: offset,
            label: label.to_string(),
        };
        let fds: Vec<RawFd> = if mediated {
            Vec::new()
        } else {
            vec![fd.as_raw_fd()]
        };
        if let Err(e) = wire::encode_payload(&add)
            .map_err(FabricError::from)
            .and_then(|p| inner.send_frame(0, op::WINDOW_ADD, 0, &p, &fds))
        {
            lock(&inner.state).exported.remove(&id);
            return Err(e);
        }
        let weak = Arc::downgrade(inner);
        let info = WindowInfo {
            id,
            size,
            label: label.to_string(),
        };
        Ok(ExportedWindow::new(
            info,
            Box::new(move || {
                let Some(inner) = weak.upgrade() else { return };
                let was = lock(&inner.state).exported.remove(&id).is_some();
                if was && !inner.is_gone() {
                    if let Ok(p) = wire::encode_payload(&msg::WindowRemove { id }) {
                        let _ = inner.send_frame(0, op::WINDOW_REMOVE, 0, &p, &[]);
                    }
                }
            }),
        ))
    }
}

impl Endpoint for LinkEndpoint {
    fn local_node(&self) -> &NodeId {
        &self.inner.local
    }
    fn peer_node(&self) -> &NodeId {
        &self.inner.peer
    }
    fn kind(&self) -> FabricKind {
        self.inner.kind
    }
    fn peer_addr(&self) -> String {
        self.inner.peer_addr.clone()
    }
    fn channel_binding(&self) -> Vec<u8> {
        self.inner.binding.clone()
    }
    fn limits(&self) -> WindowLimits {
        self.inner.cfg.limits
    }
    fn peer_limits(&self) -> WindowLimits {
        self.inner.peer_hello.limits
    }
    fn is_up(&self) -> bool {
        !self.inner.is_gone()
    }
    fn stats(&self) -> LinkStats {
        let c = &self.inner.stats;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        LinkStats {
            frames_sent: l(&c.frames_sent),
            frames_received: l(&c.frames_received),
            heartbeats_sent: l(&c.heartbeats_sent),
            heartbeats_received: l(&c.heartbeats_received),
            window_io_frames: l(&c.window_io_frames),
        }
    }

    fn export_window(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        size: u64,
        label: &str,
    ) -> Result<ExportedWindow> {
        self.export(fd, offset, size, label, self.inner.kind == FabricKind::Tcp)
    }

    fn export_window_mediated(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        size: u64,
        label: &str,
    ) -> Result<ExportedWindow> {
        self.export(fd, offset, size, label, true)
    }

    fn peer_windows(&self) -> Vec<WindowInfo> {
        lock(&self.inner.state)
            .peer_windows
            .values()
            .map(|w| w.info.clone())
            .collect()
    }

    fn wait_peer_window(&self, label: &str, timeout: Duration) -> Result<WindowInfo> {
        self.inner.wait_for(timeout, |st| {
            st.peer_windows
                .values()
                .find(|w| w.info.label == label)
                .map(|w| w.info.clone())
        })
    }

    fn map_peer_window(&self, id: WindowId) -> Result<Box<dyn PeerWindow>> {
        let inner = &self.inner;
        inner.check_up()?;
        let (info, fd, fd_offset) = {
            let st = lock(&inner.state);
            let w = st
                .peer_windows
                .get(&id)
                .ok_or(FabricError::UnknownWindow(id))?;
            (w.info.clone(), w.fd.clone(), w.fd_offset)
        };
        let Some(fd) = fd else {
            return Ok(Box::new(MessageWindow {
                inner: inner.clone(),
                info,
            }));
        };
        // Seals first: once F_SEAL_SHRINK is seen it cannot go away, so the size checked next
        // stays valid for the life of the mapping.
        let what = format!("window {id} ({:?})", info.label);
        check_sealed(fd.as_fd(), &inner.cfg, &inner.peer, &what)?;
        let need = fd_offset.saturating_add(info.size);
        let have = fd_size(fd.as_fd())?;
        if have < need {
            return Err(FabricError::RegionTooSmall { have, need });
        }
        let backing = BackingId::of_file(fd.as_fd(), fd_offset, info.size)?;
        let map = Arc::new(Mapping::map_shared(fd.as_fd(), fd_offset, info.size)?);
        {
            let mut st = lock(&inner.state);
            if !st.peer_windows.contains_key(&id) {
                drop(st);
                return Err(if inner.is_gone() {
                    inner.gone_err()
                } else {
                    FabricError::WindowRevoked(id)
                });
            }
            st.live.retain(|(_, w)| w.strong_count() > 0);
            st.live.push((id, Arc::downgrade(&map)));
        }
        Ok(Box::new(DirectWindow {
            inner: inner.clone(),
            info,
            map,
            backing,
        }))
    }

    fn doorbell_count(&self) -> u32 {
        self.inner.cfg.doorbells
    }

    fn ring_peer(&self, bits: u64) -> Result<()> {
        let inner = &self.inner;
        check_doorbell_bits(bits, inner.peer_hello.doorbells)?;
        inner.check_up()?;
        match inner.kind {
            FabricKind::Shm => {
                for (bit, e) in inner.peer_doorbells.iter().enumerate() {
                    if bits & (1u64 << bit) != 0 {
                        e.write(1).map_err(FabricError::io("ring doorbell"))?;
                    }
                }
                Ok(())
            }
            FabricKind::Tcp => {
                let p = wire::encode_payload(&msg::Doorbell { bits })?;
                inner.send_frame(0, op::DOORBELL, 0, &p, &[])
            }
        }
    }

    fn wait_doorbell(&self, mask: u64, timeout: Duration) -> Result<u64> {
        let inner = &self.inner;
        check_doorbell_bits(mask, inner.cfg.doorbells)?;
        let deadline = Instant::now() + timeout;
        let selected: Vec<(usize, &EventFd)> = inner
            .doorbells
            .iter()
            .enumerate()
            .filter(|(bit, _)| mask & (1u64 << bit) != 0)
            .collect();
        loop {
            let mut fired = 0u64;
            for (bit, e) in &selected {
                if e.read().is_ok() {
                    fired |= 1u64 << bit;
                }
            }
            if fired != 0 {
                return Ok(fired);
            }
            inner.check_up()?;
            let now = Instant::now();
            if now >= deadline {
                return Err(FabricError::Timeout(timeout));
            }
            // SAFETY: the eventfds live in `inner` for the whole call.
            let mut fds: Vec<BorrowedFd<'_>> = selected
                .iter()
                .map(|(_, e)| unsafe { BorrowedFd::borrow_raw(e.as_raw_fd()) })
                .collect();
            // SAFETY: as above.
            fds.push(unsafe { BorrowedFd::borrow_raw(inner.gone_evt.as_raw_fd()) });
            poll_fds(&fds, deadline - now)?;
        }
    }

    fn doorbell_eventfd(&self, bit: u32) -> Result<EventFd> {
        let count = self.inner.cfg.doorbells;
        self.inner
            .doorbells
            .get(bit as usize)
            .ok_or(FabricError::BadDoorbell {
                bits: 1u64.checked_shl(bit).unwrap_or(0),
                count,
            })?
            .try_clone()
            .map_err(FabricError::io("dup eventfd"))
    }

    fn peer_doorbell_eventfd(&self, bit: u32) -> Result<EventFd> {
        let inner = &self.inner;
        if inner.kind != FabricKind::Shm {
            return Err(FabricError::DirectMappingUnsupported { kind: inner.kind });
        }
        inner
            .peer_doorbells
            .get(bit as usize)
            .ok_or(FabricError::BadDoorbell {
                bits: 1u64.checked_shl(bit).unwrap_or(0),
                count: inner.peer_hello.doorbells,
            })?
            .try_clone()
            .map_err(FabricError::io("dup eventfd"))
    }

    fn spad_count(&self) -> u32 {
        self.inner.cfg.scratchpads
    }

    fn read_spad(&self, index: u32) -> Result<u32> {
        self.inner.get_local_spad(index)
    }

    fn write_spad(&self, index: u32, value: u32) -> Result<()> {
        self.inner.set_local_spad(index, value)
    }

    fn read_peer_spad(&self, index: u32) -> Result<u32> {
        let inner = &self.inner;
        match inner.peer_spad(index)? {
            Some(spad) => Ok(spad.load(Ordering::SeqCst)),
            None => {
                let p = wire::encode_payload(&msg::SpadRead { index })?;
                let (id, rx) = inner.start_request(op::SPAD_READ, &p, &[])?;
                let r = inner.wait_reply(id, &rx, IO_TIMEOUT)?;
                Ok(wire::decode_payload::<u32>(&r.payload)?)
            }
        }
    }

    fn write_peer_spad(&self, index: u32, value: u32) -> Result<()> {
        let inner = &self.inner;
        match inner.peer_spad(index)? {
            Some(spad) => {
                spad.store(value, Ordering::SeqCst);
                Ok(())
            }
            None => {
                let p = wire::encode_payload(&msg::SpadWrite { index, value })?;
                inner.send_frame(0, op::SPAD_WRITE, 0, &p, &[])
            }
        }
    }

    fn send(&self, msg: Message) -> Result<()> {
        msg.check_user()?;
        if self.inner.kind == FabricKind::Tcp && !msg.fds.is_empty() {
            return Err(FabricError::FdPassingUnsupported {
                kind: self.inner.kind,
            });
        }
        let fds: Vec<RawFd> = msg.fds.iter().map(|f| f.as_raw_fd()).collect();
        self.inner.send_frame(0, msg.opcode, 0, &msg.payload, &fds)
    }

    fn request(&self, msg: Message, timeout: Duration) -> Result<Message> {
        msg.check_user()?;
        if self.inner.kind == FabricKind::Tcp && !msg.fds.is_empty() {
            return Err(FabricError::FdPassingUnsupported {
                kind: self.inner.kind,
            });
        }
        let fds: Vec<RawFd> = msg.fds.iter().map(|f| f.as_raw_fd()).collect();
        let (id, rx) = self.inner.start_request(msg.opcode, &msg.payload, &fds)?;
        self.inner.wait_reply(id, &rx, timeout)
    }

    fn reply(&self, id: RequestId, reply: std::result::Result<Message, ErrorReply>) -> Result<()> {
        match reply {
            Ok(m) => {
                if self.inner.kind == FabricKind::Tcp && !m.fds.is_empty() {
                    return Err(FabricError::FdPassingUnsupported {
                        kind: self.inner.kind,
                    });
                }
                let fds: Vec<RawFd> = m.fds.iter().map(|f| f.as_raw_fd()).collect();
                self.inner
                    .send_frame(FLAG_REPLY, m.opcode, id.0, &m.payload, &fds)
            }
            Err(e) => {
                let p = wire::encode_payload(&e)?;
                self.inner.send_frame(
                    FLAG_REPLY | FLAG_ERROR,
                    wire::USER_OPCODE_BASE,
                    id.0,
                    &p,
                    &[],
                )
            }
        }
    }

    fn recv(&self, timeout: Duration) -> Result<Incoming> {
        self.inner.wait_for(timeout, |st| {
            let i = st.incoming.pop_front()?;
            st.incoming_bytes = st.incoming_bytes.saturating_sub(incoming_bytes(&i));
            Some(i)
        })
    }

    fn wait_gone(&self, timeout: Duration) -> Result<String> {
        let inner = &self.inner;
        inner.wait_for(timeout, |st| {
            inner
                .is_gone()
                .then(|| st.gone_reason.clone().unwrap_or_default())
        })
    }

    fn close(&self) {
        if !self.inner.is_gone() {
            let _ = self.inner.send_frame(0, op::GOODBYE, 0, &[], &[]);
        }
        self.inner.mark_gone("closed locally");
    }
}
