//! Fakes of the three seams (link, VM, interrupt manager) plus a fake pinner, recording
//! everything into shared state that tests inspect after handing the fakes to the device.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use pci::interrupt::{InterruptError, InterruptIndex, InterruptManager, InterruptSourceGroup};
pub use pci::testing::{GroupCall, MockGroup};
use pci::vm_ops::{
    GuestRamRegion, IoEventAddress, IoEventDatamatch, IoEventGuard, MemslotGuard, VmOps, VmOpsError,
};
use vmm_sys_util::eventfd::EventFd;

use crate::link::{
    DmaMapping, IommuFaultReport, IrqKind, IrqTargets, KickDoorbells, LeaseState, LenderCounters,
    LinkError, LinkEventHook, RemoteDeviceInfo, RemoteDeviceLink,
};
use crate::pin::{PinError, PinnedRange, Pinner};

/// A global order of teardown steps, to check "unmap before unpin".
pub type Journal = Arc<Mutex<Vec<String>>>;

fn log(j: &Journal, s: impl Into<String>) {
    j.lock().unwrap().push(s.into());
}

// ---- link ------------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkCall {
    ConfigWrite(u16, Vec<u8>),
    BarRead(u8, u64, usize),
    BarWrite(u8, u64, Vec<u8>),
    MapDma(u64),
    SetIrqs {
        kind: IrqKind,
        n: usize,
        resample: bool,
    },
    Reset,
    Quiesce(bool),
}

pub struct LinkState {
    pub calls: Vec<LinkCall>,
    /// The real device's config space (config_read serves it; config_write applies it
    /// through `writable`).
    pub config: Vec<u8>,
    /// Bits of `config` the "lender" lets writes change.
    pub writable: Vec<u8>,
    pub bars: HashMap<u8, Vec<u8>>,
    pub fail_map: bool,
    pub dropped: bool,
    /// Eventfds last handed over per kind (kept to check they are real group notifiers).
    pub irq_fds: HashMap<&'static str, Vec<EventFd>>,
    /// What `lender_counters` answers (`None`: a lender that does not report them).
    pub counters: Option<LenderCounters>,
    /// The hook the device/VMM registered.
    pub hook: Option<Arc<dyn LinkEventHook>>,
    /// Set by [`FakeLink::lose`]: `lease_state` reports it.
    pub lost: Option<String>,
    /// Whether the hook was told of the loss (once, like the real link).
    pub lost_reported: bool,
    /// Kick-only doorbells the link has received (newest generation wins, as in
    /// `KickCell`); tests set it directly to play an asynchronous event.
    pub kicks: KickDoorbells,
    /// What the next BAR write's reply carries.
    pub kicks_after_write: Option<KickDoorbells>,
    /// What the next reset's reply carries.
    pub kicks_after_reset: Option<KickDoorbells>,
}

impl LinkState {
    /// Receives `k` as a reply or event would: kept only if newer.
    pub fn offer_kicks(&mut self, k: KickDoorbells) {
        if k.generation > self.kicks.generation {
            self.kicks = k;
        }
    }
}

pub struct FakeLink {
    pub info: RemoteDeviceInfo,
    pub state: Arc<Mutex<LinkState>>,
    pub dma_live: Arc<AtomicUsize>,
    pub journal: Journal,
}

impl FakeLink {
    pub fn new(info: RemoteDeviceInfo, journal: Journal) -> Self {
        let n = info.config.len();
        let state = LinkState {
            calls: Vec::new(),
            config: info.config.clone(),
            writable: vec![0xff; n],
            bars: HashMap::new(),
            fail_map: false,
            dropped: false,
            irq_fds: HashMap::new(),
            counters: None,
            hook: None,
            lost: None,
            lost_reported: false,
            kicks: KickDoorbells::default(),
            kicks_after_write: None,
            kicks_after_reset: None,
        };
        Self {
            info,
            state: Arc::new(Mutex::new(state)),
            dma_live: Arc::new(AtomicUsize::new(0)),
            journal,
        }
    }
}

