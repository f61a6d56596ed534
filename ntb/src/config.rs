//! Cluster description (`resources/cluster.example.toml`): nodes, their control addresses and
//! fabric kinds, optional per-node NTB limits, link timers and policies, and the cluster auth
//! token (`token = "..."` or `token_file = "path"`, relative to the cluster file), and the
//! optional `[directory]` table that moves node discovery and device claims to etcd
//! (`lending::directory`); with it the file may list no nodes at all.

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use crate::fabric::{FabricKind, LinkConfig, NodeId, WindowLimits};
use crate::region::RegionSpec;

/// Errors of the cluster description; they name the file, line and field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{origin}:{line}: {message}")]
    Parse {
        origin: String,
        line: usize,
        message: String,
    },
    #[error("{origin}:{line}: field `{field}`: {message}")]
    Invalid {
        origin: String,
        line: usize,
        field: String,
        message: String,
    },
    #[error("{origin}: {message}")]
    Cluster { origin: String, message: String },
    #[error("token file {path} is empty")]
    EmptyToken { path: String },
    #[error(
        "token file {path} has mode {mode:04o}: group or others may read it; \
         run `chmod 600 {path}`"
    )]
    TokenFileMode { path: String, mode: u32 },
    #[error(
        "{path} holds an inline `token` and has mode {mode:04o}: group or others may read or \
         write it; run `chmod 600 {path}`, or move the token to a `token_file`"
    )]
    InlineTokenMode { path: String, mode: u32 },
    #[error("the cluster token from {from} is too weak: {problem}")]
    WeakToken { from: String, problem: String },
}

/// Where the cluster auth token comes from.
#[derive(Clone, PartialEq, Eq)]
pub enum ClusterToken {
    /// `token = "..."` in the cluster file.
    Inline(String),
    /// `token_file = "path"`; a relative path is already resolved against the directory of
    /// the cluster file (by [`ClusterConfig::load`]).
    File(PathBuf),
}

impl fmt::Debug for ClusterToken {
    /// Never prints the secret.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClusterToken::Inline(_) => f.write_str("Inline(<redacted>)"),
            ClusterToken::File(p) => f.debug_tuple("File").field(p).finish(),
        }
    }
}

/// Longest accepted token.
pub const MAX_TOKEN_LEN: usize = 4096;
/// Shortest accepted token, in bytes: the token is the cluster's only secret (the links'
/// challenge-response and TLS binding derive from it), so it must carry at least 128 bits,
/// which 32 random hex digits do (`openssl rand -hex 32` gives 64).
pub const MIN_TOKEN_LEN: usize = 32;
/// Fewest distinct characters in an accepted token: refuses `aaaa...` and `abab...`-like
/// tokens of the right length (32 random hex digits have about 14 distinct ones).
pub const MIN_TOKEN_DISTINCT: usize = 8;

/// Why `t` is too weak to be the cluster token, `None` if it is strong enough: at least
/// [`MIN_TOKEN_LEN`] bytes and [`MIN_TOKEN_DISTINCT`] distinct characters.
pub fn token_weakness(t: &str) -> Option<String> {
    let hint = "(make one with `openssl rand -hex 32`)";
    if t.len() < MIN_TOKEN_LEN {
        return Some(format!(
            "it is {} bytes long, the minimum is {MIN_TOKEN_LEN} {hint}",
            t.len()
        ));
    }
    let distinct = t.chars().collect::<std::collections::BTreeSet<_>>().len();
    if distinct < MIN_TOKEN_DISTINCT {
        return Some(format!(
            "it has {distinct} distinct characters, the minimum is {MIN_TOKEN_DISTINCT} {hint}"
        ));
    }
    None
}

/// Refuses a cluster token that is too weak ([`token_weakness`]); `from` names where it came
/// from (`--token`, `$LENDVM_TOKEN`, a file) in the error. Every binary checks the token it
/// is given with this before it uses it.
pub fn check_token(t: &str, from: &str) -> Result<(), ConfigError> {
    match token_weakness(t) {
        None => Ok(()),
        Some(problem) => Err(ConfigError::WeakToken {
            from: from.to_string(),
            problem,
        }),
    }
}

/// Checks a token's text; `None` if it is fine.
fn token_problem(t: &str) -> Option<String> {
    if t.trim().is_empty() {
        Some("must not be empty".into())
    } else if t.len() > MAX_TOKEN_LEN {
        Some(format!("is {} bytes, longer than {MAX_TOKEN_LEN}", t.len()))
    } else if t.trim() != t {
        Some("has leading or trailing whitespace".into())
    } else if t.chars().any(char::is_control) {
        Some("contains control characters".into())
    } else {
        token_weakness(t).map(|w| format!("is too weak: {w}"))
    }
}

/// Reads a cluster token file: refuses one that group or others may read (its mode is
/// checked on the opened file, so it cannot be swapped between the check and the read), and
/// returns the trimmed, checked token.
pub fn read_token_file(path: &Path) -> Result<String, ConfigError> {
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    let shown = path.display().to_string();
    let io = |source| ConfigError::Io {
        path: format!("token file {shown}"),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mode = f.metadata().map_err(io)?.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(ConfigError::TokenFileMode { path: shown, mode });
    }
    let mut text = String::new();
    f.read_to_string(&mut text).map_err(io)?;
    let t = text.trim();
    if t.is_empty() {
        return Err(ConfigError::EmptyToken { path: shown });
    }
    if let Some(m) = token_problem(t) {
        return Err(ConfigError::Cluster {
            origin: format!("token file {shown}"),
            message: format!("the token {m}"),
        });
    }
    Ok(t.to_string())
}

/// Writes `token` to a new file at `path` with mode 0600 from the start (for tools and
/// tests that make token files).
pub fn write_token_file(path: &Path, token: &str) -> std::io::Result<()> {
    write_private_file(path, token)
}

/// Writes `text` to `path`, readable and writable by its owner only (mode 0600 from the
/// start, and set again on a file that existed): for token files and cluster files with an
/// inline `token`.
pub fn write_private_file(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    f.write_all(text.as_bytes())
}

/// Where a node listens for links.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlAddr {
    /// A Unix socket path (shm nodes).
    Unix(PathBuf),
    /// `ip:port` (tcp nodes).
    Tcp(SocketAddr),
}

impl ControlAddr {
    /// The kind of fabric a link to this address uses.
    pub fn kind(&self) -> FabricKind {
        match self {
            ControlAddr::Unix(_) => FabricKind::Shm,
            ControlAddr::Tcp(_) => FabricKind::Tcp,
        }
    }

