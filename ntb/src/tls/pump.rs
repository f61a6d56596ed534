//! The pump: a thread that moves bytes between a TLS connection's TCP socket (records) and
//! one end of a Unix socket pair (plaintext), for the streams whose users want a plain
//! socket: the live-migration stream ([`super::client`], [`super::server`]). Fabric links
//! use [`super::stream::TlsStream`] instead, which has no thread and no socket pair.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustls::Connection;

use super::LINGER;
use crate::fabric::{FabricError, Result};

/// Plaintext the pump holds for the link before it stops reading the socket.
const PUMP_CAP: usize = 4 << 20;
/// Bytes the pump moves per read (plaintext from the link, or decrypted from rustls): 16 TLS
/// records, fewer trips around the poll loop than 64 KiB.
const BUF: usize = 256 << 10;

/// A tcp connection inside TLS: the plaintext end for the link, the session's channel
/// binding, and the pump thread (ends when either side closes).
pub(crate) struct TlsLink {
    pub(crate) plain: UnixStream,
    pub(crate) binding: Vec<u8>,
    pub(crate) pump: JoinHandle<()>,
}

/// Starts the pump of a connection that finished its handshake ([`super::handshake`]).
pub(crate) fn start(conn: Connection, tcp: TcpStream, binding: Vec<u8>) -> Result<TlsLink> {
    let (plain, inner) = UnixStream::pair().map_err(FabricError::io("socketpair"))?;
    let peer = tcp.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let pump = std::thread::Builder::new()
        .name("ntb-tls".into())
        .spawn(move || {
            if let Err(e) = pump(conn, tcp, inner) {
                log::debug!("tls link with {peer} ended: {e}");
            }
        })
        .map_err(FabricError::io("spawn tls thread"))?;
    Ok(TlsLink {
        plain,
        binding,
        pump,
    })
}

fn poll2(
    tcp: &TcpStream,
    tcp_ev: i16,
    local: &UnixStream,
    local_ev: i16,
) -> io::Result<(i16, i16)> {
    let mut p = [
        libc::pollfd {
            fd: tcp.as_raw_fd(),
            events: tcp_ev,
            revents: 0,
        },
        libc::pollfd {
            fd: local.as_raw_fd(),
            events: local_ev,
            revents: 0,
        },
    ];
    // SAFETY: two valid pollfds; a timeout so a stuck state is re-examined.
    let r = unsafe { libc::poll(p.as_mut_ptr(), 2, 1000) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok((0, 0));
        }
        return Err(e);
    }
    Ok((p[0].revents, p[1].revents))
}

fn would_block(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

/// Moves bytes both ways until either side closes; then closes the other.
fn pump(mut conn: Connection, tcp: TcpStream, local: UnixStream) -> io::Result<()> {
    tcp.set_nonblocking(true)?;
    local.set_nonblocking(true)?;
    let close = |tcp: &TcpStream, local: &UnixStream| {
        let _ = tcp.shutdown(Shutdown::Both);
        let _ = local.shutdown(Shutdown::Both);
    };
    // Plaintext for the link, `to_local[start..end]`, in one buffer allocated once: decrypted
    // straight into it and written to the link from it, no bounce copy. Written bytes are
    // skipped by `start` (both ends return to 0 when it drains), and the rest is moved to the
    // front only when the tail has no room for a read, at most once per PUMP_CAP bytes.
    let mut to_local = vec![0u8; 2 * PUMP_CAP];
    let (mut start, mut end) = (0usize, 0usize);
    let mut buf = vec![0u8; BUF];
    let mut peer_done = false;
    let r = (|| -> io::Result<()> {
        loop {
            // Plaintext rustls decrypted, to the link.
            while end - start < PUMP_CAP {
                if to_local.len() - end < BUF {
                    to_local.copy_within(start..end, 0);
                    (start, end) = (0, end - start);
                }
                match conn.reader().read(&mut to_local[end..]) {
                    Ok(0) => {
                        peer_done = true;
                        break;
                    }
                    Ok(n) => end += n,
                    Err(e) if would_block(&e) => break,
                    Err(_) => {
                        peer_done = true;
                        break;
                    }
                }
            }
            while start < end {
                match (&local).write(&to_local[start..end]) {
                    Ok(n) => start += n,
                    Err(e) if would_block(&e) => break,
                    Err(_) => {
                        // The link stopped reading (it is closing): drop what it would have
                        // read, but keep forwarding what it still writes (its GOODBYE).
                        start = end;
                    }
                }
            }
            if start == end {
                (start, end) = (0, 0);
            }
            while conn.wants_write() {
                match conn.write_tls(&mut &tcp) {
                    Ok(_) => {}
                    Err(e) if would_block(&e) => break,
                    Err(e) => return Err(e),
                }
            }
            if peer_done && start == end {
                return Ok(());
            }
            let mut tcp_ev = 0;
            if !peer_done && end - start < PUMP_CAP {
                tcp_ev |= libc::POLLIN;
            }
            if conn.wants_write() {
                tcp_ev |= libc::POLLOUT;
            }
            let mut local_ev = 0;
            if !conn.wants_write() {
                local_ev |= libc::POLLIN;
            }
            if start < end {
                local_ev |= libc::POLLOUT;
            }
            let (tr, lr) = poll2(&tcp, tcp_ev, &local, local_ev)?;
            let bad = libc::POLLERR | libc::POLLHUP;
            if tr & (libc::POLLIN | bad) != 0 && !peer_done {
                match conn.read_tls(&mut &tcp) {
                    Ok(0) => peer_done = true,
                    Ok(_) => {
                        conn.process_new_packets()
                            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                    }
                    Err(e) if would_block(&e) => {}
                    Err(_) => peer_done = true,
                }
            }
            if lr & (libc::POLLIN | bad) != 0 && local_ev & libc::POLLIN != 0 {
                match (&local).read(&mut buf) {
                    Ok(0) => {
                        // The link closed: say goodbye to the peer (best effort), then wait
                        // briefly for it to close too. Closing a TCP socket with unread data
                        // sends a reset, which can destroy our last records (the fabric's
                        // GOODBYE) in the peer's receive queue before it reads them.
                        conn.send_close_notify();
                        tcp.set_nonblocking(false)?;
                        tcp.set_write_timeout(Some(Duration::from_millis(200)))?;
                        while conn.wants_write() {
                            if conn.write_tls(&mut &tcp).is_err() {
                                break;
                            }
                        }
                        let _ = tcp.shutdown(Shutdown::Write);
                        let until = Instant::now() + LINGER;
                        let mut sink = [0u8; 4096];
                        while let Some(left) = until.checked_duration_since(Instant::now()) {
                            let _ = tcp.set_read_timeout(Some(left.max(Duration::from_millis(1))));
                            match (&tcp).read(&mut sink) {
                                Ok(0) | Err(_) => break,
                                Ok(_) => {}
                            }
                        }
                        return Ok(());
                    }
                    Ok(n) => conn.writer().write_all(&buf[..n])?,
                    Err(e) if would_block(&e) => {}
                    Err(e) => return Err(e),
                }
            }
        }
    })();
    close(&tcp, &local);
    r
}