impl FakeLink {
    /// The lease is lost: `lease_state` says so and the hook (now or when set) is told once,
    /// as `LendingLink` does.
    pub fn lose(state: &Arc<Mutex<LinkState>>, why: &str) {
        let hook = {
            let mut s = state.lock().unwrap();
            s.lost.get_or_insert_with(|| why.to_string());
            if s.lost_reported {
                None
            } else {
                s.hook.clone().inspect(|_| s.lost_reported = true)
            }
        };
        if let Some(h) = hook {
            h.lease_lost(why);
        }
    }

    /// Reports an IOMMU fault to the hook, if one is set.
    pub fn fault(state: &Arc<Mutex<LinkState>>, f: &IommuFaultReport) {
        let hook = state.lock().unwrap().hook.clone();
        if let Some(h) = hook {
            h.iommu_fault(f);
        }
    }
}

pub struct FakeDma {
    size: u64,
    live: Arc<AtomicUsize>,
    journal: Journal,
}

impl DmaMapping for FakeDma {
    fn size(&self) -> u64 {
        self.size
    }
}

impl Drop for FakeDma {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
        log(&self.journal, "unmap-dma");
    }
}

impl RemoteDeviceLink for FakeLink {
    fn device_info(&self) -> RemoteDeviceInfo {
        self.info.clone()
    }

    fn config_read(&self, offset: u16, data: &mut [u8]) -> Result<(), LinkError> {
        let s = self.state.lock().unwrap();
        let o = usize::from(offset);
        let src = s.config.get(o..o + data.len()).ok_or(LinkError::BadReply {
            op: "config read",
            reason: "past the end".into(),
        })?;
        data.copy_from_slice(src);
        Ok(())
    }

    fn config_write(&self, offset: u16, data: &[u8]) -> Result<(), LinkError> {
        let mut s = self.state.lock().unwrap();
        s.calls.push(LinkCall::ConfigWrite(offset, data.to_vec()));
        for (i, b) in data.iter().enumerate() {
            let o = usize::from(offset) + i;
            if o == 6 || o == 7 {
                // Status: write 1 to clear.
                s.config[o] &= !b;
            } else if o < s.config.len() {
                let w = s.writable[o];
                s.config[o] = (s.config[o] & !w) | (b & w);
            }
        }
        Ok(())
    }

    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) -> Result<(), LinkError> {
        let mut s = self.state.lock().unwrap();
        s.calls.push(LinkCall::BarRead(bar, offset, data.len()));
        let m = s.bars.entry(bar).or_insert_with(|| vec![0; 0x1000]);
        let o = offset as usize;
        data.copy_from_slice(&m[o..o + data.len()]);
        Ok(())
    }

    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) -> Result<(), LinkError> {
        let mut s = self.state.lock().unwrap();
        s.calls.push(LinkCall::BarWrite(bar, offset, data.to_vec()));
        let m = s.bars.entry(bar).or_insert_with(|| vec![0; 0x1000]);
        let o = offset as usize;
        if m.len() < o + data.len() {
            m.resize(o + data.len(), 0);
        }
        m[o..o + data.len()].copy_from_slice(data);
        if let Some(k) = s.kicks_after_write.take() {
            s.offer_kicks(k);
        }
        Ok(())
    }

    fn map_dma(&self, regions: &[GuestRamRegion]) -> Result<Box<dyn DmaMapping>, LinkError> {
        let size = regions.iter().map(|r| r.size).sum();
        let mut s = self.state.lock().unwrap();
        s.calls.push(LinkCall::MapDma(size));
        if s.fail_map {
            return Err(LinkError::Remote {
                op: "dma map",
                message: "iommu full".into(),
            });
        }
        self.dma_live.fetch_add(1, Ordering::SeqCst);
        log(&self.journal, "map-dma");
        Ok(Box::new(FakeDma {
            size,
            live: self.dma_live.clone(),
            journal: self.journal.clone(),
        }))
    }

    fn set_irqs(&self, t: &IrqTargets<'_>) -> Result<(), LinkError> {
        let mut s = self.state.lock().unwrap();
        s.calls.push(LinkCall::SetIrqs {
            kind: t.kind,
            n: t.triggers.len(),
            resample: t.resample.is_some(),
        });
        let fds = t.triggers.iter().map(|e| e.try_clone().unwrap()).collect();
        let key = match t.kind {
            IrqKind::Intx => "intx",
            IrqKind::Msi => "msi",
            IrqKind::Msix => "msix",
        };
        s.irq_fds.insert(key, fds);
        Ok(())
    }

    fn reset(&self) -> Result<(), LinkError> {
        let mut s = self.state.lock().unwrap();
        s.calls.push(LinkCall::Reset);
        if let Some(k) = s.kicks_after_reset.take() {
            s.offer_kicks(k);
        }
        Ok(())
    }

    fn kick_generation(&self) -> u64 {
        self.state.lock().unwrap().kicks.generation
    }

    fn kick_doorbells(&self) -> KickDoorbells {
        self.state.lock().unwrap().kicks.clone()
    }

    fn lease_state(&self) -> LeaseState {
        match &self.state.lock().unwrap().lost {
            Some(why) => LeaseState::Lost(why.clone()),
            None => LeaseState::Active,
        }
    }

    fn set_event_hook(&self, hook: Arc<dyn LinkEventHook>) {
        let lost = {
            let mut s = self.state.lock().unwrap();
            s.hook = Some(hook);
            s.lost.clone()
        };
        if let Some(why) = lost {
            FakeLink::lose(&self.state, &why);
        }
    }

    fn lender_counters(&self) -> Result<Option<LenderCounters>, LinkError> {
        Ok(self.state.lock().unwrap().counters.clone())
    }

    fn quiesce(&self, stop: bool) -> Result<(), LinkError> {
        self.state
            .lock()
            .unwrap()
            .calls
            .push(LinkCall::Quiesce(stop));
        Ok(())
    }
}

