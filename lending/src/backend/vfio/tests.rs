use super::fake::{FakeSysfs, FakeVfioDevice};
use super::*;
use crate::backend::config::CMD_BUS_MASTER;
use crate::backend::filtered_config_write;
use crate::backend::test_log;
use crate::iommu::vfio::fake::FakeVfioContainer;
use crate::iommu::MmapBacking;
use std::os::fd::AsRawFd;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};
use vfio_bindings::bindings::vfio::VFIO_REGION_INFO_FLAG_READ;
use vfio_bindings::bindings::vfio::{
    VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX, VFIO_REGION_INFO_FLAG_MMAP,
};

pub(crate) const BDF: &str = "0000:81:00.0";

/// Config space of the fake NIC: BAR0 64-bit prefetchable memory, BAR2 32-bit memory,
/// MSI-X at 0x40 (8 vectors, table in BAR2 at 0, PBA in BAR2 at 0x800) → PCI Express at
/// 0x60. With `ext`, 4 KiB with the extended chain of
/// [`crate::backend::config::extended::tests::ext_chain`] (AER, ACS, SR-IOV, ATS, PRI,
/// PASID, resizable BAR and an unknown one).
pub(crate) fn nic_config(ext: bool) -> Vec<u8> {
    let mut cfg = vec![0u8; if ext { 4096 } else { 256 }];
    cfg[0..4].copy_from_slice(&[0x86, 0x80, 0x3e, 0x15]);
    cfg[6] = 0x10;
    cfg[0x10..0x14].copy_from_slice(&0x0000_000cu32.to_le_bytes()); // 64-bit prefetch
    cfg[0x18..0x1c].copy_from_slice(&0u32.to_le_bytes()); // BAR2 32-bit
    cfg[0x34] = 0x40;
    cfg[0x40] = 0x11; // MSI-X
    cfg[0x41] = 0x60;
    cfg[0x42..0x44].copy_from_slice(&7u16.to_le_bytes()); // 8 vectors
    cfg[0x44..0x48].copy_from_slice(&2u32.to_le_bytes()); // table in BAR2 @0
    cfg[0x48..0x4c].copy_from_slice(&(0x800u32 | 2).to_le_bytes());
    cfg[0x60] = 0x10; // PCI Express, device control at 0x68
    cfg[0x61] = 0;
    cfg[0x62] = 0x02;
    if ext {
        crate::backend::config::extended::tests::put_ext_chain(&mut cfg);
    }
    cfg
}

/// The fake NIC over `cfg`; BAR2 (MSI-X) is mmap-able per VFIO when `bar2_mmap`.
pub(crate) fn nic_with(cfg: Vec<u8>, bar2_mmap: bool) -> FakeVfioDevice {
    let rw = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;
    let cfg_size = cfg.len() as u64;
    FakeVfioDevice::new(
        vec![
            (
                VFIO_PCI_CONFIG_REGION_INDEX,
                RegionInfo {
                    size: cfg_size,
                    offset: 7 << 40,
                    flags: rw,
                },
                cfg,
            ),
            (
                0,
                RegionInfo {
                    size: 0x4000,
                    offset: 0,
                    flags: rw | VFIO_REGION_INFO_FLAG_MMAP,
                },
                vec![0; 0x4000],
            ),
            (
                2,
                RegionInfo {
                    size: 0x1000,
                    offset: 2 << 40,
                    flags: if bar2_mmap {
                        rw | VFIO_REGION_INFO_FLAG_MMAP
                    } else {
                        rw
                    },
                },
                vec![0; 0x1000],
            ),
        ],
        &[(VFIO_PCI_INTX_IRQ_INDEX, 1), (VFIO_PCI_MSIX_IRQ_INDEX, 8)],
    )
    .unwrap()
}

fn nic_like() -> FakeVfioDevice {
    nic_with(nic_config(false), false)
}

/// A backend over `dev` whose sysfs root is `sysfs`.
pub(crate) fn backend_with(
    dev: FakeVfioDevice,
    sysfs: &FakeSysfs,
) -> (VfioBackend<FakeVfioDevice>, Arc<FakeVfioContainer>) {
    let c = Arc::new(FakeVfioContainer::default());
    let dom = Arc::new(VfioDomain::new("fake", Arc::clone(&c)));
    (VfioBackend::with_parts(BDF, dev, dom, sysfs.root()), c)
}

/// The fake NIC with a fake sysfs that has BAR0's resource file.
fn backend() -> (
    VfioBackend<FakeVfioDevice>,
    Arc<FakeVfioContainer>,
    FakeSysfs,
) {
    let sysfs = FakeSysfs::new().unwrap();
    sysfs.add_resource(BDF, 0, 0x4000).unwrap();
    let (b, c) = backend_with(nic_like(), &sysfs);
    (b, c, sysfs)
}

pub(crate) fn stat(fd: BorrowedFd<'_>) -> libc::stat {
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: fstat writes into the properly sized buffer; the fd is borrowed live.
    assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) }, 0);
    // SAFETY: fstat succeeded.
    unsafe { st.assume_init() }
}

