//! The cluster directory: where borrowers find lenders, what devices exist, and who holds
//! which device, behind one trait with two backends.
//!
//! * [`static_file::StaticDirectory`] (the default): the cluster file's `[[node]]` list. No
//!   shared state: a lender's inventory is the only record of who holds a device, `list`
//!   asks every lender in turn, a borrower's claim is implicit in the lender's `BORROW`.
//! * [`etcd::EtcdDirectory`] (`--cluster etcd://host:port[,...]` or a `[directory]` table):
//!   lenders register a node record and one record per device under an etcd lease with a
//!   TTL that they keep alive (a clean stop revokes it; a crash lets it expire); borrowers
//!   claim a device with a create-if-absent transaction under their own lease and borrow with
//!   the claim's revision as a fencing token ([`crate::protocol::BorrowClaimed`]); lenders
//!   check that token ([`ClaimAuthority`]) and end a lease whose claim disappears.
//!
//! Keys (etcd, below the prefix, `/lendvm` by default; values are JSON):
//!
//! | key | value | lease |
//! |---|---|---|
//! | `nodes/<node>` | [`NodeRecord`] | the lender's |
//! | `devices/<node>/<bdf>` | [`DeviceRecord`] | the lender's |
//! | `claims/<node>/<bdf>` | [`ClaimRecord`] | the borrower's |
//!
//! Failure semantics (what wins, and why) are in `docs/DIRECTORY.md`.

pub mod etcd;
pub mod static_file;
#[cfg(feature = "testing")]
pub mod testing;

use std::sync::Arc;
use std::time::Duration;

use ntb::fabric::WindowLimits;
use ntb::{
    ClusterConfig, ControlAddr, DirectoryConfig, FabricKind, LinkConfig, NodeConfig, NodeId,
};
use serde::{Deserialize, Serialize};

use crate::protocol::DeviceSummary;

/// Errors of the cluster directory.
#[derive(Debug, thiserror::Error)]
pub enum DirectoryError {
    /// etcd answered with an error, or could not be reached.
    #[error("etcd {op}: {source}")]
    Etcd {
        op: String,
        #[source]
        source: etcd_client::Error,
    },
    /// etcd did not answer in time.
    #[error("etcd {op}: no answer within {timeout:?} (endpoints {endpoints})")]
    Timeout {
        op: String,
        timeout: Duration,
        endpoints: String,
    },
    /// A record in the directory is not what this version writes.
    #[error("directory key {key}: {message}")]
    BadRecord { key: String, message: String },
    /// No such lender in the directory.
    #[error("lender {node} is not in the directory{known}")]
    UnknownLender { node: String, known: String },
    /// The lender has no such device registered.
    #[error("lender {node} has no device {bdf} in the directory")]
    UnknownDevice { node: String, bdf: String },
    /// Someone else holds the claim.
    #[error("{node}:{bdf} is claimed by {holder}/{vm} (claim revision {revision})")]
    Claimed {
        node: String,
        bdf: String,
        holder: String,
        vm: String,
        revision: i64,
    },
    /// The claim to take over is no longer there (released or expired).
    #[error("the claim on {node}:{bdf} (revision {revision}) is gone (released or expired)")]
    ClaimGone {
        node: String,
        bdf: String,
        revision: i64,
    },
    /// This backend cannot do that.
    #[error("the {backend} directory cannot {what}")]
    Unsupported {
        backend: &'static str,
        what: &'static str,
    },
    /// The process could not start the directory's runtime.
    #[error("starting the etcd client runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The directory settings do not go together (see [`DirectoryConfig::validate`]).
    #[error("{0}")]
    Config(String),
    /// A TLS or password file could not be read.
    #[error("etcd {what} file {path}: {source}")]
    Credential {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A private key or password file that others may read.
    #[error(
        "etcd {what} file {path} has mode {mode:04o}: group or others may read it; \
         run `chmod 600 {path}`"
    )]
    CredentialMode {
        what: &'static str,
        path: String,
        mode: u32,
    },
    /// The first call to etcd failed: the endpoints, what etcd or the TLS layer said, and a
    /// hint at the usual cause.
    #[error("etcd at {endpoints} cannot be used: {detail}{hint}")]
    Connect {
        endpoints: String,
        detail: String,
        hint: String,
    },
    /// Claims are signed with the cluster secret; this directory was opened without it.
    #[error("claiming {node}:{bdf} needs the cluster secret (claims are signed with it)")]
    NoClaimSecret { node: String, bdf: String },
}

