//! The VMM control plane: the remote-device table, the REST API handler and the event loop.
//!
//! [`Controller`] owns every borrowed device and implements [`ApiHandler`] with the
//! semantics of `api::fake::FakeVmm` (same status codes and messages). All lender traffic of
//! hot-add and removal (connect, borrow, return, DMA unmap on teardown) runs here, on the
//! thread of [`run_event_loop`], never on a vCPU thread.
//!
//! # Event loop
//!
//! `poll(2)` over the API eventfd, the hotplug eject eventfd and the exit notifier's
//! eventfd, with a [`LEASE_POLL`] timeout: on every wake-up that is due, every device's
//! `status()` is checked for a lost lease (the lender died, or reported the device gone).
//!
//! # Removal
//!
//! `vm.remove-device` sets the slot-down bit and raises the GED interrupt; the device stays
//! (`removing`) until the guest writes the slot to B0EJ, then it is taken off the bus and
//! dropped (DMA unmapped, pins released, irqfds/GSIs/memslots/ioeventfds freed, lease
//! returned). `force` does the teardown at once and still notifies the guest; the guest's
//! later eject of the now empty slot is ignored. A lost lease tears the device down locally
//! at once, notifies the guest and keeps a `lost` entry until the guest ejects the slot or the
//! device is removed through the API.
//!
//! A slot whose device was torn down before the guest ejected it stays "present" in the
//! hotplug controller, so new devices go to other slots; only when no other slot is free is
//! such a slot reclaimed (the VMM completes the eject itself).

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use acpi::{EjectReceiver, PciHotplugController, RemovalRequest, PCI_HOTPLUG_START};
use api::request::ApiResponse;
use api::request::{serve_pending, ApiError, ApiHandler, ApiMessage, ApiReply, ApiRequest};
use api::types::{
    DmaWindowInfo, InterruptCounts, LeaseState as ApiLeaseState, PciBdf as ApiBdf, PciDeviceInfo,
    RemoteDeviceConfig, RemoteDeviceInfo, RemoteDeviceMode, RemoteDeviceSpec,
    VmAddRemoteDeviceData, VmConfigInfo, VmCounters, VmInfo, VmRemoveDeviceData, VmState,
    VmmPingResponse,
};
use pci::vm_ops::VmOps;
use pci::{BusDevice, PciBdf, SharedPciDevice};
use remote_pci::{
    IrqKind, LeaseState, MlockPinner, RemoteDeviceLink, RemoteDeviceStatus, RemotePciDevice,
    RemotePciDeviceParams,
};
use vmm_sys_util::eventfd::EventFd;

use crate::device_manager::DeviceManager;
use crate::exit::{ExitNotifier, VmExit};
use crate::interrupt::KvmInterruptManager;
use crate::platform::slot_intx_gsi;
use crate::remote::{
    effective_mode, AttachError, CountingPinner, LinkSource, ResourceCounters, VmmLink,
};
use crate::vm_ops::KvmVmOps;

/// How often device leases are checked for loss.
pub const LEASE_POLL: Duration = Duration::from_millis(200);
/// How long teardown waits for a vCPU thread to let go of a device it is accessing.
const RELEASE_WAIT: Duration = Duration::from_secs(2);
/// Highest slot on bus 0 (slot 0 is the host bridge).
const MAX_SLOT: u8 = 31;

/// What the controller needs of the VM.
#[derive(Clone)]
pub struct VmHandles {
    pub devices: Arc<DeviceManager>,
    pub interrupts: Arc<KvmInterruptManager>,
    pub vm_ops: Arc<KvmVmOps>,
    pub hotplug: Arc<Mutex<PciHotplugController>>,
    pub exit: Arc<ExitNotifier>,
}

