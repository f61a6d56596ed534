//! The migration stream: a versioned hello, then typed frames.
//!
//! Every frame is a 16-byte header — `type: u32 LE`, `reserved: u32` (0), `len: u64 LE` —
//! and `len` bytes of payload. Control messages carry JSON (serde); a memory frame carries
//! `gpa: u64 LE` and the raw bytes of one run of guest pages, so RAM is never encoded.
//!
//! On tcp the stream runs inside the fabric's TLS ([`ntb::tls`]); on a unix socket each side
//! first checks the other's credentials (`SO_PEERCRED`: this lendvm's uid, or root). Then,
//! when the VMMs hold the cluster secret (always on tcp), the two prove it to each other
//! ([`super::auth`]) before anything else is said:
//!
//! ```text
//! source                                   destination
//!   Auth {node, nonce}                    ->
//!                                         <- AuthReply {node, vm, nonce, proof: []}
//!   AuthProof {proof}                     ->  (the source proves first)
//!                                         <- AuthProof {proof} | Refused {reason}
//!   Hello {magic, version, lendvm_version} ->
//!                                         <- Ack | Refused {reason}   (version checked)
//!                                         <- Identity {node, vm}      (names for tickets)
//!  [Memfd + SCM_RIGHTS(guest ram memfd)]  ->  (same-host fast path: RAM shared, no copy)
//!   Config {cpus, memory_size, ...}       ->  (builds an empty VM of that shape, faults
//!                                         <- Ack | Refused {reason}    its RAM in)
//!   Memory {gpa, bytes} ...               ->  (written into guest RAM)
//!   State {the snapshot document,         ->  (restored; VM paused; each lent device's
//!          hand-over tickets}                  lease taken over with its ticket)
//!                                         <- Ack | Refused {reason}
//! ```
//!
//! Version 2 added `Identity`, `Memfd` and the hand-over of lent devices in `State`. With
//! `Memfd` no `Memory` frame follows: both processes map the same RAM. Version 3 added TLS on
//! tcp and the `Auth` exchange; `Identity` must name the destination that proved the secret.
//! Since issue 32 the source proves first (a destination's proof sent to any peer that
//! connects was an HMAC to attack offline); a source still takes a destination that proves
//! first in its `AuthReply` (checked, then `AuthProof`, then `Ack`), an older source refuses a
//! destination that does not.
//!
//! A peer that sends anything else, an oversized frame or a run outside guest RAM gets an
//! error naming it; the receiver drops the connection, the sender resumes its VM.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::snapshot::format::{MachineConfig, VmSnapshot};

/// What a hello must carry.
pub const MAGIC: &str = "lendvm-migration";
/// The protocol version this lendvm speaks (both ends must agree).
pub const PROTOCOL_VERSION: u32 = 3;
/// Largest control (JSON) payload accepted: the state document of a big VM is far below.
pub const MAX_CONTROL: u64 = 16 << 20;
/// Largest run of guest pages in one memory frame (the sender splits longer runs).
pub const MAX_RUN: u64 = 4 << 20;
/// Guest page size of the dirty log.
pub const PAGE_SIZE: u64 = 4096;

const HEADER_LEN: usize = 16;

