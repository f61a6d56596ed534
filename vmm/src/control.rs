//! The VMM control plane: the remote-device table, the REST API handler and the event loop.
//!
//! [`Controller`] owns every borrowed device and implements [`ApiHandler`] with the
//! semantics of `api::fake::FakeVmm` (same status codes and messages). All lender traffic of
//! hot-add and removal (connect, borrow, return, DMA unmap on teardown) runs here, on the
//! control thread ([`crate::event_loop`]), never on a vCPU thread.
//!
//! # Event loop
//!
//! [`crate::event_loop`] runs the controller on `event-manager`, one subscriber per source:
//! API requests, guest ejects, the VM's exit, a timer for deferred device drops, and one per
//! device whose eventfd the device's link writes when its lease is lost. Nothing polls on a
//! timer. The controller queues the subscribers of devices it adds and removes
//! ([`Controller::take_subscriber_changes`]); the loop applies them between dispatches.
//!
//! # Threads
//!
//! Teardown and lease return run here, never on a vCPU thread: a vCPU that still holds a
//! device reference (an access in flight) only delays the final drop, which is retried from
//! the release timer ([`crate::vcpu::assert_not_on_vcpu`] checks it in debug builds).
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
//!
//! # Release
//!
//! A removed device's lender device is released once nothing of it is left here: the guest
//! ejected it (or `force`), its drop ran (DMA unmapped, lease returned; the lender answers
//! RETURN after it has unmapped and reset the device) and its table entry is gone. Then the
//! `device-released` event (`id`, `device`) goes out. Until then a re-add of the same lender
//! device is refused with 409 saying that it is still being released and what it waits for
//! ([`api::request::still_being_released`]), not that it is attached. `vm.remove-device`
//! does not wait for the release: the guest's eject may take any time (or never come), and
//! the API answers on the control thread, which serves every other request too. With
//! `force` the release is done when the answer comes, unless a vCPU is inside an access to
//! the device (then milliseconds later, from the release timer). A lost device is released
//! when its entry is cleared.

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use acpi::{PciHotplugController, RemovalRequest};
use api::events::EventBus;
use api::request::{
    already_attached, id_in_use, pause_refusal, still_being_released, ApiResponse, ReleaseWait,
};
use api::request::{ApiError, ApiHandler, ApiReply, ApiRequest};
use api::types::{
    DeviceAccessCounts, DmaWindowInfo, InterruptCounts, KvmExitCounts, LeaseState as ApiLeaseState,
    PciBdf as ApiBdf, PciDeviceInfo, RemoteDeviceConfig, RemoteDeviceInfo, RemoteDeviceMode,
    RemoteDeviceSpec, VmAddRemoteDeviceData, VmConfigInfo, VmCounters, VmCountersReport, VmInfo,
    VmRemoveDeviceData, VmSendMigrationData, VmSnapshotConfig, VmState, VmmPingResponse,
};
use pci::vm_ops::VmOps;
use pci::SharedPciDevice;
use remote_pci::{
    IrqKind, LeaseState, RemoteDeviceLink, RemoteDeviceStatus, RemotePciDevice,
    RemotePciDeviceParams,
};
use serde_json::Value;
use vmm_sys_util::eventfd::EventFd;

use crate::device_events::DeviceHook;
use crate::device_manager::DeviceManager;
use crate::dma::DmaManager;
use crate::exit::{ExitNotifier, VmExit};
use crate::interrupt::KvmInterruptManager;
use crate::platform::slot_intx_gsi;
use crate::remote::{effective_mode, AttachError, LinkSource, ResourceCounters, VmmLink};
use crate::snapshot::SnapshotSource;
use crate::vcpu::VcpuControl;
use crate::vm_ops::KvmVmOps;

/// How long teardown waits in line for a vCPU thread to let go of a device it is accessing
/// (one MMIO access); after that the drop is deferred to the release timer.
const RELEASE_SPIN: Duration = Duration::from_millis(20);
/// How often a deferred drop is retried.
const RELEASE_RETRY: Duration = Duration::from_millis(5);
/// A vCPU holding a device longer than this is reported (it is still never dropped there).
const RELEASE_WARN: Duration = Duration::from_secs(2);
/// How long `vm.pause` waits for every vCPU to park.
const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// What the controller needs of the VM.
#[derive(Clone)]
pub struct VmHandles {
    pub devices: Arc<DeviceManager>,
    pub interrupts: Arc<KvmInterruptManager>,
    pub vm_ops: Arc<KvmVmOps>,
    pub hotplug: Arc<Mutex<PciHotplugController>>,
    pub exit: Arc<ExitNotifier>,
    pub vcpus: Arc<VcpuControl>,
    pub events: Arc<EventBus>,
}

/// A change to the event loop's device subscribers, queued by the controller.
pub enum SubscriberChange {
    /// Watch `lost` (written by the device's link on lease loss) for device `key`.
    Add { key: u64, id: String, lost: EventFd },
    /// Stop watching device `key`.
    Remove { key: u64 },
}

/// A torn-down device a vCPU still held; dropped by the release timer once it lets go.
struct Deferred {
    id: String,
    slot: u8,
    since: Instant,
    warned: bool,
    device: Arc<Mutex<RemotePciDevice>>,
    /// What to announce once it is gone.
    returned: Option<LeaseReturned>,
    /// The lender device, while a re-add of it must wait for this drop (`None`: a device
    /// that was never in the table, whose add failed).
    spec: Option<RemoteDeviceSpec>,
}

/// The `lease-returned` event of a device being dropped.
struct LeaseReturned {
    node: String,
    device: String,
}

struct Entry {
    spec: RemoteDeviceSpec,
    slot: u8,
    mode: RemoteDeviceMode,
    state: ApiLeaseState,
    device: Option<Arc<Mutex<RemotePciDevice>>>,
    /// Last status seen (kept for a lost device).
    last: Option<RemoteDeviceStatus>,
    /// Identifies this attachment's event subscriber (ids can be reused).
    key: u64,
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `e` and its sources, joined with ": " (repeats left out).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let text = c.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = c.source();
    }
    s
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
    /// From the request to the borrow: state and id checks, the free slot.
    pub checks: Duration,
    /// The lender: session (new, or shared with the lender's other devices), borrow, link.
    pub borrow: Duration,
    /// The device model (BARs, interrupts, memslots).
    pub device: Duration,
    /// Onto the PCI bus.
    pub bus: Duration,
    /// The hotplug controller's slot bit and the GED interrupt.
    pub ged: Duration,
}

/// Each lent device's lender-side counts, by device id ([`Controller::lender_counts`]).
type LenderCounts = std::collections::HashMap<
    String,
    Result<Option<remote_pci::link::LenderCounters>, remote_pci::link::LinkError>,
