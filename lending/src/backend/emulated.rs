//! Hosts any emulated device model ([`emulated::DeviceModel`]) as a lendable function.

use std::sync::{Arc, Mutex};

use emulated::dmatest::DmaTest;
use emulated::nvme::{NvmeConfig, NvmeController};
use emulated::{
    DeviceError, DeviceModel, DmaMemory, InterruptSink, MappedRegisters, NotifyMode, RegisterMemory,
};
use ntb::SharedMemory;
use vmm_sys_util::eventfd::EventFd;

use super::config::CMD_BUS_MASTER;
use super::irq::LeaseIrqs;
use super::{BackendError, BarExport, DeviceBackend, IrqTrigger};
use crate::iommu::{IommuDomain, SoftIommu};

/// Start of extended config space.
const EXT_START: usize = 0x100;
/// A PCIe function's config space with extended capabilities.
const EXT_CONFIG_SIZE: usize = 0x1000;
use crate::protocol::{
    BarDesc, DeviceInfo, DoorbellKicks, IrqCounts, IrqKind, LeaseCounters, MsixDesc, NotifyWrites,
};

/// Register memory in a memfd, so the BAR can be exported as a fabric window and the
/// borrower's loads/stores land in it directly.
pub type ShmRegisters = MappedRegisters<SharedMemory>;

/// A zeroed memfd of `size` bytes (page multiple) as register memory.
pub fn shm_registers(name: &str, size: u64) -> Result<ShmRegisters, BackendError> {
    let (shm, len) = register_memfd(name, size, "register memory memfd")?;
    let base = shm.as_ptr();
    // SAFETY: the memfd mapping is page aligned, `len` bytes long and owned by `shm`, which
    // the registers keep (moving it does not move the mapping); everyone else (device worker,
    // borrower through the fabric window) accesses it atomically.
    Ok(unsafe { MappedRegisters::with_backing(shm, base, len) })
}

/// A zeroed memfd of `size` bytes named `name`, mapped, and its length in bytes; `what`
/// names it in an error.
fn register_memfd(
    name: &str,
    size: u64,
    what: &'static str,
) -> Result<(SharedMemory, usize), BackendError> {
    let shm = SharedMemory::new(name, size).map_err(|e| BackendError::Os {
        what,
        source: std::io::Error::other(e.to_string()),
    })?;
    let len = usize::try_from(shm.len()).map_err(|_| BackendError::OutOfRange {
        what: "register memory".into(),
        offset: 0,
        len: 0,
        size,
    })?;
    Ok((shm, len))
}

/// The ranges of `fd`'s first `len` bytes that hold data (page aligned), by
/// `lseek(SEEK_DATA / SEEK_HOLE)`; the whole range when the file system cannot tell (a
/// memfd always can).
fn data_extents(fd: std::os::fd::RawFd, len: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while at < len {
        // SAFETY: lseek on an fd the caller owns; it moves only the fd's offset, which
        // nothing else here uses (the memory is reached through its mapping).
        let data = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
                break; // no data past `at`
            }
            return vec![(0, len)];
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return vec![(0, len)];
        }
        let (from, to) = ((data as usize).min(len), (hole as usize).min(len));
        if to <= from {
            break;
        }
        out.push((from, to));
        at = to;
    }
    out
}

