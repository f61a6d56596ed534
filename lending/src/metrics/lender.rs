//! `lenderd`'s metrics: read per scrape from the lender's inventory, its leases' device
//! counters, its sessions and its directory registration (see the module above for the label
//! bounds).

use std::sync::{Arc, Weak};

use prometheus_client::registry::Unit;

use super::{labels, Families};
use crate::directory::Registration;
use crate::protocol::DeviceState;
use crate::server::{AuthFailure, Lender};

/// Every metric family `lenderd` exports, as exposed (the dashboard test checks against it).
pub const NAMES: &[&str] = &[
    "lenderd_up",
    "lenderd_uptime_seconds",
    "lenderd_devices",
    "lenderd_device_state",
    "lenderd_leases",
    "lenderd_lease_age_seconds",
    "lenderd_sessions",
    "lenderd_dma_windows",
    "lenderd_dma_window_bytes",
    "lenderd_auth_failures_total",
    "lenderd_handshakes_in_progress",
    "lenderd_handshake_slots",
    "lenderd_lease_commands_total",
    "lenderd_lease_dma_read_bytes_total",
    "lenderd_lease_dma_written_bytes_total",
    "lenderd_lease_dma_faults_total",
    "lenderd_lease_invalid_doorbells_total",
    "lenderd_lease_bad_prps_total",
    "lenderd_lease_doorbell_kicks_total",
    "lenderd_lease_interrupts_total",
    "lenderd_lease_p2p_mappings",
    "lenderd_lease_dirty_log_fetches_total",
    "lenderd_lease_counters_requests_total",
    "lenderd_lease_bar_path",
    "lenderd_directory_registered",
    "lenderd_directory_keepalive_latency_seconds",
];

/// What `lenderd --metrics` shows.
pub struct LenderMetrics {
    lender: Arc<Lender>,
    /// Weak: the observer must not keep the registration alive (its drop revokes it, and
    /// must happen on lenderd's main thread, not on the metrics thread's runtime).
    registration: Option<Weak<dyn Registration>>,
    listener: Option<Arc<dyn ntb::Listener>>,
}

impl LenderMetrics {
    /// Metrics of `lender`, its directory `registration` and its fabric `listener`.
    pub fn new(
        lender: Arc<Lender>,
        registration: Option<Arc<dyn Registration>>,
        listener: Option<Arc<dyn ntb::Listener>>,
    ) -> Self {
        LenderMetrics {
            lender,
            registration: registration.as_ref().map(Arc::downgrade),
            listener,
        }
    }

