//! [`SocketFabric`]: the [`Fabric`] of a node described by the cluster file, using the shm
//! backend for Unix-socket control addresses and the tcp backend for `ip:port` ones.

use crate::config::{ClusterConfig, ControlAddr, NodeConfig};
use crate::fabric::{
    Endpoint, Fabric, FabricError, FabricKind, LinkConfig, Listener, NodeId, PeerInfo, Result,
};
use crate::{shm, tcp};

/// Opens a link to whatever listens at `addr` (its kind picks the backend).
pub fn connect_addr(
    addr: &ControlAddr,
    local: &NodeId,
    cfg: &LinkConfig,
) -> Result<Box<dyn Endpoint>> {
    match addr {
        ControlAddr::Unix(p) => shm::connect(p, local, cfg),
        ControlAddr::Tcp(a) => tcp::connect(*a, local, cfg),
    }
}

/// Listens at `addr`.
pub fn listen_addr(
    addr: &ControlAddr,
    local: &NodeId,
    cfg: &LinkConfig,
) -> Result<Box<dyn Listener>> {
    Ok(match addr {
        ControlAddr::Unix(p) => Box::new(shm::ShmListener::bind(p, local, cfg)?),
        ControlAddr::Tcp(a) => Box::new(tcp::TcpFabricListener::bind(*a, local, cfg)?),
    })
}

/// A node of a cluster.
#[derive(Debug, Clone)]
pub struct SocketFabric {
    local: NodeConfig,
    others: Vec<NodeConfig>,
}

impl SocketFabric {
    pub fn new(local: NodeConfig, others: Vec<NodeConfig>) -> Result<SocketFabric> {
        local.link.validate()?;
        let kind_fits = match local.fabric {
            // A bar node's links are tcp links with its region ([`LinkConfig::region`]).
            FabricKind::Bar => {
                local.control.kind() == FabricKind::Tcp && local.link.region.is_some()
            }
            k => local.control.kind() == k && local.link.region.is_none(),
        };
        if !kind_fits {
            return Err(FabricError::AddressKind(
                local.fabric,
                local.control.to_string(),
            ));
        }
        Ok(SocketFabric { local, others })
    }

    /// The node called `name` in `cluster`.
    pub fn from_cluster(cluster: &ClusterConfig, name: &str) -> Result<SocketFabric> {
        let local = cluster
            .node(name)
            .ok_or_else(|| FabricError::UnknownPeer(name.to_string()))?
            .clone();
        let others = cluster
            .nodes
            .iter()
            .filter(|n| n.name.as_str() != name)
            .cloned()
            .collect();
        Self::new(local, others)
    }

    pub fn config(&self) -> &NodeConfig {
        &self.local
    }
}

impl Fabric for SocketFabric {
    fn local_node(&self) -> &NodeId {
        &self.local.name
    }

    fn peers(&self) -> Vec<PeerInfo> {
        self.others
            .iter()
            .map(|n| PeerInfo {
                node: n.name.clone(),
                kind: n.fabric,
                control: n.control.clone(),
            })
            .collect()
    }

    fn listen(&self) -> Result<Box<dyn Listener>> {
        listen_addr(&self.local.control, &self.local.name, &self.local.link)
    }

    fn connect(&self, peer: &NodeId) -> Result<Box<dyn Endpoint>> {
        let p = self
            .others
            .iter()
            .find(|n| &n.name == peer)
            .ok_or_else(|| FabricError::UnknownPeer(peer.to_string()))?;
        let ep = connect_addr(&p.control, &self.local.name, &self.local.link)?;
        if ep.peer_node() != peer {
            return Err(FabricError::Handshake(format!(
                "{} answered as {}, expected {peer}",
                p.control,
                ep.peer_node()
            )));
        }
        Ok(ep)
    }
}