impl Drop for FakeLink {
    fn drop(&mut self) {
        self.state.lock().unwrap().dropped = true;
        log(&self.journal, "return-lease");
    }
}

// ---- VM ----------------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    pub gpa: u64,
    pub size: u64,
    pub host: u64,
    pub readonly: bool,
}

#[derive(Default)]
pub struct VmState {
    pub slots: HashMap<u32, Slot>,
    pub ioevents: HashMap<u64, (IoEventAddress, Option<IoEventDatamatch>)>,
    pub slots_made: usize,
    next: u32,
}

pub struct FakeVm {
    pub state: Arc<Mutex<VmState>>,
    pub ram: Vec<GuestRamRegion>,
    pub journal: Journal,
}

impl FakeVm {
    pub fn new(ram: Vec<GuestRamRegion>, journal: Journal) -> Self {
        Self {
            state: Arc::default(),
            ram,
            journal,
        }
    }

    pub fn slots(&self) -> Vec<Slot> {
        let mut v: Vec<Slot> = self.state.lock().unwrap().slots.values().cloned().collect();
        v.sort_by_key(|s| s.gpa);
        v
    }

    pub fn ioevents(&self) -> Vec<IoEventAddress> {
        self.state
            .lock()
            .unwrap()
            .ioevents
            .values()
            .map(|v| v.0)
            .collect()
    }
}

impl VmOps for FakeVm {
    fn map_guest_region(
        &self,
        gpa: u64,
        size: u64,
        host_addr: u64,
        readonly: bool,
    ) -> Result<MemslotGuard, VmOpsError> {
        if !gpa.is_multiple_of(4096)
            || !size.is_multiple_of(4096)
            || !host_addr.is_multiple_of(4096)
            || size == 0
        {
            return Err(VmOpsError::InvalidRegion {
                gpa,
                size,
                reason: "not page aligned",
            });
        }
        let mut s = self.state.lock().unwrap();
        let overlap = s
            .slots
            .values()
            .any(|o| gpa < o.gpa + o.size && o.gpa < gpa + size);
        if overlap {
            return Err(VmOpsError::InvalidRegion {
                gpa,
                size,
                reason: "overlaps a slot",
            });
        }
        let slot = s.next;
        s.next += 1;
        s.slots_made += 1;
        s.slots.insert(
            slot,
            Slot {
                gpa,
                size,
                host: host_addr,
                readonly,
            },
        );
        let st: Weak<Mutex<VmState>> = Arc::downgrade(&self.state);
        let j = self.journal.clone();
        Ok(MemslotGuard::new(gpa, size, slot, move || {
            if let Some(st) = st.upgrade() {
                st.lock().unwrap().slots.remove(&slot);
            }
            log(&j, "remove-slot");
        }))
    }

