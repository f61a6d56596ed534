//! Events of one lease: interrupts relayed on tcp, kick-only doorbells, IOMMU faults and
//! the loss of the lease, told to the VMM's [`LinkEventHook`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use lending::protocol::Event;
use log::{debug, error, info, warn};
use vmm_sys_util::eventfd::EventFd;

use super::{our_kicks, our_kind};
use crate::link::{IommuFaultReport, IrqKind, KickCell, LeaseState, LinkEventHook};

/// The VMM's hook and whether it has been told of the loss (under one lock, so the loss is
/// reported exactly once whichever of the loss and `set_event_hook` comes first).
#[derive(Default)]
struct HookSlot {
    hook: Option<Arc<dyn LinkEventHook>>,
    lost_reported: bool,
}

/// Receives events of one lease (from the link's own thread or an external pump).
#[derive(Clone)]
pub struct LendingEventSink {
    pub(super) lease: u64,
    /// Kick-only doorbells: from BAR_WRITE/RESET replies and KICKS events.
    pub(super) kicks: Arc<KickCell>,
    pub(super) state: Arc<Mutex<LeaseState>>,
    hook: Arc<Mutex<HookSlot>>,
    /// Held across a whole report of the loss, the hook's call included: a `set_event_hook`
    /// racing the event pump's report returns only once the hook has been told (the hook
    /// must not set a hook of this link from `lease_lost`).
    reporting: Arc<Mutex<()>>,
    /// Per kind: the eventfds to write on relayed interrupts (tcp). Bound: the vectors the
    /// VMM wired (at most `lending::protocol::MAX_IRQS`); relayed interrupts are eventfd
    /// writes, never queued here (the session's event queue is `lending::client::EVENT_QUEUE`).
    pub(super) relay: Arc<Mutex<HashMap<IrqKind, Vec<EventFd>>>>,
    pub(super) counts: Arc<Mutex<Vec<u64>>>,
    /// Times the session's event pump returned from its wait (events, wake-ups).
    pub(super) wakeups: Arc<AtomicU64>,
}

impl LendingEventSink {
    /// A sink for `lease`, in the state `Active`; `wakeups` is the pump's wake-up count.
    pub(super) fn new(lease: u64, wakeups: Arc<AtomicU64>) -> Self {
        Self {
            lease,
            kicks: Arc::default(),
            state: Arc::new(Mutex::new(LeaseState::Active)),
            hook: Arc::default(),
            reporting: Arc::default(),
            relay: Arc::default(),
            counts: Arc::default(),
            wakeups,
        }
    }

    /// The lease whose events this sink takes.
    pub fn lease(&self) -> u64 {
        self.lease
    }

    /// Handles `ev` if it belongs to this lease; returns whether it did.
    pub fn handle(&self, ev: &Event) -> bool {
        match ev {
            Event::Irq(i) if i.lease == self.lease => {
                let relay = self.relay.lock().unwrap_or_else(PoisonError::into_inner);
                let v = i.vector as usize;
                match relay.get(&our_kind(i.kind)).and_then(|fds| fds.get(v)) {
                    Some(fd) => {
                        if let Err(e) = fd.write(1) {
                            warn!("lease {}: relaying irq {v}: {e}", self.lease);
                        }
                        let mut c = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
                        if c.len() <= v {
                            c.resize(v + 1, 0);
                        }
                        c[v] += 1;
                    }
                    None => debug!(
                        "lease {}: irq {:?}/{v} with no target dropped",
                        self.lease, i.kind
                    ),
                }
                true
            }
            Event::DeviceGone(g) if g.lease == self.lease => {
                error!("lease {}: device gone: {}", self.lease, g.reason);
                self.lost(format!("device gone: {}", g.reason));
                true
            }
            Event::IommuFault(f) if f.lease == self.lease => {
                // The lender rate-limits these; `total` is exact.
                warn!(
                    "lease {}: iommu fault: dma {} of {:#x} bytes at iova {:#x} (fault #{})",
                    self.lease,
                    if f.write { "write" } else { "read" },
                    f.len,
                    f.iova,
                    f.total
                );
                let hook = self
                    .hook
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .hook
                    .clone();
                if let Some(h) = hook {
                    h.iommu_fault(&IommuFaultReport {
                        iova: f.iova,
                        len: f.len,
                        write: f.write,
                        total: f.total,
                    });
                }
                true
            }
            Event::Kicks(k) if k.lease == self.lease => {
                debug!(
                    "lease {}: {} kick-only doorbells (generation {})",
                    self.lease,
                    k.kicks.offsets.len(),
                    k.kicks.generation
                );
                self.kicks.offer(our_kicks(k.kicks.clone()));
                true
            }
            Event::LeaseMoved(m) if m.lease == self.lease => {
                // Live migration handed the lease to the destination: this end lets go of
                // the device, it is not lost (no lost-device report).
                info!("lease {}: moved to {}", self.lease, m.to);
                true
            }
            Event::Fatal(f) if f.lease == self.lease => {
                error!("lease {}: fatal device error: {}", self.lease, f.message);
                true
            }
            _ => false,
        }
    }

    /// Marks the lease lost (the first reason stays) and tells the hook, once.
    pub(super) fn lost(&self, why: String) {
        let why = {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            match &*st {
                LeaseState::Lost(first) => first.clone(),
                _ => {
                    *st = LeaseState::Lost(why.clone());
                    why
                }
            }
        };
        self.report_lost(&why);
    }

    /// Calls the hook's `lease_lost` if there is a hook and it was not told yet.
    fn report_lost(&self, why: &str) {
        let _turn = self
            .reporting
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let hook = {
            let mut slot = self.hook.lock().unwrap_or_else(PoisonError::into_inner);
            if slot.lost_reported {
                return;
            }
            let Some(h) = slot.hook.clone() else {
                return;
            };
            slot.lost_reported = true;
            h
        };
        info!("lease {}: reporting the loss: {why}", self.lease);
        hook.lease_lost(why);
    }

    pub(super) fn set_hook(&self, hook: Arc<dyn LinkEventHook>) {
        self.hook
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .hook = Some(hook);
        let lost = match &*self.state.lock().unwrap_or_else(PoisonError::into_inner) {
            LeaseState::Lost(why) => Some(why.clone()),
            _ => None,
        };
        if let Some(why) = lost {
            self.report_lost(&why);
        }
    }

    /// How often the session's event pump woke up: once per event of any lease of the
    /// session plus once when it stopped. It never wakes on a timer.
    pub fn event_thread_wakeups(&self) -> u64 {
        self.wakeups.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lending::protocol;

    fn sink(lease: u64) -> LendingEventSink {
        LendingEventSink::new(lease, Arc::default())
    }

    fn state(s: &LendingEventSink) -> LeaseState {
        s.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// A lease moved by live migration is handled but not lost; a gone device is lost.
    #[test]
    fn lease_moved_is_not_a_lost_device() {
        let s = sink(7);
        let moved = Event::LeaseMoved(protocol::LeaseMoved {
            lease: 7,
            to: "node2/vm0".into(),
        });
        assert!(s.handle(&moved));
        assert_eq!(state(&s), LeaseState::Active);
        let other = Event::LeaseMoved(protocol::LeaseMoved {
            lease: 8,
            to: "node2/vm0".into(),
        });
        assert!(!s.handle(&other), "another lease's event is not ours");
        let gone = Event::DeviceGone(protocol::DeviceGone {
            lease: 7,
            reason: "x".into(),
        });
        assert!(s.handle(&gone));
        assert!(matches!(state(&s), LeaseState::Lost(_)));
    }
}