/// Errors of the migration stream and of migrating.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    #[error("migration url '{url}' is not usable: {why} (expected unix:/path or tcp:host:port)")]
    BadUrl { url: String, why: String },
    #[error("cannot connect to {url}")]
    Connect {
        url: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot listen at {url}")]
    Listen {
        url: String,
        #[source]
        source: io::Error,
    },
    #[error("migration stream: {step}")]
    Io {
        step: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("the peer closed the migration stream while {step}")]
    Closed { step: &'static str },
    #[error("not a lendvm migration stream (hello magic '{0}')")]
    Magic(String),
    #[error(
        "migration protocol version {theirs} (lendvm {writer}); this lendvm speaks version {ours}"
    )]
    Version {
        theirs: u32,
        writer: String,
        ours: u32,
    },
    #[error("unexpected frame type {got} while {step}")]
    Unexpected { step: &'static str, got: u32 },
    #[error("frame type {kind} of {len} bytes is over the limit of {max}")]
    TooLarge { kind: u32, len: u64, max: u64 },
    #[error("memory run {gpa:#x}+{len:#x} is outside guest RAM")]
    OutOfRange { gpa: u64, len: u64 },
    #[error("cannot decode the {what} message")]
    Json {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("the same-host fast path (local) needs a unix: url: the memfd goes over SCM_RIGHTS")]
    LocalNeedsUnix,
    #[error("the source announced its guest ram memfd but none came with the frame")]
    NoMemfd,
    #[error("the destination refused: {0}")]
    Refused(String),
    #[error("the migrated VM's shape does not fit: {0}")]
    Mismatch(String),
    #[error("KVM operation {op} on memslot {slot} failed")]
    Kvm {
        op: &'static str,
        slot: u32,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("guest RAM at {gpa:#x} has no host mapping")]
    NoMapping { gpa: u64 },
    #[error("reading or writing guest RAM at file offset {offset:#x}")]
    Ram {
        offset: u64,
        #[source]
        source: io::Error,
    },
    #[error("handing over lent device {id}: {step}: {reason}")]
    Handover {
        id: String,
        step: &'static str,
        reason: String,
    },
    #[error("pausing the vm for the final pass: {0}")]
    Pause(String),
    #[error("building or restoring the migrated VM")]
    Build(#[source] Box<crate::vm::VmError>),
    #[error(transparent)]
    Snapshot(#[from] crate::snapshot::SnapshotError),
    #[error(
        "a tcp migration needs the cluster secret on both sides (--token, $LENDVM_TOKEN or the \
         cluster file's token): the stream carries guest RAM and lease tickets"
    )]
    NoSecret,
    #[error("tls on the migration stream")]
    Tls(#[source] ntb::FabricError),
    #[error("authenticating the migration stream")]
    Auth(#[source] lending::auth::AuthError),
    #[error("cannot read the credentials of the peer on the migration socket")]
    PeerCred(#[source] io::Error),
    #[error(
        "the peer on the migration socket runs as uid {uid}, neither this lendvm's uid {ours} \
         nor root: refused before anything (the guest ram memfd) is passed"
    )]
    PeerUser { uid: u32, ours: u32 },
    #[error("the {who} did not prove the cluster secret")]
    Unproven { who: &'static str },
    #[error(
        "the source did not authenticate: this destination accepts only a source that proves \
         the cluster secret (start the source with the cluster token)"
    )]
    Unauthenticated,
    #[error(
        "the source authenticates with a cluster secret, but this destination has none (start \
         it with the cluster token)"
    )]
    NoSecretHere,
    #[error(
        "the destination proved the secret as {proved}, but names itself {named} for the leases"
    )]
    IdentityChanged { proved: String, named: String },
    #[error("refused a migration source at {peer} before it authenticated")]
    NotAuthenticated {
        peer: String,
        #[source]
        source: Box<MigrationError>,
    },
    #[error("this destination already received its vm: it accepts one migration, once")]
    AlreadyReceived,
}

/// Where a migration goes: `unix:/path` or `tcp:host:port`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MigrationUrl {
    Unix(PathBuf),
    Tcp(String),
}

impl std::fmt::Display for MigrationUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MigrationUrl::Unix(p) => write!(f, "unix:{}", p.display()),
            MigrationUrl::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

/// Parses a migration url (Cloud Hypervisor's `unix:` and `tcp:` forms).
pub fn parse_url(url: &str) -> Result<MigrationUrl, MigrationError> {
    let bad = |why: &str| MigrationError::BadUrl {
        url: url.to_string(),
        why: why.to_string(),
    };
    if let Some(p) = url.strip_prefix("unix:") {
        let p = p.strip_prefix("//").unwrap_or(p);
        if p.is_empty() {
            return Err(bad("no socket path"));
        }
        if !p.starts_with('/') {
            return Err(bad("the socket path must be absolute"));
        }
        return Ok(MigrationUrl::Unix(PathBuf::from(p)));
    }
    if let Some(a) = url.strip_prefix("tcp:") {
        let a = a.strip_prefix("//").unwrap_or(a);
        let Some((host, port)) = a.rsplit_once(':') else {
            return Err(bad("no port"));
        };
        if host.is_empty() {
            return Err(bad("no host"));
        }
        if port.parse::<u16>().is_err() {
            return Err(bad(&format!("port '{port}' is not a number 0-65535")));
        }
        return Ok(MigrationUrl::Tcp(a.to_string()));
    }
    let scheme = url.split_once(':').map_or("", |(s, _)| s);
    Err(bad(&format!("unsupported scheme '{scheme}'")))
}

