//! The lender's devices, their states, and exclusive leases.
//!
//! A [`Lease`] is the only way to use a device. Dropping it — on RETURN, when the borrower's
//! link goes down (disconnect or missed heartbeats), or when lenderd stops — unmaps every DMA
//! window, drops the interrupt wiring, clears Bus Master Enable, resets the device, revokes
//! the BAR windows and puts the device back to `available` (or `failed` if the reset fails).
//! Leases live only in memory, so a restarted lenderd starts with every device available.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use thiserror::Error;

use crate::backend::DeviceBackend;
use crate::protocol::{DeviceState, DeviceStatus, DeviceSummary, LeaseCounters};

/// Errors of the inventory.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum InventoryError {
    /// No such device.
    #[error("unknown device {0}")]
    UnknownDevice(String),
    /// Lent to someone else.
    #[error("device busy, lent to {node}/{vm}")]
    Busy {
        /// Holder node.
        node: String,
        /// Holder VM.
        vm: String,
    },
    /// Resetting or failed.
    #[error("device {id} is {state}")]
    Unavailable {
        /// Device.
        id: String,
        /// Its state.
        state: String,
    },
    /// Two devices with one id.
    #[error("duplicate device id {0}")]
    Duplicate(String),
}

/// One device of the inventory.
pub struct DeviceEntry {
    id: String,
    backend: Arc<dyn DeviceBackend>,
    state: Mutex<DeviceState>,
    leases_granted: AtomicU64,
    /// The lease in force, for the metrics (one per device at most: bounded).
    current: Mutex<Option<LeaseView>>,
}

/// What the metrics show of the lease in force on a device.
#[derive(Debug, Clone)]
pub struct LeaseView {
    /// Lease id.
    pub id: u64,
    /// Borrower node.
    pub node: String,
    /// Borrower VM.
    pub vm: String,
    /// When it was granted.
    pub granted: Instant,
    /// The device's counters when it was granted.
    pub baseline: LeaseCounters,
    /// DIRTY_LOG_FETCH requests answered for it.
    pub dirty_log_fetches: u64,
}

impl DeviceEntry {
    /// Device id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn DeviceBackend> {
        &self.backend
    }

    /// Current state.
    pub fn state(&self) -> DeviceState {
        self.lock().clone()
    }

    fn lock(&self) -> MutexGuard<'_, DeviceState> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn current(&self) -> MutexGuard<'_, Option<LeaseView>> {
        self.current.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lease in force, if any.
    pub fn lease_view(&self) -> Option<LeaseView> {
        self.current().clone()
    }

    fn summary(&self) -> DeviceSummary {
        let c = self.backend.describe(&self.id).config;
        let b = |i: usize| c.get(i).copied().unwrap_or(0);
        DeviceSummary {
            id: self.id.clone(),
            kind: self.backend.kind().to_string(),
            vendor_id: u16::from_le_bytes([b(0), b(1)]),
            device_id: u16::from_le_bytes([b(2), b(3)]),
            class: u32::from(b(0x0b)) << 16 | u32::from(b(0x0a)) << 8 | u32::from(b(0x09)),
            state: self.state(),
        }
    }
}

/// All devices of this lender.
pub struct Inventory {
    devices: Vec<Arc<DeviceEntry>>,
    next_lease: AtomicU64,
    started: Instant,
}

impl Inventory {
    /// An inventory with every device available.
    pub fn new(devices: Vec<(String, Arc<dyn DeviceBackend>)>) -> Result<Self, InventoryError> {
        let mut v: Vec<Arc<DeviceEntry>> = Vec::new();
        for (id, backend) in devices {
            if v.iter().any(|d| d.id == id) {
                return Err(InventoryError::Duplicate(id));
            }
            v.push(Arc::new(DeviceEntry {
                id,
                backend,
                state: Mutex::new(DeviceState::Available),
                leases_granted: AtomicU64::new(0),
                current: Mutex::new(None),
            }));
        }
        Ok(Inventory {
            devices: v,
            next_lease: AtomicU64::new(1),
            started: Instant::now(),
        })
    }

    /// The device called `id`.
    pub fn get(&self, id: &str) -> Option<&Arc<DeviceEntry>> {
        self.devices.iter().find(|d| d.id == id)
    }

    /// Summaries of all devices.
    pub fn list(&self) -> Vec<DeviceSummary> {
        self.devices.iter().map(|d| d.summary()).collect()
    }

    /// Status details.
    pub fn status(&self) -> Vec<DeviceStatus> {
        self.devices
            .iter()
            .map(|d| {
                let dom = d.backend.domain();
                DeviceStatus {
                    summary: d.summary(),
                    dma_maps: dom.mappings().iter().map(|m| (m.iova, m.size)).collect(),
                    iommu_faults: dom.fault_count(),
                    leases_granted: d.leases_granted.load(Ordering::Relaxed),
                }
            })
            .collect()
    }