>;

/// The device table and API semantics.
pub struct Controller {
    h: VmHandles,
    source: Box<dyn LinkSource>,
    counters: Arc<ResourceCounters>,
    /// The VM's one pin of guest RAM, shared by the devices with Bus Master Enable set.
    dma: Arc<DmaManager>,
    /// The VM's peer-to-peer table: devices of one lender reach each other's BARs.
    p2p: Arc<remote_pci::P2pRouter>,
    entries: BTreeMap<String, Entry>,
    state: VmState,
    config: VmConfigInfo,
    next_auto_id: u32,
    next_key: u64,
    /// Ejects the VMM itself performed to reclaim a slot; their channel messages are skipped.
    self_ejects: BTreeMap<u32, usize>,
    subscriber_changes: Vec<SubscriberChange>,
    deferred: Vec<Deferred>,
    release_timer: Option<vmm_sys_util::timerfd::TimerFd>,
    /// What `vm.snapshot` reads (absent in unit tests without a KVM VM).
    snapshot: Option<SnapshotSource>,
    /// How an outgoing migration authenticates (the cluster secret, this node's name).
    migration_auth: crate::migration::auth::StreamAuth,
    /// Guest RAM a migration destination pinned ahead of the hand-over, until it is over.
    prepinned: Option<Arc<crate::dma::Prepinned>>,
    /// Ranges pinned ahead that no device took while others hold the pin: kept (dropping
    /// them would munlock RAM the devices' pin relies on) until the controller goes.
    _spare_pins: Vec<remote_pci::PinnedRange>,
    /// Live-migration progress, also read by metrics scrapes while a migration runs.
    migration: Arc<crate::metrics::MigrationProgress>,
}

