//! lendvm's metrics (`GET /api/v1/metrics`, `lendvm --metrics ADDR`): the figures
//! `vm.counters` and `vm.info` compute, renamed for Prometheus, plus migration progress.
//! Nothing is counted twice: [`families`] only reads a [`VmCountersReport`], the
//! [`VmCounters`], the [`VmInfo`] and the [`MigrationProgress`].
//!
//! Labels: `vm` (this VM's name on the fabric) and, per device, `device` (its id in the VM;
//! at most one per PCI slot). A removed device is not in the next scrape: its series go
//! stale. KVM statistics are read from the report's `vm` group; other groups that are not
//! devices (per-vCPU figures) are not exported yet.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};

use api::types::{LeaseState, VmCounters, VmCountersReport, VmInfo, VmState};
use lending::metrics::{labels, Families};
use prometheus_client::registry::Unit;

/// Every metric family lendvm exports, as exposed (the dashboard test checks against it).
pub const NAMES: &[&str] = &[
    "lendvm_up",
    "lendvm_vm_running",
    "lendvm_kvm_exits_total",
    "lendvm_kvm_halt_polls_total",
    "lendvm_vcpu_exits_total",
    "lendvm_kvm_stat",
    "lendvm_resources",
    "lendvm_pinned_bytes",
    "lendvm_device_lease_state",
    "lendvm_device_mmio_exits_total",
    "lendvm_device_ioeventfd_kicks_total",
    "lendvm_device_irqfd_interrupts_total",
    "lendvm_device_pinned_bytes",
    "lendvm_device_dma_read_bytes_total",
    "lendvm_device_dma_written_bytes_total",
    "lendvm_device_iommu_faults_total",
    "lendvm_device_commands_total",
    "lendvm_device_invalid_doorbells_total",
    "lendvm_device_bad_prps_total",
    "lendvm_device_figure",
    "lendvm_migrations_total",
    "lendvm_migration_active",
    "lendvm_migration_round",
    "lendvm_migration_pages_sent_total",
    "lendvm_migration_last_downtime_seconds",
];

/// Live-migration progress, updated by the migration as it goes and read by scrapes (also
/// while the VMM thread is busy migrating).
#[derive(Debug, Default)]
pub struct MigrationProgress {
    started: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    /// Round of the migration running now (0: the first full pass), `u64::MAX`: none.
    round: AtomicU64,
    pages_sent: AtomicU64,
    last_downtime_us: AtomicU64,
}

impl MigrationProgress {
    /// A fresh one: no migration.
    pub fn new() -> Self {
        let p = MigrationProgress::default();
        p.round.store(u64::MAX, Ordering::Relaxed);
        p
    }

    /// A migration starts.
    pub fn start(&self) {
        self.started.fetch_add(1, Ordering::Relaxed);
        self.round.store(0, Ordering::Relaxed);
    }

    /// A pass of `pages` pages was sent.
    pub fn round_sent(&self, round: u32, pages: u64) {
        self.round.store(u64::from(round), Ordering::Relaxed);
        self.pages_sent.fetch_add(pages, Ordering::Relaxed);
    }

