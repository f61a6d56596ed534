//! [`TlsStream`]: a fabric link's TLS connection, read and written by the link's own threads.
//!
//! The link reads frames on its reader thread and writes them from any thread (one at a
//! time, under its writer lock). One rustls connection serves both, behind a mutex that is
//! never held across a wait: the socket is non-blocking, and a reader that needs more
//! records, or a writer whose records do not fit in the socket's buffer, polls without the
//! lock. There is no thread of its own and no socket pair, so a byte is copied once on each
//! side of the encryption (the pump this replaces copied each byte three more times, two of
//! them through the kernel, and woke one more thread per frame).
//!
//! Records are read from the socket in [`READ_BUF`]-sized reads and handed to rustls from
//! that buffer: rustls itself asks for at most 4 KiB per read.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustls::Connection;
use vmm_sys_util::eventfd::EventFd;

use super::LINGER;
use crate::fabric::{FabricError, Result};
use crate::link::lock;

/// Bytes read from the socket at once (records for rustls).
const READ_BUF: usize = 128 << 10;
/// Plaintext encrypted per hold of the lock: the reader waits at most this long's worth of
/// encryption for it. It is also the most a writer queues beyond what the socket took (a
/// writer goes on only once its records are all in the socket), the bound of this stream's
/// send queue.
const WRITE_PIECE: usize = 256 << 10;
/// How long [`TlsStream::shutdown`] waits for room in the socket for its close_notify.
const CLOSE_SEND: Duration = Duration::from_millis(200);

struct Tls {
    conn: Connection,
    /// Records read from the socket, not yet given to rustls: `rbuf[rstart..rend]`.
    rbuf: Box<[u8]>,
    rstart: usize,
    rend: usize,
    /// The socket returned end of file.
    eof: bool,
}

/// A TLS connection on a non-blocking TCP socket, shared by the threads of one link.
pub(crate) struct TlsStream {
    tls: Mutex<Tls>,
    tcp: TcpStream,
    /// The longest a read waits for the peer, in ns (0: no limit); as `SO_RCVTIMEO`.
    read_timeout_ns: AtomicU64,
    /// The longest a write waits for room in the socket, in ns (0: no limit).
    write_timeout_ns: AtomicU64,
    /// [`Self::shutdown`] ran: writes fail, reads drain the socket until the peer closes (or
    /// [`LINGER`]) and then return end of file.
    closed: AtomicBool,
    closed_at: Mutex<Option<Instant>>,
    /// Readable once closed: wakes a thread that polls the socket.
    wake: EventFd,
}

impl std::fmt::Debug for TlsStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsStream")
            .field("tcp", &self.tcp)
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

fn timeout(ns: &AtomicU64) -> Option<Duration> {
    match ns.load(Ordering::Relaxed) {
        0 => None,
        n => Some(Duration::from_nanos(n)),
    }
}

fn store(ns: &AtomicU64, t: Duration) {
    // A zero timeout is refused by sockets (EINVAL); here it would mean "no limit", so it is
    // stored as the smallest limit instead.
    let n = u64::try_from(t.as_nanos()).unwrap_or(u64::MAX).max(1);
    ns.store(n, Ordering::Relaxed);
}

