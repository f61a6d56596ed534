//! A fake VMM for tests: an in-memory device table behind the real channel + eventfd plumbing.
//!
//! [`FakeVmm`] implements [`ApiHandler`] with the semantics the real VMM must have (the codes
//! are those in [`crate::server`]'s table):
//!
//! | case | answer |
//! |---|---|
//! | add: VM shut down | 409 `cannot add a device: the vm is Shutdown` |
//! | add: unknown node | 400 `unknown node node9 (known: node1, node3)` |
//! | add: node's lender unreachable ([`FakeVmmConfig::unreachable`]) | 502 `lender node5 is unreachable at fake:node5: connection refused` |
//! | add: node has no such device | 400 `node node3 has no device 0000:99:00.0 to lend` |
//! | add: id already in use | 409 `device id nvme1 is already in use` |
//! | add: same lender device attached twice | 409 `node3:0000:81:00.0 is already attached as nvme1` |
//! | add: the device was removed and the guest has not ejected it yet | 409 `node3:0000:81:00.0 (removed as nvme1) is still being released: the guest has not ejected it yet ...` |
//! | add: no free slot | 409 `no free pci slot on bus 0` |
//! | remove: unknown id, or already removed | 404 `no device with id nvme1` |
//! | remove: removal pending, no force | 409 `removal of nvme1 is already pending ...` |
//! | shutdown twice | 409 `the vm is already shut down` |
//!
//! With `auto_eject` (the default) the "guest" ejects at once, so remove completes immediately
//! and a second remove is a 404. Without it the device stays `removing` until
//! [`FakeVmm::guest_eject`] or a `force` remove.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use vmm_sys_util::eventfd::EventFd;

use crate::request::{
    already_attached, id_in_use, pause_refusal, still_being_released, ReleaseWait,
};
use crate::request::{
    serve_pending, ApiError, ApiHandler, ApiMessage, ApiReply, ApiRequest, ApiResponse,
};
use crate::types::VmCountersReport;
use crate::types::{
    DmaWindowInfo, InterruptCounts, LeaseState, PciBdf, PciDeviceInfo, RemoteDeviceInfo,
    RemoteDeviceMode, RemoteDeviceSpec, VmAddRemoteDeviceData, VmConfigInfo, VmInfo,
    VmRemoveDeviceData, VmState, VmmPingResponse,
};

/// How the fake VMM thread treats incoming messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FakeBehaviour {
    /// Answer every request.
    #[default]
    Serve,
    /// Take requests off the channel and never answer them (a stuck VMM).
    Stall,
    /// Drop requests unanswered (a VMM that loses them).
    Drop,
}

/// Settings for [`FakeVmm`].
#[derive(Debug, Clone)]
pub struct FakeVmmConfig {
    /// Lendable devices per node.
    pub lenders: BTreeMap<String, Vec<PciBdf>>,
    /// Nodes in the cluster whose lender does not answer: adding any device of theirs is a
    /// 502 (the real VMM's answer when the connection to the lender fails).
    pub unreachable: BTreeSet<String>,
    /// The guest ejects removed devices immediately.
    pub auto_eject: bool,
    pub behaviour: FakeBehaviour,
    pub vm: VmConfigInfo,
}

impl Default for FakeVmmConfig {
    /// Nodes `node1` (`0000:01:00.0`) and `node3` (`0000:81:00.0`, `0000:82:00.0`), a 2-vCPU
    /// 512 MiB VM.
    fn default() -> Self {
        let bdf = |bus| PciBdf {
            domain: 0,
            bus,
            device: 0,
            function: 0,
        };
        let mut lenders = BTreeMap::new();
        lenders.insert("node1".to_string(), vec![bdf(0x01)]);
        lenders.insert("node3".to_string(), vec![bdf(0x81), bdf(0x82)]);
        FakeVmmConfig {
            lenders,
            unreachable: BTreeSet::new(),
            auto_eject: true,
            behaviour: FakeBehaviour::Serve,
            vm: VmConfigInfo {
                cpus: 2,
                memory_size: 512 << 20,
                kernel: "/boot/guest.elf".into(),
                cmdline: "console=ttyS0".into(),
                initramfs: None,
                remote_devices: Vec::new(),
                pci_slots: Some(8),
                numa_nodes: vec![
                    crate::types::NumaNodeInfo {
                        id: 0,
                        cpus: vec![0],
                        memory_size: 256 << 20,
                        distances: vec![10, 21],
                    },
                    crate::types::NumaNodeInfo {
                        id: 1,
                        cpus: vec![1],
                        memory_size: 256 << 20,
                        distances: vec![21, 10],
                    },
                ],
                switches: vec![crate::types::SwitchInfo {
                    lender: "node3".into(),
                    bridge: "0000:00:01.0".into(),
                    bus: 1,
                    ports: 4,
                }],
            },
        }
    }
}

