//! A file-backed NVMe 1.4 controller (one namespace) for lending.
//!
//! BAR0 (16 KiB, 64-bit) is the register file and lives in caller-provided
//! [`RegisterMemory`]; BAR4 (4 KiB) holds the MSI-X table (offset 0) and PBA (offset 0x800)
//! and is emulated by the borrower's VMM. PCI identity defaults to 1b36:0010 (Red Hat's id
//! for QEMU's emulated NVMe controller, which Linux's `nvme` driver binds by class anyway;
//! an emulated controller honestly identifies as an emulated one), class 01:08:02.
//!
//! Threads: one controller thread (register diffing, SQ fetch, admin commands, DMA, CQ
//! posting, interrupts) plus the I/O engine (io_uring, or worker threads). Disk I/O is always
//! asynchronous to the controller thread.

pub mod cmb;
mod ctrl;
pub mod identify;
pub mod prp;
pub mod spec;

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use vmm_sys_util::eventfd::EventFd;

use crate::dma::DmaMemory;
use crate::engine::{create_engine, EngineKind};
use crate::irq::InterruptSink;
use crate::model::{
    build_config_space, BarInfo, DeviceError, DeviceModel, DoorbellRange, KickDoorbells, MsixInfo,
    PciIdentity,
};
use crate::regs::RegisterMemory;
use crate::waiter::{WaitState, Waiter};
use crate::NotifyMode;
use cmb::{CmbDma, CmbState};
use ctrl::{Ctrl, DbbufState, MAX_KICK_QUEUES};
use spec::{
    cq_doorbell, sq_doorbell, REG_CMBLOC, REG_CMBMSC, REG_CMBSTS, REG_CSTS, REG_DBS, REG_INTMC,
    REG_INTMS,
};

/// Size of BAR0 (registers + doorbells for up to 1535 queue pairs).
pub const BAR0_SIZE: u64 = 0x4000;
/// BAR holding the MSI-X table and PBA.
pub const MSIX_BAR: u8 = 4;
/// Size of the MSI-X BAR.
pub const MSIX_BAR_SIZE: u64 = 0x1000;
/// MSI-X PBA offset within [`MSIX_BAR`].
pub const MSIX_PBA_OFFSET: u32 = 0x800;

/// Controller configuration.
#[derive(Debug, Clone)]
pub struct NvmeConfig {
    /// Backing file (created if missing).
    pub backing: PathBuf,
    /// Namespace size in bytes; `None` uses the file's size (minus `ns_offset`). The file is
    /// extended if shorter than `ns_offset + size`.
    pub size: Option<u64>,
    /// Byte offset of the namespace in the backing file: LBA 0 is at this offset and the
    /// controller never reads or writes below it or past `ns_offset + size`. 0 for a whole
    /// file; an SR-IOV function's slice of a shared file otherwise (a multiple of the LBA
    /// size).
    pub ns_offset: u64,
    /// The function has an INTx pin (INTA). SR-IOV virtual functions have none (PCIe: VFs
    /// use MSI/MSI-X only).
    pub intx: bool,
    /// LBA size: 512 or 4096.
    pub lba_size: u32,
    /// Open the backing file with O_DIRECT.
    pub direct_io: bool,
    /// I/O engine.
    pub engine: EngineKind,
    /// Worker threads of the thread-pool engine.
    pub io_threads: usize,
    /// io_uring depth.
    pub io_depth: u32,
    /// Interrupt (eventfd) or polling doorbell mode.
    pub notify: NotifyMode,
    /// Offer Doorbell Buffer Config (shadow doorbells + EventIdx, OACS bit 8).
    pub dbbuf: bool,
    /// I/O queue pairs offered (1..=1024).
    pub max_io_queues: u16,
    /// Maximum entries per queue (MQES + 1), 2..=4096.
    pub max_queue_entries: u16,
    /// MSI-X vectors (1..=[`MAX_MSIX_VECTORS`]).
    pub msix_vectors: u16,
    /// Maximum data transfer size as a power of two of 4 KiB pages (1..=8).
    pub mdts: u8,
    /// Model number (40 chars max).
    pub model: String,
    /// Serial number (20 chars max).
    pub serial: String,
    /// Firmware revision (8 chars max).
    pub firmware: String,
    /// PCI identity.
    pub identity: PciIdentity,
    /// Controller Memory Buffer size in bytes (0: none); see [`cmb`].
    pub cmb_size: u64,
    /// What makes this controller's subsystem NQN (and namespace IDs) unique beyond its
    /// serial: lenderd puts its node name here, because two lenders lending at the same
    /// address would otherwise report one subsystem with one controller ID twice, and a guest
    /// borrowing from both rejects the second ("Duplicate cntlid"). Empty: the serial alone.
    pub subsystem: String,
}

