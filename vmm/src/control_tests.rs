//! The API handler against a real KVM VM (no vCPUs started) and fake lender links.
//! /dev/kvm is required: without it the tests fail.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};

use acpi::{EjectReceiver, PCI_HOTPLUG_START};
use remote_pci::LinkEventHook;

use api::request::ApiErrorKind;
use pci::vm_ops::GuestRamRegion;
use remote_pci::{
    BarAccess, BarKind, DmaMapping, IrqTargets, LinkError, RemoteBar, RemoteDeviceInfo,
};

use super::*;
use crate::config::{SerialConfig, VmConfig};
use crate::vm::Vm;

/// A minimal device: 1234:5678, one trapped 4 KiB BAR, no capabilities, no interrupt pin.
struct FakeLink {
    state: Arc<Mutex<LeaseState>>,
    live: Arc<AtomicUsize>,
    /// `Some(live mappings)` if the device can DMA (bus 0x82 in the spec).
    dma: Option<Arc<AtomicUsize>>,
    hook: Arc<Mutex<Option<Arc<dyn LinkEventHook>>>>,
    /// A lender of protocol version 4 whose dirty log is exact or not (VFIO): bus 0x97 in
    /// the spec is a VFIO device (not exact); otherwise no migration side.
    migration: Option<Arc<FakeMigration>>,
}

/// The migration side of a fake lease: records what the VMM asks of it, in order.
struct FakeMigration {
    exact: bool,
    logging: std::sync::atomic::AtomicBool,
    /// Calls so far: `start`, `fetch`, `stop`, `quiesce`, `resume`, `ticket`, `cancel`,
    /// `moved`.
    calls: Mutex<Vec<&'static str>>,
    /// What the hand-over quiesce reports.
    drained: std::sync::atomic::AtomicBool,
    /// The lease's DMA window (first IOVA, pages): what a whole-window fetch reports.
    window: Mutex<Option<(u64, u64)>>,
    /// Runs inside the hand-over quiesce: the device's last DMA before it drained.
    on_quiesce: Mutex<Option<Box<dyn Fn() + Send>>>,
}

impl FakeMigration {
    fn new(exact: bool) -> Self {
        Self {
            exact,
            logging: Default::default(),
            calls: Mutex::new(Vec::new()),
            drained: std::sync::atomic::AtomicBool::new(true),
            window: Mutex::new(None),
            on_quiesce: Mutex::new(None),
        }
    }

    fn call(&self, what: &'static str) {
        lock(&self.calls).push(what);
    }

    fn calls(&self) -> Vec<&'static str> {
        lock(&self.calls).clone()
    }
}

impl remote_pci::LeaseMigration for FakeMigration {
    fn lease_id(&self) -> u64 {
        1
    }
    fn start_dirty_log(&self) -> Result<bool, LinkError> {
        self.call("start");
        self.logging.store(true, Ordering::SeqCst);
        Ok(self.exact)
    }
    fn fetch_dirty_log(&self) -> Result<remote_pci::DeviceDirtyPages, LinkError> {
        self.call("fetch");
        if self.exact {
            return Ok(remote_pci::DeviceDirtyPages::default());
        }
        // As the lender's fallback: every page of the window, every time.
        let (iova, pages) = lock(&self.window).unwrap_or_default();
        let mut bits = vec![0u64; pages.div_ceil(64) as usize];
        for i in 0..pages {
            bits[(i / 64) as usize] |= 1 << (i % 64);
        }
        Ok(remote_pci::DeviceDirtyPages {
            iova,
            pages,
            bits,
            whole_window: true,
        })
    }
    fn stop_dirty_log(&self) -> Result<(), LinkError> {
        self.call("stop");
        self.logging.store(false, Ordering::SeqCst);
        Ok(())
    }
    fn quiesce_for_handover(&self, _: u32) -> Result<remote_pci::HandoverState, LinkError> {
        self.call("quiesce");
        if let Some(f) = lock(&self.on_quiesce).as_ref() {
            f();
        }
        Ok(remote_pci::HandoverState {
            drained: self.drained.load(Ordering::SeqCst),
            ..Default::default()
        })
    }
    fn resume_after_handover(&self) -> Result<(), LinkError> {
        self.call("resume");
        Ok(())
    }
    fn create_transfer(&self, _: &str, _: &str) -> Result<remote_pci::LeaseTicket, LinkError> {
        self.call("ticket");
        Ok(remote_pci::LeaseTicket {
            lease: 1,
            ticket: vec![7; 16],
            expires_in_ms: 10_000,
            claim: None,
        })
    }
    fn cancel_transfer(&self) -> Result<(), LinkError> {
        self.call("cancel");
        Ok(())
    }
    fn mark_moved(&self) {
        self.call("moved");
    }
}

impl Drop for FakeLink {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

impl RemoteDeviceLink for FakeLink {
    fn device_info(&self) -> RemoteDeviceInfo {
        let mut config = vec![0u8; 256];
        config[0..4].copy_from_slice(&0x5678_1234u32.to_le_bytes());
        config[0x0b] = 0x08; // class: system peripheral
        RemoteDeviceInfo {
            id: "fake".into(),
            config,
            bars: vec![RemoteBar {
                index: 0,
                size: 0x1000,
                kind: BarKind::Mem32,
                prefetchable: false,
                access: BarAccess::Trapped,
                ioevents: Vec::new(),
            }],
            msix: None,
        }
    }
    fn config_read(&self, _: u16, data: &mut [u8]) -> Result<(), LinkError> {
        data.fill(0);
        Ok(())
    }
    fn config_write(&self, _: u16, _: &[u8]) -> Result<(), LinkError> {
        Ok(())
    }
    fn bar_read(&self, _: u8, _: u64, data: &mut [u8]) -> Result<(), LinkError> {
        data.fill(0x5a);
        Ok(())
    }
    fn bar_write(&self, _: u8, _: u64, _: &[u8]) -> Result<(), LinkError> {
        Ok(())
    }
    fn map_dma(&self, r: &[GuestRamRegion]) -> Result<Box<dyn DmaMapping>, LinkError> {
        let Some(live) = &self.dma else {
            return Err(LinkError::Down("fake".into()));
        };
        live.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(FakeMapping {
            size: r.iter().map(|r| r.size).sum(),
            live: live.clone(),
        }))
    }
    fn set_irqs(&self, _: &IrqTargets<'_>) -> Result<(), LinkError> {
        Ok(())
    }
    fn reset(&self) -> Result<(), LinkError> {
        Ok(())
    }
    fn lease_state(&self) -> LeaseState {
        lock(&self.state).clone()
    }
    fn set_event_hook(&self, hook: Arc<dyn LinkEventHook>) {
        *lock(&self.hook) = Some(hook);
    }
    fn migration(&self) -> Option<Arc<dyn remote_pci::LeaseMigration>> {
        self.migration
            .clone()
            .map(|m| m as Arc<dyn remote_pci::LeaseMigration>)
    }
}

/// A lender's IOMMU mapping of guest RAM; counted while alive.
struct FakeMapping {
    size: u64,
    live: Arc<AtomicUsize>,
}

impl DmaMapping for FakeMapping {
    fn size(&self) -> u64 {
        self.size
    }
}

impl Drop for FakeMapping {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Clone, Default)]
struct FakeSource {
    live: Arc<AtomicUsize>,
    /// Live DMA mappings of all links.
    dma_maps: Arc<AtomicUsize>,
    /// State of the most recently borrowed link.
    last: Arc<Mutex<Option<Arc<Mutex<LeaseState>>>>>,
    /// Event hook of the most recently borrowed link.
    last_hook: Arc<Mutex<Option<Arc<dyn LinkEventHook>>>>,
    /// Migration side of the most recently borrowed VFIO-like link (bus 0x97).
    last_migration: Arc<Mutex<Option<Arc<FakeMigration>>>>,
}

impl FakeSource {
    /// The last borrowed link's lender dies: its state turns lost and its hook is told, as
    /// `LendingLink`'s event thread does.
    fn lose_last(&self, why: &str) {
        let state = lock(&self.last).clone().unwrap();
        *lock(&state) = LeaseState::Lost(why.into());
        let hook = lock(&self.last_hook)
            .clone()
            .expect("the vmm set an event hook");
        hook.lease_lost(why);
    }
}

