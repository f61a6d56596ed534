//! The static cluster file as a directory: the default, with no shared state and nothing to
//! run besides the lenders. Registration is a no-op, claims are implicit in the lender's
//! inventory (a plain `BORROW`), and a snapshot asks every lender of the file in parallel.

use std::sync::Arc;
use std::time::Duration;

use ntb::{ClusterConfig, NodeConfig, NodeId};

use super::{
    ClaimAuthority, ClaimHandle, DeviceRecord, Directory, DirectoryError, DirectoryEvent,
    NodeRecord, Registration, Snapshot,
};
use crate::client::LenderClient;

/// Who asks the lenders when a snapshot fans out.
#[derive(Debug, Clone)]
pub struct FanOut {
    /// Our node name in link handshakes.
    pub local: String,
    /// The cluster token.
    pub token: String,
    /// Client name in the hello.
    pub client: String,
    /// Upper bound on connecting to one lender.
    pub connect_timeout: Duration,
}

/// The `[[node]]` list of a cluster file.
pub struct StaticDirectory {
    cluster: ClusterConfig,
    origin: String,
    fanout: FanOut,
}

impl StaticDirectory {
    /// The directory of `cluster` (read from `origin`).
    pub fn new(cluster: ClusterConfig, origin: String, fanout: FanOut) -> Self {
        StaticDirectory {
            cluster,
            origin,
            fanout,
        }
    }

    fn probe(&self, n: &NodeConfig) -> Result<Vec<DeviceRecord>, String> {
        let local = NodeId::new(&self.fanout.local).map_err(|e| e.to_string())?;
        let c = LenderClient::connect_node(
            &self.cluster,
            n,
            &local,
            self.fanout.connect_timeout,
            &self.fanout.token,
            &self.fanout.client,
        )
        .map_err(|e| e.to_string())?;
        let devs = c.list().map_err(|e| e.to_string())?;
        Ok(devs
            .into_iter()
            .map(|device| DeviceRecord {
                node: n.name.to_string(),
                device,
            })
            .collect())
    }
}

/// Stands for the lender's inventory: never lost, no fencing token.
struct ImplicitClaim;

impl ClaimHandle for ImplicitClaim {
    fn revision(&self) -> Option<i64> {
        None
    }

    fn lost(&self) -> Option<String> {
        None
    }
}

/// Nothing to register with.
struct NoRegistration;

impl Registration for NoRegistration {
    fn update_devices(&self, _: &[DeviceRecord]) {}

    fn lost(&self) -> Option<String> {
        None
    }

    fn claim_authority(&self) -> Option<Arc<dyn ClaimAuthority>> {
        None
    }
}

impl Directory for StaticDirectory {
    fn describe(&self) -> String {
        format!("static file {}", self.origin)
    }

    fn lender(&self, node: &str) -> Result<NodeConfig, DirectoryError> {
        self.cluster
            .node(node)
            .cloned()
            .ok_or_else(|| DirectoryError::UnknownLender {
                node: node.to_string(),
                known: format!(
                    " (nodes: {})",
                    self.cluster
                        .nodes
                        .iter()
                        .map(|n| n.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
    }

    fn snapshot(&self) -> Result<Snapshot, DirectoryError> {
        let results: Vec<(&NodeConfig, Result<Vec<DeviceRecord>, String>)> =
            std::thread::scope(|s| {
                let handles: Vec<_> = self
                    .cluster
                    .nodes
                    .iter()
                    .map(|n| (n, s.spawn(move || self.probe(n))))
                    .collect();
                handles
                    .into_iter()
                    .map(|(n, h)| {
                        (
                            n,
                            h.join()
                                .unwrap_or_else(|_| Err("the probe thread panicked".into())),
                        )
                    })
                    .collect()
            });
        let mut snap = Snapshot::default();
        for (n, r) in results {
            match r {
                Ok(devs) => {
                    snap.nodes.push(NodeRecord::from_config(n));
                    snap.devices.extend(devs);
                }
                Err(e) => snap.unreachable.push((n.name.to_string(), e)),
            }
        }
        Ok(snap)
    }

    fn register(
        &self,
        _: &NodeRecord,
        _: &[DeviceRecord],
    ) -> Result<Box<dyn Registration>, DirectoryError> {
        Ok(Box::new(NoRegistration))
    }

    fn claim(
        &self,
        node: &str,
        _: &str,
        _: &str,
        _: &str,
    ) -> Result<Box<dyn ClaimHandle>, DirectoryError> {
        self.lender(node)?;
        Ok(Box::new(ImplicitClaim))
    }

    fn take_over_claim(
        &self,
        _: &str,
        _: &str,
        _: i64,
        _: &str,
        _: &str,
    ) -> Result<Box<dyn ClaimHandle>, DirectoryError> {
        // Its claims are implicit and carry no revision: nothing to take over.
        Err(DirectoryError::Unsupported {
            backend: "static",
            what: "take a claim over",
        })
    }

    fn watch(
        &self,
    ) -> Result<std::sync::mpsc::Receiver<Result<DirectoryEvent, DirectoryError>>, DirectoryError>
    {
        Err(DirectoryError::Unsupported {
            backend: "static file",
            what: "watch for changes (it has no shared state; use an etcd directory)",
        })
    }
}