/// Most MSI-X vectors the controller offers.
pub const MAX_MSIX_VECTORS: u16 = 128;
/// Most I/O queue pairs a controller offers ([`NvmeConfig::max_io_queues`]).
pub const MAX_IO_QUEUES: u16 = 1024;

impl Default for NvmeConfig {
    fn default() -> Self {
        NvmeConfig {
            backing: PathBuf::from("nvme.img"),
            size: None,
            ns_offset: 0,
            intx: true,
            lba_size: 512,
            direct_io: false,
            engine: EngineKind::Auto,
            io_threads: 4,
            io_depth: 256,
            notify: NotifyMode::Interrupt,
            dbbuf: true,
            max_io_queues: 16,
            max_queue_entries: 1024,
            msix_vectors: 17,
            mdts: 7,
            model: "lendvm NVMe Ctrl".into(),
            serial: "LENDVM0001".into(),
            firmware: "1.0".into(),
            identity: PciIdentity {
                vendor_id: 0x1b36,
                device_id: 0x0010,
                subsystem_vendor_id: 0x1af4,
                subsystem_id: 0x1100,
                class: 0x01,
                subclass: 0x08,
                prog_if: 0x02,
                revision: 0x02,
            },
            cmb_size: 0,
            subsystem: String::new(),
        }
    }
}

impl NvmeConfig {
    fn validate(&self) -> Result<(), DeviceError> {
        let bad = |m: String| Err(DeviceError::InvalidConfig(m));
        if self.lba_size != 512 && self.lba_size != 4096 {
            return bad(format!("lba size {} is not 512 or 4096", self.lba_size));
        }
        if !self.ns_offset.is_multiple_of(u64::from(self.lba_size)) {
            return bad(format!(
                "namespace offset {:#x} is not a multiple of the {}-byte lba",
                self.ns_offset, self.lba_size
            ));
        }
        cmb::check_size(self.cmb_size).map_err(DeviceError::InvalidConfig)?;
        if !(1..=MAX_IO_QUEUES).contains(&self.max_io_queues) {
            return bad(format!(
                "max io queues {} is not in 1..={MAX_IO_QUEUES}",
                self.max_io_queues
            ));
        }
        if !(2..=4096).contains(&self.max_queue_entries) {
            return bad(format!(
                "max queue entries {} is not in 2..=4096",
                self.max_queue_entries
            ));
        }
        if !(1..=MAX_MSIX_VECTORS).contains(&self.msix_vectors) {
            return bad(format!(
                "msix vectors {} is not in 1..={MAX_MSIX_VECTORS}",
                self.msix_vectors
            ));
        }
        if !(1..=8).contains(&self.mdts) {
            return bad(format!("mdts {} is not in 1..=8", self.mdts));
        }
        if self.serial.len() > 20 || self.model.len() > 40 || self.firmware.len() > 8 {
            return bad(format!(
                "serial/model/firmware {:?}/{:?}/{:?} longer than 20/40/8 bytes",
                self.serial, self.model, self.firmware
            ));
        }
        Ok(())
    }
}

/// Counters, readable at any time.
#[derive(Debug, Default)]
pub struct NvmeStats {
    /// DMA accesses the IOMMU refused (as seen by the controller).
    pub dma_faults: AtomicU64,
    /// Commands fetched.
    pub commands: AtomicU64,
    /// Completion entries posted.
    pub completions: AtomicU64,
    /// MSI-X signals sent plus INTx assertions.
    pub interrupts: AtomicU64,
    /// Doorbell writes refused because the value lies outside the queue (SQ tail or CQ
    /// head >= the queue size), counted once per value written.
    pub invalid_doorbells: AtomicU64,
    /// Commands refused for their PRPs (misaligned entries, a list walk that exceeds its
    /// bound: loops).
    pub invalid_prps: AtomicU64,
    /// Times fetching from a queue stopped because its CQ had no room for another
    /// completion (counted once per stall, until the host advances that CQ's head).
    pub fetch_stalls: AtomicU64,
    /// Completions dropped because the CQ held its bound of completions waiting for room
    /// (only a host that moved its CQ head backwards can cause it).
    pub dropped_completions: AtomicU64,
}

