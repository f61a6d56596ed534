//! The fabric abstraction, modelled on the Linux NTB API.
//!
//! | Linux NTB | here |
//! |---|---|
//! | `ntb_mw_count`, `ntb_mw_get_align` | [`Endpoint::limits`] ([`WindowLimits`]) |
//! | `ntb_mw_set_trans` (inbound window onto local memory) | [`Endpoint::export_window`] → [`ExportedWindow`] |
//! | `ntb_peer_mw_count`, `ntb_peer_mw_get_addr` + `ioremap` | [`Endpoint::peer_windows`], [`Endpoint::map_peer_window`] → [`PeerWindow`] |
//! | `ntb_peer_db_set` | [`Endpoint::ring_peer`] |
//! | `ntb_db_read` + `ntb_db_clear`, db vector irq | [`Endpoint::wait_doorbell`], [`Endpoint::doorbell_eventfd`] |
//! | `ntb_spad_*`, `ntb_peer_spad_*` | [`Endpoint::read_spad`] … [`Endpoint::write_peer_spad`] |
//! | `ntb_msg_*` | [`Endpoint::send`], [`Endpoint::request`], [`Endpoint::recv`] (typed, with fds) |
//! | `ntb_peer_port_count/number`, `ntb_link_is_up` | [`Fabric::peers`], [`Endpoint::peer_node`], [`Endpoint::is_up`] |
//!
//! An [`Endpoint`] is one NTB link between the local node and one peer.

use std::fmt;
use std::os::fd::OwnedFd;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::EventFd;

use crate::config::ControlAddr;
use crate::mem::MemError;
use crate::wire::{self, ErrorReply, WireError, MAX_FDS, USER_OPCODE_BASE};

/// Name of a node in the cluster (`node1`, `node3`, …).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(String);

impl NodeId {
    /// Longest node name.
    pub const MAX_LEN: usize = 64;

    /// Validates a node name: 1..=64 of `[A-Za-z0-9_.-]`.
    pub fn new(name: &str) -> Result<NodeId, FabricError> {
        let ok = !name.is_empty()
            && name.len() <= Self::MAX_LEN
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if ok {
            Ok(NodeId(name.to_string()))
        } else {
            Err(FabricError::BadNodeName(name.to_string()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Which backend carries a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FabricKind {
    /// Same host: memfd windows and eventfd doorbells over a Unix socket; direct mappings.
    Shm,
    /// Across hosts: everything as messages over TCP; no direct mappings.
    Tcp,
    /// Across hosts with a shared region ([`crate::region`]): control, doorbells and
    /// scratchpads as on tcp, but windows inside the region are mapped directly (the lender
    /// through a PCI BAR, like an NTB memory window).
    Bar,
}

impl FabricKind {
    /// Whether links of this kind pass file descriptors (memfd windows, eventfd doorbells).
    pub fn passes_fds(self) -> bool {
        self == FabricKind::Shm
    }

    /// Whether links of this kind run over the network (tcp and TLS): per-source limits
    /// apply, and nothing is shared by fd.
    pub fn is_networked(self) -> bool {
        self != FabricKind::Shm
    }
}

impl fmt::Display for FabricKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FabricKind::Shm => "shm",
            FabricKind::Tcp => "tcp",
            FabricKind::Bar => "bar",
        })
    }
}

/// Which path a link's control messages (requests, replies, doorbells, interrupts,
/// heartbeats) take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlPath {
    /// A Unix socket (shm).
    Socket,
    /// TLS over TCP (tcp, and bar links whose control stays on tcp).
    Tls,
    /// Rings in the bar fabric's shared region ([`crate::ring`]): ring slot `slot` at
    /// `offset`; TCP carries only wake-up kicks.
    Ring { slot: u32, offset: u64 },
}

impl fmt::Display for ControlPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ControlPath::Socket => f.write_str("unix socket"),
            ControlPath::Tls => f.write_str("tls"),
            ControlPath::Ring { slot, offset } => {
                write!(f, "ring (slot {slot} at {offset:#x} of the region)")
            }
        }
    }
}