fn config_of(b: &VfioBackend<FakeVfioDevice>) -> Vec<u8> {
    b.dev.regions.lock().unwrap()[&VFIO_PCI_CONFIG_REGION_INDEX]
        .1
        .clone()
}

/// Peer-to-peer with VFIO on either side (no /dev/vfio here: the fake device and
/// container). As a *target*, a VFIO device offers its whole BAR through the sysfs
/// resource file: a peer's DMA through its IOMMU domain lands in the BAR. As a *source*,
/// the peer BAR is handed to the type1 IOMMU as the lender's mapping of it (host address
/// = that mapping, IOVA = the target's guest BAR address), and unmapped again when the
/// mapping is dropped or the target revokes it.
#[test]
fn p2p_with_a_vfio_device_as_target_and_as_source() {
    use crate::iommu::p2p::P2pBook;
    use crate::iommu::vfio::fake::FakeOp;
    use crate::iommu::{IommuDomain, SoftIommu};
    const IOVA: u64 = 0xe000_0000;
    let (target, _c, sysfs) = backend();
    let target: Arc<dyn DeviceBackend> = Arc::new(target);
    let book = Arc::new(P2pBook::default());
    let reg = book.register(2, "borrower/vm@local", Arc::clone(&target), false);
    let resource0 = sysfs.root().join(BDF).join("resource0");

    // An emulated source (software domain) writes into the VFIO target's BAR.
    let soft = Arc::new(SoftIommu::new("emulated-source"));
    let m = book
        .map(1, "borrower/vm@local", soft.clone(), 2, 0, IOVA, false)
        .unwrap();
    soft.dma_write(IOVA + 0x10, &[0xca, 0xfe, 0xf0, 0x0d])
        .unwrap();
    assert_eq!(
        &std::fs::read(&resource0).unwrap()[0x10..0x14],
        &[0xca, 0xfe, 0xf0, 0x0d]
    );
    assert!(
        soft.dma_write(IOVA + 0x4000, &[0]).is_err(),
        "nothing past the BAR"
    );
    // Another holder's lease cannot map it.
    assert!(book
        .map(3, "borrower/other@local", soft.clone(), 2, 0, IOVA, false)
        .is_err());
    drop(m);
    assert!(
        soft.dma_write(IOVA + 0x10, &[0]).is_err(),
        "unmapped with its value"
    );

    // A VFIO source: the container is given the lender's mapping of the peer BAR.
    let c = Arc::new(FakeVfioContainer::default());
    let vdom: Arc<dyn IommuDomain> = Arc::new(VfioDomain::new("vfio-source", Arc::clone(&c)));
    let m = book
        .map(1, "borrower/vm@local", Arc::clone(&vdom), 2, 0, IOVA, false)
        .unwrap();
    let (size, host) = c.live.lock().unwrap()[&IOVA];
    assert_eq!(size, 0x4000);
    // What the IOMMU would translate IOVA to is the BAR: a store through the host
    // address reaches the resource file, i.e. the device.
    // SAFETY: `host` is the live mapping of the 16 KiB BAR that `m` keeps mapped.
    unsafe { std::ptr::write_volatile((host as *mut u8).add(0x20), 0x5a) };
    assert_eq!(std::fs::read(&resource0).unwrap()[0x20], 0x5a);
    // The target's reset/return revokes it: the container is unmapped before that returns.
    assert_eq!(reg.revoke_all("target reset"), 1);
    assert_eq!(
        c.calls(),
        vec![FakeOp::Map(IOVA, 0x4000), FakeOp::Unmap(IOVA, 0x4000)]
    );
    assert!(c.live().is_empty());
    drop(m);
    assert_eq!(
        c.calls().len(),
        2,
        "a revoked mapping is not unmapped twice"
    );
}

/// Live migration on a VFIO device: the lender cannot see its DMA, so the dirty log
/// reports the whole window; the hand-over quiesce confirms the drain through the
/// device itself (Bus Master Enable cleared, Transactions Pending clear).
#[test]
fn migration_reports_the_whole_window_and_drains_through_the_device() {
    let (b, c, _sysfs) = backend();
    let dom = b.domain();
    let mem = Arc::new(crate::iommu::MmapBacking::anonymous(0x4000).unwrap());
    dom.map(0x10_0000, 0x4000, mem).unwrap();
    b.set_bus_master(true).unwrap();
    assert!(!dom.start_dirty_log());
    let d = dom.fetch_dirty(0x10_0000, 0x8000).unwrap();
    assert!(d.whole_window);
    assert_eq!(d.count(), 4, "every mapped page, none beyond");
    let n0 = b.dev.devsta_reads().len();
    let q = b.quiesce_handover(Duration::from_millis(10)).unwrap();
    assert_eq!(
        q,
        crate::backend::Drained {
            drained: true,
            ..Default::default()
        },
        "nothing pending: drained at the first poll, no interrupt held"
    );
    assert_eq!(
        b.dev.devsta_reads()[n0..],
        [false],
        "polled once, with bus master off"
    );
    assert_eq!(command(&b) & CMD_BUS_MASTER, 0);
    dom.stop_dirty_log();
    assert_eq!(c.live(), vec![(0x10_0000, 0x4000)]);
}

