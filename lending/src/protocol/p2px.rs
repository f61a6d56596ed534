//! Version 6: peer-to-peer DMA between devices of one borrower on *different* lenders. Kept
//! apart from the older requests so other additions merge without conflicts.
//!
//! Source device S on lender A, target T on lender B. The borrower asks B to grant A access
//! to T's peer memory ([`P2pGrant`], over T's session), then asks A to map it
//! ([`P2pMapRemote`], over S's session, carrying the grant and its capability secret). A opens
//! (or reuses) an authenticated lender-to-lender link to B and presents the grant there
//! ([`P2pAttach`]); B exports T's peer memory as a fabric window on that link and A maps it
//! into S's IOMMU domain at IOVA = T's BAR address.
//!
//! | opcode | request | reply | sent by → to |
//! |---|---|---|---|
//! | 0x113 | [`P2pGrant`] | [`P2pGranted`] | borrower → target's lender |
//! | 0x114 | [`P2pRevoke`] | `()` | borrower → target's lender |
//! | 0x115 | [`P2pMapRemote`] | `()` | borrower → source's lender |
//! | 0x116 | [`P2pUnmapRemote`] | `()` | borrower → source's lender |
//! | 0x117 | [`P2pAttach`] | [`P2pAttached`] | source's lender → target's lender |
//! | 0x118 | [`P2pDetach`] | `()` | source's lender → target's lender |
//! | 0x119 | [`P2pMapGranted`] | `()` | borrower → the lender of both |
//!
//! Same lender, version 6 on tcp: a target lease borrowed in a version 6 tcp session can be mapped
//! only with its capability: the borrower asks for a grant to the lender itself
//! (P2P_GRANT with `grantee` = that lender) and presents it in [`P2pMapGranted`]; a plain
//! P2P_MAP of such a lease is answered `UNKNOWN_LEASE`. This closes the tcp weakness of the
//! identity rule (docs/SECURITY.md): another token holder at the same IP claiming the
//! victim's node and VM names does not have the secret, which only the target's session got.

use serde::{Deserialize, Serialize};

use super::{check_str, dec, enc, invalid, ProtocolError, Request};

/// The protocol version that introduced these requests.
pub const P2PX_VERSION: u32 = 6;
/// Length of a grant's capability secret (random bytes).
pub const SECRET_LEN: usize = 32;

/// Opcodes (version 6).
pub mod opcode {
    /// Grant a lender access to a lease's peer memory.
    pub const P2P_GRANT: u16 = 0x113;
    /// Withdraw a grant (and end its attachment).
    pub const P2P_REVOKE: u16 = 0x114;
    /// Map a peer's memory on another lender into a lease's IOMMU domain.
    pub const P2P_MAP_REMOTE: u16 = 0x115;
    /// Undo a P2P_MAP_REMOTE.
    pub const P2P_UNMAP_REMOTE: u16 = 0x116;
    /// Lender to lender: present a grant, get the peer memory as a window.
    pub const P2P_ATTACH: u16 = 0x117;
    /// Lender to lender: end an attachment.
    pub const P2P_DETACH: u16 = 0x118;
    /// Same lender: P2P_MAP with the target's capability.
    pub const P2P_MAP_GRANTED: u16 = 0x119;
}

/// Error codes of the version 6 requests.
pub mod code {
    /// The grant is unknown, revoked, of another lender, or its secret does not match
    /// (counted by the lender; all answered alike).
    pub const BAD_GRANT: u32 = 0x130;
    /// The source's lender cannot reach the target's lender (not in its cluster file, link
    /// refused or down).
    pub const PEER_LENDER: u32 = 0x131;
}

/// P2P_GRANT: lets lender `grantee` (a node name) map the peer memory of BAR `bar` of lease
/// `target` (held on this session). The lender checks the BAR has peer memory and answers a
/// grant id and a random capability secret; the grant lives until revoked, the target is
/// reset, or the lease ends. Errors: `UNKNOWN_LEASE`, `OUT_OF_RANGE` (no such BAR),
/// `INVALID` (no peer memory in the BAR; grantee is this lender; too many grants).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct P2pGrant {
    /// Lease whose BAR is the DMA target.
    pub target: u64,
    /// BAR index.
    pub bar: u8,
    /// Node name of the lender that will map it (the source device's lender).
    pub grantee: String,
}

/// Reply to [`P2pGrant`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct P2pGranted {
    /// Grant id (unique on this lender).
    pub grant: u64,
    /// Capability secret ([`SECRET_LEN`] bytes): whoever presents it with the grant id, over
    /// a link authenticated as the grantee, reaches the memory.
    pub secret: Vec<u8>,
}

