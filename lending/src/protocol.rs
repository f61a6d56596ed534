//! The lender control protocol (borrower ↔ lender), carried as user messages of the fabric's
//! wire format ([`ntb::wire`]: 24-byte header, postcard payload, fds beside the frame on shm).
//!
//! The operations follow vfio-user, fabric-neutral:
//!
//! | opcode | request | reply | vfio-user |
//! |---|---|---|---|
//! | 0x100 | [`Hello`] | [`HelloReply`] | VERSION (+ cluster token) |
//! | 0x101 | `List` | `Vec<`[`DeviceSummary`]`>` | — |
//! | 0x102 | [`Borrow`] | [`Borrowed`] (+ notify eventfd on shm) | — (exclusive lease) |
//! | 0x103 | [`LeaseRef`] | [`DeviceInfo`] | DEVICE_GET_INFO + GET_REGION_INFO + GET_IRQ_INFO |
//! | 0x104 | [`ConfigRead`] | bytes | REGION_READ (config region) |
//! | 0x105 | [`ConfigWrite`] | `()` | REGION_WRITE (config region, filtered) |
//! | 0x106 | [`BarRead`] | bytes | REGION_READ |
//! | 0x107 | [`BarWrite`] | `()`; version 3: [`DoorbellKicks`] | REGION_WRITE |
//! | 0x108 | [`DmaMap`] | `()` | DMA_MAP (a fabric window instead of an fd) |
//! | 0x109 | [`DmaUnmap`] | `()` | DMA_UNMAP |
//! | 0x10a | [`SetIrqs`] (+ eventfds on shm) | `()` | SET_IRQS |
//! | 0x10b | [`LeaseRef`] | `()`; version 3: [`DoorbellKicks`] | DEVICE_RESET |
//! | 0x10c | [`LeaseRef`] | `()` | — (return the lease) |
//! | 0x10d | `Status` | [`LenderStatus`] | — |
//! | 0x10e | [`LeaseRef`] (version 3) | [`LeaseCounters`] | — (lender-side counters of the lease) |
//! | 0x10f | [`Quiesce`] (version 3) | `()` | — (pause/resume fetching) |
//! | 0x110 | [`BorrowClaimed`] | [`Borrowed`] (+ notify eventfd on shm) | — (lease fenced by a directory claim) |
//! | 0x111 | [`P2pMap`] (version 5) | `()` | — (map a peer lease's BAR into this lease's IOMMU domain) |
//! | 0x112 | [`P2pUnmap`] (version 5) | `()` | — (undo a [`P2pMap`]) |
//! | 0x113..=0x119 | version 6, peer-to-peer DMA across lenders: see [`p2px`] (grant, revoke, remote map/unmap, lender-to-lender attach/detach) | | — |
//! | 0x120 | [`AuthChallenge`] (before HELLO) | [`AuthResponse`] | — (mutual challenge–response, [`crate::auth`]) |
//! | 0x121..=0x127 | version 4, live migration: see [`migration`] (dirty log, hand-over quiesce, lease transfer) | | — |
//!
//! Events (one-way): lender → borrower 0x180 [`DeviceGone`], 0x181 [`FatalError`], 0x182
//! [`IrqEvent`] (interrupt relay when no eventfd/doorbell can carry it), 0x184
//! [`IommuFaultEvent`] (a DMA the lease's IOMMU domain refused, rate-limited, version 3),
//! 0x185 [`KicksEvent`] (the device's kick-only doorbells changed, version 3), 0x186
//! [`LeaseMoved`] (the lease was transferred to another borrower, version 4); borrower →
//! lender 0x183 [`IrqResample`] (INTx resample when no eventfd can carry it, version 2).
//!
//! AUTH is outside the versioned requests: it precedes HELLO in every session, and HELLO's
//! `token` then carries the borrower's proof instead of the token ([`crate::auth`]). A lender
//! refuses a HELLO with a plain token, and a borrower refuses a lender that does not answer
//! AUTH with a valid proof, so peers from before challenge–response are refused both ways
//! with a clear error.
//!
//! Errors are wire error replies with the codes in [`code`]. Decoding never panics.
//!
//! ## Versions
//!
//! The borrower's HELLO names its version; the lender answers with the version the session
//! speaks, `min(borrower, lender)`, and refuses versions below [`MIN_PROTOCOL_VERSION`].
//! Payloads are positional (postcard), so every message whose layout changed has a frozen
//! copy of its older layout and is encoded/decoded by session version
//! ([`Request::decode_versioned`], [`encode_borrowed`], [`decode_borrowed`], ...):
//!
//! | version | change |
//! |---|---|
//! | 1 | first |
//! | any | 0x10e [`BorrowClaimed`] is a new opcode, not a new layout: a lender that predates it answers `unknown opcode`, so it needs no version |
//! | 2 | [`BarDesc::notify`] (how stores into a direct BAR reach the device, per BAR); [`SetIrqs::resample`] (INTx resample target); the [`IrqResample`] event |
//! | 4 | live migration ([`migration`]): DIRTY_LOG_START/FETCH/STOP, QUIESCE_HANDOVER, TRANSFER_CREATE/CANCEL/ACCEPT (0x121..=0x127) and the [`LeaseMoved`] event (0x186) |
//! | 3 | LEASE_COUNTERS and QUIESCE requests; the [`IommuFaultEvent`] event; [`NotifyWrites::Polled`] (sent as `Doorbells` to older borrowers); BAR_WRITE and RESET replies carry [`DoorbellKicks`]; the [`KicksEvent`] event |
//! | 5 | P2P_MAP and P2P_UNMAP requests (peer-to-peer DMA between two leases of one borrower on this lender) |
//! | 6 | peer-to-peer DMA across lenders ([`p2px`]): P2P_GRANT/REVOKE, P2P_MAP_REMOTE/UNMAP_REMOTE, lender-to-lender P2P_ATTACH/DETACH (0x113..=0x118) |
//! | 7 | [`LeaseCounters`] carries the device model's `commands`, `invalid_doorbells` and `bad_prps` (older sessions get the version 3 layout, [`encode_lease_counters`]) |
//! | 8 | [`DeviceState::Releasing`] in LIST and STATUS replies (a new enum variant, which an older decoder refuses: older sessions get `Resetting` instead, [`devices_for_version`], [`status_for_version`]) |
//!
//! New requests of a version are unknown opcodes in a session of an older version (both
//! ways: the lender answers `UNKNOWN_OPCODE`, and [`Request::encode_versioned`] refuses to
//! encode them), and a lender sends new events only in sessions of their version, so an
//! older borrower never sees them.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use ntb::wire::{self, ErrorReply, WireError};

pub mod migration;
pub mod p2px;

pub use migration::{
    AcceptMap, DirtyBitmap, DirtyLogFetch, DirtyLogStarted, HandoverQuiesced, LeaseMoved,
    QuiesceHandover, TransferAccept, TransferCreate, TransferTicket,
};
pub use p2px::{
    P2pAttach, P2pAttached, P2pDetach, P2pGrant, P2pGranted, P2pMapGranted, P2pMapRemote,
    P2pRevoke, P2pUnmapRemote, P2PX_VERSION,
};

/// Version of this protocol (independent of the wire version).
pub const PROTOCOL_VERSION: u32 = 8;
/// The version whose LIST and STATUS replies may carry [`DeviceState::Releasing`].
pub const RELEASING_STATE_VERSION: u32 = 8;
/// The version whose [`LeaseCounters`] carries the device model's command counters.
pub const MODEL_COUNTERS_VERSION: u32 = 7;
/// The version that introduced P2P_MAP/P2P_UNMAP.
pub const P2P_VERSION: u32 = 5;
/// Oldest version a lender still serves.
pub const MIN_PROTOCOL_VERSION: u32 = 1;
/// Largest config space (PCIe extended).
pub const CONFIG_SPACE_SIZE: usize = 4096;
/// Largest single BAR slow-path access.
pub const MAX_BAR_ACCESS: usize = 4096;
/// Most interrupt targets in one SET_IRQS.
pub const MAX_IRQS: usize = 2048;
/// Longest string field (tokens, names, reasons).
pub const MAX_STRING: usize = 1024;

/// Opcodes (all at or above [`ntb::wire::USER_OPCODE_BASE`]).
pub mod opcode {
    /// Hello/version/token.
    pub const HELLO: u16 = 0x100;
    /// List devices.
    pub const LIST: u16 = 0x101;
    /// Borrow a device.
    pub const BORROW: u16 = 0x102;
    /// Device information.
    pub const DEVICE_INFO: u16 = 0x103;
    /// Config space read.
    pub const CONFIG_READ: u16 = 0x104;
    /// Config space write.
    pub const CONFIG_WRITE: u16 = 0x105;
    /// BAR slow-path read.
    pub const BAR_READ: u16 = 0x106;
    /// BAR slow-path write.
    pub const BAR_WRITE: u16 = 0x107;
    /// Map a DMA window.
    pub const DMA_MAP: u16 = 0x108;
    /// Unmap a DMA window.
    pub const DMA_UNMAP: u16 = 0x109;
    /// Set interrupt targets.
    pub const SET_IRQS: u16 = 0x10a;
    /// Reset the device.
    pub const RESET: u16 = 0x10b;
    /// Return the lease.
    pub const RETURN: u16 = 0x10c;
    /// Lender inventory with states.
    pub const STATUS: u16 = 0x10d;
    /// Lender-side counters of a lease (version 3).
    pub const LEASE_COUNTERS: u16 = 0x10e;
    /// Quiesce or resume the device (version 3).
    pub const QUIESCE: u16 = 0x10f;
    /// Borrow a device under a cluster-directory claim (fencing token).
    pub const BORROW_CLAIMED: u16 = 0x110;
    /// Map a peer lease's BAR into a lease's IOMMU domain (version 5).
    pub const P2P_MAP: u16 = 0x111;
    /// Undo a P2P_MAP (version 5).
    pub const P2P_UNMAP: u16 = 0x112;
    /// Mutual authentication challenge (before HELLO, any version).
    pub const AUTH: u16 = 0x120;
    /// Event: the device is gone (lease ended by the lender).
    pub const EVT_DEVICE_GONE: u16 = 0x180;
    /// Event: fatal device error.
    pub const EVT_FATAL: u16 = 0x181;
    /// Event: interrupt relayed as a message.
    pub const EVT_IRQ: u16 = 0x182;
    /// Event (borrower → lender): INTx resample relayed as a message.
    pub const EVT_RESAMPLE: u16 = 0x183;
    /// Event: the lease's IOMMU domain refused a DMA (version 3).
    pub const EVT_IOMMU_FAULT: u16 = 0x184;
    /// Event: the device's kick-only doorbells changed (version 3).
    pub const EVT_KICKS: u16 = 0x185;
}