/// Polls `fd` for `events` (and `wake` for input, where given) until `until`; false when the
/// time ran out. A signal ends the wait early (the caller looks again).
fn wait(fd: RawFd, events: i16, wake: Option<RawFd>, until: Option<Instant>) -> io::Result<bool> {
    let mut p = [
        libc::pollfd {
            fd,
            events,
            revents: 0,
        },
        libc::pollfd {
            fd: wake.unwrap_or(-1),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let ms = match until {
        None => -1,
        Some(u) => {
            let left = u.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
        }
    };
    // SAFETY: two valid pollfd entries (a negative fd is ignored by poll) that live for the
    // call; the kernel writes only their `revents`.
    let r = unsafe { libc::poll(p.as_mut_ptr(), 2, ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(true);
        }
        return Err(e);
    }
    Ok(r > 0)
}

fn timed_out() -> io::Error {
    // What a socket with SO_RCVTIMEO / SO_SNDTIMEO returns when its time runs out.
    io::Error::from(io::ErrorKind::WouldBlock)
}

fn closed_err() -> io::Error {
    io::Error::from(io::ErrorKind::BrokenPipe)
}

impl TlsStream {
    /// Takes over a connection whose handshake is done ([`super::handshake`]) and its socket.
    pub(crate) fn new(mut conn: Connection, tcp: TcpStream) -> Result<TlsStream> {
        tcp.set_nonblocking(true)
            .map_err(FabricError::io("make the tls socket non-blocking"))?;
        // Records that arrived with the handshake's last flight are already in rustls.
        conn.process_new_packets()
            .map_err(|e| FabricError::Handshake(format!("tls after the handshake: {e}")))?;
        Ok(TlsStream {
            tls: Mutex::new(Tls {
                conn,
                rbuf: vec![0u8; READ_BUF].into_boxed_slice(),
                rstart: 0,
                rend: 0,
                eof: false,
            }),
            tcp,
            read_timeout_ns: AtomicU64::new(0),
            write_timeout_ns: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            closed_at: Mutex::new(None),
            wake: EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
                .map_err(FabricError::io("eventfd"))?,
        })
    }

    pub(crate) fn set_read_timeout(&self, t: Duration) {
        store(&self.read_timeout_ns, t);
    }

    pub(crate) fn set_write_timeout(&self, t: Duration) {
        store(&self.write_timeout_ns, t);
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Reads plaintext into `buf`: `Ok(0)` at the end of the stream (the peer closed, or this
    /// end did), a `WouldBlock` error when nothing came within the read timeout.
    pub(crate) fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let until = timeout(&self.read_timeout_ns).map(|t| Instant::now() + t);
        loop {
            if self.is_closed() {
                self.linger();
                return Ok(0);
            }
            if let Some(n) = self.read_ready(buf)? {
                return Ok(n);
            }
            if !wait(
                self.tcp.as_raw_fd(),
                libc::POLLIN,
                Some(self.wake.as_raw_fd()),
                until,
            )? {
                return Err(timed_out());
            }
        }
    }

    /// Plaintext now, from what rustls holds or the socket has; `None` when the socket has
    /// nothing yet.
    fn read_ready(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        let mut g = lock(&self.tls);
        let t = &mut *g;
        loop {
            match t.conn.reader().read(buf) {
                Ok(n) => return Ok(Some(n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                // The peer closed the socket without a close_notify: the end of the stream
                // all the same (a truncated frame is the framing's to notice).
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(Some(0)),
                Err(e) => return Err(e),
            }
            if t.rstart == t.rend && !t.eof {
                match (&self.tcp).read(&mut t.rbuf) {
                    Ok(0) => t.eof = true,
                    Ok(n) => (t.rstart, t.rend) = (0, n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                }
            }
            // At the socket's end an empty read tells rustls so.
            let mut records = &t.rbuf[t.rstart..t.rend];
            let n = t.conn.read_tls(&mut records)?;
            t.rstart += n;
            t.conn
                .process_new_packets()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            // Records rustls answers by itself (a key update, an alert): on their way if the
            // socket has room, else with the next write.
            flush_some(&mut t.conn, &self.tcp)?;
        }
    }

    /// After [`Self::shutdown`]: reads and drops what the peer still sends until it closes
    /// too, for at most [`LINGER`] from the shutdown, so that the socket is not closed with
    /// unread data (which sends a reset, see [`LINGER`]).
    fn linger(&self) {
        let until = lock(&self.closed_at).unwrap_or_else(Instant::now) + LINGER;
        let mut sink = [0u8; 4096];
        loop {
            match (&self.tcp).read(&mut sink) {
                Ok(0) => return,
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => return,
            }
            match wait(self.tcp.as_raw_fd(), libc::POLLIN, None, Some(until)) {
                Ok(true) => {}
                Ok(false) | Err(_) => return,
            }
        }
    }

    /// Writes `parts` as one contiguous piece of the stream (a frame: its head and its data),
    /// returning once all of it is in the socket.
    pub(crate) fn write_parts(&self, parts: &[&[u8]]) -> io::Result<()> {
        let mut slices: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
        let mut bufs = &mut slices[..];
        while !bufs.is_empty() {
            let mut g = lock(&self.tls);
            if self.is_closed() {
                return Err(closed_err());
            }
            // Up to WRITE_PIECE bytes of the parts left, without copying them together.
            let mut piece = Vec::with_capacity(bufs.len());
            let mut room = WRITE_PIECE;
            for b in bufs.iter() {
                if room == 0 {
                    break;
                }
                let take = b.len().min(room);
                piece.push(IoSlice::new(&b[..take]));
                room -= take;
            }
            let n = g.conn.writer().write_vectored(&piece)?;
            if n == 0 {
                return Err(io::Error::from(io::ErrorKind::WriteZero));
            }
            IoSlice::advance_slices(&mut bufs, n);
            self.flush(g)?;
        }
        Ok(())
    }

    /// Sends every record rustls holds, waiting (without the lock) for room in the socket
    /// for at most the write timeout at a time.
    fn flush<'a>(&'a self, mut g: MutexGuard<'a, Tls>) -> io::Result<()> {
        loop {
            flush_some(&mut g.conn, &self.tcp)?;
            if !g.conn.wants_write() {
                return Ok(());
            }
            drop(g);
            let until = timeout(&self.write_timeout_ns).map(|t| Instant::now() + t);
            if !wait(
                self.tcp.as_raw_fd(),
                libc::POLLOUT,
                Some(self.wake.as_raw_fd()),
                until,
            )? {
                return Err(timed_out());
            }
            if self.is_closed() {
                return Err(closed_err());
            }
            g = lock(&self.tls);
        }
    }

    /// Ends the stream: sends close_notify (waiting at most [`CLOSE_SEND`] for room) and
    /// shuts down the socket's sending side. Writes fail from now on; a read returns end of
    /// file once the peer has closed too (see [`Self::linger`]). Threads waiting on the
    /// socket are woken.
    pub(crate) fn shutdown(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        *lock(&self.closed_at) = Some(Instant::now());
        let _ = self.wake.write(1);
        let until = Instant::now() + CLOSE_SEND;
        let mut g = lock(&self.tls);
        g.conn.send_close_notify();
        loop {
            if flush_some(&mut g.conn, &self.tcp).is_err() || !g.conn.wants_write() {
                break;
            }
            match wait(self.tcp.as_raw_fd(), libc::POLLOUT, None, Some(until)) {
                Ok(true) => {}
                Ok(false) | Err(_) => break,
            }
        }
        drop(g);
        let _ = self.tcp.shutdown(Shutdown::Write);
    }
}

/// Writes records to the socket until rustls has none left or the socket is full.
fn flush_some(conn: &mut Connection, tcp: &TcpStream) -> io::Result<()> {
    while conn.wants_write() {
        match conn.write_tls(&mut &*tcp) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::Arc;

    /// Two ends of a TLS connection over loopback.
    fn pair() -> (Arc<TlsStream>, Arc<TlsStream>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let server = std::thread::spawn(move || {
            let (tcp, _) = l.accept().unwrap();
            let (conn, _) = super::super::handshake(&tcp, false, deadline).unwrap();
            TlsStream::new(conn, tcp).unwrap()
        });
        let tcp = TcpStream::connect(addr).unwrap();
        let (conn, _) = super::super::handshake(&tcp, true, deadline).unwrap();
        let client = TlsStream::new(conn, tcp).unwrap();
        (Arc::new(client), Arc::new(server.join().unwrap()))
    }

    fn read_exact(s: &TlsStream, mut buf: &mut [u8]) -> io::Result<()> {
        while !buf.is_empty() {
            match s.read(buf)? {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                n => buf = &mut buf[n..],
            }
        }
        Ok(())
    }

    fn pattern(seed: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn both_directions_at_once_deliver_every_byte_in_order() {
        let (a, b) = pair();
        // Larger than a write piece, a read buffer and the socket buffers, so that each side
        // waits for the other mid-write while it also reads.
        let big = 3 * WRITE_PIECE + 12345;
        let send = |s: Arc<TlsStream>, seed: u8| {
            std::thread::spawn(move || {
                let head = [seed; 7];
                s.write_parts(&[&head, &pattern(seed, big)]).unwrap();
            })
        };
        let ta = send(Arc::clone(&a), 1);
        let tb = send(Arc::clone(&b), 2);
        for (s, seed) in [(&a, 2u8), (&b, 1u8)] {
            let mut head = [0u8; 7];
            read_exact(s, &mut head).unwrap();
            assert_eq!(head, [seed; 7]);
            let mut got = vec![0u8; big];
            read_exact(s, &mut got).unwrap();
            assert!(got == pattern(seed, big), "data from side {seed} differs");
        }
        ta.join().unwrap();
        tb.join().unwrap();
    }

    #[test]
    fn a_read_times_out_as_a_socket_does_and_a_shutdown_ends_both_sides() {
        let (a, b) = pair();
        b.set_read_timeout(Duration::from_millis(50));
        let e = b.read(&mut [0u8; 16]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);

        // What was written before the shutdown arrives, then the end.
        a.write_parts(&[b"last words"]).unwrap();
        a.shutdown();
        let mut got = [0u8; 10];
        read_exact(&b, &mut got).unwrap();
        assert_eq!(&got, b"last words");
        assert_eq!(b.read(&mut [0u8; 16]).unwrap(), 0);
        // The closed side refuses writes and reads its end once the peer closes too.
        assert_eq!(
            a.write_parts(&[b"x"]).unwrap_err().kind(),
            io::ErrorKind::BrokenPipe
        );
        b.shutdown();
        let t = Instant::now();
        assert_eq!(a.read(&mut [0u8; 16]).unwrap(), 0);
        assert!(
            t.elapsed() < LINGER,
            "the closed side lingered {:?}",
            t.elapsed()
        );
    }

    #[test]
    fn a_shutdown_wakes_a_blocked_reader_and_a_writer_stuck_on_a_full_socket() {
        let (a, _b) = pair();
        // Nobody reads b: a's writes fill both sockets' buffers and then wait.
        let writer = {
            let a = Arc::clone(&a);
            std::thread::spawn(move || {
                let chunk = vec![7u8; WRITE_PIECE];
                loop {
                    if let Err(e) = a.write_parts(&[&chunk]) {
                        return e.kind();
                    }
                }
            })
        };
        let reader = {
            let a = Arc::clone(&a);
            std::thread::spawn(move || a.read(&mut [0u8; 16]))
        };
        std::thread::sleep(Duration::from_millis(300));
        assert!(!writer.is_finished() && !reader.is_finished());
        let t = Instant::now();
        a.shutdown();
        assert_eq!(writer.join().unwrap(), io::ErrorKind::BrokenPipe);
        // The reader lingers for the peer's close (which never comes here), then ends.
        assert_eq!(reader.join().unwrap().unwrap(), 0);
        assert!(t.elapsed() < LINGER + Duration::from_secs(2));
    }

    #[test]
    fn a_writer_whose_peer_stops_reading_fails_after_the_write_timeout() {
        let (a, _b) = pair();
        a.set_write_timeout(Duration::from_millis(200));
        let chunk = vec![7u8; WRITE_PIECE];
        let t = Instant::now();
        let e = loop {
            if let Err(e) = a.write_parts(&[&chunk]) {
                break e;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "writes never blocked"
            );
        };
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
    }
}