    /// Parses an address for a node of `kind`.
    pub fn parse(kind: FabricKind, s: &str) -> Result<ControlAddr, String> {
        match kind {
            FabricKind::Shm => {
                if s.is_empty() || !s.starts_with('/') {
                    Err(format!(
                        "shm control address {s:?} must be an absolute Unix socket path"
                    ))
                } else if s.len() >= 108 {
                    Err(format!("Unix socket path {s:?} is longer than 107 bytes"))
                } else {
                    Ok(ControlAddr::Unix(PathBuf::from(s)))
                }
            }
            FabricKind::Tcp | FabricKind::Bar => s
                .parse::<SocketAddr>()
                .map(ControlAddr::Tcp)
                .map_err(|_| format!("{kind} control address {s:?} is not ip:port")),
        }
    }
}

impl fmt::Display for ControlAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ControlAddr::Unix(p) => write!(f, "{}", p.display()),
            ControlAddr::Tcp(a) => write!(f, "{a}"),
        }
    }
}

/// One node of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeConfig {
    pub name: NodeId,
    pub fabric: FabricKind,
    pub control: ControlAddr,
    /// Local NTB resources and the cluster's link timers.
    pub link: LinkConfig,
    /// `numa_node = N`: the guest NUMA node a borrower puts this lender's devices in when
    /// its `--remote-device` (or hot-add) names none (as a borrower host's NTB adapter to
    /// this lender sits on one socket).
    pub numa_node: Option<u32>,
}

/// The whole cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    pub nodes: Vec<NodeConfig>,
    /// The cluster auth token setting, if the file has one; read it with
    /// [`ClusterConfig::auth_token`].
    pub token: Option<ClusterToken>,
    /// `[directory]`: the cluster directory is etcd, not this file's node list.
    pub directory: Option<DirectoryConfig>,
}

/// The `[directory]` table: where lenders register and borrowers claim devices.
///
/// ```toml
/// [directory]
/// etcd = ["127.0.0.1:2379"]   # client endpoints (host:port), at least one
/// prefix = "/lendvm"          # key prefix (default /lendvm)
/// lease_ttl_s = 5             # TTL of lender registrations and borrower claims (2..=300)
/// ca = "etcd-ca.pem"          # TLS: the CA of the members' certificates (https endpoints)
/// cert = "client.pem"         # TLS client certificate (etcd --client-cert-auth), with key
/// key = "client-key.pem"      # its private key (mode 0600)
/// user = "lendvm"             # etcd auth: user name, with password_file
/// password_file = "etcd-pw"   # the user's password (mode 0600; never inline)
/// allow_plain = false         # plain http to endpoints off loopback (explicit opt-in)
/// ```
///
/// Relative paths are relative to the cluster file. The `--cluster etcd://` URL takes the
/// same keys as query parameters ([`DirectoryConfig::from_url`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DirectoryConfig {
    pub etcd: Vec<String>,
    pub prefix: String,
    pub lease_ttl: Duration,
    /// CA bundle (PEM) that signs the members' certificates: with it every endpoint is
    /// reached over https.
    pub ca: Option<PathBuf>,
    /// Client certificate chain (PEM) for members started with `--client-cert-auth`.
    pub cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    pub key: Option<PathBuf>,
    /// etcd user (members with auth enabled); its password is read from `password_file`.
    pub user: Option<String>,
    pub password_file: Option<PathBuf>,
    /// The operator's explicit consent to plain http with endpoints off loopback.
    pub allow_plain: bool,
}

/// Default key prefix of the etcd directory.
pub const DEFAULT_DIRECTORY_PREFIX: &str = "/lendvm";
/// Default TTL of directory leases.
pub const DEFAULT_DIRECTORY_TTL: Duration = Duration::from_secs(5);

impl DirectoryConfig {
    /// A plain config for `endpoints` with the default prefix and TTL (no TLS, no user).
    pub fn new(endpoints: Vec<String>) -> DirectoryConfig {
        DirectoryConfig {
            etcd: endpoints,
            prefix: DEFAULT_DIRECTORY_PREFIX.into(),
            lease_ttl: DEFAULT_DIRECTORY_TTL,
            ..DirectoryConfig::default()
        }
    }

