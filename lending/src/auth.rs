//! Mutual challenge–response authentication of a borrower and a lender by the cluster token,
//! and the lender's per-address limit on failed authentications.
//!
//! The token never travels. A session starts with AUTH ([`crate::protocol::AuthChallenge`]):
//!
//! 1. borrower → lender: a fresh 32-byte nonce `nb`;
//! 2. lender → borrower: its node name, a fresh nonce `nl` and
//!    `HMAC-SHA256(token, "lendvm-auth-v1 lender" ‖ nb ‖ nl ‖ borrower ‖ lender ‖ binding)`;
//!    the borrower
//!    checks it (constant time) and refuses a lender that does not know the token;
//! 3. borrower → lender: HELLO whose `token` field is [`PROOF_PREFIX`] + hex of
//!    `HMAC-SHA256(token, "lendvm-auth-v1 borrower" ‖ nb ‖ nl ‖ borrower ‖ lender ‖ binding)`.
//!
//! Every field is length-prefixed, so no two different inputs hash alike; the direction label
//! stops a peer from reflecting one side's proof back as the other's; the fresh nonce of each
//! side stops replay; the node names (as the fabric handshake announced them) bind the proof
//! to this pair, so a proof made for another borrower or lender does not verify; the channel
//! binding (the TLS exporter of a tcp link, [`ntb::tls`]) binds it to this TLS session, so a
//! relay in the middle, which holds two sessions, cannot pass. On shm there is no binding:
//! the control socket's permissions (0600) keep other users off the channel.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;
use thiserror::Error;

/// Length of each side's nonce.
pub const NONCE_LEN: usize = 32;
/// Length of a proof (HMAC-SHA256).
pub const PROOF_LEN: usize = 32;
/// How a borrower's proof is carried in [`crate::protocol::Hello::token`].
pub const PROOF_PREFIX: &str = "hmac-sha256:";
/// Domain separation of the proofs (bump when the construction changes).
const LABEL: &[u8] = b"lendvm-auth-v1";

type HmacSha256 = Hmac<Sha256>;

/// Errors of authentication.
#[derive(Debug, Error)]
pub enum AuthError {
    /// No randomness for a nonce.
    #[error("cannot draw a nonce: {0}")]
    Random(String),
    /// The HMAC key was refused.
    #[error("hmac key: {0}")]
    Key(String),
    /// A nonce or proof of the wrong size.
    #[error("{what} is {len} bytes, expected {want}")]
    BadLength {
        /// Which field.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The expected length.
        want: usize,
    },
}

/// Which side proves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The lender (answers AUTH).
    Lender,
    /// The borrower (sends HELLO).
    Borrower,
    /// The source of a live migration (`vmm::migration`): the same construction over the
    /// migration stream, under labels of its own so that no proof of one protocol verifies
    /// in the other.
    MigrationSource,
    /// The destination of a live migration.
    MigrationDestination,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Lender => b"lender",
            Role::Borrower => b"borrower",
            Role::MigrationSource => b"migration-source",
            Role::MigrationDestination => b"migration-destination",
        }
    }
}

/// What both sides feed into a proof.
#[derive(Debug, Clone, Copy)]
pub struct Transcript<'a> {
    /// The borrower's nonce.
    pub borrower_nonce: &'a [u8],
    /// The lender's nonce.
    pub lender_nonce: &'a [u8],
    /// The borrower's node name.
    pub borrower: &'a str,
    /// The lender's node name.
    pub lender: &'a str,
    /// The link's channel binding ([`ntb::Endpoint::channel_binding`]: the TLS exporter on
    /// tcp, empty on shm), so a proof made through a relay does not verify.
    pub binding: &'a [u8],
}