struct Entry {
    spec: RemoteDeviceSpec,
    slot: u8,
    mode: RemoteDeviceMode,
    state: ApiLeaseState,
    device: Option<Arc<Mutex<RemotePciDevice>>>,
    /// Last status seen (kept for a lost device).
    last: Option<RemoteDeviceStatus>,
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// HTTP class of an attach error: the request names something that does not exist (400), the
/// device is taken (409), the lender is unreachable, refused us or failed (502, see
/// [`AttachError::is_lender_failure`]), or this VMM failed (500).
pub fn attach_api_error(e: &AttachError) -> ApiError {
    match e {
        AttachError::UnknownNode { .. } | AttachError::UnknownDevice { .. } => {
            ApiError::bad_request(e.to_string())
        }
        AttachError::Busy { .. } => ApiError::conflict(e.to_string()),
        e if e.is_lender_failure() => ApiError::bad_gateway(e.to_string()),
        _ => ApiError::internal(e.to_string()),
    }
}

/// Timings of one hot-add, logged at `info` (the hot-add benchmark reads them).
#[derive(Clone, Copy, Debug, Default)]
pub struct AddTimings {
    pub borrow: Duration,
    pub device: Duration,
    pub plug: Duration,
}

/// The device table and API semantics.
pub struct Controller {
    h: VmHandles,
    source: Box<dyn LinkSource>,
    counters: Arc<ResourceCounters>,
    entries: BTreeMap<String, Entry>,
    state: VmState,
    config: VmConfigInfo,
    next_auto_id: u32,
    last_lease_poll: Instant,
    /// Ejects the VMM itself performed to reclaim a slot; their channel messages are skipped.
    self_ejects: BTreeMap<u32, usize>,
}

impl Controller {
    pub fn new(h: VmHandles, source: Box<dyn LinkSource>, config: VmConfigInfo) -> Self {
        Self {
            h,
            source,
            counters: Arc::default(),
            entries: BTreeMap::new(),
            state: VmState::Created,
            config,
            next_auto_id: 0,
            last_lease_poll: Instant::now(),
            self_ejects: BTreeMap::new(),
        }
    }

    /// The VM's state as the API reports it.
    pub fn state(&self) -> VmState {
        self.state
    }

    /// Marks the VM running (after the vCPUs started).
    pub fn set_running(&mut self) {
        if self.state == VmState::Created {
            self.state = VmState::Running;
        }
    }

    /// Borrows and plugs the `--remote-device` devices before the guest starts (cold-plug:
    /// the slot is marked present, no GED event). Stops at the first error.
    pub fn attach_boot_devices(&mut self, devs: &[RemoteDeviceConfig]) -> Result<(), ApiError> {
        for d in devs {
            let info = self.attach(
                VmAddRemoteDeviceData {
                    device: d.device.clone(),
                    id: d.id.clone(),
                    mode: d.mode,
                },
                true,
            )?;
            log::info!("remote device {} ({}) at {}", info.id, d.device, info.bdf);
        }
        Ok(())
    }

    fn free_slot(&mut self) -> Option<u8> {
        let hp = lock(&self.h.hotplug);
        let bus = self.h.devices.pci_bus();
        let used_by_entry = |s: u8| self.entries.values().any(|e| e.slot == s);
        if let Some(s) = (1..=MAX_SLOT)
            .find(|&s| bus.device(s).is_none() && !hp.is_present(u32::from(s)) && !used_by_entry(s))
        {
            return Some(s);
        }
        // Reclaim a slot the guest never ejected after a forced removal or a loss.
        let s = (1..=MAX_SLOT).find(|&s| bus.device(s).is_none() && !used_by_entry(s))?;
        let was_present = hp.is_present(u32::from(s));
        drop(hp);
        if was_present {
            log::warn!(
                "pci slot {s}: the guest never ejected it; completing the eject to reuse it"
            );
            lock(&self.h.hotplug).write(PCI_HOTPLUG_START, 8, &(1u32 << s).to_le_bytes());
            *self.self_ejects.entry(u32::from(s)).or_default() += 1;
        }
        Some(s)
    }

    fn auto_id(&mut self) -> String {
        loop {
            let id = format!("_remote{}", self.next_auto_id);
            self.next_auto_id = self.next_auto_id.wrapping_add(1);
            if !self.entries.contains_key(&id) {
                return id;
            }
        }
    }