/// A lender as the directory records it: enough for a borrower to open a fabric link.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub name: String,
    /// `shm` or `tcp`.
    pub fabric: String,
    /// Control address (Unix socket path or `ip:port`).
    pub control: String,
    pub windows: u32,
    pub window_align: u64,
    pub max_window_size: u64,
    pub doorbells: u32,
    pub scratchpads: u32,
    pub heartbeat_ms: u64,
    pub peer_timeout_ms: u64,
    pub connect_timeout_ms: u64,
    pub require_sealed_windows: bool,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl NodeRecord {
    /// The record of a node of the cluster file.
    pub fn from_config(n: &NodeConfig) -> Self {
        NodeRecord {
            name: n.name.to_string(),
            fabric: n.fabric.to_string(),
            control: n.control.to_string(),
            windows: n.link.limits.max_windows,
            window_align: n.link.limits.addr_align,
            max_window_size: n.link.limits.max_size,
            doorbells: n.link.doorbells,
            scratchpads: n.link.scratchpads,
            heartbeat_ms: ms(n.link.heartbeat),
            peer_timeout_ms: ms(n.link.peer_timeout),
            connect_timeout_ms: ms(n.link.connect_timeout),
            require_sealed_windows: n.link.require_sealed_windows,
        }
    }

    /// The node config a fabric link needs; checks the record like the cluster file would.
    pub fn to_config(&self) -> Result<NodeConfig, DirectoryError> {
        let bad = |message: String| DirectoryError::BadRecord {
            key: format!("nodes/{}", self.name),
            message,
        };
        let name = NodeId::new(&self.name).map_err(|e| bad(e.to_string()))?;
        let fabric = match self.fabric.as_str() {
            "shm" => FabricKind::Shm,
            "tcp" => FabricKind::Tcp,
            // Each host names its own view of a bar node's shared region (a file here, a BAR
            // there), which a cluster-wide record cannot carry.
            "bar" => {
                return Err(bad(
                    "a bar node's shared region is per host: describe it in a cluster file".into(),
                ))
            }
            other => return Err(bad(format!("unknown fabric {other:?}"))),
        };
        let control = ControlAddr::parse(fabric, &self.control).map_err(bad)?;
        let link = LinkConfig {
            limits: WindowLimits {
                max_windows: self.windows,
                addr_align: self.window_align,
                size_align: self.window_align,
                max_size: self.max_window_size,
            },
            doorbells: self.doorbells,
            scratchpads: self.scratchpads,
            heartbeat: Duration::from_millis(self.heartbeat_ms),
            peer_timeout: Duration::from_millis(self.peer_timeout_ms),
            connect_timeout: Duration::from_millis(self.connect_timeout_ms),
            // Not in a directory record: a borrower's own bound on its requests.
            request_timeout: LinkConfig::default().request_timeout,
            require_sealed_windows: self.require_sealed_windows,
            region: None,
            // A lender's own listener limits, from its own cluster file: not a record's.
            preauth: ntb::PreauthLimits::default(),
            // The listener's own socket group, from its own configuration: not a record's.
            control_group: None,
        };
        link.validate().map_err(|e| bad(e.to_string()))?;
        Ok(NodeConfig {
            name,
            fabric,
            control,
            link,
            // A borrower's placement, from its own cluster file: not in a lender's record.
            numa_node: None,
        })
    }
}

/// One device of one lender.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRecord {
    pub node: String,
    pub device: DeviceSummary,
}

/// A borrower's claim on a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimRecord {
    /// Lender node.
    pub node: String,
    /// Device on the lender.
    pub bdf: String,
    /// Borrower's node name on the fabric.
    pub holder: String,
    /// Borrowing VM.
    pub vm: String,
    /// The etcd lease the record was written under (its id). The MAC covers it, and a lender
    /// takes the record only from a key that this very lease holds: a signed record put
    /// again later (replayed, or moved onto another borrower's key) is under another lease
    /// or none and is refused. The lease's TTL is so the record's expiry as well: once the
    /// lease is gone no put can attach the record to it again. 0 in records of lendvms from
    /// before the binding, which lenders refuse.
    #[serde(default)]
    pub lease: i64,
    /// HMAC-SHA256 (hex) over the fields above with a key derived from the cluster secret
    /// (`etcd::secure`): lenders ignore a claim whose MAC does not check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

/// A claim with its revision (the fencing token).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    #[serde(flatten)]
    pub record: ClaimRecord,
    pub revision: i64,
}

/// Everything the directory knows, read at one revision.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Snapshot {
    /// The store revision the read saw (0 for the static file).
    pub revision: i64,
    pub nodes: Vec<NodeRecord>,
    pub devices: Vec<DeviceRecord>,
    pub claims: Vec<Claim>,
    /// Lenders that could not be asked (static file fan-out): node, error.
    pub unreachable: Vec<(String, String)>,
}