struct Inner {
    ctrl: Mutex<Ctrl>,
    regs: Arc<dyn RegisterMemory>,
    doorbell: EventFd,
    engine_event: EventFd,
    stop: AtomicBool,
    dbbuf: Arc<DbbufState>,
    notify: NotifyMode,
    wait: Arc<WaitState>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Ctrl> {
        // A panic on the controller thread must not wedge the host: keep using the state.
        self.ctrl.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn run(&self) {
        let mut waiter = Waiter::new(self.notify, Arc::clone(&self.wait));
        while !self.stop.load(Ordering::Acquire) {
            let (work, deadline) = {
                let mut c = self.lock();
                let w = c.pass();
                (w, c.next_deadline())
            };
            if work {
                waiter.busy();
                continue;
            }
            waiter.wait(&[&self.doorbell, &self.engine_event], None, deadline);
        }
    }
}

/// The NVMe controller. Dropping it stops its threads.
pub struct NvmeController {
    cfg: Arc<NvmeConfig>,
    inner: Arc<Inner>,
    stats: Arc<NvmeStats>,
    thread: Mutex<Option<JoinHandle<()>>>,
    engine_name: &'static str,
}

impl NvmeController {
    /// Open the backing file and set up the controller (not started: call
    /// [`DeviceModel::start`]). `regs` must be at least [`cmb::bar0_size`] bytes (BAR0).
    pub fn new(
        cfg: NvmeConfig,
        regs: Arc<dyn RegisterMemory>,
        dma: Arc<dyn DmaMemory>,
        irq: Arc<dyn InterruptSink>,
    ) -> Result<Self, DeviceError> {
        cfg.validate()?;
        let bar0 = cmb::bar0_size(cfg.cmb_size);
        if (regs.len() as u64) < bar0 {
            return Err(DeviceError::RegisterMemoryTooSmall {
                got: regs.len(),
                need: bar0 as usize,
            });
        }
        let path = cfg.backing.display().to_string();
        let backing = |source| DeviceError::Backing {
            path: path.clone(),
            source,
        };
        let mut oo = OpenOptions::new();
        oo.read(true).write(true).create(true).truncate(false);
        if cfg.direct_io {
            oo.custom_flags(libc::O_DIRECT);
        }
        let file = oo.open(&cfg.backing).map_err(backing)?;
        let cur = file.metadata().map_err(backing)?.len();
        let size = match cfg.size {
            Some(s) => {
                let end = cfg.ns_offset.checked_add(s).ok_or_else(|| {
                    DeviceError::InvalidConfig(format!(
                        "namespace of {s:#x} bytes at offset {:#x} ends past 2^64",
                        cfg.ns_offset
                    ))
                })?;
                if cur < end {
                    file.set_len(end).map_err(backing)?;
                }
                s
            }
            None => cur.saturating_sub(cfg.ns_offset),
        };
        let nsze = size / u64::from(cfg.lba_size);
        if nsze == 0 {
            return Err(DeviceError::InvalidConfig(format!(
                "namespace of {size} bytes holds no {}-byte block",
                cfg.lba_size
            )));
        }
        let engine = create_engine(Arc::new(file), cfg.engine, cfg.io_depth, cfg.io_threads)
            .map_err(backing)?;
        let engine_name = engine.name();
        let os = |what| move |source| DeviceError::Os { what, source };
        let engine_event = engine
            .completion_event()
            .try_clone()
            .map_err(os("dup completion eventfd"))?;
        let doorbell = EventFd::new(libc::EFD_NONBLOCK).map_err(os("doorbell eventfd"))?;
        let stats = Arc::new(NvmeStats::default());
        // With a CMB, every controller memory access is routed: CMB addresses to the buffer
        // in BAR0, the rest to the host (IOMMU domain).
        let (dma, cmb) = if cfg.cmb_size > 0 {
            let cmb = CmbState::new(cfg.cmb_size, regs.clone());
            let d: Arc<dyn DmaMemory> = Arc::new(CmbDma {
                host: dma,
                cmb: cmb.clone(),
            });
            (d, Some(cmb))
        } else {
            (dma, None)
        };
        let cfg = Arc::new(cfg);
        let ctrl = Ctrl::new(
            cfg.clone(),
            regs.clone(),
            dma,
            irq,
            engine,
            stats.clone(),
            nsze,
            cmb,
        );
        let dbbuf = ctrl.dbbuf_state();
        log::info!(
            "nvme {}: {} blocks of {} bytes, engine {engine_name}, {:?} mode",
            cfg.serial,
            nsze,
            cfg.lba_size,
            cfg.notify
        );
        Ok(NvmeController {
            inner: Arc::new(Inner {
                ctrl: Mutex::new(ctrl),
                regs,
                doorbell,
                engine_event,
                stop: AtomicBool::new(false),
                dbbuf,
                notify: cfg.notify,
                wait: WaitState::new().map_err(os("worker wake eventfd"))?,
            }),
            cfg,
            stats,
            thread: Mutex::new(None),
            engine_name,
        })
    }