/// One connection: a unix socket, a plain tcp connection just accepted (before TLS), or the
/// plaintext end of a TLS session ([`ntb::tls`]) and its channel binding.
pub enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
    Tls { plain: UnixStream, binding: Vec<u8> },
}

impl Stream {
    /// Bounds every read and write, so a peer that stops answering fails the step.
    pub fn set_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
            Stream::Tcp(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
            Stream::Tls { plain, .. } => {
                plain.set_read_timeout(t)?;
                plain.set_write_timeout(t)
            }
        }
    }

    /// A handle that cuts this connection from another thread (a deadline's watchdog).
    pub fn cutter(&self) -> io::Result<Cutter> {
        Ok(match self {
            Stream::Unix(s) | Stream::Tls { plain: s, .. } => Cutter::Unix(s.try_clone()?),
            Stream::Tcp(s) => Cutter::Tcp(s.try_clone()?),
        })
    }

    /// The TLS session's channel binding (empty on a unix socket): authentication covers
    /// it, so a proof made through a relay does not verify.
    pub fn binding(&self) -> &[u8] {
        match self {
            Stream::Tls { binding, .. } => binding,
            Stream::Unix(_) | Stream::Tcp(_) => &[],
        }
    }

    /// On a unix socket: refuses a peer that runs as another user than this process (root
    /// excepted), before anything is said or passed (`SO_PEERCRED`).
    pub fn check_peer_user(&self) -> Result<(), MigrationError> {
        let Stream::Unix(u) = self else {
            return Ok(());
        };
        let uid = ntb::sock::peer_uid(u).map_err(MigrationError::PeerCred)?;
        // SAFETY: geteuid has no arguments and cannot fail.
        let ours = unsafe { libc::geteuid() };
        peer_user_allowed(uid, ours)
    }

    /// Runs the TLS handshake on a plain tcp connection (`initiator`: as the client), by
    /// `timeout`. Other kinds are returned as they are.
    pub fn into_tls(self, initiator: bool, timeout: Duration) -> Result<Stream, MigrationError> {
        let Stream::Tcp(tcp) = self else {
            return Ok(self);
        };
        let (plain, binding) = if initiator {
            ntb::tls::client(tcp, timeout)
        } else {
            ntb::tls::server(tcp, timeout)
        }
        .map_err(MigrationError::Tls)?;
        Ok(Stream::Tls { plain, binding })
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
            Stream::Tls { plain, .. } => plain.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
            Stream::Tls { plain, .. } => plain.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.flush(),
            Stream::Tcp(s) => s.flush(),
            Stream::Tls { plain, .. } => plain.flush(),
        }
    }
}

/// See [`Stream::cutter`].
pub enum Cutter {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Cutter {
    /// Shuts the connection down both ways: the other side's next read or write fails.
    pub fn cut(&self) {
        let _ = match self {
            Cutter::Unix(s) => s.shutdown(std::net::Shutdown::Both),
            Cutter::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }
}

/// A unix peer may run as this process's uid or as root; no one else.
fn peer_user_allowed(uid: u32, ours: u32) -> Result<(), MigrationError> {
    if uid == ours || uid == 0 {
        Ok(())
    } else {
        Err(MigrationError::PeerUser { uid, ours })
    }
}

/// Connects to the destination (on tcp: inside TLS, handshake done by `timeout`).
pub fn connect(url: &MigrationUrl, timeout: Duration) -> Result<Stream, MigrationError> {
    let err = |source| MigrationError::Connect {
        url: url.to_string(),
        source,
    };
    Ok(match url {
        MigrationUrl::Unix(p) => Stream::Unix(UnixStream::connect(p).map_err(err)?),
        MigrationUrl::Tcp(a) => {
            let s = TcpStream::connect(a).map_err(err)?;
            // Small control frames must not wait for Nagle.
            s.set_nodelay(true).map_err(err)?;
            Stream::Tcp(s).into_tls(true, timeout)?
        }
    })
}

/// A listening socket; a Unix socket's file is removed when this is dropped.
pub enum Listener {
    Unix(UnixListener, PathBuf, ntb::sock::SocketFile),
    Tcp(TcpListener),
}

impl Listener {
    /// Listens at `url`. A Unix socket is private (0600) from the first instant
    /// ([`ntb::sock::bind_private`]); a path where a listener still accepts is refused.
    pub fn bind(url: &MigrationUrl) -> Result<Self, MigrationError> {
        let err = |source| MigrationError::Listen {
            url: url.to_string(),
            source,
        };
        Ok(match url {
            MigrationUrl::Unix(p) => {
                let (l, file) = ntb::sock::bind_private(p)
                    .map_err(|e| err(io::Error::new(io::ErrorKind::AddrInUse, e)))?;
                Listener::Unix(l, p.clone(), file)
            }
            MigrationUrl::Tcp(a) => Listener::Tcp(TcpListener::bind(a).map_err(err)?),
        })
    }

