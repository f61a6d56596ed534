//! [`LinkEndpoint`]: the [`Endpoint`] of both socket backends.

use super::*;

/// The endpoint of both socket backends.
pub(crate) struct LinkEndpoint {
    pub(super) inner: Arc<Inner>,
    pub(super) threads: Mutex<Vec<crate::workers::Worker>>,
}

impl Drop for LinkEndpoint {
    fn drop(&mut self) {
        self.close();
        for t in lock(&self.threads).drain(..) {
            let _ = t.join();
        }
    }
}

/// `bits` must name at least one doorbell and only doorbells below `count`.
pub(super) fn check_doorbell_bits(bits: u64, count: u32) -> Result<()> {
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

impl Endpoint for LinkEndpoint {
    fn local_node(&self) -> &NodeId {
        &self.inner.local
    }
    fn peer_node(&self) -> &NodeId {
        &self.inner.peer
    }
    fn shared_region(&self) -> Option<Arc<Region>> {
        self.inner.region.clone()
    }

    fn control_path(&self) -> ControlPath {
        self.inner.control
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
            incoming_queued: c.incoming_queued.load(Ordering::Acquire),
            incoming_taken: c.incoming_taken.load(Ordering::Acquire),
        }
    }

    fn export_window(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        size: u64,
        label: &str,
    ) -> Result<ExportedWindow> {
        let how = match (&self.inner.region, self.inner.kind) {
            (_, FabricKind::Shm) => Export::Fd,
            (Some(r), _) if r.holds(fd)? => Export::Shared,
            _ => Export::Mediated,
        };
        self.export(fd, offset, size, label, how)
    }

    fn export_window_mediated(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        size: u64,
        label: &str,
    ) -> Result<ExportedWindow> {
        self.export(fd, offset, size, label, Export::Mediated)
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
        let (info, fd, fd_offset, shared, staging, stager) = {
            let st = lock(&inner.state);
            let w = st
                .peer_windows
                .get(&id)
                .ok_or(FabricError::UnknownWindow(id))?;
            (
                w.info.clone(),
                w.fd.clone(),
                w.fd_offset,
                w.shared,
                w.staging.clone(),
                w.stager.clone(),
            )
        };
        let what = format!("window {id} ({:?})", info.label);
        let Some(fd) = fd else {
            let staging = match (stager, staging) {
                (Some(w), _) => Some(w),
                (None, Some(r)) => {
                    // The ring is the exporter's memfd like a window's: sealed, or it could
                    // shrink under this process's mapping.
                    check_sealed(r.as_fd(), &inner.cfg, &inner.peer, &what)?;
                    let new = Arc::new(StagingWriter::map(r.as_fd())?);
                    let mut st = lock(&inner.state);
                    let w = st
                        .peer_windows
                        .get_mut(&id)
                        .ok_or(FabricError::WindowRevoked(id))?;
                    // Another thread may have mapped it meanwhile: one writer per ring.
                    Some(w.stager.get_or_insert(new).clone())
                }
                (None, None) => None,
            };
            return Ok(Box::new(MessageWindow {
                inner: inner.clone(),
                info,
                staging,
            }));
        };
        // Seals first: once F_SEAL_SHRINK is seen it cannot go away, so the size checked next
        // stays valid for the life of the mapping.
        if !shared {
            check_sealed(fd.as_fd(), &inner.cfg, &inner.peer, &what)?;
        }
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
            FabricKind::Tcp | FabricKind::Bar => {
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
        if !self.inner.kind.passes_fds() && !msg.fds.is_empty() {
            return Err(FabricError::FdPassingUnsupported {
                kind: self.inner.kind,
            });
        }
        let fds: Vec<RawFd> = msg.fds.iter().map(|f| f.as_raw_fd()).collect();
        self.inner.send_frame(0, msg.opcode, 0, &msg.payload, &fds)
    }

    fn request(&self, msg: Message, timeout: Duration) -> Result<Message> {
        msg.check_user()?;
        if !self.inner.kind.passes_fds() && !msg.fds.is_empty() {
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
                if !self.inner.kind.passes_fds() && !m.fds.is_empty() {
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
            self.inner
                .stats
                .incoming_taken
                .fetch_add(1, Ordering::Release);
            Some(i)
        })
    }

    fn wait_gone(&self, timeout: Duration) -> Result<String> {
        let inner = &self.inner;
        inner.wait_for(timeout, |st| {
            st.gone_settled
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