impl Transcript<'_> {
    fn check(&self) -> Result<(), AuthError> {
        for (what, n) in [
            ("borrower nonce", self.borrower_nonce),
            ("lender nonce", self.lender_nonce),
        ] {
            if n.len() != NONCE_LEN {
                return Err(AuthError::BadLength {
                    what,
                    len: n.len(),
                    want: NONCE_LEN,
                });
            }
        }
        Ok(())
    }

    fn mac(&self, token: &str, role: Role) -> Result<HmacSha256, AuthError> {
        self.check()?;
        // HMAC takes keys of any length; new_from_slice cannot fail for it.
        let mut m = HmacSha256::new_from_slice(token.as_bytes())
            .map_err(|e| AuthError::Key(e.to_string()))?;
        let mut field = |b: &[u8]| {
            m.update(&(b.len() as u64).to_le_bytes());
            m.update(b);
        };
        field(LABEL);
        field(role.label());
        field(self.borrower_nonce);
        field(self.lender_nonce);
        field(self.borrower.as_bytes());
        field(self.lender.as_bytes());
        field(self.binding);
        Ok(m)
    }

    /// `role`'s proof of knowing `token` for this transcript.
    pub fn prove(&self, token: &str, role: Role) -> Result<[u8; PROOF_LEN], AuthError> {
        Ok(self.mac(token, role)?.finalize().into_bytes().into())
    }

    /// Whether `proof` is `role`'s proof for this transcript (constant-time compare).
    pub fn verify(&self, token: &str, role: Role, proof: &[u8]) -> Result<bool, AuthError> {
        Ok(self.mac(token, role)?.verify_slice(proof).is_ok())
    }
}

/// Whether two secrets (migration tickets, P2P grants) are equal, in time that does not depend
/// on where they differ (`subtle`, as hmac's own `verify_slice`). Lengths are not secret.
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.ct_eq(b).into()
}

/// A fresh random nonce.
pub fn nonce() -> Result<[u8; NONCE_LEN], AuthError> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| AuthError::Random(e.to_string()))?;
    Ok(n)
}

/// `proof` as the HELLO token field.
pub fn encode_proof(proof: &[u8]) -> String {
    let mut s = String::with_capacity(PROOF_PREFIX.len() + proof.len() * 2);
    s.push_str(PROOF_PREFIX);
    for b in proof {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// The proof in a HELLO token field, `None` if it is not [`PROOF_PREFIX`] + 64 hex digits
/// (for example a plain token from a borrower that predates challenge–response).
pub fn decode_proof(token: &str) -> Option<[u8; PROOF_LEN]> {
    let hex = token.strip_prefix(PROOF_PREFIX)?;
    if hex.len() != PROOF_LEN * 2 || !hex.is_ascii() {
        return None;
    }
    let mut out = [0u8; PROOF_LEN];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(hex.get(i * 2..i * 2 + 2)?, 16).ok()?;
    }
    Some(out)
}

/// The key failed authentications are counted under: a tcp peer's IPv4 address (without
/// the port, which an attacker chooses freely), its IPv6 /64 prefix (one host or site
/// holds a whole /64 and can rotate through it at will, so a per-address key would never
/// lock it out), a local peer's uid.
pub fn rate_key(peer_addr: &str) -> String {
    if let Some(rest) = peer_addr.strip_prefix("unix:") {
        // "unix:uid=N,pid=P" -> "uid=N".
        return rest.split(',').next().unwrap_or(rest).to_string();
    }
    let ip = match peer_addr.rsplit_once(':') {
        Some((ip, port)) if port.bytes().all(|b| b.is_ascii_digit()) && !port.is_empty() => ip,
        _ => peer_addr,
    };
    let bare = ip.trim_start_matches('[').trim_end_matches(']');
    match bare.parse::<std::net::Ipv6Addr>() {
        Ok(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => {
                let s = v6.segments();
                let prefix = std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0);
                format!("{prefix}/64")
            }
        },
        Err(_) => ip.to_string(),
    }
}

/// Failed authentications allowed per address within [`FAIL_WINDOW`] before it is refused.
pub const MAX_FAILURES: u32 = 20;
/// The window failures are counted in.
pub const FAIL_WINDOW: Duration = Duration::from_secs(60);
/// How long an address that used up its failures is refused.
pub const LOCKOUT: Duration = Duration::from_secs(30);
/// Addresses remembered at most (older entries are forgotten first).
const MAX_TRACKED: usize = 4096;

#[derive(Debug)]
struct Entry {
    failures: u32,
    since: Instant,
    locked_until: Option<Instant>,
    /// Failures not logged individually since the last log line.
    unlogged: u64,
}

/// Counts failed authentications per address (see [`rate_key`]) and refuses an address for
/// [`LOCKOUT`] once it failed [`MAX_FAILURES`] times within [`FAIL_WINDOW`]. Every AUTH
/// challenge counts as a failure until the session's HELLO proves the token, so harvesting
/// challenges (material for an offline guess of a weak token) is limited as well as guessing.
#[derive(Debug, Default)]
pub struct FailureLimiter {
    map: Mutex<HashMap<String, Entry>>,
}