    /// Waits for a source: the connection (tcp: before TLS) and who it comes from.
    pub fn accept(&self) -> Result<(Stream, String), MigrationError> {
        let err = |source| MigrationError::Io {
            step: "accepting the source",
            source,
        };
        Ok(match self {
            Listener::Unix(l, p, _) => (
                Stream::Unix(l.accept().map_err(err)?.0),
                format!("unix:{}", p.display()),
            ),
            Listener::Tcp(l) => {
                let (s, a) = l.accept().map_err(err)?;
                s.set_nodelay(true).map_err(err)?;
                (Stream::Tcp(s), a.to_string())
            }
        })
    }
}

impl std::os::fd::AsRawFd for Listener {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        match self {
            Listener::Unix(l, ..) => l.as_raw_fd(),
            Listener::Tcp(l) => l.as_raw_fd(),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, p, file) = self {
            file.remove_if_ours(p);
        }
    }
}

/// Frame types.
pub mod kind {
    pub const HELLO: u32 = 1;
    pub const ACK: u32 = 2;
    pub const REFUSED: u32 = 3;
    pub const CONFIG: u32 = 4;
    pub const MEMORY: u32 = 5;
    pub const STATE: u32 = 6;
    pub const IDENTITY: u32 = 7;
    /// Same-host fast path: no payload; the guest RAM memfd rides along (SCM_RIGHTS).
    pub const MEMFD: u32 = 8;
    /// Authentication (version 3), see [`super::super::auth`].
    pub const AUTH: u32 = 9;
    pub const AUTH_REPLY: u32 = 10;
    pub const AUTH_PROOF: u32 = 11;
}

/// The source's opening of the authentication (payload of `AUTH`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthHello {
    /// The source's fabric node name (bound into both proofs).
    pub node: Option<String>,
    pub nonce: Vec<u8>,
}

/// The destination's answer (payload of `AUTH_REPLY`): who it is, its nonce and its proof.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthReply {
    pub node: Option<String>,
    pub vm: Option<String>,
    pub nonce: Vec<u8>,
    pub proof: Vec<u8>,
}

/// The source's proof (payload of `AUTH_PROOF`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthProof {
    pub proof: Vec<u8>,
}

/// Who the destination is on the device-lending fabric (payload of `IDENTITY`): the source
/// names it in the transfer tickets of its leases. `None`: it cannot take leases over.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    pub node: Option<String>,
    pub vm: Option<String>,
}

/// One lent device's hand-over, in `STATE`: the lease transfer ticket the source's lender
/// issued for the destination, and what the hand-over quiesce reported. The device's
/// guest-visible PCI state is the document's `devices.lent` entry of the same `id`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceHandover {
    /// The VMM's device id.
    pub id: String,
    /// The lease on its lender.
    pub lease: u64,
    /// The single-use ticket.
    pub ticket: Vec<u8>,
    pub expires_in_ms: u64,
    /// MSI-X vectors masked at the source (by the guest, or by the VMM for a paused VM)
    /// with an interrupt waiting there: set pending on the destination. (What the device
    /// raised during the hand-over is held and replayed by the lender.)
    #[serde(default)]
    pub pending_msix: Vec<u32>,
    /// The cluster-directory claim revision the lease is held under: the destination takes
    /// the claim over with the lease (etcd; `None` without a claim).
    #[serde(default)]
    pub claim: Option<i64>,
}

/// The first frame of a stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub magic: String,
    pub version: u32,
    pub lendvm_version: String,
    /// Lent devices the VM holds (the destination readies its RAM for their DMA).
    #[serde(default)]
    pub lent_devices: u32,
}