    /// Parses `etcd://host:port[,host:port...][/][?key=value&...]` (the `--cluster` form).
    /// The keys are those of the `[directory]` table: `ca`, `cert`, `key` (file paths),
    /// `user`, `password_file`, `allow_plain` (`true`/`false`, or bare), `prefix`,
    /// `lease_ttl_s`. A password is never taken inline (it would show in `ps`).
    pub fn from_url(url: &str) -> Result<DirectoryConfig, String> {
        let rest = url
            .strip_prefix("etcd://")
            .ok_or_else(|| format!("directory {url:?} does not start with etcd://"))?;
        let (hosts, query) = match rest.split_once('?') {
            Some((h, q)) => (h, Some(q)),
            None => (rest, None),
        };
        let etcd: Vec<String> = hosts
            .trim_end_matches('/')
            .split(',')
            .map(str::to_string)
            .collect();
        for e in &etcd {
            check_endpoint(e)?;
        }
        let mut cfg = DirectoryConfig::new(etcd);
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let path = |v: &str| {
                if v.is_empty() {
                    Err(format!("directory URL parameter {k} needs a file path"))
                } else {
                    Ok(Some(PathBuf::from(v)))
                }
            };
            match k {
                "ca" => cfg.ca = path(v)?,
                "cert" => cfg.cert = path(v)?,
                "key" => cfg.key = path(v)?,
                "password_file" => cfg.password_file = path(v)?,
                "user" if !v.is_empty() => cfg.user = Some(v.to_string()),
                "allow_plain" => {
                    cfg.allow_plain = match v {
                        "" | "true" | "1" => true,
                        "false" | "0" => false,
                        _ => {
                            return Err(format!(
                                "directory URL: allow_plain={v:?} is not true or false"
                            ))
                        }
                    }
                }
                "prefix" => {
                    check_prefix(v).map_err(|m| format!("directory URL: prefix {m}"))?;
                    cfg.prefix = v.to_string();
                }
                "lease_ttl_s" => {
                    cfg.lease_ttl = check_ttl(v.parse::<u64>().map_err(|_| {
                        format!("directory URL: lease_ttl_s={v:?} is not a number")
                    })?)
                    .map_err(|m| format!("directory URL: lease_ttl_s {m}"))?;
                }
                "password" => {
                    return Err(
                        "directory URL: a password is not taken inline (it would show in the \
                         process list); put it in a mode-0600 file and pass password_file=PATH"
                            .into(),
                    )
                }
                other => {
                    return Err(format!(
                        "directory URL: unknown parameter {other:?} (known: ca, cert, key, user, \
                         password_file, allow_plain, prefix, lease_ttl_s)"
                    ))
                }
            }
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Whether the endpoints are reached over TLS.
    pub fn tls(&self) -> bool {
        self.ca.is_some()
    }

    /// Checks that the settings go together, and refuses plain http to an endpoint off
    /// loopback unless `allow_plain` says the operator wants it: without TLS anyone on the
    /// path reads and rewrites the directory.
    pub fn validate(&self) -> Result<(), String> {
        if self.etcd.is_empty() {
            return Err("the directory has no etcd endpoints".into());
        }
        for e in &self.etcd {
            check_endpoint(e)?;
        }
        if self.cert.is_some() != self.key.is_some() {
            return Err("directory: a client certificate needs both cert and key".into());
        }
        if self.cert.is_some() && self.ca.is_none() {
            return Err(
                "directory: cert and key are TLS settings; give ca (the CA of the etcd \
                 members) too"
                    .into(),
            );
        }
        if self.user.is_some() != self.password_file.is_some() {
            return Err("directory: etcd auth needs both user and password_file".into());
        }
        if !self.tls() && !self.allow_plain {
            if let Some(e) = self.etcd.iter().find(|e| !is_loopback_endpoint(e)) {
                return Err(format!(
                    "directory: etcd endpoint {e} is not on loopback and no ca is set: plain \
                     http would let anyone on the path read and rewrite the directory; set ca \
                     (and cert/key) for TLS, or allow_plain = true to accept that"
                ));
            }
        }
        Ok(())
    }

    /// Resolves the relative file paths against `dir` (the cluster file's directory).
    fn resolve_in(&mut self, dir: &Path) {
        for p in [
            &mut self.ca,
            &mut self.cert,
            &mut self.key,
            &mut self.password_file,
        ]
        .into_iter()
        .flatten()
        {
            if p.is_relative() {
                *p = dir.join(&*p);
            }
        }
    }
}

/// Whether an endpoint's host is a loopback address (or `localhost`).
/// A portable group name (POSIX's portable filename characters, not starting with '-'),
/// at most 32 bytes like useradd's.
fn valid_group_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 32
        && !n.starts_with('-')
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

fn is_loopback_endpoint(e: &str) -> bool {
    let host = e.rsplit_once(':').map_or(e, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn check_prefix(v: &str) -> Result<(), String> {
    if !v.starts_with('/') || v.ends_with('/') || v.len() > 256 {
        Err(format!("{v:?} must start with / and not end with /"))
    } else {
        Ok(())
    }
}

fn check_ttl(t: u64) -> Result<Duration, String> {
    if (2..=300).contains(&t) {
        Ok(Duration::from_secs(t))
    } else {
        Err(format!("{t} is not in 2..=300"))
    }
}

/// `host:port` with a non-empty host and a port number.
fn check_endpoint(e: &str) -> Result<(), String> {
    match e.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() && !e.contains('/') => Ok(()),
        _ => Err(format!("etcd endpoint {e:?} is not host:port")),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDirectory {
    etcd: Spanned<Vec<String>>,
    prefix: Option<Spanned<String>>,
    lease_ttl_s: Option<Spanned<u64>>,
    ca: Option<String>,
    cert: Option<String>,
    key: Option<String>,
    user: Option<String>,
    password_file: Option<String>,
    #[serde(default)]
    allow_plain: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    #[serde(default)]
    directory: Option<RawDirectory>,
    version: Option<Spanned<u32>>,
    token: Option<Spanned<String>>,
    token_file: Option<Spanned<String>>,
    #[serde(default)]
    link: Option<RawLink>,
    #[serde(default)]
    node: Vec<RawNode>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLink {
    heartbeat_ms: Option<Spanned<u64>>,
    peer_timeout_ms: Option<Spanned<u64>>,
    connect_timeout_ms: Option<Spanned<u64>>,
    request_timeout_ms: Option<Spanned<u64>>,
    require_sealed_windows: Option<bool>,
    max_pending_handshakes: Option<Spanned<u64>>,
    max_pending_per_source: Option<Spanned<u64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    name: Spanned<String>,
    fabric: Spanned<String>,
    control: Spanned<String>,
    windows: Option<Spanned<u32>>,
    window_align: Option<Spanned<u64>>,
    max_window_size: Option<Spanned<u64>>,
    doorbells: Option<Spanned<u32>>,
    scratchpads: Option<Spanned<u32>>,
    /// `bar` nodes: this host's view of the shared region, a file ...
    region: Option<Spanned<String>>,
    /// ... or BAR `region_bar` (default 2, ivshmem's memory BAR) of a PCI function.
    region_device: Option<Spanned<String>>,
    region_bar: Option<Spanned<u8>>,
    /// `bar` nodes: where the links' control messages go once TLS has authenticated the
    /// peer: `"ring"` (default: rings in the region, [`crate::ring`]) or `"tcp"`.
    control_path: Option<Spanned<String>>,
    /// `bar` nodes: ring slots at the region's end (default
    /// [`crate::region::DEFAULT_RING_SLOTS`]).
    control_rings: Option<Spanned<u32>>,
    /// shm nodes: the group that may connect to the control socket
    /// ([`LinkConfig::control_group`]).
    control_group: Option<Spanned<String>>,
    /// [`NodeConfig::numa_node`].
    numa_node: Option<Spanned<u32>>,
}

/// A field name, the span of its value if given, and the verdict.
type Check<'a> = (&'a str, Option<std::ops::Range<usize>>, Result<(), String>);

struct Ctx<'a> {
    origin: &'a str,
    src: &'a str,
}

impl Ctx<'_> {
    fn line(&self, offset: usize) -> usize {
        self.src
            .get(..offset)
            .map_or(0, |s| s.bytes().filter(|&b| b == b'\n').count())
            + 1
    }

    fn invalid<T>(
        &self,
        field: &str,
        span: std::ops::Range<usize>,
        message: String,
    ) -> Result<T, ConfigError> {
        Err(ConfigError::Invalid {
            origin: self.origin.to_string(),
            line: self.line(span.start),
            field: field.to_string(),
            message,
        })
    }
}

impl ClusterConfig {
    /// Loads and validates a cluster file.
    /// A file with an inline `token` is refused unless only its owner may read and write
    /// it (mode checked on the opened file, as for a token file): the token is the cluster's
    /// secret.
    pub fn load(path: &Path) -> Result<ClusterConfig, ConfigError> {
        use std::io::Read;
        use std::os::unix::fs::PermissionsExt;
        let io = |source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        };
        let mut f = std::fs::File::open(path).map_err(io)?;
        let mode = f.metadata().map_err(io)?.permissions().mode() & 0o7777;
        let mut src = String::new();
        f.read_to_string(&mut src).map_err(io)?;
        let dir = path.parent().unwrap_or(Path::new(""));
        let c = Self::parse_in(&src, &path.display().to_string(), dir)?;
        if matches!(c.token, Some(ClusterToken::Inline(_))) && mode & 0o077 != 0 {
            return Err(ConfigError::InlineTokenMode {
                path: path.display().to_string(),
                mode,
            });
        }
        Ok(c)
    }

    /// Parses and validates a cluster description; `origin` names it in errors. A relative
    /// `token_file` stays relative (to the current directory); [`ClusterConfig::load`]
    /// resolves it against the cluster file's directory.
    pub fn parse(src: &str, origin: &str) -> Result<ClusterConfig, ConfigError> {
        Self::parse_in(src, origin, Path::new(""))
    }

    /// Like [`ClusterConfig::parse`], resolving a relative `token_file` against `dir`.
    pub fn parse_in(src: &str, origin: &str, dir: &Path) -> Result<ClusterConfig, ConfigError> {
        let cx = Ctx { origin, src };
        let raw: RawCluster = toml::from_str(src).map_err(|e| ConfigError::Parse {
            origin: origin.to_string(),
            line: e.span().map_or(0, |s| cx.line(s.start)),
            message: e.message().to_string(),
        })?;
        if let Some(v) = &raw.version {
            if *v.get_ref() != 1 {
                return cx.invalid(
                    "version",
                    v.span(),
                    format!("unsupported version {}", v.get_ref()),
                );
            }
        }
        let token = match (&raw.token, &raw.token_file) {
            (Some(_), Some(f)) => {
                return cx.invalid(
                    "token_file",
                    f.span(),
                    "set either `token` or `token_file`, not both".into(),
                )
            }
            (Some(t), None) => {
                if let Some(m) = token_problem(t.get_ref()) {
                    return cx.invalid("token", t.span(), m);
                }
                Some(ClusterToken::Inline(t.get_ref().clone()))
            }
            (None, Some(f)) => {
                if f.get_ref().trim().is_empty() {
                    return cx.invalid("token_file", f.span(), "must not be empty".into());
                }
                Some(ClusterToken::File(dir.join(f.get_ref())))
            }
            (None, None) => None,
        };
        let mut base = LinkConfig::default();
        if let Some(l) = &raw.link {
            if let Some(v) = l.require_sealed_windows {
                base.require_sealed_windows = v;
            }
            let ms = |v: &Spanned<u64>| Duration::from_millis(*v.get_ref());
            if let Some(v) = &l.heartbeat_ms {
                if *v.get_ref() == 0 || *v.get_ref() > 60_000 {
                    return cx.invalid(
                        "link.heartbeat_ms",
                        v.span(),
                        format!("{} is not in 1..=60000", v.get_ref()),
                    );
                }
                base.heartbeat = ms(v);
            }
            if let Some(v) = &l.peer_timeout_ms {
                base.peer_timeout = ms(v);
                if base.peer_timeout <= base.heartbeat * 2 {
                    return cx.invalid(
                        "link.peer_timeout_ms",
                        v.span(),
                        format!("{} must exceed twice heartbeat_ms", v.get_ref()),
                    );
                }
            }
            if let Some(v) = &l.connect_timeout_ms {
                if *v.get_ref() == 0 {
                    return cx.invalid("link.connect_timeout_ms", v.span(), "must not be 0".into());
                }
                base.connect_timeout = ms(v);
            }
            if let Some(v) = &l.request_timeout_ms {
                if !(100..=3_600_000).contains(v.get_ref()) {
                    return cx.invalid(
                        "link.request_timeout_ms",
                        v.span(),
                        format!("{} is not in 100..=3600000", v.get_ref()),
                    );
                }
                base.request_timeout = ms(v);
            }
            if let Some(v) = &l.max_pending_handshakes {
                base.preauth.handshakes = usize::try_from(*v.get_ref()).unwrap_or(usize::MAX);
                if base.preauth.per_source > base.preauth.handshakes
                    && l.max_pending_per_source.is_none()
                {
                    base.preauth.per_source = base.preauth.handshakes;
                }
            }
            if let Some(v) = &l.max_pending_per_source {
                base.preauth.per_source = usize::try_from(*v.get_ref()).unwrap_or(usize::MAX);
            }
            if let Err(m) = base.preauth.check() {
                let (field, span) = match (&l.max_pending_per_source, &l.max_pending_handshakes) {
                    (Some(v), _) if m.starts_with("max_pending_per_source") => {
                        ("link.max_pending_per_source", v.span())
                    }
                    (_, Some(v)) => ("link.max_pending_handshakes", v.span()),
                    (Some(v), None) => ("link.max_pending_per_source", v.span()),
                    (None, None) => ("link", 0..0),
                };
                return cx.invalid(field, span, m);
            }
            if base.peer_timeout <= base.heartbeat * 2 {
                return Err(ConfigError::Cluster {
                    origin: origin.into(),
                    message: format!(
                        "link: peer timeout {:?} must exceed twice the heartbeat {:?}",
                        base.peer_timeout, base.heartbeat
                    ),
                });
            }
        }
        let directory = match &raw.directory {
            None => None,
            Some(d) => {
                if d.etcd.get_ref().is_empty() {
                    return cx.invalid("directory.etcd", d.etcd.span(), "no endpoints".into());
                }
                for e in d.etcd.get_ref() {
                    if let Err(m) = check_endpoint(e) {
                        return cx.invalid("directory.etcd", d.etcd.span(), m);
                    }
                }
                let prefix = match &d.prefix {
                    None => DEFAULT_DIRECTORY_PREFIX.to_string(),
                    Some(p) => {
                        let v = p.get_ref();
                        if let Err(m) = check_prefix(v) {
                            return cx.invalid("directory.prefix", p.span(), m);
                        }
                        v.clone()
                    }
                };
                let lease_ttl = match &d.lease_ttl_s {
                    None => DEFAULT_DIRECTORY_TTL,
                    Some(t) => match check_ttl(*t.get_ref()) {
                        Ok(t) => t,
                        Err(m) => return cx.invalid("directory.lease_ttl_s", t.span(), m),
                    },
                };
                let mut cfg = DirectoryConfig {
                    etcd: d.etcd.get_ref().clone(),
                    prefix,
                    lease_ttl,
                    ca: d.ca.as_ref().map(PathBuf::from),
                    cert: d.cert.as_ref().map(PathBuf::from),
                    key: d.key.as_ref().map(PathBuf::from),
                    user: d.user.clone(),
                    password_file: d.password_file.as_ref().map(PathBuf::from),
                    allow_plain: d.allow_plain,
                };
                cfg.resolve_in(dir);
                if let Err(m) = cfg.validate() {
                    return cx.invalid("directory", d.etcd.span(), m);
                }
                Some(cfg)
            }
        };
        if raw.node.is_empty() && directory.is_none() {
            return Err(ConfigError::Cluster {
                origin: origin.into(),
                message: "no [[node]] entries".into(),
            });
        }
        let mut seen_names: HashMap<String, usize> = HashMap::new();
        let mut seen_addrs: HashMap<String, usize> = HashMap::new();
        let mut nodes = Vec::new();
        for n in &raw.node {
            let name = NodeId::new(n.name.get_ref())
                .or_else(|e| cx.invalid("name", n.name.span(), e.to_string()))?;
            let line = cx.line(n.name.span().start);
            if let Some(prev) = seen_names.insert(name.to_string(), line) {
                return cx.invalid(
                    "name",
                    n.name.span(),
                    format!("duplicate node {name} (first on line {prev})"),
                );
            }
            let fabric = match n.fabric.get_ref().as_str() {
                "shm" => FabricKind::Shm,
                "tcp" => FabricKind::Tcp,
                "bar" => FabricKind::Bar,
                other => {
                    return cx.invalid(
                        "fabric",
                        n.fabric.span(),
                        format!("unknown fabric {other:?}, expected \"shm\", \"tcp\" or \"bar\""),
                    )
                }
            };
            let region = match (&n.region, &n.region_device, fabric) {
                (Some(r), Some(_), _) => {
                    return cx.invalid(
                        "region",
                        r.span(),
                        "give region or region_device, not both".into(),
                    )
                }
                (Some(r), None, FabricKind::Bar) => Some(
                    RegionSpec::file(r.get_ref()).or_else(|m| cx.invalid("region", r.span(), m))?,
                ),
                (None, Some(d), FabricKind::Bar) => {
                    let bar = n.region_bar.as_ref().map_or(2, |b| *b.get_ref());
                    Some(
                        RegionSpec::pci_bar(d.get_ref(), bar)
                            .or_else(|m| cx.invalid("region_device", d.span(), m))?,
                    )
                }
                (None, None, FabricKind::Bar) => {
                    return cx.invalid(
                        "region",
                        n.name.span(),
                        "a bar node needs its shared region: region = PATH (the file behind \
                         the window) or region_device = \"DDDD:BB:DD.F\" (the PCI function \
                         whose BAR region_bar, default 2, is the window)"
                            .into(),
                    )
                }
                (Some(r), None, k) => {
                    return cx.invalid(
                        "region",
                        r.span(),
                        format!("a {k} node has no shared region (only fabric = \"bar\")"),
                    )
                }
                (None, Some(d), k) => {
                    return cx.invalid(
                        "region_device",
                        d.span(),
                        format!("a {k} node has no shared region (only fabric = \"bar\")"),
                    )
                }
                (None, None, _) => None,
            };
            let region = match region {
                Some(spec) => {
                    let ring = match n.control_path.as_ref().map(|p| (p.get_ref().as_str(), p)) {
                        None | Some(("ring", _)) => true,
                        Some(("tcp", _)) => false,
                        Some((other, p)) => {
                            return cx.invalid(
                                "control_path",
                                p.span(),
                                format!(
                                    "unknown control_path {other:?}, expected \"ring\" or \"tcp\""
                                ),
                            )
                        }
                    };
                    let slots = match (&n.control_rings, ring) {
                        (Some(r), false) => {
                            return cx.invalid(
                                "control_rings",
                                r.span(),
                                "control_rings needs control_path = \"ring\"".into(),
                            )
                        }
                        (Some(r), true) if *r.get_ref() == 0 => {
                            return cx.invalid(
                                "control_rings",
                                r.span(),
                                "control_rings must be at least 1 (control_path = \"tcp\" \
                                 keeps control off the region)"
                                    .into(),
                            )
                        }
                        (Some(r), true) => *r.get_ref(),
                        (None, true) => crate::region::DEFAULT_RING_SLOTS,
                        (None, false) => 0,
                    };
                    let span = n
                        .control_rings
                        .as_ref()
                        .map_or_else(|| n.name.span(), |r| r.span());
                    Some(
                        spec.with_rings(slots)
                            .or_else(|m| cx.invalid("control_rings", span, m))?,
                    )
                }
                None => {
                    for (field, v) in [
                        ("control_path", n.control_path.as_ref().map(|v| v.span())),
                        ("control_rings", n.control_rings.as_ref().map(|v| v.span())),
                    ] {
                        if let Some(span) = v {
                            return cx.invalid(
                                field,
                                span,
                                format!("a {fabric} node has no shared region to put control rings in (only fabric = \"bar\")"),
                            );
                        }
                    }
                    None
                }
            };
            if let (Some(b), None) = (&n.region_bar, &n.region_device) {
                return cx.invalid(
                    "region_bar",
                    b.span(),
                    "region_bar needs region_device".into(),
                );
            }
            let control = ControlAddr::parse(fabric, n.control.get_ref())
                .or_else(|m| cx.invalid("control", n.control.span(), m))?;
            if let Some(prev) =
                seen_addrs.insert(control.to_string(), cx.line(n.control.span().start))
            {
                return cx.invalid(
                    "control",
                    n.control.span(),
                    format!("address {control} already used on line {prev}"),
                );
            }
            let mut link = base.clone();
            let mut limits = WindowLimits::default();
            if let Some(v) = &n.windows {
                limits.max_windows = *v.get_ref();
            }
            if let Some(v) = &n.window_align {
                limits.addr_align = *v.get_ref();
                limits.size_align = *v.get_ref();
            }
            if let Some(v) = &n.max_window_size {
                limits.max_size = *v.get_ref();
            }
            if let Some(v) = &n.doorbells {
                link.doorbells = *v.get_ref();
            }
            if let Some(v) = &n.scratchpads {
                link.scratchpads = *v.get_ref();
            }
            link.limits = limits;
            link.region = region;
            if let Some(g) = &n.control_group {
                let name = g.get_ref();
                if fabric != FabricKind::Shm {
                    return cx.invalid(
                        "control_group",
                        g.span(),
                        format!(
                            "only an shm node's control socket has a group (this node's fabric is {fabric})"
                        ),
                    );
                }
                if !valid_group_name(name) {
                    return cx.invalid(
                        "control_group",
                        g.span(),
                        format!("{name:?} is not a group name (letters, digits, '_', '-', '.', not first '-')"),
                    );
                }
                link.control_group = Some(name.clone());
            }
            // Name the first field that breaks a rule.
            let checks: [Check<'_>; 4] = [
                (
                    "windows",
                    n.windows.as_ref().map(|v| v.span()),
                    WindowLimits {
                        addr_align: 4096,
                        size_align: 4096,
                        max_size: u64::MAX,
                        ..limits
                    }
                    .validate()
                    .map_err(|e| e.to_string()),
                ),
                (
                    "window_align",
                    n.window_align.as_ref().map(|v| v.span()),
                    WindowLimits {
                        max_windows: 1,
                        max_size: u64::MAX,
                        ..limits
                    }
                    .validate()
                    .map_err(|e| e.to_string()),
                ),
                (
                    "max_window_size",
                    n.max_window_size.as_ref().map(|v| v.span()),
                    limits.validate().map_err(|e| e.to_string()),
                ),
                (
                    "doorbells/scratchpads",
                    n.doorbells
                        .as_ref()
                        .or(n.scratchpads.as_ref())
                        .map(|v| v.span()),
                    link.validate().map_err(|e| e.to_string()),
                ),
            ];
            for (field, span, res) in checks {
                if let Err(m) = res {
                    return cx.invalid(field, span.unwrap_or_else(|| n.name.span()), m);
                }
            }
            nodes.push(NodeConfig {
                name,
                fabric,
                control,
                link,
                numa_node: n.numa_node.as_ref().map(|v| *v.get_ref()),
            });
        }
        Ok(ClusterConfig {
            nodes,
            token,
            directory,
        })
    }

    /// The cluster auth token: the inline `token`, or the trimmed contents of `token_file`
    /// (read now, so a rotated file is picked up); `None` if the file sets neither.
    pub fn auth_token(&self) -> Result<Option<String>, ConfigError> {
        let path = match &self.token {
            None => return Ok(None),
            Some(ClusterToken::Inline(t)) => return Ok(Some(t.clone())),
            Some(ClusterToken::File(p)) => p,
        };
        read_token_file(path).map(Some)
    }

    /// The node called `name`.
    pub fn node(&self, name: &str) -> Option<&NodeConfig> {
        self.nodes.iter().find(|n| n.name.as_str() == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
version = 1
[link]
heartbeat_ms = 100
peer_timeout_ms = 1000

[[node]]
name = "node1"
fabric = "shm"
control = "/run/lendvm/node1.sock"

[[node]]
name = "node3"
fabric = "tcp"
control = "169.254.77.1:7700"
windows = 4
window_align = 0x10000
doorbells = 32
"#;

    #[test]
    fn parses_good_cluster() {
        let c = ClusterConfig::parse(GOOD, "t.toml").unwrap();
        assert_eq!(c.nodes.len(), 2);
        let n3 = c.node("node3").unwrap();
        assert_eq!(n3.fabric, FabricKind::Tcp);
        assert_eq!(n3.link.limits.max_windows, 4);
        assert_eq!(n3.link.limits.addr_align, 0x10000);
        assert_eq!(n3.link.doorbells, 32);
        assert_eq!(n3.link.heartbeat, Duration::from_millis(100));
        assert_eq!(
            n3.link.request_timeout,
            crate::fabric::DEFAULT_REQUEST_TIMEOUT
        );
        assert_eq!(
            c.node("node1").unwrap().control,
            ControlAddr::Unix("/run/lendvm/node1.sock".into())
        );
    }

    fn err(src: &str) -> String {
        ClusterConfig::parse(src, "c.toml").unwrap_err().to_string()
    }

    #[test]
    fn preauth_limits_from_the_link_table() {
        let c = ClusterConfig::parse(GOOD, "t.toml").unwrap();
        assert_eq!(
            c.node("node3").unwrap().link.preauth,
            crate::PreauthLimits::default()
        );
        let nat = GOOD.replace(
            "peer_timeout_ms = 1000",
            "peer_timeout_ms = 1000\nmax_pending_handshakes = 128\nmax_pending_per_source = 96",
        );
        let c = ClusterConfig::parse(&nat, "t.toml").unwrap();
        let p = c.node("node3").unwrap().link.preauth;
        assert_eq!((p.handshakes, p.per_source), (128, 96));
        // A total below the default share takes the share down with it.
        let small = GOOD.replace(
            "peer_timeout_ms = 1000",
            "peer_timeout_ms = 1000\nmax_pending_handshakes = 4",
        );
        let c = ClusterConfig::parse(&small, "t.toml").unwrap();
        let p = c.node("node1").unwrap().link.preauth;
        assert_eq!((p.handshakes, p.per_source), (4, 4));
        let e = err(&GOOD.replace(
            "peer_timeout_ms = 1000",
            "peer_timeout_ms = 1000\nmax_pending_handshakes = 0",
        ));
        assert!(
            e.starts_with("c.toml:6: field `link.max_pending_handshakes`")
                && e.contains("0 is not in 1..=4096"),
            "{e}"
        );
        let e = err(&GOOD.replace(
            "peer_timeout_ms = 1000",
            "peer_timeout_ms = 1000\nmax_pending_handshakes = 16\nmax_pending_per_source = 17",
        ));
        assert!(
            e.starts_with("c.toml:7: field `link.max_pending_per_source`")
                && e.contains("17 is not in 1..=16"),
            "{e}"
        );
    }

    #[test]
    fn an_shm_nodes_control_group_is_kept_and_checked() {
        let shared = GOOD.replace(
            "control = \"/run/lendvm/node1.sock\"",
            "control = \"/run/lendvm/node1.sock\"\ncontrol_group = \"lendvm\"",
        );
        let c = ClusterConfig::parse(&shared, "t.toml").unwrap();
        assert_eq!(
            c.node("node1").unwrap().link.control_group.as_deref(),
            Some("lendvm")
        );
        assert_eq!(c.node("node3").unwrap().link.control_group, None);
        let e = err(&shared.replace("\"lendvm\"", "\"-x y\""));
        assert!(
            e.contains("field `control_group`") && e.contains("is not a group name"),
            "{e}"
        );
        let e = err(&GOOD.replace(
            "control = \"169.254.77.1:7700\"",
            "control = \"169.254.77.1:7700\"\ncontrol_group = \"lendvm\"",
        ));
        assert!(
            e.contains("field `control_group`") && e.contains("fabric is tcp"),
            "{e}"
        );
    }

    #[test]
    fn errors_name_line_and_field() {
        let e = err(&GOOD.replace("\"169.254.77.1:7700\"", "\"nowhere\""));
        assert!(e.starts_with("c.toml:15: field `control`"), "{e}");
        let e = err(&GOOD.replace("fabric = \"tcp\"", "fabric = \"rdma\""));
        assert!(e.starts_with("c.toml:14: field `fabric`"), "{e}");
        let e = err(&GOOD.replace("0x10000", "3000"));
        assert!(e.starts_with("c.toml:17: field `window_align`"), "{e}");
        let e = err(&GOOD.replace("windows = 4", "windows = 0"));
        assert!(e.starts_with("c.toml:16: field `windows`"), "{e}");
        let e = err(&GOOD.replace("doorbells = 32", "doorbells = 65"));
        assert!(e.contains("doorbells"), "{e}");
        let e = err(&GOOD.replace("\"node3\"", "\"node1\""));
        assert!(e.contains("duplicate node node1"), "{e}");
        let e = err(&GOOD.replace("/run/lendvm/node1.sock", "relative.sock"));
        assert!(e.contains("field `control`"), "{e}");
        let e = err(&GOOD.replace("windows = 4", "windoze = 4"));
        assert!(e.starts_with("c.toml:16:") && e.contains("windoze"), "{e}");
        let e = err(&GOOD.replace("peer_timeout_ms = 1000", "peer_timeout_ms = 150"));
        assert!(
            e.starts_with("c.toml:5: field `link.peer_timeout_ms`"),
            "{e}"
        );
        let e = err("version = 1\n");
        assert!(e.contains("no [[node]]"), "{e}");
        let e = err(&GOOD.replace(
            "peer_timeout_ms = 1000",
            "peer_timeout_ms = 1000\nrequest_timeout_ms = 10",
        ));
        assert!(
            e.starts_with("c.toml:6: field `link.request_timeout_ms`")
                && e.contains("10 is not in 100..=3600000"),
            "{e}"
        );
    }

    #[test]
    fn request_timeout_is_the_links_for_every_node() {
        let src = GOOD.replace(
            "peer_timeout_ms = 1000",
            "peer_timeout_ms = 1000\nrequest_timeout_ms = 600000",
        );
        let c = ClusterConfig::parse(&src, "t.toml").unwrap();
        for n in ["node1", "node3"] {
            assert_eq!(
                c.node(n).unwrap().link.request_timeout,
                Duration::from_secs(600)
            );
        }
    }

    #[test]
    fn example_file_is_valid() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../resources/cluster.example.toml");
        let c = ClusterConfig::load(&p).unwrap();
        assert!(c.node("node1").is_some());
        assert!(c.node("node3").is_some());
        // token_file is resolved against the directory of the cluster file.
        let dir = p.parent().unwrap();
        assert_eq!(c.token, Some(ClusterToken::File(dir.join("cluster.token"))));
        assert!(c.nodes[0].link.require_sealed_windows);
    }

    /// A token of the accepted strength (64 hex digits).
    const STRONG: &str = "9f2c4e6a8b0d1f3e5c7a9b1d3f5e7c9a0b2d4f6e8a1c3e5b7d9f0a2c4e6b8d0f";

    fn with_top(line: &str) -> String {
        GOOD.replace("version = 1\n", &format!("version = 1\n{line}\n"))
    }

    #[test]
    fn inline_token_is_returned_and_never_printed() {
        let c =
            ClusterConfig::parse(&with_top(&format!("token = \"{STRONG}\"")), "t.toml").unwrap();
        assert_eq!(c.auth_token().unwrap().as_deref(), Some(STRONG));
        assert!(!format!("{c:?}").contains(STRONG));
        let c = ClusterConfig::parse(GOOD, "t.toml").unwrap();
        assert_eq!(c.token, None);
        assert_eq!(c.auth_token().unwrap(), None);
    }

    #[test]
    fn token_file_is_relative_to_the_cluster_file_and_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("etc")).unwrap();
        let cluster = dir.path().join("etc/cluster.toml");
        std::fs::write(&cluster, with_top("token_file = \"secrets/token\"")).unwrap();
        let c = ClusterConfig::load(&cluster).unwrap();
        let tok = dir.path().join("etc/secrets/token");
        assert_eq!(c.token, Some(ClusterToken::File(tok.clone())));
        // Missing file: the error names it.
        let e = c.auth_token().unwrap_err().to_string();
        assert!(e.contains(&tok.display().to_string()), "{e}");
        std::fs::create_dir(dir.path().join("etc/secrets")).unwrap();
        write_token_file(&tok, "  \n\t\n").unwrap();
        let e = c.auth_token().unwrap_err().to_string();
        assert_eq!(e, format!("token file {} is empty", tok.display()));
        write_token_file(&tok, "abc\ndef\n").unwrap();
        let e = c.auth_token().unwrap_err().to_string();
        assert!(e.contains("control characters"), "{e}");
        write_token_file(&tok, &format!("\n  {STRONG}  \n")).unwrap();
        assert_eq!(c.auth_token().unwrap().as_deref(), Some(STRONG));
        // A token file group or others can read is refused, naming the file and its mode.
        for mode in [0o640, 0o604, 0o644] {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&tok, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = c.auth_token().unwrap_err().to_string();
            assert!(e.contains(&tok.display().to_string()), "{e}");
            assert!(e.contains(&format!("mode {mode:04o}")), "{e}");
        }
        // An absolute path stays as given.
        let c = ClusterConfig::parse_in(
            &with_top("token_file = \"/etc/lendvm/token\""),
            "c.toml",
            dir.path(),
        )
        .unwrap();
        assert_eq!(
            c.token,
            Some(ClusterToken::File("/etc/lendvm/token".into()))
        );
    }