impl LinkSource for FakeSource {
    fn check_node(&self, node: &str) -> Result<(), AttachError> {
        if node == "node3" {
            Ok(())
        } else {
            Err(AttachError::UnknownNode {
                node: node.into(),
                known: "node3".into(),
            })
        }
    }
    fn borrow(&self, spec: &RemoteDeviceSpec) -> Result<Box<dyn RemoteDeviceLink>, AttachError> {
        self.check_node(&spec.node)?;
        if spec.bdf.bus == 0x99 {
            return Err(AttachError::UnknownDevice {
                node: spec.node.clone(),
                bdf: spec.bdf.to_string(),
            });
        }
        if spec.bdf.bus == 0x98 {
            return Err(AttachError::Unreachable {
                node: spec.node.clone(),
                addr: "/run/lendvm/node3.sock".into(),
                reason: "connection refused".into(),
            });
        }
        let state = Arc::new(Mutex::new(LeaseState::Active));
        *lock(&self.last) = Some(state.clone());
        self.live.fetch_add(1, Ordering::SeqCst);
        let hook = Arc::new(Mutex::new(None));
        *lock(&self.last_hook) = None;
        let link = FakeLink {
            state,
            live: self.live.clone(),
            dma: (spec.bdf.bus == 0x82).then(|| self.dma_maps.clone()),
            hook: hook.clone(),
            migration: (spec.bdf.bus == 0x97).then(|| {
                let m = Arc::new(FakeMigration::new(false));
                *lock(&self.last_migration) = Some(m.clone());
                m
            }),
        };
        // Mirror the hook the VMM sets into the source, so a test can fire it.
        let last_hook = self.last_hook.clone();
        Ok(Box::new(HookMirror {
            link,
            hook,
            last_hook,
        }))
    }
}

/// Forwards to the fake link and publishes the hook the VMM sets.
struct HookMirror {
    link: FakeLink,
    hook: Arc<Mutex<Option<Arc<dyn LinkEventHook>>>>,
    last_hook: Arc<Mutex<Option<Arc<dyn LinkEventHook>>>>,
}

impl RemoteDeviceLink for HookMirror {
    fn device_info(&self) -> RemoteDeviceInfo {
        self.link.device_info()
    }
    fn config_read(&self, o: u16, d: &mut [u8]) -> Result<(), LinkError> {
        self.link.config_read(o, d)
    }
    fn config_write(&self, o: u16, d: &[u8]) -> Result<(), LinkError> {
        self.link.config_write(o, d)
    }
    fn bar_read(&self, b: u8, o: u64, d: &mut [u8]) -> Result<(), LinkError> {
        self.link.bar_read(b, o, d)
    }
    fn bar_write(&self, b: u8, o: u64, d: &[u8]) -> Result<(), LinkError> {
        self.link.bar_write(b, o, d)
    }
    fn map_dma(&self, r: &[GuestRamRegion]) -> Result<Box<dyn DmaMapping>, LinkError> {
        self.link.map_dma(r)
    }
    fn set_irqs(&self, t: &IrqTargets<'_>) -> Result<(), LinkError> {
        self.link.set_irqs(t)
    }
    fn reset(&self) -> Result<(), LinkError> {
        self.link.reset()
    }
    fn lease_state(&self) -> LeaseState {
        self.link.lease_state()
    }
    fn set_event_hook(&self, hook: Arc<dyn LinkEventHook>) {
        *lock(&self.hook) = Some(hook.clone());
        *lock(&self.last_hook) = Some(hook);
    }
    fn migration(&self) -> Option<Arc<dyn remote_pci::LeaseMigration>> {
        self.link.migration()
    }
}

struct Rig {
    _dir: tempfile::TempDir,
    vm: Vm,
    ctl: Controller,
    ejects: EjectReceiver,
    source: FakeSource,
}

/// A 1-vCPU VM with a two-instruction spin kernel (never started).
fn rig() -> Rig {
    rig_with(Vec::new())
}

/// [`rig`] with the guest NUMA nodes `numa` (`--numa`).
fn rig_with(numa: Vec<crate::numa::NumaNodeConfig>) -> Rig {
    rig_full(numa, Vec::new())
}

/// [`rig_with`] and the lender switches `switches`.
fn rig_full(
    numa: Vec<crate::numa::NumaNodeConfig>,
    switches: Vec<crate::device_manager::LenderSwitch>,
) -> Rig {
    if let Err(e) = kvm_ioctls::Kvm::new() {
        panic!("/dev/kvm is required by the vmm tests: {e}");
    }
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("spin.elf");
    std::fs::write(&kernel, spin_elf()).unwrap();
    let mut vm = Vm::new(&VmConfig {
        memory_size: 64 << 20,
        ram_backing: Default::default(),
        cpus: 1,
        kernel,
        cmdline: String::new(),
        initramfs: None,
        serial: SerialConfig::Off,
        cpuid_cmdline: true,
        cpu_model: Default::default(),
        pci_mmio64_size: Some(crate::device_manager::PCI_MMIO64_SIZE),
        numa,
        pci_slots: pci::root::MAX_DEVICE_SLOTS,
        switches,
    })
    .unwrap();
    let ejects = vm.platform_mut().take_ejects().unwrap();
    let h = VmHandles {
        devices: vm.devices().clone(),
        interrupts: vm.interrupt_manager(),
        vm_ops: vm.vm_ops(),
        hotplug: vm.platform().hotplug().clone(),
        exit: vm.exit_notifier().clone(),
        vcpus: vm.vcpu_control().clone(),
        events: EventBus::new(),
    };
    let source = FakeSource::default();
    let config = VmConfigInfo {
        cpus: 1,
        memory_size: 64 << 20,
        kernel: "spin.elf".into(),
        cmdline: String::new(),
        initramfs: None,
        remote_devices: Vec::new(),
        pci_slots: None,
        numa_nodes: Vec::new(),
        switches: Vec::new(),
    };
    let mut ctl = Controller::new(h, Box::new(source.clone()), config);
    ctl.set_running();
    Rig {
        _dir: dir,
        vm,
        ctl,
        ejects,
        source,
    }
}

/// ELF64 with one PT_LOAD at 2 MiB holding `pause; jmp .-2`.
fn spin_elf() -> Vec<u8> {
    let base: u64 = 0x20_0000;
    let code = [0xf3u8, 0x90, 0xeb, 0xfc];
    let mut e = Vec::new();
    e.extend_from_slice(b"\x7fELF\x02\x01\x01\x00");
    e.extend_from_slice(&[0; 8]);
    e.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    e.extend_from_slice(&0x3eu16.to_le_bytes());
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&base.to_le_bytes()); // entry
    e.extend_from_slice(&64u64.to_le_bytes()); // phoff
    e.extend_from_slice(&0u64.to_le_bytes()); // shoff
    e.extend_from_slice(&0u32.to_le_bytes());
    for v in [64u16, 56, 1, 0, 0, 0] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    e.extend_from_slice(&5u32.to_le_bytes()); // R X
    for v in [0x1000u64, base, base, 4, 4, 0x1000] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.resize(0x1000, 0);
    e.extend_from_slice(&code);
    e
}

fn add(ctl: &mut Controller, dev: &str, id: Option<&str>) -> ApiReply {
    ctl.handle(ApiRequest::VmAddRemoteDevice(VmAddRemoteDeviceData {
        device: dev.parse().unwrap(),
        id: id.map(String::from),
        mode: None,
        replace_lost: false,
        numa_node: None,
    }))
}

fn remove(ctl: &mut Controller, id: &str, force: bool) -> ApiReply {
    ctl.handle(ApiRequest::VmRemoveDevice(VmRemoveDeviceData {
        id: id.into(),
        force,
    }))
}

fn kind(r: ApiReply) -> ApiErrorKind {
    r.unwrap_err().kind
}

fn read_reg(rig: &Rig, offset: u64) -> u32 {
    let mut b = [0u8; 4];
    rig.vm
        .devices()
        .mmio_bus()
        .read(PCI_HOTPLUG_START + offset, &mut b)
        .unwrap();
    u32::from_le_bytes(b)
}