/// The fake VMM's state.
#[derive(Debug)]
pub struct FakeVmm {
    config: FakeVmmConfig,
    state: VmState,
    devices: BTreeMap<String, RemoteDeviceInfo>,
    next_auto_id: u32,
}

impl FakeVmm {
    /// A running VM with `config.vm.remote_devices` attached as at launch.
    pub fn new(config: FakeVmmConfig) -> Result<Self, ApiError> {
        let boot = config.vm.remote_devices.clone();
        let mut vmm = FakeVmm {
            config,
            state: VmState::Running,
            devices: BTreeMap::new(),
            next_auto_id: 0,
        };
        for dev in boot {
            vmm.add(VmAddRemoteDeviceData {
                device: dev.device,
                id: dev.id,
                mode: dev.mode,
                replace_lost: false,
                numa_node: None,
            })?;
        }
        Ok(vmm)
    }

    pub fn state(&self) -> VmState {
        self.state
    }

    pub fn device(&self, id: &str) -> Option<&RemoteDeviceInfo> {
        self.devices.get(id)
    }

    /// The guest ejects a device whose removal is pending. Returns whether it was pending.
    pub fn guest_eject(&mut self, id: &str) -> bool {
        let pending = self
            .devices
            .get(id)
            .is_some_and(|d| d.lease_state == LeaseState::Removing);
        if pending {
            self.devices.remove(id);
        }
        pending
    }

    /// The device's lease is lost (its lender went away): what the VMM does on surprise
    /// removal. Returns whether the device exists.
    pub fn lose(&mut self, id: &str) -> bool {
        match self.devices.get_mut(id) {
            Some(d) => {
                d.lease_state = LeaseState::Lost;
                d.dma_window = DmaWindowInfo {
                    mapped: false,
                    size: 0,
                };
                true
            }
            None => false,
        }
    }

    /// Sets a device's interrupt counters (to test what clients show).
    pub fn set_interrupts(&mut self, id: &str, counts: InterruptCounts) -> bool {
        match self.devices.get_mut(id) {
            Some(d) => {
                d.interrupts = counts;
                true
            }
            None => false,
        }
    }

    /// A free device number on root bus `bus`.
    fn free_slot(&self, bus: u8) -> Option<u8> {
        let used: BTreeSet<u8> = self
            .devices
            .values()
            .filter(|d| d.guest_bdf.bus == bus)
            .map(|d| d.guest_bdf.device)
            .collect();
        // Slot 0 is the host bridge.
        (1..=0x1f).find(|s| !used.contains(s))
    }

    fn auto_id(&mut self) -> String {
        loop {
            let id = format!("_remote{}", self.next_auto_id);
            self.next_auto_id = self.next_auto_id.wrapping_add(1);
            if !self.devices.contains_key(&id) {
                return id;
            }
        }
    }

