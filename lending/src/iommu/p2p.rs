//! Peer-to-peer DMA between two leases of one borrower on this lender.
//!
//! A borrower that placed BAR `bar` of its lease *target* at guest-physical address `gpa`
//! asks (P2P_MAP) that the IOMMU domain of its lease *source* map that BAR's memory at
//! IOVA = `gpa`: the source device's DMA to the guest driver's bus address then lands in
//! the target device's BAR, without a trip through guest RAM.
//!
//! * [`P2pBook`]: the lender-wide table of leases that can take part (every lease, from
//!   borrow to end), who holds them, and which mappings point into each one. Leases of one
//!   borrower are usually on different sessions (the VMM keeps one link per device), so
//!   this table is shared by all sessions.
//! * [`P2pMapping`]: one mapping, held by the source lease. Dropping it unmaps it. The
//!   target side can revoke it first ([`P2pBook::revoke_into`]): before the target device
//!   is reset, returned, lost with its session or its directory claim; a revoked mapping
//!   stays a (dead) value of the source until the borrower unmaps it or the source ends.
//!
//! Authorisation: both leases must be held by the same `node/vm` (the node name is the one
//! the session authenticated with the cluster token) from the same origin (shm: the same
//! process; tcp: the same IP); see docs/SECURITY.md. Anything else is answered as an unknown
//! lease, so a forger learns nothing about other leases.

use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use thiserror::Error;

use super::p2p_remote::{GrantHandle, RemoteP2pError, RemoteP2pMapping, MAX_GRANTS_PER_LEASE};
use super::{IommuDomain, IommuError, MmapBacking, IOMMU_PAGE_SIZE};
use crate::backend::DeviceBackend;

/// Most peer-to-peer mappings one source lease may hold (live or revoked).
pub const MAX_P2P_PER_LEASE: usize = 64;

/// Errors of peer-to-peer mapping.
#[derive(Debug, Error)]
pub enum P2pError {
    /// The target lease does not exist, or is not held by the source's borrower (both
    /// answered alike on purpose).
    #[error("unknown lease {0} for peer-to-peer dma of this borrower")]
    UnknownLease(u64),
    /// The target device has no such BAR.
    #[error("lease {lease}: the device has no bar {bar}")]
    NoSuchBar {
        /// Target lease.
        lease: u64,
        /// BAR index.
        bar: u8,
    },
    /// The BAR is not device memory the lender can map (I/O space, emulated by the
    /// borrower, or not exportable).
    #[error("lease {lease}: bar {bar} is not a memory bar the lender can map ({why})")]
    NotMemory {
        /// Target lease.
        lease: u64,
        /// BAR index.
        bar: u8,
        /// Which of the reasons.
        why: &'static str,
    },
    /// (source, target, bar) is mapped already.
    #[error(
        "lease {source_lease}: bar {bar} of lease {target} is already mapped at iova {iova:#x}"
    )]
    AlreadyMapped {
        /// Source lease.
        source_lease: u64,
        /// Target lease.
        target: u64,
        /// BAR index.
        bar: u8,
        /// Where.
        iova: u64,
    },
    /// No mapping of (source, target, bar).
    #[error("lease {source_lease}: no peer-to-peer mapping of bar {bar} of lease {target}")]
    NotMapped {
        /// Source lease.
        source_lease: u64,
        /// Target lease.
        target: u64,
        /// BAR index.
        bar: u8,
    },
    /// Too many mappings held by the source.
    #[error("lease {0} already holds the maximum of {MAX_P2P_PER_LEASE} peer-to-peer mappings")]
    TooMany(u64),
    /// Mapping the BAR memory into this process failed.
    #[error("mapping bar {bar} of lease {lease} into the lender: {source}")]
    Backing {
        /// Target lease.
        lease: u64,
        /// BAR index.
        bar: u8,
        /// Why.
        #[source]
        source: super::BackingError,
    },
    /// The source's IOMMU domain refused the mapping (overlap with a RAM window, alignment).
    #[error("lease {lease}: {source}")]
    Iommu {
        /// Source lease.
        lease: u64,
        /// Why.
        #[source]
        source: IommuError,
    },
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The shared part of a mapping: both the holder (source) and the book (target side) can
/// end it; whoever comes first unmaps.
struct Mapped {
    domain: Arc<dyn IommuDomain>,
    iova: u64,
    size: u64,
    source: u64,
    target: u64,
    bar: u8,
    live: Mutex<bool>,
}