fn command(b: &VfioBackend<FakeVfioDevice>) -> u16 {
    let mut v = [0u8; 2];
    b.config_read(4, &mut v).unwrap();
    u16::from_le_bytes(v)
}

/// Transactions Pending set for the first polls: the quiesce waits until it clears and
/// confirms the drain; every poll came after Bus Master Enable was cleared.
#[test]
fn handover_drain_waits_for_transactions_pending_to_clear() {
    let (b, _, _sysfs) = backend();
    b.set_bus_master(true).unwrap();
    let before = command(&b);
    b.dev.hold_pending(fake::TransactionsPending::Reads(3));
    let n0 = b.dev.devsta_reads().len();
    let q = b.quiesce_handover(Duration::from_secs(5)).unwrap();
    assert!(q.drained, "{q:?}");
    assert_eq!(
        b.dev.devsta_reads()[n0..],
        [false; 4],
        "three polls saw it pending, the fourth clear, all with bus master off"
    );
    assert_eq!(
        b.dev.command_writes().last(),
        Some(&(before & !CMD_BUS_MASTER)),
        "only bus master cleared"
    );
    // The hand-over failed: the source keeps the device, bus master as it was.
    b.quiesce(false).unwrap();
    assert_eq!(command(&b), before);
    assert_ne!(before & CMD_BUS_MASTER, 0);
}

/// A function that never completes its requests: the drain is not confirmed, the
/// quiesce returns once its timeout is up (no hang), and resuming sets bus master again.
#[test]
fn handover_drain_is_not_confirmed_while_transactions_stay_pending() {
    let (b, _, _sysfs) = backend();
    // The backend turned decoding on when it opened the function.
    let w0 = b.dev.command_writes().len();
    b.set_bus_master(true).unwrap();
    b.dev.hold_pending(fake::TransactionsPending::Forever);
    let n0 = b.dev.devsta_reads().len();
    let t0 = Instant::now();
    let q = b.quiesce_handover(Duration::from_millis(50)).unwrap();
    let took = t0.elapsed();
    assert!(!q.drained, "{q:?}");
    assert!(
        took >= Duration::from_millis(50) && took < Duration::from_secs(2),
        "{took:?}"
    );
    let reads = b.dev.devsta_reads()[n0..].to_vec();
    assert!(reads.len() > 1, "polled until the timeout: {reads:?}");
    assert!(reads.iter().all(|bme| !bme), "{reads:?}");
    assert_eq!(command(&b) & CMD_BUS_MASTER, 0, "stays off until resumed");
    // A second attempt keeps what the first saved (bus master was on).
    let q = b.quiesce_handover(Duration::ZERO).unwrap();
    assert!(!q.drained);
    b.quiesce(false).unwrap();
    assert_ne!(command(&b) & CMD_BUS_MASTER, 0, "restored");
    let writes = b.dev.command_writes()[w0..].to_vec();
    assert_eq!(
        writes
            .iter()
            .map(|c| c & CMD_BUS_MASTER != 0)
            .collect::<Vec<_>>(),
        vec![true, false, true],
        "set, cleared once for the hand-over, restored: {writes:x?}"
    );
    // Resumed again without a hand-over: nothing written.
    b.quiesce(false).unwrap();
    assert_eq!(b.dev.command_writes().len(), w0 + 3);
}

/// Bus master stays as the lender last set it: off before the hand-over stays off after
/// it; a lender decision during the hand-over (the destination's accept sets it by its
/// windows, a lease end clears it) is not undone by a later resume.
#[test]
fn handover_resume_restores_only_what_the_handover_changed() {
    let (b, _, _sysfs) = backend();
    let w0 = b.dev.command_writes().len();
    assert_eq!(command(&b) & CMD_BUS_MASTER, 0);
    assert!(b.quiesce_handover(Duration::from_secs(1)).unwrap().drained);
    b.quiesce(false).unwrap();
    assert_eq!(command(&b) & CMD_BUS_MASTER, 0, "was off, stays off");
    assert_eq!(b.dev.command_writes().len(), w0, "nothing to write");

    b.set_bus_master(true).unwrap();
    assert!(b.quiesce_handover(Duration::from_secs(1)).unwrap().drained);
    // The destination took the lease with its windows mapped: bus master on; its resume
    // leaves that alone.
    b.set_bus_master(true).unwrap();
    b.quiesce(false).unwrap();
    assert_ne!(command(&b) & CMD_BUS_MASTER, 0);
    // Quiesced again, then the lease ended (bus master off by the lender): a late
    // resume does not turn it back on.
    assert!(b.quiesce_handover(Duration::from_secs(1)).unwrap().drained);
    b.set_bus_master(false).unwrap();
    b.quiesce(false).unwrap();
    assert_eq!(command(&b) & CMD_BUS_MASTER, 0);
    // Nor after a reset.
    b.set_bus_master(true).unwrap();
    assert!(b.quiesce_handover(Duration::from_secs(1)).unwrap().drained);
    b.reset().unwrap();
    let n = b.dev.command_writes().len();
    b.quiesce(false).unwrap();
    assert_eq!(
        b.dev.command_writes().len(),
        n,
        "nothing written after the reset"
    );
}