impl Controller {
    pub fn new(h: VmHandles, source: Box<dyn LinkSource>, config: VmConfigInfo) -> Self {
        let counters: Arc<ResourceCounters> = Arc::default();
        Self {
            h,
            source,
            dma: Arc::new(DmaManager::new(counters.clone())),
            p2p: remote_pci::P2pRouter::new(),
            counters,
            entries: BTreeMap::new(),
            state: VmState::Created,
            config,
            next_auto_id: 0,
            next_key: 0,
            self_ejects: BTreeMap::new(),
            migration: Arc::new(crate::metrics::MigrationProgress::new()),
            subscriber_changes: Vec::new(),
            deferred: Vec::new(),
            release_timer: match vmm_sys_util::timerfd::TimerFd::new() {
                Ok(t) => {
                    // Non-blocking, so a check with nothing expired returns at once.
                    // SAFETY: F_SETFL on an fd the TimerFd owns; no memory is involved.
                    let r = unsafe { libc::fcntl(t.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
                    if r < 0 {
                        log::warn!(
                            "release timer: O_NONBLOCK: {}",
                            std::io::Error::last_os_error()
                        );
                    }
                    Some(t)
                }
                Err(e) => {
                    log::error!("release timer: {e}; a device a vCPU still holds is dropped late");
                    None
                }
            },
            snapshot: None,
            migration_auth: Default::default(),
            prepinned: None,
            _spare_pins: Vec::new(),
        }
    }

    /// A migration destination: guest RAM was pinned ahead of the hand-over; the devices'
    /// Bus Master Enable takes that pin instead of pinning again. Before any device.
    pub fn adopt_prepinned_ram(&mut self, pins: Vec<remote_pci::PinnedRange>) {
        if pins.is_empty() || !self.entries.is_empty() {
            return;
        }
        let pre = Arc::new(crate::dma::Prepinned::new(
            Arc::new(remote_pci::ParallelPinner::available()),
            pins,
        ));
        self.dma = Arc::new(DmaManager::with_pinner(pre.clone(), self.counters.clone()));
        self.prepinned = Some(pre);
    }

    /// The hand-over is over: ranges pinned ahead that no device took are unpinned if
    /// nothing holds the pin (else kept, see `_spare_pins`).
    fn settle_prepinned(&mut self) {
        let Some(pre) = self.prepinned.take() else {
            return;
        };
        let rest = pre.disarm();
        if !rest.is_empty() && self.dma.holders() > 0 {
            log::warn!(
                "{} ranges pinned ahead were not taken; kept pinned",
                rest.len()
            );
            self._spare_pins = rest;
        }
    }

    /// Enables `vm.snapshot` with what it reads of the VM.
    pub fn set_snapshot_source(&mut self, source: SnapshotSource) {
        self.snapshot = Some(source);
    }

    /// How `vm.send-migration` authenticates to the destination.
    pub fn set_migration_auth(&mut self, auth: crate::migration::auth::StreamAuth) {
        self.migration_auth = auth;
    }

    /// Marks a restored VM: its vCPUs were started parked, so the VM is paused until
    /// `vm.resume`.
    pub fn set_restored_paused(&mut self) {
        if self.state == VmState::Created {
            self.state = VmState::Paused;
        }
    }

    /// `vm.snapshot`: checks the destination, pauses a running VM, writes the snapshot and
    /// resumes the VM (a paused VM stays paused). Any failure leaves the VM as it was and
    /// removes what was written.
    pub fn snapshot(&mut self, data: &VmSnapshotConfig) -> Result<(), ApiError> {
        if !matches!(self.state, VmState::Running | VmState::Paused) {
            return Err(ApiError::conflict(format!(
                "cannot snapshot the vm: it is {}",
                self.state
            )));
        }
        let Some(src) = self.snapshot.clone() else {
            return Err(ApiError::internal("this vmm cannot take snapshots"));
        };
        let url = data.destination_url.as_str();
        let dir = crate::snapshot::format::parse_url(url)
            .map_err(|e| ApiError::bad_request(error_chain(&e)))?;
        crate::snapshot::format::prepare_destination(&dir)
            .map_err(|e| ApiError::bad_request(error_chain(&e)))?;
        let t0 = Instant::now();
        self.emit(
            "vm",
            "snapshot-started",
            [("destination_url", Value::from(url))],
        );
        let was_running = self.state == VmState::Running;
        if was_running {
            if let Err(e) = self.pause() {
                crate::snapshot::format::remove_partial(&dir, 0);
                self.emit(
                    "vm",
                    "snapshot-failed",
                    [
                        ("destination_url", Value::from(url)),
                        ("error", Value::from(e.message.clone())),
                    ],
                );
                return Err(e);
            }
        }
        let saved = self
            .save_lent_devices()
            .and_then(|lent| src.save(&dir, lent));
        if was_running {
            if let Err(e) = self.resume() {
                log::error!("resuming after the snapshot: {e}");
            }
        }
        match saved {
            Ok(s) => {
                self.emit(
                    "vm",
                    "snapshot-completed",
                    [
                        ("destination_url", Value::from(url)),
                        ("ram_bytes", Value::from(s.ram_bytes)),
                        ("took_ms", Value::from(t0.elapsed().as_millis() as u64)),
                    ],
                );
                Ok(())
            }
            Err(e) => {
                let msg = error_chain(&e);
                log::error!("snapshot to {url} failed: {msg}");
                self.emit(
                    "vm",
                    "snapshot-failed",
                    [
                        ("destination_url", Value::from(url)),
                        ("error", Value::from(msg.clone())),
                    ],
                );
                Err(ApiError::internal(format!("snapshot failed: {msg}")))
            }
        }
    }

    /// `vm.send-migration` (see [`crate::migration::orchestrate::send_migration`]).
    pub fn send_migration(&mut self, data: &VmSendMigrationData) -> Result<(), ApiError> {
        crate::migration::orchestrate::send_migration(self, data)
    }

    /// The destination's side of the hand-over, before it acknowledges the migration (see
    /// [`crate::migration::orchestrate::take_over_lent_devices`]).
    pub fn take_over_lent_devices(
        &mut self,
        lent: &[crate::snapshot::devices::LentDevice],
        handover: &[crate::migration::protocol::DeviceHandover],
    ) -> Result<(), ApiError> {
        let r = crate::migration::orchestrate::take_over_lent_devices(self, lent, handover);
        self.settle_prepinned();
        r
    }

    /// The lent devices' lease identities and guest-visible PCI state (VM paused). A lost
    /// device is not saved: the restored guest finds its slot empty, as it was.
    fn save_lent_devices(
        &self,
    ) -> Result<Vec<crate::snapshot::devices::LentDevice>, crate::snapshot::SnapshotError> {
        let mut out = Vec::new();
        // In the order they were attached: a restore attaches them in this order, so the BAR
        // allocators hand out the same addresses again (the replay moves any that differ).
        let mut entries: Vec<(&String, &Entry)> = self.entries.iter().collect();
        entries.sort_by_key(|(_, e)| e.key);
        for (id, e) in entries {
            if e.device.is_none() {
                log::info!("{id}: lost, not in the snapshot");
                continue;
            }
            out.push(crate::snapshot::devices::save_lent(
                self.h.devices.mmio_bus(),
                self.h.devices.pci_bus().bdf_of(e.slot),
                id,
                e.spec.to_string(),
                e.mode,
                e.slot,
            )?);
        }
        Ok(out)
    }

    /// Puts a lent device's saved guest-visible PCI state back (restore and migration).
    fn replay_lent_state(&self, d: &crate::snapshot::devices::LentDevice) -> Result<(), ApiError> {
        let pci = self.h.devices.pci_bus();
        crate::snapshot::devices::replay_lent(
            self.h.devices.mmio_bus(),
            pci.bdf_of(d.slot),
            d,
            &|| pci.refused_bar_moves(),
        )
        .map_err(|e| ApiError::internal(error_chain(&e)))
    }

    /// Restore: re-borrows each lent device of the snapshot into its old slot, has the
    /// lender reset it (as after a guest reboot) and re-applies the guest's PCI state (BARs,
    /// MSI-X, Command: Bus Master Enable maps guest RAM for DMA again). Before the vCPUs
    /// run; the slots' presence is already in the restored hotplug state.
    pub fn restore_lent_devices(
        &mut self,
        lent: &[crate::snapshot::devices::LentDevice],
    ) -> Result<(), ApiError> {
        for d in lent {
            self.attach_in(lent_device_request(d)?, true, Some(d.slot))?;
            let Some(dev) = self.entries.get(&d.id).and_then(|e| e.device.clone()) else {
                return Err(ApiError::internal(format!("{}: not attached", d.id)));
            };
            // The lender resets the function (DMA unmapped, MSI-X and Command cleared):
            // whatever the device held at the snapshot is gone, as after a guest reboot.
            if let Err(e) = pci::PciDevice::reset(&mut *lock(&dev)) {
                return Err(ApiError::bad_gateway(format!("{}: reset: {e}", d.id)));
            }
            self.replay_lent_state(d)?;
            self.emit(
                "device",
                "device-restored",
                [
                    ("id", Value::from(d.id.as_str())),
                    ("device", Value::from(d.device.as_str())),
                    ("slot", Value::from(d.slot)),
                ],
            );
        }
        Ok(())
    }

    /// Pins through `pinner` from now on (tests: a recording pinner). Only before any
    /// device has DMA enabled.
    #[cfg(test)]
    pub(crate) fn set_dma_pinner(&mut self, pinner: Arc<dyn remote_pci::Pinner>) {
        self.dma = Arc::new(DmaManager::with_pinner(pinner, self.counters.clone()));
    }

    /// The VM's DMA manager.
    pub fn dma(&self) -> &Arc<DmaManager> {
        &self.dma
    }

    /// The VM exited: the API answers from now on as for a VM shutting down.
    pub fn note_exit(&mut self) {
        if matches!(self.state, VmState::Running | VmState::Paused) {
            self.state = VmState::ShuttingDown;
        }
    }

    /// The event bus.
    pub fn events(&self) -> &Arc<EventBus> {
        &self.h.events
    }

    /// Subscribers to add or remove, in order (for the event loop).
    pub fn take_subscriber_changes(&mut self) -> Vec<SubscriberChange> {
        std::mem::take(&mut self.subscriber_changes)
    }

    /// The timer that retries deferred device drops (for the event loop).
    pub fn release_timer_fd(&self) -> Option<std::os::fd::RawFd> {
        self.release_timer.as_ref().map(|t| t.as_raw_fd())
    }

    /// Devices torn down but still referenced by a vCPU.
    pub fn deferred_drops(&self) -> usize {
        self.deferred.len()
    }

    fn emit<const N: usize>(&self, source: &str, event: &str, props: [(&str, Value); N]) {
        self.h.events.emit(source, event, props);
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
                    replace_lost: false,
                    numa_node: d.numa_node,
                },
                true,
            )?;
            log::info!("remote device {} ({}) at {}", info.id, d.device, info.bdf);
        }
        Ok(())
    }

    /// A free slot number on bus index `root` (a root bus or a switch).
    fn free_slot(&mut self, root: u8) -> Option<u8> {
        let hp = lock(&self.h.hotplug);
        let bus = self.h.devices.pci_bus();
        let used_by_entry = |s: u8| self.entries.values().any(|e| e.slot == s);
        let slots = || {
            bus.device_numbers(root)
                .map(|d| pci::root::slot_number(root, d))
        };
        if let Some(s) = slots()
            .find(|&s| bus.device(s).is_none() && !hp.is_present(u32::from(s)) && !used_by_entry(s))
        {
            return Some(s);
        }
        // Reclaim a slot the guest never ejected after a forced removal or a loss.
        let s = slots().find(|&s| bus.device(s).is_none() && !used_by_entry(s))?;
        let was_present = hp.is_present(u32::from(s));
        drop(hp);
        if was_present {
            log::warn!(
                "pci slot {s}: the guest never ejected it; completing the eject to reuse it"
            );
            if let Err(e) = lock(&self.h.hotplug).complete_eject(u32::from(s)) {
                log::warn!("pci slot {s}: completing its eject: {e}");
            }
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
        self.attach_in(data, boot, None)
    }

    /// [`Controller::attach`]; `restore_slot` (restore only) plugs into that slot and leaves
    /// the hotplug controller alone (its restored state already has the slot).
    fn attach_in(
        &mut self,
        data: VmAddRemoteDeviceData,
        boot: bool,
        restore_slot: Option<u8>,
    ) -> Result<PciDeviceInfo, ApiError> {
        self.attach_taking(data, boot, restore_slot, None)
    }

    /// [`Controller::attach_in`]; with `ticket`, the lease is taken over from a migration
    /// source instead of borrowed.
    fn attach_taking(
        &mut self,
        data: VmAddRemoteDeviceData,
        boot: bool,
        restore_slot: Option<u8>,
        ticket: Option<&remote_pci::LeaseTicket>,
    ) -> Result<PciDeviceInfo, ApiError> {
        let r = self.attach_once(data, boot, restore_slot, ticket);
        if r.is_err() {
            // A link borrowed for it may have been dropped: its session may be idle now.
            self.source.released();
        }
        r
    }

    /// [`Controller::attach_taking`] without the clean-up hint.
    fn attach_once(
        &mut self,
        data: VmAddRemoteDeviceData,
        boot: bool,
        restore_slot: Option<u8>,
        ticket: Option<&remote_pci::LeaseTicket>,
    ) -> Result<PciDeviceInfo, ApiError> {
        let start = Instant::now();
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
        if data.replace_lost {
            let lost: Vec<String> = self
                .entries
                .iter()
                .filter(|(id, e)| {
                    e.state == ApiLeaseState::Lost
                        && (data.id.as_ref() == Some(*id) || e.spec == spec)
                })
                .map(|(id, _)| id.clone())
                .collect();
            for id in lost {
                log::info!("{id}: lost device cleared to re-add {spec}");
                self.forget(&id);
            }
        }
        // Before the id check: a re-add under the old id should hear why it must wait too.
        if let Some((old, wait)) = self.release_pending(&spec) {
            return Err(ApiError::conflict(still_being_released(&spec, &old, wait)));
        }
        if let Some(id) = &data.id {
            if let Some(e) = self.entries.get(id) {
                return Err(ApiError::conflict(id_in_use(
                    id,
                    e.state == ApiLeaseState::Lost,
                )));
            }
        }
        if let Some((other, e)) = self.entries.iter().find(|(_, e)| e.spec == spec) {
            return Err(ApiError::conflict(already_attached(
                &spec,
                other,
                e.state == ApiLeaseState::Lost,
            )));
        }
        // The node's root bus: a `numa_node=` the VM cannot honour is refused by name before
        // anything is borrowed; the cluster file's default for the lender is a hint, and a VM
        // without that node puts the device on bus 0. A restore keeps the saved slot.
        let root = match (data.numa_node, restore_slot) {
            (_, Some(_)) => 0,
            (Some(node), None) => self
                .h
                .devices
                .bus_of_node(node)
                .map_err(|e| ApiError::bad_request(e.to_string()))?,
            (None, None) => match self.source.default_numa_node(spec.node.as_str()) {
                Some(node) => self.h.devices.bus_of_node(node).unwrap_or_else(|e| {
                    log::info!(
                        "{spec}: the cluster file's numa_node for {}: {e}; on bus 0",
                        spec.node
                    );
                    0
                }),
                None => 0,
            },
        };
        let slot = match restore_slot {
            Some(s)
                if self.h.devices.pci_bus().check_slot(s).is_ok()
                    && self.h.devices.pci_bus().device(s).is_none() =>
            {
                s
            }
            Some(s) => {
                return Err(ApiError::conflict(format!(
                    "pci slot {s} of the snapshot is not free"
                )))
            }
            // Behind the lender's switch while it has a free port, else on the root bus.
            None => match self
                .h
                .devices
                .switch_for(spec.node.as_str(), root)
                .and_then(|sw| self.free_slot(sw))
            {
                Some(s) => s,
                None => self.free_slot(root).ok_or_else(|| {
                    ApiError::conflict(format!(
                        "no free pci slot on root bus {root}: all {} slots for devices are in use \
                     (lendvm --pci-slots)",
                        self.h.devices.pci_bus().slots()
                    ))
                })?,
            },
        };
        let requested = data.mode.unwrap_or_default();

        let t0 = Instant::now();
        let link = match ticket {
            Some(t) => self.source.accept(&spec, t),
            None => self.source.borrow(&spec),
        };
        let link = link.map_err(|e| {
            log::debug!("{spec}: {e}");
            attach_api_error(&e)
        })?;
        let t1 = Instant::now();
        // Chosen only now, so refused adds do not use up automatic ids (as in FakeVmm).
        let id = match data.id {
            Some(id) => id,
            None => self.auto_id(),
        };
        let key = self.next_key;
        self.next_key += 1;
        let lost_evt = EventFd::new(libc::EFD_NONBLOCK)
            .and_then(|e| Ok((e.try_clone()?, e)))
            .map_err(|e| ApiError::internal(format!("cannot create the lease eventfd: {e}")))?;
        let hook = Arc::new(DeviceHook::new(&id, lost_evt.0, self.h.events.clone()));
        link.set_event_hook(hook.clone());
        let link = VmmLink::new(link, requested, &self.counters);
        let mode = effective_mode(&link.device_info());
        if mode != requested {
            log::info!("{id}: {requested} requested, the fabric gives {mode}");
        }
        let mut params = RemotePciDeviceParams::new(
            id.clone(),
            self.h.devices.pci_bus().bdf_of(slot).requester_id(),
            Some(slot_intx_gsi(
                self.h.devices.pci_bus().layout().intx_slot(slot),
            )),
        );
        params.dma_pins = Some(self.dma.clone());
        params.p2p = Some(self.p2p.clone());
        params.observer = Some(hook);
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
                let msg = format!("cannot plug device {id} into slot {slot}: {e}");
                match e {
                    // The VM's own window is full: the request cannot be met in this VM, as
                    // with a slot in use (409), not a fault of the VMM (500).
                    crate::device_manager::DeviceError::Mmio64Full { .. } => {
                        ApiError::conflict(msg)
                    }
                    _ => ApiError::internal(msg),
                }
            })?;
        let t2b = Instant::now();
        let plugged = {
            let mut hp = lock(&self.h.hotplug);
            if restore_slot.is_some() {
                Ok(())
            } else if boot {
                hp.mark_present(u32::from(slot))
            } else {
                hp.slot_added(u32::from(slot))
            }
        };
        if let Err(e) = plugged {
            self.unplug(&id, slot, device, None, None);
            return Err(ApiError::internal(format!(
                "cannot announce device {id} in slot {slot}: {e}"
            )));
        }
        let t3 = Instant::now();
        let times = AddTimings {
            checks: t0 - start,
            borrow: t1 - t0,
            device: t2 - t1,
            bus: t2b - t2,
            ged: t3 - t2b,
        };
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        log::info!(
            "{} {id}: {spec} at {bdf} ({mode}) in {:.3} ms (checks {:.3} ms, borrow {:.3} ms, \
             device {:.3} ms, bus {:.3} ms, GED {:.3} ms)",
            if boot { "cold-plugged" } else { "hot-added" },
            ms(t3 - start),
            ms(times.checks),
            ms(times.borrow),
            ms(times.device),
            ms(times.bus),
            ms(times.ged),
        );
        self.emit(
            "device",
            "device-added",
            [
                ("id", Value::from(id.as_str())),
                ("bdf", Value::from(bdf.to_string())),
                ("device", Value::from(spec.to_string())),
                ("mode", Value::from(mode.to_string())),
                ("boot", Value::from(boot)),
            ],
        );
        self.subscriber_changes.push(SubscriberChange::Add {
            key,
            id: id.clone(),
            lost: lost_evt.1,
        });
        self.entries.insert(
            id.clone(),
            Entry {
                spec,
                slot,
                mode,
                state: ApiLeaseState::Active,
                device: Some(device),
                last: None,
                key,
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

    /// Takes the device off the bus and drops it here (never on a vCPU thread): at once if
    /// no vCPU is inside one of its accesses, else from the release timer once it left.
    fn unplug(
        &mut self,
        id: &str,
        slot: u8,
        device: Arc<Mutex<RemotePciDevice>>,
        returned: Option<LeaseReturned>,
        spec: Option<RemoteDeviceSpec>,
    ) {
        crate::vcpu::assert_not_on_vcpu("device teardown");
        if let Err(e) = self.h.devices.remove_pci_device(slot) {
            log::warn!("{id}: removing slot {slot} from the bus: {e}");
        }
        // A vCPU may still hold a clone for an access in flight (one MMIO access).
        let deadline = Instant::now() + RELEASE_SPIN;
        while Arc::strong_count(&device) > 1 && Instant::now() < deadline {
            std::thread::yield_now();
        }
        let d = Deferred {
            id: id.to_string(),
            slot,
            since: Instant::now(),
            warned: false,
            device,
            returned,
            spec,
        };
        if Arc::strong_count(&d.device) > 1 {
            log::info!("{id}: a vCPU still holds the device; its drop is deferred");
            self.deferred.push(d);
            self.arm_release_timer();
        } else {
            self.finish_drop(d);
        }
    }

    fn finish_drop(&self, d: Deferred) {
        let Deferred {
            id,
            slot,
            since,
            device,
            returned,
            ..
        } = d;
        let t = Instant::now();
        drop(device);
        // Its lender's session may have no device left now: its idle time starts.
        self.source.released();
        log::info!(
            "{id}: slot {slot} torn down in {:.3} ms{}",
            t.elapsed().as_secs_f64() * 1e3,
            if since.elapsed() > RELEASE_SPIN {
                format!(" (deferred {:.1} ms)", since.elapsed().as_secs_f64() * 1e3)
            } else {
                String::new()
            }
        );
        if let Some(r) = returned {
            self.emit(
                "lease",
                "lease-returned",
                [
                    ("id", Value::from(id.as_str())),
                    ("node", Value::from(r.node)),
                    ("device", Value::from(r.device)),
                ],
            );
        }
    }

    /// Drops a deferred device; its lender device may be released now.
    fn finish_deferred(&mut self, d: Deferred) {
        let id = d.id.clone();
        let spec = d.spec.clone();
        self.finish_drop(d);
        if let Some(spec) = spec {
            self.released_if_free(&id, &spec);
        }
    }

    /// `device-released` for `spec` (removed as `id`) once nothing of it is left here: no
    /// table entry (removing, lost) and no deferred drop. What a client waits for before it
    /// adds the device again.
    fn released_if_free(&self, id: &str, spec: &RemoteDeviceSpec) {
        if self.entries.values().any(|e| e.spec == *spec)
            || self.deferred.iter().any(|d| d.spec.as_ref() == Some(spec))
        {
            return;
        }
        log::info!("{id}: {spec} released");
        self.emit(
            "device",
            "device-released",
            [
                ("id", Value::from(id)),
                ("device", Value::from(spec.to_string())),
            ],
        );
    }

    /// Takes `id` out of the table (after its teardown and its `device-removed`);
    /// `device-released` follows unless a vCPU still holds the device.
    fn remove_entry(&mut self, id: &str) {
        if let Some(e) = self.entries.remove(id) {
            self.released_if_free(id, &e.spec);
        }
    }

    /// Why a re-add of `spec` must wait, and the id it was removed as: its entry awaits the
    /// guest's eject, or its drop awaits a vCPU. `None` when it is free, attached (active)
    /// or lost (those have their own answers).
    fn release_pending(&self, spec: &RemoteDeviceSpec) -> Option<(String, ReleaseWait)> {
        if let Some((id, _)) = self
            .entries
            .iter()
            .find(|(_, e)| e.spec == *spec && e.state == ApiLeaseState::Removing)
        {
            return Some((id.clone(), ReleaseWait::GuestEject));
        }
        if self.entries.values().any(|e| e.spec == *spec) {
            return None;
        }
        self.deferred
            .iter()
            .find(|d| d.spec.as_ref() == Some(spec))
            .map(|d| (d.id.clone(), ReleaseWait::VcpuAccess))
    }

    fn arm_release_timer(&mut self) {
        if let Some(t) = &mut self.release_timer {
            if let Err(e) = t.reset(RELEASE_RETRY, Some(RELEASE_RETRY)) {
                log::error!("release timer: {e}");
            }
        }
    }

    /// The release timer fired: drop the deferred devices no vCPU holds any more.
    pub fn on_release_timer(&mut self) {
        if let Some(t) = &mut self.release_timer {
            let _ = t.wait();
        }
        let (ready, held): (Vec<Deferred>, Vec<Deferred>) = std::mem::take(&mut self.deferred)
            .into_iter()
            .partition(|d| Arc::strong_count(&d.device) == 1);
        for mut d in held {
            if !d.warned && d.since.elapsed() > RELEASE_WARN {
                log::warn!(
                    "{}: a vCPU has held the torn-down device for {:?}",
                    d.id,
                    d.since.elapsed()
                );
                d.warned = true;
            }
            self.deferred.push(d);
        }
        for d in ready {
            self.finish_deferred(d);
        }
        if self.deferred.is_empty() {
            if let Some(t) = &mut self.release_timer {
                if let Err(e) = t.clear() {
                    log::warn!("release timer: {e}");
                }
            }
        }
    }

    /// Tears the device down; `returned`: the lease goes back to the lender (not after a loss).
    fn teardown(&mut self, id: &str, return_lease: bool) {
        let Some(e) = self.entries.get_mut(id) else {
            return;
        };
        if let Some(dev) = e.device.take() {
            e.last = Some(lock(&dev).status());
            let slot = e.slot;
            let returned = return_lease.then(|| LeaseReturned {
                node: e.spec.node.clone(),
                device: e.spec.bdf.to_string(),
            });
            let key = e.key;
            let spec = e.spec.clone();
            self.subscriber_changes
                .push(SubscriberChange::Remove { key });
            self.unplug(id, slot, dev, returned, Some(spec));
        }
    }

    /// Drops the table entry of `id` (torn down first if it is not yet, lease returned).
    fn forget(&mut self, id: &str) {
        self.teardown(id, true);
        self.remove_entry(id);
    }

    fn removed_event(&self, id: &str, slot: u8, how: &str) {
        self.emit(
            "device",
            "device-removed",
            [
                ("id", Value::from(id)),
                (
                    "bdf",
                    Value::from(self.h.devices.pci_bus().bdf_of(slot).to_string()),
                ),
                ("how", Value::from(how)),
            ],
        );
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
                let slot = e.slot;
                log::info!("{id}: lost device removed from the table");
                self.removed_event(&id, slot, "lost-cleared");
                self.remove_entry(&id);
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
            let slot = self.entries.get(&id).map_or(0, |e| e.slot);
            self.teardown(&id, true);
            log::info!("{id}: force-removed");
            self.removed_event(&id, slot, "forced");
            self.remove_entry(&id);
        } else {
            log::info!("{id}: removal requested; waiting for the guest to eject it");
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
                    self.teardown(&id, true);
                    self.removed_event(&id, slot as u8, "ejected");
                    self.remove_entry(&id);
                }
                None => log::debug!("guest ejected slot {slot}, already torn down"),
            }
        }
    }

    /// A device's lease eventfd fired (its link reported a loss): check every live
    /// device's lease; a lost one is torn down locally and the guest is asked to release it.
    pub fn check_leases(&mut self) {
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
            self.lose(&id, why);
        }
    }

    /// Device `id`'s lease is gone: torn down locally, the guest asked to release it.
    fn lose(&mut self, id: &str, why: String) {
        {
            let id = id.to_string();
            log::error!("{id}: lease lost ({why}); surprise removal, the vm keeps running");
            self.teardown(&id, false);
            let Some(e) = self.entries.get_mut(&id) else {
                return;
            };
            e.state = ApiLeaseState::Lost;
            let slot = e.slot;
            if let Err(err) = lock(&self.h.hotplug).slot_removal_requested(u32::from(slot)) {
                log::warn!("{id}: notifying the guest of the loss: {err}");
            }
            self.emit(
                "device",
                "device-lost",
                [
                    ("id", Value::from(id.as_str())),
                    (
                        "bdf",
                        Value::from(self.h.devices.pci_bus().bdf_of(slot).to_string()),
                    ),
                    ("cause", Value::from(why)),
                ],
            );
        }
    }

    /// Tears every device down (VM shutdown). The vCPUs are stopped, so nothing holds a
    /// device any more and every drop happens here.
    pub fn teardown_all(&mut self) {
        let ids: Vec<String> = self.entries.keys().cloned().collect();
        for id in ids {
            self.teardown(&id, true);
            self.remove_entry(&id);
        }
        for d in std::mem::take(&mut self.deferred) {
            self.finish_deferred(d);
        }
        if self.state != VmState::Created {
            self.state = VmState::Shutdown;
        }
    }

    /// Each device's lender-side counts: one LEASE_COUNTERS round trip per lent device (on
    /// the control thread). Gathered once per report, so that a metrics render, which needs
    /// them for both `vm.counters` and `vm.info`, costs each lender one request.
    fn lender_counts(&self) -> LenderCounts {
        self.entries
            .iter()
            .filter_map(|(id, e)| Some((id.clone(), lock(e.device.as_ref()?).lender_counters())))
            .collect()
    }

    fn device_info(&self, id: &str, e: &Entry, counts: &LenderCounts) -> RemoteDeviceInfo {
        let lender = match counts.get(id) {
            Some(Ok(c)) => c.clone(),
            Some(Err(err)) => {
                log::debug!("{id}: lender counters: {err}");
                None
            }
            None => None,
        };
        let access = e.device.as_ref().map(|d| {
            let c = lock(d).counters();
            DeviceAccessCounts {
                trapped_bar_reads: c.trapped_reads,
                trapped_bar_writes: c.trapped_writes,
                vmm_doorbell_kicks: c.kicks,
                ioeventfds: c.ioeventfds,
                lender_doorbell_kicks: lender.as_ref().map(|l| l.doorbell_kicks),
            }
        });
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
        // On shm the lender signals KVM's irqfds itself, so only it can count them.
        if let Some(l) = &lender {
            interrupts.msix = interrupts.msix.max(l.msix.iter().sum());
            interrupts.intx = interrupts.intx.max(l.intx);
        }
        RemoteDeviceInfo {
            id: id.to_string(),
            node: e.spec.node.clone(),
            lender_bdf: e.spec.bdf,
            guest_bdf: {
                let bdf = self.h.devices.pci_bus().bdf_of(e.slot);
                ApiBdf {
                    domain: 0,
                    bus: bdf.bus(),
                    device: bdf.device(),
                    function: 0,
                }
            },
            mode: e.mode,
            lease_state: e.state,
            dma_window,
            interrupts,
            access,
        }
    }

    /// Live-migration progress (shared: scrapes read it while the VMM thread migrates).
    pub fn migration_progress(&self) -> Arc<crate::metrics::MigrationProgress> {
        Arc::clone(&self.migration)
    }

    /// The VM's name on the fabric (the metrics' `vm` label).
    pub fn vm_name(&self) -> String {
        self.source
            .identity()
            .map_or_else(|| "vm".to_string(), |(_, vm)| vm)
    }

    /// `GET /api/v1/metrics`: what `vm.counters` and `vm.info` compute, as metrics text.
    pub fn metrics_text(&self, format: lending::metrics::Format) -> String {
        let counts = self.lender_counts();
        crate::metrics::families(
            &self.vm_name(),
            &self.counters_report_with(&counts),
            &self.counters(),
            &self.info_with(&counts),
            &self.migration,
        )
        .encode_as(format)
    }

    /// VMM-wide resource counters.
    pub fn counters(&self) -> VmCounters {
        let gsis = lock(self.h.interrupts.gsi_allocator()).in_use();
        let fabric = self.source.fabric_counts();
        VmCounters {
            devices: self.entries.len() as u64,
            leases: self.counters.leases.load(Ordering::SeqCst) as u64,
            memslots: self.h.vm_ops.memslots_in_use() as u64,
            gsis: gsis as u64,
            irqfds: self.h.interrupts.irqfds_registered() as u64,
            ioeventfds: self.h.vm_ops.ioevents_registered() as u64,
            pinned_bytes: self.counters.pinned_bytes.load(Ordering::SeqCst),
            p2p_mappings: self.p2p.live_mappings() as u64,
            lender_sessions: fabric.sessions,
            ram_exports: fabric.ram_exports,
        }
    }

    /// `vm.pause`: parks every vCPU, then quiesces the lent devices (MSI-X masked at the
    /// VMM, polling devices told to stop fetching).
    pub fn pause(&mut self) -> Result<(), ApiError> {
        if self.state != VmState::Running {
            return Err(ApiError::conflict(pause_refusal("pause", self.state)));
        }
        let t0 = Instant::now();
        if let Err(e) = self.h.vcpus.pause(PAUSE_TIMEOUT) {
            self.h.vcpus.resume();
            return Err(ApiError::internal(format!("cannot pause the vm: {e}")));
        }
        for (id, e) in &self.entries {
            if let Some(dev) = &e.device {
                if let Err(err) = lock(dev).quiesce(true) {
                    // The vectors are masked at the VMM whatever the lender said.
                    log::warn!("{id}: quiescing on the lender: {err}");
                }
            }
        }
        self.state = VmState::Paused;
        log::info!("vm paused in {:.3} ms", t0.elapsed().as_secs_f64() * 1e3);
        self.emit(
            "vm",
            "vm-paused",
            [("took_us", Value::from(t0.elapsed().as_micros() as u64))],
        );
        Ok(())
    }

    /// `vm.resume`: re-arms the devices (pending interrupts are delivered as their vectors
    /// unmask), then lets the vCPUs run.
    pub fn resume(&mut self) -> Result<(), ApiError> {
        if self.state != VmState::Paused {
            return Err(ApiError::conflict(pause_refusal("resume", self.state)));
        }
        for (id, e) in &self.entries {
            if let Some(dev) = &e.device {
                if let Err(err) = lock(dev).quiesce(false) {
                    log::warn!("{id}: resuming on the lender: {err}");
                }
            }
        }
        self.h.vcpus.resume();
        self.state = VmState::Running;
        log::info!("vm resumed");
        self.emit("vm", "vm-resumed", []);
        Ok(())
    }

    /// `vm.counters`: KVM's statistics (group `vm`) and, per device, what the VMM counted
    /// and what the lender reports (fetched now over the control protocol).
    pub fn counters_report(&self) -> VmCountersReport {
        self.counters_report_with(&self.lender_counts())
    }

    fn counters_report_with(&self, counts: &LenderCounts) -> VmCountersReport {
        let mut report = VmCountersReport::new();
        match self.h.vcpus.kvm_stats() {
            Ok(stats) if self.h.vcpus.has_stats() => {
                report.insert("vm".into(), stats);
            }
            Ok(_) => {}
            Err(e) => log::warn!("vm.counters: {e}"),
        }
        // Each vCPU's own figures beside their sum: `vm:vcpuN` (a ':' is never in a device
        // id, so these groups cannot collide with a device's).
        if self.h.vcpus.has_stats() {
            match self.h.vcpus.kvm_stats_per_vcpu() {
                Ok(each) => {
                    for (i, stats) in each.into_iter().enumerate() {
                        report.insert(format!("vm:vcpu{i}"), stats);
                    }
                }
                Err(e) => log::warn!("vm.counters (per vCPU): {e}"),
            }
        }
        for (id, e) in &self.entries {
            let mut c = BTreeMap::new();
            if let Some(d) = &e.device {
                let io = lock(d).counters();
                c.insert("trapped_bar_reads".into(), io.trapped_reads);
                c.insert("trapped_bar_writes".into(), io.trapped_writes);
                c.insert("vmm_doorbell_kicks".into(), io.kicks);
                c.insert("ioeventfds".into(), io.ioeventfds);
                c.insert("msix_refused".into(), io.msix_refused);
                c.insert("msi_refused".into(), io.msi_refused);
                c.insert("bar_moves_refused".into(), io.bar_moves_refused);
                c.insert("flrs".into(), io.flrs);
                c.insert("config_writes_refused".into(), io.config_writes_refused);
            }
            let status = e.device.as_ref().map(|d| lock(d).status());
            if let Some(st) = status.as_ref().or(e.last.as_ref()) {
                c.insert("bme_transitions".into(), st.bme_transitions);
                c.insert("pinned_ms".into(), st.pinned_time.as_millis() as u64);
                c.insert("pinned_bytes".into(), st.pinned_bytes);
                c.insert("dma_maps".into(), st.dma_maps);
                c.insert("dma_map_failures".into(), st.dma_map_failures);
                c.insert("resets".into(), st.resets);
                if let Some(v) = &st.irq_counts {
                    for (i, n) in v.iter().enumerate() {
                        c.insert(format!("relayed_interrupts_vector_{i}"), *n);
                    }
                }
            }
            match counts.get(id) {
                Some(Ok(Some(l))) => {
                    c.insert("dma_bytes_read".into(), l.dma_bytes_read);
                    c.insert("dma_bytes_written".into(), l.dma_bytes_written);
                    c.insert("iommu_faults".into(), l.iommu_faults);
                    c.insert("doorbell_kicks".into(), l.doorbell_kicks);
                    c.insert("interrupts_intx".into(), l.intx);
                    // Lenders of protocol version 7 count these for the device model
                    // (emulated NVMe); older ones report 0.
                    c.insert("commands".into(), l.commands);
                    c.insert("invalid_doorbells".into(), l.invalid_doorbells);
                    c.insert("bad_prps".into(), l.bad_prps);
                    for (i, n) in l.msix.iter().enumerate() {
                        c.insert(format!("interrupts_vector_{i}"), *n);
                    }
                    c.insert(
                        "interrupts".into(),
                        l.msix.iter().sum::<u64>().saturating_add(l.intx),
                    );
                }
                Some(Ok(None)) | None => {}
                Some(Err(err)) => log::warn!("{id}: lender counters: {err}"),
            }
            report.insert(id.clone(), c);
        }
        report
    }

    /// The headline KVM exit counts, if KVM gives statistics.
    fn kvm_exits(&self) -> Option<KvmExitCounts> {
        if !self.h.vcpus.has_stats() {
            return None;
        }
        match self.h.vcpus.kvm_stats() {
            Ok(s) => {
                let g = |k: &str| s.get(k).copied().unwrap_or(0);
                Some(KvmExitCounts {
                    exits: g("exits"),
                    mmio_exits: g("mmio_exits"),
                    io_exits: g("io_exits"),
                    halt_exits: g("halt_exits"),
                })
            }
            Err(e) => {
                log::warn!("kvm statistics: {e}");
                None
            }
        }
    }

    /// `vm.info`.
    pub fn info(&self) -> VmInfo {
        self.info_with(&self.lender_counts())
    }

    fn info_with(&self, counts: &LenderCounts) -> VmInfo {
        VmInfo {
            config: self.config.clone(),
            state: self.state,
            remote_devices: self
                .entries
                .iter()
                .map(|(id, e)| self.device_info(id, e, counts))
                .collect(),
            counters: Some(self.counters()),
            kvm: self.kvm_exits(),
        }
    }
}