/// Hardware-like limits of a node's inbound memory windows (`ntb_mw_count`/`ntb_mw_get_align`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowLimits {
    /// Number of inbound windows the node can export at once.
    pub max_windows: u32,
    /// Alignment of a window's translated base (the offset into the exported memory).
    pub addr_align: u64,
    /// Alignment of a window's size.
    pub size_align: u64,
    /// Largest window.
    pub max_size: u64,
}

impl Default for WindowLimits {
    /// Like an Intel/Switchtec NTB port: a handful of windows, 4 KiB alignment, 64 GiB max.
    fn default() -> Self {
        WindowLimits {
            max_windows: 8,
            addr_align: 4096,
            size_align: 4096,
            max_size: 64 << 30,
        }
    }
}

impl WindowLimits {
    /// Checks the limits themselves.
    pub fn validate(&self) -> Result<(), FabricError> {
        let bad = |m: String| Err(FabricError::BadLimits(m));
        if self.max_windows == 0 || self.max_windows > 1024 {
            return bad(format!(
                "max_windows {} is not in 1..=1024",
                self.max_windows
            ));
        }
        for (n, a) in [
            ("addr_align", self.addr_align),
            ("size_align", self.size_align),
        ] {
            if a < 4096 || !a.is_power_of_two() {
                return bad(format!("{n} {a:#x} is not a power of two >= 0x1000"));
            }
        }
        if self.max_size < self.size_align {
            return bad(format!(
                "max_size {:#x} is below size_align {:#x}",
                self.max_size, self.size_align
            ));
        }
        Ok(())
    }

    /// Checks a window of `size` bytes translated to `offset`.
    pub fn check_window(&self, offset: u64, size: u64) -> Result<(), FabricError> {
        if size == 0 {
            return Err(FabricError::ZeroSizeWindow);
        }
        if !offset.is_multiple_of(self.addr_align) {
            return Err(FabricError::Misaligned {
                what: "offset",
                value: offset,
                align: self.addr_align,
            });
        }
        if !size.is_multiple_of(self.size_align) {
            return Err(FabricError::Misaligned {
                what: "size",
                value: size,
                align: self.size_align,
            });
        }
        if size > self.max_size {
            return Err(FabricError::Oversized {
                size,
                max: self.max_size,
            });
        }
        Ok(())
    }
}

/// Per-link settings of the local node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkConfig {
    pub limits: WindowLimits,
    /// Number of local doorbell bits (1..=64).
    pub doorbells: u32,
    /// Number of 32-bit scratchpad registers (1..=1024).
    pub scratchpads: u32,
    /// How often a heartbeat is sent.
    pub heartbeat: Duration,
    /// Silence after which the peer is declared gone.
    pub peer_timeout: Duration,
    /// Bound on connecting and on the handshake.
    pub connect_timeout: Duration,
    /// Bound on one request's answer (a lender's reply to a borrower). Most answers take
    /// microseconds, but a DMA map is the lender's IOMMU mapping a whole guest window: on
    /// `VM_PFNMAP` memory (an NTB's or the bar fabric's BAR) Linux 6.1's type1 walks it page
    /// by page, linear in the window on hardware too (seconds for a large guest), minutes
    /// under emulation (docs/VFIO.md).
    pub request_timeout: Duration,
    /// Refuse to map a peer's window (or scratchpad) memfd that is not sealed against
    /// shrinking (`F_SEAL_SHRINK`); when false such a mapping is only logged as a warning.
    /// An unsealed memfd can be truncated by its exporter after the size check, and a later
    /// access through the mapping would then raise SIGBUS in this process. On by default:
    /// every exporter in lendvm seals its memfds ([`crate::SharedMemory`], the VMM's guest
    /// RAM); turn it off only for a peer that cannot.
    pub require_sealed_windows: bool,
    /// The shared region of a `bar` node: its links are `bar` links whose windows inside the
    /// region are mapped directly ([`crate::region`]). `None` on shm and tcp nodes.
    pub region: Option<crate::region::RegionSpec>,
    /// Pre-authentication limits of a listener: handshakes at once, in all and per source
    /// (`[link] max_pending_handshakes`, `max_pending_per_source`).
    pub preauth: crate::accept::PreauthLimits,
    /// shm nodes: the group whose members may connect to this node's control socket (mode
    /// 0660, `[[node]] control_group`), so that VMs running as users of their own reach a
    /// lender on their host; `None`: mode 0600, this user only. Resolved when the listener
    /// binds, on the listening host.
    pub control_group: Option<String>,
}