/// A function without a PCI Express capability: bus master cleared and one config read
/// are the drain (no Device Status to poll).
#[test]
fn handover_drain_of_a_conventional_pci_function() {
    let mut cfg = nic_config(false);
    cfg[0x41] = 0; // MSI-X is the last capability: no PCI Express.
    let sysfs = FakeSysfs::new().unwrap();
    let (b, _) = backend_with(nic_with(cfg, false), &sysfs);
    b.set_bus_master(true).unwrap();
    b.dev.hold_pending(fake::TransactionsPending::Forever);
    let q = b.quiesce_handover(Duration::from_secs(1)).unwrap();
    assert!(q.drained, "{q:?}");
    assert!(b.dev.devsta_reads().is_empty());
    assert_eq!(command(&b) & CMD_BUS_MASTER, 0);
    b.quiesce(false).unwrap();
    assert_ne!(command(&b) & CMD_BUS_MASTER, 0);
}

#[test]
fn describe_reads_bars_caps_and_irqs() {
    let (b, _, _sysfs) = backend();
    let info = b.describe(BDF);
    assert_eq!(info.bars.len(), 2);
    assert_eq!(info.bars[0].index, 0);
    assert!(info.bars[0].is_64bit && info.bars[0].prefetchable);
    assert!(info.bars[1].emulated_by_borrower);
    assert_eq!(info.irqs.msix, 8);
    let m = info.msix.unwrap();
    assert_eq!((m.vectors, m.table_bar, m.pba_offset), (8, 2, 0x800));
    assert!(b.bar_export(0).is_some());
    assert!(b.bar_export(2).is_none(), "not mmap-able");
}

/// What a shm borrower receives for a BAR is the BAR's resource file: sized exactly as the
/// BAR, not the device fd, no VFIO ioctl works on it, and writing it at config offsets
/// never reaches config space.
#[test]
fn bar_export_is_the_resource_file_never_the_device_fd() {
    let (b, _, sysfs) = backend();
    let path = sysfs.root().join(BDF).join("resource0");
    let cfg_before = config_of(&b);
    let x = b.bar_export(0).expect("bar 0 has a resource file");
    assert_eq!((x.offset, x.size), (0, 0x4000));
    let st = stat(x.fd);
    let file = std::fs::metadata(&path).unwrap();
    assert_eq!((st.st_dev, st.st_ino), (file.dev(), file.ino()));
    assert_eq!(st.st_size as u64, 0x4000, "exactly the bar's size");
    let dev = stat(b.dev.device_fd());
    assert_ne!(
        (st.st_dev, st.st_ino),
        (dev.st_dev, dev.st_ino),
        "the export is not the device fd"
    );
    // VFIO_DEVICE_GET_INFO = _IO(';', 100 + 7): not a VFIO device.
    const VFIO_DEVICE_GET_INFO: libc::Ioctl = 0x3b6b;
    let mut info = [16u32, 0, 0, 0];
    // SAFETY: an ioctl on a live fd with a 16-byte buffer the kernel may write.
    let r = unsafe { libc::ioctl(x.fd.as_raw_fd(), VFIO_DEVICE_GET_INFO, info.as_mut_ptr()) };
    assert_eq!(r, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::ENOTTY)
    );
    // pwrite at config offsets (command, BAR0, MSI-X control, the PCIe FLR bit) lands in
    // BAR memory, never in config space.
    for (off, data) in [
        (0x04i64, [0x07u8, 0x04, 0, 0]),
        (0x10, [0xff; 4]),
        (0x40, [0x11, 0, 0xff, 0xc0]),
        (0x68, [0, 0x80, 0, 0]),
    ] {
        // SAFETY: pwrite of a 4-byte buffer on a live fd.
        let n = unsafe { libc::pwrite(x.fd.as_raw_fd(), data.as_ptr().cast(), 4, off) };
        assert_eq!(n, 4);
        let mut back = [0u8; 4];
        // SAFETY: pread into a 4-byte buffer on a live fd.
        let n = unsafe { libc::pread(x.fd.as_raw_fd(), back.as_mut_ptr().cast(), 4, off) };
        assert_eq!((n, back), (4, data));
    }
    assert_eq!(config_of(&b), cfg_before, "config space untouched");
    // Nothing past the BAR: the file ends where the BAR does.
    let mut byte = [0u8; 1];
    // SAFETY: pread into a 1-byte buffer on a live fd.
    let n = unsafe { libc::pread(x.fd.as_raw_fd(), byte.as_mut_ptr().cast(), 1, 0x4000) };
    assert_eq!(n, 0);
}