/// P2P_REVOKE: withdraws grant `grant` of lease `target` (held on this session); its
/// attachment, if any, ends first (the grantee's mapping is severed). Revoking a grant the
/// lender already ended (target reset, lease end) succeeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct P2pRevoke {
    /// The granted lease.
    pub target: u64,
    /// Grant id.
    pub grant: u64,
}

/// P2P_MAP_REMOTE: map BAR `bar` of lease `target` on lender `lender`, placed by the
/// borrower at guest-physical address `iova`, into lease `source`'s IOMMU domain at that
/// address, using the grant `grant`/`secret` that lender gave the borrower for this lender.
/// Errors: `UNKNOWN_LEASE` (source), `PEER_LENDER` (cannot reach `lender`), `BAD_GRANT`
/// (the target's lender refused the grant), `INVALID` (overlap, alignment, already mapped,
/// `lender` is this lender), `IOMMU`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct P2pMapRemote {
    /// Lease whose device does the DMA (on this session).
    pub source: u64,
    /// Node name of the target's lender.
    pub lender: String,
    /// The target's lease on that lender.
    pub target: u64,
    /// BAR index of the target.
    pub bar: u8,
    /// IOVA in the source's domain (the BAR's guest-physical address).
    pub iova: u64,
    /// Grant id from [`P2pGranted`].
    pub grant: u64,
    /// Capability secret from [`P2pGranted`].
    pub secret: Vec<u8>,
}

/// P2P_UNMAP_REMOTE: undo the [`P2pMapRemote`] of (`source`, `lender`, `target`, `bar`).
/// Unmapping a mapping already ended (the target's lender revoked it or its link died)
/// succeeds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct P2pUnmapRemote {
    /// Lease whose domain holds the mapping.
    pub source: u64,
    /// Node name of the target's lender.
    pub lender: String,
    /// The target's lease on that lender.
    pub target: u64,
    /// BAR index of the target.
    pub bar: u8,
}

/// P2P_ATTACH (lender → lender): presents grant `grant` with its `secret` over a link
/// authenticated as the grantee. The target's lender exports the peer memory as a fabric
/// window on this link. Errors: `BAD_GRANT`, `INVALID` (already attached).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct P2pAttach {
    /// Grant id.
    pub grant: u64,
    /// Capability secret.
    pub secret: Vec<u8>,
}

/// Reply to [`P2pAttach`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct P2pAttached {
    /// Fabric window (exported by the target's lender on this link).
    pub window: u32,
    /// Offset of the memory in the BAR (page aligned).
    pub bar_offset: u64,
    /// Bytes (page multiple).
    pub size: u64,
}

/// P2P_MAP_GRANTED: [`super::P2pMap`] on one lender, with a grant of (`target`, `bar`) to
/// this lender as the capability. Errors as P2P_MAP, and `BAD_GRANT` (unknown grant, not
/// this lease and BAR, not granted to this lender, wrong secret).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct P2pMapGranted {
    /// Lease whose device does the DMA (on this session).
    pub source: u64,
    /// Lease whose BAR is the DMA target.
    pub target: u64,
    /// BAR index of the target.
    pub bar: u8,
    /// IOVA in the source's domain (the BAR's guest-physical address).
    pub iova: u64,
    /// Grant id from [`P2pGranted`] (granted to this lender).
    pub grant: u64,
    /// Capability secret from [`P2pGranted`].
    pub secret: Vec<u8>,
}

/// P2P_DETACH (lender → lender): ends the attachment of grant `grant` (the window is
/// revoked). Detaching what is not attached succeeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct P2pDetach {
    /// Grant id.
    pub grant: u64,
}

/// The opcode of a version 6 request, `None` for other requests.
pub(super) fn opcode_of(r: &Request) -> Option<u16> {
    Some(match r {
        Request::P2pGrant(_) => opcode::P2P_GRANT,
        Request::P2pRevoke(_) => opcode::P2P_REVOKE,
        Request::P2pMapRemote(_) => opcode::P2P_MAP_REMOTE,
        Request::P2pUnmapRemote(_) => opcode::P2P_UNMAP_REMOTE,
        Request::P2pAttach(_) => opcode::P2P_ATTACH,
        Request::P2pDetach(_) => opcode::P2P_DETACH,
        Request::P2pMapGranted(_) => opcode::P2P_MAP_GRANTED,
        _ => return None,
    })
}

/// Whether `op` is a version 6 request.
pub(super) fn is_p2px_op(op: u16) -> bool {
    (opcode::P2P_GRANT..=opcode::P2P_MAP_GRANTED).contains(&op)
}

/// The lease of a version 6 request (`None` for other requests and the lender-to-lender
/// ones, which name a grant).
pub(super) fn lease_of(r: &Request) -> Option<u64> {
    match r {
        Request::P2pGrant(g) => Some(g.target),
        Request::P2pRevoke(g) => Some(g.target),
        Request::P2pMapRemote(m) => Some(m.source),
        Request::P2pUnmapRemote(m) => Some(m.source),
        Request::P2pMapGranted(m) => Some(m.source),
        _ => None,
    }
}

