//! The shm backend: same host, zero software on the data path.
//!
//! The control channel is a Unix stream socket. Windows are memfds passed with SCM_RIGHTS;
//! mapping a peer window is an `mmap` of its fd, so loads and stores reach the peer's memory
//! directly (like TLPs through an NTB). Doorbells are eventfds passed the same way, so KVM
//! ioeventfd/irqfd can be wired to them; scratchpads are a shared memfd page.

use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::accept::{Accepted, Handshakes};
use crate::config::ControlAddr;
use crate::fabric::{Endpoint, FabricError, LinkConfig, Listener, NodeId, Result};
use crate::link::{establish, LinkOpts, Stream};

/// Connects to a node listening at `path`.
pub fn connect(path: &Path, local: &NodeId, cfg: &LinkConfig) -> Result<Box<dyn Endpoint>> {
    let s = UnixStream::connect(path).map_err(|source| FabricError::Io {
        op: "connect to shm control socket",
        source,
    })?;
    Ok(Box::new(establish(
        Stream::Unix(s),
        local,
        cfg,
        true,
        LinkOpts {
            peer_addr: Some(path.display().to_string()),
            ..LinkOpts::default()
        },
    )?))
}

/// Listens on a Unix socket (mode 0600, or 0660 for [`LinkConfig::control_group`]); the
/// socket file is removed on drop.
pub struct ShmListener {
    listener: UnixListener,
    path: PathBuf,
    file: crate::sock::SocketFile,
    handshakes: Handshakes,
}

impl ShmListener {
    /// Binds `path` with mode 0600 (0660 and the group of [`LinkConfig::control_group`])
    /// from the start, replacing a stale socket file; refuses a path a live listener holds,
    /// or one that is not a socket ([`crate::sock`]).
    pub fn bind(path: &Path, local: &NodeId, cfg: &LinkConfig) -> Result<ShmListener> {
        cfg.validate()?;
        let (listener, file) = match &cfg.control_group {
            None => crate::sock::bind_private(path)?,
            Some(group) => crate::sock::bind_shared(path, group)?,
        };
        listener
            .set_nonblocking(true)
            .map_err(FabricError::io("make the shm listener non-blocking"))?;
        Ok(ShmListener {
            listener,
            path: path.to_path_buf(),
            file,
            handshakes: Handshakes::new(local, cfg, false)?,
        })
    }
}

impl Drop for ShmListener {
    /// Removes the socket file unless another listener has replaced it since.
    fn drop(&mut self) {
        self.file.remove_if_ours(&self.path);
    }
}

impl Listener for ShmListener {
    fn handshakes_pending(&self) -> Option<usize> {
        Some(self.handshakes.pending())
    }

    fn handshake_slots(&self) -> usize {
        self.handshakes.slots()
    }

    fn local_addr(&self) -> ControlAddr {
        ControlAddr::Unix(self.path.clone())
    }

    /// The handshakes run off this thread ([`Handshakes`]): the first link to finish one is
    /// returned, so a silent peer delays nobody.
    fn accept(&self, timeout: Option<Duration>) -> Result<Box<dyn Endpoint>> {
        let ep = self.handshakes.accept(
            self.listener.as_fd(),
            || {
                let (s, _) = self.listener.accept()?;
                s.set_nonblocking(false)?;
                // The peer's uid is the source its handshakes are counted under.
                let s = Stream::Unix(s);
                let from = s.peer_desc();
                Ok((Accepted::Plain(s), from))
            },
            timeout,
        )?;
        Ok(Box::new(ep))
    }
}