/// Error codes of error replies (the wire's generic codes are below 0x100).
pub mod code {
    pub use ntb::wire::code::*;
    /// Hello missing or token wrong.
    pub const BAD_TOKEN: u32 = 0x100;
    /// No such device in the inventory.
    pub const UNKNOWN_DEVICE: u32 = 0x101;
    /// The device is lent to someone else.
    pub const DEVICE_BUSY: u32 = 0x102;
    /// No such lease on this link.
    pub const UNKNOWN_LEASE: u32 = 0x103;
    /// The borrower may not touch this (config filter).
    pub const FORBIDDEN: u32 = 0x104;
    /// IOMMU refused a mapping.
    pub const IOMMU: u32 = 0x105;
    /// The device is resetting or failed.
    pub const DEVICE_UNAVAILABLE: u32 = 0x106;
    /// Hello not yet done.
    pub const NO_HELLO: u32 = 0x107;
    /// This lender lends only under a directory claim ([`super::BorrowClaimed`]).
    pub const CLAIM_REQUIRED: u32 = 0x108;
    /// The claim presented is not the device's current claim (expired, released, or
    /// someone else's): the fencing token is stale.
    pub const STALE_CLAIM: u32 = 0x109;
}

/// Errors of encoding/decoding protocol messages.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ProtocolError {
    /// Opcode not part of the protocol.
    #[error("unknown opcode {0:#x}")]
    UnknownOpcode(u16),
    /// The payload does not decode.
    #[error("opcode {opcode:#x}: {source}")]
    Wire {
        /// Opcode of the message.
        opcode: u16,
        /// Wire error.
        source: WireError,
    },
    /// A field is out of its allowed range.
    #[error("opcode {opcode:#x}: {msg}")]
    Invalid {
        /// Opcode of the message.
        opcode: u16,
        /// What is wrong.
        msg: String,
    },
}

/// First request of a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the borrower.
    pub version: u32,
    /// Cluster auth token.
    pub token: String,
    /// Free-form client name for logs (`lendvm`, `lendctl`).
    pub client: String,
}

/// AUTH: the borrower's challenge (first request of a session).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthChallenge {
    /// The borrower's fresh nonce ([`crate::auth::NONCE_LEN`] bytes).
    pub nonce: Vec<u8>,
}

/// Reply to [`AuthChallenge`]: the lender's nonce and its proof of the cluster token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthResponse {
    /// Lender node name (must be the fabric peer's).
    pub node: String,
    /// The lender's fresh nonce ([`crate::auth::NONCE_LEN`] bytes).
    pub nonce: Vec<u8>,
    /// `HMAC-SHA256(token, lender transcript)` ([`crate::auth::Transcript`]).
    pub proof: Vec<u8>,
}

/// Reply to [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloReply {
    /// Lender's protocol version.
    pub version: u32,
    /// Lender node name.
    pub node: String,
    /// Largest BAR slow-path access.
    pub max_bar_access: u32,
    /// Most DMA mappings per lease.
    pub max_dma_maps: u32,
}

/// State of a device in the inventory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceState {
    /// Can be borrowed.
    Available,
    /// Lent to `node/vm`.
    Lent {
        /// Borrower node.
        node: String,
        /// Borrower VM.
        vm: String,
    },
    /// Being reset after a lease ended. A lender of version 8 or later says
    /// [`DeviceState::Releasing`] instead; older lenders, and newer ones to older sessions,
    /// say this.
    Resetting,
    /// Unusable.
    Failed {
        /// Why.
        reason: String,
    },
    /// The lease of `node/vm` is being taken back: from the moment the lender ends it
    /// (RETURN, the borrower's link found down, its claim gone) until the device is
    /// unmapped, reset and available again (version 8; last, so that the older variants keep
    /// their positions on the wire).
    Releasing {
        /// The borrower node that held it.
        node: String,
        /// The borrower VM that held it.
        vm: String,
    },
}

impl DeviceState {
    /// The state as a session of protocol `version` may carry it: before
    /// [`RELEASING_STATE_VERSION`] a releasing device is `Resetting` (not available, as
    /// there), since an older decoder refuses the unknown variant and with it the whole
    /// reply.
    pub fn for_version(self, version: u32) -> DeviceState {
        match self {
            DeviceState::Releasing { .. } if version < RELEASING_STATE_VERSION => {
                DeviceState::Resetting
            }
            other => other,
        }
    }
}

impl std::fmt::Display for DeviceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceState::Available => f.write_str("available"),
            DeviceState::Lent { node, vm } => write!(f, "lent to {node}/{vm}"),
            DeviceState::Resetting => f.write_str("resetting"),
            DeviceState::Failed { reason } => write!(f, "failed: {reason}"),
            DeviceState::Releasing { node, vm } => {
                write!(f, "releasing (was lent to {node}/{vm})")
            }
        }
    }
}

/// One device as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceSummary {
    /// Device id (a PCI address like `0000:81:00.0`).
    pub id: String,
    /// Backend kind: `vfio`, `nvme`, `dmatest`.
    pub kind: String,
    /// PCI vendor id.
    pub vendor_id: u16,
    /// PCI device id.
    pub device_id: u16,
    /// Class code (base, sub, prog-if) as 0xBBSSPP.
    pub class: u32,
    /// Current state.
    pub state: DeviceState,
}

/// Lender status (for `lendctl status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LenderStatus {
    /// Lender node.
    pub node: String,
    /// Seconds since lenderd started.
    pub uptime_secs: u64,
    /// Devices with details.
    pub devices: Vec<DeviceStatus>,
}

/// Per-device status details.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStatus {
    /// Summary (id, kind, state).
    pub summary: DeviceSummary,
    /// Live DMA mappings (iova, size).
    pub dma_maps: Vec<(u64, u64)>,
    /// IOMMU faults counted since lenderd started.
    pub iommu_faults: u64,
    /// Leases granted since lenderd started.
    pub leases_granted: u64,
}

/// Borrow request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Borrow {
    /// Device id.
    pub device: String,
    /// Borrowing VM's name.
    pub vm: String,
}

/// Borrow request under a cluster-directory claim (`lending::directory`): the lender lends
/// only if `claim` is the revision of the device's current claim and the claim names this
/// borrower; the revision is the fencing token that keeps a borrower whose claim expired
/// from using the device again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BorrowClaimed {
    /// Device id.
    pub device: String,
    /// Borrowing VM's name.
    pub vm: String,
    /// The claim's revision in the directory (etcd `create_revision` of the claim key).
    pub claim: i64,
}

/// Reference to a lease of this link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRef {
    /// Lease id from [`Borrowed`].
    pub lease: u64,
}

/// How stores into a directly mapped BAR reach the device (version 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NotifyWrites {
    /// The device sees stores by itself (real device memory, polling models): map the window
    /// read-write; nothing to signal.
    None,
    /// Every store: store it into the window, then signal the lease's notify eventfd. What a
    /// version 1 borrower does with every direct BAR of a lease that has a notify eventfd;
    /// a version 2 lender never asks for it (it loses writes to control registers that do not
    /// change the stored value).
    All,
    /// Stores entirely inside `[offset, offset + len)` are doorbells (absolute values):
    /// store + notify is exact. Every other store must be sent as BAR_WRITE, the device's
    /// exact write path. `len` 0: every store is a BAR_WRITE.
    Doorbells {
        /// First byte of the doorbell range within the BAR.
        offset: u64,
        /// Length of the range.
        len: u64,
    },
    /// Version 3: as `Doorbells`, but the device polls the doorbell range, so the borrower
    /// may map the pages inside it read-write (stores reach the device with no exit and no
    /// notify). Sent as `Doorbells` to older borrowers (store + notify is also right).
    Polled {
        /// First byte of the doorbell range within the BAR.
        offset: u64,
        /// Length of the range.
        len: u64,
    },
}

impl NotifyWrites {
    /// True when a store of `len` bytes at `offset` may be stored into the window directly
    /// (followed by a notify for [`NotifyWrites::All`] and doorbells); false when it must be
    /// a BAR_WRITE.
    pub fn is_doorbell(&self, offset: u64, len: u64) -> bool {
        match *self {
            NotifyWrites::None | NotifyWrites::All => true,
            NotifyWrites::Doorbells { offset: o, len: l }
            | NotifyWrites::Polled { offset: o, len: l } => {
                offset >= o
                    && offset
                        .checked_add(len)
                        .is_some_and(|end| end <= o.saturating_add(l))
            }
        }
    }
}

/// BAR description.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BarDesc {
    /// BAR index (0..=5).
    pub index: u8,
    /// Size in bytes.
    pub size: u64,
    /// 64-bit memory BAR.
    pub is_64bit: bool,
    /// Prefetchable.
    pub prefetchable: bool,
    /// I/O space BAR.
    pub io: bool,
    /// Fabric window (exported by the lender on this link) that maps the BAR directly, if any;
    /// otherwise use BAR_READ/BAR_WRITE.
    pub window: Option<u32>,
    /// The borrower's VMM emulates this BAR itself (MSI-X table/PBA).
    pub emulated_by_borrower: bool,
    /// How stores into the BAR's window reach the device (meaningful with a `window`).
    /// Version 1 sessions do not carry it: a version 1 borrower treats every window as
    /// [`NotifyWrites::All`] when the lease has a notify eventfd, else [`NotifyWrites::None`].
    pub notify: NotifyWrites,
}

/// [`BarDesc`] as version 1 encodes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct BarDescV1 {
    index: u8,
    size: u64,
    is_64bit: bool,
    prefetchable: bool,
    io: bool,
    window: Option<u32>,
    emulated_by_borrower: bool,
}

impl BarDescV1 {
    fn from_v2(b: &BarDesc) -> Self {
        BarDescV1 {
            index: b.index,
            size: b.size,
            is_64bit: b.is_64bit,
            prefetchable: b.prefetchable,
            io: b.io,
            window: b.window,
            emulated_by_borrower: b.emulated_by_borrower,
        }
    }

    /// The version 1 meaning: every window is write-notified iff the lease has a notify fd.
    fn into_v2(self, has_notify: bool) -> BarDesc {
        let notify = if has_notify && self.window.is_some() {
            NotifyWrites::All
        } else {
            NotifyWrites::None
        };
        BarDesc {
            index: self.index,
            size: self.size,
            is_64bit: self.is_64bit,
            prefetchable: self.prefetchable,
            io: self.io,
            window: self.window,
            emulated_by_borrower: self.emulated_by_borrower,
            notify,
        }
    }
}

/// A capability found in config space.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapDesc {
    /// Capability id.
    pub id: u16,
    /// Offset in config space.
    pub offset: u16,
    /// PCIe extended capability (offset ≥ 0x100).
    pub extended: bool,
}

/// Interrupt counts (like GET_IRQ_INFO per index).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct IrqCounts {
    /// 1 when an INTx pin is wired.
    pub intx: u32,
    /// MSI vectors.
    pub msi: u32,
    /// MSI-X vectors.
    pub msix: u32,
}

/// MSI-X table placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MsixDesc {
    /// Vectors.
    pub vectors: u16,
    /// Table BAR.
    pub table_bar: u8,
    /// Table offset.
    pub table_offset: u32,
    /// PBA BAR.
    pub pba_bar: u8,
    /// PBA offset.
    pub pba_offset: u32,
}

/// Everything a borrower needs to present the device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// Device id.
    pub id: String,
    /// Backend kind.
    pub kind: String,
    /// Config space snapshot (256 or 4096 bytes).
    pub config: Vec<u8>,
    /// BARs.
    pub bars: Vec<BarDesc>,
    /// Capabilities.
    pub caps: Vec<CapDesc>,
    /// Interrupt counts.
    pub irqs: IrqCounts,
    /// MSI-X placement.
    pub msix: Option<MsixDesc>,
}

