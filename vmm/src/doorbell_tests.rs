//! A borrowed NVMe's doorbells without VMM exits, on a real KVM VM with an in-process
//! lender over shm and `RemotePciDevice` plugged into the VM's PCI bus:
//!
//! * interrupt mode with shadow doorbells: the vCPU's store to the SQ tail doorbell is a KVM
//!   ioeventfd on the lender's eventfd; the ioeventfds are counted by `KvmVmOps` (the
//!   `ioeventfds` leak counter of `vm.info`) and gone after removal;
//! * polling mode: the doorbell page is a writable memslot; the store lands in the lender's
//!   register memory and the polling controller sees it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use emulated::nvme::NvmeConfig;
use emulated::NotifyMode;
use lending::backend::emulated::EmulatedBackend;
use lending::inventory::Inventory;
use lending::server::{BackgroundLender, Lender};
use lending::LenderClient;
use ntb::{ClusterConfig, Fabric, SocketFabric};
use pci::configuration::command;
use pci::device::PciDevice;
use pci::vm_ops::VmOps;
use pci::SharedPciDevice;
use remote_pci::lending_link::{LendingLink, LendingLinkOptions};
use remote_pci::{RemotePciDevice, RemotePciDeviceParams};

use crate::config::{SerialConfig, VmConfig};
use crate::exit::VmExit;
use crate::vm::Vm;

const TOKEN: &str = "t0ken";
const DEV: &str = "0000:82:00.0";
const CC: u64 = 0x14;
const INTMC: u64 = 0x10;
const CSTS: u64 = 0x1c;
const AQA: u64 = 0x24;
const ASQ: u64 = 0x28;
const ACQ: u64 = 0x30;
const SQ0_TAIL: u64 = 0x1000;
const SQ1_TAIL: u64 = 0x1008;
const CQ1_HEAD: u64 = 0x100c;
/// CC: EN, IOSQES 64 B, IOCQES 16 B.
const CC_EN: u32 = 1 | (6 << 16) | (4 << 20);
// Guest RAM layout (64 MiB VM; the guest code is at 2 MiB).
const ARG_GPA: u64 = 0x30_0000;
const ASQ_GPA: u64 = 0x100_0000;
const ACQ_GPA: u64 = 0x101_0000;
const SQ1_GPA: u64 = 0x102_0000;
const CQ1_GPA: u64 = 0x103_0000;
const SHADOW_GPA: u64 = 0x104_0000;
const EVENTIDX_GPA: u64 = 0x105_0000;

/// ELF64 with one PT_LOAD at 2 MiB: `mov rax, [ARG_GPA]; mov dword [rax], 1;
/// mov al, 0; out 0xf4, al; jmp $` (a store to the address the test puts at ARG_GPA, then
/// debug exit 0).
fn store_then_exit_elf() -> Vec<u8> {
    let base: u64 = 0x20_0000;
    let mut code = vec![0x48, 0x8b, 0x04, 0x25];
    code.extend_from_slice(&(ARG_GPA as u32).to_le_bytes());
    code.extend_from_slice(&[0xc7, 0x00, 0x01, 0x00, 0x00, 0x00]);
    code.extend_from_slice(&[0xb0, 0x00, 0xe6, 0xf4, 0xeb, 0xfe]);
    let n = code.len() as u64;
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
    for v in [0x1000u64, base, base, n, n, 0x1000] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    e.resize(0x1000, 0);
    e.extend_from_slice(&code);
    e
}

fn start_lender(dir: &std::path::Path, notify: NotifyMode) -> (ClusterConfig, BackgroundLender) {
    let d = dir.display();
    let node = |n: &str| {
        format!("[[node]]\nname = \"{n}\"\nfabric = \"shm\"\ncontrol = \"{d}/{n}.sock\"\n")
    };
    let path = dir.join("cluster.toml");
    std::fs::write(
        &path,
        format!("version = 1\n{}{}", node("lender"), node("vmm")),
    )
    .unwrap();
    let cfg = ClusterConfig::load(&path).unwrap();
    let nvme = NvmeConfig {
        backing: dir.join("disk.img"),
        size: Some(1 << 20),
        io_threads: 1,
        max_io_queues: 2,
        notify,
        ..NvmeConfig::default()
    };
    let backend = Arc::new(EmulatedBackend::nvme("vmm-kick", nvme).unwrap());
    let inv = Arc::new(Inventory::new(vec![(DEV.to_string(), backend as _)]).unwrap());
    let listener = SocketFabric::from_cluster(&cfg, "lender")
        .unwrap()
        .listen()
        .unwrap();
    let lender = BackgroundLender::start(Lender::new(inv, "lender", TOKEN), listener).unwrap();
    (cfg, lender)
}