fn guest_eject(rig: &mut Rig, slot: u8) {
    rig.vm
        .devices()
        .mmio_bus()
        .write(PCI_HOTPLUG_START + 8, &(1u32 << slot).to_le_bytes())
        .unwrap();
    let slots = rig.ejects.drain();
    rig.ctl.on_ejects(&slots);
}

fn entry_state(ctl: &Controller, id: &str) -> Option<ApiLeaseState> {
    ctl.info()
        .remote_devices
        .iter()
        .find(|d| d.id == id)
        .map(|d| d.lease_state)
}

#[test]
fn attach_errors_map_to_http_classes() {
    let (node, bdf, reason) = (
        "node3".to_string(),
        "0000:81:00.0".to_string(),
        "x".to_string(),
    );
    let cases = [
        (
            AttachError::UnknownNode {
                node: node.clone(),
                known: "node1".into(),
            },
            ApiErrorKind::BadRequest,
        ),
        (
            AttachError::UnknownDevice {
                node: node.clone(),
                bdf: bdf.clone(),
            },
            ApiErrorKind::BadRequest,
        ),
        (
            AttachError::Busy {
                node: node.clone(),
                bdf: bdf.clone(),
                message: reason.clone(),
            },
            ApiErrorKind::Conflict,
        ),
        (
            AttachError::Unreachable {
                node: node.clone(),
                addr: "127.0.0.1:1".into(),
                reason: reason.clone(),
            },
            ApiErrorKind::BadGateway,
        ),
        (
            AttachError::Refused {
                node: node.clone(),
                reason: "bad token".into(),
            },
            ApiErrorKind::BadGateway,
        ),
        (
            AttachError::Borrow {
                node: node.clone(),
                bdf: bdf.clone(),
                reason: "fabric: peer node3 is gone".into(),
            },
            ApiErrorKind::BadGateway,
        ),
        (
            AttachError::Link {
                node: node.clone(),
                bdf: bdf.clone(),
                reason: reason.clone(),
            },
            ApiErrorKind::BadGateway,
        ),
        (
            AttachError::Local { node, bdf, reason },
            ApiErrorKind::Internal,
        ),
    ];
    for (e, want) in cases {
        let a = attach_api_error(&e);
        assert_eq!((a.kind, a.message.as_str()), (want, e.to_string().as_str()));
    }
    assert_eq!(ApiErrorKind::BadGateway.status(), 502);
    assert_eq!(ApiErrorKind::Internal.status(), 500);
}

#[test]
fn add_and_remove_follow_the_fake_vmm_semantics() {
    let mut rig = rig();
    let ctl = &mut rig.ctl;
    let Ok(ApiResponse::DeviceAdded(d)) = add(ctl, "node3:0000:81:00.0", Some("nvme1")) else {
        panic!("add failed");
    };
    assert_eq!(
        (d.id.as_str(), d.bdf.to_string().as_str()),
        ("nvme1", "0000:00:01.0")
    );
    // The device answers on ECAM and its BAR was assigned.
    let mut id = [0u8; 4];
    rig.vm
        .devices()
        .mmio_bus()
        .read(crate::layout::PCI_ECAM_START | (1 << 15), &mut id)
        .unwrap();
    assert_eq!(u32::from_le_bytes(id), 0x5678_1234);
    // Slot-up bit for slot 1, GED status bit 1.
    assert_eq!(read_reg(&rig, 0), 1 << 1);
    let ctl = &mut rig.ctl;
    assert_eq!(
        kind(add(ctl, "node3:0000:82:00.0", Some("nvme1"))),
        ApiErrorKind::Conflict
    );
    let e = add(ctl, "node3:0000:81:00.0", Some("x")).unwrap_err();
    assert_eq!(e.message, "node3:0000:81:00.0 is already attached as nvme1");
    let e = add(ctl, "node9:0000:81:00.0", None).unwrap_err();
    assert_eq!(
        (e.kind, e.message.as_str()),
        (
            ApiErrorKind::BadRequest,
            "unknown node node9 (known: node3)"
        )
    );
    let e = add(ctl, "node3:0000:99:00.0", None).unwrap_err();
    assert_eq!(
        (e.kind, e.message.as_str()),
        (
            ApiErrorKind::BadRequest,
            "node node3 has no device 0000:99:00.0 to lend"
        )
    );
    // The lender failed (not the request, not the VMM): 502.
    let e = add(ctl, "node3:0000:98:00.0", None).unwrap_err();
    assert_eq!(
        (e.kind, e.message.as_str()),
        (
            ApiErrorKind::BadGateway,
            "lender node3 is unreachable at /run/lendvm/node3.sock: connection refused"
        )
    );
    // Auto id (the failed adds did not use one up).
    let Ok(ApiResponse::DeviceAdded(d2)) = add(ctl, "node3:0000:82:00.0", None) else {
        panic!("second add failed");
    };
    assert_eq!((d2.id.as_str(), d2.bdf.device), ("_remote0", 2));

    // Remove waits for the guest's eject.
    assert_eq!(remove(ctl, "nvme1", false), Ok(ApiResponse::Empty));
    assert_eq!(entry_state(ctl, "nvme1"), Some(ApiLeaseState::Removing));
    let e = remove(ctl, "nvme1", false).unwrap_err();
    assert_eq!(e.kind, ApiErrorKind::Conflict);
    assert!(
        e.message.starts_with("removal of nvme1 is already pending"),
        "{}",
        e.message
    );
    assert_eq!(read_reg(&rig, 4), 1 << 1, "slot-down bit");
    assert!(
        rig.vm.devices().pci_bus().device(1).is_some(),
        "still plugged"
    );
    guest_eject(&mut rig, 1);
    assert!(
        rig.vm.devices().pci_bus().device(1).is_none(),
        "torn down on eject"
    );
    let ctl = &mut rig.ctl;
    assert_eq!(entry_state(ctl, "nvme1"), None);
    assert_eq!(kind(remove(ctl, "nvme1", false)), ApiErrorKind::NotFound);

    // Force: at once, the guest is still told, its late eject is ignored.
    assert_eq!(remove(ctl, "_remote0", true), Ok(ApiResponse::Empty));
    assert!(rig.vm.devices().pci_bus().device(2).is_none());
    assert_eq!(read_reg(&rig, 4), 1 << 2);
    assert_eq!(
        kind(remove(&mut rig.ctl, "_remote0", true)),
        ApiErrorKind::NotFound
    );
    // Slot 2 waits for the guest's eject, so the next device goes to slot 1.
    let Ok(ApiResponse::DeviceAdded(d3)) = add(&mut rig.ctl, "node3:0000:82:00.0", None) else {
        panic!("third add failed");
    };
    assert_eq!(d3.bdf.device, 1);
    guest_eject(&mut rig, 2);
    assert_eq!(entry_state(&rig.ctl, &d3.id), Some(ApiLeaseState::Active));
    assert_eq!(remove(&mut rig.ctl, &d3.id, true), Ok(ApiResponse::Empty));

    let c = rig.ctl.counters();
    assert_eq!(c, VmCounters::default(), "{c:?}");
    assert_eq!(
        rig.source.live.load(Ordering::SeqCst),
        0,
        "every link dropped"
    );
}

#[test]
fn lost_lease_is_torn_down_and_announced() {
    let mut rig = rig();
    add(&mut rig.ctl, "node3:0000:81:00.0", Some("d")).unwrap();
    let _ = read_reg(&rig, 0);
    rig.ctl.check_leases();
    assert_eq!(entry_state(&rig.ctl, "d"), Some(ApiLeaseState::Active));
    rig.source.lose_last("lender died");
    rig.ctl.check_leases();
    assert_eq!(entry_state(&rig.ctl, "d"), Some(ApiLeaseState::Lost));
    assert!(rig.vm.devices().pci_bus().device(1).is_none());
    assert_eq!(read_reg(&rig, 4), 1 << 1, "guest asked to release the slot");
    assert_eq!(rig.ctl.counters().leases, 0);
    assert_eq!(rig.source.live.load(Ordering::SeqCst), 0);
    let info = rig.ctl.info();
    assert!(!info.remote_devices[0].dma_window.mapped);
    // The guest's eject removes the entry.
    guest_eject(&mut rig, 1);
    assert_eq!(entry_state(&rig.ctl, "d"), None);
    assert_eq!(rig.ctl.counters(), VmCounters::default());
}

