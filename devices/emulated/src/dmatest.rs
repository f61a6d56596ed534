//! `dmatest`: a tiny copy engine (in the spirit of QEMU's `edu`) for exercising the DMA and
//! interrupt paths of a lent device.
//!
//! BAR0 (64 KiB, register memory): the registers in the first 4 KiB, then a 60 KiB data
//! buffer ([`BUF_OFFSET`], [`BUF_SIZE`]). The buffer size is configurable
//! ([`DmaTest::with_buffer`], lenderd's `dmatest:buf=64M`): BAR0 is then the next power of
//! two above 4 KiB + the buffer, and a copy may be as long as the buffer (at least
//! [`MAX_LEN`], at most [`MAX_BIG_COPY`]). A BAR0 over [`LARGE_BAR`] is a 64-bit prefetchable
//! BAR, the shape of a GPU's aperture (up to [`MAX_BUF_SIZE`]: 128 GiB), and the MSI-X BAR
//! moves from index 1 to 2. Such a buffer is sparse: it costs memory only where written, and
//! a reset gives its pages back rather than writing zeroes over it. The buffer is plain
//! memory: the guest reads it
//! directly and writes it through the exact BAR write path, and because BAR0 lives in
//! shareable memory (a memfd on the lender) another device's DMA can reach it peer-to-peer
//! when the lender maps this BAR into that device's IOMMU domain.
//!
//! | offset | register | access |
//! |---|---|---|
//! | 0x00 | ID = 0x544d_4144 ("DAMT" little endian: 'D','A','M','T') | RO |
//! | 0x04 | STATUS: bit 0 busy, bit 1 done, bit 2 error | RO |
//! | 0x08 | SRC_IOVA (64-bit) | RW |
//! | 0x10 | DST_IOVA (64-bit) | RW |
//! | 0x18 | LEN (bytes, at most [`MAX_LEN`]) | RW |
//! | 0x1c | IRQ_VECTOR (MSI-X vector raised on completion) | RW |
//! | 0x20 | CMD: write [`CMD_START`] to copy, [`CMD_ACK`] to clear done/error and deassert INTx; with [`CMD_SRC_BUF`] / [`CMD_DST_BUF`] SRC / DST are offsets into the device's own buffer instead of bus addresses; reads 0 once accepted | RW |
//! | 0x24 | FAULTS: DMA accesses refused so far | RO |
//! | 0x28 | COMPLETED: copies finished (ok or error) | RO |
//!
//! A copy whose source or destination is outside the DMA window (bus addresses that are
//! neither mapped RAM nor a peer BAR mapped by the lender) or outside the buffer completes
//! with STATUS.error set, FAULTS incremented, and nothing written. Buffer offsets and the
//! length of a buffer copy must be multiples of 8.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vmm_sys_util::eventfd::EventFd;

use crate::dma::DmaMemory;
use crate::irq::{InterruptMode, InterruptSink};
use crate::model::{
    build_config_space, BarInfo, DeviceError, DeviceModel, DoorbellRange, MsixInfo, PciIdentity,
    ResizableBar,
};
use crate::regs::RegisterMemory;
use crate::waiter::{WaitState, Waiter};
use crate::NotifyMode;

/// ID register offset.
pub const REG_ID: u64 = 0x00;
/// STATUS register offset.
pub const REG_STATUS: u64 = 0x04;
/// SRC_IOVA register offset.
pub const REG_SRC: u64 = 0x08;
/// DST_IOVA register offset.
pub const REG_DST: u64 = 0x10;
/// LEN register offset.
pub const REG_LEN: u64 = 0x18;
/// IRQ_VECTOR register offset.
pub const REG_IRQ_VECTOR: u64 = 0x1c;
/// CMD register offset.
pub const REG_CMD: u64 = 0x20;
/// FAULTS register offset.
pub const REG_FAULTS: u64 = 0x24;
/// COMPLETED register offset.
pub const REG_COMPLETED: u64 = 0x28;
/// ID value.
pub const DMATEST_ID: u32 = 0x544d_4144;
/// STATUS.busy.
pub const STATUS_BUSY: u32 = 1;
/// STATUS.done.
pub const STATUS_DONE: u32 = 2;
/// STATUS.error.
pub const STATUS_ERROR: u32 = 4;
/// CMD: start a copy.
pub const CMD_START: u32 = 1;
/// CMD: acknowledge completion.
pub const CMD_ACK: u32 = 2;
/// CMD: SRC is an offset into the device's own buffer.
pub const CMD_SRC_BUF: u32 = 4;
/// CMD: DST is an offset into the device's own buffer.
pub const CMD_DST_BUF: u32 = 8;
/// Largest copy (with a bigger buffer: the buffer's size).
pub const MAX_LEN: u32 = 1 << 20;
/// Largest configurable buffer: an H100's aperture BAR is 128 GiB at most.
pub const MAX_BUF_SIZE: u64 = 128 << 30;
/// A BAR0 larger than this is 64-bit and prefetchable (it could not fit the 32-bit window).
pub const LARGE_BAR: u64 = 256 << 20;
/// Longest copy of a large buffer: the staging buffer grows to the longest copy made, and a
/// device must not cost its whole aperture again in heap.
pub const MAX_BIG_COPY: u64 = 256 << 20;