impl Hello {
    pub fn current() -> Self {
        Self {
            magic: MAGIC.into(),
            version: PROTOCOL_VERSION,
            lendvm_version: env!("CARGO_PKG_VERSION").into(),
            lent_devices: 0,
        }
    }

    /// Refuses another protocol or version, naming both.
    pub fn check(&self) -> Result<(), MigrationError> {
        if self.magic != MAGIC {
            return Err(MigrationError::Magic(self.magic.clone()));
        }
        if self.version != PROTOCOL_VERSION {
            return Err(MigrationError::Version {
                theirs: self.version,
                writer: self.lendvm_version.clone(),
                ours: PROTOCOL_VERSION,
            });
        }
        Ok(())
    }
}

/// Payload of `STATE`: the snapshot document (without RAM files) and whether the VM was
/// paused on the source (it then stays paused on the destination until `vm.resume`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmState {
    #[serde(flatten)]
    pub doc: VmSnapshot,
    #[serde(default)]
    pub paused: bool,
    /// The lent devices handed over (one per `doc.devices.lent` entry).
    #[serde(default)]
    pub handover: Vec<DeviceHandover>,
}

/// Why the destination refused (payload of `REFUSED`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    pub reason: String,
}

/// A decoded frame.
#[derive(Debug)]
pub enum Frame {
    Hello(Hello),
    Ack,
    Refused(Refusal),
    Config(MachineConfig),
    /// A run of guest pages: where, and the bytes (read into the caller's buffer).
    Memory {
        gpa: u64,
        len: u64,
    },
    State(Box<VmState>),
    Identity(Identity),
    /// The source's guest RAM memfd came with it ([`read_frame_with_fd`]).
    Memfd,
    Auth(AuthHello),
    AuthReply(AuthReply),
    AuthProof(AuthProof),
}

fn io_err(step: &'static str) -> impl Fn(io::Error) -> MigrationError {
    move |source| {
        if source.kind() == io::ErrorKind::UnexpectedEof {
            MigrationError::Closed { step }
        } else {
            MigrationError::Io { step, source }
        }
    }
}

fn header(kind: u32, len: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&len.to_le_bytes());
    h
}

/// Writes a JSON control frame.
pub fn write_json<T: Serialize>(
    w: &mut impl Write,
    kind: u32,
    what: &'static str,
    v: &T,
) -> Result<(), MigrationError> {
    let body = serde_json::to_vec(v).map_err(|source| MigrationError::Json { what, source })?;
    w.write_all(&header(kind, body.len() as u64))
        .and_then(|()| w.write_all(&body))
        .and_then(|()| w.flush())
        .map_err(io_err(what))
}

/// Writes an empty frame (`ACK`).
pub fn write_empty(
    w: &mut impl Write,
    kind: u32,
    what: &'static str,
) -> Result<(), MigrationError> {
    w.write_all(&header(kind, 0))
        .and_then(|()| w.flush())
        .map_err(io_err(what))
}

/// Writes one memory frame: `gpa` and `data` (at most [`MAX_RUN`] bytes).
pub fn write_memory(w: &mut impl Write, gpa: u64, data: &[u8]) -> Result<(), MigrationError> {
    let step = "sending guest memory";
    w.write_all(&header(kind::MEMORY, 8 + data.len() as u64))
        .and_then(|()| w.write_all(&gpa.to_le_bytes()))
        .and_then(|()| w.write_all(data))
        .map_err(io_err(step))
}

/// Reads the next frame. A memory frame's bytes are left in the stream: the caller reads
/// exactly `len` of them next (see [`read_exact`]).
pub fn read_frame(r: &mut impl Read, step: &'static str) -> Result<Frame, MigrationError> {
    let mut h = [0u8; HEADER_LEN];
    r.read_exact(&mut h).map_err(io_err(step))?;
    frame_after(r, h, step)
}

/// Sends the `MEMFD` frame with `fd` attached (unix streams only: the same-host fast path).
pub fn write_memfd(s: &mut Stream, fd: std::os::fd::RawFd) -> Result<(), MigrationError> {
    use vmm_sys_util::sock_ctrl_msg::ScmSocket;
    let step = "handing over the guest ram memfd";
    let Stream::Unix(u) = s else {
        return Err(MigrationError::LocalNeedsUnix);
    };
    let h = header(kind::MEMFD, 0);
    let n = u.send_with_fd(&h[..], fd).map_err(|e| MigrationError::Io {
        step,
        source: io::Error::from_raw_os_error(e.errno()),
    })?;
    u.write_all(&h[n..]).map_err(io_err(step))
}

