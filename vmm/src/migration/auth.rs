//! Who may send a VM and who may receive it.
//!
//! The stream carries guest RAM, vCPU state and the lent devices' single-use transfer
//! tickets, so it is held to the standard of a fabric link (docs/SECURITY.md, "Migration
//! stream"):
//!
//! - on tcp it runs inside the fabric's TLS ([`ntb::tls`], the one TLS set-up of the tree),
//!   and both sides must hold the cluster secret;
//! - the two VMMs prove the secret to each other with the fabric's challenge–response
//!   ([`lending::auth`], under the migration's own role labels), over fresh nonces, both node
//!   names and the TLS channel binding: a relay in the middle holds two TLS sessions and
//!   cannot pass, and the destination's name, which the source's lenders bind the transfer
//!   tickets to, is the one it proved the secret under;
//! - on a unix socket the listener is private (0600) and each side first checks the other's
//!   credentials (`SO_PEERCRED`: the same uid, or root), before anything is said or the
//!   guest RAM memfd passed; with the secret the proofs follow as on tcp.
//!
//! The destination accepts one source that proves the secret, once: a peer that fails is
//! dropped and the listener goes on; the first that passes closes it.

use super::protocol::{
    self, kind, AuthHello, AuthProof, AuthReply, Frame, Identity, MigrationError, Stream,
};
use lending::auth::{Role, Transcript};

/// How the migration stream of this VMM is authenticated.
#[derive(Clone, Debug, Default)]
pub struct StreamAuth {
    /// The cluster secret (token). `None`: unix sockets only, on peer credentials alone.
    pub secret: Option<String>,
    /// This VMM's node name on the fabric, bound into the proofs (`None`: empty).
    pub node: Option<String>,
}

impl StreamAuth {
    /// The secret, if it is usable (an empty token is none).
    fn secret(&self) -> Option<&str> {
        self.secret.as_deref().filter(|s| !s.is_empty())
    }

    /// Whether this VMM can authenticate a migration.
    pub fn has_secret(&self) -> bool {
        self.secret().is_some()
    }
}

/// The destination's name in the proofs: `node/vm`, what the tickets are issued for.
fn destination_label(node: &Option<String>, vm: &Option<String>) -> String {
    format!(
        "{}/{}",
        node.as_deref().unwrap_or_default(),
        vm.as_deref().unwrap_or_default()
    )
}

fn unexpected(step: &'static str, f: &Frame) -> MigrationError {
    MigrationError::Unexpected {
        step,
        got: protocol::kind_of(f),
    }
}

/// Sends this side's proof of the secret over `t` (`AUTH_PROOF`), under `role`.
fn send_proof(
    stream: &mut Stream,
    t: &Transcript<'_>,
    secret: &str,
    role: Role,
) -> Result<(), MigrationError> {
    let proof = t.prove(secret, role).map_err(MigrationError::Auth)?;
    protocol::write_json(
        stream,
        kind::AUTH_PROOF,
        "authentication proof",
        &AuthProof {
            proof: proof.to_vec(),
        },
    )
}

/// The source's side: proves the secret, then checks the destination's proof. Returns the
/// destination's proven identity (its lenders' tickets go to that name only).
///
/// The source proves first: the destination answers whoever connects to its port, and a
/// proof it sent before the peer proved anything would give any network peer an HMAC to test
/// token guesses against offline. The source only talks to the address its operator gave.
/// A destination from before this order sends its proof in its reply; the source checks it
/// first and then proves, as such a destination expects.
pub fn prove_source(
    stream: &mut Stream,
    auth: &StreamAuth,
) -> Result<Option<Identity>, MigrationError> {
    let Some(secret) = auth.secret() else {
        return Ok(None);
    };
    let ours = lending::auth::nonce().map_err(MigrationError::Auth)?;
    protocol::write_json(
        stream,
        kind::AUTH,
        "authentication",
        &AuthHello {
            node: auth.node.clone(),
            nonce: ours.to_vec(),
        },
    )?;
    let step = "waiting for the destination's challenge";
    let reply = match protocol::read_frame(stream, step)? {
        Frame::AuthReply(r) => r,
        Frame::Refused(why) => return Err(MigrationError::Refused(why.reason)),
        f => return Err(unexpected(step, &f)),
    };
    let source = auth.node.clone().unwrap_or_default();
    let destination = destination_label(&reply.node, &reply.vm);
    let binding = stream.binding().to_vec();
    let t = Transcript {
        borrower_nonce: &ours,
        lender_nonce: &reply.nonce,
        borrower: &source,
        lender: &destination,
        binding: &binding,
    };
    let check_destination = |proof: &[u8]| -> Result<(), MigrationError> {
        if t.verify(secret, Role::MigrationDestination, proof)
            .map_err(MigrationError::Auth)?
        {
            Ok(())
        } else {
            Err(MigrationError::Unproven { who: "destination" })
        }
    };
    let identity = Identity {
        node: reply.node.clone(),
        vm: reply.vm.clone(),
    };
    let legacy = !reply.proof.is_empty();
    if legacy {
        check_destination(&reply.proof)?;
    }
    send_proof(stream, &t, secret, Role::MigrationSource)?;
    if legacy {
        protocol::read_answer(stream, "waiting for the destination to accept our proof")?;
        return Ok(Some(identity));
    }
    let step = "waiting for the destination's proof";
    let theirs = match protocol::read_frame(stream, step)? {
        Frame::AuthProof(p) => p,
        Frame::Refused(why) => return Err(MigrationError::Refused(why.reason)),
        f => return Err(unexpected(step, &f)),
    };
    check_destination(&theirs.proof)?;
    Ok(Some(identity))
}

