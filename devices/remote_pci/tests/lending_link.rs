//! `RemotePciDevice` over `LendingLink` against an in-process lender lending emulated
//! devices: a `dmatest` (BAR window, DMA map at IOVA = GPA of memfd guest RAM, MSI-X irqfd
//! handed to the lender, lease returned on drop); an NVMe controller whose control registers
//! take the exact path while its doorbells are stored + notified, and whose INTx is asserted
//! again after a resample (shm and tcp); and the link's teardown without polling.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use emulated::dmatest::{
    CMD_START, REG_CMD, REG_DST, REG_IRQ_VECTOR, REG_LEN, REG_SRC, REG_STATUS, STATUS_DONE,
};
use emulated::nvme::NvmeConfig;
use emulated::NotifyMode;
use lending::backend::emulated::EmulatedBackend;
use lending::backend::DeviceBackend;
use lending::inventory::Inventory;
use lending::server::{BackgroundLender, Lender};
use lending::LenderClient;
use ntb::{ClusterConfig, Fabric, FabricKind, SocketFabric};
use pci::configuration::command;
use pci::device::{PciBarAllocators, PciDevice};
use pci::interrupt::{
    InterruptError, InterruptIndex, InterruptManager, InterruptSourceGroup, MsiIrqSourceConfig,
};
use pci::vm_ops::{
    GuestRamRegion, IoEventAddress, IoEventDatamatch, IoEventGuard, MemslotGuard, VmOps, VmOpsError,
};
use remote_pci::lending_link::{
    LenderSession, LendingLink, LendingLinkOptions, SessionCounters, SessionOptions,
};
use remote_pci::{BarAccess, LeaseState, RemoteDeviceLink, RemotePciDevice, RemotePciDeviceParams};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const TOKEN: &str = "t0ken";
const DEV: &str = "0000:00:04.0";
const RAM: u64 = 1 << 20;

struct Vm {
    ram: Arc<std::fs::File>,
    host: u64,
    slots: Arc<AtomicUsize>,
    /// Registered ioeventfds (address, a duplicate of the eventfd), removed by their guard.
    ioevents: Arc<Mutex<Vec<(IoEventAddress, EventFd)>>>,
}

impl VmOps for Vm {
    fn map_guest_region(
        &self,
        gpa: u64,
        size: u64,
        _host: u64,
        _ro: bool,
    ) -> Result<MemslotGuard, VmOpsError> {
        self.slots.fetch_add(1, Ordering::SeqCst);
        let s = self.slots.clone();
        Ok(MemslotGuard::new(gpa, size, 0, move || {
            s.fetch_sub(1, Ordering::SeqCst);
        }))
    }
    fn register_ioevent(
        &self,
        fd: &EventFd,
        addr: IoEventAddress,
        dm: Option<IoEventDatamatch>,
    ) -> Result<IoEventGuard, VmOpsError> {
        self.ioevents
            .lock()
            .unwrap()
            .push((addr, fd.try_clone().unwrap()));
        let evs = self.ioevents.clone();
        Ok(IoEventGuard::new(addr, dm, move || {
            let mut v = evs.lock().unwrap();
            let i = v.iter().position(|e| e.0 == addr).unwrap();
            v.remove(i);
        }))
    }
    fn guest_ram_regions(&self) -> Vec<GuestRamRegion> {
        vec![GuestRamRegion {
            gpa: 0,
            size: RAM,
            host_addr: self.host,
            file: Some((self.ram.clone(), 0)),
        }]
    }
    fn read_guest(&self, gpa: u64, data: &mut [u8]) -> Result<(), VmOpsError> {
        assert!(gpa + data.len() as u64 <= RAM);
        // SAFETY: bounds-checked copy out of the test's RAM mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (self.host + gpa) as *const u8,
                data.as_mut_ptr(),
                data.len(),
            )
        };
        Ok(())
    }
    fn write_guest(&self, gpa: u64, data: &[u8]) -> Result<(), VmOpsError> {
        assert!(gpa + data.len() as u64 <= RAM);
        // SAFETY: bounds-checked copy into the test's RAM mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), (self.host + gpa) as *mut u8, data.len())
        };
        Ok(())
    }
}

struct Group {
    fds: Vec<EventFd>,
    resample: Option<EventFd>,
    calls: Mutex<Vec<(u32, bool)>>,
}

impl InterruptSourceGroup for Group {
    fn trigger(&self, i: InterruptIndex) -> Result<(), InterruptError> {
        self.fds[i as usize].write(1).unwrap();
        Ok(())
    }
    fn notifier(&self, i: InterruptIndex) -> Option<&EventFd> {
        self.fds.get(i as usize)
    }
    fn resample_notifier(&self, i: InterruptIndex) -> Option<&EventFd> {
        (i == 0).then_some(self.resample.as_ref()).flatten()
    }
    fn update(
        &self,
        i: InterruptIndex,
        _: MsiIrqSourceConfig,
        m: bool,
    ) -> Result<(), InterruptError> {
        self.calls.lock().unwrap().push((i, m));
        Ok(())
    }
    fn enable(&self) -> Result<(), InterruptError> {
        Ok(())
    }
    fn disable(&self) -> Result<(), InterruptError> {
        Ok(())
    }
    fn count(&self) -> InterruptIndex {
        self.fds.len() as u32
    }
}

#[derive(Default)]
struct Irqs {
    groups: Mutex<Vec<Arc<Group>>>,
    intx: Mutex<Option<Arc<Group>>>,
}

impl InterruptManager for Irqs {
    fn create_msi_group(&self, n: u32) -> Result<Arc<dyn InterruptSourceGroup>, InterruptError> {
        let g = Arc::new(Group {
            fds: (0..n)
                .map(|_| EventFd::new(EFD_NONBLOCK).unwrap())
                .collect(),
            resample: None,
            calls: Mutex::default(),
        });
        self.groups.lock().unwrap().push(g.clone());
        Ok(g)
    }
    /// Like KVM's: an irqfd asserting the level-triggered line and the resample eventfd KVM
    /// signals when the guest's EOI lowered it.
    fn create_intx_group(
        &self,
        _irq: u32,
    ) -> Result<Arc<dyn InterruptSourceGroup>, InterruptError> {
        let g = Arc::new(Group {
            fds: vec![EventFd::new(EFD_NONBLOCK).unwrap()],
            resample: Some(EventFd::new(EFD_NONBLOCK).unwrap()),
            calls: Mutex::default(),
        });
        *self.intx.lock().unwrap() = Some(g.clone());
        Ok(g)
    }
}

