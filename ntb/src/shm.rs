//! The shm backend: same host, zero software on the data path.
//!
//! The control channel is a Unix stream socket. Windows are memfds passed with SCM_RIGHTS;
//! mapping a peer window is an `mmap` of its fd, so loads and stores reach the peer's memory
//! directly (like TLPs through an NTB). Doorbells are eventfds passed the same way, so KVM
//! ioeventfd/irqfd can be wired to them; scratchpads are a shared memfd page.

use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::ControlAddr;
use crate::fabric::{Endpoint, FabricError, LinkConfig, Listener, NodeId, Result};
use crate::link::{establish, Stream};

/// Connects to a node listening at `path`.
pub fn connect(path: &Path, local: &NodeId, cfg: &LinkConfig) -> Result<Box<dyn Endpoint>> {
    let s = UnixStream::connect(path).map_err(|source| FabricError::Io {
        op: "connect to shm control socket",
        source,
    })?;
    Ok(Box::new(establish(Stream::Unix(s), local, cfg, true)?))
}

/// Listens on a Unix socket; the socket file is removed on drop.
pub struct ShmListener {
    listener: UnixListener,
    path: PathBuf,
    local: NodeId,
    cfg: LinkConfig,
}

impl ShmListener {
    /// Binds `path`, replacing a stale socket file.
    pub fn bind(path: &Path, local: &NodeId, cfg: &LinkConfig) -> Result<ShmListener> {
        cfg.validate()?;
        if let Ok(m) = std::fs::symlink_metadata(path) {
            use std::os::unix::fs::FileTypeExt;
            if m.file_type().is_socket() {
                let _ = std::fs::remove_file(path);
            }
        }
        let listener = UnixListener::bind(path).map_err(|source| FabricError::Io {
            op: "bind shm control socket",
            source,
        })?;
        Ok(ShmListener {
            listener,
            path: path.to_path_buf(),
            local: local.clone(),
            cfg: cfg.clone(),
        })
    }
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Waits until `fd` is readable; false on timeout.
pub(crate) fn wait_readable(
    fd: std::os::fd::BorrowedFd<'_>,
    timeout: Option<Duration>,
) -> Result<bool> {
    let deadline = timeout.map(|t| std::time::Instant::now() + t);
    loop {
        let ms = match deadline {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(std::time::Instant::now());
                i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
            }
        };
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r > 0 {
            return Ok(true);
        }
        if r == 0 {
            return Ok(false);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(FabricError::Io {
                op: "poll listener",
                source: e,
            });
        }
    }
}

impl Listener for ShmListener {
    fn local_addr(&self) -> ControlAddr {
        ControlAddr::Unix(self.path.clone())
    }

    fn accept(&self, timeout: Option<Duration>) -> Result<Box<dyn Endpoint>> {
        if !wait_readable(self.listener.as_fd(), timeout)? {
            return Err(FabricError::Timeout(timeout.unwrap_or_default()));
        }
        let (s, _) = self.listener.accept().map_err(|source| FabricError::Io {
            op: "accept shm link",
            source,
        })?;
        Ok(Box::new(establish(
            Stream::Unix(s),
            &self.local,
            &self.cfg,
            false,
        )?))
    }
}