    fn register_ioevent(
        &self,
        _fd: &EventFd,
        addr: IoEventAddress,
        datamatch: Option<IoEventDatamatch>,
    ) -> Result<IoEventGuard, VmOpsError> {
        let mut s = self.state.lock().unwrap();
        let key = u64::from(s.next);
        s.next += 1;
        s.ioevents.insert(key, (addr, datamatch));
        let st = Arc::downgrade(&self.state);
        Ok(IoEventGuard::new(addr, datamatch, move || {
            if let Some(st) = st.upgrade() {
                st.lock().unwrap().ioevents.remove(&key);
            }
        }))
    }

    fn guest_ram_regions(&self) -> Vec<GuestRamRegion> {
        self.ram.clone()
    }

    fn read_guest(&self, gpa: u64, data: &mut [u8]) -> Result<(), VmOpsError> {
        Err(VmOpsError::NotRam {
            gpa,
            len: data.len() as u64,
        })
    }

    fn write_guest(&self, gpa: u64, data: &[u8]) -> Result<(), VmOpsError> {
        Err(VmOpsError::NotRam {
            gpa,
            len: data.len() as u64,
        })
    }
}

// ---- interrupts ----------------------------------------------------------------------------

#[derive(Default)]
pub struct FakeIrqs {
    /// (kind, count or irq, group) of every group created.
    pub groups: Mutex<Vec<(&'static str, u32, Weak<MockGroup>)>>,
    /// Strong references for tests that want to inspect calls (taken on request only).
    pub keep: Mutex<Vec<Arc<MockGroup>>>,
    pub keep_groups: bool,
    /// The device has MSI-X: its first MSI group is the MSI-X one.
    pub has_msix: bool,
}

impl FakeIrqs {
    pub fn new(has_msix: bool, keep_groups: bool) -> Self {
        Self {
            keep_groups,
            has_msix,
            ..Default::default()
        }
    }

    pub fn group(&self, kind: &str) -> Option<Arc<MockGroup>> {
        self.groups
            .lock()
            .unwrap()
            .iter()
            .find(|g| g.0 == kind)
            .and_then(|g| g.2.upgrade())
    }

    pub fn live_groups(&self) -> usize {
        self.groups
            .lock()
            .unwrap()
            .iter()
            .filter(|g| g.2.strong_count() > 0)
            .count()
    }

    fn make(&self, kind: &'static str, n: u32, resample: bool) -> Arc<dyn InterruptSourceGroup> {
        let g = Arc::new(MockGroup::with_resample(n, resample));
        self.groups
            .lock()
            .unwrap()
            .push((kind, n, Arc::downgrade(&g)));
        if self.keep_groups {
            self.keep.lock().unwrap().push(g.clone());
        }
        g
    }
}

impl InterruptManager for FakeIrqs {
    fn create_msi_group(
        &self,
        count: InterruptIndex,
    ) -> Result<Arc<dyn InterruptSourceGroup>, InterruptError> {
        // The device asks for MSI-X first, then MSI.
        let msix_made = self.groups.lock().unwrap().iter().any(|g| g.0 == "msix");
        let kind = if self.has_msix && !msix_made {
            "msix"
        } else {
            "msi"
        };
        Ok(self.make(kind, count, false))
    }

