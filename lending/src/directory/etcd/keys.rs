//! The key layout below the prefix and the JSON records.

use super::*;

/// Key layout below the prefix.
#[derive(Debug, Clone)]
pub(super) struct Keys {
    pub(super) prefix: String,
}

impl Keys {
    pub(super) fn all(&self) -> String {
        format!("{}/", self.prefix)
    }
    pub(super) fn node(&self, node: &str) -> String {
        format!("{}/nodes/{node}", self.prefix)
    }
    pub(super) fn device(&self, node: &str, bdf: &str) -> String {
        format!("{}/devices/{node}/{bdf}", self.prefix)
    }
    pub(super) fn claim(&self, node: &str, bdf: &str) -> String {
        format!("{}/claims/{node}/{bdf}", self.prefix)
    }
    pub(super) fn claims_of(&self, node: &str) -> String {
        format!("{}/claims/{node}/", self.prefix)
    }
}

/// What a key below the prefix is.
pub(super) enum KeyKind<'a> {
    Node(&'a str),
    Device(&'a str, &'a str),
    Claim(&'a str, &'a str),
    Other,
}

pub(super) fn classify<'a>(keys: &Keys, key: &'a str) -> KeyKind<'a> {
    let Some(rest) = key
        .strip_prefix(keys.prefix.as_str())
        .and_then(|r| r.strip_prefix('/'))
    else {
        return KeyKind::Other;
    };
    let mut parts = rest.splitn(3, '/');
    match (parts.next(), parts.next(), parts.next()) {
        (Some("nodes"), Some(n), None) => KeyKind::Node(n),
        (Some("devices"), Some(n), Some(b)) => KeyKind::Device(n, b),
        (Some("claims"), Some(n), Some(b)) => KeyKind::Claim(n, b),
        _ => KeyKind::Other,
    }
}

pub(super) fn decode<T: DeserializeOwned>(kv: &KeyValue) -> Result<T, DirectoryError> {
    serde_json::from_slice(kv.value()).map_err(|e| DirectoryError::BadRecord {
        key: String::from_utf8_lossy(kv.key()).into_owned(),
        message: e.to_string(),
    })
}

pub(super) fn json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    // Records are plain structs of strings and numbers: serialization cannot fail.
    serde_json::to_vec(v).unwrap_or_default()
}
