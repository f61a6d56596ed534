//! The PCIe Non-Transparent-Bridge fabric of lendvm.
//!
//! A node exports local memory as inbound windows, maps its peers' windows, rings their
//! doorbells and writes their scratchpads, like the Linux NTB API ([`fabric`] explains the
//! mapping). Two backends run without NTB hardware: [`shm`] (same host, memfd windows and
//! eventfd doorbells passed over a Unix socket: the data path is plain loads/stores) and
//! [`tcp`] (across hosts: windows and doorbells as messages); `bar` links are tcp links with a
//! shared region ([`region`]) whose windows are mapped directly, as through an NTB BAR, and
//! whose control messages go through rings in that region ([`ring`]). All carry the control
//! protocol of the lender and borrower ([`Endpoint::request`], [`Endpoint::recv`], with fds on
//! shm) in the [`wire`] format. [`config`] loads the cluster description.

mod accept;
pub mod config;
pub mod fabric;
mod link;
pub mod mem;
pub mod node;
pub mod region;
pub mod ring;
pub mod shm;
pub mod sock;
pub mod tcp;
pub mod tls;
pub mod wire;
pub mod workers;

pub use accept::{
    source_key, PreauthLimits, MAX_PENDING_HANDSHAKES, MAX_PENDING_HANDSHAKES_LIMIT,
    MAX_PENDING_PER_SOURCE,
};
pub use config::{ClusterConfig, ConfigError, ControlAddr, DirectoryConfig, NodeConfig};
pub use fabric::{
    BackingId, ControlPath, Endpoint, ExportedWindow, Fabric, FabricError, FabricKind, Incoming,
    LinkConfig, LinkStats, Listener, Message, NodeId, PeerInfo, PeerWindow, RequestId, WindowId,
    WindowInfo, WindowLimits,
};
pub use link::{RateLimit, MAX_LABEL};
pub use mem::{MemError, SharedMemory};
pub use node::{connect_addr, listen_addr, SocketFabric};
pub use region::{Region, RegionSpec};
pub use wire::{ErrorReply, WireError};