#[test]
fn shutdown_refuses_further_changes() {
    let mut rig = rig();
    add(&mut rig.ctl, "node3:0000:81:00.0", Some("d")).unwrap();
    assert_eq!(
        rig.ctl.handle(ApiRequest::VmShutdown),
        Ok(ApiResponse::Empty)
    );
    assert!(rig.vm.exit_notifier().should_stop());
    let e = rig.ctl.handle(ApiRequest::VmShutdown).unwrap_err();
    assert_eq!(
        (e.kind, e.message.as_str()),
        (ApiErrorKind::Conflict, "the vm is already shut down")
    );
    let e = add(&mut rig.ctl, "node3:0000:82:00.0", None).unwrap_err();
    assert_eq!(
        (e.kind, e.message.as_str()),
        (
            ApiErrorKind::Conflict,
            "cannot add a device: the vm is Shutdown"
        )
    );
    rig.ctl.teardown_all();
    assert_eq!(rig.ctl.state(), VmState::Shutdown);
    assert_eq!(rig.ctl.counters(), VmCounters::default());
}

#[test]
fn fifty_cycles_leak_nothing() {
    let mut rig = rig();
    let before = rig.ctl.counters();
    for i in 0..50 {
        let Ok(ApiResponse::DeviceAdded(d)) = add(&mut rig.ctl, "node3:0000:81:00.0", None) else {
            panic!("add {i} failed");
        };
        assert_eq!(remove(&mut rig.ctl, &d.id, false), Ok(ApiResponse::Empty));
        guest_eject(&mut rig, d.bdf.device);
    }
    assert_eq!(rig.ctl.counters(), before);
    assert_eq!(rig.vm.devices().pci_bus().used_slots(), vec![0]);
}

#[test]
fn forced_slots_are_reclaimed_without_losing_the_new_device() {
    let mut rig = rig();
    // Fill every slot and force-remove: the idle guest never ejects.
    for i in 0..31u8 {
        let Ok(ApiResponse::DeviceAdded(d)) = add(&mut rig.ctl, "node3:0000:81:00.0", None) else {
            panic!("add {i} failed");
        };
        assert_eq!(d.bdf.device, i + 1);
        assert_eq!(remove(&mut rig.ctl, &d.id, true), Ok(ApiResponse::Empty));
    }
    let Ok(ApiResponse::DeviceAdded(d)) = add(&mut rig.ctl, "node3:0000:81:00.0", Some("new"))
    else {
        panic!("add after all slots were forced failed");
    };
    assert_eq!(d.bdf.device, 1, "slot 1 reclaimed");
    // The reclaim's own eject arrives on the channel and must not tear "new" down.
    let slots = rig.ejects.drain();
    assert_eq!(slots, vec![1]);
    rig.ctl.on_ejects(&slots);
    assert_eq!(entry_state(&rig.ctl, "new"), Some(ApiLeaseState::Active));
    assert!(rig.vm.devices().pci_bus().device(1).is_some());
    // The guest's own eject of the new device still works.
    assert_eq!(remove(&mut rig.ctl, "new", false), Ok(ApiResponse::Empty));
    guest_eject(&mut rig, 1);
    assert_eq!(entry_state(&rig.ctl, "new"), None);
    assert_eq!(rig.ctl.counters(), VmCounters::default());
}

#[test]
fn numa_node_puts_a_device_on_its_nodes_root_bus_and_an_unknown_node_is_refused() {
    let node = |id, cpus: Vec<u8>| crate::numa::NumaNodeConfig {
        id,
        cpus,
        memory: 32 << 20,
        distances: Vec::new(),
    };
    let mut rig = rig_with(vec![node(0, vec![0]), node(1, Vec::new())]);
    let add_in = |ctl: &mut Controller, dev: &str, id: &str, numa_node| {
        ctl.handle(ApiRequest::VmAddRemoteDevice(VmAddRemoteDeviceData {
            device: dev.parse().unwrap(),
            id: Some(id.into()),
            mode: None,
            replace_lost: false,
            numa_node,
        }))
    };
    // Node 1: root bus 1, its first slot; its BAR in bus 1's part of the windows.
    let Ok(ApiResponse::DeviceAdded(d)) = add_in(&mut rig.ctl, "node3:0000:81:00.0", "n1", Some(1))
    else {
        panic!("add in node 1 failed");
    };
    assert_eq!((d.bdf.bus, d.bdf.device), (1, 1));
    assert!(rig.vm.devices().pci_bus().device(33).is_some());
    // vm.info says where it is, as the guest sees it.
    let info = rig.ctl.info();
    let n1 = info.remote_devices.iter().find(|d| d.id == "n1").unwrap();
    assert_eq!(n1.guest_bdf.to_string(), "0000:01:01.0");
    let bar0 = crate::layout::PCI_ECAM_START | 1 << 20 | 1 << 15 | 0x10;
    let mut b = [0u8; 4];
    rig.vm.devices().mmio_bus().read(bar0, &mut b).unwrap();
    let addr = u64::from(u32::from_le_bytes(b) & !0xf);
    let mut hi = [0u8; 4];
    rig.vm.devices().mmio_bus().read(bar0 + 4, &mut hi).unwrap();
    let addr = addr | u64::from(u32::from_le_bytes(hi)) << 32;
    let windows = rig.vm.devices().root_bus_windows(1);
    assert!(
        windows[1..]
            .iter()
            .any(|&(base, size)| addr >= base && addr < base + size),
        "bar 0 at {addr:#x}, bus 1's windows {windows:x?}"
    );
    // Node 0 (and no node): bus 0.
    let Ok(ApiResponse::DeviceAdded(d)) = add_in(&mut rig.ctl, "node3:0000:82:00.0", "n0", Some(0))
    else {
        panic!("add in node 0 failed");
    };
    assert_eq!((d.bdf.bus, d.bdf.device), (0, 1));
    // A node the VM does not have: refused by name, nothing borrowed or plugged.
    let live = rig.source.live.load(Ordering::SeqCst);
    let e = add_in(&mut rig.ctl, "node3:0000:83:00.0", "n2", Some(2)).unwrap_err();
    assert_eq!(e.kind, ApiErrorKind::BadRequest);
    assert!(
        e.message.contains("numa_node=2") && e.message.contains("0 to 1"),
        "{e:?}"
    );
    assert_eq!(rig.source.live.load(Ordering::SeqCst), live);
    // The guest ejects the node-1 device on its own bus (PSEG 1).
    assert_eq!(remove(&mut rig.ctl, "n1", false), Ok(ApiResponse::Empty));
    let mmio = rig.vm.devices().mmio_bus().clone();
    mmio.write(PCI_HOTPLUG_START + 12, &1u32.to_le_bytes())
        .unwrap();
    assert_eq!(read_reg(&rig, 4), 1 << 1, "bus 1's slot-down bit");
    mmio.write(PCI_HOTPLUG_START + 8, &(1u32 << 1).to_le_bytes())
        .unwrap();
    let slots = rig.ejects.drain();
    assert_eq!(slots, vec![33]);
    rig.ctl.on_ejects(&slots);
    assert_eq!(entry_state(&rig.ctl, "n1"), None);
    assert!(rig.vm.devices().pci_bus().device(33).is_none());

    // A VM without NUMA nodes has no node to name.
    let mut flat = rig_with(Vec::new());
    let e = add_in(&mut flat.ctl, "node3:0000:81:00.0", "x", Some(0)).unwrap_err();
    assert!(e.message.contains("no NUMA nodes"), "{e:?}");
}

