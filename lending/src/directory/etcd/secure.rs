//! What the directory does not take on trust: how the client reaches etcd (TLS with the
//! operator's CA and client certificate, an etcd user whose password comes from a private
//! file), and the binding of a claim record to its claimant.
//!
//! A claim record carries an HMAC-SHA256 over its fields, keyed by a key derived from the
//! cluster secret (the fabric token). Anyone who can write to etcd but does not hold the
//! cluster secret cannot make a record a lender accepts: the lender checks the MAC before it
//! fences a borrow with the claim ([`super::EtcdClaims::verify`]) and before a new claim
//! revision counts as the device's current claim ([`super::EtcdClaims::apply`], which is
//! what ends a lease whose claim was replaced). A deletion cannot carry a MAC: a claim
//! deleted by someone with write access to etcd ends its lease (etcd's own TLS, client
//! certificates and users keep such writers out).

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use etcd_client::{Certificate, ConnectOptions, Identity, TlsOptions};
use hmac::{Hmac, Mac};
use ntb::DirectoryConfig;
use sha2::Sha256;

use super::super::{ClaimRecord, DirectoryError};

type HmacSha256 = Hmac<Sha256>;

/// Longest credential file read (certificate bundles included).
const MAX_CREDENTIAL_FILE: u64 = 1 << 20;

/// Reads a credential file; `private` files (keys, passwords) must not be readable by group
/// or others (the mode is checked on the opened file).
fn read_file(what: &'static str, path: &Path, private: bool) -> Result<Vec<u8>, DirectoryError> {
    let shown = path.display().to_string();
    let io = |source| DirectoryError::Credential {
        what,
        path: shown.clone(),
        source,
    };
    let f = std::fs::File::open(path).map_err(io)?;
    let meta = f.metadata().map_err(io)?;
    let mode = meta.permissions().mode() & 0o7777;
    if private && mode & 0o077 != 0 {
        return Err(DirectoryError::CredentialMode {
            what,
            path: shown,
            mode,
        });
    }
    let mut buf = Vec::new();
    f.take(MAX_CREDENTIAL_FILE)
        .read_to_end(&mut buf)
        .map_err(io)?;
    Ok(buf)
}

/// The connect options `cfg` asks for: TLS (CA, client identity) and the etcd user.
pub(super) fn apply_credentials(
    cfg: &DirectoryConfig,
    mut opts: ConnectOptions,
) -> Result<ConnectOptions, DirectoryError> {
    cfg.validate().map_err(DirectoryError::Config)?;
    if let Some(ca) = &cfg.ca {
        let mut tls =
            TlsOptions::new().ca_certificate(Certificate::from_pem(read_file("CA", ca, false)?));
        if let (Some(cert), Some(key)) = (&cfg.cert, &cfg.key) {
            tls = tls.identity(Identity::from_pem(
                read_file("client certificate", cert, false)?,
                read_file("client key", key, true)?,
            ));
        }
        opts = opts.with_tls(tls);
    }
    if let (Some(user), Some(pw)) = (&cfg.user, &cfg.password_file) {
        let text = read_file("password", pw, true)?;
        let text = String::from_utf8(text).map_err(|_| {
            DirectoryError::Config(format!("password file {} is not UTF-8", pw.display()))
        })?;
        let password = text.trim_end_matches(['\n', '\r']);
        if password.is_empty() {
            return Err(DirectoryError::Config(format!(
                "password file {} is empty",
                pw.display()
            )));
        }
        // The auth token etcd hands out expires (simple tokens after 5 min idle by default):
        // the client authenticates again when a call finds it expired.
        opts = opts
            .with_user(user.clone(), password.to_string())
            .with_auto_token_refresh(true);
    }
    Ok(opts)
}

/// The endpoint URLs: https when the config has a CA.
pub(super) fn endpoint_urls(cfg: &DirectoryConfig) -> Vec<String> {
    let scheme = if cfg.tls() { "https" } else { "http" };
    cfg.etcd.iter().map(|e| format!("{scheme}://{e}")).collect()
}