impl Mapped {
    /// Unmaps once; returns whether this call did it.
    fn revoke(&self, why: &str) -> bool {
        let mut live = lock(&self.live);
        if !*live {
            return false;
        }
        *live = false;
        if let Err(e) = self.domain.unmap(self.iova, self.size) {
            // The source's lease end unmaps everything first (`unmap_all`): nothing to undo.
            log::debug!(
                "lease {}: p2p mapping of lease {} bar {} already gone: {e}",
                self.source,
                self.target,
                self.bar
            );
        }
        log::info!(
            "lease {}: p2p mapping of lease {} bar {} at iova {:#x} removed ({why})",
            self.source,
            self.target,
            self.bar,
            self.iova
        );
        true
    }
}

/// One peer-to-peer mapping held by its source lease; dropping it unmaps it (if the target
/// side has not revoked it already).
pub struct P2pMapping {
    shared: Arc<Mapped>,
}

impl P2pMapping {
    /// IOVA of the mapping in the source's domain.
    pub fn iova(&self) -> u64 {
        self.shared.iova
    }

    /// Bytes mapped.
    pub fn size(&self) -> u64 {
        self.shared.size
    }

    /// False once the target side revoked it.
    pub fn is_live(&self) -> bool {
        *lock(&self.shared.live)
    }
}

impl Drop for P2pMapping {
    fn drop(&mut self) {
        self.shared.revoke("unmapped by its source");
    }
}

struct PeerLease {
    holder: String,
    /// Borrowed in a version 6 session: mappable only with its capability (a grant).
    needs_capability: bool,
    backend: Arc<dyn DeviceBackend>,
    /// Mappings of other leases that point into this lease's BARs.
    inbound: Vec<Weak<Mapped>>,
}

/// The lender-wide table of leases for peer-to-peer DMA (see the module docs).
#[derive(Default)]
pub struct P2pBook {
    leases: Mutex<HashMap<u64, PeerLease>>,
}

/// A lease's entry in the [`P2pBook`]; dropping it revokes every mapping into the lease and
/// removes it.
pub struct P2pRegistration {
    book: Arc<P2pBook>,
    lease: u64,
    holder: String,
    /// Across lenders: grants of this lease's BARs to other lenders (target side).
    grants: Mutex<HashMap<u64, GrantHandle>>,
    /// Across lenders: other lenders' memory mapped into this lease's domain (source
    /// side), by (lender, target lease, BAR).
    remote: Mutex<HashMap<(String, u64, u8), RemoteP2pMapping>>,
}

/// Key of a remote mapping: (the target's lender, target lease, BAR).
pub type RemoteKey = (String, u64, u8);

impl P2pRegistration {
    /// The lease changed hands (live migration's transfer): every mapping into it is
    /// revoked and it answers to `holder` from now on.
    pub fn rehold(&mut self, holder: &str) -> usize {
        // Grants to other lenders and mappings into it end (another holder now), and so do
        // its own mappings of other lenders' memory.
        let n = self.revoke_all("lease transferred");
        self.end_remote();
        if let Some(p) = lock(&self.book.leases).get_mut(&self.lease) {
            p.holder = holder.to_string();
        }
        self.holder = holder.to_string();
        n
    }