/// [`read_frame`], keeping an fd that came with the frame's header (unix streams).
pub fn read_frame_with_fd(
    s: &mut Stream,
    step: &'static str,
) -> Result<(Frame, Option<std::fs::File>), MigrationError> {
    use vmm_sys_util::sock_ctrl_msg::ScmSocket;
    let Stream::Unix(u) = s else {
        return Ok((read_frame(s, step)?, None));
    };
    let mut h = [0u8; HEADER_LEN];
    let (n, fd) = u.recv_with_fd(&mut h).map_err(|e| MigrationError::Io {
        step,
        source: io::Error::from_raw_os_error(e.errno()),
    })?;
    if n == 0 {
        return Err(MigrationError::Closed { step });
    }
    u.read_exact(&mut h[n..]).map_err(io_err(step))?;
    Ok((frame_after(u, h, step)?, fd))
}

/// The frame whose header is `h` (its payload is read from `r`).
fn frame_after(
    r: &mut impl Read,
    h: [u8; HEADER_LEN],
    step: &'static str,
) -> Result<Frame, MigrationError> {
    let mut k = [0u8; 4];
    k.copy_from_slice(&h[0..4]);
    let kind = u32::from_le_bytes(k);
    let mut l = [0u8; 8];
    l.copy_from_slice(&h[8..16]);
    let len = u64::from_le_bytes(l);
    if kind == kind::MEMORY {
        if !(8..=8 + MAX_RUN).contains(&len) {
            return Err(MigrationError::TooLarge {
                kind,
                len,
                max: 8 + MAX_RUN,
            });
        }
        let mut g = [0u8; 8];
        r.read_exact(&mut g).map_err(io_err(step))?;
        return Ok(Frame::Memory {
            gpa: u64::from_le_bytes(g),
            len: len - 8,
        });
    }
    if len > MAX_CONTROL {
        return Err(MigrationError::TooLarge {
            kind,
            len,
            max: MAX_CONTROL,
        });
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).map_err(io_err(step))?;
    fn json<T: serde::de::DeserializeOwned>(
        what: &'static str,
        b: &[u8],
    ) -> Result<T, MigrationError> {
        serde_json::from_slice(b).map_err(|source| MigrationError::Json { what, source })
    }
    Ok(match kind {
        kind::HELLO => Frame::Hello(json("hello", &body)?),
        kind::ACK => Frame::Ack,
        kind::REFUSED => Frame::Refused(json("refusal", &body)?),
        kind::CONFIG => Frame::Config(json("config", &body)?),
        kind::STATE => Frame::State(Box::new(json("state", &body)?)),
        kind::IDENTITY => Frame::Identity(json("identity", &body)?),
        kind::MEMFD => Frame::Memfd,
        kind::AUTH => Frame::Auth(json("auth", &body)?),
        kind::AUTH_REPLY => Frame::AuthReply(json("auth reply", &body)?),
        kind::AUTH_PROOF => Frame::AuthProof(json("auth proof", &body)?),
        got => return Err(MigrationError::Unexpected { step, got }),
    })
}

/// The type number of a frame (for "unexpected" errors).
pub fn kind_of(f: &Frame) -> u32 {
    match f {
        Frame::Hello(_) => kind::HELLO,
        Frame::Ack => kind::ACK,
        Frame::Refused(_) => kind::REFUSED,
        Frame::Config(_) => kind::CONFIG,
        Frame::Memory { .. } => kind::MEMORY,
        Frame::State(_) => kind::STATE,
        Frame::Identity(_) => kind::IDENTITY,
        Frame::Memfd => kind::MEMFD,
        Frame::Auth(_) => kind::AUTH,
        Frame::AuthReply(_) => kind::AUTH_REPLY,
        Frame::AuthProof(_) => kind::AUTH_PROOF,
    }
}

/// Reads exactly `buf.len()` bytes of a memory frame.
pub fn read_exact(r: &mut impl Read, buf: &mut [u8]) -> Result<(), MigrationError> {
    r.read_exact(buf).map_err(io_err("receiving guest memory"))
}