    #[test]
    fn token_settings_are_validated_with_line_and_field() {
        let e = err(&with_top("token = \"a\"\ntoken_file = \"t\""));
        assert!(e.starts_with("c.toml:4: field `token_file`"), "{e}");
        assert!(e.contains("not both"), "{e}");
        let e = err(&with_top("token = \"  \""));
        assert!(
            e.starts_with("c.toml:3: field `token`: must not be empty"),
            "{e}"
        );
        let e = err(&with_top("token = \" x\""));
        assert!(e.contains("whitespace"), "{e}");
        let e = err(&with_top("token_file = \"\""));
        assert!(e.starts_with("c.toml:3: field `token_file`"), "{e}");
        let e = err(&with_top("token = 5"));
        assert!(e.starts_with("c.toml:3:"), "{e}");
    }

    /// The minimum strength (MIN_TOKEN_LEN bytes, MIN_TOKEN_DISTINCT distinct characters),
    /// inline or in a token file, each refusal naming the rule; `check_token` names where
    /// the token came from.
    #[test]
    fn weak_tokens_are_refused_with_the_minimum() {
        let e = err(&with_top("token = \"s3cret-cluster-token\""));
        assert!(
            e.starts_with(
                "c.toml:3: field `token`: is too weak: it is 20 bytes long, the \
                           minimum is 32"
            ),
            "{e}"
        );
        let e = err(&with_top(&format!("token = \"{}\"", "ab".repeat(20))));
        assert!(e.contains("2 distinct characters, the minimum is 8"), "{e}");
        // 32 hex digits (128 bits) are enough.
        ClusterConfig::parse(
            &with_top(&format!("token = \"{}\"", &STRONG[..32])),
            "c.toml",
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let tok = dir.path().join("token");
        write_token_file(&tok, "short").unwrap();
        let e = read_token_file(&tok).unwrap_err().to_string();
        assert!(e.contains("too weak: it is 5 bytes long"), "{e}");
        let e = check_token("short", "--token").unwrap_err().to_string();
        assert_eq!(
            e,
            "the cluster token from --token is too weak: it is 5 bytes long, the minimum is \
             32 (make one with `openssl rand -hex 32`)"
        );
        check_token(STRONG, "--token").unwrap();
    }

    /// An inline token in a cluster file that group or others may read or write is refused
    /// by `load`, naming the file and its mode; the same file at 0600 loads, and a file
    /// without an inline token may stay world-readable.
    #[test]
    fn an_inline_token_needs_a_private_cluster_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.toml");
        std::fs::write(&path, with_top(&format!("token = \"{STRONG}\""))).unwrap();
        for mode in [0o644, 0o640, 0o604, 0o620, 0o602] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = ClusterConfig::load(&path).unwrap_err().to_string();
            assert!(
                e.contains(&path.display().to_string())
                    && e.contains(&format!("mode {mode:04o}"))
                    && e.contains("inline `token`")
                    && e.contains("chmod 600"),
                "{e}"
            );
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let c = ClusterConfig::load(&path).unwrap();
        assert_eq!(c.auth_token().unwrap().as_deref(), Some(STRONG));
        std::fs::write(&path, GOOD).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        ClusterConfig::load(&path).unwrap();
    }