/// Encodes a version 6 request's payload (`None` for other requests).
pub(super) fn encode(r: &Request, op: u16) -> Option<Result<Vec<u8>, ProtocolError>> {
    Some(match r {
        Request::P2pGrant(v) => enc(op, v),
        Request::P2pRevoke(v) => enc(op, v),
        Request::P2pMapRemote(v) => enc(op, v),
        Request::P2pUnmapRemote(v) => enc(op, v),
        Request::P2pAttach(v) => enc(op, v),
        Request::P2pDetach(v) => enc(op, v),
        Request::P2pMapGranted(v) => enc(op, v),
        _ => return None,
    })
}

fn check_secret(op: u16, s: &[u8]) -> Result<(), ProtocolError> {
    if s.len() != SECRET_LEN {
        return Err(invalid(
            op,
            format!("grant secret is {} bytes, expected {SECRET_LEN}", s.len()),
        ));
    }
    Ok(())
}

/// Decodes and validates a version 6 request. Never panics.
pub(super) fn decode(op: u16, payload: &[u8]) -> Result<Request, ProtocolError> {
    Ok(match op {
        opcode::P2P_GRANT => {
            let g: P2pGrant = dec(op, payload)?;
            check_str(op, "grantee", &g.grantee)?;
            Request::P2pGrant(g)
        }
        opcode::P2P_REVOKE => Request::P2pRevoke(dec(op, payload)?),
        opcode::P2P_MAP_REMOTE => {
            let m: P2pMapRemote = dec(op, payload)?;
            check_str(op, "lender", &m.lender)?;
            check_secret(op, &m.secret)?;
            Request::P2pMapRemote(m)
        }
        opcode::P2P_UNMAP_REMOTE => {
            let m: P2pUnmapRemote = dec(op, payload)?;
            check_str(op, "lender", &m.lender)?;
            Request::P2pUnmapRemote(m)
        }
        opcode::P2P_ATTACH => {
            let a: P2pAttach = dec(op, payload)?;
            check_secret(op, &a.secret)?;
            Request::P2pAttach(a)
        }
        opcode::P2P_DETACH => Request::P2pDetach(dec(op, payload)?),
        opcode::P2P_MAP_GRANTED => {
            let m: P2pMapGranted = dec(op, payload)?;
            check_secret(op, &m.secret)?;
            if m.source == m.target {
                return Err(invalid(
                    op,
                    format!("lease {} cannot map its own bar peer-to-peer", m.source),
                ));
            }
            Request::P2pMapGranted(m)
        }
        _ => return Err(ProtocolError::UnknownOpcode(op)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_6_requests_roundtrip_and_are_unknown_before() {
        let reqs = [
            Request::P2pGrant(P2pGrant {
                target: 3,
                bar: 0,
                grantee: "lenderA".into(),
            }),
            Request::P2pRevoke(P2pRevoke {
                target: 3,
                grant: 9,
            }),
            Request::P2pMapRemote(P2pMapRemote {
                source: 1,
                lender: "lenderB".into(),
                target: 3,
                bar: 0,
                iova: 0xc000_0000,
                grant: 9,
                secret: vec![7; SECRET_LEN],
            }),
            Request::P2pUnmapRemote(P2pUnmapRemote {
                source: 1,
                lender: "lenderB".into(),
                target: 3,
                bar: 0,
            }),
            Request::P2pAttach(P2pAttach {
                grant: 9,
                secret: vec![7; SECRET_LEN],
            }),
            Request::P2pDetach(P2pDetach { grant: 9 }),
            Request::P2pMapGranted(P2pMapGranted {
                source: 1,
                target: 2,
                bar: 0,
                iova: 0xc000_0000,
                grant: 9,
                secret: vec![7; SECRET_LEN],
            }),
        ];
        for r in reqs {
            let (op, p) = r.encode_versioned(P2PX_VERSION).unwrap();
            assert!(is_p2px_op(op));
            assert_eq!(Request::decode_versioned(op, &p, P2PX_VERSION).unwrap(), r);
            assert_eq!(
                Request::decode_versioned(op, &p, P2PX_VERSION - 1),
                Err(ProtocolError::UnknownOpcode(op))
            );
            assert!(r.encode_versioned(P2PX_VERSION - 1).is_err());
        }
        // A short secret is refused with a clear error.
        let (op, p) = Request::P2pAttach(P2pAttach {
            grant: 1,
            secret: vec![1; 4],
        })
        .encode()
        .unwrap();
        let e = Request::decode(op, &p).unwrap_err();
        assert!(e.to_string().contains("secret is 4 bytes"), "{e}");
    }
}