/// BAR0's size for a buffer of `buf` bytes: the next power of two above the registers and
/// the buffer.
pub fn bar0_size_for(buf: u64) -> u64 {
    (BUF_OFFSET + buf).next_power_of_two()
}
/// BAR0 size (registers, then the buffer).
pub const BAR0_SIZE: u64 = 0x10000;
/// Offset of the data buffer in BAR0.
pub const BUF_OFFSET: u64 = 0x1000;
/// Size of the data buffer.
pub const BUF_SIZE: u64 = BAR0_SIZE - BUF_OFFSET;
/// MSI-X vectors.
pub const VECTORS: u16 = 2;

/// The engine's only per-guest state: one copy at a time, started by a CMD store (a store
/// while busy is kept in the register, not queued); each copy moves at most `MAX_LEN` (or
/// the buffer's size) bytes. Nothing here grows with the guest's requests.
#[derive(Default)]
struct State {
    status: u32,
    faults: u32,
    completed: u32,
}

struct Inner {
    regs: Arc<dyn RegisterMemory>,
    dma: Arc<dyn DmaMemory>,
    irq: Arc<dyn InterruptSink>,
    doorbell: EventFd,
    stop: AtomicBool,
    state: Mutex<State>,
    notify: NotifyMode,
    wait: Arc<WaitState>,
    /// Copies the DMA window refused (for the log rate limit).
    refused: AtomicU64,
    /// Size of the data buffer at [`BUF_OFFSET`] the guest sees now: less than `buf_max`
    /// after the driver made a resizable BAR0 smaller ([`DmaTest::with_resizable_bar0`]).
    buf_size: AtomicU64,
    /// Size of the data buffer the register memory holds.
    buf_max: u64,
    /// Whether BAR0 offers the Resizable BAR sizes (1 MiB up to the whole buffer).
    resizable: bool,
    /// The copy's staging buffer when the bytes cannot move directly ([`Inner::move_bytes`]),
    /// kept between copies so a copy does not allocate and fault in fresh pages each time (a
    /// 64 MiB copy spent most of its time there). It grows to the
    /// longest copy made, which is bounded by the copy limit (the larger of [`MAX_LEN`] and
    /// the buffer's size, at most [`MAX_BIG_COPY`]): a device costs at most that again once a
    /// guest made such a copy. Only the worker thread takes it.
    bounce: Mutex<Vec<u8>>,
}

/// Why a copy was refused (logged rate-limited; the guest sees STATUS.error).
#[derive(Debug, thiserror::Error)]
enum CopyError {
    #[error(transparent)]
    Dma(#[from] crate::dma::DmaFault),
    /// The register memory refused a bulk access of the buffer (it is smaller than the
    /// device was built for).
    #[error("buffer {op} of {len:#x} bytes at {at:#x} refused")]
    Buffer {
        op: &'static str,
        len: usize,
        at: u64,
    },
}

impl Inner {
    fn publish(&self, s: &State) {
        self.regs.write32(REG_ID, DMATEST_ID);
        self.regs.write32(REG_STATUS, s.status);
        self.regs.write32(REG_FAULTS, s.faults);
        self.regs.write32(REG_COMPLETED, s.completed);
    }