/// Lender node3's switch (two ports, at 00:01.0, bus 1 = index 1): its devices go behind
/// it while a port is free, then on the root bus; the
/// guest ejects a device behind the switch through the switch's bus (PSEG 1), and the port
/// takes the next device.
#[test]
fn a_lenders_devices_go_behind_its_switch_while_it_has_ports_and_leave_through_it() {
    let mut rig = rig_full(
        Vec::new(),
        vec![crate::device_manager::LenderSwitch {
            lender: "node3".into(),
            root: 0,
            ports: 2,
        }],
    );
    let bdf_of = |r: ApiReply| match r {
        Ok(ApiResponse::DeviceAdded(d)) => d.bdf.to_string(),
        other => panic!("add failed: {other:?}"),
    };
    let a1 = bdf_of(add(&mut rig.ctl, "node3:0000:81:00.0", Some("a1")));
    let a2 = bdf_of(add(&mut rig.ctl, "node3:0000:82:00.0", Some("a2")));
    let a3 = bdf_of(add(&mut rig.ctl, "node3:0000:83:00.0", Some("a3")));
    assert_eq!(
        [a1.as_str(), &a2, &a3],
        ["0000:01:00.0", "0000:01:01.0", "0000:00:02.0"],
        "behind the switch (bridge at 00:01.0) while a port is free, then on bus 0"
    );
    let info = rig.ctl.info();
    let at = |id: &str| {
        info.remote_devices
            .iter()
            .find(|d| d.id == id)
            .map(|d| d.guest_bdf.to_string())
    };
    assert_eq!(at("a2").as_deref(), Some("0000:01:01.0"));
    // The guest ejects a1 on the switch's bus: PSEG 1 selects it, PCID says port 0.
    assert_eq!(remove(&mut rig.ctl, "a1", false), Ok(ApiResponse::Empty));
    let mmio = rig.vm.devices().mmio_bus().clone();
    mmio.write(PCI_HOTPLUG_START + 12, &1u32.to_le_bytes())
        .unwrap();
    assert_eq!(read_reg(&rig, 4), 1, "the switch's port-0-down bit");
    mmio.write(PCI_HOTPLUG_START + 8, &1u32.to_le_bytes())
        .unwrap();
    let slots = rig.ejects.drain();
    assert_eq!(slots, vec![32]);
    rig.ctl.on_ejects(&slots);
    assert_eq!(entry_state(&rig.ctl, "a1"), None);
    // The freed port takes node3's next device; the bridge stays in its slot.
    let a4 = bdf_of(add(&mut rig.ctl, "node3:0000:84:00.0", Some("a4")));
    assert_eq!(a4, "0000:01:00.0");
    assert!(
        rig.vm.devices().pci_bus().device(1).is_some(),
        "the bridge stays"
    );
}

fn events(ctl: &Controller) -> Vec<String> {
    ctl.events()
        .recent()
        .iter()
        .map(|e| e.event.clone())
        .collect()
}

#[test]
fn lease_loss_reaches_the_event_loop_as_an_event() {
    let rig = rig();
    let Rig {
        _dir,
        vm,
        ctl,
        ejects,
        source,
    } = rig;
    let ctl = Rc::new(RefCell::new(ctl));
    add(&mut ctl.borrow_mut(), "node3:0000:81:00.0", Some("d")).unwrap();
    let mut lp =
        crate::event_loop::EventLoop::new(ctl.clone(), None, ejects, vm.exit_notifier().clone())
            .unwrap();
    assert_eq!(lp.lease_subscribers(), 1, "boot-time device watched");
    // Nothing happens without an event: a dispatch with a short timeout sees nothing.
    assert_eq!(lp.run_once(10), None);
    assert_eq!(entry_state(&ctl.borrow(), "d"), Some(ApiLeaseState::Active));
    let t0 = Instant::now();
    source.lose_last("lender died");
    // One dispatch handles it: no timer, no polling.
    assert_eq!(lp.run_once(1000), None);
    let took = t0.elapsed();
    assert_eq!(entry_state(&ctl.borrow(), "d"), Some(ApiLeaseState::Lost));
    assert!(took < Duration::from_secs(1), "device-lost after {took:?}");
    let ev = ctl.borrow().events().recent();
    let lost = ev
        .iter()
        .find(|e| e.event == "device-lost")
        .expect("device-lost event");
    assert_eq!(lost.properties["id"], "d");
    assert_eq!(lost.properties["cause"], "lender died");
    assert_eq!(lost.properties["bdf"], "0000:00:01.0");
    assert!(!events(&ctl.borrow()).contains(&"lease-returned".to_string()));
    assert_eq!(
        lp.lease_subscribers(),
        0,
        "the lost device's subscriber is gone"
    );
    assert_eq!(ctl.borrow().counters().leases, 0);
    assert_eq!(source.live.load(Ordering::SeqCst), 0);
}

#[test]
fn device_removed_is_emitted_on_the_eject_not_the_api_call() {
    let mut rig = rig();
    add(&mut rig.ctl, "node3:0000:81:00.0", Some("d")).unwrap();
    assert_eq!(events(&rig.ctl), ["device-added"]);
    assert_eq!(remove(&mut rig.ctl, "d", false), Ok(ApiResponse::Empty));
    assert!(
        !events(&rig.ctl).contains(&"device-removed".to_string()),
        "no device-removed before the guest ejects: {:?}",
        events(&rig.ctl)
    );
    guest_eject(&mut rig, 1);
    assert_eq!(
        events(&rig.ctl),
        [
            "device-added",
            "lease-returned",
            "device-removed",
            "device-released"
        ]
    );
    let ev = rig.ctl.events().recent();
    assert_eq!(ev[2].properties["id"], "d");
    assert_eq!(ev[2].properties["bdf"], "0000:00:01.0");
    assert_eq!(ev[2].properties["how"], "ejected");
    assert_eq!(ev[3].properties["id"], "d");
    assert_eq!(ev[3].properties["device"], "node3:0000:81:00.0");
}

const RELEASING_EJECT: &str = "node3:0000:81:00.0 (removed as disk0) is still being released: \
     the guest has not ejected it yet (vm.remove-device with \"force\": true tears it down \
     now); add it again after the device-released event of disk0 (lendctl events)";
const RELEASING_VCPU: &str = "node3:0000:81:00.0 (removed as disk0) is still being released: \
     a vCPU is finishing an access to it, then its lease goes back to the lender; add it \
     again after the device-released event of disk0 (lendctl events)";

/// A re-add of a removed device before its release is over is refused as still being
/// released, saying what the release waits for (the guest's eject, then a vCPU's access),
/// not as "already attached"; `device-released` (after `device-removed` and the lease's
/// return) says when it may come back, and then it does.
#[test]
fn a_re_add_before_the_release_is_over_is_refused_as_releasing_until_device_released() {
    let mut rig = rig();
    add(&mut rig.ctl, "node3:0000:81:00.0", Some("disk0")).unwrap();
    assert_eq!(remove(&mut rig.ctl, "disk0", false), Ok(ApiResponse::Empty));
    // Under a new id or the old one: the same answer.
    for id in ["disk1", "disk0"] {
        let e = add(&mut rig.ctl, "node3:0000:81:00.0", Some(id)).unwrap_err();
        assert_eq!(
            (e.kind, e.message.as_str()),
            (ApiErrorKind::Conflict, RELEASING_EJECT)
        );
    }
    // The guest ejects while a vCPU is inside an access to the device.
    let held = rig.vm.devices().pci_bus().device(1).unwrap();
    guest_eject(&mut rig, 1);
    assert_eq!(rig.ctl.deferred_drops(), 1);
    let e = add(&mut rig.ctl, "node3:0000:81:00.0", Some("disk1")).unwrap_err();
    assert_eq!(
        (e.kind, e.message.as_str()),
        (ApiErrorKind::Conflict, RELEASING_VCPU)
    );
    assert_eq!(events(&rig.ctl), ["device-added", "device-removed"]);
    assert_eq!(rig.ctl.counters().leases, 1, "the lease is still held");
    drop(held);
    rig.ctl.on_release_timer();
    assert_eq!(
        events(&rig.ctl),
        [
            "device-added",
            "device-removed",
            "lease-returned",
            "device-released"
        ]
    );
    let ev = rig.ctl.events().recent();
    assert_eq!(ev[3].properties["id"], "disk0");
    assert_eq!(ev[3].properties["device"], "node3:0000:81:00.0");
    assert_eq!(rig.ctl.counters().leases, 0);
    // Released: it comes back.
    let Ok(ApiResponse::DeviceAdded(d)) = add(&mut rig.ctl, "node3:0000:81:00.0", Some("disk1"))
    else {
        panic!("re-add after device-released failed");
    };
    assert_eq!(d.id, "disk1");
}

