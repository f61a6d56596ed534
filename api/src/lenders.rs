//! `lendctl`'s lender commands: ask the lenders of a cluster (`lenderd` on every node of the
//! cluster file) for their devices and status over the fabric, with the lender control
//! protocol client ([`lending::client::LenderClient`]).
//!
//! `lendctl` is not a node of the cluster: it connects under an ad-hoc node name
//! (`lendctl-<pid>` unless `--node` names one) straight to the lender's control address, so
//! the cluster file does not need an entry for it. A lender only checks the cluster token.

use std::time::Duration;

use lending::client::{ClientError, LenderClient};
use lending::directory::{DirectoryEvent, Snapshot};
use lending::protocol::{DeviceState, DeviceSummary, HelloReply, LenderStatus};
use ntb::{ClusterConfig, NodeConfig, NodeId};
use serde::Serialize;

/// The client name lendctl gives in its hello (lenderd logs it).
pub const CLIENT_NAME: &str = "lendctl";

/// Errors of the lender commands.
#[derive(Debug, thiserror::Error)]
pub enum LendersError {
    #[error("lender {lender} is not in the cluster file (nodes: {known})")]
    UnknownLender { lender: String, known: String },
    #[error("lender {lender} is unreachable: {message}")]
    Unreachable { lender: String, message: String },
    #[error("lender {lender}: {source}")]
    Request {
        lender: String,
        #[source]
        source: ClientError,
    },
}

/// Who lendctl is on the fabric and how it authenticates.
#[derive(Debug, Clone)]
pub struct Session {
    /// Our node name in the link handshake.
    pub local: NodeId,
    /// The cluster token.
    pub token: String,
    /// Upper bound on connecting (the cluster's `connect_timeout_ms` applies too).
    pub connect_timeout: Duration,
}

impl Session {
    /// Opens a link to `lender` and says hello. The link settings are those of the local node
    /// if `local` is in the cluster file, otherwise the lender's (the cluster-wide timers; a
    /// lendctl session exports nothing, so the window limits do not matter).
    pub fn connect(
        &self,
        cluster: &ClusterConfig,
        lender: &NodeConfig,
    ) -> Result<LenderClient, LendersError> {
        let unreachable = |message: String| LendersError::Unreachable {
            lender: lender.name.to_string(),
            message,
        };
        LenderClient::connect_node(
            cluster,
            lender,
            &self.local,
            self.connect_timeout,
            &self.token,
            CLIENT_NAME,
        )
        .map_err(|e| match e {
            ClientError::Connect { source, .. } => {
                unreachable(format!("{} ({}): {source}", lender.control, lender.fabric))
            }
            ClientError::Remote { message, .. } => unreachable(format!("refused: {message}")),
            other => unreachable(other.to_string()),
        })
    }

    /// Connects to every node of the cluster in parallel and lists its devices.
    pub fn probe_all<'a>(&self, cluster: &'a ClusterConfig) -> Vec<Probe<'a>> {
        std::thread::scope(|s| {
            let handles: Vec<_> = cluster
                .nodes
                .iter()
                .map(|n| (n, s.spawn(move || self.probe(cluster, n))))
                .collect();
            handles
                .into_iter()
                .map(|(node, h)| Probe {
                    node,
                    result: h.join().unwrap_or_else(|_| {
                        Err(LendersError::Unreachable {
                            lender: node.name.to_string(),
                            message: "internal: the probe thread panicked".into(),
                        })
                    }),
                })
                .collect()
        })
    }

    /// Connects to one lender and lists its devices.
    pub fn probe(
        &self,
        cluster: &ClusterConfig,
        node: &NodeConfig,
    ) -> Result<Vec<DeviceSummary>, LendersError> {
        let c = self.connect(cluster, node)?;
        c.list().map_err(|source| LendersError::Request {
            lender: node.name.to_string(),
            source,
        })
    }

    /// One lender's status (with what it said at hello).
    pub fn status(
        &self,
        cluster: &ClusterConfig,
        node: &NodeConfig,
    ) -> Result<StatusView, LendersError> {
        let c = self.connect(cluster, node)?;
        let st = c.status().map_err(|source| LendersError::Request {
            lender: node.name.to_string(),
            source,
        })?;
        Ok(StatusView::new(c.hello(), &st))
    }
}