    fn pass(&self) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if self.regs.read32(REG_ID) != DMATEST_ID
            || self.regs.read32(REG_STATUS) != s.status
            || self.regs.read32(REG_FAULTS) != s.faults
            || self.regs.read32(REG_COMPLETED) != s.completed
        {
            self.publish(&s);
        }
        // Taken and cleared in one step: a second CMD store right behind the first is kept
        // for the next pass instead of being cleared unseen.
        let cmd = self.regs.swap32(REG_CMD, 0);
        if cmd == 0 {
            return false;
        }
        if cmd & CMD_ACK != 0 {
            s.status &= !(STATUS_DONE | STATUS_ERROR);
            if self.irq.mode() == InterruptMode::Intx {
                self.irq.set_intx(false);
            }
        }
        if cmd & CMD_START != 0 {
            s.status = STATUS_BUSY;
            self.publish(&s);
            let ok = self.copy(cmd);
            s.status = if ok { STATUS_DONE } else { STATUS_ERROR };
            if !ok {
                s.faults = s.faults.wrapping_add(1);
            }
            s.completed = s.completed.wrapping_add(1);
            self.publish(&s);
            match self.irq.mode() {
                InterruptMode::MsiX { vectors } => {
                    let v = self.regs.read32(REG_IRQ_VECTOR) as u16;
                    if v < vectors {
                        self.irq.signal_msix(v);
                    }
                }
                InterruptMode::Intx => self.irq.set_intx(true),
                InterruptMode::None => {}
            }
        } else {
            self.publish(&s);
        }
        true
    }

    /// The BAR0 offset of `[off, off + len)` of the buffer, if it lies inside it and is
    /// 8-byte aligned.
    fn buf_range(&self, off: u64, len: u64) -> Option<u64> {
        let end = off.checked_add(len)?;
        (end <= self.buf_size.load(Ordering::Acquire)
            && off.is_multiple_of(8)
            && len.is_multiple_of(8))
        .then_some(BUF_OFFSET + off)
    }

    /// The buffer's bytes at `at` (checked by [`Inner::buf_range`]), in one bulk copy.
    fn buf_read(&self, at: u64, out: &mut [u8]) -> Result<(), CopyError> {
        self.regs
            .read_bytes(at, out)
            .then_some(())
            .ok_or(CopyError::Buffer {
                op: "read",
                len: out.len(),
                at,
            })
    }

    fn buf_write(&self, at: u64, data: &[u8]) -> Result<(), CopyError> {
        self.regs
            .write_bytes(at, data)
            .then_some(())
            .ok_or(CopyError::Buffer {
                op: "write",
                len: data.len(),
                at,
            })
    }

    /// Moves `len` bytes from `src` to `dst`, each either the buffer at a checked BAR0 offset
    /// (`Some`) or a DMA address. Where the buffer is memory of this process the bytes move
    /// once, straight between it and the memory behind the DMA address (a peer's BAR on the
    /// same lender, guest RAM on shm), as a DMA engine moves them; otherwise (and for a
    /// DMA-to-DMA copy) they are staged in `scratch`.
    fn move_bytes(
        &self,
        src: u64,
        src_buf: Option<u64>,
        dst: u64,
        dst_buf: Option<u64>,
        len: usize,
        scratch: &mut Vec<u8>,
    ) -> Result<(), CopyError> {
        let span = |at: Option<u64>| at.and_then(|at| self.regs.raw_span(at, len));
        match (span(src_buf), span(dst_buf)) {
            (Some(s), Some(d)) => {
                s.copy_to_span(d);
                Ok(())
            }
            (Some(s), None) if dst_buf.is_none() => self
                .dma
                .write_from(dst, s, scratch)
                .map_err(CopyError::from),
            (None, Some(d)) if src_buf.is_none() => {
                self.dma.read_into(src, d, scratch).map_err(CopyError::from)
            }
            _ => {
                let buf = crate::dma::staging(scratch, len);
                match src_buf {
                    Some(at) => self.buf_read(at, buf),
                    None => self.dma.read(src, buf).map_err(CopyError::from),
                }?;
                match dst_buf {
                    Some(at) => self.buf_write(at, buf),
                    None => self.dma.write(dst, buf).map_err(CopyError::from),
                }
            }
        }
    }