/// [`LinkConfig::request_timeout`] unless the cluster file's `link.request_timeout_ms` says
/// otherwise.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            limits: WindowLimits::default(),
            doorbells: 16,
            scratchpads: 16,
            heartbeat: Duration::from_millis(250),
            peer_timeout: Duration::from_millis(1500),
            connect_timeout: Duration::from_secs(5),
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            require_sealed_windows: true,
            region: None,
            preauth: crate::accept::PreauthLimits::default(),
            control_group: None,
        }
    }
}

impl LinkConfig {
    pub fn validate(&self) -> Result<(), FabricError> {
        self.limits.validate()?;
        if !(1..=64).contains(&self.doorbells) {
            return Err(FabricError::BadLimits(format!(
                "doorbells {} is not in 1..=64",
                self.doorbells
            )));
        }
        if !(1..=1024).contains(&self.scratchpads) {
            return Err(FabricError::BadLimits(format!(
                "scratchpads {} is not in 1..=1024",
                self.scratchpads
            )));
        }
        self.preauth.check().map_err(FabricError::BadLimits)?;
        if self.heartbeat.is_zero() || self.peer_timeout <= self.heartbeat * 2 {
            return Err(FabricError::BadLimits(format!(
                "peer timeout {:?} must exceed twice the heartbeat {:?}",
                self.peer_timeout, self.heartbeat
            )));
        }
        Ok(())
    }
}

/// Id of a window, chosen by its exporter, unique per link direction.
pub type WindowId = u32;

/// A window as the peer advertised it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowInfo {
    pub id: WindowId,
    pub size: u64,
    pub label: String,
}

/// A message of a protocol built on the fabric (opcode ≥ [`USER_OPCODE_BASE`]).
#[derive(Debug, Default)]
pub struct Message {
    pub opcode: u16,
    pub payload: Vec<u8>,
    /// Attached file descriptors (shm links only; at most [`MAX_FDS`]).
    pub fds: Vec<OwnedFd>,
}

impl Message {
    /// A message with a raw payload.
    pub fn raw(opcode: u16, payload: Vec<u8>) -> Message {
        Message {
            opcode,
            payload,
            fds: Vec::new(),
        }
    }

    /// A message with a serde payload (postcard).
    pub fn new<T: Serialize + ?Sized>(opcode: u16, value: &T) -> Result<Message, WireError> {
        Ok(Message::raw(opcode, wire::encode_payload(value)?))
    }

    /// Attaches file descriptors (memfds, eventfds…).
    pub fn with_fds(mut self, fds: Vec<OwnedFd>) -> Message {
        self.fds = fds;
        self
    }

    /// Decodes the serde payload.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, WireError> {
        wire::decode_payload(&self.payload)
    }

    pub(crate) fn check_user(&self) -> Result<(), FabricError> {
        if self.opcode < USER_OPCODE_BASE {
            return Err(FabricError::ReservedOpcode(self.opcode));
        }
        if self.fds.len() > MAX_FDS {
            return Err(WireError::TooManyFds {
                count: self.fds.len(),
                max: MAX_FDS,
            }
            .into());
        }
        Ok(())
    }
}

/// Id of a request received from the peer, to be answered with [`Endpoint::reply`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestId(pub u64);