/// Over a real shm link: the BAR's window is the resource file, mapped by the lender alone,
/// which serves the borrower's accesses (the export is not revocable, so its fd never goes
/// to a borrower: server::bars).
#[test]
fn shm_window_of_a_bar_is_the_resource_file_mediated_by_the_lender() {
    use ntb::{connect_addr, listen_addr, ControlAddr, LinkConfig, NodeId};
    let (b, _, sysfs) = backend();
    let dir = tempfile::tempdir().unwrap();
    let addr = ControlAddr::Unix(dir.path().join("l.sock"));
    let l = listen_addr(
        &addr,
        &NodeId::new("lender").unwrap(),
        &LinkConfig::default(),
    )
    .unwrap();
    let t = std::thread::spawn(move || {
        connect_addr(
            &addr,
            &NodeId::new("borrower").unwrap(),
            &LinkConfig::default(),
        )
        .unwrap()
    });
    let lender = l.accept(Some(Duration::from_secs(5))).unwrap();
    let borrower = t.join().unwrap();
    // The size check stays meaningful: a device fd (size 0) cannot back any window.
    let Err(e) = lender.export_window(b.dev.device_fd(), 0, 0x4000, "device-fd") else {
        panic!("a size-0 fd must be refused as a window");
    };
    assert!(
        matches!(e, ntb::FabricError::RegionTooSmall { have: 0, .. }),
        "{e}"
    );
    let x = b.bar_export(0).unwrap();
    assert!(
        !x.revocable,
        "a resource file cannot be taken back from a borrower"
    );
    let w = lender
        .export_window_mediated(x.fd, x.offset, x.size, "bar0")
        .unwrap();
    let info = borrower
        .wait_peer_window("bar0", Duration::from_secs(5))
        .unwrap();
    assert_eq!(info.size, 0x4000);
    let win = borrower.map_peer_window(info.id).unwrap();
    assert!(win.as_ptr().is_err(), "the borrower maps nothing");
    let cfg_before = config_of(&b);
    win.write_at(0x10, &[0xde, 0xad, 0xbe, 0xef]).unwrap();
    win.write_at(0x3ffc, &[1, 2, 3, 4]).unwrap();
    assert!(
        win.write_at(0x3ffe, &[0; 4]).is_err(),
        "nothing past the bar"
    );
    let file = std::fs::read(sysfs.root().join(BDF).join("resource0")).unwrap();
    assert_eq!(&file[0x10..0x14], &[0xde, 0xad, 0xbe, 0xef]);
    assert_eq!(&file[0x3ffc..], &[1, 2, 3, 4]);
    assert_eq!(config_of(&b), cfg_before);
    drop(w);
}

/// Every way a BAR can lack a usable resource file leaves it trapped, says why once, and
/// still works through BAR_READ/BAR_WRITE.
#[test]
fn bars_without_a_usable_resource_file_are_trapped_and_say_why() {
    test_log::init();
    let why = |b: &VfioBackend<FakeVfioDevice>, bar: u8| match b.bar_access(bar) {
        Some(BarAccess::Trapped(w)) => w.clone(),
        other => panic!("bar {bar}: {other:?}"),
    };
    // No resource file at all.
    let sysfs = FakeSysfs::new().unwrap();
    let (b, _) = backend_with(nic_like(), &sysfs);
    assert!(b.bar_export(0).is_none());
    let w = why(&b, 0);
    assert!(
        w.starts_with("cannot open ") && w.contains("resource0"),
        "{w}"
    );
    let logged = test_log::lines_with(&w);
    assert_eq!(logged.len(), 1, "logged once: {logged:?}");
    assert!(logged[0].contains("bar 0 is trapped"), "{}", logged[0]);
    b.bar_write(0, 0x20, &[9, 8, 7, 6]).unwrap();
    let mut v = [0u8; 4];
    b.bar_read(0, 0x20, &mut v).unwrap();
    assert_eq!(v, [9, 8, 7, 6], "trapped access reaches the device");
    // Smaller and larger than the BAR.
    for (size, says) in [(0x1000u64, "smaller than"), (0x8000, "larger than")] {
        let sysfs = FakeSysfs::new().unwrap();
        sysfs.add_resource(BDF, 0, size).unwrap();
        let (b, _) = backend_with(nic_like(), &sysfs);
        assert!(b.bar_export(0).is_none());
        assert!(why(&b, 0).contains(says), "{}", why(&b, 0));
    }
    // Not a file (a directory in its place), or a symlink to one of the right size.
    let sysfs = FakeSysfs::new().unwrap();
    std::fs::create_dir_all(sysfs.root().join(BDF).join("resource0")).unwrap();
    let (b, _) = backend_with(nic_like(), &sysfs);
    assert!(b.bar_export(0).is_none(), "{}", why(&b, 0));
    let sysfs = FakeSysfs::new().unwrap();
    let real = sysfs.add_resource("elsewhere", 0, 0x4000).unwrap();
    std::fs::create_dir_all(sysfs.root().join(BDF)).unwrap();
    std::os::unix::fs::symlink(&real, sysfs.root().join(BDF).join("resource0")).unwrap();
    let (b, _) = backend_with(nic_like(), &sysfs);
    assert!(why(&b, 0).starts_with("cannot open"), "{}", why(&b, 0));
    // The MSI-X BAR, even when VFIO would let it be mapped and its file exists.
    let sysfs = FakeSysfs::new().unwrap();
    sysfs.add_resource(BDF, 2, 0x1000).unwrap();
    let (b, _) = backend_with(nic_with(nic_config(false), true), &sysfs);
    assert!(b.bar_export(2).is_none());
    assert!(why(&b, 2).contains("msi-x"), "{}", why(&b, 2));
    // Not mappable per VFIO (BAR2 without the flag).
    let (b, _) = backend_with(nic_like(), &sysfs);
    assert!(why(&b, 2).contains("vfio does not allow"), "{}", why(&b, 2));
    // An I/O BAR.
    let mut cfg = nic_config(false);
    cfg[0x10..0x14].copy_from_slice(&0x0000_0001u32.to_le_bytes());
    let sysfs = FakeSysfs::new().unwrap();
    sysfs.add_resource(BDF, 0, 0x4000).unwrap();
    let (b, _) = backend_with(nic_with(cfg, false), &sysfs);
    assert!(why(&b, 0).contains("i/o bar"), "{}", why(&b, 0));
    // A name that is not a plain directory name.
    let c = Arc::new(FakeVfioContainer::default());
    let dom = Arc::new(VfioDomain::new("fake", c));
    let b = VfioBackend::with_parts("../x", nic_like(), dom, sysfs.root());
    assert!(why(&b, 0).contains("not a pci address"), "{}", why(&b, 0));
}