    fn create_intx_group(&self, irq: u32) -> Result<Arc<dyn InterruptSourceGroup>, InterruptError> {
        Ok(self.make("intx", irq, true))
    }
}

// ---- pinner --------------------------------------------------------------------------------

#[derive(Default)]
pub struct FakePinner {
    pub live_bytes: Arc<AtomicUsize>,
    pub fail: bool,
    pub journal: Journal,
}

impl Pinner for FakePinner {
    fn check(&self, total: u64) -> Result<(), PinError> {
        if self.fail {
            return Err(PinError::MemlockLimit {
                needed: total,
                locked: 0,
                required: total,
                limit: 64 << 10,
            });
        }
        Ok(())
    }

    fn pin(&self, addr: u64, len: u64) -> Result<PinnedRange, PinError> {
        self.live_bytes.fetch_add(len as usize, Ordering::SeqCst);
        log(&self.journal, "pin");
        let live = self.live_bytes.clone();
        let j = self.journal.clone();
        Ok(PinnedRange::new(addr, len, move || {
            live.fetch_sub(len as usize, Ordering::SeqCst);
            log(&j, "unpin");
        }))
    }
}

// ---- memory --------------------------------------------------------------------------------

/// Page-aligned anonymous memory (a stand-in for a mapped lender window).
pub struct AnonMap {
    pub addr: u64,
    pub len: u64,
}

impl AnonMap {
    pub fn new(len: u64) -> Self {
        // SAFETY: new private anonymous mapping, unmapped in Drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Self {
            addr: p as u64,
            len,
        }
    }

    pub fn read_u32(&self, off: u64) -> u32 {
        assert!(off + 4 <= self.len);
        // SAFETY: in bounds of our mapping.
        unsafe { std::ptr::read_volatile((self.addr + off) as *const u32) }
    }

    pub fn write_u32(&self, off: u64, v: u32) {
        assert!(off + 4 <= self.len);
        // SAFETY: in bounds of our mapping.
        unsafe { std::ptr::write_volatile((self.addr + off) as *mut u32, v) }
    }
}

impl Drop for AnonMap {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping made in `new`.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len as usize) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Rec {
        lost: Mutex<Vec<String>>,
        faults: Mutex<Vec<IommuFaultReport>>,
    }

    impl LinkEventHook for Rec {
        fn lease_lost(&self, why: &str) {
            self.lost.lock().unwrap().push(why.to_string());
        }
        fn iommu_fault(&self, f: &IommuFaultReport) {
            self.faults.lock().unwrap().push(f.clone());
        }
    }

    /// The fake reports like `LendingLink`: a loss before the hook is told when it is set,
    /// and only once; faults go to the hook; counters and quiesce are what the knobs say.
    #[test]
    fn fake_link_reports_loss_once_and_faults() {
        let link = FakeLink::new(
            RemoteDeviceInfo {
                id: "x".into(),
                config: vec![0; 256],
                bars: Vec::new(),
                msix: None,
            },
            Journal::default(),
        );
        let st = link.state.clone();
        assert_eq!(link.lender_counters().unwrap(), None);
        st.lock().unwrap().counters = Some(LenderCounters {
            doorbell_kicks: 3,
            ..LenderCounters::default()
        });
        assert_eq!(link.lender_counters().unwrap().unwrap().doorbell_kicks, 3);
        link.quiesce(true).unwrap();
        assert_eq!(st.lock().unwrap().calls, vec![LinkCall::Quiesce(true)]);

        FakeLink::lose(&st, "lender died");
        assert_eq!(link.lease_state(), LeaseState::Lost("lender died".into()));
        let rec = Arc::new(Rec::default());
        link.set_event_hook(rec.clone());
        FakeLink::lose(&st, "again");
        assert_eq!(*rec.lost.lock().unwrap(), vec!["lender died".to_string()]);
        let f = IommuFaultReport {
            iova: 0x1000,
            len: 8,
            write: true,
            total: 1,
        };
        FakeLink::fault(&st, &f);
        assert_eq!(*rec.faults.lock().unwrap(), vec![f]);
    }
}