/// The node called `name` in `cluster`.
pub fn lender<'a>(cluster: &'a ClusterConfig, name: &str) -> Result<&'a NodeConfig, LendersError> {
    cluster
        .node(name)
        .ok_or_else(|| LendersError::UnknownLender {
            lender: name.to_string(),
            known: cluster
                .nodes
                .iter()
                .map(|n| n.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// The outcome of asking one lender for its devices.
#[derive(Debug)]
pub struct Probe<'a> {
    pub node: &'a NodeConfig,
    pub result: Result<Vec<DeviceSummary>, LendersError>,
}

/// One row of `lendctl lenders`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LenderRow {
    pub node: String,
    pub fabric: String,
    pub control: String,
    pub reachable: bool,
    /// Why it is not reachable.
    pub error: Option<String>,
    /// Number of devices (when reachable).
    pub devices: Option<usize>,
}

impl LenderRow {
    pub fn new(p: &Probe<'_>) -> Self {
        LenderRow {
            node: p.node.name.to_string(),
            fabric: p.node.fabric.to_string(),
            control: p.node.control.to_string(),
            reachable: p.result.is_ok(),
            error: p.result.as_ref().err().map(short_error),
            devices: p.result.as_ref().ok().map(Vec::len),
        }
    }
}

/// An error without the "lender X is unreachable:" prefix (the row already names it).
fn short_error(e: &LendersError) -> String {
    match e {
        LendersError::Unreachable { message, .. } => message.clone(),
        other => other.to_string(),
    }
}

/// Who holds a lent device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Borrower {
    pub node: String,
    pub vm: String,
}

/// One device of one lender (`lendctl list`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceRow {
    /// Lender node.
    pub node: String,
    /// PCI address on the lender.
    pub bdf: String,
    /// `nvme`, `dmatest`, `vfio`.
    pub kind: String,
    pub vendor_id: u16,
    pub device_id: u16,
    /// 0xBBSSPP.
    pub class: u32,
    /// `available`, `lent`, `releasing`, `resetting`, `failed`.
    pub state: &'static str,
    /// The borrower, when lent.
    pub lent_to: Option<Borrower>,
    /// The borrower whose lease is being taken back, when releasing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub released_from: Option<Borrower>,
    /// Why the device failed.
    pub reason: Option<String>,
    /// The directory claim on the device (etcd directory only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub claim: Option<ClaimView>,
}

/// A directory claim: who holds it and its revision (the fencing token).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClaimView {
    pub node: String,
    pub vm: String,
    pub revision: i64,
}

impl DeviceRow {
    pub fn new(node: &str, d: &DeviceSummary) -> Self {
        let borrower = |node: &String, vm: &String| {
            Some(Borrower {
                node: node.clone(),
                vm: vm.clone(),
            })
        };
        let (state, lent_to, released_from, reason) = match &d.state {
            DeviceState::Available => ("available", None, None, None),
            DeviceState::Lent { node, vm } => ("lent", borrower(node, vm), None, None),
            DeviceState::Releasing { node, vm } => ("releasing", None, borrower(node, vm), None),
            DeviceState::Resetting => ("resetting", None, None, None),
            DeviceState::Failed { reason } => ("failed", None, None, Some(reason.clone())),
        };
        DeviceRow {
            node: node.to_string(),
            bdf: d.id.clone(),
            kind: d.kind.clone(),
            vendor_id: d.vendor_id,
            device_id: d.device_id,
            class: d.class,
            state,
            lent_to,
            released_from,
            reason,
            claim: None,
        }
    }