impl Snapshot {
    /// The claim on `node`'s `bdf`, if any.
    pub fn claim(&self, node: &str, bdf: &str) -> Option<&Claim> {
        self.claims
            .iter()
            .find(|c| c.record.node == node && c.record.bdf == bdf)
    }
}

/// A change seen by [`Directory::watch`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "event", rename_all = "kebab-case")]
pub enum DirectoryEvent {
    NodeUp {
        revision: i64,
        node: NodeRecord,
    },
    NodeGone {
        revision: i64,
        node: String,
    },
    Device {
        revision: i64,
        device: DeviceRecord,
    },
    DeviceGone {
        revision: i64,
        node: String,
        bdf: String,
    },
    Claimed {
        revision: i64,
        claim: Claim,
    },
    Released {
        revision: i64,
        node: String,
        bdf: String,
    },
}

/// A lender's registration; dropping it takes the lender out of the directory at once.
pub trait Registration: Send + Sync {
    /// Publishes the devices' current states (only changed records are written).
    fn update_devices(&self, devices: &[DeviceRecord]);
    /// Why the registration is not in force right now (its lease could not be renewed
    /// within the TTL), if it is not. It is re-established in the background.
    fn lost(&self) -> Option<String>;
    /// The claims that fence this lender's leases, if the directory has claims.
    fn claim_authority(&self) -> Option<Arc<dyn ClaimAuthority>>;
    /// The round trip of the last renewal of the registration's lease (metrics). Default:
    /// not measured.
    fn keepalive_latency(&self) -> Option<std::time::Duration> {
        None
    }
}

/// A borrower's claim on a device; dropping it releases the claim.
pub trait ClaimHandle: Send + Sync {
    /// The claim's revision to present with the borrow (`None`: no claims, plain borrow).
    fn revision(&self) -> Option<i64>;
    /// Why the device must be treated as lost (the lender or the device left the directory,
    /// or the claim ended), if it must.
    fn lost(&self) -> Option<String>;
    /// Calls `f` once when the device becomes lost (at once if it already is), from the
    /// directory's own threads, so the VMM hears of it as an event. Default: a claim that
    /// can never be lost (the static file's implicit claim).
    fn on_lost(&self, f: LossCallback) {
        let _ = f;
    }
}

/// Told why a claimed device is lost (must not block).
pub type LossCallback = Arc<dyn Fn(&str) + Send + Sync>;

/// The first reason a claim was lost, and who to tell.
#[derive(Default)]
pub struct LossCell {
    why: std::sync::Mutex<Option<String>>,
    tell: std::sync::Mutex<Option<LossCallback>>,
}

impl LossCell {
    fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `why` unless a reason is recorded already; the first one is told.
    pub fn set(&self, why: &str) {
        let first = {
            let mut w = Self::lock(&self.why);
            if w.is_some() {
                false
            } else {
                *w = Some(why.to_string());
                true
            }
        };
        if first {
            let tell = Self::lock(&self.tell).clone();
            if let Some(f) = tell {
                f(why);
            }
        }
    }

    /// The recorded reason.
    pub fn get(&self) -> Option<String> {
        Self::lock(&self.why).clone()
    }

    /// Registers who to tell; told at once if the reason is already recorded.
    pub fn on_lost(&self, f: LossCallback) {
        *Self::lock(&self.tell) = Some(f.clone());
        if let Some(why) = self.get() {
            f(&why);
        }
    }
}

/// The lender's view of the claims on its devices.
pub trait ClaimAuthority: Send + Sync {
    /// Checks, against the directory itself (not a cache), that `revision` is the current
    /// claim on `device` and that it names `holder`/`vm`; the error says why not.
    fn verify(&self, device: &str, holder: &str, vm: &str, revision: i64) -> Result<(), String>;
    /// Whether the claim `revision` on `device` is still current as far as this lender has
    /// seen (cheap; called every poll period for every fenced lease).
    fn is_current(&self, device: &str, revision: i64) -> bool;
}

