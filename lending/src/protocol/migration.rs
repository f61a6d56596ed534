//! Version 4: what live migration of a VM holding lent devices needs from the lender (device
//! dirty log, hand-over quiesce with drain confirmation, atomic lease transfer). Kept apart
//! from the older requests so other version 4 additions merge without conflicts.
//!
//! | opcode | request | reply |
//! |---|---|---|
//! | 0x121 | [`LeaseRef`] DIRTY_LOG_START | [`DirtyLogStarted`] |
//! | 0x122 | [`DirtyLogFetch`] | [`DirtyBitmap`] (fetch-and-clear) |
//! | 0x123 | [`LeaseRef`] DIRTY_LOG_STOP | `()` |
//! | 0x124 | [`QuiesceHandover`] | [`HandoverQuiesced`] (resume: QUIESCE `stop: false`) |
//! | 0x125 | [`TransferCreate`] | [`TransferTicket`] |
//! | 0x126 | [`LeaseRef`] TRANSFER_CANCEL | `()` |
//! | 0x127 | [`TransferAccept`] (+ eventfds on shm) | [`super::Borrowed`] (+ notify eventfd) |
//!
//! Event 0x186 [`LeaseMoved`] (lender → the source borrower): the lease now belongs to the
//! destination; not a lost device.

use serde::{Deserialize, Serialize};

use super::{check_str, dec, enc, invalid, IrqTarget, LeaseRef, ProtocolError, Request, MAX_IRQS};

/// The protocol version that introduced these requests.
pub const MIGRATION_VERSION: u32 = 4;
/// Length of a transfer ticket (random bytes).
pub const TICKET_LEN: usize = 32;
/// Longest hand-over quiesce a borrower may ask for.
pub const MAX_DRAIN_MS: u32 = 30_000;
/// Most DMA windows one TRANSFER_ACCEPT maps.
pub const MAX_ACCEPT_MAPS: usize = 64;

/// Opcodes (version 4).
pub mod opcode {
    /// Start the lease's device dirty log.
    pub const DIRTY_LOG_START: u16 = 0x121;
    /// Fetch (and clear) the pages written since the last fetch.
    pub const DIRTY_LOG_FETCH: u16 = 0x122;
    /// Stop the dirty log.
    pub const DIRTY_LOG_STOP: u16 = 0x123;
    /// Quiesce for a hand-over, with drain confirmation.
    pub const QUIESCE_HANDOVER: u16 = 0x124;
    /// Create a transfer ticket for a lease (source borrower).
    pub const TRANSFER_CREATE: u16 = 0x125;
    /// Cancel the lease's transfer ticket (source borrower).
    pub const TRANSFER_CANCEL: u16 = 0x126;
    /// Take a lease by its ticket (destination borrower).
    pub const TRANSFER_ACCEPT: u16 = 0x127;
    /// Event: the lease moved to another borrower.
    pub const EVT_LEASE_MOVED: u16 = 0x186;
}

/// Error codes of the version 4 requests.
pub mod code {
    /// The ticket is unknown, expired, cancelled, already used, of another lease, or
    /// presented by another borrower than the one it names (counted by the lender).
    pub const BAD_TICKET: u32 = 0x120;
    /// DIRTY_LOG_FETCH/STOP before DIRTY_LOG_START.
    pub const DIRTY_LOG_OFF: u32 = 0x121;
    /// The lease has a transfer ticket outstanding (one at a time).
    pub const TRANSFER_PENDING: u32 = 0x122;
}

/// Reply to DIRTY_LOG_START.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirtyLogStarted {
    /// The lender tracks the device's writes page by page (software IOMMU domain); `false`:
    /// every fetch reports the whole window ([`DirtyBitmap::whole_window`]).
    pub exact: bool,
}

/// DIRTY_LOG_FETCH: the pages of `[iova, iova + len)` written since the previous fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirtyLogFetch {
    /// Lease.
    pub lease: u64,
    /// First IOVA (4 KiB aligned).
    pub iova: u64,
    /// Bytes (4 KiB multiple, at most [`crate::iommu::MAX_DIRTY_PAGES`] pages); 0: from the
    /// lowest to the highest mapped IOVA of the lease.
    pub len: u64,
}