/// A forced removal is released when it answers (no vCPU holds the device): the re-add
/// right after succeeds. A lost device is released when its entry is cleared.
#[test]
fn forced_and_lost_devices_are_released_when_their_entry_goes() {
    let mut rig = rig();
    add(&mut rig.ctl, "node3:0000:81:00.0", Some("disk0")).unwrap();
    assert_eq!(remove(&mut rig.ctl, "disk0", true), Ok(ApiResponse::Empty));
    assert_eq!(
        events(&rig.ctl),
        [
            "device-added",
            "lease-returned",
            "device-removed",
            "device-released"
        ]
    );
    add(&mut rig.ctl, "node3:0000:81:00.0", Some("disk1")).unwrap();
    rig.source.lose_last("lender died");
    rig.ctl.check_leases();
    let released = |ctl: &Controller| {
        events(ctl)
            .iter()
            .filter(|e| *e == "device-released")
            .count()
    };
    assert_eq!(released(&rig.ctl), 1, "a lost device is still in the table");
    assert_eq!(remove(&mut rig.ctl, "disk1", false), Ok(ApiResponse::Empty));
    assert_eq!(released(&rig.ctl), 2);
    let ev = rig.ctl.events().recent();
    let last = ev.last().unwrap();
    assert_eq!(
        (last.event.as_str(), &last.properties["id"]),
        ("device-released", &Value::from("disk1"))
    );
}

#[test]
fn lost_devices_say_how_to_clear_them_and_can_be_replaced() {
    let mut rig = rig();
    add(&mut rig.ctl, "node3:0000:81:00.0", Some("nvme0")).unwrap();
    rig.source.lose_last("lender died");
    rig.ctl.check_leases();
    let e = add(&mut rig.ctl, "node3:0000:81:00.0", Some("nvme1")).unwrap_err();
    assert_eq!(e.kind, ApiErrorKind::Conflict);
    assert!(e.message.contains("nvme0, which is lost"), "{}", e.message);
    assert!(e.message.contains("replace_lost"), "{}", e.message);
    assert!(e.message.contains("remove-device nvme0"), "{}", e.message);
    let e = add(&mut rig.ctl, "node3:0000:82:00.0", Some("nvme0")).unwrap_err();
    assert!(
        e.message.contains("in use by a lost device"),
        "{}",
        e.message
    );
    // replace_lost clears the lost entry and adds in one call.
    let r = rig
        .ctl
        .handle(ApiRequest::VmAddRemoteDevice(VmAddRemoteDeviceData {
            device: "node3:0000:81:00.0".parse().unwrap(),
            id: Some("nvme0".into()),
            mode: None,
            replace_lost: true,
            numa_node: None,
        }));
    let Ok(ApiResponse::DeviceAdded(d)) = r else {
        panic!("replace_lost add failed: {r:?}");
    };
    assert_eq!(d.id, "nvme0");
    assert_eq!(entry_state(&rig.ctl, "nvme0"), Some(ApiLeaseState::Active));
    assert_eq!(rig.ctl.counters().leases, 1);
    // replace_lost does not touch a live device.
    let r = rig
        .ctl
        .handle(ApiRequest::VmAddRemoteDevice(VmAddRemoteDeviceData {
            device: "node3:0000:81:00.0".parse().unwrap(),
            id: None,
            mode: None,
            replace_lost: true,
            numa_node: None,
        }));
    assert_eq!(
        r.unwrap_err().message,
        "node3:0000:81:00.0 is already attached as nvme0"
    );
}

#[test]
fn pause_and_resume_follow_the_vm_state() {
    let mut rig = rig();
    add(&mut rig.ctl, "node3:0000:81:00.0", Some("d")).unwrap();
    let e = rig.ctl.handle(ApiRequest::VmResume).unwrap_err();
    assert_eq!(
        (e.kind, e.message.as_str()),
        (ApiErrorKind::Conflict, "the vm is not paused")
    );
    assert_eq!(rig.ctl.handle(ApiRequest::VmPause), Ok(ApiResponse::Empty));
    assert_eq!(rig.ctl.state(), VmState::Paused);
    assert!(rig.vm.vcpu_control().is_paused());
    let dev = rig.vm.devices().pci_bus().device(1).unwrap();
    drop(dev);
    let e = rig.ctl.handle(ApiRequest::VmPause).unwrap_err();
    assert_eq!(e.message, "the vm is already paused");
    let e = add(&mut rig.ctl, "node3:0000:82:00.0", None).unwrap_err();
    assert_eq!(e.message, "cannot add a device: the vm is Paused");
    assert_eq!(rig.ctl.handle(ApiRequest::VmResume), Ok(ApiResponse::Empty));
    assert_eq!(rig.ctl.state(), VmState::Running);
    assert!(!rig.vm.vcpu_control().is_paused());
    assert_eq!(
        events(&rig.ctl),
        ["device-added", "vm-paused", "vm-resumed"]
    );
    // Shutdown works from the paused state too.
    assert_eq!(rig.ctl.handle(ApiRequest::VmPause), Ok(ApiResponse::Empty));
    assert_eq!(
        rig.ctl.handle(ApiRequest::VmmShutdown),
        Ok(ApiResponse::Empty)
    );
    assert!(rig.vm.exit_notifier().should_stop());
}

#[test]
fn counters_report_kvm_statistics_and_devices() {
    let mut rig = rig();
    add(&mut rig.ctl, "node3:0000:81:00.0", Some("d")).unwrap();
    let Ok(ApiResponse::Counters(c)) = rig.ctl.handle(ApiRequest::VmCounters) else {
        panic!("vm.counters failed");
    };
    for k in ["exits", "mmio_exits", "io_exits", "halt_exits"] {
        assert!(c["vm"].contains_key(k), "vm.{k} missing: {:?}", c["vm"]);
    }
    assert_eq!(c["vm"]["exits"], 0, "the vCPU never ran");
    assert_eq!(c["d"]["bme_transitions"], 0);
    assert_eq!(c["d"]["pinned_bytes"], 0);
}

#[test]
fn metrics_are_the_counters_under_exported_names() {
    let mut rig = rig();
    add(&mut rig.ctl, "node3:0000:81:00.0", Some("d")).unwrap();
    let Ok(ApiResponse::Metrics(t)) = rig
        .ctl
        .handle(ApiRequest::VmMetrics(lending::metrics::Format::Text))
    else {
        panic!("metrics failed");
    };
    let names: std::collections::BTreeSet<&str> = t
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    for n in &names {
        assert!(crate::metrics::NAMES.contains(n), "{n} is not in NAMES");
    }
    for n in [
        "lendvm_kvm_exits_total",
        "lendvm_device_mmio_exits_total",
        "lendvm_device_lease_state",
        "lendvm_device_pinned_bytes",
        "lendvm_resources",
        "lendvm_pinned_bytes",
        "lendvm_migrations_total",
        "lendvm_migration_active",
    ] {
        assert!(names.contains(n), "{n} missing:\n{t}");
    }
    // The figures are vm.counters' own, under their names there.
    assert!(
        t.contains("device=\"d\",name=\"bme_transitions\"} 0"),
        "{t}"
    );
    assert!(t.contains("resource=\"devices\"} 1"), "{t}");
    assert!(t.contains("state=\"active\"} 1"), "{t}");
}

