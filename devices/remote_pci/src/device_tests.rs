//! Behaviour of `RemotePciDevice` against fakes of the link, the VM and the interrupt
//! manager.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use pci::configuration::{
    cap_id, class, command, status, PciConfiguration, PciConfigurationParams, PciInterruptPin,
};
use pci::device::{BarAllocation, BarRequest, PciBarAllocators, PciDevice, SharedBarAllocators};
use pci::interrupt::InterruptSourceGroup;
use pci::msi::MsiCap;
use pci::msix::{MsixCap, MSIX_CTL_ENABLE};
use pci::vm_ops::{GuestRamRegion, IoEventAddress, VmOps};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::device::{RemotePciDevice, RemotePciDeviceParams, FORWARDED_COMMAND_BITS, LAZY_CHUNK};
use crate::link::{
    BarAccess, BarKind, DirectWindow, IrqKind, KickDoorbells, RemoteBar, RemoteDeviceInfo,
    RemoteIoEvent,
};
use crate::testing::{
    AnonMap, FakeIrqs, FakeLink, FakePinner, FakeVm, GroupCall, Journal, LinkCall, LinkState,
};

const RAM: u64 = 256 << 20;
const BAR0_SIZE: u64 = 0x4000;

struct Layout {
    pm: usize,
    pcie: usize,
    msix: usize,
    msi: usize,
}

fn snapshot() -> (Vec<u8>, Layout) {
    let mut c = PciConfiguration::new(&PciConfigurationParams {
        vendor_id: 0x1b36,
        device_id: 0x0010,
        class_code: class::MASS_STORAGE,
        subclass: class::NVM_SUBCLASS,
        prog_if: class::NVME_PROG_IF,
        extended: true,
        interrupt_pin: Some(PciInterruptPin::IntA),
        ..Default::default()
    });
    let pm = c
        .add_capability(&[cap_id::POWER_MANAGEMENT, 0, 3, 0, 0, 0, 0, 0])
        .unwrap();
    let mut pcie = vec![0u8; 0x3c];
    pcie[0] = cap_id::PCI_EXPRESS;
    pcie[2] = 2;
    let pcie = c.add_capability(&pcie).unwrap();
    // MSI-X table and PBA share the page at 0x1000 of BAR0.
    let msix = MsixCap::new(8, 0, 0x1000, 0, 0x1800)
        .unwrap()
        .add_to(&mut c)
        .unwrap();
    let msi = c
        .add_capability(&MsiCap::new(1, true, false).unwrap().to_bytes())
        .unwrap();
    c.add_extended_capability(1, 2, &[0u8; 0x44]).unwrap();
    (
        c.to_bytes(),
        Layout {
            pm,
            pcie,
            msix,
            msi,
        },
    )
}

struct Fx {
    dev: Option<RemotePciDevice>,
    link: Arc<Mutex<LinkState>>,
    dma_live: Arc<AtomicUsize>,
    vm: Arc<FakeVm>,
    irqs: Arc<FakeIrqs>,
    pinned: Arc<AtomicUsize>,
    journal: Journal,
    notify: Arc<EventFd>,
    ioevent: Arc<EventFd>,
    alloc: SharedBarAllocators,
    lay: Layout,
    bar0: AnonMap,
}

impl Drop for Fx {
    fn drop(&mut self) {
        // The device goes before the window memory it may point into.
        self.dev.take();
    }
}

struct Opts {
    write_notify: bool,
    /// Doorbell range of BAR0 (with `write_notify`).
    doorbells: Option<(u64, u64)>,
    /// Polled range of BAR0 (writable pages).
    writable: Option<(u64, u64)>,
    fail_pin: bool,
    intx: bool,
    /// BAR0's size (`BAR0_SIZE` by default).
    bar0_size: u64,
}

impl Default for Opts {
    fn default() -> Self {
        Self {
            write_notify: false,
            doorbells: None,
            writable: None,
            fail_pin: false,
            intx: true,
            bar0_size: BAR0_SIZE,
        }
    }
}

fn fixture(o: Opts) -> Fx {
    let (config, lay) = snapshot();
    let journal: Journal = Arc::default();
    let bar0 = AnonMap::new(o.bar0_size);
    let notify = Arc::new(EventFd::new(EFD_NONBLOCK).unwrap());
    let ioevent = Arc::new(EventFd::new(EFD_NONBLOCK).unwrap());
    // SAFETY: `bar0` outlives the device (Fx drops the device first).
    let mut win =
        unsafe { DirectWindow::new(bar0.addr, bar0.len, o.write_notify.then(|| notify.clone())) };
    if let Some((off, len)) = o.doorbells {
        win = win.with_doorbells(off, len);
    }
    if let Some((off, len)) = o.writable {
        win = win.with_writable(off, len);
    }
    let info = RemoteDeviceInfo {
        id: "nvme0".into(),
        config,
        bars: vec![
            RemoteBar {
                index: 0,
                size: o.bar0_size,
                kind: BarKind::Mem64,
                prefetchable: false,
                access: BarAccess::Direct(win),
                ioevents: Vec::new(),
            },
            RemoteBar {
                index: 2,
                size: 0x1000,
                kind: BarKind::Mem32,
                prefetchable: false,
                access: BarAccess::Trapped,
                ioevents: vec![RemoteIoEvent {
                    offset: 0x100,
                    datamatch: None,
                    fd: ioevent.clone(),
                }],
            },
            RemoteBar {
                index: 3,
                size: 0x20,
                kind: BarKind::Io,
                prefetchable: false,
                access: BarAccess::Trapped,
                ioevents: Vec::new(),
            },
        ],
        msix: None,
    };
    let link = FakeLink::new(info, journal.clone());
    let link_state = link.state.clone();
    let dma_live = link.dma_live.clone();
    let vm = Arc::new(FakeVm::new(
        vec![
            GuestRamRegion {
                gpa: 0,
                size: RAM / 2,
                host_addr: 0x7f00_0000_0000,
                file: None,
            },
            GuestRamRegion {
                gpa: 1 << 32,
                size: RAM / 2,
                host_addr: 0x7f10_0000_0000,
                file: None,
            },
        ],
        journal.clone(),
    ));
    let irqs = Arc::new(FakeIrqs::new(true, false));
    let pinner = Arc::new(FakePinner {
        fail: o.fail_pin,
        journal: journal.clone(),
        ..Default::default()
    });
    let pinned = pinner.live_bytes.clone();
    let mut params = RemotePciDeviceParams::new("rd0", 0x18, o.intx.then_some(5));
    params.pinner = pinner;
    let vm_ops: Arc<dyn VmOps> = vm.clone();
    let mut dev = RemotePciDevice::new(params, Box::new(link), vm_ops, irqs.as_ref()).unwrap();
    let alloc = Arc::new(Mutex::new(
        PciBarAllocators::x86_64(0x0010_0000_0000, 1 << 36).unwrap(),
    ));
    dev.allocate_bars(&alloc).unwrap();
    Fx {
        dev: Some(dev),
        link: link_state,
        dma_live,
        vm,
        irqs,
        pinned,
        journal,
        notify,
        ioevent,
        alloc,
        lay,
        bar0,
    }
}

