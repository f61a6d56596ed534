//! `LendingLink`'s lease events, lender counters and quiesce against the real `lenderd`
//! (child process, shm fabric), the link driven as the VMM drives it: doorbell stores go into
//! the lender's BAR window followed by a notify-eventfd write, control registers take the
//! exact BAR_WRITE, guest RAM is a sealed memfd mapped for DMA at IOVA = GPA, and MSI-X vectors
//! signal eventfds the lender holds. The guest's role is played by
//! `emulated::testing::NvmeDriver`.
//!
//! * N 4 KiB writes ⇒ the lender counts exactly the doorbell writes the driver made, at least
//!   N interrupts on the I/O vector (and exactly as many as reached its eventfd), N × 4 KiB of
//!   data read by DMA (+ one 64-byte SQE per command) and one 16-byte CQE written per command.
//! * A write whose data pointer is outside the DMA window ⇒ an IOMMU fault counted and
//!   reported to the link's hook.
//! * SIGKILL of lenderd ⇒ `lease_lost` on the hook, once, within a generous bound (the time
//!   is printed); a hook set after the loss is told at once.
//! * Quiesce: a doorbell written while quiesced is not processed (no DMA, no completion) until
//!   resume, in polling and in interrupt mode.
//!
//! Needs `target/<profile>/lenderd`: run `cargo build -p lending --bins` first (scripts/test.sh
//! builds every binary before the tests).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use emulated::nvme::spec::status;
use emulated::testing::{DataBuf, DriverConfig, GuestBar, GuestIrq, GuestRam, NvmeDriver};
use lending::testing::{lenderd_binary, Lenderd};
use lending::LenderClient;
use ntb::ClusterConfig;
use pci::vm_ops::GuestRamRegion;
use remote_pci::lending_link::{LendingLink, LendingLinkOptions};
use remote_pci::{
    BarAccess, DirectWindow, DmaMapping, IommuFaultReport, IrqKind, IrqTargets, LeaseState,
    LenderCounters, LinkEventHook, RemoteDeviceLink,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const TOKEN: &str = "lender-events-token-8f3a61c2d4b7e9051a6c";
const LENDER: &str = "node3";
const VMM: &str = "node1";
const NVME: &str = "0000:82:00.0";
const NVME_POLLING: &str = "0000:83:00.0";
const DMATEST: &str = "0000:84:00.0";
/// Guest RAM (all of it mapped for DMA at IOVA 0).
const RAM: u64 = 4 << 20;
/// The driver allocates from here.
const RAM_BASE: u64 = 1 << 20;
/// MSI-X vectors wired (admin on 0, the I/O queue on 1).
const VECTORS: usize = 2;
/// Bound on waiting for the lender's counters to catch up.
const SETTLE: Duration = Duration::from_secs(10);

// ---- lenderd ----------------------------------------------------------------------------

struct Lender {
    cfg: ClusterConfig,
    /// Killed before the directory goes.
    proc: Lenderd,
    /// Cluster file, disks, sockets and lenderd's log; removed last.
    _dir: tempfile::TempDir,
}

fn start_lenderd() -> Lender {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let node = |n: &str| {
        format!("[[node]]\nname = \"{n}\"\nfabric = \"shm\"\ncontrol = \"{d}/{n}.sock\"\n")
    };
    let path = dir.path().join("cluster.toml");
    std::fs::write(&path, format!("version = 1\n{}{}", node(LENDER), node(VMM))).unwrap();
    let cfg = ClusterConfig::load(&path).unwrap();
    let disk = |n: &str| dir.path().join(format!("{n}.img")).display().to_string();
    let proc = Lenderd::command(lenderd_binary(), LENDER, &path)
        .log(dir.path().join("lenderd.log"))
        .device(format!(
            "{NVME}=nvme:path={},size=16M,mode=interrupt",
            disk("a")
        ))
        .device(format!(
            "{NVME_POLLING}=nvme:path={},size=16M,mode=polling",
            disk("b")
        ))
        .device(format!("{DMATEST}=dmatest"))
        .token(TOKEN)
        .env_remove("LENDVM_TOKEN")
        .spawn_until_listening(&dir.path().join(format!("{LENDER}.sock")));
    Lender {
        cfg,
        proc,
        _dir: dir,
    }
}

impl Lender {
    fn client(&self) -> Arc<LenderClient> {
        let t0 = Instant::now();
        loop {
            match LenderClient::connect(&self.cfg, VMM, LENDER, TOKEN, "lender-events") {
                Ok(c) => return Arc::new(c),
                Err(e) if t0.elapsed() < Duration::from_secs(10) => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("connect: {e}\n{}", self.proc.log()),
            }
        }
    }

    /// A link to `dev` on its own client, as the VMM builds one per device.
    fn link(&self, dev: &str) -> LendingLink {
        let c = self.client();
        let lease = c.borrow(dev, "vm0").unwrap();
        LendingLink::new(c, lease, LendingLinkOptions::default()).unwrap()
    }
}

// ---- the guest's side -------------------------------------------------------------------

/// Guest RAM: a sealed memfd (the lender maps only sealed windows) mapped here.
struct Ram {
    file: Arc<File>,
    host: u64,
}

impl Ram {
    fn new() -> Arc<Self> {
        // SAFETY: a fresh memfd we own.
        let fd = unsafe { libc::memfd_create(c"guest-ram".as_ptr(), libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: fd is ours.
        let f = unsafe { File::from_raw_fd(fd) };
        f.set_len(RAM).unwrap();
        // SAFETY: F_ADD_SEALS on our memfd with an integer argument.
        let sealed =
            unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, ntb::mem::WINDOW_SEALS) };
        assert_eq!(sealed, 0);
        // SAFETY: a shared mapping of the memfd, never unmapped (test process).
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
        Arc::new(Ram {
            file: Arc::new(f),
            host: p as u64,
        })
    }

    fn region(&self) -> GuestRamRegion {
        GuestRamRegion {
            gpa: 0,
            size: RAM,
            host_addr: self.host,
            file: Some((self.file.clone(), 0)),
        }
    }
}

impl GuestRam for Ram {
    fn read(&self, addr: u64, buf: &mut [u8]) {
        assert!(addr + buf.len() as u64 <= RAM);
        // SAFETY: bounds-checked copy out of the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (self.host + addr) as *const u8,
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
    }
    fn write(&self, addr: u64, buf: &[u8]) {
        assert!(addr + buf.len() as u64 <= RAM);
        // SAFETY: bounds-checked copy into the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(buf.as_ptr(), (self.host + addr) as *mut u8, buf.len())
        };
    }
}

