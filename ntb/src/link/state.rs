//! A link's shared state and its two threads: the reader (dispatches frames, answers
//! fabric-internal requests) and the service thread (replies and heartbeats).

use super::*;

/// How long a write that found the peer's end closed waits for the reader to take the
/// peer's last frames (its GOODBYE) before the write's error names the end.
const PEER_CLOSE_GRACE: Duration = Duration::from_millis(200);

pub(super) struct PeerWin {
    pub(super) info: WindowInfo,
    pub(super) fd: Option<Arc<OwnedFd>>,
    pub(super) fd_offset: u64,
    /// Inside this end's shared region (`bar`): `fd` is the region's, which this host
    /// opened itself, so it is not checked for seals.
    pub(super) shared: bool,
    /// A mediated window's staging ring (shm, [`super::staging`]).
    pub(super) staging: Option<Arc<OwnedFd>>,
    /// Its writer, made at the first mapping and shared by every later one: the ring has one
    /// position, which two writers counting on their own would break.
    pub(super) stager: Option<Arc<StagingWriter>>,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) pending: HashMap<u64, Pending>,
    pub(super) incoming: VecDeque<Incoming>,
    /// Payload bytes of `incoming` (bounded by [`MAX_INCOMING_BYTES`]).
    pub(super) incoming_bytes: usize,
    /// Local exports; on tcp with the mapping that serves the peer's accesses.
    pub(super) exported: HashMap<WindowId, Option<Arc<Mapping>>>,
    /// The staging rings of exported mediated windows (shm), drained by the reader.
    pub(super) staged: HashMap<WindowId, Arc<StagingRing>>,
    pub(super) next_window: WindowId,
    pub(super) peer_windows: BTreeMap<WindowId, PeerWin>,
    pub(super) live: Vec<(WindowId, Weak<Mapping>)>,
    pub(super) gone_reason: Option<String>,
    /// Set once [`Inner::mark_gone`] has severed every live mapping, so a
    /// waiter for the link's end sees windows already dead.
    pub(super) gone_settled: bool,
}

/// A request waiting for its reply.
pub(super) struct Pending {
    pub(super) tx: mpsc::Sender<Result<Message>>,
    /// Where a window read's data goes, read there by the reader thread.
    pub(super) sink: Option<Arc<ReplySink>>,
}

/// Work for the service thread. The channel is unbounded, but what the peer can queue here
/// is small per request: a window read is queued as its (checked) range and copied out of
/// the window only when its reply is sent, into the thread's one buffer, so a peer asking
/// for many reads costs no memory per megabyte asked.
pub(super) enum Svc {
    Frame {
        flags: u8,
        opcode: u16,
        id: u64,
        payload: Vec<u8>,
    },
    WindowRead {
        id: u64,
        window: WindowId,
        map: Arc<Mapping>,
        offset: u64,
        len: usize,
    },
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) frames_sent: AtomicU64,
    pub(super) frames_received: AtomicU64,
    pub(super) heartbeats_sent: AtomicU64,
    pub(super) heartbeats_received: AtomicU64,
    pub(super) window_io_frames: AtomicU64,
    /// Items queued for `recv` and taken by it (under the state lock, with the queue).
    pub(super) incoming_queued: AtomicU64,
    pub(super) incoming_taken: AtomicU64,
}

pub(crate) struct Inner {
    pub(super) kind: FabricKind,
    pub(super) local: NodeId,
    pub(super) peer: NodeId,
    pub(super) peer_addr: String,
    /// The TLS channel binding (empty on shm).
    pub(super) binding: Vec<u8>,
    pub(super) cfg: LinkConfig,
    pub(super) peer_hello: msg::Hello,
    pub(super) writer: Mutex<Stream>,
    pub(super) ctl: Stream,
    pub(super) state: Mutex<State>,
    pub(super) cond: Condvar,
    pub(super) gone: AtomicBool,
    pub(super) gone_evt: EventFd,
    pub(super) next_id: AtomicU64,
    pub(super) doorbells: Vec<EventFd>,
    pub(super) peer_doorbells: Vec<EventFd>,
    pub(super) spads: SharedMemory,
    pub(super) peer_spads: Option<Mapping>,
    pub(super) stats: Counters,
    pub(super) svc_tx: Mutex<Option<mpsc::Sender<Svc>>>,
    /// Rate limit of the warnings about a misbehaving peer.
    pub(super) abuse_log: RateLimit,
    /// The shared region of a `bar` link.
    pub(super) region: Option<Arc<Region>>,
    /// Where the link's control messages go.
    pub(super) control: ControlPath,
}

