//! Borrower side of the version 4 migration requests ([`crate::protocol::migration`]): the
//! device dirty log, the hand-over quiesce and the lease transfer.

use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::sync::Arc;

use ntb::FabricKind;
use vmm_sys_util::eventfd::EventFd;

use super::{ClientError, ClientIrq, Lease, LenderClient};
use crate::protocol::migration::MIGRATION_VERSION;
use crate::protocol::{
    self, AcceptMap, DirtyBitmap, DirtyLogFetch, DirtyLogStarted, HandoverQuiesced, IrqKind,
    IrqTarget, LeaseRef, QuiesceHandover, Request, TransferAccept, TransferCreate, TransferTicket,
};

/// How long a hand-over quiesce waits for the interrupts relayed before its reply to reach
/// their eventfds (two thread hand-offs; generous for a loaded host).
const SETTLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

impl super::Inner {
    /// [`ClientError::MigrationUnsupported`] unless the session speaks version 4.
    fn check_migration(&self) -> Result<(), ClientError> {
        let version = self.version();
        if version < MIGRATION_VERSION {
            return Err(ClientError::MigrationUnsupported {
                lender: self.lender.clone(),
                version,
            });
        }
        Ok(())
    }
}

impl Lease {
    /// Starts the device dirty log; `Ok(true)` when the lender tracks the device's writes
    /// page by page, `Ok(false)` when every fetch reports the whole window (VFIO).
    pub fn start_dirty_log(&self) -> Result<bool, ClientError> {
        self.inner.check_migration()?;
        let r = Request::DirtyLogStart(LeaseRef { lease: self.id });
        let (s, _): (DirtyLogStarted, _) = self.inner.call(&r, Vec::new())?;
        Ok(s.exact)
    }

    /// The pages of `[iova, iova + len)` the device wrote since the previous fetch (and
    /// clears them). `len` 0: the span of the lease's DMA windows.
    pub fn fetch_dirty_log(&self, iova: u64, len: u64) -> Result<DirtyBitmap, ClientError> {
        self.inner.check_migration()?;
        let r = Request::DirtyLogFetch(DirtyLogFetch {
            lease: self.id,
            iova,
            len,
        });
        Ok(self.inner.call(&r, Vec::new())?.0)
    }

    /// Stops the device dirty log.
    pub fn stop_dirty_log(&self) -> Result<(), ClientError> {
        self.inner.check_migration()?;
        let r = Request::DirtyLogStop(LeaseRef { lease: self.id });
        self.inner.call::<()>(&r, Vec::new()).map(|_| ())
    }

    /// Quiesces the device for a hand-over and waits up to `timeout_ms` for its DMA to
    /// drain; interrupts raised from now on are held by the lender and delivered by
    /// [`Lease::quiesce`]`(false)` to the targets wired then.
    pub fn quiesce_for_handover(&self, timeout_ms: u32) -> Result<HandoverQuiesced, ClientError> {
        self.inner.check_migration()?;
        let r = Request::QuiesceHandover(QuiesceHandover {
            lease: self.id,
            timeout_ms,
        });
        let q: HandoverQuiesced = self.inner.call(&r, Vec::new())?.0;
        // Interrupts relayed before the reply (tcp) must reach their eventfds before the
        // caller saves the VM's interrupt state.
        if !self.inner.settle_events(SETTLE_TIMEOUT) {
            return Err(ClientError::EventsUnsettled {
                lender: self.inner.lender.clone(),
                lease: self.id,
                waited_ms: SETTLE_TIMEOUT.as_millis() as u64,
            });
        }
        Ok(q)
    }

    /// Authorises moving this lease to `to_node`/`to_vm`: the ticket goes to the destination,
    /// which presents it with [`LenderClient::accept_transfer`]. Until then this lease is
    /// fully ours.
    pub fn create_transfer(
        &self,
        to_node: &str,
        to_vm: &str,
    ) -> Result<TransferTicket, ClientError> {
        self.inner.check_migration()?;
        let r = Request::TransferCreate(TransferCreate {
            lease: self.id,
            to_node: to_node.to_string(),
            to_vm: to_vm.to_string(),
        });
        Ok(self.inner.call(&r, Vec::new())?.0)
    }

