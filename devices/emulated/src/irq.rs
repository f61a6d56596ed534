//! The interrupt seam.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

/// Which interrupt mechanism the borrower's driver configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InterruptMode {
    /// MSI-X enabled (function not masked) with this many vectors available.
    MsiX {
        /// Number of vectors in the table.
        vectors: u16,
    },
    /// Legacy INTx (MSI-X disabled, INTx not disabled in the command register).
    Intx,
    /// Nothing may be signalled.
    None,
}

/// Where a device's interrupts go. The borrower's VMM owns the MSI-X table and per-vector
/// masks; the device only signals vectors.
pub trait InterruptSink: Send + Sync {
    /// Signal MSI-X vector `vector`.
    fn signal_msix(&self, vector: u16);
    /// Set the INTx line level (true = asserted). Asserting while already asserted signals
    /// the line again (devices do that after an INTx resample finds the condition pending).
    fn set_intx(&self, asserted: bool);
    /// The mode the borrower configured right now.
    fn mode(&self) -> InterruptMode;
}

/// Production sink: one eventfd per MSI-X vector plus one for INTx (level changes and
/// re-assertions are signalled on the INTx eventfd; the level is readable with
/// [`EventFdInterrupts::intx_level`]).
/// The mode is set by whoever shadows the borrower's config space.
pub struct EventFdInterrupts {
    vectors: Vec<EventFd>,
    intx: EventFd,
    intx_level: AtomicBool,
    // 0 = none, 1 = intx, 2 = msix
    mode: AtomicU32,
}

impl EventFdInterrupts {
    /// Create `vectors` MSI-X eventfds and an INTx eventfd; the mode starts as INTx.
    pub fn new(vectors: u16) -> std::io::Result<Arc<Self>> {
        let mut v = Vec::with_capacity(vectors as usize);
        for _ in 0..vectors {
            v.push(EventFd::new(libc::EFD_NONBLOCK)?);
        }
        Ok(Arc::new(EventFdInterrupts {
            vectors: v,
            intx: EventFd::new(libc::EFD_NONBLOCK)?,
            intx_level: AtomicBool::new(false),
            mode: AtomicU32::new(1),
        }))
    }

    /// The eventfd of MSI-X vector `n`.
    pub fn vector_fd(&self, n: u16) -> Option<&EventFd> {
        self.vectors.get(n as usize)
    }

    /// The INTx eventfd (signalled on every level change).
    pub fn intx_fd(&self) -> &EventFd {
        &self.intx
    }

    /// Current INTx level.
    pub fn intx_level(&self) -> bool {
        self.intx_level.load(Ordering::Acquire)
    }

    /// Record the mode the borrower configured.
    pub fn set_mode(&self, mode: InterruptMode) {
        let m = match mode {
            InterruptMode::None => 0,
            InterruptMode::Intx => 1,
            InterruptMode::MsiX { .. } => 2,
        };
        self.mode.store(m, Ordering::Release);
    }
}

impl InterruptSink for EventFdInterrupts {
    fn signal_msix(&self, vector: u16) {
        if let Some(fd) = self.vectors.get(vector as usize) {
            if let Err(e) = fd.write(1) {
                log::warn!("msi-x vector {vector}: eventfd write failed: {e}");
            }
        }
    }

    fn set_intx(&self, asserted: bool) {
        if self.intx_level.swap(asserted, Ordering::AcqRel) != asserted || asserted {
            if let Err(e) = self.intx.write(1) {
                log::warn!("intx eventfd write failed: {e}");
            }
        }
    }

    fn mode(&self) -> InterruptMode {
        match self.mode.load(Ordering::Acquire) {
            0 => InterruptMode::None,
            1 => InterruptMode::Intx,
            _ => InterruptMode::MsiX {
                vectors: self.vectors.len() as u16,
            },
        }
    }
}