    /// Who holds the lease, as the book compares it.
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// Revokes every mapping into the lease's BARs (before its device resets); returns how
    /// many were live.
    pub fn revoke_all(&self, why: &str) -> usize {
        let grants = std::mem::take(&mut *lock(&self.grants));
        if !grants.is_empty() {
            log::info!(
                "lease {}: {} grants to other lenders revoked ({why})",
                self.lease,
                grants.len()
            );
        }
        drop(grants);
        self.book.revoke_into(self.lease, why)
    }

    /// Holds a grant of this lease's BAR to another lender until revoked.
    pub fn add_grant(&self, g: GrantHandle) -> Result<(), RemoteP2pError> {
        let mut grants = lock(&self.grants);
        if grants.len() >= MAX_GRANTS_PER_LEASE {
            return Err(RemoteP2pError::TooManyGrants(self.lease));
        }
        grants.insert(g.id(), g);
        Ok(())
    }

    /// Revokes grant `id` (its attachment ends first); false if the lease holds no such
    /// grant (already ended).
    pub fn revoke_grant(&self, id: u64) -> bool {
        let g = lock(&self.grants).remove(&id);
        g.is_some()
    }

    /// Whether the remote mapping `key` exists and is live; its IOVA.
    pub fn remote_live(&self, key: &RemoteKey) -> Option<u64> {
        lock(&self.remote)
            .get(key)
            .filter(|m| m.is_live())
            .map(RemoteP2pMapping::iova)
    }

    /// Remote mappings held (live or ended).
    pub fn remote_count(&self) -> usize {
        lock(&self.remote).len()
    }

    /// Holds a remote mapping (replacing a dead one of the same key).
    pub fn add_remote(&self, key: RemoteKey, m: RemoteP2pMapping) {
        let old = lock(&self.remote).insert(key, m);
        drop(old);
    }

    /// Drops (unmaps) the remote mapping `key`; false if there is none.
    pub fn remove_remote(&self, key: &RemoteKey) -> bool {
        let m = lock(&self.remote).remove(key);
        m.is_some()
    }

    /// Unmaps every remote mapping of this lease (source side).
    pub fn end_remote(&self) {
        let all = std::mem::take(&mut *lock(&self.remote));
        drop(all);
    }
}

impl Drop for P2pRegistration {
    fn drop(&mut self) {
        self.end_remote();
        self.revoke_all("target lease ended");
        self.book.revoke_into(self.lease, "target lease ended");
        lock(&self.book.leases).remove(&self.lease);
    }
}

impl P2pBook {
    /// Enters `lease` (held by `holder`: `node/vm@origin`, leases of one holder may map each
    /// other's BARs) until the returned value is dropped.
    /// With `needs_capability`, the lease is mapped only by [`P2pBook::map`] calls that
    /// verified its capability.
    pub fn register(
        self: &Arc<Self>,
        lease: u64,
        holder: &str,
        backend: Arc<dyn DeviceBackend>,
        needs_capability: bool,
    ) -> P2pRegistration {
        lock(&self.leases).insert(
            lease,
            PeerLease {
                holder: holder.to_string(),
                needs_capability,
                backend,
                inbound: Vec::new(),
            },
        );
        P2pRegistration {
            book: Arc::clone(self),
            lease,
            holder: holder.to_string(),
            grants: Mutex::default(),
            remote: Mutex::default(),
        }
    }

