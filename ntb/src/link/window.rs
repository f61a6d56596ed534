//! Windows: exporting local memory, and peer windows mapped directly (shm) or served by
//! messages (tcp).

use super::*;

/// A peer window mapped with `mmap` (shm, and `bar` windows in the shared region).
pub(super) struct DirectWindow {
    pub(super) inner: Arc<Inner>,
    pub(super) info: WindowInfo,
    pub(super) map: Arc<Mapping>,
    /// The exporter's file and range, taken when it was mapped.
    pub(super) backing: BackingId,
}

impl DirectWindow {
    pub(super) fn check(&self) -> Result<()> {
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
    unsafe fn write_raw(&self, offset: u64, src: *const u8, len: usize) -> Result<()> {
        self.check()?;
        if self.map.is_io() {
            // Registers take aligned accesses (`Mapping::write_at`): the staged default.
            // SAFETY: forwarded from this function's contract.
            return Ok(self.map.write_at(offset, &unsafe { stage_raw(src, len) })?);
        }
        crate::mem::check_range(offset, len as u64, self.map.len() as u64)?;
        // SAFETY: the range lies inside the live mapping (checked); `src` is valid for `len`
        // bytes. `copy` (memmove): the source may be another mapping of the same memory.
        unsafe { std::ptr::copy(src, self.map.as_ptr().add(offset as usize), len) };
        Ok(())
    }
    fn is_live(&self) -> bool {
        !self.map.is_severed()
    }
    fn backing_id(&self) -> Option<BackingId> {
        Some(self.backing)
    }
}

/// A peer window reached by messages (tcp, and mediated windows on every fabric).
pub(super) struct MessageWindow {
    pub(super) inner: Arc<Inner>,
    pub(super) info: WindowInfo,
    /// The exporter's staging ring, when it offered one (shm): writes go through it.
    pub(super) staging: Option<Arc<StagingWriter>>,
}

pub(super) type ReplyRx = mpsc::Receiver<Result<Message>>;

/// Requests kept in flight by batched window transfers.
pub(super) const PIPELINE: usize = 4;

impl MessageWindow {
    pub(super) fn check(&self, offset: u64, len: usize) -> Result<()> {
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

    pub(super) fn finish(&self, id: u64, rx: &mpsc::Receiver<Result<Message>>) -> Result<Message> {
        self.settle(self.inner.wait_reply(id, rx, IO_TIMEOUT))
    }

    /// A reply, with the exporter's "no such window" named as the revocation it is.
    pub(super) fn settle(&self, r: Result<Message>) -> Result<Message> {
        r.map_err(|e| match e {
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
        // Each chunk's reply is read by the link's reader straight into `buf` (module
        // `sink`); `buf` is reached only through `base` from here on, and `armed` disarms
        // every sink before this function returns, on every path.
        let (base, total) = (buf.as_mut_ptr(), buf.len());
        let mut armed = SinkSet::default();
        let mut inflight: VecDeque<(u64, ReplyRx, Arc<ReplySink>, usize, usize)> = VecDeque::new();
        let settle = |(id, rx, sink, start, len): (u64, ReplyRx, Arc<ReplySink>, usize, usize)| {
            let m = self.finish(id, &rx)?;
            if sink.disarm() {
                return Ok(());
            }
            // Not filled (the peer answered another length): the payload path says why.
            // SAFETY: `start..start + len` lies inside `buf`, and its sink is disarmed, so no
            // reader writes there any more; no other reference to these bytes exists.
            let dst = unsafe { std::slice::from_raw_parts_mut(base.add(start), len) };
            copy_reply(m, dst)
        };
        let mut start = 0;
        while start < total {
            let len = (total - start).min(wire::MAX_DATA_CHUNK);
            let req = msg::WindowRead {
                id: self.info.id,
                offset: offset + start as u64,
                len: len as u32,
            };
            // SAFETY: `start..start + len` lies inside `buf`, which this call borrows mutably
            // until it returns; nothing here reads or writes those bytes while the sink is
            // armed, and `armed` (or `settle`) disarms it before the borrow ends.
            let sink = unsafe { ReplySink::new(base.add(start), len) };
            armed.push(sink.clone());
            let (id, rx) = self.inner.start_request_into(
                op::WINDOW_READ,
                &wire::encode_payload(&req)?,
                sink.clone(),
            )?;
            inflight.push_back((id, rx, sink, start, len));
            start += len;
            if inflight.len() >= PIPELINE {
                if let Some(r) = inflight.pop_front() {
                    settle(r)?;
                }
            }
        }
        while let Some(r) = inflight.pop_front() {
            settle(r)?;
        }
        Ok(())
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        match &self.staging {
            // SAFETY: `data` is valid for reads of its length for the call.
            Some(ring) if !data.is_empty() => unsafe {
                ring.write(self, offset, data.as_ptr(), data.len())
            },
            _ => self.write_messages(offset, data),
        }
    }
    unsafe fn write_raw(&self, offset: u64, src: *const u8, len: usize) -> Result<()> {
        self.check(offset, len)?;
        match &self.staging {
            // SAFETY: forwarded from this function's contract.
            Some(ring) if len > 0 => unsafe { ring.write(self, offset, src, len) },
            _ => {
                // Messages send from a slice: stage the bytes first, never a slice of memory
                // that others change (the default's copy).
                // SAFETY: forwarded from this function's contract.
                self.write_messages(offset, &unsafe { stage_raw(src, len) })
            }
        }
    }
    fn is_live(&self) -> bool {
        !self.inner.is_gone()
            && lock(&self.inner.state)
                .peer_windows
                .contains_key(&self.info.id)
    }
}

impl MessageWindow {
    /// Window-write messages of at most [`wire::MAX_DATA_CHUNK`], [`PIPELINE`] in flight.
    fn write_messages(&self, offset: u64, data: &[u8]) -> Result<()> {
        let mut inflight = VecDeque::new();
        let mut off = offset;
        for chunk in data.chunks(wire::MAX_DATA_CHUNK) {
            let p = wire::encode_payload(&msg::WindowWrite {
                id: self.info.id,
                offset: off,
            })?;
            off += chunk.len() as u64;
            // The chunk goes out from the caller's buffer (no copy into a frame).
            inflight.push_back(
                self.inner
                    .start_request_parts(op::WINDOW_WRITE, &p, chunk)?,
            );
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
}

pub(super) fn copy_reply(m: Message, dst: &mut [u8]) -> Result<()> {
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

impl LinkEndpoint {
    /// Exports a window as `how` says ([`Export`]).
    pub(super) fn export(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        size: u64,
        label: &str,
        how: Export,
    ) -> Result<ExportedWindow> {
        let mediated = how == Export::Mediated;
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
        if let (Export::Shared, Some(r)) = (how, &inner.region) {
            r.check_range(offset, size)
                .map_err(|problem| FabricError::BadRegion {
                    path: r.path().display().to_string(),
                    problem,
                })?;
        }
        // Served by this end (tcp, or mediated): map exactly the window's range.
        let map = if mediated {
            Some(Arc::new(Mapping::map_shared(fd, offset, size)?))
        } else {
            None
        };
        // A mediated window of memory on a link that passes fds gets a staging ring for the
        // peer's writes (`staging`); device registers keep one message per access.
        let staging = match &map {
            Some(m) if inner.kind.passes_fds() && !m.is_io() => {
                Some(Arc::new(StagingRing::new(label)?))
            }
            _ => None,
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
            if let Some(r) = &staging {
                st.staged.insert(id, r.clone());
            }
            id
        };
        let add = msg::WindowAdd {
            id,
            size,
            fd_offset: offset,
            label: label.to_string(),
        };
        let (opcode, fds): (u16, Vec<RawFd>) = match (how, &staging) {
            (Export::Fd, _) => (op::WINDOW_ADD, vec![fd.as_raw_fd()]),
            (Export::Mediated, Some(r)) => (op::WINDOW_ADD_STAGED, vec![r.fd().as_raw_fd()]),
            (Export::Mediated, None) => (op::WINDOW_ADD, Vec::new()),
            // The peer maps the same offset of its own view of the region.
            (Export::Shared, _) => (op::WINDOW_ADD_SHARED, Vec::new()),
        };
        if let Err(e) = wire::encode_payload(&add)
            .map_err(FabricError::from)
            .and_then(|p| inner.send_frame(0, opcode, 0, &p, &fds))
        {
            let mut st = lock(&inner.state);
            st.exported.remove(&id);
            st.staged.remove(&id);
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
            !matches!(how, Export::Mediated),
            Box::new(move || {
                let Some(inner) = weak.upgrade() else { return };
                let was = {
                    let mut st = lock(&inner.state);
                    st.staged.remove(&id);
                    st.exported.remove(&id).is_some()
                };
                if was && !inner.is_gone() {
                    if let Ok(p) = wire::encode_payload(&msg::WindowRemove { id }) {
                        let _ = inner.send_frame(0, op::WINDOW_REMOVE, 0, &p, &[]);
                    }
                }
            }),
        ))
    }
}

/// How a window reaches the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Export {
    /// Its memfd is passed (shm).
    Fd,
    /// This end serves the peer's reads and writes from its own mapping of the range (tcp,
    /// or on request).
    Mediated,
    /// It lies in the link's shared region: the peer maps the same offset of its own view
    /// of the region (`bar`).
    Shared,
}
