//! `RemotePciDevice` over `LendingLink` against an in-process lender (shm fabric) lending a
//! `dmatest` device: BAR window, DMA map at IOVA = GPA of memfd guest RAM, MSI-X irqfd
//! handed to the lender, and the lease returned on drop.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use emulated::dmatest::{
    CMD_START, REG_CMD, REG_DST, REG_IRQ_VECTOR, REG_LEN, REG_SRC, REG_STATUS, STATUS_DONE,
};
use emulated::NotifyMode;
use lending::backend::emulated::EmulatedBackend;
use lending::inventory::Inventory;
use lending::server::{BackgroundLender, Lender};
use lending::LenderClient;
use ntb::{ClusterConfig, Fabric, SocketFabric};
use pci::configuration::command;
use pci::device::{PciBarAllocators, PciDevice};
use pci::interrupt::{
    InterruptError, InterruptIndex, InterruptManager, InterruptSourceGroup, MsiIrqSourceConfig,
};
use pci::vm_ops::{
    GuestRamRegion, IoEventAddress, IoEventDatamatch, IoEventGuard, MemslotGuard, VmOps, VmOpsError,
};
use remote_pci::lending_link::{LendingLink, LendingLinkOptions};
use remote_pci::{BarAccess, LeaseState, RemoteDeviceLink, RemotePciDevice, RemotePciDeviceParams};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const TOKEN: &str = "t0ken";
const DEV: &str = "0000:00:04.0";
const RAM: u64 = 1 << 20;

struct Vm {
    ram: Arc<std::fs::File>,
    host: u64,
    slots: Arc<AtomicUsize>,
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
        _fd: &EventFd,
        addr: IoEventAddress,
        dm: Option<IoEventDatamatch>,
    ) -> Result<IoEventGuard, VmOpsError> {
        Ok(IoEventGuard::new(addr, dm, || {}))
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
}

impl InterruptManager for Irqs {
    fn create_msi_group(&self, n: u32) -> Result<Arc<dyn InterruptSourceGroup>, InterruptError> {
        let g = Arc::new(Group {
            fds: (0..n)
                .map(|_| EventFd::new(EFD_NONBLOCK).unwrap())
                .collect(),
            calls: Mutex::default(),
        });
        self.groups.lock().unwrap().push(g.clone());
        Ok(g)
    }
    fn create_intx_group(
        &self,
        _irq: u32,
    ) -> Result<Arc<dyn InterruptSourceGroup>, InterruptError> {
        Err(InterruptError::Unsupported("no intx in this test"))
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

fn guest_ram() -> (Arc<std::fs::File>, u64) {
    // SAFETY: a fresh memfd we own.
    let fd = unsafe { libc::memfd_create(c"guest-ram".as_ptr(), 0) };
    assert!(fd >= 0);
    // SAFETY: fd is ours.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(RAM).unwrap();
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
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let src = format!(
        "version = 1\n\
         [[node]]\nname = \"lender\"\nfabric = \"shm\"\ncontrol = \"{d}/lender.sock\"\n\
         [[node]]\nname = \"vmm\"\nfabric = \"shm\"\ncontrol = \"{d}/vmm.sock\"\n"
    );
    let path = dir.path().join("cluster.toml");
    std::fs::write(&path, src).unwrap();
    let cfg = ClusterConfig::load(&path).unwrap();
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
    });
    let irqs = Irqs::default();
    let mut dev = RemotePciDevice::new(
        RemotePciDeviceParams::new("rd0", 0x20, None),
        Box::new(link),
        vm.clone(),
        &irqs,
    )
    .unwrap();
    let mut alloc = PciBarAllocators::x86_64(1 << 36, 1 << 36).unwrap();
    let bars = dev.allocate_bars(&mut alloc).unwrap();
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