    /// One scrape.
    pub fn families(&self) -> Families {
        let mut f = Families::new();
        let l = &self.lender;
        let node = l.node().to_string();
        let n = || vec![("node".to_string(), node.clone())];
        f.gauge("lenderd_up", "1 while lenderd serves.", n(), 1.0);
        f.with_unit(
            "lenderd_uptime",
            "Time since lenderd started.",
            Unit::Seconds,
            false,
            n(),
            l.inventory().uptime_secs() as f64,
        );
        // Every state, so that `lenderd_devices` has a sample for each (0 included).
        const STATES: [&str; 5] = ["available", "lent", "releasing", "resetting", "failed"];
        let mut by_state = [0u64; STATES.len()];
        let inv = l.inventory();
        let mut leases = 0u64;
        // DMA windows mapped in the devices' IOMMU domains, leased or not: a window left on
        // a device after its lease ended is a leak (pinned pages, for a VFIO device).
        let (mut windows, mut window_bytes) = (0u64, 0u64);
        f.declare(
            "lenderd_lease_commands",
            "Commands the device fetched during the lease (emulated NVMe).",
            true,
        );
        for d in inv.list() {
            let st = match &d.state {
                DeviceState::Available => 0,
                DeviceState::Lent { .. } => 1,
                DeviceState::Releasing { .. } => 2,
                DeviceState::Resetting => 3,
                DeviceState::Failed { .. } => 4,
            };
            by_state[st] += 1;
            f.gauge(
                "lenderd_device_state",
                "1 for the state each device is in.",
                labels([
                    ("node", &node),
                    ("device", &d.id),
                    ("kind", &d.kind),
                    ("state", STATES[st]),
                ]),
                1.0,
            );
            let Some(entry) = inv.get(&d.id) else {
                continue;
            };
            for m in entry.backend().domain().mappings() {
                windows += 1;
                window_bytes = window_bytes.saturating_add(m.size);
            }
            let Some(v) = entry.lease_view() else {
                continue;
            };
            leases += 1;
            let lease = v.id.to_string();
            let ll = || {
                labels([
                    ("node", &node),
                    ("device", &d.id),
                    ("lease", &lease),
                    ("borrower", &v.node),
                    ("vm", &v.vm),
                ])
            };
            f.with_unit(
                "lenderd_lease_age",
                "Time since the lease was granted.",
                Unit::Seconds,
                false,
                ll(),
                v.granted.elapsed().as_secs_f64(),
            );
            let c = entry.backend().counters().since(&v.baseline);
            f.counter(
                "lenderd_lease_commands",
                "Commands the device fetched during the lease (emulated NVMe).",
                ll(),
                c.commands,
            );
            f.with_unit(
                "lenderd_lease_dma_read",
                "Bytes the device read from the borrower's memory (emulated devices).",
                Unit::Bytes,
                true,
                ll(),
                c.dma_bytes_read as f64,
            );
            f.with_unit(
                "lenderd_lease_dma_written",
                "Bytes the device wrote to the borrower's memory (emulated devices).",
                Unit::Bytes,
                true,
                ll(),
                c.dma_bytes_written as f64,
            );
            f.counter(
                "lenderd_lease_dma_faults",
                "DMAs the lease's IOMMU domain refused.",
                ll(),
                c.iommu_faults,
            );
            f.counter(
                "lenderd_lease_invalid_doorbells",
                "Doorbell writes refused for a value outside the queue (NVMe).",
                ll(),
                c.invalid_doorbells,
            );
            f.counter(
                "lenderd_lease_bad_prps",
                "Commands refused for their PRPs (NVMe).",
                ll(),
                c.bad_prps,
            );
            f.counter(
                "lenderd_lease_doorbell_kicks",
                "Doorbell notifications the device read.",
                ll(),
                c.doorbell_kicks,
            );
            f.counter(
                "lenderd_lease_interrupts",
                "Interrupts the lender signalled to the borrower (MSI-X and INTx).",
                ll(),
                c.msix.iter().sum::<u64>().saturating_add(c.intx),
            );
            f.gauge(
                "lenderd_lease_p2p_mappings",
                "Peer-to-peer mappings into the lease's BARs.",
                ll(),
                l.p2p_live_into(v.id) as f64,
            );
            f.counter(
                "lenderd_lease_dirty_log_fetches",
                "Dirty-log fetches of the lease (live migration).",
                ll(),
                v.dirty_log_fetches,
            );
            f.counter(
                "lenderd_lease_counters_requests",
                "LEASE_COUNTERS requests of the lease's borrower (its VM's metrics scrapes).",
                ll(),
                v.counters_requests,
            );
            for (bar, path) in &v.bar_paths {
                let mut l = ll();
                l.push(("bar".to_string(), bar.to_string()));
                l.push(("path".to_string(), path.as_str().to_string()));
                f.gauge(
                    "lenderd_lease_bar_path",
                    "1 for the path each BAR of the lease takes to its borrower: mapped (the \
                     borrower maps a per-lease memfd or the shared region), mediated (the \
                     lender serves each access from its own mapping), trapped (each access \
                     goes through the device's own interface).",
                    l,
                    1.0,
                );
            }
        }
        for (i, s) in STATES.iter().enumerate() {
            f.gauge(
                "lenderd_devices",
                "Devices by state.",
                labels([("node", &node), ("state", s)]),
                by_state[i] as f64,
            );
        }
        f.gauge("lenderd_leases", "Leases in force.", n(), leases as f64);
        f.gauge(
            "lenderd_sessions",
            "Borrower sessions (authenticated or not) running.",
            n(),
            l.sessions() as f64,
        );
        f.gauge(
            "lenderd_dma_windows",
            "DMA windows mapped into borrowers' memory, over every device's IOMMU domain.",
            n(),
            windows as f64,
        );
        f.with_unit(
            "lenderd_dma_window",
            "Bytes of borrowers' memory mapped for DMA (pinned, for a VFIO device).",
            Unit::Bytes,
            false,
            n(),
            window_bytes as f64,
        );
        for why in AuthFailure::ALL {
            f.counter(
                "lenderd_auth_failures",
                "Failed authentications by reason.",
                labels([("node", &node), ("reason", why.as_str())]),
                l.auth_failures(why),
            );
        }
        if let Some(lis) = &self.listener {
            if let Some(p) = lis.handshakes_pending() {
                f.gauge(
                    "lenderd_handshakes_in_progress",
                    "Fabric handshakes of accepted connections in progress (slots in use).",
                    n(),
                    p as f64,
                );
            }
            f.gauge(
                "lenderd_handshake_slots",
                "Fabric handshakes that may be in progress at once.",
                n(),
                lis.handshake_slots() as f64,
            );
        }
        if let Some(r) = self.registration.as_ref().and_then(Weak::upgrade) {
            f.gauge(
                "lenderd_directory_registered",
                "1 while the lender's directory registration is in force.",
                n(),
                if r.lost().is_none() { 1.0 } else { 0.0 },
            );
            if let Some(d) = r.keepalive_latency() {
                f.with_unit(
                    "lenderd_directory_keepalive_latency",
                    "Round trip of the last renewal of the registration's etcd lease.",
                    Unit::Seconds,
                    false,
                    n(),
                    d.as_secs_f64(),
                );
            }
        }
        f
    }

    /// The text of one scrape.
    pub fn render(&self, format: super::Format) -> String {
        self.families().encode_as(format)
    }
}