    fn copy(&self, cmd: u32) -> bool {
        let src = self.regs.read64(REG_SRC);
        let dst = self.regs.read64(REG_DST);
        let len = self.regs.read32(REG_LEN);
        let buf_size = self.buf_size.load(Ordering::Acquire);
        let max = u64::from(MAX_LEN).max(buf_size.min(MAX_BIG_COPY));
        if u64::from(len) > max {
            log::warn!("dmatest: length {len:#x} exceeds the {max:#x} maximum");
            return false;
        }
        let in_buf = |flag: u32, off: u64| {
            if cmd & flag == 0 {
                return Some(None);
            }
            self.buf_range(off, u64::from(len)).map(Some)
        };
        let (Some(src_buf), Some(dst_buf)) = (in_buf(CMD_SRC_BUF, src), in_buf(CMD_DST_BUF, dst))
        else {
            let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
            if n <= 16 || n.is_multiple_of(1024) {
                log::warn!(
                    "dmatest: buffer copy src {src:#x} dst {dst:#x} len {len:#x} is outside \
                     the {:#x}-byte buffer or not 8-byte aligned (refused copy #{n})",
                    buf_size
                );
            }
            return false;
        };
        let mut scratch = self.bounce.lock().unwrap_or_else(|p| p.into_inner());
        let r = self.move_bytes(src, src_buf, dst, dst_buf, len as usize, &mut scratch);
        if let Err(e) = r {
            // A guest can loop on refused copies: the first 16, then one in 1024.
            let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
            if n <= 16 || n.is_multiple_of(1024) {
                log::warn!("dmatest: {e} (refused copy #{n})");
            }
            return false;
        }
        true
    }

    fn run(&self) {
        let mut w = Waiter::new(self.notify, Arc::clone(&self.wait));
        while !self.stop.load(Ordering::Acquire) {
            if self.pass() {
                w.busy();
                continue;
            }
            w.wait(&[&self.doorbell], None, None);
        }
    }
}

/// The dmatest device.
pub struct DmaTest {
    inner: Arc<Inner>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl DmaTest {
    /// The MSI-X BAR: 1, or 2 when BAR0 is a 64-bit BAR (which takes slots 0 and 1).
    fn msix_bar(&self) -> u8 {
        if self.large() {
            2
        } else {
            1
        }
    }

    /// Create the device over `regs` (at least [`BAR0_SIZE`] bytes).
    pub fn new(
        regs: Arc<dyn RegisterMemory>,
        dma: Arc<dyn DmaMemory>,
        irq: Arc<dyn InterruptSink>,
        notify: NotifyMode,
    ) -> Result<Self, DeviceError> {
        Self::with_buffer(regs, dma, irq, notify, BUF_SIZE)
    }

    /// Create the device with a data buffer of `buf_size` bytes (a multiple of 4 KiB, at
    /// most [`MAX_BUF_SIZE`]) over `regs` (at least [`bar0_size_for`] bytes).
    pub fn with_buffer(
        regs: Arc<dyn RegisterMemory>,
        dma: Arc<dyn DmaMemory>,
        irq: Arc<dyn InterruptSink>,
        notify: NotifyMode,
        buf_size: u64,
    ) -> Result<Self, DeviceError> {
        if buf_size == 0 || !buf_size.is_multiple_of(0x1000) || buf_size > MAX_BUF_SIZE {
            return Err(DeviceError::InvalidConfig(format!(
                "dmatest buffer of {buf_size:#x} bytes: it must be a multiple of 4 KiB, at \
                 most {MAX_BUF_SIZE:#x}"
            )));
        }
        let need = bar0_size_for(buf_size);
        if (regs.len() as u64) < need {
            return Err(DeviceError::RegisterMemoryTooSmall {
                got: regs.len(),
                need: need as usize,
            });
        }
        let doorbell = EventFd::new(libc::EFD_NONBLOCK).map_err(|source| DeviceError::Os {
            what: "doorbell eventfd",
            source,
        })?;
        let inner = Inner {
            regs,
            dma,
            irq,
            doorbell,
            stop: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            notify,
            wait: WaitState::new().map_err(|source| DeviceError::Os {
                what: "worker wake eventfd",
                source,
            })?,
            refused: AtomicU64::new(0),
            buf_size: AtomicU64::new(buf_size),
            buf_max: buf_size,
            resizable: false,
            bounce: Mutex::new(Vec::new()),
        };
        inner.publish(&State::default());
        Ok(DmaTest {
            inner: Arc::new(inner),
            thread: Mutex::new(None),
        })
    }
}

impl DmaTest {
    /// Smallest size a resizable BAR0 offers (the capability's smallest encoding).
    pub const MIN_RESIZED_BAR0: u64 = 1 << 20;

