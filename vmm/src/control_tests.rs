//! The API handler against a real KVM VM (no vCPUs started) and fake lender links.
//! Skipped without a usable /dev/kvm.

use std::sync::atomic::AtomicUsize;

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
    fn map_dma(&self, _: &[GuestRamRegion]) -> Result<Box<dyn DmaMapping>, LinkError> {
        Err(LinkError::Down("fake".into()))
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
}

#[derive(Clone, Default)]
struct FakeSource {
    live: Arc<AtomicUsize>,
    /// State of the most recently borrowed link.
    last: Arc<Mutex<Option<Arc<Mutex<LeaseState>>>>>,
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
        Ok(Box::new(FakeLink {
            state,
            live: self.live.clone(),
        }))
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
fn rig() -> Option<Rig> {
    if kvm_ioctls::Kvm::new().is_err() {
        eprintln!("no /dev/kvm: skipped");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("spin.elf");
    std::fs::write(&kernel, spin_elf()).unwrap();
    let mut vm = Vm::new(&VmConfig {
        memory_size: 64 << 20,
        cpus: 1,
        kernel,
        cmdline: String::new(),
        initramfs: None,
        serial: SerialConfig::Off,
        cpuid_cmdline: true,
    })
    .unwrap();
    let ejects = vm.platform_mut().take_ejects().unwrap();
    let h = VmHandles {
        devices: vm.devices().clone(),
        interrupts: vm.interrupt_manager(),
        vm_ops: vm.vm_ops(),
        hotplug: vm.platform().hotplug().clone(),
        exit: vm.exit_notifier().clone(),
    };
    let source = FakeSource::default();
    let config = VmConfigInfo {
        cpus: 1,
        memory_size: 64 << 20,
        kernel: "spin.elf".into(),
        cmdline: String::new(),
        initramfs: None,
        remote_devices: Vec::new(),
    };
    let mut ctl = Controller::new(h, Box::new(source.clone()), config);
    ctl.set_running();
    Some(Rig {
        _dir: dir,
        vm,
        ctl,
        ejects,
        source,
    })
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
    let Some(mut rig) = rig() else { return };
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
    let Some(mut rig) = rig() else { return };
    add(&mut rig.ctl, "node3:0000:81:00.0", Some("d")).unwrap();
    let _ = read_reg(&rig, 0);
    let state = lock(&rig.source.last).clone().unwrap();
    rig.ctl.poll_leases(true);
    assert_eq!(entry_state(&rig.ctl, "d"), Some(ApiLeaseState::Active));
    *lock(&state) = LeaseState::Lost("lender died".into());
    rig.ctl.poll_leases(true);
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
    let Some(mut rig) = rig() else { return };
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
    let Some(mut rig) = rig() else { return };
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
    let Some(mut rig) = rig() else { return };
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