    /// `available`, `lent to node1/vm0`, `releasing (was lent to node1/vm0)`, `resetting`,
    /// `failed: why`; a claim not yet (or no longer) matched by a lease shows as
    /// `claimed by node1/vm0`.
    pub fn state_text(&self) -> String {
        if let (None, Some(c)) = (&self.lent_to, &self.claim) {
            return format!("{} (claimed by {}/{})", self.state, c.node, c.vm);
        }
        if let Some(b) = &self.released_from {
            return format!("{} (was lent to {}/{})", self.state, b.node, b.vm);
        }
        match (&self.lent_to, &self.reason) {
            (Some(b), _) => format!("lent to {}/{}", b.node, b.vm),
            (None, Some(r)) => format!("{}: {r}", self.state),
            (None, None) => self.state.to_string(),
        }
    }
}

/// A lender that could not be asked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Unreachable {
    pub node: String,
    pub error: String,
}

/// `lendctl list`: the devices of the lenders that answered, and those that did not.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DeviceList {
    pub devices: Vec<DeviceRow>,
    pub unreachable: Vec<Unreachable>,
}

impl DeviceList {
    pub fn new(probes: &[Probe<'_>]) -> Self {
        let mut out = DeviceList::default();
        for p in probes {
            let node = p.node.name.as_str();
            match &p.result {
                Ok(devs) => out
                    .devices
                    .extend(devs.iter().map(|d| DeviceRow::new(node, d))),
                Err(e) => out.unreachable.push(Unreachable {
                    node: node.to_string(),
                    error: short_error(e),
                }),
            }
        }
        out
    }
}

impl DeviceList {
    /// The rows of a directory snapshot (every registered device with its claim).
    pub fn from_snapshot(s: &Snapshot) -> Self {
        let mut out = DeviceList::default();
        for d in &s.devices {
            let mut row = DeviceRow::new(&d.node, &d.device);
            row.claim = s.claim(&d.node, &d.device.id).map(|c| ClaimView {
                node: c.record.holder.clone(),
                vm: c.record.vm.clone(),
                revision: c.revision,
            });
            out.devices.push(row);
        }
        out.devices
            .sort_by(|a, b| (&a.node, &a.bdf).cmp(&(&b.node, &b.bdf)));
        out.unreachable = s
            .unreachable
            .iter()
            .map(|(node, error)| Unreachable {
                node: node.clone(),
                error: error.clone(),
            })
            .collect();
        out
    }
}

/// `lendctl lenders` from a directory: every registered lender (registered means alive
/// within its lease TTL).
pub fn directory_lenders(s: &Snapshot) -> Vec<LenderRow> {
    let mut rows: Vec<LenderRow> = s
        .nodes
        .iter()
        .map(|n| LenderRow {
            node: n.name.clone(),
            fabric: n.fabric.clone(),
            control: n.control.clone(),
            reachable: true,
            error: None,
            devices: Some(s.devices.iter().filter(|d| d.node == n.name).count()),
        })
        .collect();
    rows.sort_by(|a, b| a.node.cmp(&b.node));
    rows
}

/// One line of `lendctl watch`.
pub fn render_event(e: &DirectoryEvent) -> String {
    match e {
        DirectoryEvent::NodeUp { revision, node } => format!(
            "{revision} lender-up {} {} {}",
            node.name, node.fabric, node.control
        ),
        DirectoryEvent::NodeGone { revision, node } => format!("{revision} lender-gone {node}"),
        DirectoryEvent::Device { revision, device } => format!(
            "{revision} device {}:{} {}",
            device.node, device.device.id, device.device.state
        ),
        DirectoryEvent::DeviceGone {
            revision,
            node,
            bdf,
        } => format!("{revision} device-gone {node}:{bdf}"),
        DirectoryEvent::Claimed { revision, claim } => format!(
            "{revision} claimed {}:{} by {}/{} (claim {})",
            claim.record.node,
            claim.record.bdf,
            claim.record.holder,
            claim.record.vm,
            claim.revision
        ),
        DirectoryEvent::Released {
            revision,
            node,
            bdf,
        } => format!("{revision} released {node}:{bdf}"),
    }
}

/// A live DMA mapping.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DmaMapView {
    pub iova: u64,
    pub size: u64,
}