fn wait_fd(fd: &EventFd, timeout: Duration) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, timeout.as_millis() as i32) == 1 }
}

/// A cluster file with a lender and a VMM node on shm (the directory holds the sockets).
fn shm_cluster() -> (tempfile::TempDir, ClusterConfig) {
    let dir = tempfile::tempdir().unwrap();
    let path = lending::testing::shm_cluster_file(dir.path(), &["lender", "vmm"]);
    (dir, ClusterConfig::load(&path).unwrap())
}

/// A cluster file with a lender and a VMM node on `fabric`, and the lender serving `backend`
/// as [`DEV`] in this process.
fn start_lender(
    fabric: FabricKind,
    backend: Arc<dyn DeviceBackend>,
) -> (tempfile::TempDir, ClusterConfig, BackgroundLender) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let node = |name: &str| match fabric {
        FabricKind::Shm => {
            format!(
                "[[node]]\nname = \"{name}\"\nfabric = \"shm\"\ncontrol = \"{d}/{name}.sock\"\n"
            )
        }
        FabricKind::Tcp | FabricKind::Bar => {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            format!(
                "[[node]]\nname = \"{name}\"\nfabric = \"tcp\"\ncontrol = \"127.0.0.1:{port}\"\n"
            )
        }
    };
    let src = format!("version = 1\n{}{}", node("lender"), node("vmm"));
    let path = dir.path().join("cluster.toml");
    std::fs::write(&path, src).unwrap();
    let cfg = ClusterConfig::load(&path).unwrap();
    let inv = Arc::new(Inventory::new(vec![(DEV.to_string(), backend)]).unwrap());
    let listener = SocketFabric::from_cluster(&cfg, "lender")
        .unwrap()
        .listen()
        .unwrap();
    let lender = BackgroundLender::start(Lender::new(inv, "lender", TOKEN), listener).unwrap();
    (dir, cfg, lender)
}

fn nvme_backend(dir: &std::path::Path, name: &str) -> Arc<dyn DeviceBackend> {
    let cfg = NvmeConfig {
        backing: dir.join(format!("{name}.img")),
        size: Some(1 << 20),
        io_threads: 1,
        max_io_queues: 2,
        serial: name.chars().take(20).collect(),
        ..NvmeConfig::default()
    };
    Arc::new(EmulatedBackend::nvme(name, cfg).unwrap())
}

fn guest_ram() -> (Arc<std::fs::File>, u64) {
    guest_ram_named(c"guest-ram")
}

/// Guest RAM in a memfd called `name` (found by that name in `/proc/self/maps`).
fn guest_ram_named(name: &std::ffi::CStr) -> (Arc<std::fs::File>, u64) {
    // SAFETY: a fresh memfd we own.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0);
    // SAFETY: fd is ours.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(RAM).unwrap();
    // Lenders map only size-sealed windows (as the VMM seals guest RAM).
    // SAFETY: F_ADD_SEALS on our memfd with an integer argument.
    let sealed = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, ntb::mem::WINDOW_SEALS) };
    assert_eq!(sealed, 0);
    // SAFETY: shared mapping of the memfd; lives until the process exits (test only).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            RAM as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    (Arc::new(f), p as u64)
}