#[test]
fn config_filter_bar_io_reset_and_dma() {
    let (b, c, _sysfs) = backend();
    assert!(filtered_config_write(&b, 0x10, &[0; 4]).is_err());
    assert!(filtered_config_write(&b, 0x42, &[0; 2]).is_err());
    // The backend turned Memory Space on when it opened the function; a borrower's Command
    // write (lendvm forwards INTx Disable, never the decode bits) cannot turn it off.
    filtered_config_write(&b, 4, &[0x00, 0x04]).unwrap();
    let mut cmd = [0u8; 2];
    b.config_read(4, &mut cmd).unwrap();
    assert_eq!(cmd, [0x02, 0x04]);
    filtered_config_write(&b, 4, &[0x06, 0]).unwrap();
    b.config_read(4, &mut cmd).unwrap();
    assert_eq!(cmd, [0x02, 0]);
    b.bar_write(0, 0x10, &[1, 2, 3, 4]).unwrap();
    let mut v = [0u8; 4];
    b.bar_read(0, 0x10, &mut v).unwrap();
    assert_eq!(v, [1, 2, 3, 4]);
    // Like vfio-pci, the fake refuses BAR accesses while Memory Space is clear (found in
    // L1: the lender's BAR reads failed with EIO after a borrower cleared the bit), and the
    // backend returns the kernel's error instead of the buffer as it was (vfio-ioctls 0.10
    // only logs it).
    b.dev
        .region_write(VFIO_PCI_CONFIG_REGION_INDEX, 4, &[0, 0])
        .unwrap();
    let mut off = [0xeeu8; 4];
    let e = b.bar_read(0, 0x10, &mut off).unwrap_err();
    assert!(
        matches!(
            &e,
            BackendError::VfioOp(VfioOpError::Region { op: "read", index: 0, offset: 0x10, len: 4, source })
                if source.raw_os_error() == Some(libc::EIO)
        ),
        "{e:?}"
    );
    let e = b.bar_write(0, 0x10, &[9; 4]).unwrap_err();
    assert!(
        matches!(
            &e,
            BackendError::VfioOp(VfioOpError::Region { op: "write", .. })
        ),
        "{e:?}"
    );
    b.dev
        .region_write(VFIO_PCI_CONFIG_REGION_INDEX, 4, &[0x02, 0])
        .unwrap();
    b.bar_read(0, 0x10, &mut v).unwrap();
    assert_eq!(v, [1, 2, 3, 4], "the refused write changed nothing");
    assert!(b.bar_read(0, 0x3ffe, &mut v).is_err());
    assert!(b.bar_read(1, 0, &mut v).is_err());
    b.set_bus_master(true).unwrap();
    b.reset().unwrap();
    assert_eq!(*b.dev.resets.lock().unwrap(), 1);
    // As on Linux, the fake's reset leaves the command register as it was (the kernel
    // restores the saved header); the backend clears Bus Master Enable itself.
    assert_eq!(
        b.dev.command_writes().last().map(|c| c & CMD_BUS_MASTER),
        Some(0)
    );
    let win = Arc::new(MmapBacking::anonymous(0x2000).unwrap());
    b.domain().map(0x10_0000, 0x2000, win).unwrap();
    assert_eq!(c.live(), vec![(0x10_0000, 0x2000)]);
    b.domain().unmap_all();
    assert!(c.live().is_empty());
}