/// Something that arrived from the peer.
#[derive(Debug)]
pub enum Incoming {
    /// A request; answer it with [`Endpoint::reply`].
    Request { id: RequestId, msg: Message },
    /// A one-way message.
    Event(Message),
    /// The peer exported a window.
    WindowAdded(WindowInfo),
    /// The peer revoked a window (any local mapping of it is already severed).
    WindowRemoved(WindowId),
}

/// Counters of a link.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Frames sent, heartbeats excluded.
    pub frames_sent: u64,
    /// Frames received, heartbeats excluded.
    pub frames_received: u64,
    pub heartbeats_sent: u64,
    pub heartbeats_received: u64,
    /// Window data frames (tcp reads/writes) sent.
    pub window_io_frames: u64,
    /// Items (requests, events, window changes) queued for [`Endpoint::recv`] since the link
    /// came up. Read after a reply, it counts everything the peer sent before that reply:
    /// the link's reader queues a frame before it reads the next.
    pub incoming_queued: u64,
    /// Items [`Endpoint::recv`] has handed out since the link came up.
    pub incoming_taken: u64,
}

/// Errors of the fabric.
#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    #[error("window limit reached: {max} windows already exported")]
    WindowLimit { max: u32 },
    #[error("window {what} {value:#x} is not a multiple of the {align:#x} alignment")]
    Misaligned {
        what: &'static str,
        value: u64,
        align: u64,
    },
    #[error("window size {size:#x} exceeds the maximum of {max:#x}")]
    Oversized { size: u64, max: u64 },
    #[error("window size is zero")]
    ZeroSizeWindow,
    #[error("memory region of {have:#x} bytes is smaller than window end {need:#x}")]
    RegionTooSmall { have: u64, need: u64 },
    #[error("shared region {path}: {problem}")]
    BadRegion { path: String, problem: String },
    #[error(
        "{what} from {peer} is {problem}; refusing to map it (the exporter must create it \
         with MFD_ALLOW_SEALING and add F_SEAL_SHRINK, see ntb::SharedMemory)"
    )]
    UnsealedWindow {
        /// `window 3 ("lease1-bar0")`, `scratchpad memfd`.
        what: String,
        peer: String,
        /// `a memfd without F_SEAL_SHRINK (seals 0x1)`, `a file that cannot be sealed and …`.
        problem: String,
    },
    #[error("unknown peer {0}")]
    UnknownPeer(String),
    #[error("peer {peer} is gone: {reason}")]
    PeerGone { peer: String, reason: String },
    #[error("peer has no window {0}")]
    UnknownWindow(WindowId),
    #[error("window {0} was revoked by its exporter")]
    WindowRevoked(WindowId),
    #[error("{kind} fabric cannot give a direct mapping; use read/write (trap) instead")]
    DirectMappingUnsupported { kind: FabricKind },
    #[error("{kind} fabric cannot pass file descriptors")]
    FdPassingUnsupported { kind: FabricKind },
    #[error("access {offset:#x}+{len:#x} is outside the {size:#x}-byte window")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("doorbell bits {bits:#x} outside the {count} valid doorbells")]
    BadDoorbell { bits: u64, count: u32 },
    #[error("scratchpad {index} out of range (count {count})")]
    BadScratchpad { index: u32, count: u32 },
    #[error("opcode {0:#x} is reserved for the fabric (user opcodes start at 0x100)")]
    ReservedOpcode(u16),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("peer replied {0}")]
    Remote(ErrorReply),
    #[error("handshake failed: {0}")]
    Handshake(String),
    #[error(transparent)]
    Listen(#[from] crate::sock::BindError),
    #[error("bad node name {0:?}")]
    BadNodeName(String),
    #[error("bad limits: {0}")]
    BadLimits(String),
    #[error("{0} control address {1} does not fit the node's fabric kind")]
    AddressKind(FabricKind, String),
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error(transparent)]
    Mem(#[from] MemError),
    #[error("{op}: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
}