    /// Revokes (unmaps) every mapping into `lease`'s BARs; returns how many were live.
    /// Called before the lease's device is reset and when the lease ends.
    pub fn revoke_into(&self, lease: u64, why: &str) -> usize {
        let inbound = match lock(&self.leases).get_mut(&lease) {
            Some(p) => std::mem::take(&mut p.inbound),
            None => return 0,
        };
        // Unmapped outside the book's lock: a domain's unmap waits for DMAs in flight.
        inbound
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|m| m.revoke(why))
            .count()
    }

    /// Mappings into `lease` that are live (tests, status).
    pub fn live_into(&self, lease: u64) -> usize {
        lock(&self.leases).get(&lease).map_or(0, |p| {
            p.inbound
                .iter()
                .filter_map(Weak::upgrade)
                .filter(|m| *lock(&m.live))
                .count()
        })
    }

    /// Maps BAR `bar` of lease `target` at `iova` in `domain`, the IOMMU domain of lease
    /// `source` (held by `holder`). The caller checked that `source` is its own lease, and
    /// (`capability`) whether the request carried the target's verified capability.
    #[allow(clippy::too_many_arguments)]
    pub fn map(
        &self,
        source: u64,
        holder: &str,
        domain: Arc<dyn IommuDomain>,
        target: u64,
        bar: u8,
        iova: u64,
        capability: bool,
    ) -> Result<P2pMapping, P2pError> {
        let mut leases = lock(&self.leases);
        let t = leases
            .get_mut(&target)
            .filter(|t| {
                t.holder == holder && target != source && (capability || !t.needs_capability)
            })
            .ok_or(P2pError::UnknownLease(target))?;
        let (export, size) = peer_region(t.backend.as_ref(), target, bar)?;
        let iova = iova.checked_add(export.bar_offset).ok_or(P2pError::Iommu {
            lease: source,
            source: IommuError::BadRange { iova, size },
        })?;
        let backing =
            map_export(export.fd, export.fd_offset, size).map_err(|err| P2pError::Backing {
                lease: target,
                bar,
                source: err,
            })?;
        domain
            .map(iova, size, Arc::new(backing))
            .map_err(|err| P2pError::Iommu {
                lease: source,
                source: err,
            })?;
        let shared = Arc::new(Mapped {
            domain,
            iova,
            size,
            source,
            target,
            bar,
            live: Mutex::new(true),
        });
        t.inbound.retain(|w| w.strong_count() > 0);
        t.inbound.push(Arc::downgrade(&shared));
        log::info!(
            "lease {source}: bar {bar} of lease {target} mapped at iova {iova:#x} size {size:#x} \
             (peer-to-peer)"
        );
        Ok(P2pMapping { shared })
    }
}

/// The part of BAR `bar` of lease `lease`'s device a peer may reach, in whole IOMMU pages
/// inside the BAR: the device's export and the size to map.
pub(crate) fn peer_region(
    backend: &dyn DeviceBackend,
    lease: u64,
    bar: u8,
) -> Result<(crate::backend::PeerExport<'_>, u64), P2pError> {
    let desc = backend.describe("p2p");
    let b = desc
        .bars
        .iter()
        .find(|b| b.index == bar)
        .ok_or(P2pError::NoSuchBar { lease, bar })?;
    let not_memory = |why| P2pError::NotMemory { lease, bar, why };
    if b.io {
        return Err(not_memory("i/o space"));
    }
    if b.emulated_by_borrower {
        return Err(not_memory("emulated by the borrower"));
    }
    let export = backend
        .peer_export(bar)
        .ok_or_else(|| not_memory("the device has no memory in it a peer may reach"))?;
    let end = export.bar_offset.saturating_add(export.size).min(b.size);
    let size = end.saturating_sub(export.bar_offset) / IOMMU_PAGE_SIZE * IOMMU_PAGE_SIZE;
    if size == 0 || !export.bar_offset.is_multiple_of(IOMMU_PAGE_SIZE) {
        return Err(not_memory("its peer memory is not whole pages"));
    }
    Ok((export, size))
}

/// A shared mapping of the BAR's memory in this process (what the source's software domain
/// copies through, and what a VFIO domain hands to the hardware IOMMU).
fn map_export(
    fd: BorrowedFd<'_>,
    offset: u64,
    size: u64,
) -> Result<MmapBacking, super::BackingError> {
    let fd = fd
        .try_clone_to_owned()
        .map_err(|source| super::BackingError::Mmap {
            size,
            offset,
            source,
        })?;
    MmapBacking::new(fd, offset, size)
}