/// [`DeviceInfo`] as version 1 encodes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct DeviceInfoV1 {
    id: String,
    kind: String,
    config: Vec<u8>,
    bars: Vec<BarDescV1>,
    caps: Vec<CapDesc>,
    irqs: IrqCounts,
    msix: Option<MsixDesc>,
}

impl DeviceInfoV1 {
    fn from_v2(i: &DeviceInfo) -> Self {
        DeviceInfoV1 {
            id: i.id.clone(),
            kind: i.kind.clone(),
            config: i.config.clone(),
            bars: i.bars.iter().map(BarDescV1::from_v2).collect(),
            caps: i.caps.clone(),
            irqs: i.irqs,
            msix: i.msix,
        }
    }

    fn into_v2(self, has_notify: bool) -> DeviceInfo {
        DeviceInfo {
            id: self.id,
            kind: self.kind,
            config: self.config,
            bars: self
                .bars
                .into_iter()
                .map(|b| b.into_v2(has_notify))
                .collect(),
            caps: self.caps,
            irqs: self.irqs,
            msix: self.msix,
        }
    }
}

/// [`Borrowed`] as version 1 encodes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct BorrowedV1 {
    lease: u64,
    info: DeviceInfoV1,
    notify_fd: Option<u8>,
    notify_doorbell: Option<u8>,
}

/// Reply to [`Borrow`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Borrowed {
    /// Lease id for the other requests.
    pub lease: u64,
    /// Device information.
    pub info: DeviceInfo,
    /// Index of the attached notification eventfd (shm): signal it after storing into a
    /// directly mapped BAR (or hand it to KVM as an ioeventfd).
    pub notify_fd: Option<u8>,
    /// Fabric doorbell bit that notifies the device (fabrics without fd passing).
    pub notify_doorbell: Option<u8>,
}

/// Config read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigRead {
    /// Lease.
    pub lease: u64,
    /// Offset.
    pub offset: u16,
    /// Length (1..=4096).
    pub len: u16,
}

/// Config write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigWrite {
    /// Lease.
    pub lease: u64,
    /// Offset.
    pub offset: u16,
    /// Bytes.
    pub data: Vec<u8>,
}

/// BAR read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BarRead {
    /// Lease.
    pub lease: u64,
    /// BAR index.
    pub bar: u8,
    /// Offset.
    pub offset: u64,
    /// Length (1..=[`MAX_BAR_ACCESS`]).
    pub len: u32,
}

/// BAR write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BarWrite {
    /// Lease.
    pub lease: u64,
    /// BAR index.
    pub bar: u8,
    /// Offset.
    pub offset: u64,
    /// Bytes.
    pub data: Vec<u8>,
}

/// Map a fabric window the borrower exported on this link at `iova`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DmaMap {
    /// Lease.
    pub lease: u64,
    /// IOVA (= guest-physical base of the window).
    pub iova: u64,
    /// Bytes (≤ window size).
    pub size: u64,
    /// Fabric window id (exported by the borrower).
    pub window: u32,
}

/// Unmap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DmaUnmap {
    /// Lease.
    pub lease: u64,
    /// IOVA.
    pub iova: u64,
    /// Bytes.
    pub size: u64,
}

/// P2P_MAP (version 5): make BAR `bar` of lease `target`, placed by the borrower at
/// guest-physical address `iova`, reachable by DMA of lease `source`'s device at the same
/// addresses (so the guest driver's bus address is the device address). What is mapped is
/// the part of the BAR the target device exposes to peers as plain memory (the emulated
/// dmatest: its buffer, BAR0 + 0x1000..0x10000; a VFIO device: the whole BAR), at `iova` +
/// its offset in the BAR; registers are never reachable by a peer.
/// Both leases must be held by the same borrower node and VM on this lender (any of that
/// borrower's sessions); the BAR must be device memory the lender can map (not I/O, not a
/// BAR the borrower emulates). Errors: `UNKNOWN_LEASE` (either lease unknown or not the
/// caller's), `OUT_OF_RANGE` (no such BAR), `INVALID` (source = target; not a memory BAR or
/// no peer memory in it; an IOVA that is not page aligned, wraps, or overlaps a RAM window
/// or another P2P mapping of the domain; already mapped), `IOMMU` (the domain cannot map the
/// memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct P2pMap {
    /// Lease whose device does the DMA (the request's lease: it must be on this session).
    pub source: u64,
    /// Lease whose BAR is the DMA target.
    pub target: u64,
    /// BAR index of the target.
    pub bar: u8,
    /// IOVA in the source's domain (the BAR's guest-physical address).
    pub iova: u64,
}

/// P2P_UNMAP (version 5): undo the [`P2pMap`] of (`source`, `target`, `bar`). Unmapping a
/// mapping the lender already revoked (target reset, returned or lost) succeeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct P2pUnmap {
    /// Lease whose domain holds the mapping.
    pub source: u64,
    /// Lease whose BAR it maps.
    pub target: u64,
    /// BAR index of the target.
    pub bar: u8,
}

/// Interrupt kind (the vfio-pci IRQ indexes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum IrqKind {
    /// Legacy INTx.
    Intx,
    /// MSI.
    Msi,
    /// MSI-X.
    Msix,
}

/// Where one vector goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum IrqTarget {
    /// Not wired (masked at the source).
    None,
    /// Signal the `n`th eventfd attached to the message (shm).
    Fd(u8),
    /// Ring this doorbell bit of the borrower (any fabric).
    Doorbell(u8),
    /// Send an [`IrqEvent`] message (slow, any fabric).
    Event,
}

/// SET_IRQS: replaces the targets of `kind`; an empty list disables the kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetIrqs {
    /// Lease.
    pub lease: u64,
    /// Kind.
    pub kind: IrqKind,
    /// One target per vector, from vector 0.
    pub targets: Vec<IrqTarget>,
    /// INTx only (version 2): where the borrower signals the resample after the guest's EOI
    /// (its interrupt controller lowered the level-triggered line), so the lender re-checks
    /// the device's interrupt condition and asserts again if it is still pending.
    /// [`IrqTarget::Fd`]: an attached eventfd the lender watches (shm);
    /// [`IrqTarget::Event`]: the borrower sends [`IrqResample`] events; [`IrqTarget::None`]:
    /// no resample. [`IrqTarget::Doorbell`] is refused.
    pub resample: IrqTarget,
}

/// [`SetIrqs`] as version 1 encodes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SetIrqsV1 {
    lease: u64,
    kind: IrqKind,
    targets: Vec<IrqTarget>,
}

/// Event: lease ended by the lender.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceGone {
    /// Lease.
    pub lease: u64,
    /// Why.
    pub reason: String,
}

/// Event: fatal device error (the lease stays until returned).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FatalError {
    /// Lease.
    pub lease: u64,
    /// What happened.
    pub message: String,
}

/// Event: an interrupt relayed as a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IrqEvent {
    /// Lease.
    pub lease: u64,
    /// Kind.
    pub kind: IrqKind,
    /// Vector.
    pub vector: u32,
}

/// The doorbells of a device whose written value it does not need (it reads shadow
/// doorbells from memory): a store there is only a kick, which a borrower may turn into a
/// KVM ioeventfd on the lease's notify eventfd (version 3). `generation` grows with every
/// change; a borrower keeps the newest it has seen (from replies and events), so a late
/// event never undoes a newer reply. Empty `offsets`: every doorbell needs its value.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DoorbellKicks {
    /// Increases with every change.
    pub generation: u64,
    /// BAR the offsets are in.
    pub bar: u8,
    /// Offsets of kick-only 4-byte doorbells.
    pub offsets: Vec<u64>,
}

/// Most kick-only doorbells in one [`DoorbellKicks`].
pub const MAX_KICKS: usize = 256;

impl DoorbellKicks {
    fn check(&self, op: u16) -> Result<(), ProtocolError> {
        if self.bar > 5 || self.offsets.len() > MAX_KICKS {
            return Err(invalid(
                op,
                format!(
                    "kick-only doorbells: bar {} with {} offsets (bar 0..=5, at most {MAX_KICKS})",
                    self.bar,
                    self.offsets.len()
                ),
            ));
        }
        Ok(())
    }

    /// The newer of `self` and `other` (by generation).
    pub fn newest(self, other: DoorbellKicks) -> DoorbellKicks {
        if other.generation > self.generation {
            other
        } else {
            self
        }
    }
}

/// Decodes a BAR_WRITE or RESET reply sent in the layout of `version`: the device's
/// kick-only doorbells from version 3 on, `None` before.
pub fn decode_kicks_reply(
    op: u16,
    payload: &[u8],
    version: u32,
) -> Result<Option<DoorbellKicks>, ProtocolError> {
    if version < 3 {
        let () = dec(op, payload)?;
        return Ok(None);
    }
    let k: DoorbellKicks = dec(op, payload)?;
    k.check(op)?;
    Ok(Some(k))
}

/// Encodes a BAR_WRITE or RESET reply in the layout of `version`.
pub fn encode_kicks_reply(
    op: u16,
    kicks: &DoorbellKicks,
    version: u32,
) -> Result<Vec<u8>, ProtocolError> {
    if version < 3 {
        return enc(op, &());
    }
    enc(op, kicks)
}

/// Event (lender → borrower, version 3): the lease's kick-only doorbells changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KicksEvent {
    /// Lease.
    pub lease: u64,
    /// The new state.
    pub kicks: DoorbellKicks,
}

/// Event (borrower → lender, version 2): the guest EOIed the device's INTx.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IrqResample {
    /// Lease.
    pub lease: u64,
}

/// Reply to LEASE_COUNTERS (version 3): what the lender counted for the lease since it was
/// granted.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LeaseCounters {
    /// Bytes the device read from the borrower's memory through its IOMMU domain (0 where
    /// the domain cannot count: VFIO).
    pub dma_bytes_read: u64,
    /// Bytes the device wrote to the borrower's memory (0 where the domain cannot count).
    pub dma_bytes_written: u64,
    /// DMAs the IOMMU domain refused.
    pub iommu_faults: u64,
    /// Doorbell notifications the device read (the sum of the values read from its notify
    /// eventfd: every store + notify, ioeventfd kick or exact doorbell write; 0 where the
    /// lender does not see them: VFIO).
    pub doorbell_kicks: u64,
    /// Interrupts the lender signalled, per MSI-X vector from 0 (whatever the target kind;
    /// empty where the lender does not signal them itself: VFIO).
    pub msix: Vec<u64>,
    /// INTx assertions the lender signalled.
    pub intx: u64,
    /// Commands the device model fetched (0 where it does not count them: VFIO, dmatest).
    /// Version 7.
    pub commands: u64,
    /// Doorbell writes the model refused for a value outside the queue (NVMe). Version 7.
    pub invalid_doorbells: u64,
    /// Commands the model refused for their PRPs (NVMe). Version 7.
    pub bad_prps: u64,
}

/// [`LeaseCounters`] in versions 3..=6.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct LeaseCountersV3 {
    dma_bytes_read: u64,
    dma_bytes_written: u64,
    iommu_faults: u64,
    doorbell_kicks: u64,
    msix: Vec<u64>,
    intx: u64,
}