    #[test]
    fn directory_table_is_parsed_and_checked() {
        let src = "version = 1\n[directory]\netcd = [\"127.0.0.1:2379\", \"h2:2379\"]\n\
                   lease_ttl_s = 3\nallow_plain = true\n";
        let c = ClusterConfig::parse(src, "t.toml").unwrap();
        let d = c.directory.unwrap();
        assert_eq!(d.etcd, ["127.0.0.1:2379", "h2:2379"]);
        assert_eq!(d.prefix, "/lendvm");
        assert_eq!(d.lease_ttl, Duration::from_secs(3));
        assert!(c.nodes.is_empty());
        let e = err(&src.replace("lease_ttl_s = 3", "lease_ttl_s = 1"));
        assert!(
            e.starts_with("c.toml:4: field `directory.lease_ttl_s`"),
            "{e}"
        );
        let e = err(&src.replace("\"h2:2379\"", "\"h2\""));
        assert!(e.contains("\"h2\" is not host:port"), "{e}");
        let e = err(&format!("{src}prefix = \"x/\"\n"));
        assert!(e.contains("directory.prefix"), "{e}");
        let u = DirectoryConfig::from_url("etcd://a:1,b:2?allow_plain").unwrap();
        assert_eq!(u.etcd, ["a:1", "b:2"]);
        assert!(DirectoryConfig::from_url("etcd://a").is_err());
        assert!(DirectoryConfig::from_url("http://a:1").is_err());
    }