    /// Borrows `data.device` and plugs it into a free slot (`vm.add-remote-device`).
    pub fn attach(
        &mut self,
        data: VmAddRemoteDeviceData,
        boot: bool,
    ) -> Result<PciDeviceInfo, ApiError> {
        let accepting = if boot {
            self.state == VmState::Created
        } else {
            self.state == VmState::Running
        };
        if !accepting {
            return Err(ApiError::conflict(format!(
                "cannot add a device: the vm is {}",
                if self.state == VmState::ShuttingDown {
                    VmState::Shutdown
                } else {
                    self.state
                }
            )));
        }
        data.validate()
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let spec = data.device.clone();
        self.source
            .check_node(&spec.node)
            .map_err(|e| attach_api_error(&e))?;
        if let Some(id) = &data.id {
            if self.entries.contains_key(id) {
                return Err(ApiError::conflict(format!(
                    "device id {id} is already in use"
                )));
            }
        }
        if let Some((other, _)) = self.entries.iter().find(|(_, e)| e.spec == spec) {
            return Err(ApiError::conflict(format!(
                "{spec} is already attached as {other}"
            )));
        }
        let slot = self
            .free_slot()
            .ok_or_else(|| ApiError::conflict("no free pci slot on bus 0"))?;
        let requested = data.mode.unwrap_or_default();

        let t0 = Instant::now();
        let link = self.source.borrow(&spec).map_err(|e| {
            log::debug!("{spec}: {e}");
            attach_api_error(&e)
        })?;
        let t1 = Instant::now();
        // Chosen only now, so refused adds do not use up automatic ids (as in FakeVmm).
        let id = match data.id {
            Some(id) => id,
            None => self.auto_id(),
        };
        let link = VmmLink::new(link, requested, &self.counters);
        let mode = effective_mode(&link.device_info());
        if mode != requested {
            log::info!("{id}: {requested} requested, the fabric gives {mode}");
        }
        let mut params = RemotePciDeviceParams::new(
            id.clone(),
            PciBdf::new(0, slot, 0).requester_id(),
            Some(slot_intx_gsi(slot)),
        );
        params.pinner = Arc::new(CountingPinner::new(
            Arc::new(MlockPinner),
            self.counters.clone(),
        ));
        let vm_ops: Arc<dyn VmOps> = self.h.vm_ops.clone();
        let device = RemotePciDevice::new(params, Box::new(link), vm_ops, &*self.h.interrupts)
            .map_err(|e| ApiError::internal(format!("cannot create device {id}: {e}")))?;
        let device = Arc::new(Mutex::new(device));
        let t2 = Instant::now();
        let shared: SharedPciDevice = device.clone();
        let bdf = self
            .h
            .devices
            .add_pci_device(shared, Some(slot))
            .map_err(|e| {
                ApiError::internal(format!("cannot plug device {id} into slot {slot}: {e}"))
            })?;
        let plugged = {
            let mut hp = lock(&self.h.hotplug);
            if boot {
                hp.mark_present(u32::from(slot))
            } else {
                hp.slot_added(u32::from(slot))
            }
        };
        if let Err(e) = plugged {
            self.unplug(&id, slot, device);
            return Err(ApiError::internal(format!(
                "cannot announce device {id} in slot {slot}: {e}"
            )));
        }
        let t3 = Instant::now();
        let times = AddTimings {
            borrow: t1 - t0,
            device: t2 - t1,
            plug: t3 - t2,
        };
        log::info!(
            "{} {id}: {spec} at {bdf} ({mode}) in {:.3} ms (borrow {:.3} ms, device {:.3} ms, \
             bus + GED {:.3} ms)",
            if boot { "cold-plugged" } else { "hot-added" },
            (t3 - t0).as_secs_f64() * 1e3,
            times.borrow.as_secs_f64() * 1e3,
            times.device.as_secs_f64() * 1e3,
            times.plug.as_secs_f64() * 1e3,
        );
        self.entries.insert(
            id.clone(),
            Entry {
                spec,
                slot,
                mode,
                state: ApiLeaseState::Active,
                device: Some(device),
                last: None,
            },
        );
        Ok(PciDeviceInfo {
            id,
            bdf: ApiBdf {
                domain: 0,
                bus: bdf.bus(),
                device: bdf.device(),
                function: bdf.function(),
            },
        })
    }