/// Encodes a LEASE_COUNTERS reply in the layout of protocol `version`.
pub fn encode_lease_counters(c: &LeaseCounters, version: u32) -> Result<Vec<u8>, ProtocolError> {
    let op = opcode::LEASE_COUNTERS;
    if version < MODEL_COUNTERS_VERSION {
        let v3 = LeaseCountersV3 {
            dma_bytes_read: c.dma_bytes_read,
            dma_bytes_written: c.dma_bytes_written,
            iommu_faults: c.iommu_faults,
            doorbell_kicks: c.doorbell_kicks,
            msix: c.msix.clone(),
            intx: c.intx,
        };
        return enc(op, &v3);
    }
    enc(op, c)
}

/// Decodes a LEASE_COUNTERS reply sent in the layout of protocol `version` (the model's
/// counters are 0 before version 7).
pub fn decode_lease_counters(payload: &[u8], version: u32) -> Result<LeaseCounters, ProtocolError> {
    let op = opcode::LEASE_COUNTERS;
    if version < MODEL_COUNTERS_VERSION {
        let v3: LeaseCountersV3 = dec(op, payload)?;
        return Ok(LeaseCounters {
            dma_bytes_read: v3.dma_bytes_read,
            dma_bytes_written: v3.dma_bytes_written,
            iommu_faults: v3.iommu_faults,
            doorbell_kicks: v3.doorbell_kicks,
            msix: v3.msix,
            intx: v3.intx,
            ..LeaseCounters::default()
        });
    }
    dec(op, payload)
}

impl LeaseCounters {
    /// The counts since `base` (a snapshot of the same monotonic counters), saturating.
    pub fn since(&self, base: &LeaseCounters) -> LeaseCounters {
        LeaseCounters {
            dma_bytes_read: self.dma_bytes_read.saturating_sub(base.dma_bytes_read),
            dma_bytes_written: self
                .dma_bytes_written
                .saturating_sub(base.dma_bytes_written),
            iommu_faults: self.iommu_faults.saturating_sub(base.iommu_faults),
            doorbell_kicks: self.doorbell_kicks.saturating_sub(base.doorbell_kicks),
            msix: self
                .msix
                .iter()
                .enumerate()
                .map(|(i, n)| n.saturating_sub(base.msix.get(i).copied().unwrap_or(0)))
                .collect(),
            intx: self.intx.saturating_sub(base.intx),
            commands: self.commands.saturating_sub(base.commands),
            invalid_doorbells: self
                .invalid_doorbells
                .saturating_sub(base.invalid_doorbells),
            bad_prps: self.bad_prps.saturating_sub(base.bad_prps),
        }
    }
}

/// QUIESCE (version 3): `stop` true makes the device stop fetching doorbells and descriptors
/// (emulated devices: their worker stops between passes; commands already fetched complete
/// and their completions are posted after resume); false resumes it. A reset or the end of
/// the lease resumes it too. Devices the lender cannot quiesce (VFIO) accept it as a no-op:
/// the borrower masks their vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quiesce {
    /// Lease.
    pub lease: u64,
    /// Stop (true) or resume (false).
    pub stop: bool,
}

/// Event (version 3): the lease's IOMMU domain refused a DMA of the device.
///
/// Rate-limited by the lender per lease: the first [`IOMMU_FAULT_BURST`] faults are each
/// sent, then at most one per [`IOMMU_FAULT_INTERVAL_MS`] (the others are counted only);
/// `total` is always the exact number of the lease's faults so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IommuFaultEvent {
    /// Lease.
    pub lease: u64,
    /// Start IOVA of the refused access.
    pub iova: u64,
    /// Its length.
    pub len: u64,
    /// The device tried to write memory.
    pub write: bool,
    /// Faults of the lease so far, this one included.
    pub total: u64,
}

/// Faults of a lease that are each reported by an [`IommuFaultEvent`] before rate limiting.
pub const IOMMU_FAULT_BURST: u64 = 16;
/// After the burst, at most one [`IommuFaultEvent`] per this many milliseconds per lease.
pub const IOMMU_FAULT_INTERVAL_MS: u64 = 250;

/// A request, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Hello.
    Hello(Hello),
    /// List.
    List,
    /// Borrow.
    Borrow(Borrow),
    /// Device info.
    DeviceInfo(LeaseRef),
    /// Config read.
    ConfigRead(ConfigRead),
    /// Config write.
    ConfigWrite(ConfigWrite),
    /// BAR read.
    BarRead(BarRead),
    /// BAR write.
    BarWrite(BarWrite),
    /// DMA map.
    DmaMap(DmaMap),
    /// DMA unmap.
    DmaUnmap(DmaUnmap),
    /// Set IRQs.
    SetIrqs(SetIrqs),
    /// Reset.
    Reset(LeaseRef),
    /// Return.
    Return(LeaseRef),
    /// Status.
    Status,
    /// Lender-side counters of a lease (version 3).
    LeaseCounters(LeaseRef),
    /// Quiesce/resume (version 3).
    Quiesce(Quiesce),
    /// Borrow under a directory claim.
    BorrowClaimed(BorrowClaimed),
    /// Start the device dirty log (version 4).
    DirtyLogStart(LeaseRef),
    /// Fetch and clear the device dirty log (version 4).
    DirtyLogFetch(DirtyLogFetch),
    /// Stop the device dirty log (version 4).
    DirtyLogStop(LeaseRef),
    /// Quiesce for a hand-over (version 4).
    QuiesceHandover(QuiesceHandover),
    /// Create a transfer ticket (version 4).
    TransferCreate(TransferCreate),
    /// Cancel the lease's transfer ticket (version 4).
    TransferCancel(LeaseRef),
    /// Take a lease by its ticket (version 4).
    TransferAccept(TransferAccept),
    /// Peer-to-peer map (version 5).
    P2pMap(P2pMap),
    /// Peer-to-peer unmap (version 5).
    P2pUnmap(P2pUnmap),
    /// Grant a lender access to a lease's peer memory (version 6).
    P2pGrant(P2pGrant),
    /// Withdraw a grant (version 6).
    P2pRevoke(P2pRevoke),
    /// Map a peer's memory on another lender (version 6).
    P2pMapRemote(P2pMapRemote),
    /// Undo a remote map (version 6).
    P2pUnmapRemote(P2pUnmapRemote),
    /// Lender to lender: attach a grant (version 6).
    P2pAttach(P2pAttach),
    /// Lender to lender: detach a grant (version 6).
    P2pDetach(P2pDetach),
    /// Same-lender map with the target's capability (version 6).
    P2pMapGranted(P2pMapGranted),
}

/// An event, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Device gone.
    DeviceGone(DeviceGone),
    /// Fatal error.
    Fatal(FatalError),
    /// Relayed interrupt.
    Irq(IrqEvent),
    /// Relayed INTx resample (borrower → lender).
    Resample(IrqResample),
    /// A refused DMA (version 3).
    IommuFault(IommuFaultEvent),
    /// Kick-only doorbells changed (version 3).
    Kicks(KicksEvent),
    /// The lease moved to another borrower (version 4): not a lost device.
    LeaseMoved(LeaseMoved),
}

fn wire_err(opcode: u16) -> impl FnOnce(WireError) -> ProtocolError {
    move |source| ProtocolError::Wire { opcode, source }
}

fn invalid(opcode: u16, msg: String) -> ProtocolError {
    ProtocolError::Invalid { opcode, msg }
}

fn check_str(opcode: u16, what: &str, s: &str) -> Result<(), ProtocolError> {
    if s.len() > MAX_STRING {
        return Err(invalid(
            opcode,
            format!("{what} is {} bytes, at most {MAX_STRING} allowed", s.len()),
        ));
    }
    Ok(())
}

fn dec<T: serde::de::DeserializeOwned>(opcode: u16, payload: &[u8]) -> Result<T, ProtocolError> {
    wire::decode_payload(payload).map_err(wire_err(opcode))
}

fn enc<T: Serialize + ?Sized>(opcode: u16, v: &T) -> Result<Vec<u8>, ProtocolError> {
    wire::encode_payload(v).map_err(wire_err(opcode))
}

impl Request {
    /// The opcode of this request.
    pub fn opcode(&self) -> u16 {
        match self {
            Request::Hello(_) => opcode::HELLO,
            Request::List => opcode::LIST,
            Request::Borrow(_) => opcode::BORROW,
            Request::DeviceInfo(_) => opcode::DEVICE_INFO,
            Request::ConfigRead(_) => opcode::CONFIG_READ,
            Request::ConfigWrite(_) => opcode::CONFIG_WRITE,
            Request::BarRead(_) => opcode::BAR_READ,
            Request::BarWrite(_) => opcode::BAR_WRITE,
            Request::DmaMap(_) => opcode::DMA_MAP,
            Request::DmaUnmap(_) => opcode::DMA_UNMAP,
            Request::SetIrqs(_) => opcode::SET_IRQS,
            Request::Reset(_) => opcode::RESET,
            Request::Return(_) => opcode::RETURN,
            Request::Status => opcode::STATUS,
            Request::LeaseCounters(_) => opcode::LEASE_COUNTERS,
            Request::Quiesce(_) => opcode::QUIESCE,
            Request::BorrowClaimed(_) => opcode::BORROW_CLAIMED,
            Request::P2pMap(_) => opcode::P2P_MAP,
            Request::P2pUnmap(_) => opcode::P2P_UNMAP,
            other => migration::opcode_of(other)
                .or_else(|| p2px::opcode_of(other))
                .unwrap_or(0),
        }
    }

    /// The lease a request refers to, if any.
    pub fn lease(&self) -> Option<u64> {
        match self {
            Request::DeviceInfo(l)
            | Request::Reset(l)
            | Request::Return(l)
            | Request::LeaseCounters(l) => Some(l.lease),
            Request::Quiesce(q) => Some(q.lease),
            Request::ConfigRead(r) => Some(r.lease),
            Request::ConfigWrite(r) => Some(r.lease),
            Request::BarRead(r) => Some(r.lease),
            Request::BarWrite(r) => Some(r.lease),
            Request::DmaMap(r) => Some(r.lease),
            Request::DmaUnmap(r) => Some(r.lease),
            Request::SetIrqs(r) => Some(r.lease),
            Request::P2pMap(r) => Some(r.source),
            Request::P2pUnmap(r) => Some(r.source),
            Request::Hello(_)
            | Request::List
            | Request::Borrow(_)
            | Request::Status
            | Request::BorrowClaimed(_) => None,
            other => migration::lease_of(other).or_else(|| p2px::lease_of(other)),
        }
    }

    /// Encodes to (opcode, payload) in the current version.
    pub fn encode(&self) -> Result<(u16, Vec<u8>), ProtocolError> {
        self.encode_versioned(PROTOCOL_VERSION)
    }