/// The key claim records are signed with, derived from the cluster secret (so the secret
/// itself keys nothing but the fabric's own challenge-response).
#[derive(Clone)]
pub(crate) struct ClaimKey([u8; 32]);

impl std::fmt::Debug for ClaimKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClaimKey(<redacted>)")
    }
}

/// Why a claim record is not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ClaimMacError {
    #[error("the claim record has no MAC (written by someone without the cluster secret)")]
    Missing,
    #[error("the claim record's MAC does not match (forged or altered record)")]
    Mismatch,
}

impl ClaimKey {
    pub(crate) fn from_secret(secret: &str) -> ClaimKey {
        // HMAC accepts keys of any length: `new_from_slice` cannot fail for it.
        let mut m = <HmacSha256 as Mac>::new_from_slice(secret.as_bytes())
            .unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
        m.update(b"lendvm directory claim key v1");
        ClaimKey(m.finalize().into_bytes().into())
    }

    fn mac(&self, rec: &ClaimRecord) -> HmacSha256 {
        let mut m = <HmacSha256 as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
        // v2: the etcd lease is covered too (v1 records, without it, no longer check).
        m.update(b"lendvm-claim-v2");
        // Length-prefixed fields: no two different records hash the same bytes.
        for f in [&rec.node, &rec.bdf, &rec.holder, &rec.vm] {
            m.update(&(f.len() as u64).to_le_bytes());
            m.update(f.as_bytes());
        }
        m.update(&rec.lease.to_le_bytes());
        m
    }

    /// `rec` with its MAC set.
    pub(crate) fn sign(&self, mut rec: ClaimRecord) -> ClaimRecord {
        let tag = self.mac(&rec).finalize().into_bytes();
        rec.mac = Some(tag.iter().map(|b| format!("{b:02x}")).collect());
        rec
    }

    /// Checks `rec`'s MAC (constant-time compare).
    pub(crate) fn check(&self, rec: &ClaimRecord) -> Result<(), ClaimMacError> {
        let hex = rec.mac.as_deref().ok_or(ClaimMacError::Missing)?;
        let tag = decode_hex(hex).ok_or(ClaimMacError::Mismatch)?;
        self.mac(rec)
            .verify_slice(&tag)
            .map_err(|_| ClaimMacError::Mismatch)
    }
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if s.len() != 64 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|b| u8::from_str_radix(b, 16).ok()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec() -> ClaimRecord {
        ClaimRecord {
            node: "node3".into(),
            bdf: "0000:00:04.0".into(),
            holder: "vmm-a".into(),
            vm: "vm0".into(),
            lease: 0x6d2f_8e41_a3b5_0c17,
            mac: None,
        }
    }

    #[test]
    fn a_claim_mac_binds_every_field_to_the_cluster_secret() {
        let k = ClaimKey::from_secret("cluster secret");
        let signed = k.sign(rec());
        k.check(&signed).unwrap();
        assert_eq!(k.check(&rec()), Err(ClaimMacError::Missing));
        // Another secret, or any field changed, or a field boundary moved: refused.
        let other = ClaimKey::from_secret("another secret");
        assert_eq!(other.check(&signed), Err(ClaimMacError::Mismatch));
        let mut r = signed.clone();
        r.holder = "vmm-evil".into();
        assert_eq!(k.check(&r), Err(ClaimMacError::Mismatch));
        let mut r = signed.clone();
        r.holder = "vmm-av".into();
        r.vm = "m0".into();
        assert_eq!(k.check(&r), Err(ClaimMacError::Mismatch));
        // The record moved to another etcd lease (a replay under a lease of the writer's).
        let mut r = signed.clone();
        r.lease += 1;
        assert_eq!(k.check(&r), Err(ClaimMacError::Mismatch));
        let mut r = signed;
        r.mac = Some("zz".repeat(32));
        assert_eq!(k.check(&r), Err(ClaimMacError::Mismatch));
    }
}