/// Reply to DIRTY_LOG_FETCH.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirtyBitmap {
    /// First IOVA of the range.
    pub iova: u64,
    /// Pages in the range.
    pub pages: u64,
    /// Bit `i % 64` of word `i / 64`: page `iova + i * 4 KiB` was written by the device.
    pub bits: Vec<u64>,
    /// The lender cannot track the device's writes (VFIO): every mapped page is set, every
    /// time; copy the whole window at the final pass.
    pub whole_window: bool,
}

impl DirtyBitmap {
    /// IOVAs of the pages set.
    pub fn iovas(&self) -> Vec<u64> {
        (0..self.pages)
            .filter(|&i| {
                self.bits
                    .get((i / 64) as usize)
                    .is_some_and(|w| w & (1 << (i % 64)) != 0)
            })
            .map(|i| self.iova + i * 4096)
            .collect()
    }
}

/// QUIESCE_HANDOVER: QUIESCE's hand-over form. The device stops fetching work, its
/// interrupts are held as pending, the work it already fetched completes, and the lender
/// waits up to `timeout_ms` for no DMA in flight. QUIESCE `stop: false` resumes it and
/// delivers the held interrupts to the targets wired then (the lender replays them: the
/// borrower must not).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuiesceHandover {
    /// Lease.
    pub lease: u64,
    /// Bound on the drain (at most [`MAX_DRAIN_MS`]).
    pub timeout_ms: u32,
}

/// Reply to QUIESCE_HANDOVER.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandoverQuiesced {
    /// The lender confirms that no DMA of the device is in flight (`false`: the timeout
    /// passed; for VFIO, Transactions Pending stayed set after Bus Master Enable was
    /// cleared).
    pub drained: bool,
    /// MSI-X vectors raised since the quiesce began (held by the lender).
    pub pending_msix: Vec<u32>,
    /// INTx asserted since the quiesce began (held).
    pub pending_intx: bool,
}

/// TRANSFER_CREATE: the source borrower authorises moving its lease to the borrower
/// `to_node`/`to_vm` (its fabric node is authenticated by the lender when it presents the
/// ticket).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferCreate {
    /// Lease.
    pub lease: u64,
    /// Destination borrower's node.
    pub to_node: String,
    /// Destination VM name.
    pub to_vm: String,
}

/// Reply to TRANSFER_CREATE: a secret the source hands to the destination.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferTicket {
    /// Lease.
    pub lease: u64,
    /// [`TICKET_LEN`] random bytes.
    pub ticket: Vec<u8>,
    /// Milliseconds until the ticket expires.
    pub expires_in_ms: u64,
}

/// One DMA window of the destination, mapped at the IOVA the source had.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcceptMap {
    /// IOVA.
    pub iova: u64,
    /// Bytes.
    pub size: u64,
    /// The destination's fabric window.
    pub window: u32,
}

/// TRANSFER_ACCEPT: the destination takes the lease. Every window of the source must be
/// replaced, at the same IOVAs and sizes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferAccept {
    /// Lease the ticket is for.
    pub lease: u64,
    /// The ticket from [`TransferTicket`].
    pub ticket: Vec<u8>,
    /// The destination VM (must be the ticket's).
    pub vm: String,
    /// The destination's windows.
    pub maps: Vec<AcceptMap>,
    /// MSI-X targets (as SET_IRQS; empty: set them later with SET_IRQS).
    pub msix: Vec<IrqTarget>,
}

/// Event: the lease moved to `to` (the source's lease ended by transfer, not by loss).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseMoved {
    /// Lease.
    pub lease: u64,
    /// `node/vm` of the new holder.
    pub to: String,
}

/// The opcode of a version 4 migration request, `None` for other requests.
pub(super) fn opcode_of(r: &Request) -> Option<u16> {
    Some(match r {
        Request::DirtyLogStart(_) => opcode::DIRTY_LOG_START,
        Request::DirtyLogFetch(_) => opcode::DIRTY_LOG_FETCH,
        Request::DirtyLogStop(_) => opcode::DIRTY_LOG_STOP,
        Request::QuiesceHandover(_) => opcode::QUIESCE_HANDOVER,
        Request::TransferCreate(_) => opcode::TRANSFER_CREATE,
        Request::TransferCancel(_) => opcode::TRANSFER_CANCEL,
        Request::TransferAccept(_) => opcode::TRANSFER_ACCEPT,
        _ => return None,
    })
}

/// Whether `op` is a version 4 migration request.
pub(super) fn is_migration_op(op: u16) -> bool {
    (opcode::DIRTY_LOG_START..=opcode::TRANSFER_ACCEPT).contains(&op)
}