/// BAR0 as the VMM presents it: loads from the window; stores inside the doorbell range into
/// the window + a notify-eventfd write (counted); every other store as the exact BAR_WRITE.
struct LinkBar {
    link: Arc<LendingLink>,
    win: DirectWindow,
    /// Doorbell stores notified so far (each one a kick for the lender).
    notified: AtomicU64,
}

impl LinkBar {
    fn new(link: Arc<LendingLink>) -> Arc<Self> {
        let info = link.device_info();
        let BarAccess::Direct(win) = &info.bars.iter().find(|b| b.index == 0).unwrap().access
        else {
            panic!("bar 0 is not direct on shm: {info:?}");
        };
        assert!(win.write_notify().is_some() && win.doorbells().is_some());
        Arc::new(LinkBar {
            win: win.clone(),
            link,
            notified: AtomicU64::new(0),
        })
    }

    fn at<T>(&self, off: u64) -> *mut T {
        assert!(off + std::mem::size_of::<T>() as u64 <= self.win.len());
        (self.win.host_addr() + off) as *mut T
    }

    fn store(&self, off: u64, data: &[u8], direct: impl FnOnce()) {
        if self.win.store_is_direct(off, data.len() as u64) {
            direct();
            self.win.write_notify().unwrap().write(1).unwrap();
            self.notified.fetch_add(1, Ordering::SeqCst);
        } else {
            self.link.bar_write(0, off, data).unwrap();
        }
    }
}

