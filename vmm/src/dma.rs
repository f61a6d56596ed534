//! The VM's DMA manager: guest RAM is pinned once per VM, however many borrowed devices
//! master the bus.
//!
//! Every `RemotePciDevice` of the VM is given the same [`DmaManager`] (as its
//! `remote_pci::DmaPinSource`). A device that sets Bus Master Enable takes a [`DmaPin`] share;
//! the first share pins all guest RAM (populated in parallel by a
//! [`remote_pci::ParallelPinner`], counted once in [`ResourceCounters::pinned_bytes`], with
//! one `RLIMIT_MEMLOCK` check for guest RAM), later shares only count. Clearing BME, a reset
//! or removing the device drops its share; dropping the last share unpins.
//!
//! Each device then asks its lender to map the pinned RAM at IOVA = GPA, through the export of
//! guest RAM its lender session shares among that lender's devices
//! (`remote_pci::lending_link::session`): one pin per VM, one export per lender link.
//!
//! The shares live under one mutex, held while pinning and unpinning: `mlock` is not
//! reference counted by the kernel, so a `munlock` of the last share must never overlap the
//! `mlock` of a new first share. A device that sets BME while another device's first pin is
//! running waits for that pin (it could not map unpinned RAM anyway).

use std::sync::{Arc, Mutex, MutexGuard};

use remote_pci::{
    pin::pin_all, DmaPin, DmaPinSource, ParallelPinner, PinError, PinnedRange, Pinner,
};

use crate::remote::{CountingPinner, ResourceCounters};

#[derive(Default)]
struct Shares {
    /// Devices holding a share.
    holders: usize,
    /// The pinned ranges while `holders > 0`.
    pins: Vec<PinnedRange>,
    /// (host address, length) of the pinned ranges.
    ranges: Vec<(u64, u64)>,
    bytes: u64,
}

/// One per VM; devices hold shares of its pin (see the module docs).
pub struct DmaManager {
    pinner: Arc<dyn Pinner>,
    shares: Arc<Mutex<Shares>>,
}

fn lock(m: &Mutex<Shares>) -> MutexGuard<'_, Shares> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl DmaManager {
    /// Pins with one thread per CPU ([`ParallelPinner::available`]), counted in `counters`.
    pub fn new(counters: Arc<ResourceCounters>) -> Self {
        Self::with_pinner(Arc::new(ParallelPinner::available()), counters)
    }

    /// Pins through `pinner` (tests pass a recording one), counted in `counters`.
    pub fn with_pinner(pinner: Arc<dyn Pinner>, counters: Arc<ResourceCounters>) -> Self {
        Self {
            pinner: Arc::new(CountingPinner::new(pinner, counters)),
            shares: Arc::default(),
        }
    }

    /// Devices currently holding a share of the pin.
    pub fn holders(&self) -> usize {
        lock(&self.shares).holders
    }

    /// Bytes pinned now (guest RAM while any device has DMA enabled, else 0).
    pub fn pinned_bytes(&self) -> u64 {
        lock(&self.shares).bytes
    }
}

impl DmaPinSource for DmaManager {
    fn acquire(&self, ranges: &[(u64, u64)]) -> Result<DmaPin, PinError> {
        let mut s = lock(&self.shares);
        let fresh = if s.holders == 0 {
            let (pins, stats) = pin_all(self.pinner.as_ref(), ranges)?;
            s.pins = pins;
            s.ranges = ranges.to_vec();
            s.bytes = stats.bytes;
            Some(stats)
        } else {
            if s.ranges != ranges {
                // Guest RAM does not move; a device asking for other ranges is a VMM bug.
                log::error!(
                    "dma pin asked for {ranges:x?} while {:x?} is pinned; sharing the pin",
                    s.ranges
                );
            }
            None
        };
        s.holders += 1;
        let bytes = s.bytes;
        log::debug!("dma pin: {} holder(s) of {bytes:#x} bytes", s.holders);
        let shares = self.shares.clone();
        Ok(DmaPin::new(bytes, fresh, move || {
            let mut s = lock(&shares);
            s.holders = s.holders.saturating_sub(1);
            if s.holders == 0 {
                // Unpinned under the lock: a new first share waits for the munlock.
                let pins = std::mem::take(&mut s.pins);
                s.ranges.clear();
                s.bytes = 0;
                drop(pins);
                log::info!("dma pin: last holder gone, guest ram unpinned");
            }
        }))
    }
}

/// A pinner that first hands out ranges pinned ahead of time (a migration destination pins
/// guest RAM while the source still runs, [`crate::Vm::prepin_ram`]): a `pin` of exactly such
/// a range takes it, anything else goes to `inner`. [`Prepinned::disarm`] ends that; the
/// caller decides what becomes of ranges nobody took.
pub struct Prepinned {
    inner: Arc<dyn Pinner>,
    ready: Mutex<Option<Vec<PinnedRange>>>,
}

impl Prepinned {
    pub fn new(inner: Arc<dyn Pinner>, pins: Vec<PinnedRange>) -> Self {
        Self {
            inner,
            ready: Mutex::new(Some(pins)),
        }
    }