/// One device in `lendctl status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceStatusView {
    #[serde(flatten)]
    pub device: DeviceRow,
    pub dma_maps: Vec<DmaMapView>,
    pub iommu_faults: u64,
    pub leases_granted: u64,
}

/// `lendctl --lender NODE status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StatusView {
    pub node: String,
    pub protocol_version: u32,
    pub uptime_secs: u64,
    pub max_dma_maps: u32,
    pub max_bar_access: u32,
    pub devices: Vec<DeviceStatusView>,
}

impl StatusView {
    pub fn new(hello: &HelloReply, st: &LenderStatus) -> Self {
        StatusView {
            node: st.node.clone(),
            protocol_version: hello.version,
            uptime_secs: st.uptime_secs,
            max_dma_maps: hello.max_dma_maps,
            max_bar_access: hello.max_bar_access,
            devices: st
                .devices
                .iter()
                .map(|d| DeviceStatusView {
                    device: DeviceRow::new(&st.node, &d.summary),
                    dma_maps: d
                        .dma_maps
                        .iter()
                        .map(|&(iova, size)| DmaMapView { iova, size })
                        .collect(),
                    iommu_faults: d.iommu_faults,
                    leases_granted: d.leases_granted,
                })
                .collect(),
        }
    }
}

/// Renders rows as space-separated columns padded to the widest cell (the last column is not
/// padded).
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                s.push_str(cell);
            } else {
                s.push_str(&format!("{cell:<w$}  "));
            }
        }
        s
    };
    let mut out = line(header.to_vec());
    for row in rows {
        out.push('\n');
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

/// The `lendctl lenders` table.
pub fn render_lenders(rows: &[LenderRow]) -> String {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.node.clone(),
                r.fabric.clone(),
                r.control.clone(),
                r.devices.map_or_else(|| "-".into(), |n| n.to_string()),
                match &r.error {
                    None => "yes".into(),
                    Some(e) => format!("no: {e}"),
                },
            ]
        })
        .collect();
    table(
        &["NODE", "FABRIC", "CONTROL", "DEVICES", "REACHABLE"],
        &cells,
    )
}

/// The `lendctl list` table (like `smartio_tool list`).
pub fn render_devices(devices: &[DeviceRow]) -> String {
    if devices.is_empty() {
        return "no devices".into();
    }
    let cells: Vec<Vec<String>> = devices
        .iter()
        .map(|d| {
            vec![
                d.node.clone(),
                d.bdf.clone(),
                d.kind.clone(),
                format!("{:04x}:{:04x}", d.vendor_id, d.device_id),
                format!("{:06x}", d.class),
                d.state_text(),
            ]
        })
        .collect();
    table(
        &["NODE", "BDF", "KIND", "VENDOR:DEVICE", "CLASS", "STATE"],
        &cells,
    )
}

fn human_duration(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m {s}s"),
        (0, _, _) => format!("{h}h {m}m {s}s"),
        _ => format!("{d}d {h}h {m}m"),
    }
}