    /// Seconds since the inventory was created.
    pub fn uptime_secs(&self) -> u64 {
        self.started.elapsed().as_secs()
    }

    /// Takes an exclusive lease on `id` for `node/vm`.
    pub fn acquire(&self, id: &str, node: &str, vm: &str) -> Result<Lease, InventoryError> {
        let dev = self
            .get(id)
            .ok_or_else(|| InventoryError::UnknownDevice(id.to_string()))?;
        {
            let mut st = dev.lock();
            match &*st {
                DeviceState::Available => {}
                DeviceState::Lent { node, vm } => {
                    return Err(InventoryError::Busy {
                        node: node.clone(),
                        vm: vm.clone(),
                    })
                }
                other => {
                    return Err(InventoryError::Unavailable {
                        id: id.to_string(),
                        state: other.to_string(),
                    })
                }
            }
            *st = DeviceState::Lent {
                node: node.to_string(),
                vm: vm.to_string(),
            };
        }
        dev.leases_granted.fetch_add(1, Ordering::Relaxed);
        let lease = self.next_lease.fetch_add(1, Ordering::Relaxed);
        *dev.current() = Some(LeaseView {
            id: lease,
            node: node.to_string(),
            vm: vm.to_string(),
            granted: Instant::now(),
            baseline: dev.backend.counters(),
            dirty_log_fetches: 0,
        });
        log::info!("lease {lease}: {id} lent to {node}/{vm}");
        Ok(Lease {
            id: lease,
            device: Arc::clone(dev),
            holder: format!("{node}/{vm}"),
            end_reason: "returned".into(),
            bar_windows: Vec::new(),
            irq_keepalive: Vec::new(),
        })
    }
}

/// An exclusive lease. Dropping it gives the device back (see the module docs).
pub struct Lease {
    id: u64,
    device: Arc<DeviceEntry>,
    holder: String,
    end_reason: String,
    bar_windows: Vec<ntb::ExportedWindow>,
    irq_keepalive: Vec<Box<dyn std::any::Any + Send + Sync>>,
}

impl Lease {
    /// Lease id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The leased device.
    pub fn device(&self) -> &Arc<DeviceEntry> {
        &self.device
    }

    /// The backend of the leased device.
    pub fn backend(&self) -> &Arc<dyn DeviceBackend> {
        &self.device.backend
    }

    /// `node/vm`.
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// Keeps a BAR fabric window until the lease ends.
    pub fn add_bar_window(&mut self, w: ntb::ExportedWindow) {
        self.bar_windows.push(w);
    }

    /// The lease moved to `node/vm` (live migration): the device stays lent, to them.
    pub fn set_holder(&mut self, node: &str, vm: &str) {
        *self.device.lock() = DeviceState::Lent {
            node: node.to_string(),
            vm: vm.to_string(),
        };
        if let Some(v) = self.device.current().as_mut() {
            v.node = node.to_string();
            v.vm = vm.to_string();
        }
        log::info!(
            "lease {}: {} moved from {} to {node}/{vm}",
            self.id,
            self.device.id,
            self.holder
        );
        self.holder = format!("{node}/{vm}");
    }

    /// Replaces the BAR fabric windows (exported on the new holder's link); the old ones
    /// are revoked.
    pub fn replace_bar_windows(&mut self, windows: Vec<ntb::ExportedWindow>) {
        self.bar_windows = windows;
    }

    /// Keeps something alive for the lease's life (interrupt plumbing).
    pub fn keep(&mut self, v: Box<dyn std::any::Any + Send + Sync>) {
        self.irq_keepalive.push(v);
    }

    /// Counts a DIRTY_LOG_FETCH answered for the lease (metrics).
    pub fn count_dirty_log_fetch(&self) {
        if let Some(v) = self.device.current().as_mut() {
            v.dirty_log_fetches += 1;
        }
    }

    /// Why the lease ends (logged on drop).
    pub fn set_end_reason(&mut self, why: impl Into<String>) {
        self.end_reason = why.into();
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let dev = &self.device;
        *dev.current() = None;
        *dev.lock() = DeviceState::Resetting;
        let b = &dev.backend;
        let unmapped = b.domain().unmap_all();
        b.clear_irqs();
        self.irq_keepalive.clear();
        if let Err(e) = b.set_bus_master(false) {
            log::warn!("lease {}: clearing bus master on {}: {e}", self.id, dev.id);
        }
        let state = match b.reset() {
            Ok(()) => DeviceState::Available,
            Err(e) => {
                log::error!("lease {}: reset of {} failed: {e}", self.id, dev.id);
                DeviceState::Failed {
                    reason: format!("reset failed: {e}"),
                }
            }
        };
        // Revoke the BAR windows after the device is quiet.
        self.bar_windows.clear();
        *dev.lock() = state.clone();
        log::info!(
            "lease {}: {} taken back from {} ({}): {unmapped} dma windows unmapped, irqs dropped, device reset, now {state}",
            self.id,
            dev.id,
            self.holder,
            self.end_reason
        );
    }
}