    /// Encodes to (opcode, payload) in the layout of protocol `version`. Version 1 has no
    /// resample target: a SET_IRQS with one is refused rather than silently dropped. Requests
    /// newer than `version` are refused.
    pub fn encode_versioned(&self, version: u32) -> Result<(u16, Vec<u8>), ProtocolError> {
        let op = self.opcode();
        let since = Self::since_version(op);
        if version < since {
            return Err(invalid(
                op,
                format!("request needs protocol version {since}, the session speaks {version}"),
            ));
        }
        if version < 2 {
            if let Request::SetIrqs(v) = self {
                if v.resample != IrqTarget::None {
                    return Err(invalid(
                        op,
                        "an intx resample target needs protocol version 2".into(),
                    ));
                }
                let v1 = SetIrqsV1 {
                    lease: v.lease,
                    kind: v.kind,
                    targets: v.targets.clone(),
                };
                return Ok((op, enc(op, &v1)?));
            }
        }
        let payload = match self {
            Request::Hello(v) => enc(op, v)?,
            Request::List | Request::Status => enc(op, &())?,
            Request::Borrow(v) => enc(op, v)?,
            Request::BorrowClaimed(v) => enc(op, v)?,
            Request::DeviceInfo(v) | Request::Reset(v) | Request::Return(v) => enc(op, v)?,
            Request::ConfigRead(v) => enc(op, v)?,
            Request::ConfigWrite(v) => enc(op, v)?,
            Request::BarRead(v) => enc(op, v)?,
            Request::BarWrite(v) => enc(op, v)?,
            Request::DmaMap(v) => enc(op, v)?,
            Request::DmaUnmap(v) => enc(op, v)?,
            Request::SetIrqs(v) => enc(op, v)?,
            Request::LeaseCounters(v) => enc(op, v)?,
            Request::Quiesce(v) => enc(op, v)?,
            Request::P2pMap(v) => enc(op, v)?,
            Request::P2pUnmap(v) => enc(op, v)?,
            other => match migration::encode(other, op).or_else(|| p2px::encode(other, op)) {
                Some(p) => p?,
                None => return Err(ProtocolError::UnknownOpcode(op)),
            },
        };
        Ok((op, payload))
    }

    /// The protocol version that introduced the request with opcode `op` (1 for opcodes
    /// that are not requests: they fail to decode anyway).
    fn since_version(op: u16) -> u32 {
        match op {
            opcode::LEASE_COUNTERS | opcode::QUIESCE => 3,
            op if migration::is_migration_op(op) => migration::MIGRATION_VERSION,
            opcode::P2P_MAP | opcode::P2P_UNMAP => P2P_VERSION,
            op if p2px::is_p2px_op(op) => P2PX_VERSION,
            _ => 1,
        }
    }

    /// Decodes and validates a request in the current version. Never panics.
    pub fn decode(op: u16, payload: &[u8]) -> Result<Request, ProtocolError> {
        Self::decode_versioned(op, payload, PROTOCOL_VERSION)
    }

    /// Decodes and validates a request sent in the layout of protocol `version`. Never
    /// panics.
    pub fn decode_versioned(
        op: u16,
        payload: &[u8],
        version: u32,
    ) -> Result<Request, ProtocolError> {
        if version < Self::since_version(op) {
            return Err(ProtocolError::UnknownOpcode(op));
        }
        if migration::is_migration_op(op) {
            return migration::decode(op, payload);
        }
        if p2px::is_p2px_op(op) {
            return p2px::decode(op, payload);
        }
        let r = match op {
            opcode::LEASE_COUNTERS => Request::LeaseCounters(dec(op, payload)?),
            opcode::QUIESCE => Request::Quiesce(dec(op, payload)?),
            opcode::P2P_MAP => {
                let m: P2pMap = dec(op, payload)?;
                if m.source == m.target {
                    return Err(invalid(
                        op,
                        format!("lease {} cannot map its own bar peer-to-peer", m.source),
                    ));
                }
                Request::P2pMap(m)
            }
            opcode::P2P_UNMAP => Request::P2pUnmap(dec(op, payload)?),
            opcode::HELLO => {
                let h: Hello = dec(op, payload)?;
                check_str(op, "token", &h.token)?;
                check_str(op, "client name", &h.client)?;
                Request::Hello(h)
            }
            opcode::LIST => {
                dec::<()>(op, payload)?;
                Request::List
            }
            opcode::STATUS => {
                dec::<()>(op, payload)?;
                Request::Status
            }
            opcode::BORROW => {
                let b: Borrow = dec(op, payload)?;
                check_str(op, "device id", &b.device)?;
                check_str(op, "vm name", &b.vm)?;
                Request::Borrow(b)
            }
            opcode::BORROW_CLAIMED => {
                let b: BorrowClaimed = dec(op, payload)?;
                check_str(op, "device id", &b.device)?;
                check_str(op, "vm name", &b.vm)?;
                if b.claim <= 0 {
                    return Err(invalid(
                        op,
                        format!("claim revision {} is not positive", b.claim),
                    ));
                }
                Request::BorrowClaimed(b)
            }
            opcode::DEVICE_INFO => Request::DeviceInfo(dec(op, payload)?),
            opcode::RESET => Request::Reset(dec(op, payload)?),
            opcode::RETURN => Request::Return(dec(op, payload)?),
            opcode::CONFIG_READ => {
                let r: ConfigRead = dec(op, payload)?;
                check_config_range(op, r.offset, usize::from(r.len))?;
                Request::ConfigRead(r)
            }
            opcode::CONFIG_WRITE => {
                let w: ConfigWrite = dec(op, payload)?;
                check_config_range(op, w.offset, w.data.len())?;
                Request::ConfigWrite(w)
            }
            opcode::BAR_READ => {
                let r: BarRead = dec(op, payload)?;
                check_bar_access(op, r.bar, r.offset, r.len as usize)?;
                Request::BarRead(r)
            }
            opcode::BAR_WRITE => {
                let w: BarWrite = dec(op, payload)?;
                check_bar_access(op, w.bar, w.offset, w.data.len())?;
                Request::BarWrite(w)
            }
            opcode::DMA_MAP => {
                let m: DmaMap = dec(op, payload)?;
                if m.size == 0 || m.iova.checked_add(m.size).is_none() {
                    return Err(invalid(
                        op,
                        format!(
                            "dma window iova {:#x} size {:#x} is empty or wraps",
                            m.iova, m.size
                        ),
                    ));
                }
                Request::DmaMap(m)
            }
            opcode::DMA_UNMAP => Request::DmaUnmap(dec(op, payload)?),
            opcode::SET_IRQS => {
                let s: SetIrqs = if version < 2 {
                    let v1: SetIrqsV1 = dec(op, payload)?;
                    SetIrqs {
                        lease: v1.lease,
                        kind: v1.kind,
                        targets: v1.targets,
                        resample: IrqTarget::None,
                    }
                } else {
                    dec(op, payload)?
                };
                if s.targets.len() > MAX_IRQS {
                    return Err(invalid(
                        op,
                        format!(
                            "{} interrupt targets, at most {MAX_IRQS} allowed",
                            s.targets.len()
                        ),
                    ));
                }
                if s.kind == IrqKind::Intx && s.targets.len() > 1 {
                    return Err(invalid(op, "intx has a single vector".into()));
                }
                if s.resample != IrqTarget::None
                    && (s.kind != IrqKind::Intx || s.targets.is_empty())
                {
                    return Err(invalid(
                        op,
                        format!(
                            "a resample target needs wired intx, not {:?} with {} targets",
                            s.kind,
                            s.targets.len()
                        ),
                    ));
                }
                if let IrqTarget::Doorbell(bit) = s.resample {
                    return Err(invalid(
                        op,
                        format!("resample via doorbell bit {bit}: only an eventfd or events"),
                    ));
                }
                Request::SetIrqs(s)
            }
            other => return Err(ProtocolError::UnknownOpcode(other)),
        };
        Ok(r)
    }
}

fn check_config_range(op: u16, offset: u16, len: usize) -> Result<(), ProtocolError> {
    let end = usize::from(offset) + len;
    if len == 0 || end > CONFIG_SPACE_SIZE {
        return Err(invalid(
            op,
            format!("config access {offset:#x}+{len:#x} is empty or beyond 0x1000"),
        ));
    }
    Ok(())
}

fn check_bar_access(op: u16, bar: u8, offset: u64, len: usize) -> Result<(), ProtocolError> {
    if bar > 5 {
        return Err(invalid(op, format!("bar index {bar} is not in 0..=5")));
    }
    if len == 0 || len > MAX_BAR_ACCESS || offset.checked_add(len as u64).is_none() {
        return Err(invalid(
            op,
            format!("bar access of {len:#x} bytes at {offset:#x} is empty, too large or wraps"),
        ));
    }
    Ok(())
}

impl Event {
    /// Encodes to (opcode, payload).
    pub fn encode(&self) -> Result<(u16, Vec<u8>), ProtocolError> {
        match self {
            Event::DeviceGone(v) => Ok((opcode::EVT_DEVICE_GONE, enc(opcode::EVT_DEVICE_GONE, v)?)),
            Event::Fatal(v) => Ok((opcode::EVT_FATAL, enc(opcode::EVT_FATAL, v)?)),
            Event::Irq(v) => Ok((opcode::EVT_IRQ, enc(opcode::EVT_IRQ, v)?)),
            Event::Resample(v) => Ok((opcode::EVT_RESAMPLE, enc(opcode::EVT_RESAMPLE, v)?)),
            Event::IommuFault(v) => Ok((opcode::EVT_IOMMU_FAULT, enc(opcode::EVT_IOMMU_FAULT, v)?)),
            Event::Kicks(v) => Ok((opcode::EVT_KICKS, enc(opcode::EVT_KICKS, v)?)),
            Event::LeaseMoved(v) => {
                let op = migration::opcode::EVT_LEASE_MOVED;
                Ok((op, enc(op, v)?))
            }
        }
    }

    /// Decodes an event. Never panics.
    pub fn decode(op: u16, payload: &[u8]) -> Result<Event, ProtocolError> {
        match op {
            opcode::EVT_DEVICE_GONE => Ok(Event::DeviceGone(dec(op, payload)?)),
            opcode::EVT_FATAL => Ok(Event::Fatal(dec(op, payload)?)),
            opcode::EVT_IRQ => Ok(Event::Irq(dec(op, payload)?)),
            opcode::EVT_RESAMPLE => Ok(Event::Resample(dec(op, payload)?)),
            opcode::EVT_IOMMU_FAULT => Ok(Event::IommuFault(dec(op, payload)?)),
            opcode::EVT_KICKS => {
                let k: KicksEvent = dec(op, payload)?;
                k.kicks.check(op)?;
                Ok(Event::Kicks(k))
            }
            migration::opcode::EVT_LEASE_MOVED => {
                let m: LeaseMoved = dec(op, payload)?;
                check_str(op, "new holder", &m.to)?;
                Ok(Event::LeaseMoved(m))
            }
            other => Err(ProtocolError::UnknownOpcode(other)),
        }
    }
}

/// Encodes a reply payload.
pub fn encode_reply<T: Serialize + ?Sized>(op: u16, v: &T) -> Result<Vec<u8>, ProtocolError> {
    enc(op, v)
}

/// Decodes a reply payload of the request with opcode `op`.
pub fn decode_reply<T: serde::de::DeserializeOwned>(
    op: u16,
    payload: &[u8],
) -> Result<T, ProtocolError> {
    dec(op, payload)
}