/// Why an address is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockedOut {
    /// Time left.
    pub retry_in: Duration,
}

impl FailureLimiter {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `key` may try now.
    pub fn check(&self, key: &str) -> Result<(), LockedOut> {
        let now = Instant::now();
        let map = self.lock();
        match map.get(key).and_then(|e| e.locked_until) {
            Some(t) if t > now => Err(LockedOut { retry_in: t - now }),
            _ => Ok(()),
        }
    }

    /// Counts one failure of `key`; logs the first failure of a window and the start of a
    /// lockout, and folds the others into a count (a guessing peer cannot flood the log).
    pub fn fail(&self, key: &str, what: &str) {
        let now = Instant::now();
        let mut map = self.lock();
        if map.len() >= MAX_TRACKED && !map.contains_key(key) {
            map.retain(|_, e| {
                now.duration_since(e.since) < FAIL_WINDOW || e.locked_until.is_some_and(|t| t > now)
            });
            if map.len() >= MAX_TRACKED {
                if let Some(oldest) = map
                    .iter()
                    .min_by_key(|(_, e)| e.since)
                    .map(|(k, _)| k.clone())
                {
                    map.remove(&oldest);
                }
            }
        }
        let e = map.entry(key.to_string()).or_insert(Entry {
            failures: 0,
            since: now,
            locked_until: None,
            unlogged: 0,
        });
        if now.duration_since(e.since) >= FAIL_WINDOW && e.locked_until.is_none_or(|t| t <= now) {
            e.failures = 0;
            e.since = now;
            e.locked_until = None;
        }
        e.failures = e.failures.saturating_add(1);
        if e.failures == 1 {
            log::warn!("authentication failure from {key}: {what}");
        } else {
            e.unlogged += 1;
        }
        if e.failures >= MAX_FAILURES && e.locked_until.is_none_or(|t| t <= now) {
            e.locked_until = Some(now + LOCKOUT);
            log::warn!(
                "{} failed authentications from {key} within {:?} ({} not logged singly, last: \
                 {what}); refusing it for {:?}",
                e.failures,
                FAIL_WINDOW,
                e.unlogged,
                LOCKOUT
            );
            e.unlogged = 0;
        }
    }

