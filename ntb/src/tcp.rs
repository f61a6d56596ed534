//! The tcp backend: the same link over TCP for hosts without NTB hardware.
//!
//! Window reads and writes become request/reply messages of at most
//! [`MAX_DATA_CHUNK`](crate::wire::MAX_DATA_CHUNK) bytes, a few kept in flight (a slow path,
//! like vfio-user without fds); doorbells and scratchpad writes become one-way messages.
//! Direct mappings and fd passing fail with a clear error so the VMM can fall back to trapping.
//! Every link runs inside TLS 1.3 ([`crate::tls`]).

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::time::Duration;

use crate::accept::{Accepted, Handshakes};
use crate::config::ControlAddr;
use crate::fabric::{Endpoint, FabricError, LinkConfig, Listener, NodeId, Result};
use crate::link::{establish, LinkOpts};

/// Connects to a node listening at `addr`.
pub fn connect(addr: SocketAddr, local: &NodeId, cfg: &LinkConfig) -> Result<Box<dyn Endpoint>> {
    let s = TcpStream::connect_timeout(&addr, cfg.connect_timeout).map_err(|source| {
        FabricError::Io {
            op: "connect to tcp control address",
            source,
        }
    })?;
    tune(&s).map_err(FabricError::io(
        "set TCP_NODELAY and TCP_THIN_LINEAR_TIMEOUTS on the link",
    ))?;
    // TLS first, then the fabric handshake, both within connect_timeout.
    let deadline = std::time::Instant::now() + cfg.connect_timeout;
    let (stream, opts) = LinkOpts::tls(s, true, deadline, cfg)?;
    Ok(Box::new(establish(stream, local, cfg, true, opts)?))
}

/// Socket options of a link's TCP connection, on both ends.
///
/// - `TCP_NODELAY`: frames are small and latency-bound (doorbells, heartbeats, replies).
/// - `TCP_THIN_LINEAR_TIMEOUTS`: a link that is only heartbeating is a thin stream (fewer
///   than four segments in flight). Under a burst of loss, TCP's exponential retransmission
///   backoff (0.2, 0.4, 0.8, 1.6, 3.2 s, ...) would otherwise hold back every heartbeat
///   queued behind one lost segment for longer than the peer timeout, after the link has
///   recovered, and a link that only lost packets would be declared gone and its leases
///   reclaimed. With this option the kernel retransmits a thin stream at its plain RTO for
///   the first six timeouts. A dead link is still declared gone by the peer timeout, which
///   counts the silence of heartbeats, not retransmissions.
fn tune(s: &TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let on: libc::c_int = 1;
    // SAFETY: a valid socket fd borrowed from `s`; `on` is a c_int that outlives the call and
    // its size is passed; the kernel only reads it.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_THIN_LINEAR_TIMEOUTS,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Listens on a TCP address.
pub struct TcpFabricListener {
    listener: TcpListener,
    handshakes: Handshakes,
}

impl TcpFabricListener {
    pub fn bind(addr: SocketAddr, local: &NodeId, cfg: &LinkConfig) -> Result<TcpFabricListener> {
        cfg.validate()?;
        let listener = TcpListener::bind(addr).map_err(|source| FabricError::Io {
            op: "bind tcp control address",
            source,
        })?;
        listener
            .set_nonblocking(true)
            .map_err(FabricError::io("make the tcp listener non-blocking"))?;
        Ok(TcpFabricListener {
            listener,
            handshakes: Handshakes::new(local, cfg, true)?,
        })
    }
}

impl Listener for TcpFabricListener {
    fn handshakes_pending(&self) -> Option<usize> {
        Some(self.handshakes.pending())
    }

    fn handshake_slots(&self) -> usize {
        self.handshakes.slots()
    }

    fn local_addr(&self) -> ControlAddr {
        match self.listener.local_addr() {
            Ok(a) => ControlAddr::Tcp(a),
            Err(_) => ControlAddr::Tcp(SocketAddr::from(([0, 0, 0, 0], 0))),
        }
    }

    /// The handshakes run off this thread ([`Handshakes`]): the first link to finish one is
    /// returned, so a silent peer delays nobody.
    fn accept(&self, timeout: Option<Duration>) -> Result<Box<dyn Endpoint>> {
        let ep = self.handshakes.accept(
            self.listener.as_fd(),
            || {
                let (s, from) = self.listener.accept()?;
                s.set_nonblocking(false)?;
                tune(&s)?;
                Ok((Accepted::Tls(s), from.to_string()))
            },
            timeout,
        )?;
        Ok(Box::new(ep))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(s: &TcpStream, opt: libc::c_int) -> libc::c_int {
        let mut v: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: a valid socket fd; `v` and `len` are live locals of the sizes passed.
        let r = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::IPPROTO_TCP,
                opt,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(
            r,
            0,
            "getsockopt {opt}: {}",
            std::io::Error::last_os_error()
        );
        v
    }

    #[test]
    fn both_ends_of_a_link_connection_get_linear_timeouts_and_no_delay() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        // The kernel's defaults, so that the check below sees tune's doing.
        assert_eq!(get(&a, libc::TCP_THIN_LINEAR_TIMEOUTS), 0);
        for s in [&a, &b] {
            tune(s).unwrap();
            assert_eq!(get(s, libc::TCP_THIN_LINEAR_TIMEOUTS), 1);
            assert_ne!(get(s, libc::TCP_NODELAY), 0);
        }
    }
}