/// The lease of a migration request (`None` for other requests).
pub(super) fn lease_of(r: &Request) -> Option<u64> {
    match r {
        Request::DirtyLogStart(l) | Request::DirtyLogStop(l) | Request::TransferCancel(l) => {
            Some(l.lease)
        }
        Request::DirtyLogFetch(f) => Some(f.lease),
        Request::QuiesceHandover(q) => Some(q.lease),
        Request::TransferCreate(t) => Some(t.lease),
        Request::TransferAccept(t) => Some(t.lease),
        _ => None,
    }
}

/// Encodes a migration request's payload (`None` for other requests).
pub(super) fn encode(r: &Request, op: u16) -> Option<Result<Vec<u8>, ProtocolError>> {
    Some(match r {
        Request::DirtyLogStart(v) | Request::DirtyLogStop(v) | Request::TransferCancel(v) => {
            enc(op, v)
        }
        Request::DirtyLogFetch(v) => enc(op, v),
        Request::QuiesceHandover(v) => enc(op, v),
        Request::TransferCreate(v) => enc(op, v),
        Request::TransferAccept(v) => enc(op, v),
        _ => return None,
    })
}

/// Decodes and validates a migration request. Never panics.
pub(super) fn decode(op: u16, payload: &[u8]) -> Result<Request, ProtocolError> {
    Ok(match op {
        opcode::DIRTY_LOG_START => Request::DirtyLogStart(dec::<LeaseRef>(op, payload)?),
        opcode::DIRTY_LOG_STOP => Request::DirtyLogStop(dec::<LeaseRef>(op, payload)?),
        opcode::TRANSFER_CANCEL => Request::TransferCancel(dec::<LeaseRef>(op, payload)?),
        opcode::DIRTY_LOG_FETCH => {
            let f: DirtyLogFetch = dec(op, payload)?;
            let pages = f.len / 4096;
            if !f.iova.is_multiple_of(4096)
                || !f.len.is_multiple_of(4096)
                || f.iova.checked_add(f.len).is_none()
                || pages > crate::iommu::MAX_DIRTY_PAGES
            {
                return Err(invalid(
                    op,
                    format!(
                        "dirty log range iova {:#x} len {:#x} is unaligned, wraps or exceeds {} pages",
                        f.iova,
                        f.len,
                        crate::iommu::MAX_DIRTY_PAGES
                    ),
                ));
            }
            Request::DirtyLogFetch(f)
        }
        opcode::QUIESCE_HANDOVER => {
            let q: QuiesceHandover = dec(op, payload)?;
            if q.timeout_ms > MAX_DRAIN_MS {
                return Err(invalid(
                    op,
                    format!(
                        "drain timeout {} ms, at most {MAX_DRAIN_MS} allowed",
                        q.timeout_ms
                    ),
                ));
            }
            Request::QuiesceHandover(q)
        }
        opcode::TRANSFER_CREATE => {
            let t: TransferCreate = dec(op, payload)?;
            check_str(op, "destination node", &t.to_node)?;
            check_str(op, "destination vm", &t.to_vm)?;
            Request::TransferCreate(t)
        }
        opcode::TRANSFER_ACCEPT => {
            let t: TransferAccept = dec(op, payload)?;
            check_str(op, "vm name", &t.vm)?;
            if t.ticket.len() != TICKET_LEN {
                return Err(invalid(
                    op,
                    format!("ticket is {} bytes, expected {TICKET_LEN}", t.ticket.len()),
                ));
            }
            if t.maps.len() > MAX_ACCEPT_MAPS || t.msix.len() > MAX_IRQS {
                return Err(invalid(
                    op,
                    format!(
                        "{} windows and {} interrupt targets, at most {MAX_ACCEPT_MAPS} and \
                         {MAX_IRQS}",
                        t.maps.len(),
                        t.msix.len()
                    ),
                ));
            }
            if let Some(m) = t
                .maps
                .iter()
                .find(|m| m.size == 0 || m.iova.checked_add(m.size).is_none())
            {
                return Err(invalid(
                    op,
                    format!(
                        "dma window iova {:#x} size {:#x} is empty or wraps",
                        m.iova, m.size
                    ),
                ));
            }
            Request::TransferAccept(t)
        }
        other => return Err(super::ProtocolError::UnknownOpcode(other)),
    })
}