    /// Counters.
    pub fn stats(&self) -> &NvmeStats {
        &self.stats
    }

    /// "io_uring" or "thread-pool".
    pub fn engine_name(&self) -> &'static str {
        self.engine_name
    }

    /// The configuration in use.
    pub fn config(&self) -> &NvmeConfig {
        &self.cfg
    }

    /// BAR0's size (registers and doorbells, and the CMB if there is one).
    pub fn bar0_size(&self) -> u64 {
        cmb::bar0_size(self.cfg.cmb_size)
    }

    fn stop_thread(&self) {
        let handle = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            self.inner.stop.store(true, Ordering::Release);
            // Open both gates, or a worker parked there never sees `stop`.
            self.inner.wait.quiesce("nvme", false);
            self.inner.wait.bus_master("nvme", true);
            self.inner.wait.wake();
            if h.join().is_err() {
                log::error!("nvme controller thread panicked");
            }
            self.inner.stop.store(false, Ordering::Release);
        }
    }
}

impl DeviceModel for NvmeController {
    fn name(&self) -> &str {
        "nvme"
    }

    fn peer_memory(&self, bar: u8) -> Option<(u64, u64)> {
        // The Controller Memory Buffer only (plain memory, which is what it is for: other
        // devices DMA queue entries and data into it); the registers and doorbells never.
        (bar == 0 && self.cfg.cmb_size > 0).then_some((cmb::CMB_OFFSET, self.cfg.cmb_size))
    }

    fn identity(&self) -> PciIdentity {
        self.cfg.identity
    }

    fn bars(&self) -> Vec<BarInfo> {
        vec![
            BarInfo {
                index: 0,
                size: self.bar0_size(),
                is_64bit: true,
                prefetchable: false,
                register_memory: true,
                // SQ tail / CQ head doorbells hold absolute queue indexes: storing them and
                // waking the controller is exact. Page 0 (CC, INTMS/INTMC, AQA, ...) is not.
                // The CMB (plain memory) is exact when stored too.
                doorbells: Some(DoorbellRange {
                    offset: REG_DBS,
                    len: self.bar0_size() - REG_DBS,
                }),
            },
            BarInfo {
                index: MSIX_BAR,
                size: MSIX_BAR_SIZE,
                is_64bit: false,
                prefetchable: false,
                register_memory: false,
                doorbells: None,
            },
        ]
    }

    fn msix(&self) -> Option<MsixInfo> {
        Some(MsixInfo {
            vectors: self.cfg.msix_vectors,
            table_bar: MSIX_BAR,
            table_offset: 0,
            pba_bar: MSIX_BAR,
            pba_offset: MSIX_PBA_OFFSET,
        })
    }

    fn intx_pin(&self) -> u8 {
        u8::from(self.cfg.intx)
    }

    fn config_space(&self) -> [u8; 256] {
        build_config_space(
            &self.cfg.identity,
            &self.bars(),
            self.msix().as_ref(),
            self.intx_pin(),
        )
    }