    #[test]
    fn plain_http_etcd_off_loopback_needs_the_operators_explicit_consent() {
        for ok in [
            "etcd://127.0.0.1:2379",
            "etcd://localhost:2379,[::1]:2379",
            "etcd://h2:2379?allow_plain=true",
            "etcd://h2:2379/?ca=/etc/ca.pem",
        ] {
            DirectoryConfig::from_url(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        let e = DirectoryConfig::from_url("etcd://127.0.0.1:2379,10.0.0.2:2379").unwrap_err();
        assert!(e.contains("10.0.0.2:2379 is not on loopback"), "{e}");
        assert!(e.contains("allow_plain"), "{e}");
        let src = "version = 1\n[directory]\netcd = [\"h2:2379\"]\n";
        let e = err(src);
        assert!(e.contains("h2:2379 is not on loopback"), "{e}");
    }

    #[test]
    fn directory_tls_and_auth_settings_from_the_table_and_the_url() {
        let d = DirectoryConfig::from_url(
            "etcd://h1:2379,h2:2379?ca=/p/ca.pem&cert=/p/c.pem&key=/p/k.pem&user=lv\
             &password_file=/p/pw&prefix=/x&lease_ttl_s=6",
        )
        .unwrap();
        assert!(d.tls());
        assert_eq!(d.ca.as_deref(), Some(Path::new("/p/ca.pem")));
        assert_eq!(d.cert.as_deref(), Some(Path::new("/p/c.pem")));
        assert_eq!(d.key.as_deref(), Some(Path::new("/p/k.pem")));
        assert_eq!(d.user.as_deref(), Some("lv"));
        assert_eq!(d.password_file.as_deref(), Some(Path::new("/p/pw")));
        assert_eq!(d.prefix, "/x");
        assert_eq!(d.lease_ttl, Duration::from_secs(6));
        for (bad, says) in [
            ("etcd://h:1?ca=/c&cert=/c", "both cert and key"),
            ("etcd://127.0.0.1:1?cert=/c&key=/k", "give ca"),
            ("etcd://127.0.0.1:1?user=u", "both user and password_file"),
            (
                "etcd://127.0.0.1:1?user=u&password=hunter2",
                "not taken inline",
            ),
            (
                "etcd://127.0.0.1:1?cafile=/c",
                "unknown parameter \"cafile\"",
            ),
            ("etcd://127.0.0.1:1?ca=", "needs a file path"),
            ("etcd://127.0.0.1:1?lease_ttl_s=1", "not in 2..=300"),
        ] {
            let e = DirectoryConfig::from_url(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        // In a cluster file, relative paths are relative to the file.
        let src = "version = 1\n[directory]\netcd = [\"h2:2379\"]\nca = \"tls/ca.pem\"\n\
                   cert = \"tls/c.pem\"\nkey = \"/abs/k.pem\"\nuser = \"lv\"\n\
                   password_file = \"pw\"\n";
        let c = ClusterConfig::parse_in(src, "c.toml", Path::new("/etc/lendvm")).unwrap();
        let d = c.directory.unwrap();
        assert_eq!(d.ca.as_deref(), Some(Path::new("/etc/lendvm/tls/ca.pem")));
        assert_eq!(d.cert.as_deref(), Some(Path::new("/etc/lendvm/tls/c.pem")));
        assert_eq!(d.key.as_deref(), Some(Path::new("/abs/k.pem")));
        assert_eq!(
            d.password_file.as_deref(),
            Some(Path::new("/etc/lendvm/pw"))
        );
        let e = err(&src.replace("key = \"/abs/k.pem\"\n", ""));
        assert!(
            e.contains("field `directory`") && e.contains("cert and key"),
            "{e}"
        );
    }

    #[test]
    fn require_sealed_windows_is_a_link_setting_on_by_default() {
        let c = ClusterConfig::parse(GOOD, "t.toml").unwrap();
        assert!(c.nodes.iter().all(|n| n.link.require_sealed_windows));
        let src = GOOD.replace("[link]\n", "[link]\nrequire_sealed_windows = false\n");
        let c = ClusterConfig::parse(&src, "t.toml").unwrap();
        assert!(c.nodes.iter().all(|n| !n.link.require_sealed_windows));
        let e = err(&GOOD.replace("[link]\n", "[link]\nrequire_sealed_windows = 1\n"));
        assert!(e.starts_with("c.toml:4:"), "{e}");
    }
}