/// A LIST reply's devices as a session of protocol `version` may carry them
/// ([`DeviceState::for_version`]).
pub fn devices_for_version(devices: Vec<DeviceSummary>, version: u32) -> Vec<DeviceSummary> {
    devices
        .into_iter()
        .map(|d| DeviceSummary {
            state: d.state.for_version(version),
            ..d
        })
        .collect()
}

/// A STATUS reply as a session of protocol `version` may carry it
/// ([`DeviceState::for_version`]).
pub fn status_for_version(status: LenderStatus, version: u32) -> LenderStatus {
    LenderStatus {
        devices: status
            .devices
            .into_iter()
            .map(|d| DeviceStatus {
                summary: DeviceSummary {
                    state: d.summary.state.for_version(version),
                    ..d.summary
                },
                ..d
            })
            .collect(),
        ..status
    }
}

/// The version a lender serving `ours` speaks with a borrower asking for `theirs`, or `None`
/// when the borrower is too old.
pub fn negotiate(theirs: u32, ours: u32) -> Option<u32> {
    (theirs >= MIN_PROTOCOL_VERSION).then(|| theirs.min(ours))
}

/// Encodes a [`Borrowed`] reply in the layout of `version`.
pub fn encode_borrowed(b: &Borrowed, version: u32) -> Result<Vec<u8>, ProtocolError> {
    let op = opcode::BORROW;
    if version < 2 {
        let v1 = BorrowedV1 {
            lease: b.lease,
            info: DeviceInfoV1::from_v2(&b.info),
            notify_fd: b.notify_fd,
            notify_doorbell: b.notify_doorbell,
        };
        return enc(op, &v1);
    }
    if version < 3 {
        let v2 = Borrowed {
            info: without_polled(&b.info),
            ..b.clone()
        };
        return enc(op, &v2);
    }
    enc(op, b)
}

/// Decodes a [`Borrowed`] reply sent in the layout of `version` (version 1 BARs get the
/// version 1 meaning of their window, see [`BarDesc::notify`]).
pub fn decode_borrowed(payload: &[u8], version: u32) -> Result<Borrowed, ProtocolError> {
    let op = opcode::BORROW;
    if version < 2 {
        let v1: BorrowedV1 = dec(op, payload)?;
        let has_notify = v1.notify_fd.is_some() || v1.notify_doorbell.is_some();
        return Ok(Borrowed {
            lease: v1.lease,
            info: v1.info.into_v2(has_notify),
            notify_fd: v1.notify_fd,
            notify_doorbell: v1.notify_doorbell,
        });
    }
    dec(op, payload)
}

/// Encodes a DEVICE_INFO reply in the layout of `version`.
pub fn encode_device_info(i: &DeviceInfo, version: u32) -> Result<Vec<u8>, ProtocolError> {
    let op = opcode::DEVICE_INFO;
    if version < 2 {
        return enc(op, &DeviceInfoV1::from_v2(i));
    }
    if version < 3 {
        return enc(op, &without_polled(i));
    }
    enc(op, i)
}

/// Version 2 has no [`NotifyWrites::Polled`]: such BARs are sent as `Doorbells` (store +
/// notify, also right for a polling device); the layout is otherwise the same.
fn without_polled(i: &DeviceInfo) -> DeviceInfo {
    let mut i = i.clone();
    for b in i.bars.iter_mut() {
        if let NotifyWrites::Polled { offset, len } = b.notify {
            b.notify = NotifyWrites::Doorbells { offset, len };
        }
    }
    i
}

/// Decodes a DEVICE_INFO reply sent in the layout of `version`; `has_notify`: whether the
/// lease came with a notify eventfd or doorbell (version 1 meaning of the windows).
pub fn decode_device_info(
    payload: &[u8],
    version: u32,
    has_notify: bool,
) -> Result<DeviceInfo, ProtocolError> {
    let op = opcode::DEVICE_INFO;
    if version < 2 {
        let v1: DeviceInfoV1 = dec(op, payload)?;
        return Ok(v1.into_v2(has_notify));
    }
    dec(op, payload)
}

