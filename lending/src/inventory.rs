//! The lender's devices, their states, and exclusive leases.
//!
//! A [`Lease`] is the only way to use a device. Dropping it — on RETURN, when the borrower's
//! link goes down (disconnect or missed heartbeats), or when lenderd stops — unmaps every DMA
//! window, drops the interrupt wiring, clears Bus Master Enable, resets the device, revokes
//! the BAR windows and puts the device back to `available` (or `failed` if the reset fails).
//! Leases live only in memory, so a restarted lenderd starts with every device available.
//!
//! From the moment a lease is being taken back until the device is available again, the
//! device is `releasing (was lent to node/vm)` ([`DeviceState::Releasing`]) and a borrow is
//! refused with [`InventoryError::Releasing`]: the session marks a lease so the moment it
//! decides to end it ([`Lease::begin_release`]), and [`Inventory::release_unreachable`]
//! marks a lease whose holder's link is down while the session is still busy with a request
//! (a long DMA map). So once the link's end is known, `lendctl list` shows a dead borrower's
//! device as lent for at most one more poll period of the lender.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
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
    /// A lease on it is being taken back (unmaps, reset): it is available again shortly.
    #[error(
        "device {id} is being released (was lent to {node}/{vm}): the lender is taking the \
         lease back (unmapping its DMA, resetting the device); borrow it again once it is \
         available"
    )]
    Releasing {
        /// Device.
        id: String,
        /// The borrower node that held it.
        node: String,
        /// The borrower VM that held it.
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
    /// An SR-IOV relative is lent (or being reset after its lease): a PF and its VFs are
    /// never lent at the same time, since resetting the PF takes the VFs away.
    #[error(
        "{id} cannot be lent while its {relation} {relative} is {state}: a physical function \
         and its virtual functions are never lent at the same time (a PF reset takes its VFs \
         away from their borrowers)"
    )]
    Family {
        /// The device asked for.
        id: String,
        /// "physical function" or "virtual function".
        relation: &'static str,
        /// The relative's id.
        relative: String,
        /// The relative's state (e.g. `lent to node/vm`).
        state: String,
    },
    /// A hardware PF whose VFs are enabled (they were enabled after the lender opened it:
    /// the open refuses such a PF too, `vfio::PfWithVfs`).
    #[error(
        "{id} cannot be lent now: it is an SR-IOV physical function with {vfs} virtual \
         function(s) enabled, and its reset (every lease ends with one) would take them away; \
         lend the VFs instead, or disable them first (sriov_numvfs 0)"
    )]
    PfWithVfs {
        /// The device asked for.
        id: String,
        /// Its enabled VFs.
        vfs: u32,
    },
    /// Whether the device's VFs are enabled cannot be read: refused (fails closed).
    #[error("{id} cannot be lent now: {source}")]
    SriovUnreadable {
        /// The device asked for.
        id: String,
        /// What could not be read.
        #[source]
        source: crate::backend::SriovUnreadable,
    },
}

/// One device of the inventory.
pub struct DeviceEntry {
    id: String,
    backend: Arc<dyn DeviceBackend>,
    state: Mutex<DeviceState>,
    leases_granted: AtomicU64,
    /// The lease in force, for the metrics (one per device at most: bounded).
    current: Mutex<Option<LeaseView>>,
    /// The link of the lease's holder, while one holds it: [`Inventory::release_unreachable`]
    /// looks at it. Weak: the session owns its link.
    holder_link: Mutex<Option<Weak<dyn ntb::Endpoint>>>,
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
    /// LEASE_COUNTERS requests answered for it (a borrower's scrapes reach the lender as
    /// these: the operator sees what a scrape flood costs, and the tests that it is bounded).
    pub counters_requests: u64,
    /// How each BAR of the lease reaches its borrower (set as the lease's windows are
    /// exported).
    pub bar_paths: Vec<(u8, crate::server::BarPath)>,
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