    /// Takes back one failure of `key` (a challenge that ended in a proven HELLO).
    pub fn succeed(&self, key: &str) {
        let mut map = self.lock();
        if let Some(e) = map.get_mut(key) {
            e.failures = e.failures.saturating_sub(1);
            e.unlogged = e.unlogged.saturating_sub(1);
            if e.failures == 0 && e.locked_until.is_none() {
                map.remove(key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t<'a>(nb: &'a [u8], nl: &'a [u8]) -> Transcript<'a> {
        Transcript {
            borrower_nonce: nb,
            lender_nonce: nl,
            borrower: "node1",
            lender: "node3",
            binding: b"session-1",
        }
    }

    #[test]
    fn proofs_bind_token_role_nonces_and_names() {
        let (nb, nl) = (nonce().unwrap(), nonce().unwrap());
        assert_ne!(nb, nl);
        let tr = t(&nb, &nl);
        let p = tr.prove("secret", Role::Borrower).unwrap();
        assert!(tr.verify("secret", Role::Borrower, &p).unwrap());
        assert!(
            !tr.verify("secret", Role::Lender, &p).unwrap(),
            "reflection"
        );
        // The migration stream's proofs never pass for the fabric's, nor the other way.
        for (a, b) in [
            (Role::Borrower, Role::MigrationSource),
            (Role::Lender, Role::MigrationDestination),
            (Role::MigrationSource, Role::MigrationDestination),
        ] {
            let pa = tr.prove("secret", a).unwrap();
            assert!(!tr.verify("secret", b, &pa).unwrap(), "{a:?} as {b:?}");
            let pb = tr.prove("secret", b).unwrap();
            assert!(!tr.verify("secret", a, &pb).unwrap(), "{b:?} as {a:?}");
        }
        assert!(
            !tr.verify("other", Role::Borrower, &p).unwrap(),
            "wrong token"
        );
        let nl2 = nonce().unwrap();
        assert!(
            !t(&nb, &nl2).verify("secret", Role::Borrower, &p).unwrap(),
            "replay"
        );
        let swapped = Transcript {
            borrower: "node3",
            lender: "node1",
            ..tr
        };
        assert!(!swapped.verify("secret", Role::Borrower, &p).unwrap());
        let relayed = Transcript {
            binding: b"session-2",
            ..tr
        };
        assert!(
            !relayed.verify("secret", Role::Borrower, &p).unwrap(),
            "relay"
        );
        assert!(!tr.verify("secret", Role::Borrower, &p[..31]).unwrap());
        assert!(tr.prove("secret", Role::Lender).is_ok());
        assert!(t(&nb[..16], &nl).prove("secret", Role::Lender).is_err());
    }

    #[test]
    fn proof_round_trips_through_the_token_field() {
        let p = [0xa5u8; PROOF_LEN];
        let s = encode_proof(&p);
        assert_eq!(decode_proof(&s), Some(p));
        assert_eq!(decode_proof("s3cret-token"), None);
        assert_eq!(decode_proof(&format!("{PROOF_PREFIX}zz")), None);
        assert_eq!(decode_proof(&s[..s.len() - 2]), None);
    }

    #[test]
    fn rate_keys_ignore_ports_and_pids() {
        assert_eq!(rate_key("10.0.0.1:4242"), "10.0.0.1");
        assert_eq!(rate_key("[::1]:4242"), "::/64");
        assert_eq!(rate_key("unix:uid=1000,pid=77"), "uid=1000");
        assert_eq!(
            rate_key("/run/lendvm/lender.sock"),
            "/run/lendvm/lender.sock"
        );
    }

    /// Rotating IPv6 addresses inside one /64 share one key (and so one lockout); another
    /// /64 does not; an IPv4-mapped address counts as its IPv4 address.
    #[test]
    fn ipv6_peers_are_limited_per_64_prefix() {
        assert_eq!(rate_key("[2001:db8:1:2::1]:4242"), "2001:db8:1:2::/64");
        assert_eq!(
            rate_key("[2001:db8:1:2:dead:beef:0:7]:1"),
            "2001:db8:1:2::/64"
        );
        assert_eq!(rate_key("[2001:db8:1:3::1]:4242"), "2001:db8:1:3::/64");
        assert_eq!(rate_key("[::ffff:10.0.0.1]:4242"), "10.0.0.1");
        let l = FailureLimiter::default();
        for i in 0..MAX_FAILURES {
            // A new address of the same /64 for every attempt.
            let key = rate_key(&format!("[2001:db8:1:2:{i:x}:{:x}::9]:4242", i * 7 + 1));
            assert!(l.check(&key).is_ok(), "attempt {i} refused early");
            l.fail(&key, "test");
        }
        let e = l.check(&rate_key("[2001:db8:1:2:ffff::1]:99"));
        assert!(
            e.is_err(),
            "a fresh address of the locked-out /64 got through"
        );
        assert!(l.check(&rate_key("[2001:db8:1:3::1]:99")).is_ok());
    }

    #[test]
    fn limiter_locks_out_after_max_failures_and_forgives_successes() {
        let l = FailureLimiter::default();
        for _ in 0..MAX_FAILURES - 1 {
            l.fail("a", "test");
            assert!(l.check("a").is_ok());
        }
        l.succeed("a");
        l.fail("a", "test");
        assert!(l.check("a").is_ok(), "a success took one failure back");
        l.fail("a", "test");
        let e = l.check("a").unwrap_err();
        assert!(e.retry_in <= LOCKOUT && e.retry_in > Duration::ZERO);
        assert!(l.check("b").is_ok(), "other addresses are not affected");
    }

    #[test]
    fn secrets_are_compared_by_same_secret_only() {
        assert!(same_secret(b"ticket-0123", b"ticket-0123"));
        assert!(!same_secret(b"ticket-0123", b"ticket-0124"));
        assert!(!same_secret(b"ticket", b"ticket-0123"));
        assert!(same_secret(b"", b""));
        // The hand-written XOR fold that tickets and grants were compared with (a loop whose
        // time the compiler may make depend on the data) is gone from the crate: every secret
        // comparison goes through `same_secret` (issue 32).
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut stack = vec![src];
        let mut offenders = Vec::new();
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    let text = std::fs::read_to_string(&p).unwrap();
                    if text.contains(&["acc | (x ", "^ y)"].concat()) {
                        offenders.push(p.display().to_string());
                    }
                }
            }
        }
        assert!(
            offenders.is_empty(),
            "XOR-fold comparisons in {offenders:?}"
        );
    }
}