impl FabricError {
    pub(crate) fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> FabricError {
        move |source| FabricError::Io { op, source }
    }

    /// Whether this error means the link is dead.
    pub fn is_peer_gone(&self) -> bool {
        matches!(self, FabricError::PeerGone { .. })
    }
}

pub type Result<T, E = FabricError> = std::result::Result<T, E>;

/// Which memory a mapped peer window reaches: the file its exporter passed (`st_dev`,
/// `st_ino`) and the range of it. Two windows with equal ids are views of the same bytes —
/// on one host, the same memfd exported by two processes (guest RAM handed to a second VMM
/// by the memfd fast path of live migration). Compared while both windows are mapped, an
/// inode cannot have been freed and reused in between (each mapping keeps its file alive).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BackingId {
    /// `st_dev` of the file.
    pub dev: u64,
    /// `st_ino` of the file.
    pub ino: u64,
    /// Offset of the window in the file.
    pub offset: u64,
    /// Length of the window.
    pub len: u64,
}

impl BackingId {
    /// The identity of `[offset, offset + len)` of the file `fd` refers to.
    pub fn of_file(
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: u64,
    ) -> std::result::Result<BackingId, MemError> {
        let (dev, ino) = crate::mem::fd_file_id(fd)?;
        Ok(BackingId {
            dev,
            ino,
            offset,
            len,
        })
    }
}

/// A peer's window mapped into the local address space (an outbound NTB window).
///
/// Dropping it unmaps it. When the peer revokes the window or dies, the mapping is severed:
/// the host range stays valid (it is replaced by anonymous zero memory so stray loads and
/// stores through a saved pointer cannot fault) and every accessor reports the cause.
pub trait PeerWindow: Send + Sync {
    fn info(&self) -> &WindowInfo;

    fn len(&self) -> u64 {
        self.info().size
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Host address of the mapping, for KVM memslots and direct loads/stores (shm only).
    fn as_ptr(&self) -> Result<*mut u8>;

    /// Copies from the window at `offset` (tcp: request/reply messages, batched).
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()>;

    /// Copies into the window at `offset` (tcp: messages of ≤ 1 MiB, pipelined).
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()>;

    /// [`PeerWindow::write_at`] of `len` bytes at `src`, memory that others (a guest, a
    /// device, another process) may change meanwhile and that is therefore never made a
    /// Rust slice: the bytes move by raw copies only. The default stages them in a buffer;
    /// a window that can take them in one copy (a staged mediated window) overrides it.
    ///
    /// # Safety
    /// `src` must be valid for reads of `len` bytes for the duration of the call.
    unsafe fn write_raw(&self, offset: u64, src: *const u8, len: usize) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        self.write_at(offset, &unsafe { stage_raw(src, len) })
    }

    /// Whether the window is still backed by the peer's memory.
    fn is_live(&self) -> bool;

    /// The memory the window was mapped from (shm: the exporter's file and range), so that
    /// two windows can be recognised as the same memory. `None` (the default) for windows
    /// reached by messages (tcp), which are never the same memory as another window.
    fn backing_id(&self) -> Option<BackingId> {
        None
    }
}

/// The `len` bytes at `src` in a buffer of their own, taken by one raw copy: what a window
/// that sends or stores from a slice takes in [`PeerWindow::write_raw`].
///
/// # Safety
/// `src` must be valid for reads of `len` bytes for the duration of the call.
pub(crate) unsafe fn stage_raw(src: *const u8, len: usize) -> Vec<u8> {
    let mut buf = Vec::with_capacity(len);
    // SAFETY: `src` is valid for `len` bytes (this function's contract) and `buf` has room
    // for them; a raw copy, then the length is set over the bytes written.
    unsafe {
        std::ptr::copy_nonoverlapping(src, buf.as_mut_ptr(), len);
        buf.set_len(len);
    }
    buf
}

