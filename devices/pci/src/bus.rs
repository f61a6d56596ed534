//! Address-range buses (port I/O and MMIO) that dispatch guest accesses to devices.
//!
//! Modelled on Cloud Hypervisor's `vm-device` bus: a sorted map from range base to device,
//! devices behind `Arc<Mutex<_>>` so one device can sit on several ranges (e.g. a PCI BAR
//! and its config space) and be removed on hot-unplug.
//!
//! [`Bus::insert_range`] returns a [`BusRange`] guard: dropping it takes the range off the
//! bus, so a hot-unplugged device's BAR ranges go with the value that registered them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};

/// A device reachable through a [`Bus`] range.
pub trait BusDevice: Send {
    /// Guest read of `data.len()` bytes at `base + offset`, where `base` is the range start.
    fn read(&mut self, base: u64, offset: u64, data: &mut [u8]);
    /// Guest write of `data` at `base + offset`.
    fn write(&mut self, base: u64, offset: u64, data: &[u8]);
}

/// Errors from bus range management and dispatch.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    #[error("bus range {base:#x}+{len:#x} overlaps an existing range")]
    Overlap { base: u64, len: u64 },
    #[error("bus range of zero length at {0:#x}")]
    ZeroLength(u64),
    #[error("no device at bus address {0:#x}")]
    NoDevice(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Range {
    base: u64,
    len: u64,
}

impl Range {
    fn overlaps(&self, base: u64, len: u64) -> bool {
        self.base < base.saturating_add(len) && base < self.base.saturating_add(self.len)
    }
}

/// Shared handle to a device on a bus.
pub type SharedBusDevice = Arc<Mutex<dyn BusDevice>>;

/// A thread-safe address bus; vCPU threads dispatch concurrently, hot-plug mutates rarely.
#[derive(Default)]
pub struct Bus {
    ranges: RwLock<BTreeMap<Range, SharedBusDevice>>,
}

impl Bus {
    pub fn new() -> Self {
        Self::default()
    }

    /// Puts `device` at `[base, base + len)`.
    pub fn insert(&self, device: SharedBusDevice, base: u64, len: u64) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::ZeroLength(base));
        }
        let mut ranges = self.ranges.write().unwrap_or_else(|e| e.into_inner());
        if ranges.keys().any(|r| r.overlaps(base, len)) {
            return Err(BusError::Overlap { base, len });
        }
        ranges.insert(Range { base, len }, device);
        Ok(())
    }

    /// Puts `device` at `[base, base + len)` and returns the guard that removes it again.
    pub fn insert_range(
        self: &Arc<Self>,
        device: SharedBusDevice,
        base: u64,
        len: u64,
    ) -> Result<BusRange, BusError> {
        self.insert(device, base, len)?;
        Ok(BusRange {
            bus: Arc::clone(self),
            base,
            len,
        })
    }

    /// Removes the range that starts at `base`; returns its device.
    pub fn remove(&self, base: u64) -> Result<SharedBusDevice, BusError> {
        let mut ranges = self.ranges.write().unwrap_or_else(|e| e.into_inner());
        let key = ranges
            .keys()
            .find(|r| r.base == base)
            .copied()
            .ok_or(BusError::NoDevice(base))?;
        ranges.remove(&key).ok_or(BusError::NoDevice(base))
    }

    /// Moves the range at `old_base` to `new_base` (a guest reprogramming a BAR).
    pub fn relocate(&self, old_base: u64, new_base: u64) -> Result<(), BusError> {
        self.move_range(old_base, new_base, None)
    }

    /// Makes the range at `old_base` `[new_base, new_base + new_len)` (a resized BAR); on
    /// an overlap with another range it stays as it was.
    pub fn resize(&self, old_base: u64, new_base: u64, new_len: u64) -> Result<(), BusError> {
        if new_len == 0 {
            return Err(BusError::ZeroLength(new_base));
        }
        self.move_range(old_base, new_base, Some(new_len))
    }

    /// The range at `old_base`, at `new_base` with `new_len` bytes (its own length when
    /// `None`), unless that overlaps another range.
    fn move_range(
        &self,
        old_base: u64,
        new_base: u64,
        new_len: Option<u64>,
    ) -> Result<(), BusError> {
        let mut ranges = self.ranges.write().unwrap_or_else(|e| e.into_inner());
        let key = ranges
            .keys()
            .find(|r| r.base == old_base)
            .copied()
            .ok_or(BusError::NoDevice(old_base))?;
        let new_len = new_len.unwrap_or(key.len);
        if ranges
            .keys()
            .any(|r| *r != key && r.overlaps(new_base, new_len))
        {
            return Err(BusError::Overlap {
                base: new_base,
                len: new_len,
            });
        }
        let device = ranges.remove(&key).ok_or(BusError::NoDevice(old_base))?;
        ranges.insert(
            Range {
                base: new_base,
                len: new_len,
            },
            device,
        );
        Ok(())
    }

    /// Number of ranges currently on the bus (leak accounting in tests).
    pub fn len(&self) -> usize {
        self.ranges.read().map(|r| r.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn resolve(&self, addr: u64) -> Option<(u64, SharedBusDevice)> {
        let ranges = self.ranges.read().unwrap_or_else(|e| e.into_inner());
        let (range, dev) = ranges
            .range(
                ..=Range {
                    base: addr,
                    len: u64::MAX,
                },
            )
            .next_back()?;
        (addr - range.base < range.len).then(|| (range.base, dev.clone()))
    }

    /// Dispatches a read; `Err(NoDevice)` lets the caller decide (e.g. return all-ones).
    pub fn read(&self, addr: u64, data: &mut [u8]) -> Result<(), BusError> {
        let (base, dev) = self.resolve(addr).ok_or(BusError::NoDevice(addr))?;
        dev.lock()
            .unwrap_or_else(|e| e.into_inner())
            .read(base, addr - base, data);
        Ok(())
    }

    /// Dispatches a write.
    pub fn write(&self, addr: u64, data: &[u8]) -> Result<(), BusError> {
        let (base, dev) = self.resolve(addr).ok_or(BusError::NoDevice(addr))?;
        dev.lock()
            .unwrap_or_else(|e| e.into_inner())
            .write(base, addr - base, data);
        Ok(())
    }
}

/// A range registered on a [`Bus`]; dropping it removes the range (and the bus's reference
/// to the device behind it).
pub struct BusRange {
    bus: Arc<Bus>,
    base: u64,
    len: u64,
}

impl BusRange {
    /// Current start of the range.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Length of the range.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: a bus range is never empty (zero lengths are refused at insert).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Moves the range to `new_base` (the guest reprogrammed a BAR); on an overlap the
    /// range stays where it was.
    pub fn relocate(&mut self, new_base: u64) -> Result<(), BusError> {
        self.bus.relocate(self.base, new_base)?;
        self.base = new_base;
        Ok(())
    }

    /// Makes the range `[new_base, new_base + new_len)` (a resized BAR); on an overlap it
    /// stays as it was.
    pub fn resize(&mut self, new_base: u64, new_len: u64) -> Result<(), BusError> {
        self.bus.resize(self.base, new_base, new_len)?;
        self.base = new_base;
        self.len = new_len;
        Ok(())
    }
}

impl std::fmt::Debug for BusRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BusRange({:#x}+{:#x})", self.base, self.len)
    }
}

impl Drop for BusRange {
    fn drop(&mut self) {
        if let Err(e) = self.bus.remove(self.base) {
            // Only possible if someone removed the range behind the guard's back.
            log::warn!("bus range {:#x}+{:#x}: {e}", self.base, self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Recorder {
        last: Vec<(u64, u64, Vec<u8>)>,
    }

    impl BusDevice for Recorder {
        fn read(&mut self, base: u64, offset: u64, data: &mut [u8]) {
            data.fill((base + offset) as u8);
        }
        fn write(&mut self, base: u64, offset: u64, data: &[u8]) {
            self.last.push((base, offset, data.to_vec()));
        }
    }

    #[test]
    fn dispatches_by_range_and_rejects_overlap() {
        let bus = Bus::new();
        let dev = Arc::new(Mutex::new(Recorder { last: vec![] }));
        bus.insert(dev.clone(), 0x100, 0x10).unwrap();
        assert_eq!(
            bus.insert(dev.clone(), 0x10f, 1),
            Err(BusError::Overlap {
                base: 0x10f,
                len: 1
            })
        );
        bus.insert(dev.clone(), 0x110, 1).unwrap();
        let mut b = [0u8; 2];
        bus.read(0x105, &mut b).unwrap();
        assert_eq!(b, [0x05, 0x05]);
        assert_eq!(bus.read(0xff, &mut b), Err(BusError::NoDevice(0xff)));
        assert_eq!(bus.read(0x111, &mut b), Err(BusError::NoDevice(0x111)));
        bus.write(0x10c, &[1, 2]).unwrap();
        assert_eq!(dev.lock().unwrap().last, vec![(0x100, 0xc, vec![1, 2])]);
        bus.relocate(0x100, 0x200).unwrap();
        assert!(bus.read(0x105, &mut b).is_err());
        bus.read(0x205, &mut b).unwrap();
        bus.remove(0x200).unwrap();
        assert_eq!(bus.len(), 1);
        assert_eq!(bus.insert(dev, 0x5, 0), Err(BusError::ZeroLength(5)));
    }

    #[test]
    fn bus_range_guard_removes_and_relocates() {
        let bus = Arc::new(Bus::new());
        let dev = Arc::new(Mutex::new(Recorder { last: vec![] }));
        let mut g = bus.insert_range(dev.clone(), 0x100, 0x10).unwrap();
        assert_eq!(Arc::strong_count(&dev), 2, "the bus holds the device");
        assert!(bus.insert_range(dev.clone(), 0x108, 0x10).is_err());
        let mut b = [0u8; 1];
        g.relocate(0x200).unwrap();
        assert_eq!(g.base(), 0x200);
        assert!(bus.read(0x100, &mut b).is_err());
        bus.read(0x200, &mut b).unwrap();
        let other = bus.insert_range(dev.clone(), 0x300, 0x10).unwrap();
        assert!(g.relocate(0x308).is_err(), "overlap refused");
        assert_eq!(g.base(), 0x200, "a refused move leaves the range");
        drop(g);
        assert!(
            bus.read(0x200, &mut b).is_err(),
            "dropping the guard removes the range"
        );
        assert_eq!(bus.len(), 1);
        drop(other);
        assert!(bus.is_empty());
        assert_eq!(Arc::strong_count(&dev), 1, "no reference left on the bus");
        // The freed range can be registered again.
        let _again = bus.insert_range(dev, 0x100, 0x10).unwrap();
    }

    /// A resized BAR's range grows or shrinks in place or elsewhere; one that would overlap
    /// another range, or be empty, stays as it was.
    #[test]
    fn bus_range_guard_resizes() {
        let bus = Arc::new(Bus::new());
        let dev = Arc::new(Mutex::new(Recorder { last: vec![] }));
        let mut g = bus.insert_range(dev.clone(), 0x1000, 0x100).unwrap();
        let _other = bus.insert_range(dev.clone(), 0x3000, 0x100).unwrap();
        let mut b = [0u8; 1];
        g.resize(0x1000, 0x1000).unwrap();
        assert_eq!((g.base(), g.len()), (0x1000, 0x1000));
        bus.read(0x1fff, &mut b).unwrap();
        assert_eq!(
            g.resize(0x2000, 0x2000),
            Err(BusError::Overlap {
                base: 0x2000,
                len: 0x2000
            })
        );
        assert_eq!((g.base(), g.len()), (0x1000, 0x1000), "refused: unchanged");
        assert!(g.resize(0x1000, 0).is_err());
        g.resize(0x4000, 0x10).unwrap();
        assert!(bus.read(0x1000, &mut b).is_err());
        bus.read(0x400f, &mut b).unwrap();
        assert!(bus.read(0x4010, &mut b).is_err());
        drop(g);
        assert_eq!(bus.len(), 1);
    }
}