/// The destination's side: the source must open with the authentication and prove the
/// secret (with `auth` holding one; without, only a source without one is taken, on a unix
/// socket). `identity` is this VMM's, proven to the source once the source has proven the
/// secret: before that the destination sends only its name and a nonce (its challenge), so
/// a peer that merely connects learns nothing to test token guesses against.
pub fn verify_source(
    stream: &mut Stream,
    auth: &StreamAuth,
    identity: &Identity,
) -> Result<(), MigrationError> {
    let Some(secret) = auth.secret() else {
        return Ok(());
    };
    let step = "waiting for the source to authenticate";
    let hello = match protocol::read_frame(stream, step)? {
        Frame::Auth(h) => h,
        Frame::Hello(_) => return Err(MigrationError::Unauthenticated),
        f => return Err(unexpected(step, &f)),
    };
    let ours = lending::auth::nonce().map_err(MigrationError::Auth)?;
    let source = hello.node.clone().unwrap_or_default();
    let destination = destination_label(&identity.node, &identity.vm);
    let binding = stream.binding().to_vec();
    let t = Transcript {
        borrower_nonce: &hello.nonce,
        lender_nonce: &ours,
        borrower: &source,
        lender: &destination,
        binding: &binding,
    };
    protocol::write_json(
        stream,
        kind::AUTH_REPLY,
        "authentication challenge",
        &AuthReply {
            node: identity.node.clone(),
            vm: identity.vm.clone(),
            nonce: ours.to_vec(),
            // No proof yet: the source proves first.
            proof: Vec::new(),
        },
    )?;
    let step = "waiting for the source's proof";
    let theirs = match protocol::read_frame(stream, step)? {
        Frame::AuthProof(p) => p,
        f => return Err(unexpected(step, &f)),
    };
    if !t
        .verify(secret, Role::MigrationSource, &theirs.proof)
        .map_err(MigrationError::Auth)?
    {
        return Err(MigrationError::Unproven { who: "source" });
    }
    send_proof(stream, &t, secret, Role::MigrationDestination)?;
    log::info!("migration source {source:?} proved the cluster secret");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn auth(secret: Option<&str>, node: &str) -> StreamAuth {
        StreamAuth {
            secret: secret.map(str::to_string),
            node: Some(node.into()),
        }
    }

    fn dst_identity() -> Identity {
        Identity {
            node: Some("node9".into()),
            vm: Some("dst".into()),
        }
    }

    /// Runs both sides over a socket pair whose ends see `bindings` (a relay in the middle
    /// of two TLS sessions gives each end another binding).
    fn run(
        src: StreamAuth,
        dst: StreamAuth,
        bindings: (&[u8], &[u8]),
    ) -> (
        Result<Option<Identity>, MigrationError>,
        Result<(), MigrationError>,
    ) {
        let (a, b) = UnixStream::pair().unwrap();
        let t = std::time::Duration::from_secs(5);
        let mut a = Stream::Tls {
            plain: a,
            binding: bindings.0.to_vec(),
        };
        let mut b = Stream::Tls {
            plain: b,
            binding: bindings.1.to_vec(),
        };
        a.set_timeout(Some(t)).unwrap();
        b.set_timeout(Some(t)).unwrap();
        let d = std::thread::spawn(move || {
            let r = verify_source(&mut b, &dst, &dst_identity());
            if let Err(e) = &r {
                let _ = protocol::write_json(
                    &mut b,
                    kind::REFUSED,
                    "refusal",
                    &protocol::Refusal {
                        reason: e.to_string(),
                    },
                );
            }
            r
        });
        let s = prove_source(&mut a, &src);
        drop(a);
        (s, d.join().unwrap())
    }

    #[test]
    fn both_sides_prove_the_secret_and_the_destination_its_name() {
        let (s, d) = run(
            auth(Some("s3cret"), "node1"),
            auth(Some("s3cret"), "node9"),
            (b"tls", b"tls"),
        );
        d.unwrap();
        assert_eq!(s.unwrap(), Some(dst_identity()));
    }

    #[test]
    fn a_wrong_secret_a_relay_or_no_proof_is_refused() {
        // The source holds another secret: its proof (it proves first) does not verify at
        // the destination, which refuses it and never proves anything.
        let (s, d) = run(
            auth(Some("guess"), "node1"),
            auth(Some("s3cret"), "node9"),
            (b"tls", b"tls"),
        );
        assert!(
            matches!(&s, Err(MigrationError::Refused(why)) if why.contains("source")),
            "{s:?}"
        );
        assert!(
            matches!(d, Err(MigrationError::Unproven { who: "source" })),
            "the destination took an unproven source: {d:?}"
        );
        // A relay that terminates TLS on both sides: two bindings, no proof verifies.
        let (s, d) = run(
            auth(Some("s3cret"), "node1"),
            auth(Some("s3cret"), "node9"),
            (b"session-a", b"session-b"),
        );
        assert!(s.is_err(), "{s:?}");
        assert!(d.is_err(), "{d:?}");
        // A source without the secret says HELLO at once: refused by name.
        let (a, b) = UnixStream::pair().unwrap();
        let mut a = Stream::Unix(a);
        let mut b = Stream::Unix(b);
        protocol::write_json(&mut a, kind::HELLO, "hello", &protocol::Hello::current()).unwrap();
        let e = verify_source(&mut b, &auth(Some("s3cret"), "node9"), &dst_identity()).unwrap_err();
        assert!(matches!(e, MigrationError::Unauthenticated), "{e}");
        assert!(e.to_string().contains("proves the cluster secret"), "{e}");
    }

    /// A peer that connects to a destination and opens the authentication gets a nonce and a
    /// name, no proof: nothing to test token guesses against offline (issue 32: the
    /// destination used to prove first, to anyone). Only after the peer's own proof fails is
    /// it dropped, still without one.
    #[test]
    fn a_peer_that_connects_gets_no_proof_before_it_proves() {
        let (a, b) = UnixStream::pair().unwrap();
        let t = std::time::Duration::from_secs(5);
        let mut a = Stream::Tls {
            plain: a,
            binding: b"tls".to_vec(),
        };
        let mut b = Stream::Tls {
            plain: b,
            binding: b"tls".to_vec(),
        };
        a.set_timeout(Some(t)).unwrap();
        b.set_timeout(Some(t)).unwrap();
        let d = std::thread::spawn(move || {
            verify_source(&mut b, &auth(Some("s3cret"), "node9"), &dst_identity())
        });
        protocol::write_json(
            &mut a,
            kind::AUTH,
            "authentication",
            &AuthHello {
                node: Some("harvester".into()),
                nonce: vec![7; 32],
            },
        )
        .unwrap();
        let reply = match protocol::read_frame(&mut a, "challenge").unwrap() {
            Frame::AuthReply(r) => r,
            f => panic!("{:?}", protocol::kind_of(&f)),
        };
        assert!(reply.proof.is_empty(), "the destination proved first");
        assert_eq!(reply.nonce.len(), 32);
        protocol::write_json(
            &mut a,
            kind::AUTH_PROOF,
            "authentication proof",
            &AuthProof { proof: vec![0; 32] },
        )
        .unwrap();
        let e = d.join().unwrap().unwrap_err();
        assert!(
            matches!(e, MigrationError::Unproven { who: "source" }),
            "{e}"
        );
        // Nothing follows: the destination sent no proof after the failed one.
        let mut rest = Vec::new();
        drop(std::io::Read::read_to_end(&mut a, &mut rest));
        assert!(rest.is_empty(), "{} more bytes", rest.len());
    }

    #[test]
    fn the_peer_user_check_takes_this_user() {
        let (a, _b) = UnixStream::pair().unwrap();
        Stream::Unix(a).check_peer_user().unwrap();
    }
}