/// A local memory region exported to the peer as an inbound window.
///
/// Dropping it revokes the window: the peer is told and its mappings are severed.
pub struct ExportedWindow {
    pub(crate) info: WindowInfo,
    pub(crate) revoke: Option<Box<dyn FnOnce() + Send + Sync>>,
    /// The peer maps the memory itself (its fd was passed, or it lies in the shared
    /// region), rather than this end serving each access.
    pub(crate) mapped_by_peer: bool,
}

impl ExportedWindow {
    pub fn new(
        info: WindowInfo,
        mapped_by_peer: bool,
        revoke: Box<dyn FnOnce() + Send + Sync>,
    ) -> Self {
        ExportedWindow {
            info,
            revoke: Some(revoke),
            mapped_by_peer,
        }
    }

    /// Whether the peer maps the memory itself (`false`: this end serves every access).
    pub fn mapped_by_peer(&self) -> bool {
        self.mapped_by_peer
    }

    pub fn id(&self) -> WindowId {
        self.info.id
    }

    pub fn info(&self) -> &WindowInfo {
        &self.info
    }
}

impl fmt::Debug for ExportedWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExportedWindow")
            .field("info", &self.info)
            .finish()
    }
}

impl Drop for ExportedWindow {
    fn drop(&mut self) {
        if let Some(revoke) = self.revoke.take() {
            revoke();
        }
    }
}

/// One NTB link between the local node and a peer.
pub trait Endpoint: Send + Sync {
    fn local_node(&self) -> &NodeId;
    fn peer_node(&self) -> &NodeId;
    fn kind(&self) -> FabricKind;
    /// Where the peer is, for logs, errors and per-address limits: `ip:port` on tcp; on shm
    /// `unix:uid=U,pid=P` of the connecting process (accepting side) or the socket path
    /// (connecting side); empty when unknown.
    fn peer_addr(&self) -> String {
        String::new()
    }

    /// The shared region of a `bar` link (`None` on shm and tcp).
    fn shared_region(&self) -> Option<std::sync::Arc<crate::region::Region>> {
        None
    }

    /// Which path this link's control messages take.
    fn control_path(&self) -> ControlPath {
        match self.kind() {
            FabricKind::Shm => ControlPath::Socket,
            FabricKind::Tcp | FabricKind::Bar => ControlPath::Tls,
        }
    }

    /// Bytes unique to this link's secure channel that both ends see alike (the TLS exporter
    /// on tcp, [`crate::tls`]); empty when the link has none (shm, where the socket's
    /// permissions protect the channel). Authentication above the fabric mixes it into its
    /// proofs, so they do not verify through a relay.
    fn channel_binding(&self) -> Vec<u8> {
        Vec::new()
    }
    /// Local inbound window limits.
    fn limits(&self) -> WindowLimits;
    /// The peer's inbound window limits (from the handshake).
    fn peer_limits(&self) -> WindowLimits;
    /// Whether the link is up (the peer has not gone).
    fn is_up(&self) -> bool;
    fn stats(&self) -> LinkStats;

    /// Exports `size` bytes of the memory behind `fd` at `offset` as an inbound window
    /// (`ntb_mw_set_trans`). `fd` must be mmap-able (a memfd, a /dev/shm file); it is
    /// duplicated. On shm the peer receives the fd; on tcp the exporter serves the peer's
    /// reads and writes from its own mapping.
    fn export_window(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        size: u64,
        label: &str,
    ) -> Result<ExportedWindow>;

    /// Like [`Endpoint::export_window`], but the peer never receives the fd, on shm too: it
    /// reaches exactly `[offset, offset + size)` of the file through reads and writes this
    /// end serves from its own mapping of that range. So nothing else of the file is ever
    /// exposed, and dropping the window ends the peer's access for good (there is nothing
    /// it could keep). For memory lent to a party that must not keep it: a peer-to-peer
    /// grant to another lender.
    fn export_window_mediated(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        size: u64,
        label: &str,
    ) -> Result<ExportedWindow>;