/// An error reply with a protocol code.
pub fn error(code: u32, message: impl Into<String>) -> ErrorReply {
    ErrorReply::new(code, message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn samples() -> Vec<Request> {
        vec![
            Request::Hello(Hello {
                version: PROTOCOL_VERSION,
                token: "secret".into(),
                client: "test".into(),
            }),
            Request::List,
            Request::Status,
            Request::Borrow(Borrow {
                device: "0000:81:00.0".into(),
                vm: "vm0".into(),
            }),
            Request::DeviceInfo(LeaseRef { lease: 7 }),
            Request::ConfigRead(ConfigRead {
                lease: 7,
                offset: 0,
                len: 256,
            }),
            Request::ConfigWrite(ConfigWrite {
                lease: 7,
                offset: 4,
                data: vec![6, 0],
            }),
            Request::BarRead(BarRead {
                lease: 7,
                bar: 0,
                offset: 0x1000,
                len: 4,
            }),
            Request::BarWrite(BarWrite {
                lease: 7,
                bar: 0,
                offset: 0x1000,
                data: vec![1, 0, 0, 0],
            }),
            Request::DmaMap(DmaMap {
                lease: 7,
                iova: 0x100000,
                size: 0x10000,
                window: 2,
            }),
            Request::DmaUnmap(DmaUnmap {
                lease: 7,
                iova: 0x100000,
                size: 0x10000,
            }),
            Request::SetIrqs(SetIrqs {
                lease: 7,
                kind: IrqKind::Msix,
                targets: vec![IrqTarget::Fd(0), IrqTarget::Doorbell(3), IrqTarget::None],
                resample: IrqTarget::None,
            }),
            Request::Reset(LeaseRef { lease: 7 }),
            Request::Return(LeaseRef { lease: 7 }),
            Request::LeaseCounters(LeaseRef { lease: 7 }),
            Request::Quiesce(Quiesce {
                lease: 7,
                stop: true,
            }),
            Request::BorrowClaimed(BorrowClaimed {
                device: "0000:81:00.0".into(),
                vm: "vm0".into(),
                claim: 42,
            }),
            Request::P2pMap(P2pMap {
                source: 7,
                target: 8,
                bar: 0,
                iova: 0xc000_0000,
            }),
            Request::P2pUnmap(P2pUnmap {
                source: 7,
                target: 8,
                bar: 0,
            }),
        ]
    }

    /// The version 4 migration requests.
    fn migration_samples() -> Vec<Request> {
        vec![
            Request::DirtyLogStart(LeaseRef { lease: 7 }),
            Request::DirtyLogFetch(DirtyLogFetch {
                lease: 7,
                iova: 0x10_0000,
                len: 0x4000_0000,
            }),
            Request::DirtyLogStop(LeaseRef { lease: 7 }),
            Request::QuiesceHandover(QuiesceHandover {
                lease: 7,
                timeout_ms: 5000,
            }),
            Request::TransferCreate(TransferCreate {
                lease: 7,
                to_node: "node2".into(),
                to_vm: "vm0".into(),
            }),
            Request::TransferCancel(LeaseRef { lease: 7 }),
            Request::TransferAccept(TransferAccept {
                lease: 7,
                ticket: vec![9; migration::TICKET_LEN],
                vm: "vm0".into(),
                maps: vec![AcceptMap {
                    iova: 0,
                    size: 0xc000_0000,
                    window: 4,
                }],
                msix: vec![IrqTarget::Fd(0), IrqTarget::Doorbell(2), IrqTarget::None],
            }),
        ]
    }

    #[test]
    fn version_4_migration_requests_roundtrip_and_are_refused_below_4() {
        for r in migration_samples() {
            let (op, p) = r.encode().unwrap();
            assert!((0x121..=0x127).contains(&op), "{r:?}: {op:#x}");
            assert_eq!(Request::decode(op, &p).unwrap(), r);
            assert_eq!(r.lease(), Some(7));
            assert!(r.encode_versioned(3).is_err(), "{r:?}");
            assert_eq!(
                Request::decode_versioned(op, &p, 3),
                Err(ProtocolError::UnknownOpcode(op))
            );
        }
        // Old requests keep their layouts in version 4 (the version 5 P2P samples aside).
        for r in samples()
            .into_iter()
            .filter(|r| !matches!(r, Request::P2pMap(_) | Request::P2pUnmap(_)))
        {
            let (op, p) = r.encode_versioned(3).unwrap();
            assert_eq!(Request::decode_versioned(op, &p, 4).unwrap(), r);
        }
        let ev = Event::LeaseMoved(LeaseMoved {
            lease: 7,
            to: "node2/vm0".into(),
        });
        let (op, p) = ev.encode().unwrap();
        assert_eq!(op, 0x186);
        assert_eq!(Event::decode(op, &p).unwrap(), ev);
        let bm = DirtyBitmap {
            iova: 0x1000,
            pages: 70,
            bits: vec![0b101, 1 << 5],
            whole_window: false,
        };
        assert_eq!(bm.iovas(), vec![0x1000, 0x3000, 0x1000 + 69 * 4096]);
        let p = encode_reply(migration::opcode::DIRTY_LOG_FETCH, &bm).unwrap();
        assert_eq!(
            decode_reply::<DirtyBitmap>(migration::opcode::DIRTY_LOG_FETCH, &p).unwrap(),
            bm
        );
        assert_eq!(negotiate(4, 3), Some(3), "a version 3 lender speaks 3");
    }

    #[test]
    fn version_4_decoder_rejects_bad_fields() {
        let bad = [
            Request::DirtyLogFetch(DirtyLogFetch {
                lease: 1,
                iova: 0x1001,
                len: 0x1000,
            }),
            Request::DirtyLogFetch(DirtyLogFetch {
                lease: 1,
                iova: 0,
                len: (crate::iommu::MAX_DIRTY_PAGES + 1) * 4096,
            }),
            Request::DirtyLogFetch(DirtyLogFetch {
                lease: 1,
                iova: u64::MAX - 0xfff,
                len: 0x2000,
            }),
            Request::QuiesceHandover(QuiesceHandover {
                lease: 1,
                timeout_ms: migration::MAX_DRAIN_MS + 1,
            }),
            Request::TransferAccept(TransferAccept {
                lease: 1,
                ticket: vec![0; 5],
                vm: "v".into(),
                maps: vec![],
                msix: vec![],
            }),
            Request::TransferAccept(TransferAccept {
                lease: 1,
                ticket: vec![0; migration::TICKET_LEN],
                vm: "v".into(),
                maps: vec![AcceptMap {
                    iova: u64::MAX,
                    size: 2,
                    window: 0,
                }],
                msix: vec![],
            }),
            Request::TransferCreate(TransferCreate {
                lease: 1,
                to_node: "n".repeat(MAX_STRING + 1),
                to_vm: "v".into(),
            }),
        ];
        for r in bad {
            let (op, p) = r.encode().unwrap();
            let e = Request::decode(op, &p).unwrap_err();
            assert!(matches!(e, ProtocolError::Invalid { .. }), "{r:?}: {e}");
        }
    }

    #[test]
    fn requests_roundtrip() {
        for r in samples() {
            let (op, p) = r.encode().unwrap();
            assert_eq!(Request::decode(op, &p).unwrap(), r);
        }
    }

    #[test]
    fn events_roundtrip() {
        for e in [
            Event::DeviceGone(DeviceGone {
                lease: 1,
                reason: "lenderd shutting down".into(),
            }),
            Event::Fatal(FatalError {
                lease: 1,
                message: "x".into(),
            }),
            Event::Irq(IrqEvent {
                lease: 1,
                kind: IrqKind::Msix,
                vector: 3,
            }),
            Event::Resample(IrqResample { lease: 1 }),
            Event::IommuFault(IommuFaultEvent {
                lease: 1,
                iova: 0xdead_0000,
                len: 512,
                write: true,
                total: 17,
            }),
        ] {
            let (op, p) = e.encode().unwrap();
            assert_eq!(Event::decode(op, &p).unwrap(), e);
        }
    }

    #[test]
    fn decoder_rejects_bad_fields() {
        let bad = [
            Request::ConfigRead(ConfigRead {
                lease: 1,
                offset: 0xfff,
                len: 2,
            }),
            Request::ConfigWrite(ConfigWrite {
                lease: 1,
                offset: 0,
                data: vec![],
            }),
            Request::BarRead(BarRead {
                lease: 1,
                bar: 6,
                offset: 0,
                len: 4,
            }),
            Request::BarRead(BarRead {
                lease: 1,
                bar: 0,
                offset: u64::MAX,
                len: 4,
            }),
            Request::DmaMap(DmaMap {
                lease: 1,
                iova: u64::MAX,
                size: 2,
                window: 0,
            }),
            Request::SetIrqs(SetIrqs {
                lease: 1,
                kind: IrqKind::Intx,
                targets: vec![IrqTarget::None; 2],
                resample: IrqTarget::None,
            }),
            Request::SetIrqs(SetIrqs {
                lease: 1,
                kind: IrqKind::Msix,
                targets: vec![IrqTarget::Fd(0)],
                resample: IrqTarget::Fd(1),
            }),
            Request::SetIrqs(SetIrqs {
                lease: 1,
                kind: IrqKind::Intx,
                targets: vec![IrqTarget::Fd(0)],
                resample: IrqTarget::Doorbell(2),
            }),
        ];
        for r in bad {
            let (op, p) = r.encode().unwrap();
            let e = Request::decode(op, &p).unwrap_err();
            assert!(matches!(e, ProtocolError::Invalid { .. }), "{r:?}: {e}");
        }
        assert_eq!(
            Request::decode(0x1ff, &[]),
            Err(ProtocolError::UnknownOpcode(0x1ff))
        );
        // Trailing bytes are an error, not ignored.
        let (op, mut p) = Request::List.encode().unwrap();
        p.push(0);
        assert!(Request::decode(op, &p).is_err());
    }

    fn sample_info() -> DeviceInfo {
        let bar = |index, window, notify| BarDesc {
            index,
            size: 0x4000,
            is_64bit: true,
            prefetchable: false,
            io: false,
            window,
            emulated_by_borrower: false,
            notify,
        };
        DeviceInfo {
            id: "0000:81:00.0".into(),
            kind: "nvme".into(),
            config: vec![0x36, 0x1b, 0x10, 0],
            bars: vec![
                bar(
                    0,
                    Some(3),
                    NotifyWrites::Doorbells {
                        offset: 0x1000,
                        len: 0x3000,
                    },
                ),
                bar(4, None, NotifyWrites::None),
            ],
            caps: vec![],
            irqs: IrqCounts {
                intx: 1,
                msi: 0,
                msix: 17,
            },
            msix: None,
        }
    }

    #[test]
    fn version_2_roundtrips_notify_and_resample() {
        let b = Borrowed {
            lease: 9,
            info: sample_info(),
            notify_fd: Some(0),
            notify_doorbell: None,
        };
        let p = encode_borrowed(&b, 2).unwrap();
        assert_eq!(decode_borrowed(&p, 2).unwrap(), b);
        let p = encode_device_info(&b.info, 2).unwrap();
        assert_eq!(decode_device_info(&p, 2, true).unwrap(), b.info);
        let r = Request::SetIrqs(SetIrqs {
            lease: 9,
            kind: IrqKind::Intx,
            targets: vec![IrqTarget::Fd(0)],
            resample: IrqTarget::Fd(1),
        });
        let (op, p) = r.encode().unwrap();
        assert_eq!(Request::decode(op, &p).unwrap(), r);
    }

    #[test]
    fn version_1_layouts_keep_their_meaning() {
        assert_eq!(negotiate(1, PROTOCOL_VERSION), Some(1));
        assert_eq!(negotiate(7, PROTOCOL_VERSION), Some(7));
        assert_eq!(
            negotiate(PROTOCOL_VERSION, PROTOCOL_VERSION),
            Some(PROTOCOL_VERSION)
        );
        assert_eq!(negotiate(0, PROTOCOL_VERSION), None);
        // A version 1 borrower reads the borrow reply without notify modes; decoded back, a
        // window of a lease with a notify fd is write-notified as a whole, as in version 1.
        let b = Borrowed {
            lease: 9,
            info: sample_info(),
            notify_fd: Some(0),
            notify_doorbell: None,
        };
        let p1 = encode_borrowed(&b, 1).unwrap();
        assert!(decode_borrowed(&p1, 2).is_err(), "layouts differ");
        let back = decode_borrowed(&p1, 1).unwrap();
        assert_eq!(back.info.bars[0].notify, NotifyWrites::All);
        assert_eq!(back.info.bars[1].notify, NotifyWrites::None);
        let p1 = encode_device_info(&b.info, 1).unwrap();
        let back = decode_device_info(&p1, 1, false).unwrap();
        assert!(back.bars.iter().all(|b| b.notify == NotifyWrites::None));
        // SET_IRQS: version 1 has no resample; one is refused, not dropped.
        let mut s = SetIrqs {
            lease: 9,
            kind: IrqKind::Intx,
            targets: vec![IrqTarget::Fd(0)],
            resample: IrqTarget::Fd(1),
        };
        assert!(Request::SetIrqs(s.clone()).encode_versioned(1).is_err());
        s.resample = IrqTarget::None;
        let (op, p) = Request::SetIrqs(s.clone()).encode_versioned(1).unwrap();
        assert_eq!(
            Request::decode_versioned(op, &p, 1).unwrap(),
            Request::SetIrqs(s)
        );
        assert!(Request::decode_versioned(op, &p, 2).is_err());
    }

    fn sample_counters() -> LeaseCounters {
        LeaseCounters {
            dma_bytes_read: 40 * 4096 + 40 * 64,
            dma_bytes_written: 40 * 16,
            iommu_faults: 2,
            doorbell_kicks: 80,
            msix: vec![3, 40, 0, 1 << 40],
            intx: 5,
            commands: 41,
            invalid_doorbells: 3,
            bad_prps: 1,
        }
    }

    #[test]
    fn version_7_counters_carry_the_model_counts_and_older_sessions_the_old_layout() {
        let c = sample_counters();
        let p7 = encode_lease_counters(&c, 7).unwrap();
        assert_eq!(decode_lease_counters(&p7, 7).unwrap(), c);
        let p6 = encode_lease_counters(&c, 6).unwrap();
        assert!(p6.len() < p7.len());
        // A version 6 borrower reads the old layout to its end (no trailing bytes).
        let old: LeaseCountersV3 = dec(opcode::LEASE_COUNTERS, &p6).unwrap();
        assert_eq!(old.msix, c.msix);
        let back = decode_lease_counters(&p6, 6).unwrap();
        assert_eq!(
            back,
            LeaseCounters {
                commands: 0,
                invalid_doorbells: 0,
                bad_prps: 0,
                ..c.clone()
            }
        );
        // The new layout is not the old one: read as version 6 it is refused, not misread.
        assert!(decode_lease_counters(&p7, 6).is_err());
    }

    /// A releasing device reaches a version 8 session as `Releasing`; a version 7 session,
    /// whose decoder does not know that variant (frozen copy below) and would refuse the
    /// whole LIST or STATUS reply, gets `Resetting`. The older variants keep their positions.
    #[test]
    fn a_releasing_device_is_resetting_to_sessions_before_version_8() {
        #[derive(Debug, PartialEq, Deserialize)]
        enum DeviceStateV7 {
            Available,
            Lent { node: String, vm: String },
            Resetting,
            Failed { reason: String },
        }
        #[derive(Debug, Deserialize)]
        struct DeviceSummaryV7 {
            id: String,
            _kind: String,
            _vendor_id: u16,
            _device_id: u16,
            _class: u32,
            state: DeviceStateV7,
        }
        let dev = |state| DeviceSummary {
            id: "0000:81:00.0".into(),
            kind: "nvme".into(),
            vendor_id: 0x1b36,
            device_id: 0x0010,
            class: 0x010802,
            state,
        };
        let releasing = DeviceState::Releasing {
            node: "node1".into(),
            vm: "vm0".into(),
        };
        assert_eq!(releasing.to_string(), "releasing (was lent to node1/vm0)");
        let op = opcode::LIST;
        let list = vec![dev(releasing.clone()), dev(DeviceState::Available)];
        let p8 = enc(op, &devices_for_version(list.clone(), 8)).unwrap();
        assert_eq!(dec::<Vec<DeviceSummary>>(op, &p8).unwrap(), list);
        assert!(
            dec::<Vec<DeviceSummaryV7>>(op, &p8).is_err(),
            "a version 7 decoder reads Releasing"
        );
        let p7 = enc(op, &devices_for_version(list.clone(), 7)).unwrap();
        let old: Vec<DeviceSummaryV7> = dec(op, &p7).unwrap();
        assert_eq!(old[0].id, "0000:81:00.0");
        assert_eq!(old[0].state, DeviceStateV7::Resetting);
        assert_eq!(old[1].state, DeviceStateV7::Available);
        // The older variants are where version 7 has them.
        for (new, v7) in [
            (
                DeviceState::Lent {
                    node: "n".into(),
                    vm: "v".into(),
                },
                DeviceStateV7::Lent {
                    node: "n".into(),
                    vm: "v".into(),
                },
            ),
            (DeviceState::Resetting, DeviceStateV7::Resetting),
            (
                DeviceState::Failed { reason: "r".into() },
                DeviceStateV7::Failed { reason: "r".into() },
            ),
        ] {
            let p = enc(op, &devices_for_version(vec![dev(new)], 8)).unwrap();
            assert_eq!(dec::<Vec<DeviceSummaryV7>>(op, &p).unwrap()[0].state, v7);
        }
        // STATUS the same way.
        let st = LenderStatus {
            node: "node3".into(),
            uptime_secs: 1,
            devices: vec![DeviceStatus {
                summary: dev(releasing.clone()),
                dma_maps: vec![(0x1000, 0x1000)],
                iommu_faults: 0,
                leases_granted: 1,
            }],
        };
        let s7 = status_for_version(st.clone(), 7);
        assert_eq!(s7.devices[0].summary.state, DeviceState::Resetting);
        assert_eq!(s7.devices[0].dma_maps, st.devices[0].dma_maps);
        assert_eq!(status_for_version(st.clone(), 8), st);
    }

    #[test]
    fn version_3_counters_quiesce_and_faults() {
        let c = sample_counters();
        let p = encode_reply(opcode::LEASE_COUNTERS, &c).unwrap();
        assert_eq!(
            decode_reply::<LeaseCounters>(opcode::LEASE_COUNTERS, &p).unwrap(),
            c
        );
        // Per-lease counts are differences of monotonic snapshots, vector by vector.
        let base = LeaseCounters {
            dma_bytes_read: 4096,
            dma_bytes_written: 16,
            iommu_faults: 1,
            doorbell_kicks: 2,
            msix: vec![1, 2],
            intx: 5,
            commands: 1,
            invalid_doorbells: 1,
            bad_prps: 0,
        };
        assert_eq!(
            c.since(&base),
            LeaseCounters {
                dma_bytes_read: 39 * 4096 + 40 * 64,
                dma_bytes_written: 39 * 16,
                iommu_faults: 1,
                doorbell_kicks: 78,
                msix: vec![2, 38, 0, 1 << 40],
                intx: 0,
                commands: 40,
                invalid_doorbells: 2,
                bad_prps: 1,
            }
        );
        // Nothing newer than the session: encoding refuses, decoding sees an unknown opcode
        // (what a version 2 lender answers).
        for r in [
            Request::LeaseCounters(LeaseRef { lease: 1 }),
            Request::Quiesce(Quiesce {
                lease: 1,
                stop: false,
            }),
        ] {
            assert!(r.encode_versioned(2).is_err(), "{r:?}");
            assert!(r.encode_versioned(1).is_err(), "{r:?}");
            let (op, p) = r.encode_versioned(3).unwrap();
            assert_eq!(
                Request::decode_versioned(op, &p, 2),
                Err(ProtocolError::UnknownOpcode(op))
            );
            assert_eq!(Request::decode_versioned(op, &p, 3).unwrap(), r);
        }
        // Old requests keep their layouts in version 3.
        for r in samples().into_iter().take(14) {
            let (op, p) = r.encode_versioned(2).unwrap();
            assert_eq!(Request::decode_versioned(op, &p, 3).unwrap(), r);
        }
        assert_eq!(negotiate(2, PROTOCOL_VERSION), Some(2));
        assert_eq!(negotiate(3, 2), Some(2), "a version 2 lender speaks 2");
    }

    #[test]
    fn version_5_p2p_requests() {
        for r in [
            Request::P2pMap(P2pMap {
                source: 1,
                target: 2,
                bar: 0,
                iova: 0xc000_0000,
            }),
            Request::P2pUnmap(P2pUnmap {
                source: 1,
                target: 2,
                bar: 0,
            }),
        ] {
            for v in 1..P2P_VERSION {
                assert!(r.encode_versioned(v).is_err(), "{r:?} in version {v}");
            }
            let (op, p) = r.encode_versioned(P2P_VERSION).unwrap();
            assert_eq!(
                Request::decode_versioned(op, &p, 4),
                Err(ProtocolError::UnknownOpcode(op)),
                "what a version 4 lender answers"
            );
            assert_eq!(Request::decode_versioned(op, &p, P2P_VERSION).unwrap(), r);
        }
        // A lease cannot be its own peer.
        let (op, p) = Request::P2pMap(P2pMap {
            source: 3,
            target: 3,
            bar: 0,
            iova: 0,
        })
        .encode()
        .unwrap();
        assert!(matches!(
            Request::decode(op, &p),
            Err(ProtocolError::Invalid { .. })
        ));
        assert_eq!(negotiate(5, 4), Some(4), "a version 4 lender speaks 4");
    }

    #[test]
    fn notify_doorbell_range_is_whole_accesses_only() {
        let n = NotifyWrites::Doorbells {
            offset: 0x1000,
            len: 0x3000,
        };
        assert!(n.is_doorbell(0x1000, 4));
        assert!(n.is_doorbell(0x3ffc, 4));
        assert!(!n.is_doorbell(0x3ffc, 8));
        assert!(!n.is_doorbell(0xffc, 8));
        assert!(!n.is_doorbell(0x14, 4));
        assert!(!n.is_doorbell(u64::MAX, 8));
        assert!(NotifyWrites::All.is_doorbell(0x14, 4));
        let empty = NotifyWrites::Doorbells { offset: 0, len: 0 };
        assert!(!empty.is_doorbell(0, 4));
    }

    /// Number of proptest cases: `PROPTEST_CASES` if set (CI-short: 100000), else 20000.
    fn cases() -> u32 {
        std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20_000)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

        /// Any opcode and any bytes: decoding returns, never panics.
        #[test]
        fn decoder_never_panics(op in 0x100u16..0x190, payload in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Request::decode(op, &payload);
            let _ = Event::decode(op, &payload);
            let _ = decode_reply::<DeviceInfo>(op, &payload);
            let _ = Request::decode_versioned(op, &payload, 1);
            let _ = decode_borrowed(&payload, 1);
            let _ = decode_borrowed(&payload, 2);
            let _ = decode_device_info(&payload, 1, true);
            let _ = decode_reply::<Vec<DeviceSummary>>(op, &payload);
            let _ = Request::decode_versioned(op, &payload, 2);
            let _ = decode_reply::<LeaseCounters>(op, &payload);
            let _ = Request::decode_versioned(op, &payload, 3);
            let _ = decode_reply::<DirtyBitmap>(op, &payload);
            let _ = decode_reply::<HandoverQuiesced>(op, &payload);
            let _ = decode_reply::<TransferTicket>(op, &payload);
        }

        /// Migration requests (version 4) mutated at one byte or cut: no panic; untouched
        /// ones roundtrip.
        #[test]
        fn mutated_migration_requests_never_panic(which in 0usize..7, at in any::<usize>(), byte in any::<u8>(), cut in any::<usize>()) {
            let r = &migration_samples()[which];
            let (op, p) = r.encode().unwrap();
            prop_assert_eq!(&Request::decode(op, &p).unwrap(), r);
            let mut m = p.clone();
            if !m.is_empty() {
                let i = at % m.len();
                m[i] = byte;
            }
            let _ = Request::decode(op, &m);
            let _ = Request::decode(op, &p[..cut % (p.len() + 1)]);
            let (eop, e) = Event::LeaseMoved(LeaseMoved { lease: 3, to: "n/v".into() }).encode().unwrap();
            let mut m = e.clone();
            let i = at % m.len();
            m[i] = byte;
            let _ = Event::decode(eop, &m);
            let _ = Event::decode(eop, &e[..cut % (e.len() + 1)]);
        }

        /// A LEASE_COUNTERS reply mutated at one byte or cut: no panic.
        #[test]
        fn mutated_counters_replies_never_panic(at in any::<usize>(), byte in any::<u8>(), cut in any::<usize>()) {
            let c = sample_counters();
            let p = encode_reply(opcode::LEASE_COUNTERS, &c).unwrap();
            prop_assert_eq!(&decode_reply::<LeaseCounters>(opcode::LEASE_COUNTERS, &p).unwrap(), &c);
            let mut m = p.clone();
            let i = at % m.len();
            m[i] = byte;
            let _ = decode_reply::<LeaseCounters>(opcode::LEASE_COUNTERS, &m);
            let _ = decode_reply::<LeaseCounters>(opcode::LEASE_COUNTERS, &p[..cut % (p.len() + 1)]);
            let (op, e) = Event::IommuFault(IommuFaultEvent { lease: 3, iova: 1 << 40, len: 8, write: false, total: 1 }).encode().unwrap();
            let mut m = e.clone();
            let i = at % m.len();
            m[i] = byte;
            let _ = Event::decode(op, &m);
            let _ = Event::decode(op, &e[..cut % (e.len() + 1)]);
        }

        /// Valid encodings mutated at one byte: still no panic, and untouched ones roundtrip.
        #[test]
        fn mutated_valid_messages_never_panic(which in 0usize..16, at in any::<usize>(), byte in any::<u8>(), cut in any::<usize>()) {
            let r = &samples()[which];
            let (op, p) = r.encode().unwrap();
            prop_assert_eq!(&Request::decode(op, &p).unwrap(), r);
            let mut m = p.clone();
            if !m.is_empty() {
                let i = at % m.len();
                m[i] = byte;
            }
            let _ = Request::decode(op, &m);
            let _ = Request::decode(op, &p[..cut % (p.len() + 1)]);
        }
    }

    #[test]
    fn version_3_kicks_and_polled_bars_downgrade() {
        let k = DoorbellKicks {
            generation: 4,
            bar: 0,
            offsets: vec![0x1008, 0x100c],
        };
        let op = opcode::BAR_WRITE;
        let p = encode_kicks_reply(op, &k, 3).unwrap();
        assert_eq!(decode_kicks_reply(op, &p, 3).unwrap(), Some(k.clone()));
        // Version 2 peers keep the `()` reply both ways.
        let p2 = encode_kicks_reply(op, &k, 2).unwrap();
        assert!(p2.is_empty());
        assert_eq!(decode_kicks_reply(op, &p2, 2).unwrap(), None);
        let bad = DoorbellKicks {
            generation: 1,
            bar: 9,
            offsets: vec![],
        };
        let p = encode_kicks_reply(op, &bad, 3).unwrap();
        assert!(decode_kicks_reply(op, &p, 3).is_err(), "bar 9 refused");
        let too_many = DoorbellKicks {
            generation: 1,
            bar: 0,
            offsets: vec![0; MAX_KICKS + 1],
        };
        let ev = Event::Kicks(KicksEvent {
            lease: 3,
            kicks: too_many,
        });
        let (op, p) = ev.encode().unwrap();
        assert!(
            Event::decode(op, &p).is_err(),
            "oversized kick list refused"
        );
        let ev = Event::Kicks(KicksEvent {
            lease: 3,
            kicks: k.clone(),
        });
        let (op, p) = ev.encode().unwrap();
        assert_eq!(Event::decode(op, &p).unwrap(), ev);
        // Newest wins whichever path delivered it.
        let old = DoorbellKicks {
            generation: 3,
            ..k.clone()
        };
        assert_eq!(old.clone().newest(k.clone()), k);
        assert_eq!(k.clone().newest(old), k);
        // A polled BAR reaches a version 2 borrower as store + notify doorbells.
        let mut info = sample_info();
        info.bars[0].notify = NotifyWrites::Polled {
            offset: 0x1000,
            len: 0x3000,
        };
        let v3 = decode_device_info(&encode_device_info(&info, 3).unwrap(), 3, true).unwrap();
        assert_eq!(v3, info);
        let v2 = decode_device_info(&encode_device_info(&info, 2).unwrap(), 2, true).unwrap();
        assert_eq!(
            v2.bars[0].notify,
            NotifyWrites::Doorbells {
                offset: 0x1000,
                len: 0x3000
            }
        );
        let b = Borrowed {
            lease: 1,
            info,
            notify_fd: Some(0),
            notify_doorbell: None,
        };
        let v2 = decode_borrowed(&encode_borrowed(&b, 2).unwrap(), 2).unwrap();
        assert!(matches!(
            v2.info.bars[0].notify,
            NotifyWrites::Doorbells { .. }
        ));
        assert_eq!(
            decode_borrowed(&encode_borrowed(&b, 3).unwrap(), 3).unwrap(),
            b
        );
    }
}