    /// Makes BAR0 resizable, the way a GPU's aperture is: a 64-bit prefetchable BAR
    /// offering every power of two from 1 MiB to the whole buffer ([`bar0_size_for`] its
    /// size, which must then be a power of two less the registers' 4 KiB), `initial`
    /// bytes until the driver picks another. The buffer the guest sees is the BAR less the
    /// registers; what lies past it is kept. Before [`DeviceModel::start`] only.
    pub fn with_resizable_bar0(mut self, initial: u64) -> Result<Self, DeviceError> {
        let inner = Arc::get_mut(&mut self.inner).ok_or_else(|| {
            DeviceError::InvalidConfig("dmatest: made resizable after it started".into())
        })?;
        let max = BUF_OFFSET + inner.buf_max;
        if !max.is_power_of_two() || max < Self::MIN_RESIZED_BAR0 {
            return Err(DeviceError::InvalidConfig(format!(
                "a resizable dmatest needs a buffer of a power of two less 4K and at least                  1M less 4K (a whole BAR0 of 1M, 2M, ...); {:#x} bytes is not",
                inner.buf_max
            )));
        }
        if !initial.is_power_of_two() || !(Self::MIN_RESIZED_BAR0..=max).contains(&initial) {
            return Err(DeviceError::InvalidConfig(format!(
                "a resizable dmatest's BAR0 starts at a power of two from 1M to its whole                  size ({max:#x}); {initial:#x} bytes is not"
            )));
        }
        inner.resizable = true;
        inner
            .buf_size
            .store(initial - BUF_OFFSET, Ordering::Release);
        Ok(self)
    }

    /// Whether BAR0 is 64-bit prefetchable (a large or resizable aperture).
    fn large(&self) -> bool {
        self.inner.resizable || bar0_size_for(self.inner.buf_max) > LARGE_BAR
    }

    fn bar0_size(&self) -> u64 {
        if self.inner.resizable {
            BUF_OFFSET + self.inner.buf_size.load(Ordering::Acquire)
        } else {
            bar0_size_for(self.inner.buf_max)
        }
    }
}

impl DeviceModel for DmaTest {
    fn name(&self) -> &str {
        "dmatest"
    }

    fn polls_doorbells(&self) -> bool {
        self.inner.notify == NotifyMode::Polling
    }

    fn resizable_bars(&self) -> Vec<ResizableBar> {
        if !self.inner.resizable {
            return Vec::new();
        }
        let max = BUF_OFFSET + self.inner.buf_max;
        // Bits 0 (1 MiB) up to log2(max) - 20.
        let top = max.trailing_zeros() - 20;
        vec![ResizableBar {
            index: 0,
            sizes: (1u64 << (top + 1)) - 1,
            current: self.bar0_size(),
        }]
    }

    fn resize_bar(&self, bar: u8, size: u64) -> Result<(), DeviceError> {
        let offered = self.resizable_bars();
        match offered.iter().find(|r| r.index == bar) {
            Some(r) if r.offers(size) => {
                self.inner
                    .buf_size
                    .store(size - BUF_OFFSET, Ordering::Release);
                log::info!("dmatest: bar 0 is now {size:#x} bytes");
                Ok(())
            }
            Some(r) => Err(DeviceError::InvalidConfig(format!(
                "dmatest bar 0 offers sizes {:#x} (bit n: 1 MiB << n), not {size:#x} bytes",
                r.sizes
            ))),
            None => Err(DeviceError::InvalidConfig(format!(
                "dmatest bar {bar} is not resizable"
            ))),
        }
    }

    fn peer_memory(&self, bar: u8) -> Option<(u64, u64)> {
        // The buffer only: peers never reach the registers.
        (bar == 0).then_some((BUF_OFFSET, self.inner.buf_size.load(Ordering::Acquire)))
    }

    fn identity(&self) -> PciIdentity {
        PciIdentity {
            vendor_id: 0x1b36,
            device_id: 0x1105,
            subsystem_vendor_id: 0x1b36,
            subsystem_id: 0x1105,
            class: 0x08,
            subclass: 0x80,
            prog_if: 0,
            revision: 1,
        }
    }

