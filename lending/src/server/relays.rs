//! What a lease's device raises, relayed to its borrower: interrupts as doorbells or event
//! messages, INTx resamples, and IOMMU faults as rate-limited events.

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use ntb::{Endpoint, Message};

use crate::backend::{DeviceBackend, IrqTrigger};
use crate::iommu::{FaultListener, IommuDomain, IommuFault};
use crate::protocol::{
    Event, IommuFaultEvent, IrqEvent, IOMMU_FAULT_BURST, IOMMU_FAULT_INTERVAL_MS,
};

/// Rings a borrower doorbell bit.
pub(super) struct DoorbellTrigger {
    pub(super) ep: Weak<dyn Endpoint>,
    pub(super) bit: u8,
}

impl IrqTrigger for DoorbellTrigger {
    fn trigger(&self) {
        if let Some(ep) = self.ep.upgrade() {
            if let Err(e) = ep.ring_peer(1u64 << self.bit) {
                log::debug!("doorbell {} to {}: {e}", self.bit, ep.peer_node());
            }
        }
    }
}

/// Re-checks a device's INTx after the borrower's resample.
pub(super) struct ResampleTrigger {
    pub(super) backend: Arc<dyn DeviceBackend>,
}

impl IrqTrigger for ResampleTrigger {
    fn trigger(&self) {
        self.backend.intx_resample();
    }
}

/// Sends [`Event::IommuFault`] for one lease's faults to its borrower, rate-limited per lease
/// (see [`IommuFaultEvent`]: the first [`IOMMU_FAULT_BURST`], then at most one per
/// [`IOMMU_FAULT_INTERVAL_MS`]); `total` is exact in every event sent.
pub(super) struct FaultRelay {
    pub(super) ep: Weak<dyn Endpoint>,
    pub(super) lease: u64,
    /// The domain's fault count when the lease was granted.
    pub(super) base: u64,
    pub(super) limit: Mutex<FaultLimit>,
}

#[derive(Default)]
pub(super) struct FaultLimit {
    pub(super) sent: u64,
    pub(super) last: Option<Instant>,
}

impl FaultLimit {
    /// Whether an event may go now (and records it).
    fn admit(&mut self, now: Instant) -> bool {
        let interval = Duration::from_millis(IOMMU_FAULT_INTERVAL_MS);
        let ok = self.sent < IOMMU_FAULT_BURST
            || self
                .last
                .is_none_or(|t| now.saturating_duration_since(t) >= interval);
        if ok {
            self.sent += 1;
            self.last = Some(now);
        }
        ok
    }
}

impl FaultListener for FaultRelay {
    fn fault(&self, f: &IommuFault, total: u64) {
        let admitted = match self.limit.lock() {
            Ok(mut g) => g.admit(Instant::now()),
            Err(p) => p.into_inner().admit(Instant::now()),
        };
        if !admitted {
            return;
        }
        let Some(ep) = self.ep.upgrade() else {
            return;
        };
        let ev = Event::IommuFault(IommuFaultEvent {
            lease: self.lease,
            iova: f.iova,
            len: f.len,
            write: f.write,
            total: total.saturating_sub(self.base),
        });
        match ev.encode() {
            Ok((op, p)) => {
                if let Err(e) = ep.send(Message::raw(op, p)) {
                    log::debug!("iommu fault event to {}: {e}", ep.peer_node());
                }
            }
            Err(e) => log::error!("iommu fault event encode: {e}"),
        }
    }
}

/// A [`FaultRelay`] installed on a domain; dropping it removes it.
pub(super) struct FaultRelayGuard {
    pub(super) domain: Arc<dyn IommuDomain>,
}

impl Drop for FaultRelayGuard {
    fn drop(&mut self) {
        self.domain.set_fault_listener(None);
    }
}

/// Sends an IRQ event message.
pub(super) struct MessageTrigger {
    pub(super) ep: Weak<dyn Endpoint>,
    pub(super) ev: IrqEvent,
}

impl IrqTrigger for MessageTrigger {
    fn trigger(&self) {
        if let Some(ep) = self.ep.upgrade() {
            match Event::Irq(self.ev).encode() {
                Ok((op, p)) => {
                    if let Err(e) = ep.send(Message::raw(op, p)) {
                        log::debug!("irq event to {}: {e}", ep.peer_node());
                    }
                }
                Err(e) => log::error!("irq event encode: {e}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_events_burst_then_one_per_interval() {
        let mut l = FaultLimit::default();
        let t0 = Instant::now();
        let burst = (0..100).filter(|_| l.admit(t0)).count() as u64;
        assert_eq!(burst, IOMMU_FAULT_BURST);
        let step = Duration::from_millis(IOMMU_FAULT_INTERVAL_MS / 5);
        // Faults every fifth of the interval for ten intervals: one event per interval.
        let later = (1..=50u32).filter(|i| l.admit(t0 + step * *i)).count();
        assert_eq!(later, 10);
    }
}
