//! The tcp backend: the same link over TCP for hosts without NTB hardware.
//!
//! Window reads and writes become request/reply messages of at most
//! [`MAX_DATA_CHUNK`](crate::wire::MAX_DATA_CHUNK) bytes, a few kept in flight (a slow path,
//! like vfio-user without fds); doorbells and scratchpad writes become one-way messages.
//! Direct mappings and fd passing fail with a clear error so the VMM can fall back to trapping.
//! Every link runs inside TLS 1.3 ([`crate::tls`]).

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
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
    s.set_nodelay(true)
        .map_err(FabricError::io("set TCP_NODELAY"))?;
    // TLS first, then the fabric handshake, both within connect_timeout.
    let deadline = std::time::Instant::now() + cfg.connect_timeout;
    let (stream, opts) = LinkOpts::tls(s, true, deadline, cfg)?;
    Ok(Box::new(establish(stream, local, cfg, true, opts)?))
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
                s.set_nodelay(true)?;
                Ok((Accepted::Tls(s), from.to_string()))
            },
            timeout,
        )?;
        Ok(Box::new(ep))
    }
}