    /// Withdraws the lease's transfer ticket.
    pub fn cancel_transfer(&self) -> Result<(), ClientError> {
        self.inner.check_migration()?;
        let r = Request::TransferCancel(LeaseRef { lease: self.id });
        self.inner.call::<()>(&r, Vec::new()).map(|_| ())
    }

    /// The lease moved to another borrower (a destination accepted our transfer ticket):
    /// from now on its handle is inert — dropping it returns nothing (the lender no longer
    /// knows it on this link). For a handle shared by several owners; see [`Lease::moved`].
    pub fn mark_moved(&self) {
        self.moved.store(true, std::sync::atomic::Ordering::Release);
        self.inner.forget_routes(self.id, None);
    }

    /// Whether [`Lease::mark_moved`] was called.
    pub fn is_moved(&self) -> bool {
        self.moved.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The lease moved to another borrower ([`crate::protocol::Event::LeaseMoved`]): forget
    /// it without returning it.
    pub fn moved(mut self) {
        self.returned = true;
        self.inner.forget_routes(self.id, None);
    }
}

impl LenderClient {
    /// Takes over the lease of `ticket` for `vm`, with our DMA windows `maps` (at the IOVAs
    /// the source had) and MSI-X `msix` targets (may be empty: wire them with
    /// [`Lease::set_irqs`]). The device is not reset; resume it with [`Lease::quiesce`]
    /// `(false)`, which delivers the interrupts held during the hand-over. On links without
    /// fd passing (tcp) eventfd targets are wired by a SET_IRQS right after the accept; if
    /// that fails the lease, already ours, is returned (the device is reset).
    pub fn accept_transfer(
        &self,
        ticket: &TransferTicket,
        vm: &str,
        maps: &[AcceptMap],
        msix: &[ClientIrq<'_>],
    ) -> Result<Lease, ClientError> {
        self.inner.check_migration()?;
        // Without fd passing (tcp) the targets are wired by SET_IRQS right after the accept,
        // which routes relayed interrupts to the eventfds; nothing is lost meanwhile: the
        // device's interrupts are held until the resume.
        let pass_fds = self.inner.ep.kind() == FabricKind::Shm;
        let mut fds: Vec<OwnedFd> = Vec::new();
        let mut targets = Vec::with_capacity(msix.len());
        for m in msix.iter().filter(|_| pass_fds) {
            targets.push(match m {
                ClientIrq::None => IrqTarget::None,
                ClientIrq::Doorbell(b) => IrqTarget::Doorbell(*b),
                ClientIrq::Event => IrqTarget::Event,
                ClientIrq::EventFd(e) => {
                    let i = u8::try_from(fds.len()).map_err(|_| {
                        ClientError::BadReply("more than 255 eventfds in one accept".into())
                    })?;
                    let dup = e.try_clone().map_err(|source| ClientError::Os {
                        what: "duplicating an interrupt eventfd",
                        source,
                    })?;
                    // SAFETY: `dup` is a fresh eventfd we own; ownership moves to the OwnedFd.
                    fds.push(unsafe { OwnedFd::from_raw_fd(dup.into_raw_fd()) });
                    IrqTarget::Fd(i)
                }
            });
        }
        let r = Request::TransferAccept(TransferAccept {
            lease: ticket.lease,
            ticket: ticket.ticket.clone(),
            vm: vm.to_string(),
            maps: maps.to_vec(),
            msix: targets,
        });
        let (_, payload, mut fds) = self.inner.call_raw(&r, fds)?;
        let b = protocol::decode_borrowed(&payload, self.inner.version())?;
        let notify = match b.notify_fd {
            Some(i) if usize::from(i) < fds.len() => {
                let fd = fds.swap_remove(usize::from(i));
                // SAFETY: the lender sent this fd as an eventfd; we own it exclusively.
                Some(unsafe { EventFd::from_raw_fd(fd.into_raw_fd()) })
            }
            Some(i) => {
                return Err(ClientError::BadReply(format!(
                    "notify eventfd #{i} missing from the accept reply"
                )))
            }
            None => None,
        };
        let lease = Lease {
            inner: Arc::clone(&self.inner),
            id: b.lease,
            info: b.info,
            notify,
            returned: false,
            moved: std::sync::atomic::AtomicBool::new(false),
        };
        if !pass_fds && !msix.is_empty() {
            lease.set_irqs(IrqKind::Msix, msix)?;
        }
        Ok(lease)
    }
}