    /// Windows the peer currently exports to us.
    fn peer_windows(&self) -> Vec<WindowInfo>;

    /// Waits until the peer exports a window labelled `label`.
    fn wait_peer_window(&self, label: &str, timeout: Duration) -> Result<WindowInfo>;

    /// Maps a peer window (`ntb_peer_mw_get_addr` + ioremap).
    fn map_peer_window(&self, id: WindowId) -> Result<Box<dyn PeerWindow>>;

    /// Number of local doorbell bits.
    fn doorbell_count(&self) -> u32;
    /// Sets doorbell bits on the peer (`ntb_peer_db_set`).
    fn ring_peer(&self, bits: u64) -> Result<()>;
    /// Waits for any local doorbell in `mask`, clears and returns the bits that fired.
    fn wait_doorbell(&self, mask: u64, timeout: Duration) -> Result<u64>;
    /// A duplicate of the local doorbell eventfd of `bit` (e.g. a KVM irqfd).
    fn doorbell_eventfd(&self, bit: u32) -> Result<EventFd>;
    /// A duplicate of the peer's doorbell eventfd of `bit` (e.g. a KVM ioeventfd), shm only.
    fn peer_doorbell_eventfd(&self, bit: u32) -> Result<EventFd>;

    fn spad_count(&self) -> u32;
    fn read_spad(&self, index: u32) -> Result<u32>;
    fn write_spad(&self, index: u32, value: u32) -> Result<()>;
    fn read_peer_spad(&self, index: u32) -> Result<u32>;
    fn write_peer_spad(&self, index: u32, value: u32) -> Result<()>;

    /// Sends a one-way message.
    fn send(&self, msg: Message) -> Result<()>;
    /// Sends a request and waits for its reply; an error reply becomes [`FabricError::Remote`].
    fn request(&self, msg: Message, timeout: Duration) -> Result<Message>;
    /// Answers a request received through [`Endpoint::recv`].
    fn reply(&self, id: RequestId, reply: std::result::Result<Message, ErrorReply>) -> Result<()>;
    /// Next incoming request, event or window change; `PeerGone` once the link is down and
    /// everything received has been taken; `Timeout` if nothing came.
    fn recv(&self, timeout: Duration) -> Result<Incoming>;
    /// Waits until the link is down and every window mapped through it is severed (so
    /// `is_live` is false on return); returns the reason, or `Timeout`.
    fn wait_gone(&self, timeout: Duration) -> Result<String>;
    /// Orderly close: tells the peer and takes the link down.
    fn close(&self);
}

/// A peer known from the cluster description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    pub node: NodeId,
    pub kind: FabricKind,
    pub control: ControlAddr,
}

/// Accepts links from peers at the local control address.
pub trait Listener: Send + Sync {
    /// The address peers connect to (with the real port when bound to port 0).
    fn local_addr(&self) -> ControlAddr;
    /// Waits for the next peer (forever if `timeout` is `None`).
    fn accept(&self, timeout: Option<Duration>) -> Result<Box<dyn Endpoint>>;
    /// Handshakes of accepted connections in progress now, out of
    /// [`Listener::handshake_slots`] (metrics). Default: not counted.
    fn handshakes_pending(&self) -> Option<usize> {
        None
    }
    /// Handshakes that may be in progress at once.
    fn handshake_slots(&self) -> usize {
        crate::accept::MAX_PENDING_HANDSHAKES
    }
}

/// The local node's view of the fabric.
pub trait Fabric: Send + Sync {
    fn local_node(&self) -> &NodeId;
    /// Other nodes of the cluster (`ntb_peer_port_*`).
    fn peers(&self) -> Vec<PeerInfo>;
    /// Listens at the local node's control address.
    fn listen(&self) -> Result<Box<dyn Listener>>;
    /// Opens a link to `peer`.
    fn connect(&self, peer: &NodeId) -> Result<Box<dyn Endpoint>>;
}