impl Fx {
    fn dev(&mut self) -> &mut RemotePciDevice {
        self.dev.as_mut().unwrap()
    }

    fn write(&mut self, abs: usize, data: &[u8]) -> pci::ConfigWriteEffects {
        self.dev()
            .write_config_register(abs / 4, (abs % 4) as u64, data)
    }

    fn read32(&mut self, abs: usize) -> u32 {
        self.dev().read_config_register(abs / 4)
    }

    fn read16(&mut self, abs: usize) -> u16 {
        (self.read32(abs & !3) >> ((abs % 4) * 8)) as u16
    }

    fn calls(&self) -> Vec<LinkCall> {
        std::mem::take(&mut self.link.lock().unwrap().calls)
    }

    fn bar_addr(&mut self, idx: usize) -> u64 {
        self.dev().configuration().bar(idx).unwrap().addr
    }

    fn cmd(&mut self, bits: u16) -> pci::ConfigWriteEffects {
        self.write(4, &bits.to_le_bytes())
    }
}

fn config_writes(calls: &[LinkCall]) -> Vec<(u16, Vec<u8>)> {
    calls
        .iter()
        .filter_map(|c| match c {
            LinkCall::ConfigWrite(o, d) => Some((*o, d.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn shadow_identity_and_bar_sizing() {
    let mut f = fixture(Opts::default());
    assert_eq!(f.read32(0), 0x0010_1b36);
    assert_eq!(f.read32(8) >> 8, 0x01_08_02);
    let bar0 = f.bar_addr(0);
    assert_eq!(bar0 % BAR0_SIZE, 0);
    assert!(
        bar0 >= 0x0010_0000_0000,
        "64-bit bar from the 64-bit window"
    );
    assert_eq!(f.read32(0x10) & 0xf, 0x4, "64-bit non-prefetchable");
    // Sizing BAR0 (both halves), then restoring it: no move, nothing forwarded.
    let lo = f.read32(0x10);
    let hi = f.read32(0x14);
    assert!(f.write(0x10, &u32::MAX.to_le_bytes()).is_empty());
    assert!(f.write(0x14, &u32::MAX.to_le_bytes()).is_empty());
    assert_eq!(f.read32(0x10), !(BAR0_SIZE as u32 - 1) | 0x4);
    assert_eq!(f.read32(0x14), u32::MAX);
    assert!(f.write(0x10, &lo.to_le_bytes()).is_empty());
    assert!(f.write(0x14, &hi.to_le_bytes()).is_empty());
    assert_eq!(f.bar_addr(0), bar0);
    // I/O BAR sizing.
    f.write(0x1c, &u32::MAX.to_le_bytes());
    assert_eq!(f.read32(0x1c), !0x1f | 0x1);
    // ROM reads 0 (no ROM), writes dropped.
    f.write(0x30, &u32::MAX.to_le_bytes());
    assert_eq!(f.read32(0x30), 0);
    assert!(
        config_writes(&f.calls()).is_empty(),
        "bar/rom never forwarded"
    );
    // Reads past a 4 KiB space are all-ones; a snapshot's BARs are not visible.
    assert_eq!(f.read32(0x1000), u32::MAX);
    // FLR is advertised.
    let devcap = f.read32(f.lay.pcie + 4);
    assert_ne!(devcap & (1 << 28), 0);
}

#[test]
fn command_filtered_and_status_merged_from_lender() {
    let mut f = fixture(Opts::default());
    f.calls();
    let fx = f.cmd(command::MEMORY_SPACE | command::INTX_DISABLE | command::SERR_ENABLE);
    assert_eq!(
        fx.command.unwrap().new,
        command::MEMORY_SPACE | command::INTX_DISABLE | command::SERR_ENABLE
    );
    let fwd = (command::INTX_DISABLE | command::SERR_ENABLE) & FORWARDED_COMMAND_BITS;
    assert_eq!(
        config_writes(&f.calls()),
        vec![(4, fwd.to_le_bytes().to_vec())]
    );
    // The lender's Interrupt Status and an error bit show through; the shadow's
    // Capabilities List stays.
    {
        let mut s = f.link.lock().unwrap();
        let st = status::INTERRUPT | status::DETECTED_PARITY_ERROR;
        s.config[6..8].copy_from_slice(&st.to_le_bytes());
    }
    let st = f.read16(6);
    assert_ne!(st & status::INTERRUPT, 0);
    assert_ne!(st & status::DETECTED_PARITY_ERROR, 0);
    assert_ne!(st & status::CAPABILITIES_LIST, 0);
    // Write-1-to-clear of Status is forwarded (only the RW1C bits).
    f.write(6, &0xffffu16.to_le_bytes());
    assert_eq!(
        config_writes(&f.calls()),
        vec![(6, status::RW1C.to_le_bytes().to_vec())]
    );
}

#[test]
fn capability_writes_forwarded_and_read_back() {
    let mut f = fixture(Opts::default());
    f.calls();
    let pm = f.lay.pm;
    // The "lender" lets only the low two bits of PMCSR change.
    {
        let mut s = f.link.lock().unwrap();
        s.writable[pm + 4] = 0x03;
        s.writable[pm + 5] = 0;
    }
    f.write(pm + 4, &0xffffu16.to_le_bytes());
    assert_eq!(
        config_writes(&f.calls()),
        vec![((pm + 4) as u16, vec![0xff, 0xff])]
    );
    assert_eq!(f.read16(pm + 4), 0x3, "shadow refreshed from the lender");
    // Extended capability space is forwarded too.
    f.write(0x104, &0x1234_5678u32.to_le_bytes());
    assert_eq!(f.read32(0x104), 0x1234_5678);
    assert_eq!(
        config_writes(&f.calls()),
        vec![(0x104, 0x1234_5678u32.to_le_bytes().to_vec())]
    );
    // Header registers other than Command/Status stay local.
    f.write(0x3c, &[11]);
    f.write(0x0c, &[0x10]);
    assert_eq!(f.read32(0x3c) & 0xff, 11);
    assert!(config_writes(&f.calls()).is_empty());
}

/// Live migration: interrupts waiting on masked vectors (a signal in the irqfd, a PBA bit)
/// are taken from the source device and set pending on the destination's, where unmasking
/// delivers them; deliverable vectors are left alone (KVM took their signals already).
#[test]
fn undelivered_msix_moves_to_another_device_and_is_delivered_on_unmask() {
    let program = |f: &mut Fx| {
        let msix = f.lay.msix;
        let bar0 = f.bar_addr(0);
        for v in 0..2u64 {
            f.dev()
                .write_bar(bar0, 0x1000 + 16 * v, &0xfee0_0000u64.to_le_bytes());
            f.dev()
                .write_bar(bar0, 0x1008 + 16 * v, &(0x41 + v as u32).to_le_bytes());
            f.dev()
                .write_bar(bar0, 0x100c + 16 * v, &0u32.to_le_bytes());
        }
        f.write(msix + 2, &MSIX_CTL_ENABLE.to_le_bytes());
        // The guest masks vector 1.
        f.dev().write_bar(bar0, 0x101c, &1u32.to_le_bytes());
        bar0
    };
    let mut src = fixture(Opts::default());
    program(&mut src);
    let group = src.irqs.group("msix").unwrap();
    // The lender signals vector 1 (masked: waits in its eventfd) and vector 0 (deliverable).
    src.link.lock().unwrap().irq_fds["msix"][1]
        .write(1)
        .unwrap();
    src.link.lock().unwrap().irq_fds["msix"][0]
        .write(1)
        .unwrap();
    assert_eq!(src.dev().take_undelivered_msix(), vec![1]);
    assert!(
        group.notifier(1).unwrap().read().is_err(),
        "signal consumed"
    );
    assert_eq!(group.notifier(0).unwrap().read().unwrap(), 1, "left to KVM");
    assert!(src.dev().take_undelivered_msix().is_empty());

    let mut dst = fixture(Opts::default());
    let bar0 = program(&mut dst);
    let dgroup = dst.irqs.group("msix").unwrap();
    dgroup.take();
    dst.dev().set_msix_pending(&[1]);
    let mut q = [0u8; 8];
    dst.dev().read_bar(bar0, 0x1800, &mut q);
    assert_eq!(
        u64::from_le_bytes(q),
        0b10,
        "pending in the PBA while masked"
    );
    assert!(!dgroup.take().contains(&GroupCall::Trigger(1)));
    // The guest unmasks it: delivered once.
    dst.dev().write_bar(bar0, 0x101c, &0u32.to_le_bytes());
    let calls = dgroup.take();
    assert_eq!(
        calls
            .iter()
            .filter(|c| **c == GroupCall::Trigger(1))
            .count(),
        1,
        "{calls:?}"
    );
}

#[test]
fn msix_emulated_locally_and_wired_to_lender() {
    let mut f = fixture(Opts::default());
    assert_eq!(f.dev().status().irq_mode, Some(IrqKind::Intx));
    f.calls();
    let msix = f.lay.msix;
    let group = f.irqs.group("msix").unwrap();
    // Program vector 0 through the table in BAR0 (trapped page).
    let bar0 = f.bar_addr(0);
    f.dev()
        .write_bar(bar0, 0x1000, &0xfee0_0000u64.to_le_bytes());
    f.dev().write_bar(bar0, 0x1008, &0x41u32.to_le_bytes());
    f.dev().write_bar(bar0, 0x100c, &0u32.to_le_bytes());
    let mut b = [0u8; 4];
    f.dev().read_bar(bar0, 0x1008, &mut b);
    assert_eq!(u32::from_le_bytes(b), 0x41);
    // Enable MSI-X with a 16-bit Message Control write.
    f.write(msix + 2, &MSIX_CTL_ENABLE.to_le_bytes());
    assert_ne!(f.read16(msix + 2) & MSIX_CTL_ENABLE, 0);
    assert_eq!(f.read16(msix + 2) & 0x7ff, 7, "table size stays read-only");
    let gc = group.take();
    assert_eq!(gc[0], GroupCall::Enable);
    assert!(matches!(gc[1], GroupCall::Update(0, _, false)));
    let calls = f.calls();
    assert!(config_writes(&calls).is_empty(), "msi-x never forwarded");
    assert_eq!(
        calls,
        vec![
            LinkCall::SetIrqs {
                kind: IrqKind::Intx,
                n: 0,
                resample: false
            },
            LinkCall::SetIrqs {
                kind: IrqKind::Msix,
                n: 8,
                resample: false
            },
        ]
    );
    // The lender got the group's own irqfds: a signal on its copy reaches the notifier.
    f.link.lock().unwrap().irq_fds["msix"][3].write(1).unwrap();
    assert_eq!(group.notifier(3).unwrap().read().unwrap(), 1);
    let st = f.dev().status();
    assert!(st.msix_enabled);
    assert_eq!(st.irq_mode, Some(IrqKind::Msix));
    // Mask vector 0: the PBA is honoured for interrupts that come through the VMM.
    f.dev().write_bar(bar0, 0x100c, &1u32.to_le_bytes());
    assert!(!f.dev().trigger_msix(0));
    let mut q = [0u8; 8];
    f.dev().read_bar(bar0, 0x1800, &mut q);
    assert_eq!(u64::from_le_bytes(q), 1);
    group.take();
    f.dev().write_bar(bar0, 0x100c, &0u32.to_le_bytes());
    assert_eq!(group.take().last(), Some(&GroupCall::Trigger(0)));
    // Disable: back to INTx.
    f.write(msix + 2, &0u16.to_le_bytes());
    assert_eq!(
        f.calls(),
        vec![
            LinkCall::SetIrqs {
                kind: IrqKind::Msix,
                n: 0,
                resample: false
            },
            LinkCall::SetIrqs {
                kind: IrqKind::Intx,
                n: 1,
                resample: true
            },
        ]
    );
}

#[test]
fn msi_emulated_locally() {
    let mut f = fixture(Opts {
        intx: false,
        ..Default::default()
    });
    assert_eq!(f.dev().status().irq_mode, None);
    f.calls();
    let msi = f.lay.msi;
    f.write(msi + 4, &0xfee0_0000u32.to_le_bytes());
    f.write(msi + 12, &0x30u16.to_le_bytes());
    f.write(msi + 2, &1u16.to_le_bytes());
    let calls = f.calls();
    assert!(config_writes(&calls).is_empty(), "msi never forwarded");
    assert_eq!(
        calls,
        vec![LinkCall::SetIrqs {
            kind: IrqKind::Msi,
            n: 1,
            resample: false
        }]
    );
    let g = f.irqs.group("msi").unwrap();
    assert!(g.take().contains(&GroupCall::Enable));
    assert!(f.dev().status().msi_enabled);
}

#[test]
fn bar_memslots_split_around_msix_pages_and_follow_moves() {
    let mut f = fixture(Opts::default());
    assert!(
        f.vm.slots().is_empty(),
        "nothing mapped before Memory Space Enable"
    );
    f.cmd(command::MEMORY_SPACE);
    let bar0 = f.bar_addr(0);
    let slots = f.vm.slots();
    assert_eq!(slots.len(), 2, "{slots:?}");
    assert_eq!((slots[0].gpa, slots[0].size), (bar0, 0x1000));
    assert_eq!(slots[0].host, f.bar0.addr);
    assert_eq!((slots[1].gpa, slots[1].size), (bar0 + 0x2000, 0x2000));
    assert_eq!(slots[1].host, f.bar0.addr + 0x2000);
    assert!(slots.iter().all(|s| !s.readonly));
    // ioeventfd of the trapped BAR2 at its guest address.
    let bar2 = f.bar_addr(2);
    assert_eq!(f.vm.ioevents(), vec![IoEventAddress::Mmio(bar2 + 0x100)]);
    assert_eq!(f.dev().status().memslots, 2);

    // Guest moves BAR0 (low half) while decoding: old slots go, new ones appear.
    let new = bar0 + 0x10_0000;
    let fx = f.write(0x10, &((new as u32) | 4).to_le_bytes());
    assert_eq!(fx.bar_moves.len(), 1);
    f.dev().move_bar(bar0, new).unwrap();
    let slots = f.vm.slots();
    assert_eq!(slots.len(), 2);
    assert_eq!(slots[0].gpa, new);
    assert_eq!(slots[1].gpa, new + 0x2000);
    // Move BAR2 with decoding off, then on.
    f.cmd(0);
    assert!(f.vm.slots().is_empty() && f.vm.ioevents().is_empty());
    let new2 = bar2 + 0x10_0000;
    f.write(0x18, &(new2 as u32).to_le_bytes());
    f.dev().move_bar(bar2, new2).unwrap();
    f.cmd(command::MEMORY_SPACE);
    assert_eq!(f.vm.ioevents(), vec![IoEventAddress::Mmio(new2 + 0x100)]);
    assert_eq!(f.vm.slots().len(), 2);
    let _ = &f.ioevent;
}

/// A move the VMM refused (over RAM, another BAR, the MSI-X page of another device...) maps
/// nothing at the new address: the BAR keeps its memslots and trapped accesses where it was
/// placed, counted; a later accepted move starts from there, and unplug frees the placed
/// range. Before, the write alone moved the memslots to wherever the guest pointed.
#[test]
fn refused_bar_moves_keep_the_bar_where_it_was() {
    let mut f = fixture(Opts::default());
    f.cmd(command::MEMORY_SPACE);
    let bar0 = f.bar_addr(0);
    let before = f.vm.slots();
    let over = 0x10_0000u64; // e.g. guest RAM
    let fx = f.write(0x10, &((over as u32) | 4).to_le_bytes());
    assert_eq!(fx.bar_moves.len(), 1);
    f.dev().bar_move_refused(&fx.bar_moves[0]);
    assert_eq!(f.vm.slots(), before, "memslots moved to a refused address");
    assert_eq!(f.dev().counters().bar_moves_refused, 1);
    // Trapped accesses still reach the BAR at its placed address.
    f.bar0.write_u32(0x1c, 0x1234_5678);
    let mut b = [0u8; 4];
    f.dev().read_bar(bar0, 0x1c, &mut b);
    assert_eq!(u32::from_le_bytes(b), 0x1234_5678);
    let mut b = [0u8; 4];
    f.dev().read_bar(over, 0x1c, &mut b);
    assert_eq!(
        u32::from_le_bytes(b),
        0xffff_ffff,
        "decodes at the refused address"
    );
    // Memory Space off and on again: mapped at the placed address, not the register's.
    f.cmd(0);
    f.cmd(command::MEMORY_SPACE);
    assert_eq!(f.vm.slots(), before);
    // An accepted move starts from the placed address.
    let new = bar0 + 0x10_0000;
    f.write(0x10, &((new as u32) | 4).to_le_bytes());
    f.dev().move_bar(over, new).unwrap();
    let slots = f.vm.slots();
    assert_eq!(slots[0].gpa, new, "{slots:?}");
}

#[test]
fn write_notify_bar_is_readonly_and_trapped_writes_notify() {
    let mut f = fixture(Opts {
        write_notify: true,
        ..Default::default()
    });
    f.cmd(command::MEMORY_SPACE);
    assert!(f.vm.slots().iter().all(|s| s.readonly));
    let bar0 = f.bar_addr(0);
    // A guest store exits: stored into the shared register file, device notified.
    f.dev().write_bar(bar0, 0x14, &0x0046_0001u32.to_le_bytes());
    assert_eq!(f.bar0.read_u32(0x14), 0x0046_0001);
    assert_eq!(f.notify.read().unwrap(), 1);
    // Reads come from the shared memory.
    f.bar0.write_u32(0x1c, 1);
    let mut b = [0u8; 4];
    f.dev().read_bar(bar0, 0x1c, &mut b);
    assert_eq!(u32::from_le_bytes(b), 1);
    // Outside the window: all-ones, no notification.
    let mut b = [0u8; 4];
    f.dev().read_bar(bar0, BAR0_SIZE, &mut b);
    assert_eq!(b, [0xff; 4]);
}

#[test]
fn stores_outside_the_doorbell_range_take_the_exact_bar_write() {
    let mut f = fixture(Opts {
        write_notify: true,
        doorbells: Some((0x2000, 0x2000)),
        ..Default::default()
    });
    f.cmd(command::MEMORY_SPACE);
    assert!(f.vm.slots().iter().all(|s| s.readonly));
    let bar0 = f.bar_addr(0);
    f.calls();
    // Control registers (page 0): the lender's exact write path; neither the shared window
    // nor the notify eventfd is touched, so a store of the value already there is not lost.
    f.bar0.write_u32(0x10, 1);
    f.dev().write_bar(bar0, 0x10, &1u32.to_le_bytes());
    f.dev().write_bar(bar0, 0x14, &0x0046_0001u32.to_le_bytes());
    assert_eq!(f.bar0.read_u32(0x14), 0, "not stored locally");
    assert!(f.notify.read().is_err(), "not notified");
    // Straddling the start of the range: exact path too.
    f.dev().write_bar(bar0, 0x1ffc, &7u64.to_le_bytes());
    assert_eq!(
        f.calls(),
        vec![
            LinkCall::BarWrite(0, 0x10, 1u32.to_le_bytes().to_vec()),
            LinkCall::BarWrite(0, 0x14, 0x0046_0001u32.to_le_bytes().to_vec()),
            LinkCall::BarWrite(0, 0x1ffc, 7u64.to_le_bytes().to_vec()),
        ]
    );
    // Doorbells: stored into the window and notified, no lender round trip.
    f.dev().write_bar(bar0, 0x2008, &5u32.to_le_bytes());
    f.dev().write_bar(bar0, 0x3ffc, &6u32.to_le_bytes());
    assert_eq!(f.bar0.read_u32(0x2008), 5);
    assert_eq!(f.bar0.read_u32(0x3ffc), 6);
    assert_eq!(f.notify.read().unwrap(), 2);
    assert!(f.calls().is_empty());
    // Reads still come straight from the window.
    f.bar0.write_u32(0x1c, 1);
    let mut b = [0u8; 4];
    f.dev().read_bar(bar0, 0x1c, &mut b);
    assert_eq!(u32::from_le_bytes(b), 1);
    assert!(f.calls().is_empty());
}

#[test]
fn trapped_bars_forwarded_to_lender() {
    let mut f = fixture(Opts::default());
    f.calls();
    let bar2 = f.bar_addr(2);
    f.dev().write_bar(bar2, 0x40, &0xdead_beefu32.to_le_bytes());
    let mut b = [0u8; 4];
    f.dev().read_bar(bar2, 0x40, &mut b);
    assert_eq!(u32::from_le_bytes(b), 0xdead_beef);
    let io = f.bar_addr(3);
    f.dev().write_bar(io, 4, &[7]);
    assert_eq!(
        f.calls(),
        vec![
            LinkCall::BarWrite(2, 0x40, 0xdead_beefu32.to_le_bytes().to_vec()),
            LinkCall::BarRead(2, 0x40, 4),
            LinkCall::BarWrite(3, 4, vec![7]),
        ]
    );
    // Unknown base: all-ones.
    f.dev().read_bar(0x1234_0000, 0, &mut b);
    assert_eq!(b, [0xff; 4]);
}

#[test]
fn bus_master_pins_then_maps_and_unmaps_before_unpin() {
    let mut f = fixture(Opts::default());
    f.cmd(command::BUS_MASTER);
    assert_eq!(f.pinned.load(Ordering::SeqCst) as u64, RAM);
    assert_eq!(f.dma_live.load(Ordering::SeqCst), 1);
    let st = f.dev().status();
    assert!(st.dma_mapped && st.bus_master);
    assert_eq!(
        (st.dma_bytes, st.pinned_bytes, st.pinned_ranges),
        (RAM, RAM, 2)
    );
    assert_eq!(st.last_pin.unwrap().bytes, RAM);
    // Setting BME again (another bit changes) does not map twice.
    f.cmd(command::BUS_MASTER | command::MEMORY_SPACE);
    assert_eq!(f.dev().status().dma_maps, 1);
    f.cmd(command::MEMORY_SPACE);
    assert_eq!(f.pinned.load(Ordering::SeqCst), 0);
    assert_eq!(f.dma_live.load(Ordering::SeqCst), 0);
    let j = f.journal.lock().unwrap().clone();
    let j: Vec<&str> = j
        .iter()
        .map(String::as_str)
        .filter(|s| *s != "remove-slot")
        .collect();
    assert_eq!(
        j,
        vec!["pin", "pin", "map-dma", "unmap-dma", "unpin", "unpin"]
    );
}

#[test]
fn failed_dma_map_unpins_and_reports_master_abort() {
    let mut f = fixture(Opts::default());
    f.link.lock().unwrap().fail_map = true;
    f.cmd(command::BUS_MASTER);
    assert_eq!(f.pinned.load(Ordering::SeqCst), 0);
    let st = f.dev().status();
    assert!(!st.dma_mapped && st.bus_master);
    assert_eq!(st.dma_map_failures, 1);
    assert_ne!(f.read16(6) & status::RECEIVED_MASTER_ABORT, 0);
    // The guest clears the bit (RW1C) and retries once the lender recovers.
    f.write(6, &status::RECEIVED_MASTER_ABORT.to_le_bytes());
    assert_eq!(f.read16(6) & status::RECEIVED_MASTER_ABORT, 0);
    f.link.lock().unwrap().fail_map = false;
    f.cmd(0);
    f.cmd(command::BUS_MASTER);
    assert!(f.dev().status().dma_mapped);
}

#[test]
fn failed_pin_skips_the_map() {
    let mut f = fixture(Opts {
        fail_pin: true,
        ..Default::default()
    });
    f.calls();
    f.cmd(command::BUS_MASTER);
    assert!(!f.calls().iter().any(|c| matches!(c, LinkCall::MapDma(_))));
    assert_eq!(f.dev().status().dma_map_failures, 1);
    assert_ne!(f.read16(6) & status::RECEIVED_MASTER_ABORT, 0);
}

#[test]
fn guest_flr_resets_lender_dma_and_msix() {
    let mut f = fixture(Opts::default());
    let msix = f.lay.msix;
    f.cmd(command::MEMORY_SPACE | command::BUS_MASTER);
    f.write(msix + 2, &MSIX_CTL_ENABLE.to_le_bytes());
    assert!(f.dev().status().msix_enabled);
    f.calls();
    let devctl = f.lay.pcie + 8;
    let fx = f.write(devctl, &(0x8000u16 | 0x0010).to_le_bytes());
    assert_eq!(fx.command.unwrap().new, 0);
    let calls = f.calls();
    assert_eq!(
        config_writes(&calls),
        vec![(devctl as u16, 0x0010u16.to_le_bytes().to_vec())],
        "forwarded without the FLR bit"
    );
    assert!(calls.contains(&LinkCall::Reset));
    assert!(calls.contains(&LinkCall::SetIrqs {
        kind: IrqKind::Intx,
        n: 1,
        resample: true
    }));
    let st = f.dev().status();
    assert!(!st.dma_mapped && !st.msix_enabled && !st.bus_master && !st.memory_enabled);
    assert_eq!((st.memslots, st.pinned_bytes, st.resets), (0, 0, 1));
    assert_eq!(f.read16(msix + 2) & MSIX_CTL_ENABLE, 0);
    assert_eq!(f.dma_live.load(Ordering::SeqCst), 0);
    assert_eq!(f.read16(devctl) & 0x8000, 0, "Initiate FLR reads 0");
    // The BAR addresses survive; the guest restores Command and it all comes back.
    f.cmd(command::MEMORY_SPACE | command::BUS_MASTER);
    assert_eq!(f.vm.slots().len(), 2);
    assert!(f.dev().status().dma_mapped);
    // Device reset (VM reset) does the same.
    f.dev().reset().unwrap();
    let st = f.dev().status();
    assert_eq!((st.memslots, st.dma_mapped, st.resets), (0, false, 2));
}

#[test]
fn drop_releases_everything_after_moves_and_bme_cycles() {
    let mut f = fixture(Opts {
        write_notify: true,
        ..Default::default()
    });
    let msix = f.lay.msix;
    f.write(msix + 2, &MSIX_CTL_ENABLE.to_le_bytes());
    let mut bar0 = f.bar_addr(0);
    for i in 0..50u64 {
        f.cmd(command::MEMORY_SPACE | command::BUS_MASTER);
        assert_eq!(f.dma_live.load(Ordering::SeqCst), 1);
        if i % 10 == 0 {
            let new = bar0 + 0x10_0000;
            f.write(0x10, &((new as u32) | 4).to_le_bytes());
            f.dev().move_bar(bar0, new).unwrap();
            bar0 = new;
        }
        f.cmd(command::MEMORY_SPACE);
        assert_eq!(f.pinned.load(Ordering::SeqCst), 0);
    }
    assert_eq!(f.dev().status().dma_maps, 50);
    f.cmd(command::MEMORY_SPACE | command::BUS_MASTER);
    assert_eq!(f.vm.slots().len(), 2);
    assert_eq!(f.vm.state.lock().unwrap().slots_made, 2 * 6);
    assert_eq!(f.irqs.live_groups(), 3, "msi-x, msi and intx groups");
    f.calls();
    f.journal.lock().unwrap().clear();
    drop(f.dev.take());
    assert_eq!(f.dma_live.load(Ordering::SeqCst), 0);
    assert_eq!(f.pinned.load(Ordering::SeqCst), 0);
    assert!(f.vm.slots().is_empty());
    assert!(f.vm.ioevents().is_empty());
    assert_eq!(f.irqs.live_groups(), 0);
    let s = f.link.lock().unwrap();
    assert!(s.dropped, "lease returned");
    assert_eq!(
        s.calls,
        vec![LinkCall::SetIrqs {
            kind: IrqKind::Msix,
            n: 0,
            resample: false
        }]
    );
    drop(s);
    let j = f.journal.lock().unwrap().clone();
    assert_eq!(j.first().map(String::as_str), Some("unmap-dma"));
    assert_eq!(j.last().map(String::as_str), Some("return-lease"));
    let unpin = j.iter().position(|s| s == "unpin").unwrap();
    let slot = j.iter().position(|s| s == "remove-slot").unwrap();
    assert!(unpin < slot, "{j:?}");
}

#[test]
fn dropping_the_device_returns_its_bar_ranges_and_slots() {
    let mut f = fixture(Opts::default());
    f.cmd(command::MEMORY_SPACE);
    assert_eq!(f.vm.slots().len(), 2);
    let bars = f.dev().configuration().bars();
    assert!(!bars.is_empty());
    let alloc = f.alloc.clone();
    assert!(
        f.dev().allocate_bars(&alloc).is_err(),
        "bars are allocated once"
    );
    f.dev.take();
    assert!(f.vm.slots().is_empty());
    // Nobody called a free path: the device's guards gave the same ranges back.
    let again: Vec<BarAllocation> = bars
        .iter()
        .map(|b| {
            let req = BarRequest {
                idx: b.idx,
                size: b.size,
                region_type: b.region_type,
                prefetchable: b.prefetchable,
            };
            BarAllocation::allocate(&f.alloc, &req).unwrap()
        })
        .collect();
    let addrs: Vec<u64> = again.iter().map(BarAllocation::base).collect();
    assert_eq!(addrs, bars.iter().map(|b| b.addr).collect::<Vec<_>>());
}

#[test]
fn bad_bars_are_refused() {
    let (config, _) = snapshot();
    let mk = |bars: Vec<RemoteBar>| {
        let info = RemoteDeviceInfo {
            id: "x".into(),
            config: config.clone(),
            bars,
            msix: None,
        };
        let vm: Arc<dyn VmOps> = Arc::new(FakeVm::new(Vec::new(), Journal::default()));
        RemotePciDevice::new(
            RemotePciDeviceParams::new("rd", 0, None),
            Box::new(FakeLink::new(info, Journal::default())),
            vm,
            &FakeIrqs::new(true, false),
        )
        .err()
        .map(|e| e.to_string())
    };
    let bar = |index, size, kind| RemoteBar {
        index,
        size,
        kind,
        prefetchable: false,
        access: BarAccess::Trapped,
        ioevents: Vec::new(),
    };
    let e = mk(vec![bar(0, 0x3000, BarKind::Mem32)]).unwrap();
    assert!(e.contains("0x3000"), "{e}");
    assert!(mk(vec![bar(5, 0x1000, BarKind::Mem64)]).is_some());
    assert!(mk(vec![
        bar(0, 0x1000, BarKind::Mem64),
        bar(1, 0x1000, BarKind::Mem32)
    ])
    .is_some());
    assert!(mk(vec![bar(0, 0x1000, BarKind::Mem64)]).is_none());
    assert!(mk(Vec::new()).is_none());
    let info = RemoteDeviceInfo {
        id: "x".into(),
        config: vec![0; 100],
        bars: Vec::new(),
        msix: None,
    };
    let vm: Arc<dyn VmOps> = Arc::new(FakeVm::new(Vec::new(), Journal::default()));
    let e = RemotePciDevice::new(
        RemotePciDeviceParams::new("rd", 0, None),
        Box::new(FakeLink::new(info, Journal::default())),
        vm,
        &FakeIrqs::new(false, false),
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("100 bytes"), "{e}");
}

#[test]
fn real_pinning_of_guest_ram_on_bus_master() {
    use crate::pin::{locked_bytes, VMLCK_TEST_LOCK};
    let _g = VMLCK_TEST_LOCK.lock().unwrap();
    let ram = AnonMap::new(4 << 20);
    let (config, _) = snapshot();
    let info = RemoteDeviceInfo {
        id: "x".into(),
        config,
        bars: Vec::new(),
        msix: None,
    };
    let link = FakeLink::new(info, Journal::default());
    let dma_live = link.dma_live.clone();
    let vm: Arc<dyn VmOps> = Arc::new(FakeVm::new(
        vec![GuestRamRegion {
            gpa: 0,
            size: ram.len,
            host_addr: ram.addr,
            file: None,
        }],
        Journal::default(),
    ));
    let mut dev = RemotePciDevice::new(
        RemotePciDeviceParams::new("rd", 0, None),
        Box::new(link),
        vm,
        &FakeIrqs::new(true, false),
    )
    .unwrap();
    let before = locked_bytes();
    dev.write_config_register(1, 0, &command::BUS_MASTER.to_le_bytes());
    assert!(locked_bytes() >= before + ram.len);
    assert_eq!(dev.status().pinned_bytes, ram.len);
    assert_eq!(dma_live.load(Ordering::SeqCst), 1);
    dev.write_config_register(1, 0, &0u16.to_le_bytes());
    assert!(locked_bytes() <= before);
    drop(dev);
}

fn mmio(f: &mut Fx, off: u64) -> IoEventAddress {
    IoEventAddress::Mmio(f.bar_addr(0) + off)
}

#[test]
fn kick_only_doorbells_become_ioeventfds_until_the_reply_says_otherwise() {
    let mut f = fixture(Opts {
        write_notify: true,
        doorbells: Some((0x2000, 0x2000)),
        ..Default::default()
    });
    f.cmd(command::MEMORY_SPACE);
    let bar0 = f.bar_addr(0);
    // BAR2's static ioeventfd only.
    assert_eq!(f.vm.ioevents().len(), 1);
    assert_eq!(f.dev().counters().ioeventfds, 1, "BAR2's static one only");
    // Shadow doorbells switched on (an asynchronous event): 0x2008/0x200c are kicks; a
    // control register and an MSI-X page offset are refused by the VMM.
    f.link.lock().unwrap().kicks = KickDoorbells {
        generation: 1,
        bar: 0,
        offsets: vec![0x2008, 0x200c, 0x14, 0x1000],
    };
    // Picked up at the next trapped store, which itself still takes the exact path.
    f.dev().write_bar(bar0, 0x2008, &3u32.to_le_bytes());
    assert_eq!(f.bar0.read_u32(0x2008), 3);
    assert_eq!(f.notify.read().unwrap(), 1);
    let evs = f.vm.ioevents();
    let (a, b) = (mmio(&mut f, 0x2008), mmio(&mut f, 0x200c));
    assert!(evs.contains(&a) && evs.contains(&b), "{evs:?}");
    assert!(!evs.contains(&mmio(&mut f, 0x14)) && !evs.contains(&mmio(&mut f, 0x1000)));
    assert_eq!(evs.len(), 3);
    assert_eq!(f.dev().status().ioevents, 3);
    let c = f.dev().counters();
    assert_eq!((c.trapped_writes, c.kicks, c.ioeventfds), (1, 1, 3));
    assert_eq!(f.dev().kick_ioeventfds(), (0, vec![0x2008, 0x200c]));
    // CC.EN 1 -> 0 takes the exact path; its reply ends shadowing: the ioeventfds are gone
    // when the store returns to the guest.
    f.link.lock().unwrap().kicks_after_write = Some(KickDoorbells {
        generation: 2,
        bar: 0,
        offsets: vec![],
    });
    f.dev().write_bar(bar0, 0x14, &0u32.to_le_bytes());
    assert_eq!(f.vm.ioevents().len(), 1);
    assert_eq!(f.dev().counters().ioeventfds, 1);
    // A stale event (generation 1) arriving late changes nothing.
    f.link.lock().unwrap().offer_kicks(KickDoorbells {
        generation: 1,
        bar: 0,
        offsets: vec![0x2008],
    });
    f.dev().write_bar(bar0, 0x2008, &4u32.to_le_bytes());
    assert_eq!(f.vm.ioevents().len(), 1);
    // On again; the ioeventfds follow the BAR when it is disabled and enabled.
    f.link.lock().unwrap().offer_kicks(KickDoorbells {
        generation: 3,
        bar: 0,
        offsets: vec![0x2010],
    });
    f.dev().write_bar(bar0, 0x2010, &1u32.to_le_bytes());
    assert!(f.vm.ioevents().contains(&mmio(&mut f, 0x2010)));
    f.cmd(0);
    assert!(f.vm.ioevents().is_empty());
    assert_eq!(f.dev().status().ioevents, 0);
    f.cmd(command::MEMORY_SPACE);
    assert!(f.vm.ioevents().contains(&mmio(&mut f, 0x2010)));
    // FLR: the reset's reply ends shadowing.
    f.link.lock().unwrap().kicks_after_reset = Some(KickDoorbells {
        generation: 4,
        bar: 0,
        offsets: vec![],
    });
    let ctl = f.lay.pcie + 8;
    f.write(ctl, &0x8000u16.to_le_bytes());
    f.cmd(command::MEMORY_SPACE);
    assert_eq!(f.vm.ioevents().len(), 1, "only BAR2's static ioeventfd");
    f.link.lock().unwrap().offer_kicks(KickDoorbells {
        generation: 5,
        bar: 0,
        offsets: vec![0x2008],
    });
    f.dev().write_bar(bar0, 0x2008, &1u32.to_le_bytes());
    assert_eq!(f.vm.ioevents().len(), 2);
    // Removal: every ioeventfd unregistered.
    f.dev.take();
    assert!(f.vm.ioevents().is_empty());
}

#[test]
fn polled_doorbell_pages_are_mapped_writable() {
    let mut f = fixture(Opts {
        write_notify: true,
        doorbells: Some((0x2000, 0x2000)),
        writable: Some((0x2000, 0x2000)),
        ..Default::default()
    });
    f.cmd(command::MEMORY_SPACE);
    let bar0 = f.bar_addr(0);
    // Page 0 (control registers) read-only, page 1 (MSI-X) trapped, pages 2-3 writable.
    let slots: Vec<(u64, u64, bool)> =
        f.vm.slots()
            .iter()
            .filter(|s| s.gpa >= bar0 && s.gpa < bar0 + BAR0_SIZE)
            .map(|s| (s.gpa - bar0, s.size, s.readonly))
            .collect();
    assert_eq!(slots, vec![(0, 0x1000, true), (0x2000, 0x2000, false)]);
    // A store into the writable pages never reaches the VMM: no trapped access counted.
    f.bar0.write_u32(0x2008, 9);
    let c = f.dev().counters();
    assert_eq!((c.trapped_reads, c.trapped_writes, c.kicks), (0, 0, 0));
    // Control registers still take the exact path.
    f.calls();
    f.dev().write_bar(bar0, 0x14, &1u32.to_le_bytes());
    assert_eq!(
        f.calls(),
        vec![LinkCall::BarWrite(0, 0x14, 1u32.to_le_bytes().to_vec())]
    );
    assert_eq!(f.dev().counters().trapped_writes, 1);
    // Shadow doorbells on a polled BAR: its doorbells never exit, so no ioeventfds.
    f.link.lock().unwrap().kicks = KickDoorbells {
        generation: 1,
        bar: 0,
        offsets: vec![0x2008, 0x200c],
    };
    f.dev().write_bar(bar0, 0x14, &1u32.to_le_bytes());
    assert_eq!(f.dev().kick_ioeventfds().1, Vec::<u64>::new());
    assert_eq!(f.vm.ioevents().len(), 1, "BAR2's static one only");
}

/// A BAR of at least `LAZY_BAR_MIN` is mapped a chunk at a time, at the first access into
/// each chunk: nothing at Memory Space Enable, then the touched chunk's memslots (around the
/// MSI-X page, as a whole BAR's would be), each access served through the window meanwhile;
/// decoding off drops them all and the BAR starts lazy again.
#[test]
fn a_large_bar_is_mapped_a_chunk_at_a_time_at_first_touch() {
    let size = 4 * LAZY_CHUNK;
    let mut f = fixture(Opts {
        bar0_size: size,
        ..Opts::default()
    });
    f.cmd(command::MEMORY_SPACE);
    let bar0 = f.bar_addr(0);
    assert_eq!(bar0 % size, 0);
    assert!(f.vm.slots().is_empty(), "{:?}", f.vm.slots());
    assert_eq!(f.dev().status().memslots, 0);

    // A read in chunk 0: served through the window, then chunk 0 is mapped.
    f.bar0.write_u32(0x1c, 0x1234_5678);
    let mut b = [0u8; 4];
    f.dev().read_bar(bar0, 0x1c, &mut b);
    assert_eq!(u32::from_le_bytes(b), 0x1234_5678);
    let slots = f.vm.slots();
    assert_eq!(slots.len(), 2, "{slots:?}");
    assert_eq!((slots[0].gpa, slots[0].size), (bar0, 0x1000));
    assert_eq!(
        (slots[1].gpa, slots[1].size),
        (bar0 + 0x2000, LAZY_CHUNK - 0x2000)
    );
    assert_eq!(slots[1].host, f.bar0.addr + 0x2000);
    // Another access in the same chunk maps nothing more.
    f.dev().read_bar(bar0, LAZY_CHUNK - 4, &mut b);
    assert_eq!(f.vm.slots().len(), 2);

    // A write in the last chunk: it lands in the window, then that chunk is mapped whole.
    let off = size - LAZY_CHUNK + 0x40;
    f.dev().write_bar(bar0, off, &0xabcd_ef01u32.to_le_bytes());
    assert_eq!(f.bar0.read_u32(off), 0xabcd_ef01);
    let slots = f.vm.slots();
    assert_eq!(slots.len(), 3, "{slots:?}");
    assert_eq!(
        (slots[2].gpa, slots[2].size, slots[2].host),
        (
            bar0 + size - LAZY_CHUNK,
            LAZY_CHUNK,
            f.bar0.addr + size - LAZY_CHUNK
        )
    );
    assert_eq!(f.dev().status().memslots, 3);

    // Decoding off: every chunk goes; on again: lazy again.
    f.cmd(0);
    assert!(f.vm.slots().is_empty());
    f.cmd(command::MEMORY_SPACE);
    assert!(f.vm.slots().is_empty());
    f.dev().read_bar(bar0, 2 * LAZY_CHUNK, &mut b);
    assert_eq!(f.vm.slots().len(), 1);
}