#[test]
fn borrowed_dmatest_copies_and_interrupts_through_remote_pci() {
    let (_dir, cfg) = shm_cluster();
    let backend =
        Arc::new(EmulatedBackend::dmatest("rpci-dmatest", NotifyMode::Interrupt).unwrap());
    let inv = Arc::new(Inventory::new(vec![(DEV.to_string(), backend as _)]).unwrap());
    let listener = SocketFabric::from_cluster(&cfg, "lender")
        .unwrap()
        .listen()
        .unwrap();
    let _lender = BackgroundLender::start(Lender::new(inv, "lender", TOKEN), listener).unwrap();

    let client = Arc::new(LenderClient::connect(&cfg, "vmm", "lender", TOKEN, "test").unwrap());
    let lease = client.borrow(DEV, "vm0").unwrap();
    let link = LendingLink::new(client.clone(), lease, LendingLinkOptions::default()).unwrap();
    let info = link.device_info();
    let BarAccess::Direct(w) = &info.bars.iter().find(|b| b.index == 0).unwrap().access else {
        panic!("bar 0 is not directly mapped on shm: {info:?}");
    };
    assert!(
        w.write_notify().is_some(),
        "interrupt-mode device: stores are notified"
    );
    assert_eq!(link.lease_state(), LeaseState::Active);

    let (ram, host) = guest_ram();
    let slots = Arc::new(AtomicUsize::new(0));
    let vm: Arc<dyn VmOps> = Arc::new(Vm {
        ram,
        host,
        slots: slots.clone(),
        ioevents: Arc::default(),
    });
    let irqs = Irqs::default();
    let mut dev = RemotePciDevice::new(
        RemotePciDeviceParams::new("rd0", 0x20, None),
        Box::new(link),
        vm.clone(),
        &irqs,
    )
    .unwrap();
    let alloc = Arc::new(Mutex::new(
        PciBarAllocators::x86_64(1 << 36, 1 << 36).unwrap(),
    ));
    let bars = dev.allocate_bars(&alloc).unwrap();
    let bar0 = bars.iter().find(|b| b.idx == 0).unwrap().addr;
    let msix_bar = dev
        .msix()
        .map(|_| ())
        .and_then(|_| bars.iter().find(|b| b.idx == 1));
    let msix_base = msix_bar.unwrap().addr;

    // Memory + bus master: BAR0 memslot, guest RAM pinned and mapped at IOVA = GPA.
    dev.write_config_register(
        1,
        0,
        &(command::MEMORY_SPACE | command::BUS_MASTER).to_le_bytes(),
    );
    let st = dev.status();
    assert!(st.dma_mapped, "{st:?}");
    assert_eq!((st.dma_bytes, st.pinned_bytes), (RAM, RAM));
    assert!(slots.load(Ordering::SeqCst) >= 1);

    // MSI-X: vector 0 unmasked, enabled; the lender gets the irqfds.
    dev.write_bar(msix_base, 0, &0xfee0_0000u64.to_le_bytes());
    dev.write_bar(msix_base, 8, &0x40u32.to_le_bytes());
    dev.write_bar(msix_base, 12, &0u32.to_le_bytes());
    let cap = dev
        .configuration()
        .find_capability(pci::configuration::cap_id::MSIX)
        .unwrap();
    dev.write_config_register(cap / 4, 2, &0x8000u16.to_le_bytes());
    assert!(dev.status().msix_enabled);

    // A copy programmed through trapped stores into the shared register file.
    vm.write_guest(0x1000, &[0x5a; 256]).unwrap();
    dev.write_bar(bar0, REG_SRC, &0x1000u64.to_le_bytes());
    dev.write_bar(bar0, REG_DST, &0x8000u64.to_le_bytes());
    dev.write_bar(bar0, REG_LEN, &256u32.to_le_bytes());
    dev.write_bar(bar0, REG_IRQ_VECTOR, &0u32.to_le_bytes());
    dev.write_bar(bar0, REG_CMD, &CMD_START.to_le_bytes());
    let g = irqs.groups.lock().unwrap()[0].clone();
    assert!(
        wait_fd(g.notifier(0).unwrap(), Duration::from_secs(10)),
        "no completion interrupt on the irqfd"
    );
    let t0 = Instant::now();
    let mut s = [0u8; 4];
    loop {
        dev.read_bar(bar0, REG_STATUS, &mut s);
        if u32::from_le_bytes(s) & STATUS_DONE != 0 || t0.elapsed() > Duration::from_secs(10) {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_ne!(u32::from_le_bytes(s) & STATUS_DONE, 0);
    let mut out = [0u8; 256];
    vm.read_guest(0x8000, &mut out).unwrap();
    assert_eq!(out, [0x5a; 256], "device DMA went to GPA 0x8000");

    // BME off: unmapped and unpinned; drop: slots gone and the lease returned.
    dev.write_config_register(1, 0, &command::MEMORY_SPACE.to_le_bytes());
    assert!(!dev.status().dma_mapped);
    drop(dev);
    assert_eq!(slots.load(Ordering::SeqCst), 0);
    let t0 = Instant::now();
    while client.list().unwrap()[0].state != lending::protocol::DeviceState::Available
        && t0.elapsed() < Duration::from_secs(5)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        client.list().unwrap()[0].state,
        lending::protocol::DeviceState::Available
    );
}

// ---- NVMe: exact control registers, INTx resample ----------------------------------------

const INTMS: u64 = 0x0c;
const INTMC: u64 = 0x10;
const CC: u64 = 0x14;
const CSTS: u64 = 0x1c;
const AQA: u64 = 0x24;
const ASQ: u64 = 0x28;
const ACQ: u64 = 0x30;
const SQ0_TAIL: u64 = 0x1000;
const CQ0_HEAD: u64 = 0x1004;
const ASQ_GPA: u64 = 0x1_0000;
const ACQ_GPA: u64 = 0x2_0000;
/// CC: EN, IOSQES 64 B, IOCQES 16 B.
const CC_EN: u32 = 1 | (6 << 16) | (4 << 20);

/// A borrowed NVMe controller behind `RemotePciDevice` + `LendingLink`, BARs allocated,
/// memory decoding and bus mastering on.
struct NvmeRig {
    dev: Option<RemotePciDevice>,
    vm: Arc<dyn VmOps>,
    ioevents: Arc<Mutex<Vec<(IoEventAddress, EventFd)>>>,
    irqs: Irqs,
    bar0: u64,
    client: Arc<LenderClient>,
    _lender: BackgroundLender,
    _dir: tempfile::TempDir,
}

impl NvmeRig {
    fn new(fabric: FabricKind, intx: bool) -> Self {
        let data = tempfile::tempdir().unwrap();
        let name = format!("rpci-nvme-{fabric:?}-{intx}");
        let (dir, cfg, lender) = start_lender(fabric, nvme_backend(data.path(), &name));
        let client = Arc::new(LenderClient::connect(&cfg, "vmm", "lender", TOKEN, "test").unwrap());
        let lease = client.borrow(DEV, "vm0").unwrap();
        let link = LendingLink::new(client.clone(), lease, LendingLinkOptions::default()).unwrap();
        let (ram, host) = guest_ram();
        let ioevents: Arc<Mutex<Vec<(IoEventAddress, EventFd)>>> = Arc::default();
        let vm: Arc<dyn VmOps> = Arc::new(Vm {
            ram,
            host,
            slots: Arc::default(),
            ioevents: ioevents.clone(),
        });
        let irqs = Irqs::default();
        let mut dev = RemotePciDevice::new(
            RemotePciDeviceParams::new("rd1", 0x28, intx.then_some(17)),
            Box::new(link),
            vm.clone(),
            &irqs,
        )
        .unwrap();
        let alloc = Arc::new(Mutex::new(
            PciBarAllocators::x86_64(1 << 36, 1 << 36).unwrap(),
        ));
        let bars = dev.allocate_bars(&alloc).unwrap();
        let bar0 = bars.iter().find(|b| b.idx == 0).unwrap().addr;
        dev.write_config_register(
            1,
            0,
            &(command::MEMORY_SPACE | command::BUS_MASTER).to_le_bytes(),
        );
        assert!(dev.status().dma_mapped);
        drop(data);
        NvmeRig {
            dev: Some(dev),
            vm,
            ioevents,
            irqs,
            bar0,
            client,
            _lender: lender,
            _dir: dir,
        }
    }

    fn dev(&mut self) -> &mut RemotePciDevice {
        self.dev.as_mut().unwrap()
    }

    fn w32(&mut self, off: u64, v: u32) {
        let b = self.bar0;
        self.dev().write_bar(b, off, &v.to_le_bytes());
    }

    fn w64(&mut self, off: u64, v: u64) {
        let b = self.bar0;
        self.dev().write_bar(b, off, &v.to_le_bytes());
    }

    fn r32(&mut self, off: u64) -> u32 {
        let b = self.bar0;
        let mut d = [0u8; 4];
        self.dev().read_bar(b, off, &mut d);
        u32::from_le_bytes(d)
    }

    /// Admin queues of 16 entries in guest RAM, CC.EN = 1.
    fn enable(&mut self) {
        self.w32(AQA, (15 << 16) | 15);
        self.w64(ASQ, ASQ_GPA);
        self.w64(ACQ, ACQ_GPA);
        self.w32(CC, CC_EN);
        assert_eq!(
            self.r32(CSTS) & 1,
            1,
            "CSTS.RDY right after the (exact) CC write"
        );
    }

    /// Places a Get Features (Number of Queues) command at admin SQ slot `slot`.
    fn push_get_features(&self, slot: u64, cid: u16) {
        let mut sqe = [0u8; 64];
        sqe[0..4].copy_from_slice(&(0x0a | (u32::from(cid) << 16)).to_le_bytes());
        sqe[40..44].copy_from_slice(&7u32.to_le_bytes());
        self.vm.write_guest(ASQ_GPA + slot * 64, &sqe).unwrap();
    }

    /// Completion queue entries of the first pass posted so far (phase 1).
    fn posted(&self) -> u64 {
        self.posted_in(ACQ_GPA)
    }

    /// Phase-1 entries posted at the start of the 16-entry CQ at `cq`.
    fn posted_in(&self, cq: u64) -> u64 {
        (0..16u64)
            .take_while(|i| {
                let mut dw3 = [0u8; 4];
                self.vm.read_guest(cq + i * 16 + 12, &mut dw3).unwrap();
                (u32::from_le_bytes(dw3) >> 16) & 1 == 1
            })
            .count() as u64
    }

    /// Status field (SCT << 8 | SC) of the CQE at `cq` slot `i`.
    fn status_at(&self, cq: u64, i: u64) -> u16 {
        let mut dw3 = [0u8; 4];
        self.vm.read_guest(cq + i * 16 + 12, &mut dw3).unwrap();
        ((u32::from_le_bytes(dw3) >> 17) & 0x7ff) as u16
    }

    /// Places an SQE with the given dwords at `sq` slot `slot`.
    fn push(&self, sq: u64, slot: u64, dw: &[(usize, u32)]) {
        let mut sqe = [0u8; 64];
        for &(i, v) in dw {
            sqe[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
        self.vm.write_guest(sq + slot * 64, &sqe).unwrap();
    }

    /// Waits (at most 10 s) until `n` entries are posted in the CQ at `cq`.
    fn wait_posted(&self, cq: u64, n: u64) {
        let t0 = Instant::now();
        while self.posted_in(cq) < n && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(self.posted_in(cq), n, "completions at {cq:#x}");
    }
}

impl Drop for NvmeRig {
    fn drop(&mut self) {
        self.dev.take();
    }
}

/// Writes that leave a control register's stored value unchanged, or that are undone before
/// the controller thread runs, still reach the device: they take the lender's exact
/// `bar_write`, while doorbells keep the store + notify path.
#[test]
fn nvme_control_register_writes_are_exact_and_doorbells_direct() {
    let mut r = NvmeRig::new(FabricKind::Shm, false);
    let info_bar0 = r.dev().status().memslots;
    assert!(info_bar0 >= 1, "bar 0 is mapped (read-only) into the guest");

    // INTMS/INTMC are RW1S/RW1C over one mask that both read back.
    r.w32(INTMS, 1);
    assert_eq!((r.r32(INTMS), r.r32(INTMC)), (1, 1));
    // Clearing with the value INTMC already holds: a stored value would not change.
    r.w32(INTMC, 1);
    assert_eq!((r.r32(INTMS), r.r32(INTMC)), (0, 0), "INTMC write seen");
    r.w32(INTMS, 1);
    r.w32(INTMS, 1);
    assert_eq!(r.r32(INTMS), 1);
    r.w32(INTMC, 1);
    r.w32(INTMC, 1);
    assert_eq!(r.r32(INTMS), 0);

    // CC.EN 1 -> 0 -> 1 back to back: the controller resets in between (the reset clears
    // the interrupt mask) and is ready again.
    r.enable();
    r.w32(INTMS, 1);
    assert_eq!(r.r32(INTMS), 1);
    r.w32(CC, 0);
    r.w32(CC, CC_EN);
    assert_eq!(
        r.r32(INTMS),
        0,
        "the 1 -> 0 transition reset the controller"
    );
    assert_eq!(r.r32(CSTS) & 1, 1, "and 0 -> 1 enabled it again");

    // Doorbells: the SQ tail store goes to the shared window and wakes the controller,
    // which fetches the command and posts its completion.
    r.push_get_features(0, 1);
    r.w32(SQ0_TAIL, 1);
    let t0 = Instant::now();
    while r.posted() < 1 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(
        r.posted(),
        1,
        "admin command completed after a direct doorbell store"
    );
}

/// Level-triggered INTx across the lender: two completions assert the line once; the guest
/// takes one and EOIs; the second is delivered only after the resample.
#[test]
fn nvme_intx_is_asserted_again_after_resample() {
    for fabric in [FabricKind::Shm, FabricKind::Tcp] {
        let mut r = NvmeRig::new(fabric, true);
        assert_eq!(r.dev().status().irq_mode, Some(remote_pci::IrqKind::Intx));
        let g = r.irqs.intx.lock().unwrap().clone().unwrap();
        let irqfd = g.notifier(0).unwrap();
        let resample = g.resample_notifier(0).unwrap();
        r.enable();
        r.push_get_features(0, 1);
        r.push_get_features(1, 2);
        r.w32(SQ0_TAIL, 2);
        assert!(
            wait_fd(irqfd, Duration::from_secs(10)),
            "{fabric:?}: no intx assertion"
        );
        irqfd.read().unwrap();
        let t0 = Instant::now();
        while r.posted() < 2 && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(r.posted(), 2, "{fabric:?}");
        // The guest handles one completion, then EOIs: KVM lowers the line and signals the
        // resample eventfd. Until then nothing re-asserts (the level never changed).
        r.w32(CQ0_HEAD, 1);
        assert!(
            !wait_fd(irqfd, Duration::from_millis(200)),
            "{fabric:?}: asserted again without a resample"
        );
        resample.write(1).unwrap();
        assert!(
            wait_fd(irqfd, Duration::from_secs(10)),
            "{fabric:?}: the pending completion was not signalled after the resample"
        );
        irqfd.read().unwrap();
        // Both handled: the resample finds nothing pending.
        r.w32(CQ0_HEAD, 2);
        resample.write(1).unwrap();
        assert!(
            !wait_fd(irqfd, Duration::from_millis(200)),
            "{fabric:?}: asserted with an empty completion queue"
        );
        let _ = &r.client;
    }
}

// ---- teardown ------------------------------------------------------------------------------

/// The link's event thread blocks without a timer: an idle link never wakes it, and dropping
/// the link wakes it exactly once and joins it (so `drop` does not wait for any polling
/// interval; the elapsed time is printed for the record, not asserted).
#[test]
fn dropping_the_link_wakes_its_idle_event_thread_once() {
    for fabric in [FabricKind::Shm, FabricKind::Tcp] {
        let backend =
            Arc::new(EmulatedBackend::dmatest("rpci-drop", NotifyMode::Interrupt).unwrap());
        let (_dir, cfg, _lender) = start_lender(fabric, backend);
        let client = Arc::new(LenderClient::connect(&cfg, "vmm", "lender", TOKEN, "test").unwrap());
        let lease = client.borrow(DEV, "vm0").unwrap();
        let link = LendingLink::new(client, lease, LendingLinkOptions::default()).unwrap();
        let sink = link.event_sink();
        // Idle for a while: a polling thread would have woken several times by now.
        std::thread::sleep(Duration::from_millis(350));
        assert_eq!(
            sink.event_thread_wakeups(),
            0,
            "{fabric:?}: woken while idle"
        );
        // The link holds the only client: dropping it returns the lease and ends the session.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            drop(link);
            tx.send(t0.elapsed()).unwrap();
        });
        let took = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("dropping the link did not return");
        eprintln!("{fabric:?}: LendingLink drop took {took:?}");
        assert_eq!(
            sink.event_thread_wakeups(),
            1,
            "{fabric:?}: the drop's wake-up, and nothing else, ended the event thread"
        );
    }
}

// ---- lease events ----------------------------------------------------------------------------

#[derive(Default)]
struct LostHook(Mutex<Vec<String>>);

impl remote_pci::LinkEventHook for LostHook {
    fn lease_lost(&self, why: &str) {
        self.0.lock().unwrap().push(why.to_string());
    }
    fn iommu_fault(&self, _: &remote_pci::IommuFaultReport) {}
}

/// A lender that stops sends DeviceGone, then the link goes down: the hook hears of the loss
/// once, with the lender's reason, on both fabrics.
#[test]
fn stopping_lender_reports_device_gone_once() {
    for fabric in [FabricKind::Shm, FabricKind::Tcp] {
        let backend =
            Arc::new(EmulatedBackend::dmatest("rpci-gone", NotifyMode::Interrupt).unwrap());
        let (_dir, cfg, lender) = start_lender(fabric, backend);
        let client = Arc::new(LenderClient::connect(&cfg, "vmm", "lender", TOKEN, "test").unwrap());
        let lease = client.borrow(DEV, "vm0").unwrap();
        let link = LendingLink::new(client, lease, LendingLinkOptions::default()).unwrap();
        let hook = Arc::new(LostHook::default());
        link.set_event_hook(hook.clone());
        drop(lender);
        let t0 = Instant::now();
        while hook.0.lock().unwrap().is_empty() && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(2));
        }
        std::thread::sleep(Duration::from_millis(200));
        let lost = hook.0.lock().unwrap().clone();
        assert_eq!(lost.len(), 1, "{fabric:?}: {lost:?}");
        assert!(
            lost[0].contains("device gone") && lost[0].contains("shutting down"),
            "{fabric:?}: {lost:?}"
        );
        assert!(matches!(link.lease_state(), LeaseState::Lost(_)));
    }
}

