//! The connected stream under a link (a Unix socket, a TLS connection, or the plaintext end
//! of a control ring's pump) and its framing: frames with fds, bounded reads.

use super::*;

/// A connected stream socket.
#[derive(Debug)]
pub(crate) enum Stream {
    Unix(UnixStream),
    /// A tcp link's TLS connection ([`crate::tls::stream`]).
    Tls(Arc<TlsStream>),
    /// A `bar` link's plaintext, through the pump of its control rings ([`crate::ring`]).
    Ring(UnixStream),
}

impl Stream {
    pub(crate) fn kind(&self) -> FabricKind {
        match self {
            Stream::Unix(_) => FabricKind::Shm,
            Stream::Tls(_) | Stream::Ring(_) => FabricKind::Tcp,
        }
    }

    /// The peer's address (see [`crate::Endpoint::peer_addr`]).
    pub(crate) fn peer_desc(&self) -> String {
        match self {
            Stream::Tls(_) | Stream::Ring(_) => String::new(),
            Stream::Unix(s) => match crate::sock::peer_cred(s) {
                Ok(cred) => format!("unix:uid={},pid={}", cred.uid, cred.pid),
                Err(_) => "unix:unknown".into(),
            },
        }
    }

    pub(super) fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tls(s) => Stream::Tls(Arc::clone(s)),
            Stream::Ring(s) => Stream::Ring(s.try_clone()?),
        })
    }

    pub(super) fn shutdown(&self) {
        match self {
            Stream::Unix(s) | Stream::Ring(s) => {
                let _ = s.shutdown(Shutdown::Both);
            }
            Stream::Tls(s) => s.shutdown(),
        }
    }

    pub(super) fn set_timeouts(&self, t: Duration) -> io::Result<()> {
        match self {
            Stream::Unix(s) | Stream::Ring(s) => {
                s.set_read_timeout(Some(t))?;
                s.set_write_timeout(Some(t))
            }
            Stream::Tls(s) => {
                s.set_read_timeout(t);
                s.set_write_timeout(t);
                Ok(())
            }
        }
    }

    pub(super) fn write_frame(&self, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
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
            Stream::Tls(s) => s.write_parts(&[bytes]),
            Stream::Ring(s) => (&*s).write_all(bytes),
        }
    }

    /// Writes a frame given as its head (header and any prefix) and its data, without
    /// copying the data into one buffer first (window writes carry up to
    /// `wire::MAX_DATA_CHUNK` bytes of it; no fds travel with them).
    pub(super) fn write_parts(&self, head: &[u8], data: &[u8]) -> io::Result<()> {
        let mut w = match self {
            Stream::Unix(s) | Stream::Ring(s) => s,
            Stream::Tls(s) => return s.write_parts(&[head, data]),
        };
        let mut bufs = [io::IoSlice::new(head), io::IoSlice::new(data)];
        let mut bufs = &mut bufs[..];
        while !bufs.is_empty() {
            match w.write_vectored(bufs) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
                Ok(n) => io::IoSlice::advance_slices(&mut bufs, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    pub(super) fn read_some(&self, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
        match self {
            Stream::Tls(s) => s.read(buf),
            // SAFETY: `buf` is valid for writes of its length, borrowed mutably for the call.
            Stream::Unix(_) | Stream::Ring(_) => unsafe {
                self.read_some_raw(buf.as_mut_ptr(), buf.len(), fds)
            },
        }
    }

    /// Whether the kernel copies received bytes straight to their destination ([`Self::
    /// read_some_raw`]): a Unix socket or a ring's plaintext end, not a TLS connection
    /// (rustls writes through a slice, and memory a device or a guest changes under us is
    /// never lent as one).
    pub(super) fn reads_raw(&self) -> bool {
        matches!(self, Stream::Unix(_) | Stream::Ring(_))
    }

    /// [`Self::read_some`] into `len` bytes at `ptr` (a window's memory), through the
    /// kernel only; a TLS stream refuses (`Unsupported`).
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must be valid for writes for the duration of the call.
    pub(super) unsafe fn read_some_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        fds: &mut Vec<OwnedFd>,
    ) -> io::Result<usize> {
        match self {
            Stream::Tls(_) => Err(io::Error::from(io::ErrorKind::Unsupported)),
            Stream::Ring(s) => {
                // SAFETY: the caller guarantees `ptr..ptr + len` is writable; `s` is an open
                // socket for the call.
                let n = unsafe { libc::read(s.as_raw_fd(), ptr.cast(), len) };
                if n < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(n as usize)
            }
            Stream::Unix(s) => {
                let mut raw = [-1 as RawFd; MAX_FDS];
                let mut iov = [libc::iovec {
                    iov_base: ptr.cast(),
                    iov_len: len,
                }];
                // SAFETY: the iovec points at memory the caller guarantees writable.
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

    pub(super) fn set_read_timeout(&self, t: Duration) -> io::Result<()> {
        match self {
            Stream::Unix(s) | Stream::Ring(s) => s.set_read_timeout(Some(t)),
            Stream::Tls(s) => {
                s.set_read_timeout(t);
                Ok(())
            }
        }
    }

    /// Reads all of `buf`; with a `deadline`, the whole read ends by then however slowly the
    /// peer trickles bytes (each read's timeout is the time left).
    pub(super) fn read_exact(
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

    /// All of `len` bytes into `ptr` ([`Self::read_some_raw`]), without a deadline.
    ///
    /// # Safety
    ///
    /// As [`Self::read_some_raw`].
    pub(super) unsafe fn read_exact_raw(
        &self,
        mut ptr: *mut u8,
        mut len: usize,
        fds: &mut Vec<OwnedFd>,
    ) -> io::Result<()> {
        while len > 0 {
            // SAFETY: `ptr..ptr + len` stays inside the caller's writable range.
            match unsafe { self.read_some_raw(ptr, len, fds) } {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
                Ok(n) => {
                    ptr = ptr.wrapping_add(n);
                    len -= n;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads and drops `len` bytes (a refused frame's rest) through a small buffer: a
    /// peer's announced length costs no allocation of that size.
    pub(super) fn skip(&self, mut len: usize, fds: &mut Vec<OwnedFd>) -> io::Result<()> {
        let mut buf = [0u8; 16 << 10];
        while len > 0 {
            let n = len.min(buf.len());
            self.read_exact(&mut buf[..n], fds, None)?;
            len -= n;
        }
        Ok(())
    }
}

/// Why reading a frame failed.
pub(super) enum ReadError {
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

/// A whole frame; fails once `deadline` passes (the handshake's bound).
pub(super) fn read_frame_until(
    s: &Stream,
    deadline: Option<Instant>,
) -> std::result::Result<(Header, Vec<u8>, Vec<OwnedFd>), ReadError> {
    let (h, fds) = read_header(s, deadline)?;
    read_payload(s, h, fds, deadline)
}

pub(super) fn read_error(e: io::Error) -> ReadError {
    match e.kind() {
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => ReadError::Closed,
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ReadError::TimedOut,
        _ => ReadError::Io(e),
    }
}

/// A frame's header (and any fds that came with its first bytes).
pub(super) fn read_header(
    s: &Stream,
    deadline: Option<Instant>,
) -> std::result::Result<(Header, Vec<OwnedFd>), ReadError> {
    let mut fds = Vec::new();
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb, &mut fds, deadline)
        .map_err(read_error)?;
    let h = Header::decode(&hb).map_err(|e| ReadError::Protocol(e.to_string()))?;
    Ok((h, fds))
}

/// The payload of the frame whose header was read, into a new buffer.
pub(super) fn read_payload(
    s: &Stream,
    h: Header,
    mut fds: Vec<OwnedFd>,
    deadline: Option<Instant>,
) -> std::result::Result<(Header, Vec<u8>, Vec<OwnedFd>), ReadError> {
    let mut payload = vec![0u8; h.len as usize];
    s.read_exact(&mut payload, &mut fds, deadline)
        .map_err(read_error)?;
    check_fds(&h, &fds)?;
    Ok((h, payload, fds))
}

pub(super) fn check_fds(h: &Header, fds: &[OwnedFd]) -> std::result::Result<(), ReadError> {
    if fds.len() != h.fds as usize {
        return Err(ReadError::Protocol(format!(
            "frame announces {} fds but {} arrived",
            h.fds,
            fds.len()
        )));
    }
    Ok(())
}

pub(super) fn send_raw(
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