    fn add(&mut self, data: VmAddRemoteDeviceData) -> Result<PciDeviceInfo, ApiError> {
        if self.state != VmState::Running {
            return Err(ApiError::conflict(format!(
                "cannot add a device: the vm is {}",
                self.state
            )));
        }
        let RemoteDeviceSpec { node, bdf } = &data.device;
        // An unreachable lender cannot say what it lends: like the real VMM, the add gets as
        // far as the borrow (after the local checks) and fails there.
        let unreachable = self.config.unreachable.contains(node);
        if !unreachable {
            let inventory = self.config.lenders.get(node).ok_or_else(|| {
                let known: BTreeSet<&str> = self
                    .config
                    .lenders
                    .keys()
                    .chain(&self.config.unreachable)
                    .map(String::as_str)
                    .collect();
                let known: Vec<&str> = known.into_iter().collect();
                ApiError::bad_request(format!("unknown node {node} (known: {})", known.join(", ")))
            })?;
            if !inventory.contains(bdf) {
                return Err(ApiError::bad_request(format!(
                    "node {node} has no device {bdf} to lend"
                )));
            }
        }
        if data.replace_lost {
            self.devices.retain(|id, d| {
                let same =
                    data.id.as_ref() == Some(id) || (d.node == *node && d.lender_bdf == *bdf);
                !(same && d.lease_state == LeaseState::Lost)
            });
        }
        // As the VMM: a device whose removal waits for the guest is still being released.
        if let Some(other) = self.devices.values().find(|d| {
            d.node == *node && d.lender_bdf == *bdf && d.lease_state == LeaseState::Removing
        }) {
            return Err(ApiError::conflict(still_being_released(
                &data.device,
                &other.id,
                ReleaseWait::GuestEject,
            )));
        }
        if let Some(id) = &data.id {
            if let Some(d) = self.devices.get(id) {
                return Err(ApiError::conflict(id_in_use(
                    id,
                    d.lease_state == LeaseState::Lost,
                )));
            }
        }
        if let Some(other) = self
            .devices
            .values()
            .find(|d| d.node == *node && d.lender_bdf == *bdf)
        {
            return Err(ApiError::conflict(already_attached(
                &data.device,
                &other.id,
                other.lease_state == LeaseState::Lost,
            )));
        }
        // As the VMM: NUMA node n's devices sit on root bus n; a node the VM lacks is refused
        // by name.
        let nodes = self.config.vm.numa_nodes.len();
        let bus = match data.numa_node {
            None => 0,
            Some(n) if nodes == 0 => {
                return Err(ApiError::bad_request(format!(
                    "numa_node={n}: this VM has no NUMA nodes (lendvm --numa)"
                )))
            }
            Some(n) if n as usize >= nodes => {
                return Err(ApiError::bad_request(format!(
                    "numa_node={n}: this VM has NUMA nodes 0 to {} (lendvm --numa)",
                    nodes - 1
                )))
            }
            Some(n) => n as u8,
        };
        let slot = self
            .free_slot(bus)
            .ok_or_else(|| ApiError::conflict(format!("no free pci slot on root bus {bus}")))?;
        if unreachable {
            return Err(ApiError::bad_gateway(format!(
                "lender {node} is unreachable at fake:{node}: connection refused"
            )));
        }
        let id = match data.id {
            Some(id) => id,
            None => self.auto_id(),
        };
        let guest_bdf = PciBdf {
            domain: 0,
            bus,
            device: slot,
            function: 0,
        };
        self.devices.insert(
            id.clone(),
            RemoteDeviceInfo {
                id: id.clone(),
                node: node.clone(),
                lender_bdf: *bdf,
                guest_bdf,
                mode: data.mode.unwrap_or(RemoteDeviceMode::Direct),
                lease_state: LeaseState::Active,
                dma_window: DmaWindowInfo {
                    mapped: true,
                    size: self.config.vm.memory_size,
                },
                interrupts: InterruptCounts::default(),
                access: None,
            },
        );
        Ok(PciDeviceInfo { id, bdf: guest_bdf })
    }

    fn remove(&mut self, data: VmRemoveDeviceData) -> Result<(), ApiError> {
        if self.state != VmState::Running {
            return Err(ApiError::conflict(format!(
                "cannot remove a device: the vm is {}",
                self.state
            )));
        }
        let dev = self
            .devices
            .get_mut(&data.id)
            .ok_or_else(|| ApiError::not_found(format!("no device with id {}", data.id)))?;
        if data.force || self.config.auto_eject || dev.lease_state == LeaseState::Lost {
            self.devices.remove(&data.id);
            return Ok(());
        }
        if dev.lease_state == LeaseState::Removing {
            return Err(ApiError::conflict(format!(
                "removal of {} is already pending (waiting for the guest to eject it); \
                 use force to remove it now",
                data.id
            )));
        }
        dev.lease_state = LeaseState::Removing;
        Ok(())
    }
}