// ---- one session per lender ----------------------------------------------------------------

/// Mappings of the session test's guest RAM memfd in this process: the test's own one
/// plus the in-process lender's mappings of the borrower's window.
fn guest_ram_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("/memfd:shared-session-ram "))
        .count()
}

fn wait_mappings(n: usize) {
    let t0 = Instant::now();
    while guest_ram_mappings() != n && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        guest_ram_mappings(),
        n,
        "guest ram mappings in this process"
    );
}

/// Two dmatests of one lender over one session: guest RAM is exported once and the lender
/// maps it once, both devices DMA through it; removing one keeps the export for the other;
/// removing the last revokes it; the session closes with its last link. Then the lender
/// stops: both leases of a new pair hear of it, once each.
#[test]
fn two_leases_of_one_lender_share_one_session_and_one_ram_export() {
    let (_dir, cfg) = shm_cluster();
    let backend = |name: &str| -> Arc<dyn DeviceBackend> {
        Arc::new(EmulatedBackend::dmatest(name, NotifyMode::Interrupt).unwrap())
    };
    let inv = Arc::new(
        Inventory::new(vec![
            ("0000:00:0a.0".to_string(), backend("share-a")),
            ("0000:00:0b.0".to_string(), backend("share-b")),
        ])
        .unwrap(),
    );
    let listener = SocketFabric::from_cluster(&cfg, "lender")
        .unwrap()
        .listen()
        .unwrap();
    let lender = BackgroundLender::start(Lender::new(inv, "lender", TOKEN), listener).unwrap();

    let (ram, host) = guest_ram_named(c"shared-session-ram");
    let vm: Arc<dyn VmOps> = Arc::new(Vm {
        ram,
        host,
        slots: Arc::default(),
        ioevents: Arc::default(),
    });
    assert_eq!(guest_ram_mappings(), 1, "the test's own mapping only");
    let irqs = Irqs::default();
    let alloc = Arc::new(Mutex::new(
        PciBarAllocators::x86_64(1 << 36, 1 << 36).unwrap(),
    ));
    let counters = Arc::new(SessionCounters::default());
    let client = LenderClient::connect(&cfg, "vmm", "lender", TOKEN, "test").unwrap();
    let session = LenderSession::new(
        client,
        SessionOptions {
            event_pump: true,
            counters: Some(counters.clone()),
        },
    )
    .unwrap();
    let device = |dev: &str, id: &str, devid: u32| {
        let lease = session.client().borrow(dev, "vm0").unwrap();
        let link = LendingLink::in_session(session.clone(), lease).unwrap();
        let mut d = RemotePciDevice::new(
            RemotePciDeviceParams::new(id, devid, None),
            Box::new(link),
            vm.clone(),
            &irqs,
        )
        .unwrap();
        let bars = d.allocate_bars(&alloc).unwrap();
        let bar0 = bars.iter().find(|b| b.idx == 0).unwrap().addr;
        (d, bar0)
    };
    let exports = || counters.ram_exports.load(Ordering::SeqCst);
    let (mut a, a_bar0) = device("0000:00:0a.0", "a", 0x20);
    let (mut b, b_bar0) = device("0000:00:0b.0", "b", 0x28);
    assert_eq!(session.leases(), 2);
    assert_eq!(counters.sessions.load(Ordering::SeqCst), 1);
    assert_eq!(exports(), 0, "nothing exported before bus mastering");

    let mem_bme = (command::MEMORY_SPACE | command::BUS_MASTER).to_le_bytes();
    a.write_config_register(1, 0, &mem_bme);
    b.write_config_register(1, 0, &mem_bme);
    assert!(a.status().dma_mapped && b.status().dma_mapped);
    assert_eq!(exports(), 1, "one export of guest ram for both leases");
    assert!(session.ram_exported());
    wait_mappings(2);

    // Both devices copy guest RAM to guest RAM through the one window.
    let pattern = |k: u32| -> Vec<u8> { (0..0x1000u32).map(|i| (i * k + 3) as u8).collect() };
    vm.write_guest(0x4000, &pattern(7)).unwrap();
    vm.write_guest(0x6000, &pattern(11)).unwrap();
    assert!(dmatest_copy(&mut a, a_bar0, 0x4000, 0x8000, 0x1000));
    assert!(dmatest_copy(&mut b, b_bar0, 0x6000, 0xa000, 0x1000));
    let mut out = vec![0u8; 0x1000];
    vm.read_guest(0x8000, &mut out).unwrap();
    assert_eq!(out, pattern(7));
    vm.read_guest(0xa000, &mut out).unwrap();
    assert_eq!(out, pattern(11));

    // A goes: B keeps the export and its DMA.
    drop(a);
    assert_eq!(session.leases(), 1);
    assert_eq!(exports(), 1);
    wait_mappings(2);
    vm.write_guest(0x4000, &pattern(5)).unwrap();
    assert!(dmatest_copy(&mut b, b_bar0, 0x4000, 0xc000, 0x1000));
    vm.read_guest(0xc000, &mut out).unwrap();
    assert_eq!(out, pattern(5));

    // The last bus master lets go: the export is revoked and the lender unmaps it.
    b.write_config_register(1, 0, &command::MEMORY_SPACE.to_le_bytes());
    assert_eq!(exports(), 0);
    assert!(!session.ram_exported());
    wait_mappings(1);
    drop(b);
    assert_eq!(session.leases(), 0);

    // A new pair; the lender stops: each lease is told once.
    let hooks: Vec<_> = ["0000:00:0a.0", "0000:00:0b.0"]
        .iter()
        .map(|dev| {
            let lease = session.client().borrow(dev, "vm0").unwrap();
            let link = LendingLink::in_session(session.clone(), lease).unwrap();
            let hook = Arc::new(LostHook::default());
            link.set_event_hook(hook.clone());
            (link, hook)
        })
        .collect();
    drop(lender);
    let t0 = Instant::now();
    while hooks.iter().any(|(_, h)| h.0.lock().unwrap().is_empty())
        && t0.elapsed() < Duration::from_secs(10)
    {
        std::thread::sleep(Duration::from_millis(2));
    }
    for (link, hook) in &hooks {
        let lost = hook.0.lock().unwrap().clone();
        assert_eq!(lost.len(), 1, "{lost:?}");
        assert!(matches!(link.lease_state(), LeaseState::Lost(_)));
    }
    let t0 = Instant::now();
    while session.is_usable() && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(
        !session.is_usable(),
        "a session whose link ended is not reused"
    );
    drop(hooks);
    drop(session);
    assert_eq!(counters.sessions.load(Ordering::SeqCst), 0);
}