    /// It ended (`downtime` when it succeeded).
    pub fn end(&self, downtime: Option<std::time::Duration>) {
        self.round.store(u64::MAX, Ordering::Relaxed);
        match downtime {
            Some(d) => {
                self.completed.fetch_add(1, Ordering::Relaxed);
                self.last_downtime_us
                    .store(d.as_micros() as u64, Ordering::Relaxed);
            }
            None => {
                self.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Its families (labels `vm`).
    pub fn add_to(&self, f: &mut Families, vm: &str) {
        for (result, n) in [
            ("started", &self.started),
            ("completed", &self.completed),
            ("failed", &self.failed),
        ] {
            f.counter(
                "lendvm_migrations",
                "Live migrations of this VM sent, by result.",
                labels([("vm", vm), ("result", result)]),
                n.load(Ordering::Relaxed),
            );
        }
        let round = self.round.load(Ordering::Relaxed);
        f.gauge(
            "lendvm_migration_active",
            "1 while a live migration of this VM is being sent.",
            labels([("vm", vm)]),
            if round == u64::MAX { 0.0 } else { 1.0 },
        );
        f.gauge(
            "lendvm_migration_round",
            "Precopy round of the migration being sent (0: the full pass).",
            labels([("vm", vm)]),
            if round == u64::MAX { 0.0 } else { round as f64 },
        );
        f.counter(
            "lendvm_migration_pages_sent",
            "Guest RAM pages sent by live migrations.",
            labels([("vm", vm)]),
            self.pages_sent.load(Ordering::Relaxed),
        );
        f.with_unit(
            "lendvm_migration_last_downtime",
            "How long the VM was paused by the last completed migration.",
            Unit::Seconds,
            false,
            labels([("vm", vm)]),
            self.last_downtime_us.load(Ordering::Relaxed) as f64 / 1e6,
        );
    }
}

fn lease_state(s: LeaseState) -> &'static str {
    match s {
        LeaseState::Pending => "pending",
        LeaseState::Active => "active",
        LeaseState::Removing => "removing",
        LeaseState::Lost => "lost",
    }
}

/// The VM's families.
pub fn families(
    vm: &str,
    report: &VmCountersReport,
    counters: &VmCounters,
    info: &VmInfo,
    migration: &MigrationProgress,
) -> Families {
    let mut f = Families::new();
    let v = || labels([("vm", vm)]);
    f.gauge("lendvm_up", "1 while the VMM answers.", v(), 1.0);
    f.gauge(
        "lendvm_vm_running",
        "1 while the VM runs (0: paused, created or shutting down).",
        v(),
        if info.state == VmState::Running {
            1.0
        } else {
            0.0
        },
    );
    if let Some(kvm) = report.get("vm") {
        for (k, n) in kvm {
            if let Some(reason) = k.strip_suffix("_exits") {
                f.counter(
                    "lendvm_kvm_exits",
                    "KVM exits of all vCPUs by reason (KVM's statistics; mmio: to user space).",
                    labels([("vm", vm), ("reason", reason)]),
                    *n,
                );
            }
            let poll = match k.as_str() {
                "halt_successful_poll" => Some("successful"),
                "halt_attempted_poll" => Some("attempted"),
                "halt_poll_invalid" => Some("invalid"),
                _ => None,
            };
            if let Some(result) = poll {
                f.counter(
                    "lendvm_kvm_halt_polls",
                    "KVM halt polls of all vCPUs by result.",
                    labels([("vm", vm), ("result", result)]),
                    *n,
                );
            }
            f.gauge(
                "lendvm_kvm_stat",
                "Every KVM statistic of the vCPUs, summed, by its KVM name.",
                labels([("vm", vm), ("stat", k)]),
                *n as f64,
            );
        }
    }
    // Each vCPU's own exits (`vm.counters` groups `vm:vcpuN`): bounded by the VM's vCPUs.
    for (group, stats) in report {
        let Some(cpu) = group.strip_prefix("vm:vcpu") else {
            continue;
        };
        for (k, n) in stats {
            if let Some(reason) = k.strip_suffix("_exits") {
                f.counter(
                    "lendvm_vcpu_exits",
                    "KVM exits of one vCPU by reason (mmio: to user space).",
                    labels([("vm", vm), ("vcpu", cpu), ("reason", reason)]),
                    *n,
                );
            }
        }
    }
    if let Ok(serde_json::Value::Object(m)) = serde_json::to_value(counters) {
        for (k, n) in m {
            if let Some(n) = n.as_u64() {
                f.gauge(
                    "lendvm_resources",
                    "Resources the VMM holds for remote devices (vm.info counters).",
                    labels([("vm", vm), ("resource", &k)]),
                    n as f64,
                );
            }
        }
    }
    f.with_unit(
        "lendvm_pinned",
        "Guest RAM pinned for device DMA.",
        Unit::Bytes,
        false,
        v(),
        counters.pinned_bytes as f64,
    );
    let devices: BTreeSet<&str> = info.remote_devices.iter().map(|d| d.id.as_str()).collect();
    for d in &info.remote_devices {
        for s in [
            LeaseState::Pending,
            LeaseState::Active,
            LeaseState::Removing,
            LeaseState::Lost,
        ] {
            f.gauge(
                "lendvm_device_lease_state",
                "1 for the lease state each remote device is in.",
                labels([
                    ("vm", vm),
                    ("device", &d.id),
                    ("node", &d.node),
                    ("state", lease_state(s)),
                ]),
                if d.lease_state == s { 1.0 } else { 0.0 },
            );
        }
    }
    for (id, c) in report {
        if !devices.contains(id.as_str()) {
            continue;
        }
        let g = |k: &str| c.get(k).copied();
        let dl = || labels([("vm", vm), ("device", id)]);
        f.counter(
            "lendvm_device_mmio_exits",
            "BAR accesses of the device that exited to the VMM.",
            dl(),
            g("trapped_bar_reads")
                .unwrap_or(0)
                .saturating_add(g("trapped_bar_writes").unwrap_or(0)),
        );
        if let Some(k) = g("doorbell_kicks") {
            f.counter(
                "lendvm_device_ioeventfd_kicks",
                "Doorbell kicks that reached the lender without the VMM (KVM ioeventfds).",
                dl(),
                k.saturating_sub(g("vmm_doorbell_kicks").unwrap_or(0)),
            );
        }
        if let Some(n) = g("interrupts") {
            f.counter(
                "lendvm_device_irqfd_interrupts",
                "Interrupts the lender signalled to the VM's irqfds.",
                dl(),
                n,
            );
        }
        if let Some(n) = g("pinned_bytes") {
            f.with_unit(
                "lendvm_device_pinned",
                "Guest RAM pinned for the device's DMA.",
                Unit::Bytes,
                false,
                dl(),
                n as f64,
            );
        }
        for (key, name, help, unit) in [
            (
                "dma_bytes_read",
                "lendvm_device_dma_read",
                "Bytes the device read from guest RAM (lender's count).",
                Some(Unit::Bytes),
            ),
            (
                "dma_bytes_written",
                "lendvm_device_dma_written",
                "Bytes the device wrote to guest RAM (lender's count).",
                Some(Unit::Bytes),
            ),
            (
                "iommu_faults",
                "lendvm_device_iommu_faults",
                "DMAs of the device its lender's IOMMU domain refused.",
                None,
            ),
            (
                "commands",
                "lendvm_device_commands",
                "Commands the device fetched (lender's count, emulated NVMe).",
                None,
            ),
            (
                "invalid_doorbells",
                "lendvm_device_invalid_doorbells",
                "Doorbell writes the device refused (lender's count, NVMe).",
                None,
            ),
            (
                "bad_prps",
                "lendvm_device_bad_prps",
                "Commands refused for their PRPs (lender's count, NVMe).",
                None,
            ),
        ] {
            if let Some(n) = g(key) {
                match unit {
                    Some(u) => f.with_unit(name, help, u, true, dl(), n as f64),
                    None => f.counter(name, help, dl(), n),
                }
            }
        }
        for (k, n) in c {
            f.gauge(
                "lendvm_device_figure",
                "Every per-device figure of vm.counters, by its name there.",
                labels([("vm", vm), ("device", id), ("name", k)]),
                *n as f64,
            );
        }
    }
    migration.add_to(&mut f, vm);
    f
}

/// Only the migration's figures (the VMM thread is busy, e.g. sending the migration).
pub fn migration_only(vm: &str, migration: &MigrationProgress) -> Families {
    let mut f = Families::new();
    migration.add_to(&mut f, vm);
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(f: &Families, name: &str, label: Option<(&str, &str)>) -> f64 {
        let fam = f
            .families()
            .iter()
            .find(|x| x.name == name)
            .unwrap_or_else(|| panic!("{name} missing"));
        fam.samples
            .iter()
            .find(|(l, _)| label.is_none_or(|(k, v)| l.iter().any(|(a, b)| a == k && b == v)))
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("{name} {label:?} missing"))
    }

    #[test]
    fn migration_progress_follows_a_migration() {
        let p = MigrationProgress::new();
        let f = migration_only("vm1", &p);
        assert_eq!(value(&f, "lendvm_migration_active", None), 0.0);
        p.start();
        p.round_sent(0, 100);
        p.round_sent(1, 20);
        let f = migration_only("vm1", &p);
        assert_eq!(value(&f, "lendvm_migration_active", None), 1.0);
        assert_eq!(value(&f, "lendvm_migration_round", None), 1.0);
        assert_eq!(value(&f, "lendvm_migration_pages_sent", None), 120.0);
        p.end(Some(std::time::Duration::from_millis(250)));
        p.start();
        p.end(None);
        let f = migration_only("vm1", &p);
        assert_eq!(value(&f, "lendvm_migration_active", None), 0.0);
        assert_eq!(
            value(&f, "lendvm_migrations", Some(("result", "started"))),
            2.0
        );
        assert_eq!(
            value(&f, "lendvm_migrations", Some(("result", "completed"))),
            1.0
        );
        assert_eq!(
            value(&f, "lendvm_migrations", Some(("result", "failed"))),
            1.0
        );
        assert_eq!(value(&f, "lendvm_migration_last_downtime", None), 0.25);
        for n in f.exposed_names() {
            assert!(NAMES.contains(&n.as_str()), "{n}");
        }
    }
}
