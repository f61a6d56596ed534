//! The session side of cross-lender peer-to-peer DMA (protocol version 6,
//! [`crate::protocol::p2px`], [`crate::iommu::p2p_remote`]).

use std::sync::Arc;

use ntb::wire::ErrorReply;

use super::{ok, Reply, Session};
use crate::iommu::p2p_remote::{log_refusal, RemoteP2pError};
use crate::protocol::{self, error, P2pGranted, Request};

fn p2px_err(e: RemoteP2pError) -> ErrorReply {
    error(e.code(), e.to_string())
}

impl Session {
    /// Handles a version 6 request (`None`: not one).
    pub(super) fn dispatch_p2px(&mut self, op: u16, req: &Request) -> Option<Reply> {
        Some(match req {
            Request::P2pGrant(g) => self.p2p_grant(op, g),
            Request::P2pRevoke(r) => self.lease(r.target).and_then(|sl| {
                if !sl.p2p.revoke_grant(r.grant) {
                    log::debug!("lease {}: grant {} already ended", r.target, r.grant);
                }
                ok(op, &())
            }),
            Request::P2pMapRemote(m) => self.p2p_map_remote(op, m),
            Request::P2pUnmapRemote(u) => self.lease(u.source).and_then(|sl| {
                // Already ended (revoked by the target's lender, link lost): nothing to do.
                sl.p2p.remove_remote(&(u.lender.clone(), u.target, u.bar));
                ok(op, &())
            }),
            Request::P2pAttach(a) => {
                let grants = Arc::clone(&self.lender.grants);
                match grants.attach(self.ep.as_ref(), a, &mut self.attachments) {
                    Ok(r) => ok(op, &r),
                    Err(e) => Err(p2px_err(e)),
                }
            }
            Request::P2pMapGranted(m) => {
                let grants = Arc::clone(&self.lender.grants);
                let node = self.lender.node.clone();
                if !grants.check(m.grant, m.target, m.bar, &node, &m.secret) {
                    return Some(Err(p2px_err(RemoteP2pError::BadGrant(m.grant))));
                }
                let p = protocol::P2pMap {
                    source: m.source,
                    target: m.target,
                    bar: m.bar,
                    iova: m.iova,
                };
                self.p2p_map(op, p, true)
            }
            Request::P2pDetach(d) => {
                self.attachments.detach(d.grant);
                ok(op, &())
            }
            _ => return None,
        })
    }

    fn p2p_grant(&mut self, op: u16, g: &protocol::P2pGrant) -> Reply {
        // A grant to this lender itself is the target's capability for P2P_MAP_GRANTED.
        let grants = Arc::clone(&self.lender.grants);
        let peers = Arc::clone(&self.lender.peers);
        let sl = self.lease(g.target)?;
        let h = grants
            .grant(g.target, g.bar, &g.grantee, sl.lease.backend().as_ref())
            .map_err(|e| {
                log_refusal(
                    &peers.refusals,
                    format_args!("lease {}: p2p grant refused: {e}", g.target),
                );
                p2px_err(e)
            })?;
        let r = P2pGranted {
            grant: h.id(),
            secret: h.secret().to_vec(),
        };
        sl.p2p.add_grant(h).map_err(p2px_err)?;
        ok(op, &r)
    }

    fn p2p_map_remote(&mut self, op: u16, m: &protocol::P2pMapRemote) -> Reply {
        let peers = Arc::clone(&self.lender.peers);
        let sl = self.lease(m.source)?;
        let key = (m.lender.clone(), m.target, m.bar);
        if let Some(iova) = sl.p2p.remote_live(&key) {
            return Err(error(
                protocol::code::INVALID,
                format!(
                    "lease {}: bar {} of lease {} on {} is already mapped at iova {iova:#x}",
                    m.source, m.bar, m.target, m.lender
                ),
            ));
        }
        if sl.p2p.remote_count() >= crate::iommu::p2p::MAX_P2P_PER_LEASE {
            return Err(error(
                protocol::code::INVALID,
                format!(
                    "lease {} already holds the maximum of {} remote peer-to-peer mappings",
                    m.source,
                    crate::iommu::p2p::MAX_P2P_PER_LEASE
                ),
            ));
        }
        // A dead mapping of the same key is dropped first (its IOVA range is free again).
        sl.p2p.remove_remote(&key);
        let domain = sl.lease.backend().domain();
        let mapping = peers
            .map(
                m.source, domain, &m.lender, m.target, m.bar, m.iova, m.grant, &m.secret,
            )
            .map_err(|e| {
                log_refusal(
                    &peers.refusals,
                    format_args!("lease {}: remote p2p map refused: {e}", m.source),
                );
                p2px_err(e)
            })?;
        sl.p2p.add_remote(key, mapping);
        ok(op, &())
    }
}