struct Guest<'a> {
    ops: &'a dyn VmOps,
}

impl Guest<'_> {
    fn sqe(&self, sq: u64, slot: u64, dw: &[(usize, u32)]) {
        let mut sqe = [0u8; 64];
        for &(i, v) in dw {
            sqe[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
        self.ops.write_guest(sq + slot * 64, &sqe).unwrap();
    }

    fn u32_at(&self, gpa: u64) -> u32 {
        let mut b = [0u8; 4];
        self.ops.read_guest(gpa, &mut b).unwrap();
        u32::from_le_bytes(b)
    }

    /// Phase-1 completions at the start of the CQ at `cq`.
    fn posted(&self, cq: u64) -> u64 {
        (0..16u64)
            .take_while(|i| (self.u32_at(cq + i * 16 + 12) >> 16) & 1 == 1)
            .count() as u64
    }

    fn wait_posted(&self, cq: u64, n: u64) {
        let t0 = Instant::now();
        while self.posted(cq) < n && t0.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(self.posted(cq), n, "completions at {cq:#x}");
        for i in 0..n {
            let st = (self.u32_at(cq + i * 16 + 12) >> 17) & 0x7ff;
            assert_eq!(st, 0, "status of completion {i} at {cq:#x}");
        }
    }
}

#[test]
fn shadowed_doorbell_store_is_a_kvm_ioeventfd_and_gone_after_removal() {
    guest_doorbell_store(NotifyMode::Interrupt);
}

#[test]
fn polled_doorbell_store_lands_in_a_writable_memslot() {
    guest_doorbell_store(NotifyMode::Polling);
}

fn guest_doorbell_store(mode: NotifyMode) {
    let polling = mode == NotifyMode::Polling;
    kvm_ioctls::Kvm::new().expect("this test needs a usable /dev/kvm");
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("store.elf");
    std::fs::write(&kernel, store_then_exit_elf()).unwrap();
    let vm = Vm::new(&VmConfig {
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
        numa: Vec::new(),
        pci_slots: pci::root::MAX_DEVICE_SLOTS,
        switches: Vec::new(),
    })
    .unwrap();
    let ops = vm.vm_ops();
    assert_eq!(ops.ioevents_registered(), 0);
    let (cluster, _lender) = start_lender(dir.path(), mode);
    let client = Arc::new(LenderClient::connect(&cluster, "vmm", "lender", TOKEN, "test").unwrap());
    assert_eq!(client.endpoint().kind(), ntb::FabricKind::Shm);
    let lease = client.borrow(DEV, "vm0").unwrap();
    let link = LendingLink::new(client, lease, LendingLinkOptions::default()).unwrap();
    let dev = RemotePciDevice::new(
        RemotePciDeviceParams::new("nvme0", 0x08, None),
        Box::new(link),
        ops.clone(),
        &*vm.interrupt_manager(),
    )
    .unwrap();
    let dev = Arc::new(Mutex::new(dev));
    let shared: SharedPciDevice = dev.clone();
    let bdf = vm.devices().add_pci_device(shared, None).unwrap();
    let mut d = dev.lock().unwrap();
    d.write_config_register(
        1,
        0,
        &(command::MEMORY_SPACE | command::BUS_MASTER).to_le_bytes(),
    );
    assert!(d.status().dma_mapped);
    let bar0 = d.configuration().bar(0).unwrap().addr;
    let g = Guest { ops: &*ops };
    let w32 = |d: &mut RemotePciDevice, off: u64, v: u32| d.write_bar(bar0, off, &v.to_le_bytes());
    let w64 = |d: &mut RemotePciDevice, off: u64, v: u64| d.write_bar(bar0, off, &v.to_le_bytes());

    // The driver side, from the host: enable, I/O queue pair 1, Doorbell Buffer Config.
    w32(&mut d, AQA, (15 << 16) | 15);
    w64(&mut d, ASQ, ASQ_GPA);
    w64(&mut d, ACQ, ACQ_GPA);
    w32(&mut d, CC, CC_EN);
    let mut csts = [0u8; 4];
    d.read_bar(bar0, CSTS, &mut csts);
    assert_eq!(u32::from_le_bytes(csts) & 1, 1, "ready");
    let qs = 1 | (15 << 16);
    g.sqe(
        ASQ_GPA,
        0,
        &[(0, 0x05), (6, CQ1_GPA as u32), (10, qs), (11, 1)],
    );
    let sq = [
        (0, 0x01 | (1 << 16)),
        (6, SQ1_GPA as u32),
        (10, qs),
        (11, 1 | (1 << 16)),
    ];
    g.sqe(ASQ_GPA, 1, &sq);
    let dbbuf = [
        (0, 0x7c | (2 << 16)),
        (6, SHADOW_GPA as u32),
        (8, EVENTIDX_GPA as u32),
    ];
    g.sqe(ASQ_GPA, 2, &dbbuf);
    let n = if polling { 2 } else { 3 };
    w32(&mut d, SQ0_TAIL, n as u32);
    g.wait_posted(ACQ_GPA, n);
    if polling {
        // No shadow doorbells; BAR0's doorbell pages are writable, page 0 is not.
        assert!(d.kick_ioeventfds().1.is_empty());
        assert_eq!(ops.ioevents_registered(), 0);
        drop(d);
        guest_store_completes(vm, dev, bar0, &*ops, bdf);
        return;
    }
    // The lender's KICKS event is applied at the next trapped store (a harmless INTMC write).
    let t0 = Instant::now();
    while d.kick_ioeventfds().1.is_empty() && t0.elapsed() < Duration::from_secs(10) {
        w32(&mut d, INTMC, 0);
        std::thread::sleep(Duration::from_millis(5));
    }
    let offs = d.kick_ioeventfds().1;
    assert!(
        offs.contains(&SQ1_TAIL) && offs.contains(&CQ1_HEAD),
        "{offs:?}"
    );
    assert_eq!(ops.ioevents_registered(), offs.len(), "registered with KVM");
    assert_eq!(d.counters().ioeventfds, offs.len() as u64);

    // The guest's I/O: a Flush on SQ 1 with its tail in the shadow buffer; the vCPU's store
    // to the SQ 1 tail doorbell is the only kick.
    ops.write_guest(SHADOW_GPA + 8, &1u32.to_le_bytes())
        .unwrap();
    drop(d);
    guest_store_completes(vm, dev, bar0, &*ops, bdf);
    // SQ 1's EventIdx asks for a doorbell at the next tail: the controller caught up.
    assert_eq!(Guest { ops: &*ops }.u32_at(EVENTIDX_GPA + 8), 1);
    assert_eq!(
        ops.ioevents_registered(),
        0,
        "ioeventfds leak counter back to 0"
    );
}

/// Runs the guest (a Flush queued on SQ 1, the vCPU stores tail 1 to BAR0's SQ 1 doorbell
/// and exits), checks the Flush completed with no trapped BAR write and no VMM kick, then
/// removes the device.
fn guest_store_completes(
    vm: Vm,
    dev: Arc<Mutex<RemotePciDevice>>,
    bar0: u64,
    ops: &dyn VmOps,
    bdf: pci::PciBdf,
) {
    let g = Guest { ops };
    g.sqe(SQ1_GPA, 0, &[(0, 7 << 16), (1, 1)]);
    ops.write_guest(ARG_GPA, &(bar0 + SQ1_TAIL).to_le_bytes())
        .unwrap();
    let (before, counters) = {
        let d = dev.lock().unwrap();
        (d.counters(), d.counters_handle())
    };
    let devices = vm.devices().clone();
    let exit = vm.run(Some(Duration::from_secs(60))).unwrap();
    assert_eq!(exit, VmExit::DebugExit(0));
    g.wait_posted(CQ1_GPA, 1);
    let after = counters.snapshot();
    assert!(
        before.trapped_writes > 0,
        "the set-up's control writes trapped"
    );
    assert_eq!(
        (after.trapped_writes, after.kicks),
        (before.trapped_writes, before.kicks),
        "the doorbell store never reached the VMM"
    );
    // Removal: the device's ioeventfds are unregistered from KVM.
    let removed = devices.remove_pci_device(bdf.device()).unwrap();
    drop(removed);
    drop(dev);
}