#[test]
fn a_device_a_vcpu_still_holds_is_dropped_later_on_the_control_thread() {
    let mut rig = rig();
    add(&mut rig.ctl, "node3:0000:81:00.0", Some("d")).unwrap();
    // What a vCPU inside an access holds.
    let held = rig.vm.devices().pci_bus().device(1).unwrap();
    assert_eq!(remove(&mut rig.ctl, "d", true), Ok(ApiResponse::Empty));
    assert_eq!(rig.ctl.deferred_drops(), 1);
    assert_eq!(rig.ctl.counters().leases, 1, "the lease is still held");
    rig.ctl.on_release_timer();
    assert_eq!(rig.ctl.deferred_drops(), 1, "still held");
    drop(held);
    // The holder's drop was not the last one: the device is still alive.
    assert_eq!(rig.ctl.counters().leases, 1);
    assert_eq!(rig.source.live.load(Ordering::SeqCst), 1);
    rig.ctl.on_release_timer();
    assert_eq!(rig.ctl.deferred_drops(), 0);
    assert_eq!(rig.ctl.counters(), VmCounters::default());
    assert_eq!(rig.source.live.load(Ordering::SeqCst), 0);
    assert!(events(&rig.ctl).contains(&"lease-returned".to_string()));
}

// ---- one DMA manager per VM ------------------------------------------------------------------

/// The real parallel pinner, recording every `RLIMIT_MEMLOCK` demand.
struct RecordingPinner {
    inner: remote_pci::ParallelPinner,
    checks: Mutex<Vec<u64>>,
}

impl remote_pci::Pinner for RecordingPinner {
    fn check(&self, total: u64) -> Result<(), remote_pci::PinError> {
        lock(&self.checks).push(total);
        self.inner.check(total)
    }
    fn pin(&self, addr: u64, len: u64) -> Result<remote_pci::PinnedRange, remote_pci::PinError> {
        self.inner.pin(addr, len)
    }
}

/// Sets or clears Bus Master Enable of the device in `slot` as a guest config write does.
fn set_bme(rig: &Rig, slot: u8, on: bool) {
    let dev = rig.vm.devices().pci_bus().device(slot).unwrap();
    let v: u16 = if on { 0x6 } else { 0x2 };
    lock(&dev).write_config_register(1, 0, &v.to_le_bytes());
}

/// (dma maps made, pinned bytes held) of device `id` per `vm.counters`.
fn dma_status(ctl: &Controller, id: &str) -> (u64, u64) {
    let c = ctl.counters_report();
    let d = &c[id];
    (d["dma_maps"], d["pinned_bytes"])
}

#[test]
fn two_dma_devices_pin_guest_ram_once() {
    let mut rig = rig();
    let rec = Arc::new(RecordingPinner {
        inner: remote_pci::ParallelPinner::new(2).with_min_chunk(16 << 20),
        checks: Mutex::new(Vec::new()),
    });
    rig.ctl.set_dma_pinner(rec.clone());
    let ram: u64 = 64 << 20;
    add(&mut rig.ctl, "node3:0000:82:00.0", Some("a")).unwrap();
    add(&mut rig.ctl, "node3:0000:82:01.0", Some("b")).unwrap();
    let slot = |id: &str| {
        rig.ctl
            .info()
            .remote_devices
            .iter()
            .find(|d| d.id == id)
            .map(|d| d.guest_bdf.device)
            .unwrap()
    };
    let (sa, sb) = (slot("a"), slot("b"));
    let locked0 = remote_pci::pin::locked_bytes();
    set_bme(&rig, sa, true);
    set_bme(&rig, sb, true);
    assert_eq!(
        rig.source.dma_maps.load(Ordering::SeqCst),
        2,
        "each device mapped"
    );
    assert_eq!(
        rig.ctl.counters().pinned_bytes,
        ram,
        "pinned once, not twice"
    );
    assert_eq!(rig.ctl.dma().holders(), 2);
    assert_eq!(
        *lock(&rec.checks),
        vec![ram],
        "the memlock check asks for ram once"
    );
    let locked = remote_pci::pin::locked_bytes();
    assert!(
        locked >= locked0 + ram && locked < locked0 + 2 * ram,
        "VmLck {locked0:#x} -> {locked:#x}"
    );
    assert_eq!(dma_status(&rig.ctl, "a"), (1, ram));
    assert_eq!(dma_status(&rig.ctl, "b"), (1, ram));

    // Removing one keeps the other's pin and mapping.
    assert_eq!(remove(&mut rig.ctl, "a", true), Ok(ApiResponse::Empty));
    assert_eq!(rig.ctl.deferred_drops(), 0);
    assert_eq!(rig.source.dma_maps.load(Ordering::SeqCst), 1);
    assert_eq!(rig.ctl.counters().pinned_bytes, ram);
    assert_eq!(rig.ctl.dma().holders(), 1);
    assert!(
        remote_pci::pin::locked_bytes() >= locked0 + ram,
        "b's ram got unpinned"
    );
    assert_eq!(dma_status(&rig.ctl, "b"), (1, ram));

    // Clearing BME on the last one unpins; setting it again pins again.
    set_bme(&rig, sb, false);
    assert_eq!(rig.ctl.counters().pinned_bytes, 0);
    assert_eq!(rig.source.dma_maps.load(Ordering::SeqCst), 0);
    set_bme(&rig, sb, true);
    assert_eq!(rig.ctl.counters().pinned_bytes, ram);
    assert_eq!(lock(&rec.checks).len(), 2);

    // Removing the last returns every counter to 0.
    assert_eq!(remove(&mut rig.ctl, "b", true), Ok(ApiResponse::Empty));
    assert_eq!(rig.ctl.deferred_drops(), 0);
    assert_eq!(rig.ctl.counters(), VmCounters::default());
    assert_eq!(rig.ctl.dma().holders(), 0);
    assert_eq!(rig.source.dma_maps.load(Ordering::SeqCst), 0);
    // VmLck is the whole test process's: other tests' pages come and go meanwhile, so the
    // fall is awaited (bounded) rather than read once.
    let deadline = Instant::now() + Duration::from_secs(10);
    while remote_pci::pin::locked_bytes() > locked0 + (ram / 2) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let locked = remote_pci::pin::locked_bytes();
    assert!(
        locked <= locked0 + (ram / 2),
        "VmLck {locked0:#x} -> {locked:#x} after both devices went"
    );
}

#[test]
fn migration_refuses_lent_devices_bad_urls_and_incoming_on_a_running_vm() {
    let mut rig = rig();
    let send = |ctl: &mut Controller, url: &str| {
        ctl.handle(ApiRequest::VmSendMigration(
            api::types::VmSendMigrationData {
                destination_url: url.into(),
                local: false,
            },
        ))
    };
    let e = send(&mut rig.ctl, "ftp://elsewhere").unwrap_err();
    assert_eq!(e.kind, ApiErrorKind::BadRequest, "{e}");
    assert!(e.message.contains("ftp://elsewhere"), "{e}");
    add(&mut rig.ctl, "node3:0000:81:00.0", Some("nvme0")).unwrap();
    let e = send(&mut rig.ctl, "unix:/nonexistent/m.sock").unwrap_err();
    assert_eq!(e.kind, ApiErrorKind::Conflict, "{e}");
    assert!(
        e.message.contains("nvme0") && e.message.contains("cannot be handed over"),
        "{e}"
    );
    // Refused up front: no migration was started, the VM runs on.
    assert_eq!(rig.ctl.state(), VmState::Running);
    assert!(!events(&rig.ctl).iter().any(|e| e.starts_with("migration-")));
    // A device whose lender cannot track its DMA writes (VFIO) is not refused (see
    // `migration_of_an_untracked_device_sends_its_whole_window_at_the_final_pass`); a VMM
    // that cannot migrate at all (no snapshot source here) stops the dirty log it started.
    remove(&mut rig.ctl, "nvme0", true).unwrap();
    add(&mut rig.ctl, "node3:0000:97:00.0", Some("vfio0")).unwrap();
    let e = send(&mut rig.ctl, "unix:/nonexistent/m.sock").unwrap_err();
    assert_eq!(e.kind, ApiErrorKind::Internal, "{e}");
    assert!(e.message.contains("cannot migrate its vm"), "{e}");
    let m = lock(&rig.source.last_migration).clone().unwrap();
    assert!(!m.logging.load(Ordering::SeqCst), "dirty log left on");
    assert_eq!(m.calls(), ["start", "stop"]);
    assert_eq!(rig.ctl.state(), VmState::Running);
    assert!(!events(&rig.ctl).iter().any(|e| e.starts_with("migration-")));
    let e = rig
        .ctl
        .handle(ApiRequest::VmReceiveMigration(
            api::types::VmReceiveMigrationData {
                receiver_url: "unix:/tmp/x.sock".into(),
            },
        ))
        .unwrap_err();
    assert_eq!(e.kind, ApiErrorKind::Conflict, "{e}");
}