impl GuestBar for LinkBar {
    fn read32(&self, off: u64) -> u32 {
        // SAFETY: in-bounds, aligned register of the mapped window (shared with the lender,
        // hence atomic).
        unsafe { (*self.at::<AtomicU32>(off)).load(Ordering::SeqCst) }
    }
    fn write32(&self, off: u64, v: u32) {
        self.store(off, &v.to_le_bytes(), || {
            // SAFETY: as in `read32`.
            unsafe { (*self.at::<AtomicU32>(off)).store(v, Ordering::SeqCst) }
        });
    }
    fn read64(&self, off: u64) -> u64 {
        // SAFETY: as in `read32`.
        unsafe { (*self.at::<AtomicU64>(off)).load(Ordering::SeqCst) }
    }
    fn write64(&self, off: u64, v: u64) {
        self.store(off, &v.to_le_bytes(), || {
            // SAFETY: as in `read32`.
            unsafe { (*self.at::<AtomicU64>(off)).store(v, Ordering::SeqCst) }
        });
    }
}

/// One eventfd per vector (the VMM's irqfds); counts every signal that reached it.
struct Irqs {
    fds: Vec<EventFd>,
    seen: Vec<AtomicU64>,
}

impl Irqs {
    fn new() -> Arc<Self> {
        Arc::new(Irqs {
            fds: (0..VECTORS)
                .map(|_| EventFd::new(EFD_NONBLOCK).unwrap())
                .collect(),
            seen: (0..VECTORS).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// Signals that reached vector `v` so far (consumed or still pending).
    fn total(&self, v: usize) -> u64 {
        if let Ok(n) = self.fds[v].read() {
            self.seen[v].fetch_add(n, Ordering::SeqCst);
        }
        self.seen[v].load(Ordering::SeqCst)
    }
}

impl GuestIrq for Irqs {
    fn wait(&self, vector: u16, timeout: Duration) -> bool {
        let v = usize::from(vector);
        let mut p = libc::pollfd {
            fd: self.fds[v].as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut p, 1, timeout.as_millis().max(1) as i32) };
        match self.fds[v].read() {
            Ok(n) => {
                self.seen[v].fetch_add(n, Ordering::SeqCst);
                true
            }
            Err(_) => false,
        }
    }
}

/// An NVMe controller borrowed through a `LendingLink`, DMA mapped, MSI-X wired, enabled,
/// with I/O queue 1 on vector 1.
struct NvmeRig {
    driver: NvmeDriver,
    bar: Arc<LinkBar>,
    irqs: Arc<Irqs>,
    link: Arc<LendingLink>,
    _dma: Box<dyn DmaMapping>,
}

impl NvmeRig {
    fn new(lender: &Lender, dev: &str, use_interrupts: bool) -> Self {
        let link = Arc::new(lender.link(dev));
        let ram = Ram::new();
        let dma = link.map_dma(&[ram.region()]).unwrap();
        let irqs = Irqs::new();
        link.set_irqs(&IrqTargets {
            kind: IrqKind::Msix,
            triggers: irqs.fds.iter().collect(),
            resample: None,
        })
        .unwrap();
        let bar = LinkBar::new(link.clone());
        let mut driver = NvmeDriver::new(
            bar.clone(),
            ram,
            irqs.clone(),
            DriverConfig {
                ram_base: RAM_BASE,
                ram_len: RAM - RAM_BASE,
                use_interrupts,
                timeout: Duration::from_secs(10),
            },
        );
        driver.enable(16).unwrap();
        driver.set_num_queues(1).unwrap();
        driver.create_io_queue_pair(1, 64, 1).unwrap();
        NvmeRig {
            driver,
            bar,
            irqs,
            link,
            _dma: dma,
        }
    }

    fn counters(&self) -> LenderCounters {
        self.link
            .lender_counters()
            .unwrap()
            .expect("a version 3 lender reports counters")
    }

    /// The lender's counters once it has read every doorbell notification made so far (its
    /// kick count is exact once the worker drained the eventfd).
    fn settled(&self) -> LenderCounters {
        let want = self.bar.notified.load(Ordering::SeqCst);
        let t0 = Instant::now();
        loop {
            let c = self.counters();
            if c.doorbell_kicks >= want || t0.elapsed() > SETTLE {
                assert_eq!(
                    c.doorbell_kicks, want,
                    "kicks counted vs doorbells notified"
                );
                return c;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

fn diff(a: &LenderCounters, b: &LenderCounters) -> LenderCounters {
    LenderCounters {
        dma_bytes_read: b.dma_bytes_read - a.dma_bytes_read,
        dma_bytes_written: b.dma_bytes_written - a.dma_bytes_written,
        iommu_faults: b.iommu_faults - a.iommu_faults,
        doorbell_kicks: b.doorbell_kicks - a.doorbell_kicks,
        msix: b.msix.iter().zip(&a.msix).map(|(b, a)| b - a).collect(),
        intx: b.intx - a.intx,
        commands: b.commands - a.commands,
        invalid_doorbells: b.invalid_doorbells - a.invalid_doorbells,
        bad_prps: b.bad_prps - a.bad_prps,
    }
}

#[derive(Default)]
struct Hook {
    lost: Mutex<Vec<(Instant, String)>>,
    faults: Mutex<Vec<IommuFaultReport>>,
}

impl LinkEventHook for Hook {
    fn lease_lost(&self, why: &str) {
        self.lost
            .lock()
            .unwrap()
            .push((Instant::now(), why.to_string()));
    }
    fn iommu_fault(&self, f: &IommuFaultReport) {
        self.faults.lock().unwrap().push(f.clone());
    }
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < timeout, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

// ---- tests --------------------------------------------------------------------------------

/// N 4 KiB writes: exact doorbell kicks, ≥ N interrupts (all of which reached the irqfd),
/// N × (4 KiB data + 64-byte SQE) read and N × 16-byte CQE written by DMA; then a write whose
/// data is outside the DMA window: a fault counted and reported to the hook.
#[test]
fn lender_counts_a_known_workload_and_reports_iommu_faults() {
    const N: u64 = 32;
    let lender = start_lenderd();
    let mut r = NvmeRig::new(&lender, NVME, true);
    let hook = Arc::new(Hook::default());
    r.link.set_event_hook(hook.clone());
    let before = r.settled();
    assert_eq!(
        before.msix.len(),
        17,
        "one count per msi-x vector of the controller"
    );
    assert_eq!(before.iommu_faults, 0);
    let (irq_before, kicks_before) = (r.irqs.total(1), r.bar.notified.load(Ordering::SeqCst));

    let buf = r.driver.alloc_data(4096, 0, false).unwrap();
    for i in 0..N {
        buf.fill(r.driver.ram(), &[i as u8; 4096]);
        let cqe = r
            .driver
            .execute(1, NvmeDriver::rw_sqe(true, i * 8, 8, &buf))
            .unwrap();
        assert_eq!(cqe.code(), status::SUCCESS);
    }
    let after = r.settled();
    let d = diff(&before, &after);
    let doorbells = r.bar.notified.load(Ordering::SeqCst) - kicks_before;
    eprintln!("{N} writes: {doorbells} doorbell writes; lender counted {d:?}");
    assert_eq!(
        doorbells,
        2 * N,
        "an SQ tail and a CQ head doorbell per command"
    );
    assert_eq!(d.doorbell_kicks, doorbells);
    assert!(
        d.msix[1] >= N,
        "{} interrupts for {N} completions",
        d.msix[1]
    );
    assert_eq!(
        d.msix[1],
        r.irqs.total(1) - irq_before,
        "counted = delivered"
    );
    assert_eq!(d.msix[0], 0, "nothing on the admin vector");
    assert_eq!(d.dma_bytes_read, N * (4096 + 64), "data + SQEs");
    assert_eq!(d.dma_bytes_written, N * 16, "CQEs");
    assert_eq!((d.iommu_faults, d.intx), (0, 0));

    // Data outside the window: refused by the IOMMU, failed command, counted, reported.
    let outside = DataBuf {
        prp1: RAM + 0x10_0000,
        prp2: 0,
        segs: Vec::new(),
        len: 4096,
    };
    let cqe = r
        .driver
        .execute(1, NvmeDriver::rw_sqe(true, 0, 8, &outside))
        .unwrap();
    assert_ne!(
        cqe.code(),
        status::SUCCESS,
        "dma outside the window failed the command"
    );
    wait_until("iommu fault reported to the hook", SETTLE, || {
        !hook.faults.lock().unwrap().is_empty()
    });
    let f = hook.faults.lock().unwrap()[0].clone();
    assert_eq!(
        (f.iova, f.write, f.total),
        (RAM + 0x10_0000, false, 1),
        "{f:?}"
    );
    assert!(f.len > 0 && f.len <= 4096, "{f:?}");
    assert_eq!(r.settled().iommu_faults, 1);
    assert!(hook.lost.lock().unwrap().is_empty());
}

/// SIGKILL of lenderd: the hook hears of the loss once, within a generous bound (measured and
/// printed); a link whose hook is set only after the loss is told at once.
#[test]
fn killing_lenderd_reports_lease_lost_once() {
    let mut lender = start_lenderd();
    let a = lender.link(NVME);
    let b = lender.link(DMATEST);
    let hook = Arc::new(Hook::default());
    a.set_event_hook(hook.clone());
    assert_eq!(a.lease_state(), LeaseState::Active);

    let t0 = Instant::now();
    lender.proc.kill();
    wait_until("lease_lost after SIGKILL", Duration::from_secs(5), || {
        !hook.lost.lock().unwrap().is_empty()
    });
    let (at, why) = hook.lost.lock().unwrap()[0].clone();
    let took = at - t0;
    eprintln!("lease_lost {took:?} after SIGKILL of lenderd: {why}");
    assert!(took < Duration::from_secs(1), "lease_lost after {took:?}");
    assert!(matches!(a.lease_state(), LeaseState::Lost(_)));

    // The other link saw the loss too; its hook, set now, is told at once.
    wait_until("second link lost", Duration::from_secs(5), || {
        matches!(b.lease_state(), LeaseState::Lost(_))
    });
    let late = Arc::new(Hook::default());
    b.set_event_hook(late.clone());
    assert_eq!(
        late.lost.lock().unwrap().len(),
        1,
        "told inside set_event_hook"
    );

    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(hook.lost.lock().unwrap().len(), 1, "exactly once");
    assert_eq!(late.lost.lock().unwrap().len(), 1, "exactly once");
}

/// Quiesce, in polling and in interrupt mode: a command whose doorbell is written while the
/// controller is quiesced is not fetched (no DMA, no completion) within a window, and
/// completes after resume.
#[test]
fn quiesced_controller_fetches_nothing_until_resumed() {
    let lender = start_lenderd();
    for (dev, use_interrupts) in [(NVME_POLLING, false), (NVME, true)] {
        let mut r = NvmeRig::new(&lender, dev, use_interrupts);
        let buf = r.driver.alloc_data(4096, 0, false).unwrap();
        buf.fill(r.driver.ram(), &[0x5a; 4096]);
        let c0 = r.settled();
        r.link.quiesce(true).unwrap();
        r.driver
            .submit(1, NvmeDriver::rw_sqe(true, 16, 8, &buf))
            .unwrap();
        let t0 = Instant::now();
        let mut out = Vec::new();
        while t0.elapsed() < Duration::from_millis(300) {
            assert_eq!(
                r.driver.poll(1, &mut out).unwrap(),
                0,
                "{dev}: completed while quiesced"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let c1 = r.counters();
        assert_eq!(
            (c1.dma_bytes_read, c1.dma_bytes_written),
            (c0.dma_bytes_read, c0.dma_bytes_written),
            "{dev}: no dma while quiesced"
        );
        r.link.quiesce(false).unwrap();
        r.driver.wait(1, &mut out, 1).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].code(), status::SUCCESS, "{dev}");
        let c2 = r.settled();
        assert_eq!(c2.dma_bytes_read - c0.dma_bytes_read, 4096 + 64, "{dev}");
    }
}