// ---- shadow doorbells + ioeventfd -------------------------------------------------------

const SQ1_GPA: u64 = 0x3_0000;
const CQ1_GPA: u64 = 0x4_0000;
const SHADOW_GPA: u64 = 0x5_0000;
const EVENTIDX_GPA: u64 = 0x6_0000;
const SQ1_TAIL: u64 = 0x1008;
const CQ1_HEAD: u64 = 0x100c;

/// Over shm with the real lender: once the guest's Doorbell Buffer Config succeeds, the
/// lender's KICKS event makes the VMM register the I/O queue doorbells as ioeventfds wired
/// to the lender's own doorbell eventfd (a signal on it, as KVM makes on a guest store,
/// makes the controller fetch from the shadow tail with no VMM code running); the exact
/// CC.EN = 0 write's reply removes them before the store returns; removal leaves none.
#[test]
fn nvme_shadow_doorbells_become_ioeventfds_on_the_lenders_eventfd() {
    let mut r = NvmeRig::new(FabricKind::Shm, false);
    assert!(r.ioevents.lock().unwrap().is_empty());
    r.enable();
    // Create I/O CQ 1 + SQ 1 (16 entries, no interrupts), then Doorbell Buffer Config.
    let qs = 1 | (15 << 16);
    r.push(
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
    r.push(ASQ_GPA, 1, &sq);
    let dbbuf = [
        (0, 0x7c | (2 << 16)),
        (6, SHADOW_GPA as u32),
        (8, EVENTIDX_GPA as u32),
    ];
    r.push(ASQ_GPA, 2, &dbbuf);
    r.w32(SQ0_TAIL, 3);
    r.wait_posted(ACQ_GPA, 3);
    for i in 0..3 {
        assert_eq!(r.status_at(ACQ_GPA, i), 0, "admin command {i}");
    }
    r.w32(CQ0_HEAD, 3);
    // The KICKS event arrives asynchronously; the VMM applies it at a trapped store (here a
    // harmless INTMC write), as it would at a guest's next exact doorbell store.
    let t0 = Instant::now();
    while r.dev().kick_ioeventfds().1.is_empty() && t0.elapsed() < Duration::from_secs(10) {
        r.w32(INTMC, 0);
        std::thread::sleep(Duration::from_millis(5));
    }
    let (bar, offs) = r.dev().kick_ioeventfds();
    assert_eq!(bar, 0);
    assert!(
        offs.contains(&SQ1_TAIL) && offs.contains(&CQ1_HEAD),
        "{offs:?}"
    );
    assert!(
        !offs.contains(&SQ0_TAIL) && !offs.contains(&CQ0_HEAD),
        "admin stays exact"
    );
    let n = r.ioevents.lock().unwrap().len();
    assert_eq!(n, offs.len());
    assert_eq!(r.dev().counters().ioeventfds, n as u64);
    assert_eq!(r.dev().status().ioevents, n);
    // A guest I/O: Flush on SQ 1, its tail in the shadow buffer, then the ioeventfd's
    // eventfd signalled as KVM does on the guest's MMIO store.
    let before = r.dev().counters();
    r.push(SQ1_GPA, 0, &[(0, 7 << 16), (1, 1)]);
    r.vm.write_guest(SHADOW_GPA + 8, &1u32.to_le_bytes())
        .unwrap();
    let sq1 = r.bar0 + SQ1_TAIL;
    {
        let evs = r.ioevents.lock().unwrap();
        let (_, fd) = evs
            .iter()
            .find(|(a, _)| *a == IoEventAddress::Mmio(sq1))
            .expect("an ioeventfd at the sq 1 tail doorbell");
        fd.write(1).unwrap();
    }
    r.wait_posted(CQ1_GPA, 1);
    assert_eq!(r.status_at(CQ1_GPA, 0), 0, "flush completed");
    assert_eq!(r.dev().counters(), before, "no trapped access, no vmm kick");
    // SQ 1's EventIdx now asks for a doorbell at the next tail: the controller caught up.
    let mut ei = [0u8; 4];
    r.vm.read_guest(EVENTIDX_GPA + 8, &mut ei).unwrap();
    assert_eq!(u32::from_le_bytes(ei), 1);
    // Controller reset through the exact path: the reply ends shadowing; the ioeventfds are
    // gone when the store returns (before the guest could ring a plain doorbell).
    r.w32(CC, 0);
    assert!(r.dev().kick_ioeventfds().1.is_empty());
    assert!(r.ioevents.lock().unwrap().is_empty());
    assert_eq!(r.dev().counters().ioeventfds, 0);
    let evs = r.ioevents.clone();
    drop(r);
    assert!(evs.lock().unwrap().is_empty());
}

// ---- peer-to-peer DMA between two devices of one lender -----------------------------------

/// Reads a 32-bit dmatest register through the device.
fn dmatest_reg(dev: &mut RemotePciDevice, bar0: u64, reg: u64) -> u32 {
    let mut s = [0u8; 4];
    dev.read_bar(bar0, reg, &mut s);
    u32::from_le_bytes(s)
}

/// Programs one copy through the device's BAR (as the guest driver would), waits until
/// COMPLETED moves (bounded) and says whether it succeeded.
fn dmatest_copy(dev: &mut RemotePciDevice, bar0: u64, src: u64, dst: u64, len: u32) -> bool {
    dmatest_copy_flags(dev, bar0, 0, src, dst, len)
}

/// [`dmatest_copy`] with CMD flags (`CMD_SRC_BUF`: the source is the device's own buffer).
fn dmatest_copy_flags(
    dev: &mut RemotePciDevice,
    bar0: u64,
    flags: u32,
    src: u64,
    dst: u64,
    len: u32,
) -> bool {
    use emulated::dmatest::{REG_COMPLETED, STATUS_ERROR};
    let done = dmatest_reg(dev, bar0, REG_COMPLETED);
    dev.write_bar(bar0, REG_SRC, &src.to_le_bytes());
    dev.write_bar(bar0, REG_DST, &dst.to_le_bytes());
    dev.write_bar(bar0, REG_LEN, &len.to_le_bytes());
    dev.write_bar(bar0, REG_CMD, &(CMD_START | flags).to_le_bytes());
    let t0 = Instant::now();
    while dmatest_reg(dev, bar0, REG_COMPLETED) == done {
        assert!(t0.elapsed() < Duration::from_secs(10), "copy never ended");
        std::thread::sleep(Duration::from_millis(2));
    }
    let s = dmatest_reg(dev, bar0, REG_STATUS);
    assert_ne!(s & (STATUS_DONE | STATUS_ERROR), 0, "status {s:#x}");
    s & STATUS_ERROR == 0
}

/// Reads `len` bytes of a BAR through the device (direct window loads, 4 at a time).
fn bar_bytes(dev: &mut RemotePciDevice, base: u64, off: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    for i in (0..len as u64).step_by(4) {
        let mut b = [0u8; 4];
        dev.read_bar(base, off + i, &mut b);
        out.extend_from_slice(&b);
    }
    out
}

/// Two dmatests of one lender in one VM, each over its own link, sharing the VM's P2P
/// router: A's DMA to B's BAR lands in B's buffer; B's BAR moving, B's reset and B's removal
/// withdraw A's mapping of it before they take effect (a DMA to the old place faults on the
/// lender and ends with STATUS.error); a DMA to an address that is neither RAM nor a BAR is
/// refused the same way; nothing is left mapped at the end.
#[test]
fn p2p_between_two_dmatests_of_one_lender_follows_bars_reset_and_removal() {
    use emulated::dmatest::BUF_OFFSET;
    use lending::iommu::IommuDomain;
    let (_dir, cfg) = shm_cluster();
    let a_backend = Arc::new(EmulatedBackend::dmatest("p2p-a", NotifyMode::Interrupt).unwrap());
    let b_backend = Arc::new(EmulatedBackend::dmatest("p2p-b", NotifyMode::Interrupt).unwrap());
    let inv = Arc::new(
        Inventory::new(vec![
            ("0000:00:0a.0".to_string(), a_backend.clone() as _),
            ("0000:00:0b.0".to_string(), b_backend.clone() as _),
        ])
        .unwrap(),
    );
    let listener = SocketFabric::from_cluster(&cfg, "lender")
        .unwrap()
        .listen()
        .unwrap();
    let lender = Lender::new(inv, "lender", TOKEN);
    let _bg = BackgroundLender::start(Arc::clone(&lender), listener).unwrap();

    let (ram, host) = guest_ram();
    let slots = Arc::new(AtomicUsize::new(0));
    let vm: Arc<dyn VmOps> = Arc::new(Vm {
        ram,
        host,
        slots: slots.clone(),
        ioevents: Arc::default(),
    });
    let irqs = Irqs::default();
    let router = remote_pci::P2pRouter::new();
    let alloc = Arc::new(Mutex::new(
        PciBarAllocators::x86_64(1 << 36, 1 << 36).unwrap(),
    ));
    // Both leases over one session, as the VMM borrows from one lender.
    let client = LenderClient::connect(&cfg, "vmm", "lender", TOKEN, "test").unwrap();
    let session = LenderSession::new(client, SessionOptions::default()).unwrap();
    let device = |dev: &str, id: &str, devid: u32| {
        let lease = session.client().borrow(dev, "vm0").unwrap();
        let lease_id = lease.id();
        let link = LendingLink::in_session(session.clone(), lease).unwrap();
        let mut params = RemotePciDeviceParams::new(id, devid, None);
        params.p2p = Some(router.clone());
        let mut d = RemotePciDevice::new(params, Box::new(link), vm.clone(), &irqs).unwrap();
        let bars = d.allocate_bars(&alloc).unwrap();
        let bar0 = bars.iter().find(|b| b.idx == 0).unwrap().addr;
        (d, bar0, lease_id)
    };
    let (mut a, a_bar0, _) = device("0000:00:0a.0", "a", 0x20);
    let (mut b, b_bar0, b_lease) = device("0000:00:0b.0", "b", 0x28);
    let mem_bme = (command::MEMORY_SPACE | command::BUS_MASTER).to_le_bytes();

    // B decodes its BAR; A masters the bus: A's domain maps B's BAR0 at its guest address.
    b.write_config_register(1, 0, &command::MEMORY_SPACE.to_le_bytes());
    assert_eq!(router.live_mappings(), 0, "no bus master yet");
    a.write_config_register(1, 0, &mem_bme);
    assert!(a.status().dma_mapped);
    assert_eq!(router.live_mappings(), 1);
    assert_eq!(lender.p2p_live_into(b_lease), 1);

    let data: Vec<u8> = (0..0x2000u32).map(|i| (i * 7 + 1) as u8).collect();
    vm.write_guest(0x4000, &data).unwrap();
    assert!(dmatest_copy(
        &mut a,
        a_bar0,
        0x4000,
        b_bar0 + BUF_OFFSET,
        0x2000
    ));
    assert_eq!(bar_bytes(&mut b, b_bar0, BUF_OFFSET, 0x2000), data);

    // Neither RAM nor a BAR: refused, counted on the lender.
    let faults = a_backend.soft_iommu().fault_count();
    assert!(!dmatest_copy(&mut a, a_bar0, 0x4000, 0xdff0_0000, 0x100));
    assert_eq!(a_backend.soft_iommu().fault_count(), faults + 1);

    // The guest moves B's BAR0: A's mapping of the old address goes when the BAR register
    // is written, the new one comes when the VMM moved the bus range (move_bar).
    let new_bar0 = b_bar0 + 0x10_0000;
    let effects = b.write_config_register(4, 0, &(new_bar0 as u32).to_le_bytes());
    assert_eq!(effects.bar_moves.len(), 1);
    assert_eq!(router.live_mappings(), 0, "withdrawn before the move");
    b.move_bar(b_bar0, new_bar0).unwrap();
    assert_eq!(router.live_mappings(), 1);
    let data2: Vec<u8> = (0..0x1000u32).map(|i| (i * 13 + 5) as u8).collect();
    vm.write_guest(0x8000, &data2).unwrap();
    assert!(dmatest_copy(
        &mut a,
        a_bar0,
        0x8000,
        new_bar0 + BUF_OFFSET + 0x2000,
        0x1000
    ));
    assert_eq!(
        bar_bytes(&mut b, new_bar0, BUF_OFFSET + 0x2000, 0x1000),
        data2
    );
    let faults = a_backend.soft_iommu().fault_count();
    assert!(!dmatest_copy(
        &mut a,
        a_bar0,
        0x8000,
        b_bar0 + BUF_OFFSET,
        0x100
    ));
    assert_eq!(
        a_backend.soft_iommu().fault_count(),
        faults + 1,
        "old address"
    );

    // A move the VMM refuses (the bus range stays), then the register written back to where
    // the BAR is: withdrawn while pending, published again at the same place after each.
    let over = new_bar0 + 0x100_0000;
    let effects = b.write_config_register(4, 0, &(over as u32).to_le_bytes());
    assert_eq!(router.live_mappings(), 0);
    b.bar_move_refused(&effects.bar_moves[0]);
    assert_eq!(router.live_mappings(), 1);
    let effects = b.write_config_register(4, 0, &(new_bar0 as u32).to_le_bytes());
    assert_eq!(effects.bar_moves.len(), 1);
    assert_eq!(router.live_mappings(), 0);
    b.move_bar(over, new_bar0).unwrap();
    assert_eq!(router.live_mappings(), 1);
    assert!(dmatest_copy(
        &mut a,
        a_bar0,
        0x8000,
        new_bar0 + BUF_OFFSET + 0x2000,
        0x1000
    ));

    // B is reset (FLR / device reset): A's mapping is gone before the lender resets B, and
    // comes back when the guest turns decoding on again.
    b.reset().unwrap();
    assert_eq!(router.live_mappings(), 0);
    assert_eq!(lender.p2p_live_into(b_lease), 0);
    assert!(!dmatest_copy(
        &mut a,
        a_bar0,
        0x8000,
        new_bar0 + BUF_OFFSET,
        0x100
    ));
    b.write_config_register(1, 0, &command::MEMORY_SPACE.to_le_bytes());
    assert_eq!(router.live_mappings(), 1);
    assert!(dmatest_copy(
        &mut a,
        a_bar0,
        0x8000,
        new_bar0 + BUF_OFFSET,
        0x100
    ));

    // B masters the bus too: it maps A's BAR, and copies its own buffer (reset to zero, then
    // 0x100 bytes from A) into A's buffer, device to device.
    b.write_config_register(1, 0, &mem_bme);
    assert_eq!(router.live_mappings(), 2);
    let flags = emulated::dmatest::CMD_SRC_BUF;
    assert!(dmatest_copy_flags(
        &mut b,
        new_bar0,
        flags,
        0,
        a_bar0 + BUF_OFFSET,
        0x1000
    ));
    let mut want = data2[..0x100].to_vec();
    want.resize(0x1000, 0);
    assert_eq!(bar_bytes(&mut a, a_bar0, BUF_OFFSET, 0x1000), want);

    // A clears BME: its mapping of B goes, B's of A stays.
    a.write_config_register(1, 0, &command::MEMORY_SPACE.to_le_bytes());
    assert_eq!(router.live_mappings(), 1);
    a.write_config_register(1, 0, &mem_bme);
    assert_eq!(router.live_mappings(), 2);

    // B is removed: every mapping into it and of it goes before its lease is returned.
    drop(b);
    assert_eq!(router.live_mappings(), 0);
    assert_eq!(lender.p2p_live_into(b_lease), 0);
    assert!(!dmatest_copy(
        &mut a,
        a_bar0,
        0x8000,
        new_bar0 + BUF_OFFSET,
        0x100
    ));
    drop(a);
    assert_eq!(router.live_mappings(), 0);
    assert_eq!(slots.load(Ordering::SeqCst), 0);
    assert_eq!(router.map_failures(), 0);
}