impl ApiHandler for FakeVmm {
    fn handle(&mut self, request: ApiRequest) -> ApiReply {
        match request {
            ApiRequest::VmmPing => Ok(ApiResponse::Pong(VmmPingResponse {
                version: env!("CARGO_PKG_VERSION").to_string(),
                pid: i64::from(std::process::id()),
                features: vec!["remote_pci".into()],
            })),
            ApiRequest::VmInfo => Ok(ApiResponse::VmInfo(Box::new(VmInfo {
                config: self.config.vm.clone(),
                state: self.state,
                remote_devices: self.devices.values().cloned().collect(),
                counters: None,
                kvm: None,
            }))),
            ApiRequest::VmAddRemoteDevice(data) => self.add(data).map(ApiResponse::DeviceAdded),
            ApiRequest::VmRemoveDevice(data) => self.remove(data).map(|()| ApiResponse::Empty),
            ApiRequest::VmShutdown | ApiRequest::VmmShutdown => {
                if !matches!(self.state, VmState::Running | VmState::Paused) {
                    return Err(ApiError::conflict("the vm is already shut down"));
                }
                // Shutting down releases every lease.
                self.devices.clear();
                self.state = VmState::Shutdown;
                Ok(ApiResponse::Empty)
            }
            ApiRequest::VmPause => match self.state {
                VmState::Running => {
                    self.state = VmState::Paused;
                    Ok(ApiResponse::Empty)
                }
                other => Err(ApiError::conflict(pause_refusal("pause", other))),
            },
            ApiRequest::VmSendMigration(_) => match self.state {
                VmState::Running | VmState::Paused => Ok(ApiResponse::Empty),
                other => Err(ApiError::conflict(format!(
                    "cannot migrate the vm: it is {other:?}"
                ))),
            },
            ApiRequest::VmReceiveMigration(_) => Err(ApiError::conflict(
                "cannot receive a migration: this vmm already runs a vm",
            )),
            ApiRequest::VmSnapshot(_) => match self.state {
                VmState::Running | VmState::Paused => Ok(ApiResponse::Empty),
                other => Err(ApiError::conflict(format!(
                    "cannot snapshot the vm: it is {other:?}"
                ))),
            },
            ApiRequest::VmResume => match self.state {
                VmState::Paused => {
                    self.state = VmState::Running;
                    Ok(ApiResponse::Empty)
                }
                other => Err(ApiError::conflict(pause_refusal("resume", other))),
            },
            ApiRequest::VmCounters => {
                let mut report = VmCountersReport::new();
                for (id, d) in &self.devices {
                    let mut c = BTreeMap::new();
                    c.insert("interrupts".to_string(), d.interrupts.total());
                    report.insert(id.clone(), c);
                }
                Ok(ApiResponse::Counters(report))
            }
            ApiRequest::VmMetrics(format) => {
                let mut f = lending::metrics::Families::new();
                for (id, d) in &self.devices {
                    f.counter(
                        "lendvm_device_interrupts",
                        "Interrupts delivered.",
                        lending::metrics::labels([("device", id)]),
                        d.interrupts.total(),
                    );
                }
                Ok(ApiResponse::Metrics(f.encode_as(format)))
            }
        }
    }
}

fn lock(vmm: &Mutex<FakeVmm>) -> MutexGuard<'_, FakeVmm> {
    match vmm.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// A [`FakeVmm`] served on its own thread that waits on the eventfd with `poll(2)`, exactly as
/// the real VMM's epoll loop would. Stopped (and joined) on drop.
pub struct FakeVmmThread {
    tx: Sender<ApiMessage>,
    evt: EventFd,
    vmm: Arc<Mutex<FakeVmm>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl FakeVmmThread {
    pub fn spawn(config: FakeVmmConfig) -> io::Result<Self> {
        let behaviour = config.behaviour;
        let vmm = FakeVmm::new(config).map_err(|e| io::Error::other(e.message))?;
        let vmm = Arc::new(Mutex::new(vmm));
        let evt = EventFd::new(libc::EFD_NONBLOCK)?;
        let (tx, rx) = channel::<ApiMessage>();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let evt = evt.try_clone()?;
            let vmm = vmm.clone();
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("fake-vmm".into())
                .spawn(move || run(rx, evt, vmm, stop, behaviour))?
        };
        Ok(FakeVmmThread {
            tx,
            evt,
            vmm,
            stop,
            thread: Some(thread),
        })
    }

    /// The request channel to hand to [`crate::server::ApiServer::start`].
    pub fn api_sender(&self) -> Sender<ApiMessage> {
        self.tx.clone()
    }

    /// The eventfd to hand to [`crate::server::ApiServer::start`].
    pub fn api_event(&self) -> io::Result<EventFd> {
        self.evt.try_clone()
    }

    /// Runs `f` on the VMM state (between requests).
    pub fn with_vmm<R>(&self, f: impl FnOnce(&mut FakeVmm) -> R) -> R {
        f(&mut lock(&self.vmm))
    }
}

impl Drop for FakeVmmThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.evt.write(1);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                log::error!("fake vmm thread panicked");
            }
        }
    }
}

fn run(
    rx: Receiver<ApiMessage>,
    evt: EventFd,
    vmm: Arc<Mutex<FakeVmm>>,
    stop: Arc<AtomicBool>,
    behaviour: FakeBehaviour,
) {
    let mut held = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        let mut pfd = libc::pollfd {
            fd: evt.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is one valid, initialised pollfd that outlives the call; the fd belongs
        // to `evt`, which is alive for the whole loop.
        let n = unsafe { libc::poll(&mut pfd, 1, 100) };
        if n <= 0 {
            continue;
        }
        match behaviour {
            FakeBehaviour::Serve => {
                serve_pending(&rx, &evt, &mut *lock(&vmm));
            }
            FakeBehaviour::Stall | FakeBehaviour::Drop => {
                let _ = evt.read();
                while let Ok(msg) = rx.try_recv() {
                    if behaviour == FakeBehaviour::Stall {
                        held.push(msg);
                    }
                }
            }
        }
    }
}