pub(super) fn spad_bytes(n: u32) -> u64 {
    (u64::from(n) * 4).div_ceil(4096) * 4096
}

pub(super) fn atomic_at(base: *mut u8, index: u32) -> *const AtomicU32 {
    base.wrapping_add(index as usize * 4).cast::<AtomicU32>()
}

impl Inner {
    pub(super) fn is_gone(&self) -> bool {
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

    pub(super) fn check_up(&self) -> Result<()> {
        if self.is_gone() {
            Err(self.gone_err())
        } else {
            Ok(())
        }
    }

    /// Waits on the state condvar until `ready` yields a value; fails when the link goes down
    /// first (unless `ready` answers that too) or `timeout` passes.
    pub(super) fn wait_for<R>(
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
            // `gone_settled`, not `is_gone()`: a waiter sees the link's end
            // only once its windows are severed too.
            if st.gone_settled {
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

    pub(super) fn mark_gone(&self, reason: &str) {
        if self.gone.swap(true, Ordering::AcqRel) {
            return;
        }
        log::info!("ntb link {} -> {} down: {reason}", self.local, self.peer);
        let live = {
            let mut st = lock(&self.state);
            st.gone_reason = Some(reason.to_string());
            st.pending.clear();
            st.exported.clear();
            st.staged.clear();
            st.peer_windows.clear();
            std::mem::take(&mut st.live)
        };
        for (_, w) in live {
            if let Some(m) = w.upgrade() {
                m.sever();
            }
        }
        // Only now is the link's end whole: a waiter woken before the
        // mappings were severed would see a dead link with live windows.
        lock(&self.state).gone_settled = true;
        let _ = self.gone_evt.write(1);
        self.cond.notify_all();
        self.ctl.shutdown();
        lock(&self.svc_tx).take();
    }

    pub(super) fn send_frame(
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
        self.sent(flags, opcode, res)
    }

    /// [`Self::send_frame`] of a payload made of a small `prefix` (an encoded message) and
    /// `data` (window bytes), written from the caller's buffers: no copy of `data` into a
    /// frame. No fds.
    pub(super) fn send_frame_parts(
        &self,
        flags: u8,
        opcode: u16,
        id: u64,
        prefix: &[u8],
        data: &[u8],
    ) -> Result<()> {
        self.check_up()?;
        let header = wire::encode_header(flags, opcode, id, prefix.len() + data.len(), 0)?;
        let mut head = Vec::with_capacity(header.len() + prefix.len());
        head.extend_from_slice(&header);
        head.extend_from_slice(prefix);
        let res = lock(&self.writer).write_parts(&head, data);
        self.sent(flags, opcode, res)
    }

    /// Accounts a frame written (or marks the link gone if writing failed).
    fn sent(&self, flags: u8, opcode: u16, res: std::io::Result<()>) -> Result<()> {
        if let Err(e) = res {
            if matches!(
                e.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            ) {
                // The peer closed its end. What it sent last (its GOODBYE, naming why) may
                // still be in our socket: the reader names the end if it gets there within
                // the bound, rather than this write's broken pipe.
                let _ = self.wait_for(PEER_CLOSE_GRACE, |_| None::<()>);
            }
            self.mark_gone(&format!("send failed: {e}"));
            return Err(self.gone_err());
        }
        let c = &self.stats;
        if opcode == op::HEARTBEAT && flags == 0 {
            c.heartbeats_sent.fetch_add(1, Ordering::Relaxed);
        } else {
            c.frames_sent.fetch_add(1, Ordering::Relaxed);
            if matches!(
                opcode,
                op::WINDOW_READ | op::WINDOW_WRITE | op::WINDOW_COMMIT
            ) && flags == 0
            {
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
        self.start_request_with(None, |id| self.send_frame(0, opcode, id, payload, fds))
    }

    /// [`Self::start_request`] of a window read whose reply's data the reader puts into
    /// `sink` (no payload buffer, no copy); the reply [`Message`] then has an empty payload.
    pub(super) fn start_request_into(
        &self,
        opcode: u16,
        payload: &[u8],
        sink: Arc<ReplySink>,
    ) -> Result<(u64, mpsc::Receiver<Result<Message>>)> {
        self.start_request_with(Some(sink), |id| {
            self.send_frame(0, opcode, id, payload, &[])
        })
    }

    /// [`Self::start_request`] whose payload is `prefix` followed by `data`, sent without
    /// copying `data` (window writes).
    pub(crate) fn start_request_parts(
        &self,
        opcode: u16,
        prefix: &[u8],
        data: &[u8],
    ) -> Result<(u64, mpsc::Receiver<Result<Message>>)> {
        self.start_request_with(None, |id| {
            self.send_frame_parts(0, opcode, id, prefix, data)
        })
    }

    fn start_request_with(
        &self,
        sink: Option<Arc<ReplySink>>,
        send: impl FnOnce(u64) -> Result<()>,
    ) -> Result<(u64, mpsc::Receiver<Result<Message>>)> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        {
            let mut st = lock(&self.state);
            if self.is_gone() {
                drop(st);
                return Err(self.gone_err());
            }
            st.pending.insert(id, Pending { tx, sink });
        }
        if let Err(e) = send(id) {
            lock(&self.state).pending.remove(&id);
            return Err(e);
        }
        Ok((id, rx))
    }

    /// Drops the wait for request `id`'s reply (its answer came another way).
    pub(super) fn forget_request(&self, id: u64) {
        lock(&self.state).pending.remove(&id);
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

    pub(super) fn queue_reply(
        &self,
        id: u64,
        opcode: u16,
        r: std::result::Result<Vec<u8>, ErrorReply>,
    ) {
        let (flags, payload) = reply_frame(r);
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
    pub(super) fn push_incoming(&self, i: Incoming) -> bool {
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
            self.stats.incoming_queued.fetch_add(1, Ordering::Release);
        }
        self.cond.notify_all();
        true
    }

    pub(super) fn serve_mapping(
        &self,
        id: WindowId,
    ) -> std::result::Result<Arc<Mapping>, ErrorReply> {
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

    /// Checks a peer's window read; the service thread copies the bytes as it replies.
    pub(super) fn window_read(&self, id: u64, p: &[u8]) -> std::result::Result<Svc, ErrorReply> {
        let r: msg::WindowRead =
            wire::decode_payload(p).map_err(|e| ErrorReply::new(code::INVALID, e.to_string()))?;
        let map = self.serve_mapping(r.id)?;
        // The peer chooses `len` (up to 4 GiB); the service thread's buffer is one chunk.
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
        crate::mem::check_range(r.offset, u64::from(r.len), map.len() as u64)
            .map_err(|e| ErrorReply::new(code::OUT_OF_RANGE, e.to_string()))?;
        Ok(Svc::WindowRead {
            id,
            window: r.id,
            map,
            offset: r.offset,
            len: r.len as usize,
        })
    }

    /// The reply `queue_reply` would send, sent from this thread.
    fn send_reply(
        &self,
        id: u64,
        opcode: u16,
        r: std::result::Result<&[u8], ErrorReply>,
    ) -> Result<()> {
        let (flags, payload) = reply_frame(r.map(std::borrow::Cow::Borrowed));
        self.send_frame_parts(flags, opcode, id, &[], &payload)
    }

    /// The sink waiting for `h`'s data, when `h` is a window read's data reply.
    fn reply_sink(&self, h: &Header) -> Option<Arc<ReplySink>> {
        if !h.is_reply() || h.is_error() || h.opcode != op::WINDOW_READ || h.fds != 0 {
            return None;
        }
        lock(&self.state)
            .pending
            .get(&h.id)
            .and_then(|p| p.sink.clone())
    }

    /// [`Self::window_write`] of a frame whose header was read, its data read by the kernel
    /// straight into the window (no payload buffer, no copy): what a mediated window's
    /// writes (a cross-lender P2P copy, a borrower's writes to a mediated BAR) cost on shm.
    /// A refused write's data is skipped through a small buffer, and answered as
    /// `window_write` would. A window over device registers (a VFIO BAR) is written through
    /// a buffer in aligned accesses instead.
    fn window_write_in_place(
        &self,
        stream: &Stream,
        h: &Header,
        mut fds: Vec<OwnedFd>,
    ) -> std::result::Result<(), ReadError> {
        let len = h.len as usize;
        // The encoded `msg::WindowWrite` (postcard: at most 15 bytes) and the data's start.
        let mut head = [0u8; 16];
        let n = len.min(head.len());
        stream
            .read_exact(&mut head[..n], &mut fds, None)
            .map_err(read_error)?;
        let target = wire::decode_prefix::<msg::WindowWrite>(&head[..n])
            .map_err(|e| ErrorReply::new(code::INVALID, e.to_string()))
            .and_then(|(w, first)| {
                let map = self.serve_mapping(w.id)?;
                let data = len - (n - first.len());
                crate::mem::check_range(w.offset, data as u64, map.len() as u64)
                    .map_err(|e| ErrorReply::new(code::OUT_OF_RANGE, e.to_string()))?;
                Ok((map, w.offset, first.len(), data))
            });
        let r = match target {
            // Device registers take the write as the writer sent it, in aligned accesses
            // (`Mapping::is_io`): the kernel's copy would store bytes. The frame is at most
            // `wire::MAX_PAYLOAD` (`Header::decode` checked), so is this buffer.
            Ok((map, offset, first, data)) if map.is_io() => {
                let mut buf = vec![0u8; data];
                buf[..first].copy_from_slice(&head[n - first..n]);
                stream
                    .read_exact(&mut buf[first..], &mut fds, None)
                    .map_err(read_error)?;
                map.write_at(offset, &buf)
                    .map_err(|e| ReadError::Protocol(e.to_string()))?;
                Ok(Vec::new())
            }
            Ok((map, offset, first, data)) => {
                map.write_at(offset, &head[n - first..n])
                    .map_err(|e| ReadError::Protocol(e.to_string()))?;
                let start = offset as usize + first;
                // SAFETY: `check_range` put `offset..offset + data` inside the live mapping,
                // which `map` keeps alive for the call; the kernel writes the bytes there.
                unsafe { stream.read_exact_raw(map.as_ptr().add(start), data - first, &mut fds) }
                    .map_err(read_error)?;
                Ok(Vec::new())
            }
            Err(e) => {
                stream.skip(len - n, &mut fds).map_err(read_error)?;
                Err(e)
            }
        };
        check_fds(h, &fds)?;
        self.queue_reply(h.id, h.opcode, r);
        Ok(())
    }

    /// A chunk of a staged write: from the window's staging ring into the window.
    pub(super) fn window_commit(&self, p: &[u8]) -> std::result::Result<Vec<u8>, ErrorReply> {
        let c: msg::WindowCommit =
            wire::decode_payload(p).map_err(|e| ErrorReply::new(code::INVALID, e.to_string()))?;
        // One look at the tables: the window's mapping and its ring, as exported together.
        let (map, ring) = {
            let st = lock(&self.state);
            match (st.exported.get(&c.id), st.staged.get(&c.id)) {
                (Some(Some(m)), Some(r)) => (m.clone(), r.clone()),
                (None, _) => {
                    return Err(ErrorReply::new(
                        code::UNKNOWN_WINDOW,
                        format!("no window {}", c.id),
                    ))
                }
                _ => {
                    return Err(ErrorReply::new(
                        code::UNSUPPORTED,
                        format!("window {} has no staging ring", c.id),
                    ))
                }
            }
        };
        ring.drain(&map, &c)?;
        Ok(Vec::new())
    }

    pub(super) fn window_write(&self, p: &[u8]) -> std::result::Result<Vec<u8>, ErrorReply> {
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
    /// A peer's window notice: with its memfd (shm), served by messages (tcp, and `bar`
    /// windows outside the region), or an offset into this end's shared region (`bar`).
    fn window_added(&self, opcode: u16, a: msg::WindowAdd, fds: Vec<OwnedFd>) {
        // Any fd beyond the window's one is closed here (dropped with `fds`).
        let mut fds = fds;
        let shared = opcode == op::WINDOW_ADD_SHARED;
        // A staged window's one fd is its ring: the window itself stays mediated.
        let staging = if opcode == op::WINDOW_ADD_STAGED && self.kind.passes_fds() {
            fds.pop().filter(|_| fds.is_empty()).map(Arc::new)
        } else {
            None
        };
        let checked = self.check_window_add(&a).and_then(|()| {
            if opcode == op::WINDOW_ADD_STAGED {
                return Ok(None);
            }
            if !shared {
                return Ok(if self.kind.passes_fds() && fds.len() == 1 {
                    fds.pop().map(Arc::new)
                } else {
                    None
                });
            }
            let region = self
                .region
                .as_ref()
                .ok_or_else(|| format!("a shared-region window on a {} link", self.kind))?;
            region.check_range(a.fd_offset, a.size)?;
            Ok(Some(region.fd().clone()))
        });
        let fd = match checked {
            Ok(fd) => fd,
            Err(why) => {
                if let Some(n) = self.abuse_log.hit() {
                    log::warn!(
                        "peer {}: refusing window {} ({:?}): {why} ({n} more refused since the \
                         last report)",
                        self.peer,
                        a.id,
                        a.label
                    );
                }
                return;
            }
        };
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
                    shared,
                    staging,
                    stager: None,
                },
            );
        }
        self.push_incoming(Incoming::WindowAdded(info));
    }

    pub(super) fn check_window_add(&self, a: &msg::WindowAdd) -> std::result::Result<(), String> {
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

    pub(super) fn spad_ptr(&self, index: u32) -> Result<*const AtomicU32> {
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
    pub(super) fn peer_spad(&self, index: u32) -> Result<Option<&AtomicU32>> {
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

    pub(super) fn set_local_spad(&self, index: u32, value: u32) -> Result<()> {
        let p = self.spad_ptr(index)?;
        // SAFETY: index < count, inside our page-aligned spad mapping which lives as long as self.
        unsafe { (*p).store(value, Ordering::SeqCst) };
        Ok(())
    }

    pub(super) fn get_local_spad(&self, index: u32) -> Result<u32> {
        let p = self.spad_ptr(index)?;
        // SAFETY: as in set_local_spad.
        Ok(unsafe { (*p).load(Ordering::SeqCst) })
    }

    /// Handles one frame; returns false when the link must stop.
    pub(super) fn dispatch(&self, h: Header, payload: Vec<u8>, fds: Vec<OwnedFd>) -> bool {
        let c = &self.stats;
        if h.opcode == op::HEARTBEAT && !h.is_reply() {
            c.heartbeats_received.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        c.frames_received.fetch_add(1, Ordering::Relaxed);
        if h.is_reply() {
            let tx = lock(&self.state).pending.remove(&h.id).map(|p| p.tx);
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
            op::WINDOW_ADD | op::WINDOW_ADD_SHARED | op::WINDOW_ADD_STAGED => {
                match wire::decode_payload::<msg::WindowAdd>(&payload) {
                    Ok(a) => self.window_added(h.opcode, a, fds),
                    Err(e) => log::warn!("bad window add from {}: {e}", self.peer),
                }
            }
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
            op::WINDOW_READ if h.id != 0 => match self.window_read(h.id, &payload) {
                Ok(job) => {
                    if let Some(tx) = lock(&self.svc_tx).as_ref() {
                        let _ = tx.send(job);
                    }
                }
                Err(e) => self.queue_reply(h.id, h.opcode, Err(e)),
            },
            op::WINDOW_WRITE if h.id != 0 => {
                let r = self.window_write(&payload);
                self.queue_reply(h.id, h.opcode, r);
            }
            op::WINDOW_COMMIT => {
                // Landed chunks are told by the ring's drained count, not by a reply
                // (`staging`); a write's last commit (an id) is answered if refused.
                let r = self.window_commit(&payload);
                if let (Err(e), true) = (&r, h.id != 0) {
                    self.queue_reply(h.id, h.opcode, Err(e.clone()));
                } else if let Err(e) = r {
                    // A posted chunk: its writer learns of the refusal from the write's last
                    // chunk (the ring is broken from here on, or the window is gone).
                    if let Some(n) = self.abuse_log.hit() {
                        log::warn!(
                            "peer {}: staged write refused: {e} ({n} more refused since the \
                             last report)",
                            self.peer
                        );
                    }
                }
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

/// A reply's flags and payload: the data, or the encoded error.
fn reply_frame<P: From<Vec<u8>>>(r: std::result::Result<P, ErrorReply>) -> (u8, P) {
    match r {
        Ok(p) => (FLAG_REPLY, p),
        Err(e) => (
            FLAG_REPLY | FLAG_ERROR,
            P::from(wire::encode_payload(&e).unwrap_or_default()),
        ),
    }
}

/// What the reader took from the stream.
enum Next {
    /// A frame to dispatch.
    Frame(Header, Vec<u8>, Vec<OwnedFd>),
    /// A window write already served, its data read straight into the window.
    Served,
}

pub(super) fn reader_loop(inner: Arc<Inner>, stream: Stream) {
    loop {
        match read_next(&inner, &stream) {
            Ok(Next::Frame(h, p, fds)) => {
                if !inner.dispatch(h, p, fds) {
                    break;
                }
            }
            Ok(Next::Served) => {
                inner.stats.frames_received.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                inner.mark_gone(&e.to_string());
                break;
            }
        }
    }
}

/// The next frame. A window read's data goes straight into its caller's buffer when the
/// caller is still waiting (the frame's payload is then empty); a peer's window write on a
/// stream the kernel reads raw goes straight into the window.
fn read_next(inner: &Inner, stream: &Stream) -> std::result::Result<Next, ReadError> {
    let (h, mut fds) = read_header(stream, None)?;
    if let Some(sink) = inner.reply_sink(&h) {
        let filled = sink.fill(h.len as usize, |dst| stream.read_exact(dst, &mut fds, None));
        if let Some(r) = filled {
            r.map_err(read_error)?;
            check_fds(&h, &fds)?;
            return Ok(Next::Frame(h, Vec::new(), fds));
        }
    }
    if !h.is_reply()
        && h.opcode == op::WINDOW_WRITE
        && h.id != 0
        && h.fds == 0
        && stream.reads_raw()
    {
        inner.window_write_in_place(stream, &h, fds)?;
        return Ok(Next::Served);
    }
    let (h, p, fds) = read_payload(stream, h, fds, None)?;
    Ok(Next::Frame(h, p, fds))
}

pub(super) fn service_loop(inner: Arc<Inner>, rx: mpsc::Receiver<Svc>) {
    let hb = inner.cfg.heartbeat;
    let mut next_hb = Instant::now();
    // Window reads are copied here just before they go out: one buffer of at most
    // `wire::MAX_DATA_CHUNK` (`window_read` checks), zeroed once, reused for every reply.
    let mut scratch: Vec<u8> = Vec::new();
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
                if inner
                    .send_frame_parts(flags, opcode, id, &[], &payload)
                    .is_err()
                {
                    break;
                }
            }
            Ok(Svc::WindowRead {
                id,
                window,
                map,
                offset,
                len,
            }) => {
                if scratch.len() < len {
                    scratch.resize(len, 0);
                }
                let out = &mut scratch[..len];
                // Still exported as it was when the request was read: a window revoked
                // meanwhile serves nothing more, as when the reader copied at once.
                let r = inner
                    .serve_mapping(window)
                    .and_then(|now| {
                        if Arc::ptr_eq(&now, &map) {
                            Ok(())
                        } else {
                            Err(ErrorReply::new(
                                code::UNKNOWN_WINDOW,
                                format!("no window {window}"),
                            ))
                        }
                    })
                    .and_then(|()| {
                        map.read_at(offset, out)
                            .map_err(|e| ErrorReply::new(code::OUT_OF_RANGE, e.to_string()))
                    })
                    .map(|()| &*out);
                if inner.send_reply(id, op::WINDOW_READ, r).is_err() {
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