impl ApiHandler for Controller {
    fn handle(&mut self, request: ApiRequest) -> ApiReply {
        let what = request.endpoint();
        match request {
            ApiRequest::VmmPing => Ok(ApiResponse::Pong(VmmPingResponse {
                version: env!("CARGO_PKG_VERSION").to_string(),
                pid: i64::from(std::process::id()),
                features: vec![
                    "remote_pci".into(),
                    "hotplug".into(),
                    "counters".into(),
                    "snapshot".into(),
                    "migration".into(),
                ],
            })),
            ApiRequest::VmInfo => Ok(ApiResponse::VmInfo(Box::new(self.info()))),
            ApiRequest::VmAddRemoteDevice(data) => {
                self.attach(data, false).map(ApiResponse::DeviceAdded)
            }
            ApiRequest::VmRemoveDevice(data) => self.remove(data).map(|()| ApiResponse::Empty),
            ApiRequest::VmShutdown | ApiRequest::VmmShutdown => {
                if !matches!(self.state, VmState::Running | VmState::Paused) {
                    return Err(ApiError::conflict("the vm is already shut down"));
                }
                self.state = VmState::ShuttingDown;
                log::info!("{what} requested through the api: shutting down");
                self.h.exit.request(VmExit::Shutdown(format!(
                    "{what} requested through the api"
                )));
                Ok(ApiResponse::Empty)
            }
            ApiRequest::VmPause => self.pause().map(|()| ApiResponse::Empty),
            ApiRequest::VmResume => self.resume().map(|()| ApiResponse::Empty),
            ApiRequest::VmSnapshot(data) => self.snapshot(&data).map(|()| ApiResponse::Empty),
            ApiRequest::VmSendMigration(data) => {
                self.send_migration(&data).map(|()| ApiResponse::Empty)
            }
            ApiRequest::VmReceiveMigration(_) => Err(ApiError::conflict(
                "cannot receive a migration: this vmm already runs a vm (start lendvm with \
                 only --api-socket to receive one)",
            )),
            ApiRequest::VmCounters => Ok(ApiResponse::Counters(self.counters_report())),
            ApiRequest::VmMetrics(f) => Ok(ApiResponse::Metrics(self.metrics_text(f))),
        }
    }
}