    fn holder_link(&self) -> MutexGuard<'_, Option<Weak<dyn ntb::Endpoint>>> {
        self.holder_link.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `Lent` becomes `Releasing` (the lease is being taken back); returns whether it was
    /// lent. Any other state is left alone: `Releasing` already, or the end of the release.
    fn mark_releasing(&self) -> bool {
        let mut st = self.lock();
        let DeviceState::Lent { node, vm } = &*st else {
            return false;
        };
        *st = DeviceState::Releasing {
            node: node.clone(),
            vm: vm.clone(),
        };
        true
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
    /// Held while an acquire checks a device's SR-IOV relatives and marks it lent, so a PF
    /// and one of its VFs cannot both pass the check at once.
    family: Mutex<()>,
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
                holder_link: Mutex::new(None),
            }));
        }
        Ok(Inventory {
            devices: v,
            family: Mutex::new(()),
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

    /// Marks `releasing` every lent device whose holder's link is down
    /// ([`Lease::watch_holder`]); returns how many it marked. The session of that link ends
    /// the lease as soon as it sees the link's end, but it serves one request at a time: while
    /// it is inside a long one (a DMA map of a large window takes seconds on hardware,
    /// minutes under emulation) the device would otherwise show as lent to a borrower that
    /// is gone. Called by [`crate::server::Lender::serve`] every poll period.
    pub fn release_unreachable(&self) -> usize {
        let mut marked = 0;
        for dev in &self.devices {
            let down = dev
                .holder_link()
                .as_ref()
                .and_then(Weak::upgrade)
                .is_some_and(|ep| !ep.is_up());
            if down && dev.mark_releasing() {
                // Once per lease: the state is no longer `Lent` after this.
                log::info!(
                    "{}: the holder's link is down; releasing (the session ends the lease \
                     after the request it is serving)",
                    dev.id
                );
                marked += 1;
            }
        }
        marked
    }

    /// Refuses `dev` while its PF, or one of its VFs, is lent, releasing or resetting (a
    /// failed or available relative does not hold it back). Called with the family lock held.
    fn check_family(&self, dev: &DeviceEntry) -> Result<(), InventoryError> {
        let physfn = dev.backend.physical_function();
        for other in self.devices.iter().filter(|d| d.id != dev.id) {
            let relation = if physfn.as_deref() == Some(other.id.as_str()) {
                "physical function"
            } else if other.backend.physical_function().as_deref() == Some(dev.id.as_str()) {
                "virtual function"
            } else {
                continue;
            };
            let state = other.state();
            if matches!(
                state,
                DeviceState::Lent { .. } | DeviceState::Releasing { .. } | DeviceState::Resetting
            ) {
                return Err(InventoryError::Family {
                    id: dev.id.clone(),
                    relation,
                    relative: other.id.clone(),
                    state: state.to_string(),
                });
            }
        }
        Ok(())
    }

    /// Takes an exclusive lease on `id` for `node/vm`. A PF is refused while any of its
    /// VFs is lent, and a VF while its PF is ([`InventoryError::Family`]).
    pub fn acquire(&self, id: &str, node: &str, vm: &str) -> Result<Lease, InventoryError> {
        let dev = self
            .get(id)
            .ok_or_else(|| InventoryError::UnknownDevice(id.to_string()))?;
        let _family = self.family.lock().unwrap_or_else(|p| p.into_inner());
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
                DeviceState::Releasing { node, vm } => {
                    return Err(InventoryError::Releasing {
                        id: id.to_string(),
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
            self.check_family(dev)?;
            let sharing = dev.backend.vfs_sharing_reset().map_err(|source| {
                InventoryError::SriovUnreadable {
                    id: id.to_string(),
                    source,
                }
            })?;
            match sharing {
                0 => {}
                vfs => {
                    return Err(InventoryError::PfWithVfs {
                        id: id.to_string(),
                        vfs,
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
            counters_requests: 0,
            bar_paths: Vec::new(),
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

    /// Watches `link`, the holder's link to this lender: once it is down the device shows
    /// `releasing` even before the session ends the lease ([`Inventory::release_unreachable`]).
    /// Set again by a transfer to the new holder's link.
    pub fn watch_holder(&self, link: &Arc<dyn ntb::Endpoint>) {
        *self.device.holder_link() = Some(Arc::downgrade(link));
    }

    /// The lease is being taken back (its session is about to end it, or its holder's link
    /// is down): the device shows `releasing` from now until the drop has reset it.
    pub fn begin_release(&self) {
        self.device.mark_releasing();
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

    /// Records how each BAR of the lease reaches its borrower (metrics).
    pub fn set_bar_paths(&self, paths: Vec<(u8, crate::server::BarPath)>) {
        if let Some(v) = self.device.current().as_mut() {
            v.bar_paths = paths;
        }
    }

    /// Counts a LEASE_COUNTERS request answered for the lease (metrics).
    pub fn count_counters_request(&self) {
        if let Some(v) = self.device.current().as_mut() {
            v.counters_requests += 1;
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
        *dev.holder_link() = None;
        // Usually marked already by the session; a lease dropped another way (a transfer
        // that failed half-way, the lender stopping) is marked here.
        dev.mark_releasing();
        let b = &dev.backend;
        let unmapped = b.domain().unmap_all();
        b.clear_irqs();
        self.irq_keepalive.clear();
        if let Err(e) = b.set_bus_master(false) {
            log::warn!("lease {}: clearing bus master on {}: {e}", self.id, dev.id);
        }
        // After the reset, the memory the lease exported moves to fresh memory: what a
        // borrower or a grantee kept of it no longer reaches the device.
        let state = match b
            .reset()
            .and_then(|()| b.restore_defaults())
            .and_then(|()| b.renew_exports())
        {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::backend::emulated::EmulatedBackend;
    use emulated::NotifyMode;

    fn function(name: &str, pf: Option<&str>) -> (String, Arc<dyn DeviceBackend>) {
        let b =
            EmulatedBackend::dmatest(&format!("inv-family-{name}"), NotifyMode::Interrupt).unwrap();
        let b = match pf {
            Some(pf) => b.with_physfn(pf),
            None => b,
        };
        (name.to_string(), Arc::new(b))
    }

    /// The end of a lease moves the device's exported memory to a fresh memfd: a mapping of
    /// the old one (what a borrower, or a lender granted the peer memory, kept on shm)
    /// neither reaches the device any more nor sees what the device does next; the next
    /// export is the fresh memory.
    #[test]
    fn the_end_of_a_lease_cuts_off_what_a_holder_kept_of_the_device_memory() {
        use emulated::dmatest::BUF_OFFSET;
        use ntb::mem::Mapping;
        use std::os::fd::AsFd;
        use std::os::unix::fs::MetadataExt;

        let ino = |fd: std::os::fd::BorrowedFd<'_>| {
            let f = std::fs::File::from(fd.try_clone_to_owned().unwrap());
            f.metadata().unwrap().ino()
        };
        let inv = Inventory::new(vec![function("renewed", None)]).unwrap();
        let b = Arc::clone(inv.get("renewed").unwrap().backend());
        let lease = inv.acquire("renewed", "n1", "vm-a").unwrap();
        let (kept, off, size) = {
            let x = b.peer_export(0).unwrap();
            (x.fd.try_clone_to_owned().unwrap(), x.fd_offset, x.size)
        };
        let old = Mapping::map_shared(kept.as_fd(), off, size).unwrap();
        // The device's own view of its buffer (BAR accesses go through its register memory).
        let device = |at: u64| {
            let mut v = [0u8; 8];
            b.bar_read(0, BUF_OFFSET + at, &mut v).unwrap();
            u64::from_le_bytes(v)
        };
        let kept_at = |at: u64| {
            let mut v = [0u8; 8];
            old.read_at(at, &mut v).unwrap();
            u64::from_le_bytes(v)
        };
        // While the lease lasts, the kept mapping is the device's memory.
        old.write_at(0, &0x5a5a_0001u64.to_le_bytes()).unwrap();
        assert_eq!(device(0), 0x5a5a_0001);
        drop(lease);

        old.write_at(0, &0xa5a5_0002u64.to_le_bytes()).unwrap();
        assert_ne!(
            device(0),
            0xa5a5_0002,
            "a write through the kept mapping reached the device"
        );
        b.bar_write(0, BUF_OFFSET + 64, &0x7777_0003u64.to_le_bytes())
            .unwrap();
        assert_eq!(device(64), 0x7777_0003);
        assert_ne!(
            kept_at(64),
            0x7777_0003,
            "the kept mapping sees the device's new data"
        );
        // The next lease exports the fresh memory, which is the device's.
        let _next = inv.acquire("renewed", "n2", "vm-b").unwrap();
        let x = b.peer_export(0).unwrap();
        assert_ne!(
            ino(x.fd),
            ino(kept.as_fd()),
            "the export is still the old memfd"
        );
        let fresh = Mapping::map_shared(x.fd, x.fd_offset, x.size).unwrap();
        let mut v = [0u8; 8];
        fresh.read_at(64, &mut v).unwrap();
        assert_eq!(u64::from_le_bytes(v), 0x7777_0003);
        fresh.write_at(128, &0x3c3c_0004u64.to_le_bytes()).unwrap();
        assert_eq!(device(128), 0x3c3c_0004);
    }

    /// A lease being taken back shows `releasing` with its holder until its drop has reset
    /// the device; a borrow meanwhile is refused as being released (not "busy, lent to"),
    /// and so is a VF of a releasing PF.
    #[test]
    fn a_lease_being_taken_back_is_releasing_and_refuses_borrows_as_such() {
        let inv =
            Inventory::new(vec![function("rel", None), function("relvf", Some("rel"))]).unwrap();
        let lease = inv.acquire("rel", "n1", "vm-a").unwrap();
        lease.begin_release();
        let st = inv.get("rel").unwrap().state();
        assert_eq!(
            st,
            DeviceState::Releasing {
                node: "n1".into(),
                vm: "vm-a".into()
            }
        );
        assert_eq!(st.to_string(), "releasing (was lent to n1/vm-a)");
        let e = inv.acquire("rel", "n2", "vm-b").err().unwrap();
        assert_eq!(
            e.to_string(),
            "device rel is being released (was lent to n1/vm-a): the lender is taking the \
             lease back (unmapping its DMA, resetting the device); borrow it again once it is \
             available"
        );
        let e = inv
            .acquire("relvf", "n2", "vm-b")
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("its physical function rel is releasing (was lent to n1/vm-a)"),
            "{e}"
        );
        drop(lease);
        assert_eq!(inv.get("rel").unwrap().state(), DeviceState::Available);
        let _again = inv.acquire("rel", "n2", "vm-b").unwrap();
    }

    /// A PF is refused while one of its VFs is lent, a VF while its PF is; unrelated
    /// devices and the other VF are not held back, and a returned lease frees the family.
    #[test]
    fn a_pf_and_its_vfs_are_never_lent_at_the_same_time() {
        let inv = Inventory::new(vec![
            function("pf", None),
            function("vf1", Some("pf")),
            function("vf2", Some("pf")),
            function("other", None),
        ])
        .unwrap();
        let vf1 = inv.acquire("vf1", "n1", "vm-a").unwrap();
        let vf2 = inv.acquire("vf2", "n2", "vm-b").unwrap();
        let other = inv.acquire("other", "n3", "vm-c").unwrap();
        let e = inv.acquire("pf", "n3", "vm-p").err().unwrap();
        assert!(
            matches!(
                &e,
                InventoryError::Family {
                    relation: "virtual function",
                    ..
                }
            ),
            "{e:?}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("pf cannot be lent while its virtual function vf1 is lent to n1/vm-a"),
            "{msg}"
        );
        drop(vf1);
        let e = inv.acquire("pf", "n3", "vm-p").err().unwrap().to_string();
        assert!(e.contains("virtual function vf2 is lent to n2/vm-b"), "{e}");
        drop(vf2);
        let pf = inv.acquire("pf", "n3", "vm-p").unwrap();
        let e = inv.acquire("vf2", "n2", "vm-b").err().unwrap().to_string();
        assert!(
            e.contains("vf2 cannot be lent while its physical function pf is lent to n3/vm-p"),
            "{e}"
        );
        drop(pf);
        let _vf2 = inv.acquire("vf2", "n2", "vm-b").unwrap();
        drop(other);
    }
}