/// A cluster directory (see the module docs).
pub trait Directory: Send + Sync {
    /// `static file PATH` or `etcd a:1,b:2 (prefix /lendvm)`.
    fn describe(&self) -> String;
    /// Where lender `node` listens.
    fn lender(&self, node: &str) -> Result<NodeConfig, DirectoryError>;
    /// Every node, device and claim (etcd: one range read).
    fn snapshot(&self) -> Result<Snapshot, DirectoryError>;
    /// Registers lender `node` with its devices.
    fn register(
        &self,
        node: &NodeRecord,
        devices: &[DeviceRecord],
    ) -> Result<Box<dyn Registration>, DirectoryError>;
    /// Claims `node`'s `bdf` for `holder`/`vm`.
    fn claim(
        &self,
        node: &str,
        bdf: &str,
        holder: &str,
        vm: &str,
    ) -> Result<Box<dyn ClaimHandle>, DirectoryError>;
    /// Takes over the claim on `node`'s `bdf` whose revision is `revision` for `holder`/`vm`
    /// (live migration: the destination VMM takes the source's claim with the lease). The
    /// claim keeps its revision, so the lender's fencing of the moved lease holds; it is
    /// refused if the claim has changed since (released, expired, claimed anew).
    fn take_over_claim(
        &self,
        node: &str,
        bdf: &str,
        revision: i64,
        holder: &str,
        vm: &str,
    ) -> Result<Box<dyn ClaimHandle>, DirectoryError>;
    /// Streams changes from now on; the stream ends with an error when the watch fails for
    /// good. Bounded: `lendctl watch` stops after its own limits.
    fn watch(
        &self,
    ) -> Result<std::sync::mpsc::Receiver<Result<DirectoryEvent, DirectoryError>>, DirectoryError>;
}

/// Opens the directory a `--cluster` value names: `etcd://host:port[,...]` is etcd with
/// defaults; a file is the static directory unless it has a `[directory]` table. Returns
/// the cluster file too (link timers, token), when there is one.
pub fn open(
    cluster: &str,
    fanout: static_file::FanOut,
) -> Result<(Arc<dyn Directory>, Option<ClusterConfig>), String> {
    // Claims are signed with the cluster secret the fan-out authenticates with.
    let secret = Some(fanout.token.as_str()).filter(|t| !t.is_empty());
    if cluster.starts_with("etcd://") {
        let cfg = DirectoryConfig::from_url(cluster)?;
        let d = etcd::EtcdDirectory::connect(&cfg, secret).map_err(|e| e.to_string())?;
        return Ok((Arc::new(d), None));
    }
    let file = ClusterConfig::load(std::path::Path::new(cluster)).map_err(|e| e.to_string())?;
    let dir: Arc<dyn Directory> = match &file.directory {
        Some(cfg) => {
            Arc::new(etcd::EtcdDirectory::connect(cfg, secret).map_err(|e| e.to_string())?)
        }
        None => Arc::new(static_file::StaticDirectory::new(
            file.clone(),
            cluster.to_string(),
            fanout,
        )),
    };
    Ok((dir, Some(file)))
}

/// A one-node cluster description for a link to `node` (a directory lender need not be in
/// any cluster file).
pub fn cluster_of(node: NodeConfig) -> ClusterConfig {
    ClusterConfig {
        nodes: vec![node],
        token: None,
        directory: None,
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn loss_cell_tells_the_first_reason_once_even_when_registered_late() {
        let told = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let cell = LossCell::default();
        cell.set("lender left");
        cell.set("claim ended");
        assert_eq!(cell.get().as_deref(), Some("lender left"));
        let t = told.clone();
        cell.on_lost(Arc::new(move |why: &str| {
            t.lock().unwrap().push(why.to_string())
        }));
        assert_eq!(*told.lock().unwrap(), ["lender left"]);
        let early = LossCell::default();
        let t = told.clone();
        early.on_lost(Arc::new(move |why: &str| {
            t.lock().unwrap().push(why.to_string())
        }));
        early.set("device left");
        early.set("again");
        assert_eq!(*told.lock().unwrap(), ["lender left", "device left"]);
    }
    use super::*;

    #[test]
    fn node_records_round_trip_through_the_cluster_config() {
        let c = ClusterConfig::parse(
            "version = 1\n[[node]]\nname = \"n1\"\nfabric = \"tcp\"\ncontrol = \"127.0.0.1:7700\"\n\
             windows = 4\ndoorbells = 32\n",
            "t",
        )
        .unwrap();
        let r = NodeRecord::from_config(&c.nodes[0]);
        assert_eq!(r.fabric, "tcp");
        assert_eq!(r.to_config().unwrap(), c.nodes[0]);
        let bad = NodeRecord {
            control: "nowhere".into(),
            ..r.clone()
        };
        let e = bad.to_config().unwrap_err().to_string();
        assert!(e.starts_with("directory key nodes/n1:"), "{e}");
        let bad = NodeRecord { doorbells: 0, ..r };
        assert!(bad.to_config().is_err());
    }
}