    fn doorbell_event(&self) -> &EventFd {
        &self.inner.doorbell
    }

    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if bar != 0 || offset >= self.bar0_size() {
            return;
        }
        let regs = &self.inner.regs;
        match data.len() {
            8 => data.copy_from_slice(&regs.read64(offset).to_le_bytes()),
            n @ 1..=4 => {
                let v = regs.read32(offset & !3).to_le_bytes();
                let s = (offset & 3) as usize;
                let n = n.min(4 - s);
                data[..n].copy_from_slice(&v[s..s + n]);
            }
            _ => {}
        }
    }

    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) {
        if bar != 0 || offset >= self.bar0_size() {
            return;
        }
        let regs = &self.inner.regs;
        let aligned = offset & !3;
        // Read-only registers (CAP, VS, CSTS, CMBLOC, CMBSZ, CMBSTS) ignore writes.
        if aligned < REG_INTMS
            || aligned == REG_CSTS
            || (REG_CMBLOC..REG_CMBMSC).contains(&aligned)
            || (REG_CMBSTS..REG_CMBSTS + 4).contains(&aligned)
        {
            return;
        }
        if aligned == REG_INTMS || aligned == REG_INTMC {
            if data.len() == 4 && offset == aligned {
                let v = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
                self.inner.lock().write_intm(aligned == REG_INTMS, v);
            }
            return;
        }
        match data.len() {
            8 if offset & 7 == 0 => regs.write64(
                offset,
                u64::from_le_bytes(data.try_into().unwrap_or([0; 8])),
            ),
            n @ 1..=4 => {
                let s = (offset & 3) as usize;
                let n = n.min(4 - s);
                let mut v = regs.read32(aligned).to_le_bytes();
                v[s..s + n].copy_from_slice(&data[..n]);
                regs.write32(aligned, u32::from_le_bytes(v));
            }
            _ => return,
        }
        if offset < REG_DBS {
            // Page-0 writes (CC, AQA, ...) are applied synchronously so no transition is lost.
            self.inner.lock().check_page0();
        } else if let Err(e) = self.inner.doorbell.write(1) {
            log::warn!("nvme doorbell eventfd write failed: {e}");
        }
    }

    fn start(&self) -> Result<(), DeviceError> {
        let mut t = self.thread.lock().unwrap_or_else(|p| p.into_inner());
        if t.is_some() {
            return Ok(());
        }
        let inner = self.inner.clone();
        let h = std::thread::Builder::new()
            .name(format!("nvme-{}", self.cfg.serial))
            .spawn(move || inner.run())
            .map_err(|source| DeviceError::Os {
                what: "spawn controller thread",
                source,
            })?;
        *t = Some(h);
        Ok(())
    }

    fn reset(&self) {
        self.inner.lock().function_reset();
    }

    fn kick_generation(&self) -> u64 {
        self.inner.dbbuf.get().0
    }

    fn polls_doorbells(&self) -> bool {
        self.cfg.notify == NotifyMode::Polling
    }

    fn set_kick_listener(&self, listener: Option<crate::KickListener>) {
        self.inner.dbbuf.set_listener(listener);
    }

    fn kick_doorbells(&self) -> KickDoorbells {
        let (generation, on) = self.inner.dbbuf.get();
        let offsets = if on {
            (1..=self.cfg.max_io_queues.min(MAX_KICK_QUEUES))
                .flat_map(|q| [sq_doorbell(q), cq_doorbell(q)])
                .collect()
        } else {
            Vec::new()
        };
        KickDoorbells {
            generation,
            bar: 0,
            offsets,
        }
    }

    fn intx_resample(&self) {
        self.inner.lock().intx_resample();
        // Head doorbells read here may have freed room for held completions: let the
        // controller thread post and signal them.
        self.inner.wait.wake();
    }

    fn doorbell_kicks(&self) -> u64 {
        self.inner.wait.kicks()
    }

    fn model_counters(&self) -> crate::model::ModelCounters {
        crate::model::ModelCounters {
            commands: self.stats.commands.load(Ordering::Relaxed),
            invalid_doorbells: self.stats.invalid_doorbells.load(Ordering::Relaxed),
            bad_prps: self.stats.invalid_prps.load(Ordering::Relaxed),
        }
    }

    fn quiesce(&self, stop: bool) {
        self.inner.wait.quiesce("nvme", stop);
    }

    fn set_bus_master(&self, enable: bool) {
        self.inner.wait.bus_master("nvme", enable);
    }

    /// With the worker parked between passes (it fetches no SQE), completes the commands
    /// already fetched on this thread: their data DMA, their completions, their interrupts.
    fn drain(&self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let running = self
            .thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some();
        if !self.inner.wait.wait_parked(running, deadline) {
            return false;
        }
        self.inner.lock().drain_for_handover(deadline)
    }
}

impl Drop for NvmeController {
    fn drop(&mut self) {
        self.stop_thread();
    }
}