    /// Takes the device off the bus and drops it here (not on a vCPU thread).
    fn unplug(&self, id: &str, slot: u8, device: Arc<Mutex<RemotePciDevice>>) {
        if let Err(e) = self.h.devices.remove_pci_device(slot) {
            log::warn!("{id}: removing slot {slot} from the bus: {e}");
        }
        // A vCPU may still hold a clone for an access in flight; let it finish.
        let deadline = Instant::now() + RELEASE_WAIT;
        while Arc::strong_count(&device) > 1 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        if Arc::strong_count(&device) > 1 {
            log::warn!("{id}: still referenced after {RELEASE_WAIT:?}; released by its last user");
        }
        let t = Instant::now();
        drop(device);
        log::info!(
            "{id}: slot {slot} torn down in {:.3} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
    }

    fn teardown(&mut self, id: &str) {
        let Some(e) = self.entries.get_mut(id) else {
            return;
        };
        if let Some(dev) = e.device.take() {
            e.last = Some(lock(&dev).status());
            let slot = e.slot;
            self.unplug(id, slot, dev);
        }
    }

    /// `vm.remove-device`.
    pub fn remove(&mut self, data: VmRemoveDeviceData) -> Result<(), ApiError> {
        if self.state != VmState::Running {
            return Err(ApiError::conflict(format!(
                "cannot remove a device: the vm is {}",
                if self.state == VmState::ShuttingDown {
                    VmState::Shutdown
                } else {
                    self.state
                }
            )));
        }
        let id = data.id;
        let e = self
            .entries
            .get_mut(&id)
            .ok_or_else(|| ApiError::not_found(format!("no device with id {id}")))?;
        match e.state {
            ApiLeaseState::Lost => {
                // Already torn down when the lease was lost; the guest was told then.
                self.entries.remove(&id);
                log::info!("{id}: lost device removed from the table");
                return Ok(());
            }
            ApiLeaseState::Removing if !data.force => {
                return Err(ApiError::conflict(format!(
                    "removal of {id} is already pending (waiting for the guest to eject it); \
                     use force to remove it now"
                )));
            }
            ApiLeaseState::Removing => {}
            ApiLeaseState::Active | ApiLeaseState::Pending => {
                let slot = e.slot;
                match lock(&self.h.hotplug).slot_removal_requested(u32::from(slot)) {
                    Ok(RemovalRequest::Requested | RemovalRequest::AlreadyPending) => {}
                    Err(err) => log::warn!("{id}: notifying the guest of the removal: {err}"),
                }
                e.state = ApiLeaseState::Removing;
            }
        }
        if data.force {
            self.teardown(&id);
            self.entries.remove(&id);
            log::info!("{id}: force-removed");
        }
        Ok(())
    }

    /// Slots the guest ejected (B0EJ): tear their devices down.
    pub fn on_ejects(&mut self, slots: &[u32]) {
        for &slot in slots {
            if let Some(n) = self.self_ejects.get_mut(&slot) {
                *n -= 1;
                if *n == 0 {
                    self.self_ejects.remove(&slot);
                }
                log::debug!("slot {slot}: eject done by the vmm itself");
                continue;
            }
            let id = self
                .entries
                .iter()
                .find(|(_, e)| u32::from(e.slot) == slot)
                .map(|(id, _)| id.clone());
            match id {
                Some(id) => {
                    log::info!("{id}: guest ejected slot {slot}");
                    self.teardown(&id);
                    self.entries.remove(&id);
                }
                None => log::debug!("guest ejected slot {slot}, already torn down"),
            }
        }
    }

    /// Checks every live device's lease; a lost one is torn down locally and the guest is
    /// asked to release it. Runs at most every [`LEASE_POLL`] unless `force`.
    pub fn poll_leases(&mut self, force: bool) {
        if !force && self.last_lease_poll.elapsed() < LEASE_POLL {
            return;
        }
        self.last_lease_poll = Instant::now();
        let mut lost = Vec::new();
        for (id, e) in &self.entries {
            let Some(dev) = &e.device else { continue };
            let lease = lock(dev).status().lease;
            match lease {
                LeaseState::Active => {}
                LeaseState::Lost(why) => lost.push((id.clone(), why)),
                LeaseState::Returned => lost.push((id.clone(), "lease returned".into())),
            }
        }
        for (id, why) in lost {
            log::error!("{id}: lease lost ({why}); surprise removal, the vm keeps running");
            self.teardown(&id);
            let Some(e) = self.entries.get_mut(&id) else {
                continue;
            };
            e.state = ApiLeaseState::Lost;
            let slot = u32::from(e.slot);
            if let Err(err) = lock(&self.h.hotplug).slot_removal_requested(slot) {
                log::warn!("{id}: notifying the guest of the loss: {err}");
            }
        }
    }

    /// Tears every device down (VM shutdown).
    pub fn teardown_all(&mut self) {
        let ids: Vec<String> = self.entries.keys().cloned().collect();
        for id in ids {
            self.teardown(&id);
        }
        self.entries.clear();
        if self.state != VmState::Created {
            self.state = VmState::Shutdown;
        }
    }

    fn device_info(id: &str, e: &Entry) -> RemoteDeviceInfo {
        let st = e.device.as_ref().map(|d| lock(d).status());
        let st = st.as_ref().or(e.last.as_ref());
        let live = e.device.is_some();
        let dma_window = DmaWindowInfo {
            mapped: live && st.is_some_and(|s| s.dma_mapped),
            size: if live {
                st.map_or(0, |s| s.dma_bytes)
            } else {
                0
            },
        };
        let mut interrupts = InterruptCounts::default();
        if let Some(s) = st {
            let total: u64 = s.irq_counts.as_ref().map_or(0, |v| v.iter().sum());
            match s.irq_mode {
                Some(IrqKind::Msix) => interrupts.msix = total,
                Some(IrqKind::Msi) => interrupts.msi = total,
                Some(IrqKind::Intx) => interrupts.intx = total,
                None => {}
            }
        }
        RemoteDeviceInfo {
            id: id.to_string(),
            node: e.spec.node.clone(),
            lender_bdf: e.spec.bdf,
            guest_bdf: ApiBdf {
                domain: 0,
                bus: 0,
                device: e.slot,
                function: 0,
            },
            mode: e.mode,
            lease_state: e.state,
            dma_window,
            interrupts,
        }
    }

    /// VMM-wide resource counters.
    pub fn counters(&self) -> VmCounters {
        let gsis = lock(self.h.interrupts.gsi_allocator()).in_use();
        VmCounters {
            devices: self.entries.len() as u64,
            leases: self.counters.leases.load(Ordering::SeqCst) as u64,
            memslots: self.h.vm_ops.memslots_in_use() as u64,
            gsis: gsis as u64,
            irqfds: self.h.interrupts.irqfds_registered() as u64,
            ioeventfds: self.h.vm_ops.ioevents_registered() as u64,
            pinned_bytes: self.counters.pinned_bytes.load(Ordering::SeqCst),
        }
    }

    /// `vm.info`.
    pub fn info(&self) -> VmInfo {
        VmInfo {
            config: self.config.clone(),
            state: self.state,
            remote_devices: self
                .entries
                .iter()
                .map(|(id, e)| Self::device_info(id, e))
                .collect(),
            counters: Some(self.counters()),
        }
    }
}

impl ApiHandler for Controller {
    fn handle(&mut self, request: ApiRequest) -> ApiReply {
        match request {
            ApiRequest::VmmPing => Ok(ApiResponse::Pong(VmmPingResponse {
                version: env!("CARGO_PKG_VERSION").to_string(),
                pid: i64::from(std::process::id()),
                features: vec!["remote_pci".into(), "hotplug".into(), "counters".into()],
            })),
            ApiRequest::VmInfo => Ok(ApiResponse::VmInfo(self.info())),
            ApiRequest::VmAddRemoteDevice(data) => {
                self.attach(data, false).map(ApiResponse::DeviceAdded)
            }
            ApiRequest::VmRemoveDevice(data) => self.remove(data).map(|()| ApiResponse::Empty),
            ApiRequest::VmShutdown => {
                if self.state != VmState::Running {
                    return Err(ApiError::conflict("the vm is already shut down"));
                }
                self.state = VmState::ShuttingDown;
                self.h.exit.request(VmExit::Shutdown(
                    "vm.shutdown requested through the api".into(),
                ));
                Ok(ApiResponse::Empty)
            }
        }
    }
}

/// The API request channel and its eventfd.
pub struct ApiChannel {
    pub rx: Receiver<ApiMessage>,
    pub evt: EventFd,
}

/// Runs the control loop until the VM exits; returns the exit reason. The vCPUs must be
/// running; the caller stops them and calls [`Controller::teardown_all`] afterwards.
pub fn run_event_loop(
    ctl: &mut Controller,
    api: Option<&ApiChannel>,
    ejects: &EjectReceiver,
    exit: &ExitNotifier,
) -> VmExit {
    const API: usize = 0;
    const EJECT: usize = 1;
    const EXIT: usize = 2;
    let fd = |e: Option<&EventFd>| e.map_or(-1, |e| e.as_raw_fd());
    let mut pfds = [
        libc::pollfd {
            fd: fd(api.map(|a| &a.evt)),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: ejects.eventfd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: fd(exit.eventfd()),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        if let Some(reason) = exit.reason() {
            if ctl.state == VmState::Running {
                ctl.state = VmState::ShuttingDown;
            }
            return reason;
        }
        for p in &mut pfds {
            p.revents = 0;
        }
        // SAFETY: `pfds` is an array of initialised pollfds that outlives the call; negative
        // fds are ignored by poll.
        let n = unsafe {
            libc::poll(
                pfds.as_mut_ptr(),
                pfds.len() as libc::nfds_t,
                LEASE_POLL.as_millis() as libc::c_int,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                log::error!("event loop poll: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
            continue;
        }
        if pfds[EJECT].revents & libc::POLLIN != 0 {
            ctl.on_ejects(&ejects.drain());
        }
        if let Some(a) = api {
            if pfds[API].revents & libc::POLLIN != 0 {
                serve_pending(&a.rx, &a.evt, ctl);
            }
        }
        let _ = pfds[EXIT].revents;
        ctl.poll_leases(false);
    }
}

#[cfg(test)]
#[path = "control_tests.rs"]
mod tests;