/// The destination of a test migration: guest RAM of its own, no vCPUs or devices (the
/// state document is taken as it comes).
struct FakeDestination {
    ram: Arc<crate::memory::GuestRam>,
}

impl crate::migration::receive::MigrationTarget for FakeDestination {
    fn ram(&self) -> &crate::memory::GuestRam {
        &self.ram
    }
    fn restore(
        &self,
        _: &crate::snapshot::format::VmSnapshot,
    ) -> Result<(), crate::migration::MigrationError> {
        Ok(())
    }
}

type Arrived = Result<
    (
        Arc<crate::memory::GuestRam>,
        Vec<crate::migration::protocol::DeviceHandover>,
    ),
    String,
>;

/// Listens at a unix socket in `dir` as `node9`/`dst`, receives one VM and acknowledges it.
/// The thread returns the RAM it received and the hand-overs, or why it failed.
fn destination(dir: &std::path::Path) -> (String, std::thread::JoinHandle<Arrived>) {
    let url = format!("unix:{}", dir.join("migrate.sock").display());
    let mut incoming =
        crate::migration::receive::Incoming::listen(&url, Default::default()).unwrap();
    let t = std::thread::spawn(move || {
        let identity = crate::migration::protocol::Identity {
            node: Some("node9".into()),
            vm: Some("dst".into()),
        };
        let r = incoming
            .receive(identity, |cfg, _| {
                Ok(FakeDestination {
                    ram: Arc::new(crate::memory::GuestRam::new(cfg.memory_size).unwrap()),
                })
            })
            .map_err(|e| error_chain(&e))?;
        let ram = r.vm.ram.clone();
        r.reply.ack().map_err(|e| error_chain(&e))?;
        Ok((ram, r.handover))
    });
    (url, t)
}

/// Starts the rig's vCPUs (the spin kernel) and gives the controller what a migration
/// reads.
fn migratable(rig: &mut Rig) {
    rig.vm.start().unwrap();
    rig.ctl.set_snapshot_source(
        rig.vm
            .snapshot_source(crate::snapshot::format::MachineConfig {
                cpus: 1,
                memory_size: 64 << 20,
                kernel: "spin.elf".into(),
                cmdline: String::new(),
                serial: None,
                cpu_model: None,
                pci_mmio64_size: None,
                numa: Vec::new(),
                pci_slots: None,
                switches: Vec::new(),
            }),
    );
}

/// Offset of `gpa` in the guest RAM file.
fn ram_offset(ram: &crate::memory::GuestRam, gpa: u64) -> u64 {
    let r = ram
        .regions()
        .iter()
        .find(|r| gpa >= r.gpa && gpa < r.gpa + r.size)
        .unwrap();
    r.file_offset + (gpa - r.gpa)
}

fn migration_events(ctl: &Controller) -> Vec<Arc<api::events::VmEvent>> {
    ctl.events()
        .recent()
        .into_iter()
        .filter(|e| e.source == "migration")
        .collect()
}

/// The DMA window of the VFIO-like device in the migration tests: 64 pages at 1 MiB.
const WINDOW: u64 = 0x10_0000;
const WINDOW_PAGES: u64 = 64;

/// A device whose lender cannot log its writes (VFIO without IOMMU dirty tracking)
/// migrates: its log is not fetched in precopy (it would be the whole window every round),
/// but once, after the hand-over quiesce confirmed its drain, so its whole window is sent
/// again with the VM paused. A write the device made at the very end (inside the quiesce,
/// after precopy sent that page; KVM's log cannot see device writes) arrives at the
/// destination only through that.
#[test]
fn migration_of_an_untracked_device_sends_its_whole_window_at_the_final_pass() {
    use std::os::unix::fs::FileExt;
    let mut rig = rig();
    migratable(&mut rig);
    add(&mut rig.ctl, "node3:0000:97:00.0", Some("vfio0")).unwrap();
    let m = lock(&rig.source.last_migration).clone().unwrap();
    *lock(&m.window) = Some((WINDOW, WINDOW_PAGES));
    const MARK: &[u8] = b"the device's last write before it drained";
    let at = ram_offset(rig.vm.ram(), WINDOW + 5 * 4096 + 0x123);
    {
        let ram = rig.vm.ram().clone();
        *lock(&m.on_quiesce) = Some(Box::new(move || {
            ram.memfd().write_all_at(MARK, at).unwrap();
        }));
    }
    let (url, dst) = destination(rig._dir.path());
    let r = rig.ctl.send_migration(&api::types::VmSendMigrationData {
        destination_url: url,
        local: false,
    });
    let arrived = dst.join().unwrap();
    r.unwrap();
    let (ram, handover) = arrived.unwrap();
    let mut got = vec![0u8; MARK.len()];
    ram.memfd().read_exact_at(&mut got, at).unwrap();
    assert_eq!(got, MARK, "the device's last write arrived");
    assert_eq!(
        handover.iter().map(|h| h.id.as_str()).collect::<Vec<_>>(),
        ["vfio0"]
    );
    // One fetch, after the quiesce; the lease moved.
    assert_eq!(m.calls(), ["start", "quiesce", "fetch", "ticket", "moved"]);
    assert_eq!(rig.ctl.state(), VmState::ShuttingDown);

    let evs = migration_events(&rig.ctl);
    let started = evs.iter().find(|e| e.event == "migration-started").unwrap();
    assert_eq!(
        started.properties["untracked_devices"],
        serde_json::json!(["vfio0"])
    );
    let quiesced = evs
        .iter()
        .find(|e| e.event == "migration-device-handover" && e.properties["phase"] == "quiesced")
        .unwrap();
    assert_eq!(quiesced.properties["dirty_log"], "whole-window");
    let rounds: Vec<(u64, u64)> = evs
        .iter()
        .filter(|e| e.event == "migration-memory-iteration")
        .map(|e| {
            (
                e.properties["pages"].as_u64().unwrap(),
                e.properties["device_pages"].as_u64().unwrap(),
            )
        })
        .collect();
    let (last, precopy) = rounds.split_last().unwrap();
    assert_eq!(precopy[0].0, (64 << 20) / 4096, "round 0: all of RAM");
    assert!(
        precopy.iter().all(|&(_, dev)| dev == 0),
        "no device pages in precopy: {rounds:?}"
    );
    assert!(
        last.0 >= WINDOW_PAGES && last.1 > 0,
        "the final pass has the whole window: {rounds:?}"
    );
}

/// The drain of an untracked device is not confirmed: the migration fails before its log is
/// fetched or its lease is offered, and the source runs on with the device.
#[test]
fn migration_of_an_untracked_device_that_does_not_drain_fails_and_the_source_runs_on() {
    let mut rig = rig();
    migratable(&mut rig);
    add(&mut rig.ctl, "node3:0000:97:00.0", Some("vfio0")).unwrap();
    let m = lock(&rig.source.last_migration).clone().unwrap();
    *lock(&m.window) = Some((WINDOW, WINDOW_PAGES));
    m.drained.store(false, Ordering::SeqCst);
    let (url, dst) = destination(rig._dir.path());
    let e = rig
        .ctl
        .send_migration(&api::types::VmSendMigrationData {
            destination_url: url,
            local: false,
        })
        .unwrap_err();
    assert!(
        e.message.contains("vfio0") && e.message.contains("drained"),
        "{e}"
    );
    assert!(dst.join().unwrap().is_err(), "the destination got no vm");
    assert_eq!(m.calls(), ["start", "quiesce", "stop", "resume"]);
    assert_eq!(rig.ctl.state(), VmState::Running);
    assert!(!rig.vm.vcpu_control().is_paused(), "vCPUs resumed");
    assert_eq!(entry_state(&rig.ctl, "vfio0"), Some(ApiLeaseState::Active));
    let names: Vec<String> = migration_events(&rig.ctl)
        .iter()
        .map(|e| e.event.clone())
        .collect();
    assert_eq!(names.last().map(String::as_str), Some("migration-failed"));
}
