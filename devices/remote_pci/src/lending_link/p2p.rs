//! The lease's peer-to-peer requests (protocol versions 5 and 6) as a [`crate::P2pPort`]
//! and the mappings they hand out, each undone on drop.

use std::sync::Arc;

use lending::client::{ClientError, Lease};
use lending::protocol;
use log::{debug, warn};

use super::link_err;

/// The lease's P2P_MAP/P2P_UNMAP, shared with the VM's P2P router.
pub(super) struct LendingP2p {
    pub(super) lender: String,
    /// Same-lender peers need this lease's capability (tcp, protocol version 6).
    pub(super) capability: bool,
    /// BARs backed by lender memory (exported as windows, not emulated by the borrower).
    pub(super) bars: Vec<u8>,
    pub(super) lease: Arc<Lease>,
}

impl crate::P2pPort for LendingP2p {
    fn lender(&self) -> &str {
        &self.lender
    }

    fn lease(&self) -> u64 {
        self.lease.id()
    }

    fn peer_bars(&self) -> Vec<u8> {
        self.bars.clone()
    }

    fn map(
        &self,
        target: u64,
        bar: u8,
        iova: u64,
    ) -> Result<Box<dyn crate::PeerMapping>, crate::P2pMapError> {
        self.lease.p2p_map(target, bar, iova).map_err(|e| {
            // The lender's verdict on this BAR at this address (no peer memory, not a
            // memory BAR, overlaps RAM) does not change by asking again.
            let permanent = matches!(
                e.code(),
                Some(protocol::code::INVALID | protocol::code::OUT_OF_RANGE)
            );
            let e = link_err("p2p map", e);
            if permanent {
                crate::P2pMapError::Refused(e)
            } else {
                crate::P2pMapError::Failed(e)
            }
        })?;
        Ok(Box::new(LendingPeerMapping {
            lease: Arc::clone(&self.lease),
            target,
            bar,
        }))
    }

    fn needs_capability(&self) -> bool {
        self.capability
    }

    fn map_granted(
        &self,
        target: u64,
        bar: u8,
        iova: u64,
        grant: &crate::PeerGrant,
    ) -> Result<Box<dyn crate::PeerMapping>, crate::P2pMapError> {
        let g = protocol::P2pGranted {
            grant: grant.grant,
            secret: grant.secret.clone(),
        };
        self.lease
            .p2p_map_granted(target, bar, iova, &g)
            .map_err(|e| p2p_map_err("p2p map", e))?;
        Ok(Box::new(LendingPeerMapping {
            lease: Arc::clone(&self.lease),
            target,
            bar,
        }))
    }

    fn grant(
        &self,
        bar: u8,
        grantee: &str,
    ) -> Result<(crate::PeerGrant, Box<dyn crate::PeerMapping>), crate::P2pMapError> {
        let g = self
            .lease
            .p2p_grant(bar, grantee)
            .map_err(|e| p2p_map_err("p2p grant", e))?;
        Ok((
            crate::PeerGrant {
                grant: g.grant,
                secret: g.secret,
            },
            Box::new(LendingGrant {
                lease: Arc::clone(&self.lease),
                grant: g.grant,
            }),
        ))
    }

    fn map_remote(
        &self,
        lender: &str,
        target: u64,
        bar: u8,
        iova: u64,
        grant: &crate::PeerGrant,
    ) -> Result<Box<dyn crate::PeerMapping>, crate::P2pMapError> {
        let g = protocol::P2pGranted {
            grant: grant.grant,
            secret: grant.secret.clone(),
        };
        self.lease
            .p2p_map_remote(lender, target, bar, iova, &g)
            .map_err(|e| p2p_map_err("p2p map remote", e))?;
        Ok(Box::new(LendingRemoteMapping {
            lease: Arc::clone(&self.lease),
            lender: lender.to_string(),
            target,
            bar,
        }))
    }
}

/// The lender's verdict on a BAR at an address (no peer memory, not a memory BAR, overlaps
/// RAM) does not change by asking again: `Refused`; anything else may: `Failed`.
fn p2p_map_err(op: &'static str, e: ClientError) -> crate::P2pMapError {
    let permanent = matches!(
        e.code(),
        Some(protocol::code::INVALID | protocol::code::OUT_OF_RANGE)
    );
    let e = link_err(op, e);
    if permanent {
        crate::P2pMapError::Refused(e)
    } else {
        crate::P2pMapError::Failed(e)
    }
}

/// A grant of this lease's BAR to another lender; dropping it sends P2P_REVOKE.
struct LendingGrant {
    lease: Arc<Lease>,
    grant: u64,
}

impl crate::PeerMapping for LendingGrant {}

impl Drop for LendingGrant {
    fn drop(&mut self) {
        if let Err(e) = self.lease.p2p_revoke(self.grant) {
            // The target's lender may be gone: its grants went with it.
            debug!(
                "lease {}: p2p revoke of grant {}: {e}",
                self.lease.id(),
                self.grant
            );
        }
    }
}

/// One P2P_MAP_REMOTE of the lease; dropping it sends P2P_UNMAP_REMOTE.
struct LendingRemoteMapping {
    lease: Arc<Lease>,
    lender: String,
    target: u64,
    bar: u8,
}

impl crate::PeerMapping for LendingRemoteMapping {}

impl Drop for LendingRemoteMapping {
    fn drop(&mut self) {
        if let Err(e) = self
            .lease
            .p2p_unmap_remote(&self.lender, self.target, self.bar)
        {
            warn!(
                "lease {}: p2p unmap of lease {} bar {} on {}: {e}",
                self.lease.id(),
                self.target,
                self.bar,
                self.lender
            );
        }
    }
}

/// One P2P_MAP of the lease; dropping it sends P2P_UNMAP.
struct LendingPeerMapping {
    lease: Arc<Lease>,
    target: u64,
    bar: u8,
}

impl crate::PeerMapping for LendingPeerMapping {}

impl Drop for LendingPeerMapping {
    fn drop(&mut self) {
        if let Err(e) = self.lease.p2p_unmap(self.target, self.bar) {
            warn!(
                "lease {}: p2p unmap of lease {} bar {}: {e}",
                self.lease.id(),
                self.target,
                self.bar
            );
        }
    }
}