/// The `lendctl --lender NODE status` report.
pub fn render_status(st: &StatusView) -> String {
    let mut out = format!(
        "lender {}: up {}, protocol v{}, {} device{}, at most {} DMA maps per lease\n",
        st.node,
        human_duration(st.uptime_secs),
        st.protocol_version,
        st.devices.len(),
        if st.devices.len() == 1 { "" } else { "s" },
        st.max_dma_maps,
    );
    if st.devices.is_empty() {
        out.push_str("\nno devices");
        return out;
    }
    let cells: Vec<Vec<String>> = st
        .devices
        .iter()
        .map(|d| {
            vec![
                d.device.bdf.clone(),
                d.device.kind.clone(),
                d.device.state_text(),
                d.leases_granted.to_string(),
                d.iommu_faults.to_string(),
                if d.dma_maps.is_empty() {
                    "-".into()
                } else {
                    d.dma_maps
                        .iter()
                        .map(|m| format!("{:#x}+{:#x}", m.iova, m.size))
                        .collect::<Vec<_>>()
                        .join(", ")
                },
            ]
        })
        .collect();
    out.push('\n');
    out.push_str(&table(
        &[
            "BDF",
            "KIND",
            "STATE",
            "LEASES GRANTED",
            "IOMMU FAULTS",
            "DMA WINDOWS (IOVA+SIZE)",
        ],
        &cells,
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use lending::protocol::DeviceStatus;

    fn summary(state: DeviceState) -> DeviceSummary {
        DeviceSummary {
            id: "0000:00:04.0".into(),
            kind: "dmatest".into(),
            vendor_id: 0x1b36,
            device_id: 0x1105,
            class: 0xff0000,
            state,
        }
    }

    #[test]
    fn device_rows_name_the_state() {
        let lent = DeviceRow::new(
            "node3",
            &summary(DeviceState::Lent {
                node: "node1".into(),
                vm: "vm0".into(),
            }),
        );
        assert_eq!(lent.state, "lent");
        assert_eq!(lent.state_text(), "lent to node1/vm0");
        let failed = DeviceRow::new(
            "node3",
            &summary(DeviceState::Failed {
                reason: "reset timed out".into(),
            }),
        );
        assert_eq!(failed.state_text(), "failed: reset timed out");
        // A lease being taken back is not lent any more, and says whose it was.
        let releasing = DeviceRow::new(
            "node3",
            &summary(DeviceState::Releasing {
                node: "node1".into(),
                vm: "vm0".into(),
            }),
        );
        assert_eq!(releasing.state, "releasing");
        assert_eq!(releasing.lent_to, None);
        assert_eq!(releasing.state_text(), "releasing (was lent to node1/vm0)");
        let j = serde_json::to_value(&releasing).unwrap();
        assert_eq!(j["state"], "releasing");
        assert_eq!(j["released_from"]["node"], "node1");
        assert!(j["lent_to"].is_null());
        let t = render_devices(&[DeviceRow::new("node3", &summary(DeviceState::Available))]);
        assert_eq!(
            t,
            "NODE   BDF           KIND     VENDOR:DEVICE  CLASS   STATE\n\
             node3  0000:00:04.0  dmatest  1b36:1105      ff0000  available"
        );
        let j = serde_json::to_value(&lent).unwrap();
        assert_eq!(j["lent_to"]["vm"], "vm0");
        assert_eq!(j["state"], "lent");
    }

    #[test]
    fn status_renders_maps_and_counters() {
        let hello = HelloReply {
            version: 1,
            node: "node3".into(),
            max_bar_access: 4096,
            max_dma_maps: 64,
        };
        let st = LenderStatus {
            node: "node3".into(),
            uptime_secs: 3725,
            devices: vec![DeviceStatus {
                summary: summary(DeviceState::Resetting),
                dma_maps: vec![(0x10_0000, 0x8000), (0x20_0000, 0x1000)],
                iommu_faults: 2,
                leases_granted: 5,
            }],
        };
        let v = StatusView::new(&hello, &st);
        let t = render_status(&v);
        assert!(
            t.starts_with("lender node3: up 1h 2m 5s, protocol v1, 1 device,"),
            "{t}"
        );
        let row = t.lines().last().unwrap();
        assert!(
            row.contains("resetting") && row.ends_with("0x100000+0x8000, 0x200000+0x1000"),
            "{row}"
        );
        let j = serde_json::to_value(&v).unwrap();
        assert_eq!(j["devices"][0]["bdf"], "0000:00:04.0");
        assert_eq!(j["devices"][0]["iommu_faults"], 2);
        assert_eq!(j["devices"][0]["dma_maps"][1]["size"], 0x1000);
    }

    #[test]
    fn durations_are_short() {
        assert_eq!(human_duration(5), "5s");
        assert_eq!(human_duration(65), "1m 5s");
        assert_eq!(human_duration(90061), "1d 1h 1m");
    }
}
