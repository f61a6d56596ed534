//! Test doubles and a guest-side NVMe driver, shared by this crate's tests and benchmark and
//! by the lender's "lent" tests (which implement [`GuestBar`]/[`GuestRam`]/[`GuestIrq`] over
//! the fabric).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use thiserror::Error;
use vmm_sys_util::eventfd::EventFd;

use crate::dma::{DmaFault, DmaMemory};
use crate::irq::{InterruptMode, InterruptSink};
use crate::model::DeviceModel;
use crate::nvme::spec::*;
use crate::regs::RegisterMemory;

// ---- guest RAM ------------------------------------------------------------------------------

/// In-memory "guest RAM" at guest addresses `0..len`. As [`DmaMemory`] it only allows the
/// window `[window_start, window_end)` and counts refused accesses; the guest side
/// ([`GuestRam`]) sees all of it.
pub struct TestMemory {
    ptr: *mut u8,
    len: usize,
    layout: std::alloc::Layout,
    window: (u64, u64),
    faults: AtomicU64,
}

// SAFETY: the allocation is owned by the value; concurrent byte copies model concurrent DMA
// and CPU access to shared RAM (the guest and device synchronise through the NVMe protocol).
unsafe impl Send for TestMemory {}
// SAFETY: as above.
unsafe impl Sync for TestMemory {}

impl TestMemory {
    /// `len` bytes of zeroed RAM, all of it DMA-visible.
    pub fn new(len: usize) -> Arc<Self> {
        Self::with_window(len, 0, len as u64)
    }

    /// `len` bytes of zeroed RAM; DMA may only touch `[start, end)`.
    pub fn with_window(len: usize, start: u64, end: u64) -> Arc<Self> {
        let layout = std::alloc::Layout::from_size_align(len.max(4096), 4096)
            .unwrap_or_else(|_| std::alloc::Layout::new::<u64>());
        // SAFETY: non-zero size layout.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Arc::new(TestMemory {
            ptr,
            len,
            layout,
            window: (start, end.min(len as u64)),
            faults: AtomicU64::new(0),
        })
    }

    /// DMA accesses refused so far.
    pub fn faults(&self) -> u64 {
        self.faults.load(Ordering::Relaxed)
    }

    /// The DMA window.
    pub fn window(&self) -> (u64, u64) {
        self.window
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn in_bounds(&self, addr: u64, n: usize, lo: u64, hi: u64) -> bool {
        addr >= lo && addr.checked_add(n as u64).is_some_and(|e| e <= hi)
    }

    fn copy_out(&self, addr: u64, buf: &mut [u8]) {
        // SAFETY: callers checked `addr..addr+len` lies inside the allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.add(addr as usize), buf.as_mut_ptr(), buf.len())
        }
    }

    fn copy_in(&self, addr: u64, buf: &[u8]) {
        // SAFETY: callers checked `addr..addr+len` lies inside the allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(buf.as_ptr(), self.ptr.add(addr as usize), buf.len())
        }
    }

    /// Fill `[addr, addr+len)` with `byte` (guest side; panics when out of RAM).
    pub fn fill(&self, addr: u64, len: usize, byte: u8) {
        assert!(
            self.in_bounds(addr, len, 0, self.len as u64),
            "fill outside test ram"
        );
        // SAFETY: bounds checked above.
        unsafe { std::ptr::write_bytes(self.ptr.add(addr as usize), byte, len) }
    }

    /// True if every byte of `[addr, addr+len)` equals `byte`.
    pub fn check(&self, addr: u64, len: usize, byte: u8) -> bool {
        let mut v = vec![0u8; len];
        GuestRam::read(self, addr, &mut v);
        v.iter().all(|&b| b == byte)
    }
}

impl Drop for TestMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `with_window` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

impl DmaMemory for TestMemory {
    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaFault> {
        if !self.in_bounds(iova, buf.len(), self.window.0, self.window.1) {
            self.faults.fetch_add(1, Ordering::Relaxed);
            return Err(DmaFault::read(iova, buf.len()));
        }
        self.copy_out(iova, buf);
        Ok(())
    }

    fn write(&self, iova: u64, buf: &[u8]) -> Result<(), DmaFault> {
        if !self.in_bounds(iova, buf.len(), self.window.0, self.window.1) {
            self.faults.fetch_add(1, Ordering::Relaxed);
            return Err(DmaFault::write(iova, buf.len()));
        }
        self.copy_in(iova, buf);
        Ok(())
    }
}

/// The guest's (CPU) view of its RAM, used by [`NvmeDriver`].
pub trait GuestRam: Send + Sync {
    /// Read guest RAM.
    fn read(&self, addr: u64, buf: &mut [u8]);
    /// Write guest RAM.
    fn write(&self, addr: u64, buf: &[u8]);
}

impl GuestRam for TestMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) {
        assert!(
            self.in_bounds(addr, buf.len(), 0, self.len as u64),
            "guest read outside ram"
        );
        self.copy_out(addr, buf);
    }

    fn write(&self, addr: u64, buf: &[u8]) {
        assert!(
            self.in_bounds(addr, buf.len(), 0, self.len as u64),
            "guest write outside ram"
        );
        self.copy_in(addr, buf);
    }
}

// ---- interrupts -----------------------------------------------------------------------------

/// An [`InterruptSink`] that counts signals per vector and lets a test wait for them.
pub struct CountingInterrupts {
    mode: Mutex<InterruptMode>,
    counts: Vec<AtomicU64>,
    pending: Mutex<(Vec<bool>, bool)>,
    cond: Condvar,
    intx: AtomicU64,
    intx_signals: AtomicU64,
}

