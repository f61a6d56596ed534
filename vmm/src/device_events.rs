//! The bridge from a borrowed device's threads to the control plane: a [`DeviceHook`] is the
//! link's [`LinkEventHook`] (lease loss, IOMMU faults, on the link's event thread) and the
//! device's [`DeviceObserver`] (DMA map/unmap, on the vCPU that set Bus Master Enable).
//!
//! Nothing here blocks or talks to a lender: a lease loss only writes the device's eventfd,
//! which the control thread's event loop watches (one subscriber per device), so the
//! surprise removal runs there within milliseconds; the other callbacks only emit events.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use api::events::EventBus;
use remote_pci::{DeviceObserver, IommuFaultReport, LinkEventHook};
use serde_json::Value;
use vmm_sys_util::eventfd::EventFd;

/// Lets `burst` events through, then at most `per_sec` a second; counts the rest.
pub struct RateLimit {
    burst: u32,
    per_sec: u32,
    window: Instant,
    in_window: u32,
    total: u64,
    suppressed: u64,
}

impl RateLimit {
    pub fn new(burst: u32, per_sec: u32) -> Self {
        Self {
            burst,
            per_sec,
            window: Instant::now(),
            in_window: 0,
            total: 0,
            suppressed: 0,
        }
    }

    /// Whether this occurrence may be reported; with it, how many were suppressed since the
    /// last one that was.
    pub fn allow(&mut self) -> Option<u64> {
        self.total += 1;
        if self.total <= u64::from(self.burst) {
            return Some(std::mem::take(&mut self.suppressed));
        }
        if self.window.elapsed() >= Duration::from_secs(1) {
            self.window = Instant::now();
            self.in_window = 0;
        }
        if self.in_window < self.per_sec {
            self.in_window += 1;
            return Some(std::mem::take(&mut self.suppressed));
        }
        self.suppressed += 1;
        None
    }
}

/// One device's hook and observer.
pub struct DeviceHook {
    id: String,
    lost: EventFd,
    events: Arc<EventBus>,
    faults: Mutex<RateLimit>,
}

impl DeviceHook {
    /// `lost` is written when the lease is lost (the control loop watches a clone of it).
    pub fn new(id: &str, lost: EventFd, events: Arc<EventBus>) -> Self {
        Self {
            id: id.to_string(),
            lost,
            events,
            // Faults come from a guest that may loop: the first 16, then 2 a second.
            faults: Mutex::new(RateLimit::new(16, 2)),
        }
    }
}

impl LinkEventHook for DeviceHook {
    fn lease_lost(&self, why: &str) {
        log::info!("{}: lease lost ({why}); waking the control loop", self.id);
        if let Err(e) = self.lost.write(1) {
            log::error!("{}: cannot signal the lease loss: {e}", self.id);
        }
    }

    fn iommu_fault(&self, f: &IommuFaultReport) {
        let allowed = self
            .faults
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .allow();
        let Some(suppressed) = allowed else {
            log::trace!("{}: iommu fault at {:#x} (not reported)", self.id, f.iova);
            return;
        };
        log::warn!(
            "{}: iommu fault: dma {} of {:#x} bytes at iova {:#x} refused ({} so far)",
            self.id,
            if f.write { "write" } else { "read" },
            f.len,
            f.iova,
            f.total
        );
        self.events.emit(
            "iommu",
            "iommu-fault",
            [
                ("id", Value::from(self.id.as_str())),
                ("iova", Value::from(f.iova)),
                ("len", Value::from(f.len)),
                ("write", Value::from(f.write)),
                ("total", Value::from(f.total)),
                ("suppressed", Value::from(suppressed)),
            ],
        );
    }
}

impl DeviceObserver for DeviceHook {
    fn dma_mapped(&self, id: &str, bytes: u64, pinned: u64, took: Duration) {
        self.events.emit(
            "dma",
            "dma-mapped",
            [
                ("id", Value::from(id)),
                ("bytes", Value::from(bytes)),
                ("pinned_bytes", Value::from(pinned)),
                ("took_us", Value::from(took.as_micros() as u64)),
            ],
        );
    }

    fn dma_unmapped(&self, id: &str, bytes: u64, took: Duration) {
        self.events.emit(
            "dma",
            "dma-unmapped",
            [
                ("id", Value::from(id)),
                ("bytes", Value::from(bytes)),
                ("took_us", Value::from(took.as_micros() as u64)),
            ],
        );
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn rate_limit_lets_a_burst_through_then_counts() {
        let mut r = RateLimit::new(3, 1);
        assert_eq!(r.allow(), Some(0));
        assert_eq!(r.allow(), Some(0));
        assert_eq!(r.allow(), Some(0));
        // One more in this second, then suppressed.
        assert_eq!(r.allow(), Some(0));
        assert_eq!(r.allow(), None);
        assert_eq!(r.allow(), None);
        r.window -= Duration::from_secs(2);
        assert_eq!(r.allow(), Some(2));
    }

    #[test]
    fn lease_loss_signals_and_faults_are_limited() {
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let bus = EventBus::new();
        let hook = DeviceHook::new("d0", evt.try_clone().unwrap(), bus.clone());
        hook.lease_lost("lender gone");
        assert_eq!(evt.read().unwrap(), 1);
        for i in 0..100 {
            hook.iommu_fault(&IommuFaultReport {
                iova: i,
                len: 8,
                write: true,
                total: i + 1,
            });
        }
        let faults = bus
            .recent()
            .iter()
            .filter(|e| e.event == "iommu-fault")
            .count();
        assert!((16..=18).contains(&faults), "{faults} fault events");
    }
}