/// The add request that borrows a snapshot's (or a migration's) lent device `d` again under
/// its own id and BAR access mode.
pub(crate) fn lent_device_request(
    d: &crate::snapshot::devices::LentDevice,
) -> Result<VmAddRemoteDeviceData, ApiError> {
    let spec: RemoteDeviceSpec = d
        .device
        .parse()
        .map_err(|e| ApiError::bad_request(format!("{}: lent device '{}': {e}", d.id, d.device)))?;
    Ok(VmAddRemoteDeviceData {
        device: spec,
        id: Some(d.id.clone()),
        mode: Some(d.mode),
        replace_lost: false,
        numa_node: None,
    })
}

impl crate::migration::orchestrate::MigrationHost for Controller {
    fn vm_state(&self) -> VmState {
        self.state
    }

    fn event_bus(&self) -> &EventBus {
        &self.h.events
    }

    fn leased_devices(&self) -> Vec<(String, Arc<Mutex<RemotePciDevice>>)> {
        self.entries
            .iter()
            .filter_map(|(id, e)| Some((id.clone(), e.device.clone()?)))
            .collect()
    }

    fn snapshot_source(&self) -> Option<SnapshotSource> {
        self.snapshot.clone()
    }

    fn stream_auth(&self) -> crate::migration::auth::StreamAuth {
        self.migration_auth.clone()
    }