#[derive(Default)]
struct Count(AtomicU32);
impl IrqTrigger for Count {
    fn trigger(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn irqs_go_direct_or_through_relay() {
    let (b, _, _sysfs) = backend();
    let direct = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
    let counted = Arc::new(Count::default());
    b.set_irqs(
        IrqKind::Msix,
        vec![
            Some(direct.clone() as Arc<dyn IrqTrigger>),
            None,
            Some(counted.clone() as Arc<dyn IrqTrigger>),
        ],
    )
    .unwrap();
    let enabled = b.dev.enabled.lock().unwrap();
    let fds = &enabled[&VFIO_PCI_MSIX_IRQ_INDEX];
    assert_eq!(fds.len(), 3);
    // "Kernel" signals vector 0: lands on the borrower's eventfd itself.
    fds[0].write(1).unwrap();
    assert_eq!(direct.read().unwrap(), 1);
    // Vector 2 goes through the relay.
    fds[2].write(1).unwrap();
    drop(enabled);
    let t0 = Instant::now();
    while counted.0.load(Ordering::SeqCst) == 0 && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(counted.0.load(Ordering::SeqCst), 1);
    assert!(b.set_irqs(IrqKind::Msix, vec![None; 9]).is_err());
    b.clear_irqs();
    assert!(b.dev.enabled.lock().unwrap().is_empty());
}

/// A virtual function is an ordinary BDF to the VFIO backend. The VF addresses come
/// from the PF's SR-IOV capability (Intel-style First VF Offset 0x80, stride 2: VFs of
/// 81:00.0 at 81:10.0 and 81:10.2); each parses as a `--device` spec, names its own sysfs
/// directory (BAR0 lent directly through `<sysfs>/<VF BDF>/resource0`) and, having no
/// INTx (VFs have none), describes MSI-X only; its sysfs `physfn` link names its PF. The
/// PF and both VFs sit in one inventory; the VFs go to two borrowers, and the PF is then
/// refused to a third (resetting it would take the VFs away); returning one VF's lease
/// resets that VF only, and the PF is lent once no VF is, its VFs then refused.
#[test]
fn virtual_functions_are_plain_bdfs_in_sysfs_and_the_inventory() {
    use crate::inventory::{Inventory, InventoryError};
    use crate::protocol::DeviceState;
    use crate::sriov::Bdf;

    let pf: Bdf = BDF.parse().unwrap();
    let cap = emulated::sriov::SriovCap::enabled(2, 0x80, 2, 0x154c, vec![]).unwrap();
    let vfs: Vec<String> = pf
        .vfs(&cap)
        .unwrap()
        .iter()
        .map(|b| b.to_string())
        .collect();
    assert_eq!(vfs, ["0000:81:10.0", "0000:81:10.2"]);
    let sysfs = FakeSysfs::new().unwrap();
    sysfs.add_resource(BDF, 0, 0x4000).unwrap();
    let (pf_b, _) = backend_with(nic_with(nic_config(true), false), &sysfs);
    let pf_b = Arc::new(pf_b);
    let mut devices: Vec<(String, Arc<dyn DeviceBackend>)> =
        vec![(BDF.to_string(), pf_b.clone() as Arc<dyn DeviceBackend>)];
    let mut vf_bs = Vec::new();
    for vf in &vfs {
        let spec: crate::spec::DeviceSpec = format!("{vf}=vfio").parse().unwrap();
        assert_eq!(spec.function_ids(), std::slice::from_ref(vf));
        sysfs.add_resource(vf, 0, 0x4000).unwrap();
        // As the kernel does: `<VF>/physfn -> ../<PF>`.
        std::os::unix::fs::symlink(format!("../{BDF}"), sysfs.root().join(vf).join("physfn"))
            .unwrap();
        // vfio-pci shows a VF's vendor and device id (the VF's own header reads
        // ffff:ffff); it has MSI-X and no INTx.
        let mut cfg = nic_config(false);
        cfg[2..4].copy_from_slice(&0x154cu16.to_le_bytes());
        let mut dev = nic_with(cfg, false);
        dev.irq_counts.remove(&VFIO_PCI_INTX_IRQ_INDEX);
        let c = Arc::new(FakeVfioContainer::default());
        let dom = Arc::new(VfioDomain::new(format!("vfio {vf}"), c));
        let b = Arc::new(VfioBackend::with_parts(vf, dev, dom, sysfs.root()));
        assert_eq!(b.physical_function().as_deref(), Some(BDF), "{vf}");
        match b.bar_access(0) {
            Some(BarAccess::Direct { path, .. }) => {
                assert_eq!(path, &sysfs.root().join(vf).join("resource0"))
            }
            other => panic!("{vf}: bar 0 {other:?}"),
        }
        let info = b.describe(vf);
        assert_eq!((info.irqs.intx, info.irqs.msix), (0, 8), "{vf}");
        assert_eq!(&info.config[2..4], &[0x4c, 0x15]);
        devices.push((vf.clone(), b.clone() as Arc<dyn DeviceBackend>));
        vf_bs.push(b);
    }
    let inv = Inventory::new(devices).unwrap();
    let ids: Vec<String> = inv.list().into_iter().map(|d| d.id).collect();
    assert_eq!(ids, [BDF, "0000:81:10.0", "0000:81:10.2"]);
    let l1 = inv.acquire(&vfs[0], "node1", "vm-a").unwrap();
    let l2 = inv.acquire(&vfs[1], "node2", "vm-b").unwrap();
    assert_eq!(pf_b.physical_function(), None);
    let e = inv.acquire(BDF, "node4", "vm-c").err().unwrap();
    assert!(
        matches!(&e, InventoryError::Family { relative, .. } if *relative == vfs[0]),
        "{e:?}"
    );
    assert_eq!(inv.get(BDF).unwrap().state(), DeviceState::Available);
    assert_eq!(
        inv.acquire(&vfs[0], "node2", "vm-b").err(),
        Some(InventoryError::Busy {
            node: "node1".into(),
            vm: "vm-a".into()
        })
    );
    drop(l1);
    assert_eq!(*vf_bs[0].dev.resets.lock().unwrap(), 1);
    assert_eq!(*vf_bs[1].dev.resets.lock().unwrap(), 0, "vf 2 untouched");
    assert_eq!(*pf_b.dev.resets.lock().unwrap(), 0, "pf untouched");
    assert_eq!(inv.get(&vfs[0]).unwrap().state(), DeviceState::Available);
    assert!(matches!(
        inv.get(&vfs[1]).unwrap().state(),
        DeviceState::Lent { .. }
    ));
    drop(l2);
    assert_eq!(*pf_b.dev.resets.lock().unwrap(), 0, "pf untouched");
    let lp = inv.acquire(BDF, "node4", "vm-c").unwrap();
    let e = inv.acquire(&vfs[1], "node2", "vm-b").err().unwrap();
    assert!(
        e.to_string()
            .contains("its physical function 0000:81:00.0 is lent to node4/vm-c"),
        "{e}"
    );
    drop(lp);
    assert_eq!(*pf_b.dev.resets.lock().unwrap(), 1);
    inv.acquire(&vfs[1], "node2", "vm-b").unwrap();
}

/// A hardware PF is refused while its VFs are enabled, lent or not (its reset, which ends
/// every lease, would take them from whoever uses them), and `sriov_numvfs` is read at each
/// acquire: VFs enabled after the lender opened the PF (vfio-pci's `enable_sriov`) count.
#[test]
fn a_pf_is_refused_while_its_vfs_are_enabled_even_if_none_is_lent() {
    use crate::inventory::{Inventory, InventoryError};

    let sysfs = FakeSysfs::new().unwrap();
    sysfs.add_resource(BDF, 0, 0x4000).unwrap();
    let (pf_b, _) = backend_with(nic_with(nic_config(true), false), &sysfs);
    let pf_b = Arc::new(pf_b);
    let inv = Inventory::new(vec![(
        BDF.to_string(),
        pf_b.clone() as Arc<dyn DeviceBackend>,
    )])
    .unwrap();
    assert_eq!(
        pf_b.vfs_sharing_reset(),
        Ok(0),
        "no sriov_numvfs: no SR-IOV"
    );
    drop(inv.acquire(BDF, "node1", "vm-a").unwrap());
    let numvfs = sysfs.root().join(BDF).join("sriov_numvfs");
    std::fs::write(&numvfs, "2\n").unwrap();
    let e = inv.acquire(BDF, "node1", "vm-a").err().unwrap();
    assert_eq!(
        e,
        InventoryError::PfWithVfs {
            id: BDF.into(),
            vfs: 2
        }
    );
    assert!(
        e.to_string()
            .contains("SR-IOV physical function with 2 virtual function(s)"),
        "{e}"
    );
    assert_eq!(
        inv.get(BDF).unwrap().state(),
        crate::protocol::DeviceState::Available,
        "a refusal changes nothing"
    );
    // A count that cannot be read refuses the lease too (fails closed), naming the file.
    std::fs::write(&numvfs, "?\n").unwrap();
    let e = inv.acquire(BDF, "node1", "vm-a").err().unwrap();
    assert!(
        matches!(&e, InventoryError::SriovUnreadable { id, .. } if id == BDF),
        "{e:?}"
    );
    assert!(e.to_string().contains("sriov_numvfs"), "{e}");
    assert_eq!(
        inv.get(BDF).unwrap().state(),
        crate::protocol::DeviceState::Available
    );
    std::fs::write(&numvfs, "0\n").unwrap();
    drop(inv.acquire(BDF, "node1", "vm-a").unwrap());
}

/// Opening refuses a name that is no sysfs directory before any VFIO call, and a write to a
/// read-only BAR region is refused by name, the region untouched.
#[test]
fn bad_names_and_read_only_bars_are_refused_by_name() {
    for bad in ["", ".", "..", "../0000:81:00.0", "0000:81:00.0\0"] {
        match VfioBackend::open(bad) {
            Err(BackendError::Binding(BindingError::BadName { bdf })) => assert_eq!(bdf, bad),
            Err(e) => panic!("{bad:?}: {e}"),
            Ok(_) => panic!("{bad:?} was opened"),
        }
    }
    let sysfs = FakeSysfs::new().unwrap();
    let (b, _) = backend_with(nic_like(), &sysfs);
    b.dev.regions.lock().unwrap().get_mut(&0).unwrap().0.flags = VFIO_REGION_INFO_FLAG_READ;
    let e = b.bar_write(0, 0x10, &[1, 2, 3, 4]).unwrap_err();
    assert!(matches!(e, BackendError::ReadOnlyBar(0)), "{e:?}");
    assert_eq!(e.to_string(), "bar 0 is read-only");
    let mut v = [0xffu8; 4];
    b.bar_read(0, 0x10, &mut v).unwrap();
    assert_eq!(v, [0; 4]);
}