impl CountingInterrupts {
    /// `vectors` MSI-X vectors, mode MSI-X.
    pub fn new(vectors: u16) -> Arc<Self> {
        Arc::new(CountingInterrupts {
            mode: Mutex::new(InterruptMode::MsiX { vectors }),
            counts: (0..vectors).map(|_| AtomicU64::new(0)).collect(),
            pending: Mutex::new((vec![false; vectors as usize], false)),
            cond: Condvar::new(),
            intx: AtomicU64::new(0),
            intx_signals: AtomicU64::new(0),
        })
    }

    /// Change the mode.
    pub fn set_mode(&self, m: InterruptMode) {
        *self.mode.lock().unwrap_or_else(|p| p.into_inner()) = m;
    }

    /// Signals seen on `vector`.
    pub fn count(&self, vector: u16) -> u64 {
        self.counts
            .get(vector as usize)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// INTx assertions seen (rising edges).
    pub fn intx_assertions(&self) -> u64 {
        self.intx.load(Ordering::Relaxed)
    }

    /// `set_intx(true)` calls seen (rising edges plus re-assertions after a resample).
    pub fn intx_signals(&self) -> u64 {
        self.intx_signals.load(Ordering::Relaxed)
    }

    /// Current INTx level.
    pub fn intx_level(&self) -> bool {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).1
    }
}

impl InterruptSink for CountingInterrupts {
    fn signal_msix(&self, vector: u16) {
        if let Some(c) = self.counts.get(vector as usize) {
            c.fetch_add(1, Ordering::Relaxed);
            let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            p.0[vector as usize] = true;
            self.cond.notify_all();
        }
    }

    fn set_intx(&self, asserted: bool) {
        let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if asserted && !p.1 {
            self.intx.fetch_add(1, Ordering::Relaxed);
        }
        if asserted {
            self.intx_signals.fetch_add(1, Ordering::Relaxed);
        }
        p.1 = asserted;
        self.cond.notify_all();
    }