    fn save_lent_devices(
        &self,
    ) -> Result<Vec<crate::snapshot::devices::LentDevice>, crate::snapshot::SnapshotError> {
        Controller::save_lent_devices(self)
    }

    fn pause_vcpus(&mut self) -> Result<(), ApiError> {
        if let Err(e) = self.h.vcpus.pause(PAUSE_TIMEOUT) {
            self.h.vcpus.resume();
            return Err(ApiError::internal(format!("cannot pause the vm: {e}")));
        }
        self.state = VmState::Paused;
        Ok(())
    }

    fn resume(&mut self) -> Result<(), ApiError> {
        Controller::resume(self)
    }

    fn lose(&mut self, id: &str, why: String) {
        Controller::lose(self, id, why);
    }

    fn migrated_away(&mut self, to: &crate::migration::MigrationUrl) {
        self.state = VmState::ShuttingDown;
        self.h
            .exit
            .request(VmExit::Shutdown(format!("vm migrated to {to}")));
    }

    fn take_over(
        &mut self,
        data: VmAddRemoteDeviceData,
        slot: u8,
        ticket: &remote_pci::LeaseTicket,
    ) -> Result<Arc<Mutex<RemotePciDevice>>, ApiError> {
        let id = data.id.clone().unwrap_or_default();
        self.attach_taking(data, true, Some(slot), Some(ticket))?;
        self.entries
            .get(&id)
            .and_then(|e| e.device.clone())
            .ok_or_else(|| ApiError::internal(format!("{id}: not attached")))
    }

    fn replay_lent(&self, d: &crate::snapshot::devices::LentDevice) -> Result<(), ApiError> {
        self.replay_lent_state(d)
    }

    fn progress(&self) -> &crate::metrics::MigrationProgress {
        &self.migration
    }

    fn lender_request_timeout(&self) -> std::time::Duration {
        self.source.request_timeout()
    }
}

#[cfg(test)]
#[path = "control_tests.rs"]
mod tests;