    fn bars(&self) -> Vec<BarInfo> {
        let size = self.bar0_size();
        let large = self.large();
        vec![
            BarInfo {
                index: 0,
                size,
                is_64bit: large,
                prefetchable: large,
                register_memory: true,
                // SRC, DST, LEN, IRQ_VECTOR and CMD are plain values read when CMD is seen
                // (`bar_write` only stores them): store + notify is exact. ID, STATUS, FAULTS
                // and COMPLETED are read-only and must not be stored by the borrower.
                doorbells: Some(DoorbellRange {
                    offset: REG_SRC,
                    len: REG_CMD + 4 - REG_SRC,
                }),
            },
            BarInfo {
                index: self.msix_bar(),
                size: 0x1000,
                is_64bit: false,
                prefetchable: false,
                register_memory: false,
                doorbells: None,
            },
        ]
    }

    fn msix(&self) -> Option<MsixInfo> {
        let bar = self.msix_bar();
        Some(MsixInfo {
            vectors: VECTORS,
            table_bar: bar,
            table_offset: 0,
            pba_bar: bar,
            pba_offset: 0x800,
        })
    }

    fn intx_pin(&self) -> u8 {
        1
    }

    fn config_space(&self) -> [u8; 256] {
        build_config_space(&self.identity(), &self.bars(), self.msix().as_ref(), 1)
    }

    fn doorbell_event(&self) -> &EventFd {
        &self.inner.doorbell
    }

    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if bar != 0 {
            return;
        }
        match data.len() {
            8 => data.copy_from_slice(&self.inner.regs.read64(offset).to_le_bytes()),
            4 => data.copy_from_slice(&self.inner.regs.read32(offset).to_le_bytes()),
            _ => {}
        }
    }

    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) {
        if bar != 0 || matches!(offset, REG_ID | REG_STATUS | REG_FAULTS | REG_COMPLETED) {
            return;
        }
        match data.len() {
            8 => self.inner.regs.write64(
                offset,
                u64::from_le_bytes(data.try_into().unwrap_or([0; 8])),
            ),
            4 => self.inner.regs.write32(
                offset,
                u32::from_le_bytes(data.try_into().unwrap_or([0; 4])),
            ),
            _ => return,
        }
        if offset == REG_CMD {
            let _ = self.inner.doorbell.write(1);
        }
    }

    fn start(&self) -> Result<(), DeviceError> {
        let mut t = self.thread.lock().unwrap_or_else(|p| p.into_inner());
        if t.is_some() {
            return Ok(());
        }
        let inner = self.inner.clone();
        *t = Some(
            std::thread::Builder::new()
                .name("dmatest".into())
                .spawn(move || inner.run())
                .map_err(|source| DeviceError::Os {
                    what: "spawn dmatest thread",
                    source,
                })?,
        );
        Ok(())
    }

    fn reset(&self) {
        let mut s = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
        *s = State::default();
        for r in [REG_SRC, REG_DST] {
            self.inner.regs.write64(r, 0);
        }
        for r in [REG_LEN, REG_IRQ_VECTOR, REG_CMD] {
            self.inner.regs.write32(r, 0);
        }
        // The buffer too: the next borrower must not read the last one's data. Memory
        // shared from a memfd (the lender's) gives its pages back: a sparse 64 GiB buffer
        // costs nothing to clear.
        // All of it: a resizable BAR0 keeps what lies past its current size.
        if !self.inner.regs.zero_bytes(BUF_OFFSET, self.inner.buf_max) {
            log::warn!("dmatest: the buffer is outside the register memory; not cleared");
        }
        self.inner.publish(&s);
        self.inner.irq.set_intx(false);
    }

    fn intx_resample(&self) {
        // INTx stays asserted from a completion until CMD_ACK clears done/error.
        let s = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.status & (STATUS_DONE | STATUS_ERROR) != 0
            && self.inner.irq.mode() == InterruptMode::Intx
        {
            self.inner.irq.set_intx(true);
        }
    }

    fn doorbell_kicks(&self) -> u64 {
        self.inner.wait.kicks()
    }

    fn quiesce(&self, stop: bool) {
        self.inner.wait.quiesce("dmatest", stop);
    }

    /// A copy runs inside one pass of the worker: parked at the gate, none is running.
    fn drain(&self, timeout: std::time::Duration) -> bool {
        let running = self
            .thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some();
        self.inner
            .wait
            .wait_parked(running, std::time::Instant::now() + timeout)
    }
}

impl Drop for DmaTest {
    fn drop(&mut self) {
        let h = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = h {
            self.inner.stop.store(true, Ordering::Release);
            self.inner.wait.quiesce("dmatest", false);
            self.inner.wait.wake();
            let _ = h.join();
        }
    }
}