    fn mode(&self) -> InterruptMode {
        *self.mode.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// How the driver waits for an interrupt.
pub trait GuestIrq: Send + Sync {
    /// Wait up to `timeout` for `vector` to fire (MSI-X) or INTx to be asserted; consumes a
    /// pending MSI-X edge. Returns true if it fired.
    fn wait(&self, vector: u16, timeout: Duration) -> bool;
}

impl GuestIrq for CountingInterrupts {
    fn wait(&self, vector: u16, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let intx = matches!(
                *self.mode.lock().unwrap_or_else(|p| p.into_inner()),
                InterruptMode::Intx
            );
            if intx && p.1 {
                return true;
            }
            if let Some(f) = p.0.get_mut(vector as usize) {
                if *f {
                    *f = false;
                    return true;
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            p = match self.cond.wait_timeout(p, deadline - now) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
    }
}

// ---- BAR access -----------------------------------------------------------------------------

/// The guest's view of the controller's BAR0.
pub trait GuestBar: Send + Sync {
    /// 32-bit load.
    fn read32(&self, off: u64) -> u32;
    /// 32-bit store.
    fn write32(&self, off: u64, v: u32);
    /// 64-bit load.
    fn read64(&self, off: u64) -> u64 {
        u64::from(self.read32(off)) | (u64::from(self.read32(off + 4)) << 32)
    }
    /// 64-bit store.
    fn write64(&self, off: u64, v: u64) {
        self.write32(off, v as u32);
        self.write32(off + 4, (v >> 32) as u32);
    }
}

/// What a borrower's VMM makes of a device's BAR 0 once it follows
/// [`DeviceModel::kick_doorbells`]: a store to a kick-only doorbell only signals the
/// doorbell eventfd (a KVM ioeventfd: the value is lost), a store to another doorbell is
/// stored and signalled, any other store takes the exact [`DeviceModel::bar_write`]. The
/// kick set is re-read on every store, as if the VMM applied each change at once.
pub struct KickBar {
    model: Arc<dyn DeviceModel>,
    regs: Arc<dyn RegisterMemory>,
    doorbells: Option<crate::DoorbellRange>,
    kicks: AtomicU64,
}

impl KickBar {
    /// Over `model`'s BAR 0 backed by `regs`.
    pub fn new(model: Arc<dyn DeviceModel>, regs: Arc<dyn RegisterMemory>) -> Self {
        let doorbells = model
            .bars()
            .iter()
            .find(|b| b.index == 0)
            .and_then(|b| b.doorbells);
        KickBar {
            model,
            regs,
            doorbells,
            kicks: AtomicU64::new(0),
        }
    }

    /// Stores that became kicks (their value dropped).
    pub fn kicks(&self) -> u64 {
        self.kicks.load(Ordering::Relaxed)
    }
}

impl GuestBar for KickBar {
    fn read32(&self, off: u64) -> u32 {
        self.regs.read32(off)
    }
    fn write32(&self, off: u64, v: u32) {
        let k = self.model.kick_doorbells();
        if k.bar == 0 && k.offsets.contains(&off) {
            self.kicks.fetch_add(1, Ordering::Relaxed);
            let _ = self.model.doorbell_event().write(1);
        } else if self.doorbells.is_some_and(|d| d.contains(off, 4)) {
            self.regs.write32(off, v);
            let _ = self.model.doorbell_event().write(1);
        } else {
            self.model.bar_write(0, off, &v.to_le_bytes());
        }
    }
    fn read64(&self, off: u64) -> u64 {
        self.regs.read64(off)
    }
    fn write64(&self, off: u64, v: u64) {
        self.model.bar_write(0, off, &v.to_le_bytes());
    }
}

/// Stores land directly in register memory (the shm fabric). With `notify`, every store also
/// signals the device's doorbell eventfd (what the VMM trap or KVM ioeventfd does); without,
/// the device must be in polling mode.
pub struct DirectBar {
    regs: Arc<dyn RegisterMemory>,
    notify: Option<EventFd>,
}

impl DirectBar {
    /// Direct access, optionally notifying `doorbell` (duplicated) after each store.
    pub fn new(regs: Arc<dyn RegisterMemory>, doorbell: Option<&EventFd>) -> std::io::Result<Self> {
        Ok(DirectBar {
            regs,
            notify: doorbell.map(EventFd::try_clone).transpose()?,
        })
    }

    fn kick(&self) {
        if let Some(e) = &self.notify {
            let _ = e.write(1);
        }
    }
}

impl GuestBar for DirectBar {
    fn read32(&self, off: u64) -> u32 {
        self.regs.read32(off)
    }
    fn write32(&self, off: u64, v: u32) {
        self.regs.write32(off, v);
        self.kick();
    }
    fn read64(&self, off: u64) -> u64 {
        self.regs.read64(off)
    }
    fn write64(&self, off: u64, v: u64) {
        self.regs.write64(off, v);
        self.kick();
    }
}

/// Every access goes through [`DeviceModel::bar_read`]/[`DeviceModel::bar_write`] (the tcp
/// fabric's trapped path).
pub struct TrappedBar(pub Arc<dyn DeviceModel>);

impl GuestBar for TrappedBar {
    fn read32(&self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.0.bar_read(0, off, &mut b);
        u32::from_le_bytes(b)
    }
    fn write32(&self, off: u64, v: u32) {
        self.0.bar_write(0, off, &v.to_le_bytes());
    }
    fn read64(&self, off: u64) -> u64 {
        let mut b = [0u8; 8];
        self.0.bar_read(0, off, &mut b);
        u64::from_le_bytes(b)
    }
    fn write64(&self, off: u64, v: u64) {
        self.0.bar_write(0, off, &v.to_le_bytes());
    }
}

// ---- driver ---------------------------------------------------------------------------------

/// Driver errors.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DriverError {
    /// Waited too long.
    #[error("timed out waiting for {0}")]
    Timeout(&'static str),
    /// The guest RAM arena is exhausted.
    #[error("guest ram arena exhausted allocating {0:#x} bytes")]
    OutOfMemory(usize),
    /// A command completed with an error status.
    #[error("command {opcode:#x} failed with status {status:#x}")]
    Status {
        /// Opcode.
        opcode: u8,
        /// `SCT << 8 | SC`.
        status: u16,
    },
    /// The controller reported fatal status.
    #[error("controller fatal status (csts {0:#x})")]
    Fatal(u32),
    /// Unknown queue.
    #[error("no i/o queue {0}")]
    NoQueue(u16),
    /// Queue has no free slot.
    #[error("queue {0} is full")]
    QueueFull(u16),
}

/// Data buffer in guest RAM with its PRPs.
#[derive(Debug, Clone)]
pub struct DataBuf {
    /// PRP1.
    pub prp1: u64,
    /// PRP2 (data page or list pointer or 0).
    pub prp2: u64,
    /// Guest segments holding the data, in order.
    pub segs: Vec<(u64, usize)>,
    /// Total length.
    pub len: usize,
}

impl DataBuf {
    /// Copy `data` (len bytes) into the buffer's guest pages.
    pub fn fill(&self, ram: &dyn GuestRam, data: &[u8]) {
        let mut off = 0;
        for &(a, l) in &self.segs {
            ram.write(a, &data[off..off + l]);
            off += l;
        }
    }

    /// Read the buffer's contents.
    pub fn read(&self, ram: &dyn GuestRam) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        let mut off = 0;
        for &(a, l) in &self.segs {
            ram.read(a, &mut v[off..off + l]);
            off += l;
        }
        v
    }
}

/// Identify Controller fields the tests look at.
#[derive(Debug, Clone)]
pub struct IdController {
    /// PCI vendor id.
    pub vid: u16,
    /// Serial number (trimmed).
    pub serial: String,
    /// Model number (trimmed).
    pub model: String,
    /// Firmware revision (trimmed).
    pub firmware: String,
    /// MDTS.
    pub mdts: u8,
    /// Number of namespaces.
    pub nn: u32,
    /// SQES/CQES.
    pub sqes: u8,
    /// CQES.
    pub cqes: u8,
    /// VER.
    pub ver: u32,
    /// VWC.
    pub vwc: u8,
    /// ONCS.
    pub oncs: u16,
    /// OACS (bit 8: Doorbell Buffer Config).
    pub oacs: u16,
}

struct Queue {
    qid: u16,
    sq: u64,
    cq: u64,
    size: u16,
    tail: u16,
    head: u16,
    phase: bool,
    vector: u16,
    next_cid: u16,
    outstanding: usize,
    /// The SQ is in the Controller Memory Buffer at this BAR0 offset: entries are stored
    /// through the BAR (`sq` is then its bus address, for the controller).
    sq_bar: Option<u64>,
}

/// Driver configuration.
#[derive(Debug, Clone, Copy)]
pub struct DriverConfig {
    /// First guest address the driver may allocate from.
    pub ram_base: u64,
    /// Bytes it may allocate.
    pub ram_len: u64,
    /// Sleep on interrupts (true) or poll CQs (false).
    pub use_interrupts: bool,
    /// Timeout of any single wait.
    pub timeout: Duration,
}

/// A small guest-side NVMe driver.
pub struct NvmeDriver {
    bar: Arc<dyn GuestBar>,
    ram: Arc<dyn GuestRam>,
    irq: Arc<dyn GuestIrq>,
    cfg: DriverConfig,
    next: u64,
    admin: Option<Queue>,
    io: Vec<Queue>,
    /// Shadow doorbell and EventIdx buffers once Doorbell Buffer Config succeeded.
    dbbuf: Option<(u64, u64)>,
    doorbells: DoorbellCounts,
}

/// I/O queue doorbell accounting of [`NvmeDriver`] (the admin queue is not counted).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DoorbellCounts {
    /// SQ tail updates (each would be an MMIO write without shadow doorbells).
    pub sq_updates: u64,
    /// SQ tail MMIO writes made.
    pub sq_writes: u64,
    /// CQ head updates.
    pub cq_updates: u64,
    /// CQ head MMIO writes made.
    pub cq_writes: u64,
}

impl DoorbellCounts {
    /// MMIO doorbell writes.
    pub fn writes(&self) -> u64 {
        self.sq_writes + self.cq_writes
    }

    /// Doorbell updates.
    pub fn updates(&self) -> u64 {
        self.sq_updates + self.cq_updates
    }

    /// `self - earlier`, field by field.
    pub fn since(&self, earlier: &DoorbellCounts) -> DoorbellCounts {
        DoorbellCounts {
            sq_updates: self.sq_updates - earlier.sq_updates,
            sq_writes: self.sq_writes - earlier.sq_writes,
            cq_updates: self.cq_updates - earlier.cq_updates,
            cq_writes: self.cq_writes - earlier.cq_writes,
        }
    }
}

fn trim(b: &[u8]) -> String {
    String::from_utf8_lossy(b)
        .trim_end_matches([' ', '\0'])
        .to_string()
}

impl NvmeDriver {
    /// New driver (controller not touched yet).
    pub fn new(
        bar: Arc<dyn GuestBar>,
        ram: Arc<dyn GuestRam>,
        irq: Arc<dyn GuestIrq>,
        cfg: DriverConfig,
    ) -> Self {
        NvmeDriver {
            bar,
            ram,
            irq,
            next: cfg.ram_base,
            cfg,
            admin: None,
            io: Vec::new(),
            dbbuf: None,
            doorbells: DoorbellCounts::default(),
        }
    }

    /// I/O queue doorbell updates and MMIO writes so far.
    pub fn doorbell_counts(&self) -> DoorbellCounts {
        self.doorbells
    }

    /// Whether shadow doorbells are in use.
    pub fn dbbuf_enabled(&self) -> bool {
        self.dbbuf.is_some()
    }

    /// Send Doorbell Buffer Config with the given buffers (PRP1 shadow, PRP2 EventIdx) and
    /// return its completion; on success the driver uses them, as Linux does.
    pub fn dbbuf_config(&mut self, shadow: u64, eventidx: u64) -> Result<Cqe, DriverError> {
        let mut s = Sqe::new(admin::DBBUF_CONFIG, 0);
        s.set_prps(shadow, eventidx);
        let e = self.execute(0, s)?;
        if e.code() == status::SUCCESS {
            self.dbbuf = Some((shadow, eventidx));
        }
        Ok(e)
    }

    /// Allocate zeroed shadow and EventIdx pages and enable shadow doorbells.
    pub fn enable_dbbuf(&mut self) -> Result<(), DriverError> {
        let shadow = self.alloc(PAGE_SIZE as usize, PAGE_SIZE)?;
        let eventidx = self.alloc(PAGE_SIZE as usize, PAGE_SIZE)?;
        let e = self.dbbuf_config(shadow, eventidx)?;
        if e.code() != status::SUCCESS {
            return Err(DriverError::Status {
                opcode: admin::DBBUF_CONFIG,
                status: e.code(),
            });
        }
        Ok(())
    }

    /// Write a doorbell the way Linux's `nvme_dbbuf_update_and_check_event` does: with
    /// shadow doorbells on (I/O queues only), store the value in the shadow slot, full
    /// fence, read EventIdx and write MMIO only if `(u16)(new - ei - 1) < (u16)(new - old)`.
    fn doorbell(&mut self, qid: u16, cq: bool, value: u16) {
        let reg = if cq {
            cq_doorbell(qid)
        } else {
            sq_doorbell(qid)
        };
        if qid == 0 {
            self.bar.write32(reg, u32::from(value));
            return;
        }
        if cq {
            self.doorbells.cq_updates += 1;
        } else {
            self.doorbells.sq_updates += 1;
        }
        if let Some((shadow, eventidx)) = self.dbbuf {
            let slot = 8 * u64::from(qid) + if cq { 4 } else { 0 };
            let mut b = [0u8; 4];
            self.ram.read(shadow + slot, &mut b);
            let old = u32::from_le_bytes(b) as u16;
            self.ram
                .write(shadow + slot, &u32::from(value).to_le_bytes());
            std::sync::atomic::fence(Ordering::SeqCst);
            self.ram.read(eventidx + slot, &mut b);
            let ei = u32::from_le_bytes(b) as u16;
            if value.wrapping_sub(ei).wrapping_sub(1) >= value.wrapping_sub(old) {
                return;
            }
        }
        if cq {
            self.doorbells.cq_writes += 1;
        } else {
            self.doorbells.sq_writes += 1;
        }
        self.bar.write32(reg, u32::from(value));
    }

    /// The guest RAM.
    pub fn ram(&self) -> &dyn GuestRam {
        &*self.ram
    }

    /// The BAR.
    pub fn bar(&self) -> &dyn GuestBar {
        &*self.bar
    }

    /// Allocate `len` bytes of guest RAM aligned to `align` (zeroed).
    pub fn alloc(&mut self, len: usize, align: u64) -> Result<u64, DriverError> {
        let a = self.next.next_multiple_of(align.max(1));
        let end = a + len as u64;
        if end > self.cfg.ram_base + self.cfg.ram_len {
            return Err(DriverError::OutOfMemory(len));
        }
        self.next = end;
        self.ram.write(a, &vec![0u8; len]);
        Ok(a)
    }

    /// Allocate a data buffer of `len` bytes starting `offset` bytes into its first page
    /// (dword aligned). With `scatter`, pages are non-contiguous (a gap page between each), so
    /// PRP entries cannot be merged. PRP lists are built (chained when longer than a page).
    pub fn alloc_data(
        &mut self,
        len: usize,
        offset: usize,
        scatter: bool,
    ) -> Result<DataBuf, DriverError> {
        let page = PAGE_SIZE as usize;
        let npages = (offset + len).div_ceil(page);
        let mut pages = Vec::with_capacity(npages);
        if scatter {
            for _ in 0..npages {
                pages.push(self.alloc(page, PAGE_SIZE)?);
                self.alloc(page, PAGE_SIZE)?;
            }
        } else {
            let base = self.alloc(npages * page, PAGE_SIZE)?;
            pages.extend((0..npages).map(|i| base + (i * page) as u64));
        }
        let mut segs = Vec::new();
        let mut left = len;
        for (i, &p) in pages.iter().enumerate() {
            let start = if i == 0 { offset } else { 0 };
            let n = (page - start).min(left);
            segs.push((p + start as u64, n));
            left -= n;
        }
        let prp1 = pages[0] + offset as u64;
        let prp2 = match pages.len() {
            1 => 0,
            2 => pages[1],
            _ => self.build_prp_list(&pages[1..])?,
        };
        Ok(DataBuf {
            prp1,
            prp2,
            segs,
            len,
        })
    }

    fn build_prp_list(&mut self, entries: &[u64]) -> Result<u64, DriverError> {
        let per = (PAGE_SIZE / 8) as usize;
        let first = self.alloc(PAGE_SIZE as usize, PAGE_SIZE)?;
        let mut list = first;
        let mut rest = entries;
        loop {
            if rest.len() <= per {
                let b: Vec<u8> = rest.iter().flat_map(|e| e.to_le_bytes()).collect();
                self.ram.write(list, &b);
                return Ok(first);
            }
            let next = self.alloc(PAGE_SIZE as usize, PAGE_SIZE)?;
            let mut b: Vec<u8> = rest[..per - 1]
                .iter()
                .flat_map(|e| e.to_le_bytes())
                .collect();
            b.extend_from_slice(&next.to_le_bytes());
            self.ram.write(list, &b);
            rest = &rest[per - 1..];
            list = next;
        }
    }

    fn wait_csts(&self, what: &'static str, f: impl Fn(u32) -> bool) -> Result<u32, DriverError> {
        let deadline = Instant::now() + self.cfg.timeout;
        loop {
            let c = self.bar.read32(REG_CSTS);
            if f(c) {
                return Ok(c);
            }
            if c & CSTS_CFS != 0 {
                return Err(DriverError::Fatal(c));
            }
            if Instant::now() > deadline {
                return Err(DriverError::Timeout(what));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Reset (if enabled) and enable the controller with an admin queue of `entries`.
    pub fn enable(&mut self, entries: u16) -> Result<(), DriverError> {
        if self.bar.read32(REG_CC) & CC_EN != 0 {
            self.bar.write32(REG_CC, 0);
            self.wait_csts("csts.rdy clear", |c| c & CSTS_RDY == 0)?;
        }
        let sq = self.alloc(entries as usize * SQE_SIZE as usize, PAGE_SIZE)?;
        let cq = self.alloc(entries as usize * CQE_SIZE as usize, PAGE_SIZE)?;
        let n = u32::from(entries - 1);
        self.bar.write32(REG_AQA, n | (n << 16));
        self.bar.write64(REG_ASQ, sq);
        self.bar.write64(REG_ACQ, cq);
        // IOCQES 4, IOSQES 6, MPS 0, CSS NVM, EN.
        self.bar.write32(REG_CC, (4 << 20) | (6 << 16) | CC_EN);
        self.wait_csts("csts.rdy", |c| c & CSTS_RDY != 0)?;
        self.dbbuf = None;
        self.admin = Some(Queue {
            qid: 0,
            sq,
            cq,
            size: entries,
            tail: 0,
            head: 0,
            phase: true,
            vector: 0,
            next_cid: 0,
            outstanding: 0,
            sq_bar: None,
        });
        self.io.clear();
        Ok(())
    }

    /// Normal shutdown (CC.SHN = 01) and wait for SHST = complete.
    pub fn shutdown(&mut self) -> Result<(), DriverError> {
        let cc = self.bar.read32(REG_CC);
        self.bar.write32(REG_CC, (cc & !(3 << 14)) | (1 << 14));
        self.wait_csts("shutdown", |c| c & CSTS_SHST_MASK == CSTS_SHST_COMPLETE)?;
        Ok(())
    }

    /// Disable (CC.EN = 0) and wait for RDY = 0.
    pub fn disable(&mut self) -> Result<(), DriverError> {
        self.bar.write32(REG_CC, 0);
        self.wait_csts("csts.rdy clear", |c| c & CSTS_RDY == 0)?;
        self.admin = None;
        self.io.clear();
        self.dbbuf = None;
        Ok(())
    }

    fn queue(&mut self, qid: u16) -> Result<&mut Queue, DriverError> {
        if qid == 0 {
            return self.admin.as_mut().ok_or(DriverError::NoQueue(0));
        }
        self.io
            .iter_mut()
            .find(|q| q.qid == qid)
            .ok_or(DriverError::NoQueue(qid))
    }

    /// Place `sqe` on queue `qid` (assigning its cid) without ringing the doorbell.
    pub fn push(&mut self, qid: u16, mut sqe: Sqe) -> Result<u16, DriverError> {
        let ram = self.ram.clone();
        let bar = self.bar.clone();
        let q = self.queue(qid)?;
        if q.outstanding + 1 >= q.size as usize {
            return Err(DriverError::QueueFull(qid));
        }
        let cid = q.next_cid;
        q.next_cid = q.next_cid.wrapping_add(1);
        sqe.dw[0] = (sqe.dw[0] & 0xffff) | (u32::from(cid) << 16);
        match q.sq_bar {
            Some(at) => {
                let at = at + u64::from(q.tail) * SQE_SIZE;
                for (i, w) in sqe.to_bytes().chunks_exact(4).enumerate() {
                    let v = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                    bar.write32(at + 4 * i as u64, v);
                }
            }
            None => ram.write(q.sq + u64::from(q.tail) * SQE_SIZE, &sqe.to_bytes()),
        }
        q.tail = (q.tail + 1) % q.size;
        q.outstanding += 1;
        Ok(cid)
    }

    /// Places `sqe` on queue `qid` whether or not its CQ could take the completion, as a
    /// hostile driver that never consumes its CQ does; the command is not counted as
    /// outstanding (nothing limits such a driver). Returns its cid.
    pub fn push_unchecked(&mut self, qid: u16, mut sqe: Sqe) -> Result<u16, DriverError> {
        let ram = self.ram.clone();
        let q = self.queue(qid)?;
        if q.sq_bar.is_some() {
            return Err(DriverError::NoQueue(qid));
        }
        let cid = q.next_cid;
        q.next_cid = q.next_cid.wrapping_add(1);
        sqe.dw[0] = (sqe.dw[0] & 0xffff) | (u32::from(cid) << 16);
        ram.write(q.sq + u64::from(q.tail) * SQE_SIZE, &sqe.to_bytes());
        q.tail = (q.tail + 1) % q.size;
        Ok(cid)
    }

    /// Queue `qid`'s SQ tail as the driver last stored it.
    pub fn sq_tail(&mut self, qid: u16) -> Result<u16, DriverError> {
        Ok(self.queue(qid)?.tail)
    }

    /// Ring queue `qid`'s SQ tail doorbell.
    pub fn ring(&mut self, qid: u16) -> Result<(), DriverError> {
        let tail = self.queue(qid)?.tail;
        std::sync::atomic::fence(Ordering::SeqCst);
        self.doorbell(qid, false, tail);
        Ok(())
    }

    /// Push and ring.
    pub fn submit(&mut self, qid: u16, sqe: Sqe) -> Result<u16, DriverError> {
        let cid = self.push(qid, sqe)?;
        self.ring(qid)?;
        Ok(cid)
    }

    /// Commands submitted on `qid` and not yet reaped.
    pub fn outstanding(&mut self, qid: u16) -> usize {
        self.queue(qid).map_or(0, |q| q.outstanding)
    }

    /// Take every completion currently posted on `qid`'s CQ (non-blocking).
    pub fn poll(&mut self, qid: u16, out: &mut Vec<Cqe>) -> Result<usize, DriverError> {
        let ram = self.ram.clone();
        let q = self.queue(qid)?;
        let mut n = 0;
        loop {
            let mut b = [0u8; 16];
            ram.read(q.cq + u64::from(q.head) * CQE_SIZE, &mut b);
            let e = Cqe::from_bytes(&b);
            if e.phase != q.phase {
                break;
            }
            std::sync::atomic::fence(Ordering::Acquire);
            ram.read(q.cq + u64::from(q.head) * CQE_SIZE, &mut b);
            out.push(Cqe::from_bytes(&b));
            q.head = (q.head + 1) % q.size;
            if q.head == 0 {
                q.phase = !q.phase;
            }
            q.outstanding = q.outstanding.saturating_sub(1);
            n += 1;
        }
        if n > 0 {
            let head = q.head;
            self.doorbell(qid, true, head);
        }
        Ok(n)
    }

    /// Wait until at least `min` completions were taken from `qid` into `out`.
    pub fn wait(&mut self, qid: u16, out: &mut Vec<Cqe>, min: usize) -> Result<(), DriverError> {
        let deadline = Instant::now() + self.cfg.timeout;
        let vector = self.queue(qid)?.vector;
        let mut got = 0;
        let mut spins = 0u32;
        loop {
            got += self.poll(qid, out)?;
            if got >= min {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(DriverError::Timeout("completion"));
            }
            if self.cfg.use_interrupts {
                self.irq.wait(vector, Duration::from_millis(5));
            } else {
                spins += 1;
                if spins > 64 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }

    /// Submit one command and wait for its completion (other completions are dropped).
    pub fn execute(&mut self, qid: u16, sqe: Sqe) -> Result<Cqe, DriverError> {
        let cid = self.submit(qid, sqe)?;
        let deadline = Instant::now() + self.cfg.timeout;
        let mut out = Vec::new();
        loop {
            self.wait(qid, &mut out, 1)?;
            if let Some(e) = out.iter().find(|e| e.cid == cid) {
                return Ok(*e);
            }
            out.clear();
            if Instant::now() > deadline {
                return Err(DriverError::Timeout("command"));
            }
        }
    }

    /// Execute and map an error status to [`DriverError::Status`].
    pub fn execute_ok(&mut self, qid: u16, sqe: Sqe) -> Result<Cqe, DriverError> {
        let e = self.execute(qid, sqe)?;
        if e.code() != status::SUCCESS {
            return Err(DriverError::Status {
                opcode: sqe.opcode(),
                status: e.code(),
            });
        }
        Ok(e)
    }

    fn identify(&mut self, cns: u32, nsid: u32) -> Result<Vec<u8>, DriverError> {
        let buf = self.alloc_data(4096, 0, false)?;
        let mut s = Sqe::new(admin::IDENTIFY, 0);
        s.set_nsid(nsid)
            .set_prps(buf.prp1, buf.prp2)
            .set_cdw(10, cns);
        self.execute_ok(0, s)?;
        Ok(buf.read(&*self.ram))
    }

    /// Identify Controller.
    pub fn identify_controller(&mut self) -> Result<IdController, DriverError> {
        let b = self.identify(1, 0)?;
        Ok(IdController {
            vid: u16::from_le_bytes([b[0], b[1]]),
            serial: trim(&b[4..24]),
            model: trim(&b[24..64]),
            firmware: trim(&b[64..72]),
            mdts: b[77],
            ver: u32::from_le_bytes([b[80], b[81], b[82], b[83]]),
            sqes: b[512],
            cqes: b[513],
            nn: u32::from_le_bytes([b[516], b[517], b[518], b[519]]),
            oncs: u16::from_le_bytes([b[520], b[521]]),
            oacs: u16::from_le_bytes([b[256], b[257]]),
            vwc: b[525],
        })
    }

    /// Identify Namespace: (size in blocks, block size).
    pub fn identify_namespace(&mut self, nsid: u32) -> Result<(u64, u32), DriverError> {
        let b = self.identify(0, nsid)?;
        let nsze = u64::from_le_bytes(b[0..8].try_into().unwrap_or([0; 8]));
        let flbas = (b[26] & 0xf) as usize;
        let lbaf = u32::from_le_bytes(
            b[128 + 4 * flbas..132 + 4 * flbas]
                .try_into()
                .unwrap_or([0; 4]),
        );
        Ok((nsze, 1u32 << ((lbaf >> 16) & 0xff)))
    }

    /// Active namespace ids.
    pub fn active_namespaces(&mut self) -> Result<Vec<u32>, DriverError> {
        let b = self.identify(2, 0)?;
        Ok(b.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .take_while(|&n| n != 0)
            .collect())
    }

    /// Namespace identification descriptors: (type, id bytes).
    pub fn ns_descriptors(&mut self, nsid: u32) -> Result<Vec<(u8, Vec<u8>)>, DriverError> {
        let b = self.identify(3, nsid)?;
        let mut v = Vec::new();
        let mut off = 0;
        while off + 4 <= b.len() && b[off] != 0 {
            let len = b[off + 1] as usize;
            if off + 4 + len > b.len() {
                break;
            }
            v.push((b[off], b[off + 4..off + 4 + len].to_vec()));
            off += 4 + len;
        }
        Ok(v)
    }

    /// Set Features Number of Queues; returns the (SQ, CQ) counts granted (1-based).
    pub fn set_num_queues(&mut self, n: u16) -> Result<(u16, u16), DriverError> {
        let mut s = Sqe::new(admin::SET_FEATURES, 0);
        let v = u32::from(n - 1);
        s.set_cdw(10, u32::from(feat::NUM_QUEUES))
            .set_cdw(11, v | (v << 16));
        let e = self.execute_ok(0, s)?;
        Ok(((e.dw0 & 0xffff) as u16 + 1, (e.dw0 >> 16) as u16 + 1))
    }

    /// Create I/O CQ + SQ `qid` with `entries` entries, interrupts on `vector`.
    pub fn create_io_queue_pair(
        &mut self,
        qid: u16,
        entries: u16,
        vector: u16,
    ) -> Result<(), DriverError> {
        let cq = self.alloc(entries as usize * CQE_SIZE as usize, PAGE_SIZE)?;
        let sq = self.alloc(entries as usize * SQE_SIZE as usize, PAGE_SIZE)?;
        let qs = u32::from(qid) | (u32::from(entries - 1) << 16);
        let mut c = Sqe::new(admin::CREATE_CQ, 0);
        c.set_prps(cq, 0)
            .set_cdw(10, qs)
            .set_cdw(11, 1 | 2 | (u32::from(vector) << 16));
        self.execute_ok(0, c)?;
        let mut s = Sqe::new(admin::CREATE_SQ, 0);
        s.set_prps(sq, 0)
            .set_cdw(10, qs)
            .set_cdw(11, 1 | (u32::from(qid) << 16));
        self.execute_ok(0, s)?;
        self.io.push(Queue {
            qid,
            sq,
            cq,
            size: entries,
            tail: 0,
            head: 0,
            phase: true,
            vector,
            next_cid: 0,
            outstanding: 0,
            sq_bar: None,
        });
        Ok(())
    }

    /// Turns the Controller Memory Buffer on the NVMe 1.4 way, as Linux's `nvme_map_cmb`
    /// does: CMBMSC.CRE, read CMBSZ and CMBLOC, then CMBMSC = CRE | CMSE | `cba` (the bus
    /// address the host gives the buffer). Returns (BAR0 offset, size, CMBSZ), or `None`
    /// when CAP.CMBS is clear or CMBSZ stays 0.
    pub fn enable_cmb(&mut self, cba: u64) -> Result<Option<(u64, u64, u32)>, DriverError> {
        use crate::nvme::cmb::{CAP_CMBS, CMBMSC_CMSE, CMBMSC_CRE};
        if self.bar.read64(REG_CAP) & CAP_CMBS == 0 {
            return Ok(None);
        }
        self.bar.write64(REG_CMBMSC, CMBMSC_CRE);
        // The controller applies the store on its next pass (at once through an exact
        // BAR write): wait for CMBSZ, bounded.
        let t0 = std::time::Instant::now();
        let sz = loop {
            let sz = self.bar.read32(REG_CMBSZ);
            if sz != 0 {
                break sz;
            }
            if t0.elapsed() > self.cfg.timeout {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_micros(100));
        };
        let loc = self.bar.read32(REG_CMBLOC);
        let unit = 4096u64 << (4 * ((sz >> 8) & 0xf));
        let size = u64::from(sz >> 12) * unit;
        let offset = u64::from(loc >> 12) * unit;
        self.bar.write64(REG_CMBMSC, CMBMSC_CRE | CMBMSC_CMSE | cba);
        Ok(Some((offset, size, sz)))
    }

    /// Create I/O CQ `qid` in RAM and its SQ in the CMB at BAR0 offset `sq_bar` (bus address
    /// `sq_bus`), with `entries` entries, interrupts on `vector`.
    pub fn create_io_queue_pair_cmb(
        &mut self,
        qid: u16,
        entries: u16,
        vector: u16,
        sq_bar: u64,
        sq_bus: u64,
    ) -> Result<(), DriverError> {
        let cq = self.alloc(entries as usize * CQE_SIZE as usize, PAGE_SIZE)?;
        let qs = u32::from(qid) | (u32::from(entries - 1) << 16);
        let mut c = Sqe::new(admin::CREATE_CQ, 0);
        c.set_prps(cq, 0)
            .set_cdw(10, qs)
            .set_cdw(11, 1 | 2 | (u32::from(vector) << 16));
        self.execute_ok(0, c)?;
        let mut s = Sqe::new(admin::CREATE_SQ, 0);
        s.set_prps(sq_bus, 0)
            .set_cdw(10, qs)
            .set_cdw(11, 1 | (u32::from(qid) << 16));
        self.execute_ok(0, s)?;
        self.io.push(Queue {
            qid,
            sq: sq_bus,
            cq,
            size: entries,
            tail: 0,
            head: 0,
            phase: true,
            vector,
            next_cid: 0,
            outstanding: 0,
            sq_bar: Some(sq_bar),
        });
        Ok(())
    }

    /// Stores `data` (a multiple of 4 bytes) at BAR0 offset `off` (the CMB), 32 bits at a
    /// time.
    pub fn bar_write_bytes(&self, off: u64, data: &[u8]) {
        for (i, w) in data.chunks_exact(4).enumerate() {
            self.bar.write32(
                off + 4 * i as u64,
                u32::from_le_bytes([w[0], w[1], w[2], w[3]]),
            );
        }
    }

    /// Loads `len` bytes (a multiple of 4) at BAR0 offset `off`.
    pub fn bar_read_bytes(&self, off: u64, len: usize) -> Vec<u8> {
        (0..len as u64 / 4)
            .flat_map(|i| self.bar.read32(off + 4 * i).to_le_bytes())
            .collect()
    }

    /// Delete I/O SQ then CQ `qid`.
    pub fn delete_io_queue_pair(&mut self, qid: u16) -> Result<(), DriverError> {
        let mut s = Sqe::new(admin::DELETE_SQ, 0);
        s.set_cdw(10, u32::from(qid));
        self.execute_ok(0, s)?;
        let mut c = Sqe::new(admin::DELETE_CQ, 0);
        c.set_cdw(10, u32::from(qid));
        self.execute_ok(0, c)?;
        self.io.retain(|q| q.qid != qid);
        Ok(())
    }

    /// A Read/Write SQE for `nlb` blocks at `lba` into/from `buf`.
    pub fn rw_sqe(write: bool, lba: u64, nlb: u32, buf: &DataBuf) -> Sqe {
        let mut s = Sqe::new(if write { io::WRITE } else { io::READ }, 0);
        s.set_nsid(1)
            .set_prps(buf.prp1, buf.prp2)
            .set_cdw(10, lba as u32)
            .set_cdw(11, (lba >> 32) as u32)
            .set_cdw(12, nlb - 1);
        s
    }

    /// Synchronous read or write of `nlb` blocks.
    pub fn rw(
        &mut self,
        qid: u16,
        write: bool,
        lba: u64,
        nlb: u32,
        buf: &DataBuf,
    ) -> Result<Cqe, DriverError> {
        self.execute(qid, Self::rw_sqe(write, lba, nlb, buf))
    }

    /// Flush namespace 1.
    pub fn flush(&mut self, qid: u16) -> Result<(), DriverError> {
        let mut s = Sqe::new(io::FLUSH, 0);
        s.set_nsid(1);
        self.execute_ok(qid, s).map(|_| ())
    }
}

/// A complete in-process setup: controller + test RAM + counting interrupts + driver.
pub struct LocalRig {
    /// The controller.
    pub ctrl: Arc<crate::nvme::NvmeController>,
    /// Guest RAM.
    pub mem: Arc<TestMemory>,
    /// Interrupts.
    pub irq: Arc<CountingInterrupts>,
    /// Register memory.
    pub regs: Arc<crate::regs::HeapRegisters>,
    /// Driver (controller not yet enabled).
    pub driver: NvmeDriver,
}

impl LocalRig {
    /// Build and start a controller from `cfg` over `ram_len` bytes of test RAM (all of it
    /// DMA-visible), with the driver allocating from `[1 MiB, ram_len)`. In interrupt mode
    /// the driver's BAR stores signal the doorbell eventfd; in polling mode they do not.
    pub fn new(
        cfg: crate::nvme::NvmeConfig,
        ram_len: usize,
        use_interrupts: bool,
    ) -> Result<Self, crate::DeviceError> {
        Self::with_memory(cfg, TestMemory::new(ram_len), use_interrupts)
    }

    /// As [`LocalRig::new`] with a caller-made [`TestMemory`].
    pub fn with_memory(
        cfg: crate::nvme::NvmeConfig,
        mem: Arc<TestMemory>,
        use_interrupts: bool,
    ) -> Result<Self, crate::DeviceError> {
        let notify = cfg.notify;
        let vectors = cfg.msix_vectors;
        let regs = Arc::new(crate::regs::HeapRegisters::new(
            crate::nvme::cmb::bar0_size(cfg.cmb_size) as usize,
        ));
        let irq = CountingInterrupts::new(vectors);
        let ctrl = Arc::new(crate::nvme::NvmeController::new(
            cfg,
            regs.clone(),
            mem.clone(),
            irq.clone(),
        )?);
        ctrl.start()?;
        let doorbell = if notify == crate::NotifyMode::Interrupt {
            Some(ctrl.doorbell_event())
        } else {
            None
        };
        let bar =
            DirectBar::new(regs.clone(), doorbell).map_err(|source| crate::DeviceError::Os {
                what: "dup doorbell eventfd",
                source,
            })?;
        let driver = NvmeDriver::new(
            Arc::new(bar),
            mem.clone(),
            irq.clone(),
            DriverConfig {
                ram_base: 1 << 20,
                ram_len: mem.len() as u64 - (1 << 20),
                use_interrupts,
                timeout: Duration::from_secs(10),
            },
        );
        Ok(LocalRig {
            ctrl,
            mem,
            irq,
            regs,
            driver,
        })
    }
}