/// Moves `shm`'s memory to a fresh memfd with the same contents, in place: the new memfd is
/// mapped over the old mapping's address (the device's pointers stay valid) and takes over
/// the old fd's number, so `shm.fd()` and every later export name the new memory while
/// anyone who holds the old memfd (another process's mapping, a duplicated fd) keeps only
/// the old one, cut off from the device. The caller keeps writers away meanwhile.
fn renew_memfd(shm: &ntb::SharedMemory) -> Result<(), BackendError> {
    use std::os::fd::AsRawFd;
    let os = |what: &'static str| {
        let source = std::io::Error::last_os_error();
        BackendError::Os { what, source }
    };
    // The same name: the device's memory is still the device's (`/proc/PID/fd` of the lender
    // shows one memfd per device, whatever lease it is in).
    let (fresh, len) = register_memfd(shm.name(), shm.len(), "fresh register memfd")?;
    // Only pages with data: a large buffer the lease never touched stays unallocated. The
    // old memfd's holes are skipped with SEEK_DATA/SEEK_HOLE, not read: a read of a hole in
    // a shared shmem mapping allocates the page (a 1 GiB buffer read whole costs 1 GiB of
    // RAM and the time to zero it, at every lease's end). Within the data, raw reads and
    // copies (like the fabric's window copies): a holder of the old memfd may still write
    // it; what it writes now is its own business.
    const PAGE: usize = 4096;
    let (old, new) = (shm.as_ptr(), fresh.as_ptr());
    for (from, to) in data_extents(shm.fd().as_raw_fd(), len) {
        for at in (from..to).step_by(PAGE) {
            let n = PAGE.min(to - at);
            // SAFETY: `at + n <= to <= len` inside both live mappings (page aligned, so u64
            // aligned); volatile loads tolerate a concurrent writer.
            let used = (0..n / 8)
                .any(|w| unsafe { std::ptr::read_volatile(old.add(at).cast::<u64>().add(w)) != 0 });
            if used {
                // SAFETY: as above; distinct memfds, so the ranges do not overlap.
                unsafe { std::ptr::copy_nonoverlapping(old.add(at), new.add(at), n) };
            }
        }
    }
    // SAFETY: replaces exactly the mapping `shm` owns (same address and length, shared, read
    // and write as before) with the fresh memfd; `shm`'s drop unmaps that range as before.
    let p = unsafe {
        libc::mmap(
            shm.as_ptr().cast(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fresh.fd().as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED || p.cast::<u8>() != shm.as_ptr() {
        return Err(os("mapping the fresh register memfd in place"));
    }
    // SAFETY: both fds are open and owned (`shm` keeps owning its fd number, which now
    // names the fresh memfd; `fresh` closes its own number when dropped).
    if unsafe {
        libc::dup3(
            fresh.fd().as_raw_fd(),
            shm.fd().as_raw_fd(),
            libc::O_CLOEXEC,
        )
    } < 0
    {
        return Err(os("moving the fresh register memfd to the exported fd"));
    }
    Ok(())
}

/// Builds a model over the seams the backend provides.
pub type ModelFactory<'a> = Box<
    dyn FnOnce(
            Arc<dyn RegisterMemory>,
            Arc<dyn DmaMemory>,
            Arc<dyn InterruptSink>,
        ) -> Result<Box<dyn DeviceModel>, DeviceError>
        + 'a,
>;

/// An emulated device as a [`DeviceBackend`].
pub struct EmulatedBackend {
    kind: String,
    model: Box<dyn DeviceModel>,
    regs: Arc<ShmRegisters>,
    reg_bar: u8,
    iommu: Arc<SoftIommu>,
    irqs: Arc<LeaseIrqs>,
    /// The function's config space: 256 bytes, or 4 KiB when it has extended capabilities
    /// (an SR-IOV PF).
    config: Mutex<Vec<u8>>,
    pristine: Vec<u8>,
    /// The PF's id, for an SR-IOV virtual function.
    physfn: Option<String>,
}

impl EmulatedBackend {
    /// Creates register memory of `reg_size` bytes, a software IOMMU and an interrupt sink,
    /// builds the model with `factory` and starts it.
    pub fn new(
        name: &str,
        kind: &str,
        reg_size: u64,
        msix_vectors: u16,
        factory: ModelFactory<'_>,
    ) -> Result<Self, BackendError> {
        let regs = Arc::new(shm_registers(&format!("{name}-bar"), reg_size)?);
        let iommu = Arc::new(SoftIommu::new(format!("{kind} {name}")));
        let irqs = Arc::new(LeaseIrqs::new(name, msix_vectors));
        let model = factory(
            Arc::clone(&regs) as Arc<dyn RegisterMemory>,
            Arc::clone(&iommu) as Arc<dyn DmaMemory>,
            Arc::clone(&irqs) as Arc<dyn InterruptSink>,
        )
        .map_err(|e| BackendError::Model(e.to_string()))?;
        let reg_bar = model
            .bars()
            .iter()
            .find(|b| b.register_memory)
            .map(|b| b.index)
            .ok_or_else(|| BackendError::Model(format!("{kind} has no register-memory bar")))?;
        if let Some(m) = model.msix() {
            if m.vectors != msix_vectors {
                return Err(BackendError::Model(format!(
                    "{kind} reports {} msi-x vectors, expected {msix_vectors}",
                    m.vectors
                )));
            }
        }
        model
            .start()
            .map_err(|e| BackendError::Model(e.to_string()))?;
        let mut pristine = model.config_space().to_vec();
        let rebar = model.resizable_bars();
        if !rebar.is_empty() {
            // The model's resizable BARs as the capability at 0x100 (the only extended
            // capability of such a function: SR-IOV PFs are not resizable).
            pristine.resize(EXT_CONFIG_SIZE, 0);
            let cap = emulated::rebar::encode(&rebar, 0);
            pristine[EXT_START..EXT_START + cap.len()].copy_from_slice(&cap);
        }
        Ok(EmulatedBackend {
            kind: kind.to_string(),
            model,
            regs,
            reg_bar,
            iommu,
            irqs,
            config: Mutex::new(pristine.clone()),
            pristine,
            physfn: None,
        })
    }

    /// A `dmatest` copy engine.
    pub fn dmatest(name: &str, notify: NotifyMode) -> Result<Self, BackendError> {
        Self::dmatest_with_buffer(name, notify, emulated::dmatest::BUF_SIZE)
    }

    /// A `dmatest` copy engine with a data buffer of `buf` bytes (its peer memory).
    pub fn dmatest_with_buffer(
        name: &str,
        notify: NotifyMode,
        buf: u64,
    ) -> Result<Self, BackendError> {
        Self::dmatest_resizable(name, notify, buf, None)
    }

    /// A `dmatest` copy engine with a data buffer of `buf` bytes whose BAR0 is resizable
    /// (Resizable BAR capability) and starts at `rebar` bytes, when given
    /// ([`DmaTest::with_resizable_bar0`]).
    pub fn dmatest_resizable(
        name: &str,
        notify: NotifyMode,
        buf: u64,
        rebar: Option<u64>,
    ) -> Result<Self, BackendError> {
        EmulatedBackend::new(
            name,
            "dmatest",
            emulated::dmatest::bar0_size_for(buf),
            emulated::dmatest::VECTORS,
            Box::new(move |r, d, i| {
                let t = DmaTest::with_buffer(r, d, i, notify, buf)?;
                Ok(Box::new(match rebar {
                    Some(initial) => t.with_resizable_bar0(initial)?,
                    None => t,
                }))
            }),
        )
    }

    /// A PCI endpoint test function of `vectors` MSI-X vectors (`emulated::epftest`).
    pub fn epftest(name: &str, vectors: u16) -> Result<Self, BackendError> {
        EmulatedBackend::new(
            name,
            "epftest",
            emulated::epftest::BAR0_SIZE,
            vectors,
            Box::new(move |r, _d, i| Ok(Box::new(emulated::epftest::EpfTest::new(r, i, vectors)?))),
        )
    }

    /// An NVMe controller.
    pub fn nvme(name: &str, cfg: NvmeConfig) -> Result<Self, BackendError> {
        EmulatedBackend::nvme_kind(name, "nvme", cfg)
    }

    /// An NVMe controller whose backend kind (what `lendctl list` shows) is `kind`
    /// (`nvme-vf` for an SR-IOV virtual function).
    pub fn nvme_kind(name: &str, kind: &str, cfg: NvmeConfig) -> Result<Self, BackendError> {
        let vectors = cfg.msix_vectors;
        EmulatedBackend::new(
            name,
            kind,
            emulated::nvme::cmb::bar0_size(cfg.cmb_size),
            vectors,
            Box::new(move |r, d, i| Ok(Box::new(NvmeController::new(cfg, r, d, i)?))),
        )
    }

    /// Gives the function a 4 KiB config space whose extended capability list is `cap`
    /// alone, at 0x100 (the PF of [`crate::sriov`]). The capability is lender state: a
    /// borrower never sees it (the config gate hides SR-IOV) and extended config space
    /// ignores writes, so NumVFs stays what lenderd was told.
    pub fn with_sriov(mut self, cap: &emulated::sriov::SriovCap) -> Self {
        let mut c = self.pristine.clone();
        c.resize(EXT_CONFIG_SIZE, 0);
        c[EXT_START..EXT_START + emulated::sriov::CAP_LEN].copy_from_slice(&cap.to_bytes(0));
        *self.shadow() = c.clone();
        self.pristine = c;
        self
    }

    /// Marks the function as a virtual function of the PF `pf` (see
    /// [`DeviceBackend::physical_function`]).
    pub fn with_physfn(mut self, pf: &str) -> Self {
        self.physfn = Some(pf.to_string());
        self
    }

    /// The software IOMMU (tests and status).
    pub fn soft_iommu(&self) -> &Arc<SoftIommu> {
        &self.iommu
    }

    fn shadow(&self) -> std::sync::MutexGuard<'_, Vec<u8>> {
        match self.config.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// A write in extended config space: only the size field of a Resizable BAR control
    /// dword is writable (the model resizes the BAR, or the write is refused with what it
    /// offers); the rest of extended config space (SR-IOV: NumVFs and VF Enable are fixed
    /// by lenderd's `vfs=N`) ignores writes.
    fn rebar_write(&self, c: &mut [u8], offset: u16, data: &[u8]) -> Result<(), BackendError> {
        let start = usize::from(offset);
        let Some(e) = emulated::rebar::entries_in(c)
            .into_iter()
            .find(|e| (e.ctrl_at()..e.ctrl_at() + 4).contains(&start))
        else {
            return Ok(());
        };
        let at = e.ctrl_at();
        let mut dword = [0u8; 4];
        dword.copy_from_slice(&c[at..at + 4]);
        for (i, &b) in data.iter().enumerate() {
            if let Some(x) = dword.get_mut(start - at + i) {
                *x = b;
            }
        }
        let old = u32::from_le_bytes([c[at], c[at + 1], c[at + 2], c[at + 3]]);
        let asked = emulated::rebar::ctrl_size(u32::from_le_bytes(dword));
        if asked == e.current {
            return Ok(());
        }
        if !e.offers(asked) {
            return Err(BackendError::ResizeRefused {
                bar: e.bar,
                asked: emulated::rebar::human(asked),
                offered: emulated::rebar::describe_sizes(e.sizes),
            });
        }
        self.model
            .resize_bar(e.bar, asked)
            .map_err(|err| BackendError::Model(err.to_string()))?;
        let new = emulated::rebar::ctrl_with_size(old, asked);
        c[at..at + 4].copy_from_slice(&new.to_le_bytes());
        log::info!(
            "{}: bar {} resized {} -> {}",
            self.kind,
            e.bar,
            emulated::rebar::human(e.current),
            emulated::rebar::human(asked)
        );
        Ok(())
    }

    fn check_bar(&self, bar: u8, offset: u64, len: usize) -> Result<(), BackendError> {
        let b = self
            .model
            .bars()
            .into_iter()
            .find(|b| b.index == bar)
            .ok_or(BackendError::NoSuchBar(bar))?;
        if !b.register_memory {
            return Err(BackendError::BorrowerBar(bar));
        }
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > b.size)
        {
            return Err(BackendError::OutOfRange {
                what: format!("bar {bar}"),
                offset,
                len,
                size: b.size,
            });
        }
        if !(len == 4 || len == 8) || !offset.is_multiple_of(len as u64) {
            return Err(BackendError::BadAccess {
                what: format!("bar {bar}"),
                offset,
                len,
            });
        }
        Ok(())
    }
}

impl DeviceBackend for EmulatedBackend {
    fn kind(&self) -> &str {
        &self.kind
    }

    fn physical_function(&self) -> Option<String> {
        self.physfn.clone()
    }

    fn describe(&self, id: &str) -> DeviceInfo {
        let bars = self
            .model
            .bars()
            .into_iter()
            .map(|b| BarDesc {
                index: b.index,
                size: b.size,
                is_64bit: b.is_64bit,
                prefetchable: b.prefetchable,
                io: false,
                window: None,
                emulated_by_borrower: !b.register_memory,
                // Register memory: the model's doorbells may be stored + notified, the
                // control registers must take BAR_WRITE (the model's exact path).
                // A polling model sees doorbell stores by itself: those pages may be writable.
                notify: match (b.register_memory, b.doorbells) {
                    (false, _) => NotifyWrites::None,
                    (true, Some(r)) if self.model.polls_doorbells() => NotifyWrites::Polled {
                        offset: r.offset,
                        len: r.len,
                    },
                    (true, Some(r)) => NotifyWrites::Doorbells {
                        offset: r.offset,
                        len: r.len,
                    },
                    (true, None) => NotifyWrites::Doorbells { offset: 0, len: 0 },
                },
            })
            .collect();
        let msix = self.model.msix().map(|m| MsixDesc {
            vectors: m.vectors,
            table_bar: m.table_bar,
            table_offset: m.table_offset,
            pba_bar: m.pba_bar,
            pba_offset: m.pba_offset,
        });
        let irqs = IrqCounts {
            intx: u32::from(self.model.intx_pin() != 0),
            msi: 0,
            msix: msix.map_or(0, |m| u32::from(m.vectors)),
        };
        super::device_info(id, &self.kind, self.shadow().clone(), bars, irqs, msix)
    }

    fn config_size(&self) -> u16 {
        u16::try_from(self.pristine.len()).unwrap_or(u16::MAX)
    }

    fn config_read(&self, offset: u16, buf: &mut [u8]) -> Result<(), BackendError> {
        let c = self.shadow();
        for (i, b) in buf.iter_mut().enumerate() {
            // Beyond the config space (256 bytes, or 4 KiB with extended capabilities): zero.
            *b = c.get(usize::from(offset) + i).copied().unwrap_or(0);
        }
        Ok(())
    }

    fn config_write(&self, offset: u16, data: &[u8]) -> Result<(), BackendError> {
        let mut c = self.shadow();
        if usize::from(offset) >= EXT_START {
            return self.rebar_write(&mut c, offset, data);
        }
        for (i, &b) in data.iter().enumerate() {
            // Extended config space (the SR-IOV capability) is read-only: NumVFs and VF
            // Enable are fixed by lenderd's `vfs=N`.
            let at = usize::from(offset) + i;
            if at >= EXT_START {
                continue;
            }
            if let Some(x) = c.get_mut(at) {
                *x = b;
            }
        }
        let cmd = u16::from_le_bytes([c[4], c[5]]);
        self.irqs.set_intx_disabled(cmd & (1 << 10) != 0);
        Ok(())
    }

    fn resizes_bars(&self) -> bool {
        !self.model.resizable_bars().is_empty()
    }

    fn restore_defaults(&self) -> Result<(), BackendError> {
        // The sizes lenderd was told: the model and the control dwords go back to them.
        let mut c = self.shadow();
        for e in emulated::rebar::entries_in(&self.pristine) {
            self.model
                .resize_bar(e.bar, e.current)
                .map_err(|err| BackendError::Model(err.to_string()))?;
            let at = e.ctrl_at();
            c[at..at + 4].copy_from_slice(&self.pristine[at..at + 4]);
        }
        Ok(())
    }

    fn bar_export(&self, bar: u8) -> Option<BarExport<'_>> {
        (bar == self.reg_bar).then(|| BarExport {
            fd: self.regs.backing().fd(),
            offset: 0,
            size: self.regs.backing().len(),
            // renew_exports moves the registers to a new memfd at every lease's end.
            revocable: true,
        })
    }

    fn peer_export(&self, bar: u8) -> Option<super::PeerExport<'_>> {
        // Only what the model calls plain memory: a peer's writes bypass `bar_write`.
        let (off, len) = self.model.peer_memory(bar)?;
        let x = self.bar_export(bar)?;
        (off.checked_add(len)? <= x.size).then_some(super::PeerExport {
            fd: x.fd,
            fd_offset: x.offset + off,
            bar_offset: off,
            size: len,
        })
    }

    fn bar_read(&self, bar: u8, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        self.check_bar(bar, offset, buf.len())?;
        self.model.bar_read(bar, offset, buf);
        Ok(())
    }

    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        self.check_bar(bar, offset, data.len())?;
        self.model.bar_write(bar, offset, data);
        Ok(())
    }

    fn notify_eventfd(&self) -> Option<EventFd> {
        self.model.doorbell_event().try_clone().ok()
    }

    fn set_irqs(
        &self,
        kind: IrqKind,
        targets: Vec<Option<Arc<dyn IrqTrigger>>>,
    ) -> Result<(), BackendError> {
        self.irqs.set(kind, targets)
    }

    fn clear_irqs(&self) {
        self.irqs.clear();
    }

    fn intx_resample(&self) {
        if self.irqs.mode() == emulated::InterruptMode::Intx {
            self.model.intx_resample();
        }
    }

    fn set_bus_master(&self, enable: bool) -> Result<(), BackendError> {
        let mut c = self.shadow();
        let mut cmd = u16::from_le_bytes([c[4], c[5]]);
        if enable {
            cmd |= CMD_BUS_MASTER;
        } else {
            cmd &= !CMD_BUS_MASTER;
        }
        c[4..6].copy_from_slice(&cmd.to_le_bytes());
        drop(c);
        self.model.set_bus_master(enable);
        Ok(())
    }

    fn kick_doorbells(&self) -> DoorbellKicks {
        let k = self.model.kick_doorbells();
        DoorbellKicks {
            generation: k.generation,
            bar: k.bar,
            offsets: k.offsets,
        }
    }

    fn kick_generation(&self) -> u64 {
        self.model.kick_generation()
    }

    fn set_kick_listener(&self, listener: Option<::emulated::KickListener>) {
        self.model.set_kick_listener(listener);
    }

    fn reset(&self) -> Result<(), BackendError> {
        // The reset runs on this thread while a quiesced worker stays parked between passes;
        // then the pause ends, so the worker resumes on the clean registers and acts on
        // nothing that was written before the reset.
        self.model.reset();
        // Interrupts held for a hand-over belong to the state the reset discards.
        self.irqs.release(false);
        self.model.quiesce(false);
        {
            let mut c = self.shadow();
            let mut fresh = self.pristine.clone();
            // A function reset keeps a resized BAR's size (Linux writes it back after an
            // FLR anyway): the borrower's map of the BAR stays true. A lease's end puts
            // the first size back (`restore_defaults`).
            for e in emulated::rebar::entries_in(&c) {
                let at = e.ctrl_at();
                fresh[at..at + 4].copy_from_slice(&c[at..at + 4]);
            }
            *c = fresh;
        }
        self.irqs.set_intx_disabled(false);
        // Guest FLR storms reach here: first 16, then one in 1024.
        static RESETS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = RESETS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if n <= 16 || n.is_multiple_of(1024) {
            log::info!("{}: function reset (#{n} in this lender)", self.kind);
        }
        Ok(())
    }

    fn domain(&self) -> Arc<dyn IommuDomain> {
        Arc::clone(&self.iommu) as Arc<dyn IommuDomain>
    }

    fn renew_exports(&self) -> Result<(), BackendError> {
        // The worker parks between passes: nothing writes the registers while they move.
        self.model.quiesce(true);
        let r = renew_memfd(self.regs.backing());
        self.model.quiesce(false);
        r
    }

    fn quiesce(&self, stop: bool) -> Result<(), BackendError> {
        if !stop {
            // Interrupts held by a hand-over quiesce go to the targets wired now.
            self.irqs.release(true);
        }
        self.model.quiesce(stop);
        Ok(())
    }

    fn quiesce_handover(
        &self,
        timeout: std::time::Duration,
    ) -> Result<super::Drained, BackendError> {
        self.irqs.hold();
        self.model.quiesce(true);
        let drained = self.model.drain(timeout);
        let (pending_msix, pending_intx) = self.irqs.pending();
        Ok(super::Drained {
            drained,
            pending_msix,
            pending_intx,
        })
    }

    fn counters(&self) -> LeaseCounters {
        let (dma_bytes_read, dma_bytes_written) = self.iommu.dma_bytes().unwrap_or((0, 0));
        let (msix, intx) = self.irqs.counts();
        let m = self.model.model_counters();
        LeaseCounters {
            dma_bytes_read,
            dma_bytes_written,
            iommu_faults: self.iommu.fault_count(),
            doorbell_kicks: self.model.doorbell_kicks(),
            msix,
            intx,
            commands: m.commands,
            invalid_doorbells: m.invalid_doorbells,
            bad_prps: m.bad_prps,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::filtered_config_write;
    use crate::iommu::{DmaBacking, VecBacking};
    use emulated::dmatest::{
        CMD_START, DMATEST_ID, REG_CMD, REG_DST, REG_FAULTS, REG_ID, REG_IRQ_VECTOR, REG_LEN,
        REG_SRC, REG_STATUS, STATUS_DONE, STATUS_ERROR,
    };
    use std::time::{Duration, Instant};

    fn wait_status(b: &EmulatedBackend, bits: u32) -> u32 {
        let t0 = Instant::now();
        loop {
            let mut s = [0u8; 4];
            b.bar_read(0, REG_STATUS, &mut s).unwrap();
            let s = u32::from_le_bytes(s);
            if s & bits != 0 || t0.elapsed() > Duration::from_secs(5) {
                return s;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Allocated bytes of `fd`'s file.
    fn allocated(fd: std::os::fd::BorrowedFd<'_>) -> u64 {
        use std::os::fd::AsRawFd;
        // SAFETY: fstat fills a zeroed stat of an open fd.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
        st.st_blocks as u64 * 512
    }

    /// A lease's end moves the registers to a fresh memfd copying only the pages with data,
    /// found without reading the holes (a read of a hole would allocate it in the old memfd:
    /// a large buffer would cost its whole size at every lease's end).
    #[test]
    fn renewing_register_memory_touches_only_its_data() {
        use std::os::fd::AsFd;
        let (shm, len) = register_memfd("renew-test", 256 << 20, "test memfd").unwrap();
        assert_eq!(len, 256 << 20);
        let p = shm.as_ptr();
        // SAFETY: both offsets are inside the live 256 MiB mapping.
        unsafe {
            p.add(0x10).write_volatile(0xa5);
            p.add(200 << 20).write_volatile(0x5a);
        }
        let old = shm.fd().as_fd().try_clone_to_owned().unwrap();
        assert_eq!(allocated(old.as_fd()), 2 * 4096);
        renew_memfd(&shm).unwrap();
        assert_eq!(
            allocated(old.as_fd()),
            2 * 4096,
            "renew read the old memfd's holes"
        );
        assert_eq!(allocated(shm.fd().as_fd()), 2 * 4096);
        // SAFETY: as above; the mapping now shows the fresh memfd.
        unsafe {
            assert_eq!(p.add(0x10).read_volatile(), 0xa5);
            assert_eq!(p.add(200 << 20).read_volatile(), 0x5a);
        }
        // The kept old fd is cut off: a write through it does not reach the device's memory.
        let old_file = std::fs::File::from(old);
        std::os::unix::fs::FileExt::write_at(&old_file, &[0x11], 0x10).unwrap();
        // SAFETY: as above.
        assert_eq!(unsafe { p.add(0x10).read_volatile() }, 0xa5);
    }

    fn w32(b: &EmulatedBackend, off: u64, v: u32) {
        b.bar_write(0, off, &v.to_le_bytes()).unwrap();
    }
    fn w64(b: &EmulatedBackend, off: u64, v: u64) {
        b.bar_write(0, off, &v.to_le_bytes()).unwrap();
    }

    #[test]
    fn dmatest_copies_inside_window_and_faults_outside() {
        let b = EmulatedBackend::dmatest("t0", NotifyMode::Interrupt).unwrap();
        let info = b.describe("0000:00:01.0");
        assert_eq!(info.kind, "dmatest");
        assert_eq!(info.irqs.msix, 2);
        assert!(info.caps.iter().any(|c| c.id == 0x11));
        assert!(b.bar_export(0).is_some());
        let mut id = [0u8; 4];
        b.bar_read(0, REG_ID, &mut id).unwrap();
        assert_eq!(u32::from_le_bytes(id), DMATEST_ID);

        let mem = Arc::new(VecBacking::new(0x3000));
        mem.fill(0x5a);
        mem.write_at(0x1000, &[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
        // Only the middle page is mapped, at IOVA 0x40000.
        let win = Arc::new(VecBacking::new(0x1000));
        win.write_at(0, &[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
        b.domain().map(0x40000, 0x1000, win.clone()).unwrap();
        let irq = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        b.set_irqs(
            IrqKind::Msix,
            vec![Some(irq.clone() as Arc<dyn IrqTrigger>), None],
        )
        .unwrap();

        w64(&b, REG_SRC, 0x40000);
        w64(&b, REG_DST, 0x40800);
        w32(&b, REG_LEN, 8);
        w32(&b, REG_IRQ_VECTOR, 0);
        w32(&b, REG_CMD, CMD_START);
        let s = wait_status(&b, STATUS_DONE | STATUS_ERROR);
        assert_eq!(s & STATUS_ERROR, 0, "status {s:#x}");
        let mut out = [0u8; 8];
        win.read_at(0x800, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(irq.read().unwrap(), 1);

        // Destination past the end of the window: refused, counted.
        w32(&b, REG_CMD, emulated::dmatest::CMD_ACK);
        w64(&b, REG_DST, 0x40ffc);
        w32(&b, REG_CMD, CMD_START);
        let s = wait_status(&b, STATUS_ERROR);
        assert_ne!(s & STATUS_ERROR, 0, "status {s:#x}");
        assert!(b.soft_iommu().fault_count() >= 1);
        let mut f = [0u8; 4];
        b.bar_read(0, REG_FAULTS, &mut f).unwrap();
        assert!(u32::from_le_bytes(f) >= 1);
        let mut tail = [0u8; 4];
        win.read_at(0xffc, &mut tail).unwrap();
        assert_eq!(tail, [0; 4]);
    }

    /// Quiesced, the engine does not start a copy whose CMD it was told of; a reset resumes
    /// it (and does not wait on the parked worker). Counters: kicks, bytes, interrupts.
    #[test]
    fn quiesce_holds_work_until_reset_and_counters_count() {
        let b = EmulatedBackend::dmatest("t2", NotifyMode::Interrupt).unwrap();
        let win = Arc::new(VecBacking::new(0x1000));
        b.domain().map(0x40000, 0x1000, win.clone()).unwrap();
        let irq = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        b.set_irqs(
            IrqKind::Msix,
            vec![Some(irq.clone() as Arc<dyn IrqTrigger>), None],
        )
        .unwrap();
        let copy = |b: &EmulatedBackend| {
            w64(b, REG_SRC, 0x40000);
            w64(b, REG_DST, 0x40800);
            w32(b, REG_LEN, 0x100);
            w32(b, REG_IRQ_VECTOR, 0);
            w32(b, REG_CMD, CMD_START);
        };
        b.quiesce(true).unwrap();
        copy(&b);
        std::thread::sleep(Duration::from_millis(200));
        let mut s = [0u8; 4];
        b.bar_read(0, REG_STATUS, &mut s).unwrap();
        assert_eq!(u32::from_le_bytes(s) & (STATUS_DONE | STATUS_ERROR), 0);
        assert_eq!(
            b.counters().dma_bytes_read,
            0,
            "nothing fetched while quiesced"
        );
        b.reset().unwrap();
        // Reset: registers cleared, worker running again.
        copy(&b);
        assert_eq!(
            wait_status(&b, STATUS_DONE | STATUS_ERROR) & STATUS_ERROR,
            0
        );
        let t0 = Instant::now();
        while b.counters().doorbell_kicks < 2 && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let c = b.counters();
        // bar_write notifies on CMD only: one kick per copy programmed.
        assert_eq!(c.doorbell_kicks, 2, "{c:?}");
        assert_eq!((c.dma_bytes_read, c.dma_bytes_written), (0x100, 0x100));
        assert_eq!((c.msix, c.intx, c.iommu_faults), (vec![1, 0], 0, 0));
        assert_eq!(irq.read().unwrap(), 1);
    }

    #[test]
    fn config_filter_and_reset() {
        let b = EmulatedBackend::dmatest("t1", NotifyMode::Interrupt).unwrap();
        assert!(filtered_config_write(&b, 0x10, &[0xff; 4]).is_err());
        filtered_config_write(&b, 4, &[0x06, 0x00]).unwrap();
        let mut cmd = [0u8; 2];
        b.config_read(4, &mut cmd).unwrap();
        assert_eq!(cmd, [0x00, 0x00], "decode and bme stay with the lender");
        b.set_bus_master(true).unwrap();
        b.config_read(4, &mut cmd).unwrap();
        assert_eq!(cmd, [0x04, 0x00]);
        b.reset().unwrap();
        b.config_read(4, &mut cmd).unwrap();
        assert_eq!(cmd, [0, 0]);
        assert!(matches!(
            b.bar_read(0, 2, &mut [0u8; 4]),
            Err(BackendError::BadAccess { .. })
        ));
        assert!(matches!(
            b.bar_read(0, emulated::dmatest::BAR0_SIZE, &mut [0u8; 4]),
            Err(BackendError::OutOfRange { .. })
        ));
        assert!(matches!(
            b.bar_read(5, 0, &mut [0u8; 4]),
            Err(BackendError::NoSuchBar(5))
        ));
    }

    /// Guest memory whose device writes of at least `min` bytes take `delay` (a DMA that is
    /// in flight long enough to quiesce against); `in_write` counts writes under way.
    struct SlowMemory {
        mem: Arc<VecBacking>,
        delay: std::sync::atomic::AtomicU64,
        /// Device reads of at least `min` bytes take this long (ms).
        read_delay: std::sync::atomic::AtomicU64,
        min: usize,
        in_write: std::sync::atomic::AtomicU64,
        in_read: std::sync::atomic::AtomicU64,
    }

    impl DmaBacking for SlowMemory {
        fn size(&self) -> u64 {
            self.mem.size()
        }
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), crate::iommu::BackingError> {
            use std::sync::atomic::Ordering::SeqCst;
            if buf.len() >= self.min {
                self.in_read.fetch_add(1, SeqCst);
                std::thread::sleep(Duration::from_millis(self.read_delay.load(SeqCst)));
            }
            self.mem.read_at(offset, buf)
        }
        fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), crate::iommu::BackingError> {
            use std::sync::atomic::Ordering::SeqCst;
            if data.len() >= self.min {
                self.in_write.fetch_add(1, SeqCst);
                std::thread::sleep(Duration::from_millis(self.delay.load(SeqCst)));
            }
            self.mem.write_at(offset, data)
        }
    }

    fn slow_memory(size: usize, min: usize) -> Arc<SlowMemory> {
        Arc::new(SlowMemory {
            mem: Arc::new(VecBacking::new(size)),
            delay: std::sync::atomic::AtomicU64::new(0),
            read_delay: std::sync::atomic::AtomicU64::new(0),
            min,
            in_write: std::sync::atomic::AtomicU64::new(0),
            in_read: std::sync::atomic::AtomicU64::new(0),
        })
    }

    fn wait_in_write(m: &SlowMemory) {
        let t0 = Instant::now();
        while m.in_write.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "no dma write started"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn handover_quiesce_waits_for_the_running_copy_and_holds_its_interrupt() {
        let b = EmulatedBackend::dmatest("handover", NotifyMode::Interrupt).unwrap();
        let mem = slow_memory(0x20000, 0x1000);
        mem.delay.store(300, std::sync::atomic::Ordering::SeqCst);
        b.domain().map(0x40000, 0x20000, mem.clone()).unwrap();
        let irq = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        b.set_irqs(
            IrqKind::Msix,
            vec![None, Some(irq.clone() as Arc<dyn IrqTrigger>)],
        )
        .unwrap();
        w32(&b, REG_IRQ_VECTOR, 1);
        w64(&b, REG_SRC, 0x40000);
        w64(&b, REG_DST, 0x50000);
        w32(&b, REG_LEN, 0x8000);
        w32(&b, REG_CMD, CMD_START);
        wait_in_write(&mem);
        let d = b.quiesce_handover(Duration::from_secs(5)).unwrap();
        assert_eq!(
            d,
            super::super::Drained {
                drained: true,
                pending_msix: vec![1],
                pending_intx: false
            },
            "the copy finished inside the quiesce; its interrupt is held"
        );
        let mut st = [0u8; 4];
        b.bar_read(0, REG_STATUS, &mut st).unwrap();
        assert_ne!(u32::from_le_bytes(st) & STATUS_DONE, 0);
        assert!(irq.read().is_err(), "not delivered while held");
        // Resumed, the held interrupt goes to the targets wired now (a new borrower's).
        let moved = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        b.set_irqs(
            IrqKind::Msix,
            vec![None, Some(moved.clone() as Arc<dyn IrqTrigger>)],
        )
        .unwrap();
        b.quiesce(false).unwrap();
        assert_eq!(moved.read().unwrap(), 1, "replayed once");
        assert!(irq.read().is_err(), "the old target saw nothing");
        // A reset drops what a hand-over held.
        mem.delay.store(0, std::sync::atomic::Ordering::SeqCst);
        b.quiesce_handover(Duration::from_secs(1)).unwrap();
        w32(&b, REG_CMD, emulated::dmatest::CMD_ACK | CMD_START);
        b.reset().unwrap();
        assert!(moved.read().is_err());
    }

    /// A guest-side view of the backend for the NVMe driver: RAM is the backing's memory,
    /// the BAR goes through the backend's exact path, completions are polled.
    struct GuestRamOf(Arc<VecBacking>);
    impl emulated::testing::GuestRam for GuestRamOf {
        fn read(&self, addr: u64, buf: &mut [u8]) {
            self.0.read_at(addr, buf).unwrap();
        }
        fn write(&self, addr: u64, buf: &[u8]) {
            self.0.write_at(addr, buf).unwrap();
        }
    }
    struct BarOf(Arc<EmulatedBackend>);
    impl emulated::testing::GuestBar for BarOf {
        fn read32(&self, off: u64) -> u32 {
            let mut b = [0u8; 4];
            self.0.bar_read(0, off, &mut b).unwrap();
            u32::from_le_bytes(b)
        }
        fn write32(&self, off: u64, v: u32) {
            self.0.bar_write(0, off, &v.to_le_bytes()).unwrap();
        }
    }
    struct NoIrq;
    impl emulated::testing::GuestIrq for NoIrq {
        fn wait(&self, _vector: u16, timeout: Duration) -> bool {
            std::thread::sleep(timeout.min(Duration::from_millis(1)));
            false
        }
    }

    /// An NVMe backend over slow guest memory (mapped at IOVA 0), two MSI-X eventfds, and a
    /// driver with one I/O queue pair on vector 1.
    fn nvme_rig(
        dir: &std::path::Path,
    ) -> (
        Arc<EmulatedBackend>,
        Arc<SlowMemory>,
        Vec<Arc<EventFd>>,
        emulated::testing::NvmeDriver,
    ) {
        use emulated::testing::{DriverConfig, NvmeDriver};
        let cfg = NvmeConfig {
            backing: dir.join("disk"),
            size: Some(16 << 20),
            ..NvmeConfig::default()
        };
        let b = Arc::new(EmulatedBackend::nvme("handover", cfg).unwrap());
        let mem = slow_memory(4 << 20, 0x1000);
        b.domain().map(0, 4 << 20, mem.clone()).unwrap();
        b.set_bus_master(true).unwrap();
        let irq: Vec<Arc<EventFd>> = (0..2)
            .map(|_| Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()))
            .collect();
        b.set_irqs(
            IrqKind::Msix,
            irq.iter()
                .map(|e| Some(e.clone() as Arc<dyn IrqTrigger>))
                .collect(),
        )
        .unwrap();
        let mut d = NvmeDriver::new(
            Arc::new(BarOf(b.clone())),
            Arc::new(GuestRamOf(mem.mem.clone())),
            Arc::new(NoIrq),
            DriverConfig {
                ram_base: 1 << 20,
                ram_len: 3 << 20,
                use_interrupts: false,
                timeout: Duration::from_secs(10),
            },
        );
        d.enable(16).unwrap();
        d.set_num_queues(1).unwrap();
        d.create_io_queue_pair(1, 16, 1).unwrap();
        (b, mem, irq, d)
    }

    #[test]
    fn nvme_handover_quiesce_drains_in_flight_commands_and_holds_their_interrupt() {
        use emulated::testing::NvmeDriver;
        let dir = tempfile::tempdir().unwrap();
        let (b, mem, irq, mut d) = nvme_rig(dir.path());
        let bufs: Vec<_> = (0..4)
            .map(|_| d.alloc_data(4096, 0, false).unwrap())
            .collect();
        let _ = irq[1].read();
        mem.delay.store(100, std::sync::atomic::Ordering::SeqCst);
        for (i, buf) in bufs.iter().enumerate() {
            d.push(1, NvmeDriver::rw_sqe(false, i as u64 * 8, 8, buf))
                .unwrap();
        }
        d.ring(1).unwrap();
        // The first read's data DMA is under way: the commands are in flight.
        wait_in_write(&mem);
        let q = b.quiesce_handover(Duration::from_secs(10)).unwrap();
        assert!(q.drained, "{q:?}");
        assert_eq!(
            q.pending_msix,
            vec![1],
            "the completions' interrupt is held"
        );
        assert!(irq[1].read().is_err(), "not delivered while held");
        let mut cqes = Vec::new();
        d.poll(1, &mut cqes).unwrap();
        assert_eq!(cqes.len(), 4, "every fetched command completed: {cqes:?}");
        assert!(cqes.iter().all(|c| c.status == 0), "{cqes:?}");
        assert_eq!(
            mem.in_write.load(std::sync::atomic::Ordering::SeqCst),
            4,
            "all four data transfers done"
        );
        b.quiesce(false).unwrap();
        assert!(irq[1].read().is_ok(), "replayed on resume");
        mem.delay.store(0, std::sync::atomic::Ordering::SeqCst);
        d.rw(1, false, 0, 8, &bufs[0]).unwrap();
    }

    /// Commands fetched in the worker's last pass before it parks complete in the drain on
    /// the lender's thread (their gather is slow, so the quiesce comes during the fetch and
    /// the worker parks before any pass reaps them).
    #[test]
    fn nvme_drain_completes_commands_fetched_before_the_park() {
        use emulated::testing::NvmeDriver;
        let dir = tempfile::tempdir().unwrap();
        let (b, mem, irq, mut d) = nvme_rig(dir.path());
        let bufs: Vec<_> = (0..4)
            .map(|_| d.alloc_data(4096, 0, false).unwrap())
            .collect();
        let _ = irq[1].read();
        mem.read_delay
            .store(50, std::sync::atomic::Ordering::SeqCst);
        for (i, buf) in bufs.iter().enumerate() {
            d.push(1, NvmeDriver::rw_sqe(true, i as u64 * 8, 8, buf))
                .unwrap();
        }
        d.ring(1).unwrap();
        let t0 = Instant::now();
        while mem.in_read.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            assert!(t0.elapsed() < Duration::from_secs(5), "no gather started");
            std::thread::sleep(Duration::from_millis(1));
        }
        let q = b.quiesce_handover(Duration::from_secs(10)).unwrap();
        assert!(q.drained, "{q:?}");
        assert_eq!(
            q.pending_msix,
            vec![1],
            "completions posted by the drain, held"
        );
        assert!(irq[1].read().is_err());
        let mut cqes = Vec::new();
        d.poll(1, &mut cqes).unwrap();
        assert!(
            !cqes.is_empty(),
            "the fetched writes completed in the drain"
        );
        b.quiesce(false).unwrap();
        assert!(irq[1].read().is_ok(), "replayed on resume");
        mem.read_delay.store(0, std::sync::atomic::Ordering::SeqCst);
        let left = 4 - cqes.len();
        d.wait(1, &mut cqes, left).unwrap();
        assert!(cqes.iter().all(|c| c.status == 0), "{cqes:?}");
    }
}