/// Waits for the destination's answer: `Ok` on `ACK`, its reason on `REFUSED`.
pub fn read_answer(r: &mut impl Read, step: &'static str) -> Result<(), MigrationError> {
    match read_frame(r, step)? {
        Frame::Ack => Ok(()),
        Frame::Refused(why) => Err(MigrationError::Refused(why.reason)),
        f => Err(MigrationError::Unexpected {
            step,
            got: kind_of(&f),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_or_are_refused_by_name() {
        assert_eq!(
            parse_url("unix:/tmp/m.sock").unwrap(),
            MigrationUrl::Unix("/tmp/m.sock".into())
        );
        assert_eq!(
            parse_url("tcp:127.0.0.1:4444").unwrap(),
            MigrationUrl::Tcp("127.0.0.1:4444".into())
        );
        for (url, want) in [
            ("file:///x", "scheme 'file'"),
            ("unix:", "no socket path"),
            ("unix:rel.sock", "absolute"),
            ("tcp:127.0.0.1", "no port"),
            ("tcp:h:99999", "port '99999'"),
            ("nonsense", "scheme ''"),
        ] {
            let e = parse_url(url).unwrap_err().to_string();
            assert!(e.contains(url) && e.contains(want), "{url}: {e}");
        }
    }

    #[test]
    fn the_unix_listener_is_private_and_other_users_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("m.sock");
        let l = Listener::bind(&MigrationUrl::Unix(p.clone())).unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
        // A second listener on a live path is refused, not swapped in.
        assert!(Listener::bind(&MigrationUrl::Unix(p.clone())).is_err());
        drop(l);
        assert!(!p.exists(), "the socket file goes with the listener");
        peer_user_allowed(1000, 1000).unwrap();
        peer_user_allowed(0, 1000).unwrap();
        let e = peer_user_allowed(1001, 1000).unwrap_err().to_string();
        assert!(e.contains("uid 1001") && e.contains("uid 1000"), "{e}");
    }

    #[test]
    fn frames_round_trip_and_bad_ones_are_refused() {
        let mut buf = Vec::new();
        write_json(&mut buf, kind::HELLO, "hello", &Hello::current()).unwrap();
        write_memory(&mut buf, 0x1000, &[7u8; 4096]).unwrap();
        write_empty(&mut buf, kind::ACK, "ack").unwrap();
        let mut r = &buf[..];
        match read_frame(&mut r, "t").unwrap() {
            Frame::Hello(h) => h.check().unwrap(),
            f => panic!("{f:?}"),
        }
        match read_frame(&mut r, "t").unwrap() {
            Frame::Memory { gpa, len } => {
                assert_eq!((gpa, len), (0x1000, 4096));
                let mut b = vec![0u8; 4096];
                read_exact(&mut r, &mut b).unwrap();
                assert!(b.iter().all(|&x| x == 7));
            }
            f => panic!("{f:?}"),
        }
        read_answer(&mut r, "t").unwrap();
        // A future version is refused naming both.
        let h = Hello {
            version: 9,
            ..Hello::current()
        };
        let e = h.check().unwrap_err().to_string();
        assert!(
            e.contains("version 9") && e.contains(&format!("version {PROTOCOL_VERSION}")),
            "{e}"
        );
        // The destination's identity frame.
        let mut buf = Vec::new();
        let id = Identity {
            node: Some("n2".into()),
            vm: Some("vm2".into()),
        };
        write_json(&mut buf, kind::IDENTITY, "identity", &id).unwrap();
        match read_frame(&mut &buf[..], "t").unwrap() {
            Frame::Identity(got) => assert_eq!(got, id),
            f => panic!("{f:?}"),
        }
        // Oversized and unknown frames.
        let big = header(kind::MEMORY, 8 + MAX_RUN + 1);
        let e = read_frame(&mut &big[..], "t").unwrap_err();
        assert!(matches!(e, MigrationError::TooLarge { .. }), "{e}");
        let odd = header(77, 0);
        let e = read_frame(&mut &odd[..], "t").unwrap_err();
        assert!(
            matches!(e, MigrationError::Unexpected { got: 77, .. }),
            "{e}"
        );
        // A stream cut short.
        let e = read_frame(&mut &buf[..5], "reading").unwrap_err();
        assert!(
            matches!(e, MigrationError::Closed { step: "reading" }),
            "{e}"
        );
    }
}