    /// From now on every pin goes to `inner`; returns the ranges not taken.
    pub fn disarm(&self) -> Vec<PinnedRange> {
        self.ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_default()
    }
}

impl Pinner for Prepinned {
    fn check(&self, total: u64) -> Result<(), PinError> {
        self.inner.check(total)
    }

    fn pin(&self, addr: u64, len: u64) -> Result<PinnedRange, PinError> {
        let mut ready = self.ready.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = ready.as_mut() {
            if let Some(i) = v.iter().position(|p| p.addr() == addr && p.len() == len) {
                log::info!("dma pin: {len:#x} bytes at {addr:#x} were pinned ahead");
                return Ok(v.swap_remove(i));
            }
        }
        drop(ready);
        self.inner.pin(addr, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Records `check` demands and live pinned bytes.
    #[derive(Default)]
    struct Recording {
        checks: Mutex<Vec<u64>>,
        live: Arc<AtomicU64>,
        fail: bool,
    }

    impl Pinner for Recording {
        fn check(&self, total: u64) -> Result<(), PinError> {
            self.checks.lock().unwrap().push(total);
            Ok(())
        }
        fn pin(&self, addr: u64, len: u64) -> Result<PinnedRange, PinError> {
            if self.fail {
                return Err(PinError::Unaligned { addr, len });
            }
            self.live.fetch_add(len, Ordering::SeqCst);
            let live = self.live.clone();
            Ok(PinnedRange::new(addr, len, move || {
                live.fetch_sub(len, Ordering::SeqCst);
            }))
        }
    }

    const RAM: [(u64, u64); 2] = [
        (0x7f00_0000_0000, 0xc000_0000),
        (0x7f10_0000_0000, 0x4000_0000),
    ];

    #[test]
    fn ram_is_pinned_once_and_unpinned_with_the_last_share() {
        let rec = Arc::new(Recording::default());
        let counters = Arc::new(ResourceCounters::default());
        let m = DmaManager::with_pinner(rec.clone(), counters.clone());
        let a = m.acquire(&RAM).unwrap();
        assert!(a.fresh().is_some(), "the first share pins");
        let b = m.acquire(&RAM).unwrap();
        assert!(b.fresh().is_none(), "the second share only counts");
        assert_eq!(m.holders(), 2);
        assert_eq!(rec.live.load(Ordering::SeqCst), 4 << 30);
        assert_eq!(counters.pinned_bytes.load(Ordering::SeqCst), 4 << 30);
        assert_eq!(
            *rec.checks.lock().unwrap(),
            vec![4u64 << 30],
            "one memlock check"
        );
        drop(a);
        assert_eq!(counters.pinned_bytes.load(Ordering::SeqCst), 4 << 30);
        assert_eq!(m.pinned_bytes(), 4 << 30);
        drop(b);
        assert_eq!(rec.live.load(Ordering::SeqCst), 0);
        assert_eq!(counters.pinned_bytes.load(Ordering::SeqCst), 0);
        assert_eq!(m.holders(), 0);
        // Pinned again by the next first share.
        let c = m.acquire(&RAM).unwrap();
        assert!(c.fresh().is_some());
        assert_eq!(rec.checks.lock().unwrap().len(), 2);
        drop(c);
        assert_eq!(counters.pinned_bytes.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn ranges_pinned_ahead_are_taken_instead_of_pinned_again() {
        let rec = Arc::new(Recording::default());
        let ahead: Vec<PinnedRange> = RAM.iter().map(|&(a, l)| rec.pin(a, l).unwrap()).collect();
        assert_eq!(rec.live.load(Ordering::SeqCst), 4 << 30);
        let pre = Arc::new(Prepinned::new(rec.clone(), ahead));
        let counters = Arc::new(ResourceCounters::default());
        let m = DmaManager::with_pinner(pre.clone(), counters.clone());
        let a = m.acquire(&RAM).unwrap();
        // Taken, not pinned a second time; counted as pinned by the VM.
        assert_eq!(rec.live.load(Ordering::SeqCst), 4 << 30);
        assert_eq!(counters.pinned_bytes.load(Ordering::SeqCst), 4 << 30);
        assert!(pre.disarm().is_empty());
        drop(a);
        assert_eq!(rec.live.load(Ordering::SeqCst), 0);
        // Disarmed: the next first share pins through the inner pinner.
        let b = m.acquire(&RAM).unwrap();
        assert_eq!(rec.live.load(Ordering::SeqCst), 4 << 30);
        drop(b);
        assert_eq!(rec.live.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_failed_first_pin_leaves_no_share_behind() {
        let rec = Arc::new(Recording {
            fail: true,
            ..Recording::default()
        });
        let counters = Arc::new(ResourceCounters::default());
        let m = DmaManager::with_pinner(rec, counters.clone());
        assert!(m.acquire(&RAM).is_err());
        assert_eq!(m.holders(), 0);
        assert_eq!(counters.pinned_bytes.load(Ordering::SeqCst), 0);
    }
}
