//! One connection to a lender, shared by every lease a VM borrows there.
//!
//! A [`LenderSession`] owns the [`LenderClient`] (one authenticated fabric link), one event
//! pump for all of its leases, and the export of guest RAM as a fabric window:
//!
//! * Every [`super::LendingLink`] of the session registers its [`LendingEventSink`]; the pump
//!   hands each event to the sink of the lease it names. When the link goes down, every
//!   registered lease is lost at once (they all travelled over it).
//! * Guest RAM is exported once per session ([`LenderSession::ram_export`]): the first
//!   device to set Bus Master Enable exports it, later devices of the same lender share the
//!   export ([`RamExport`], reference counted) and only ask the lender to map it into their
//!   own IOMMU domain at IOVA = GPA. The lender maps the borrower's window once per session
//!   as well, and its domains share that mapping. The last device to let go of DMA drops the
//!   last reference, which revokes the export.
//!
//! The session lives as long as one of its links (each holds an `Arc`); whoever keeps a
//! directory of sessions (the VMM's `LenderSource`) holds them weakly.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use lending::client::{ClientError, EventWaker, LenderClient};
use lending::protocol::Event;
use log::{debug, error, info};
use ntb::{ExportedWindow, FabricError};
use pci::vm_ops::GuestRamRegion;

use super::events::LendingEventSink;
use super::{link_err, LendingLinkError};
use crate::link::LinkError;

/// VMM-wide counts of what sessions hold (leak accounting: both are 0 once every borrowed
/// device is gone).
#[derive(Debug, Default)]
pub struct SessionCounters {
    /// Sessions (connections to a lender) alive.
    pub sessions: AtomicUsize,
    /// Exports of guest RAM alive (at most one per session).
    pub ram_exports: AtomicUsize,
}

/// Options of [`LenderSession::new`].
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Run a thread that receives the connection's events (IRQ relay, device gone, faults)
    /// for every lease of the session. Without it, only what the caller feeds to each
    /// [`super::LendingLink::event_sink`] reaches the leases.
    pub event_pump: bool,
    /// Where to count the session and its RAM export (a fresh set if `None`).
    pub counters: Option<Arc<SessionCounters>>,
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self {
            event_pump: true,
            counters: None,
        }
    }
}

/// Leases of the session and whether its link has ended (under one lock, so a lease
/// registered while the pump reports the end is lost too, never forgotten).
#[derive(Default)]
struct Table {
    /// Shared, so handing an event to its lease (an interrupt relayed on tcp) takes one
    /// reference count, not a copy of the sink.
    sinks: HashMap<u64, Arc<LendingEventSink>>,
    ended: Option<String>,
}

#[derive(Default)]
struct Sinks {
    table: Mutex<Table>,
    /// Times the pump returned from its wait (shared with every sink).
    wakeups: Arc<AtomicU64>,
}

impl Sinks {
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The link ended: every lease of the session is lost (told outside the lock: a hook
    /// may take its time).
    fn end(&self, why: String) {
        let sinks: Vec<Arc<LendingEventSink>> = {
            let mut t = self.lock();
            t.ended.get_or_insert_with(|| why.clone());
            t.sinks.values().cloned().collect()
        };
        for s in sinks {
            s.lost(why.clone());
        }
    }

    fn dispatch(&self, ev: &Event) {
        let sink = event_lease(ev).and_then(|l| self.lock().sinks.get(&l).cloned());
        match sink {
            Some(s) if s.handle(ev) => {}
            _ => debug!("lender session: event for no lease of ours: {ev:?}"),
        }
    }
}

/// The lease an event is about (every lease event names one).
fn event_lease(ev: &Event) -> Option<u64> {
    Some(match ev {
        Event::Irq(i) => i.lease,
        Event::DeviceGone(g) => g.lease,
        Event::IommuFault(f) => f.lease,
        Event::Kicks(k) => k.lease,
        Event::LeaseMoved(m) => m.lease,
        Event::Fatal(f) => f.lease,
        // Borrower -> lender only.
        Event::Resample(_) => return None,
    })
}

/// A lease's place in the session's event dispatch; leaving it on drop.
pub(super) struct Registration {
    sinks: Arc<Sinks>,
    lease: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.sinks.lock().sinks.remove(&self.lease);
    }
}

struct Pump {
    stop: Arc<AtomicBool>,
    waker: EventWaker,
    handle: Option<ntb::workers::Worker>,
}

impl Drop for Pump {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // The thread blocks without a timeout: wake it, so the join returns at once.
        self.waker.wake();
        if let Some(h) = self.handle.take() {
            if h.join().is_err() {
                error!("lender session event pump panicked");
            }
        }
    }
}

fn pump(client: &LenderClient, sinks: &Sinks, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        // Blocks until an event, the link's end, or the session's drop wakes it: no timer.
        let r = client.wait_event();
        sinks.wakeups.fetch_add(1, Ordering::SeqCst);
        match r {
            Ok(Some(ev)) => sinks.dispatch(&ev),
            Ok(None) => {}
            Err(ClientError::Fabric(FabricError::PeerGone { reason, .. })) => {
                if !stop.load(Ordering::SeqCst) {
                    error!("lender {}: link down: {reason}", client.hello().node);
                    sinks.end(reason);
                }
                return;
            }
            Err(e) => {
                error!("lender {}: event pump ends: {e}", client.hello().node);
                sinks.end(format!("event relay failed: {e}"));
                return;
            }
        }
    }
}

/// Counts one live value in a counter, until dropped.
struct Counted(Arc<SessionCounters>, fn(&SessionCounters) -> &AtomicUsize);

impl Counted {
    fn new(c: &Arc<SessionCounters>, which: fn(&SessionCounters) -> &AtomicUsize) -> Self {
        which(c).fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(c), which)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        (self.1)(&self.0).fetch_sub(1, Ordering::SeqCst);
    }
}

/// What identifies an export of guest RAM: each region's guest address and the file range
/// behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RegionKey {
    gpa: u64,
    memory: ntb::BackingId,
}

/// Guest RAM exported as fabric windows on one session; revoked when the last holder
/// drops it.
pub(super) struct RamExport {
    key: Vec<RegionKey>,
    /// (GPA, size, window) per region.
    windows: Vec<(u64, u64, ExportedWindow)>,
    _count: Counted,
}

impl RamExport {
    /// (GPA, size, window id) of each region.
    pub(super) fn windows(&self) -> impl Iterator<Item = (u64, u64, ntb::WindowId)> + '_ {
        self.windows.iter().map(|(g, s, w)| (*g, *s, w.id()))
    }
}

impl Drop for RamExport {
    fn drop(&mut self) {
        debug!(
            "guest ram export of {} region(s) revoked (last holder gone)",
            self.windows.len()
        );
    }
}

/// One connection to a lender and what its leases share (see the module docs).
pub struct LenderSession {
    // Field order is drop order: the pump stops, the RAM export slot goes, the client (the
    // link) closes, then the session stops being counted.
    _pump: Option<Pump>,
    sinks: Arc<Sinks>,
    /// The live export of guest RAM, if a lease of the session holds one.
    ram: Mutex<Weak<RamExport>>,
    counters: Arc<SessionCounters>,
    client: Arc<LenderClient>,
    _count: Counted,
}

impl LenderSession {
    /// Wraps a connected `client`; starts the event pump if `opts.event_pump`.
    pub fn new(client: LenderClient, opts: SessionOptions) -> Result<Arc<Self>, LendingLinkError> {
        Self::shared(Arc::new(client), opts)
    }

    /// As [`LenderSession::new`], for a client already shared.
    pub fn shared(
        client: Arc<LenderClient>,
        opts: SessionOptions,
    ) -> Result<Arc<Self>, LendingLinkError> {
        let counters = opts.counters.unwrap_or_default();
        let sinks = Arc::new(Sinks::default());
        let pump = if opts.event_pump {
            let stop = Arc::new(AtomicBool::new(false));
            let waker = client.event_waker().map_err(LendingLinkError::Waker)?;
            let (s, c, st) = (Arc::clone(&sinks), Arc::clone(&client), Arc::clone(&stop));
            let handle = ntb::workers::spawn(
                format!("lender-{}-events", client.hello().node),
                move || pump(&c, &s, &st),
            )
            .map_err(LendingLinkError::Thread)?;
            Some(Pump {
                stop,
                waker,
                handle: Some(handle),
            })
        } else {
            None
        };
        Ok(Arc::new(Self {
            _pump: pump,
            sinks,
            ram: Mutex::new(Weak::new()),
            _count: Counted::new(&counters, |c| &c.sessions),
            counters,
            client,
        }))
    }

    /// The connection.
    pub fn client(&self) -> &Arc<LenderClient> {
        &self.client
    }

    /// Whether new leases may use this session: its link is up and its pump has not seen
    /// it end.
    pub fn is_usable(&self) -> bool {
        self.client.endpoint().is_up() && self.sinks.lock().ended.is_none()
    }

    /// Leases registered now.
    pub fn leases(&self) -> usize {
        self.sinks.lock().sinks.len()
    }

    /// Whether guest RAM is exported on this session now.
    pub fn ram_exported(&self) -> bool {
        self.ram
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .strong_count()
            > 0
    }

    /// How often the event pump woke up (once per event of any lease, once at its stop).
    pub fn event_wakeups(&self) -> u64 {
        self.sinks.wakeups.load(Ordering::SeqCst)
    }

    /// A sink for `lease`, counting the pump's wake-ups.
    pub(super) fn sink(&self, lease: u64) -> LendingEventSink {
        LendingEventSink::new(lease, Arc::clone(&self.sinks.wakeups))
    }

    /// Routes `sink`'s lease's events to it until the registration is dropped. On a session
    /// whose link already ended the lease is lost at once.
    pub(super) fn register(&self, sink: &LendingEventSink) -> Registration {
        let ended = {
            let mut t = self.sinks.lock();
            t.sinks.insert(sink.lease(), Arc::new(sink.clone()));
            t.ended.clone()
        };
        if let Some(why) = ended {
            sink.lost(why);
        }
        Registration {
            sinks: Arc::clone(&self.sinks),
            lease: sink.lease(),
        }
    }

    /// Guest RAM (`regions`, each memfd backed) exported on this session: the live export
    /// if one of the same regions exists, else a new one.
    pub(super) fn ram_export(
        &self,
        regions: &[GuestRamRegion],
    ) -> Result<Arc<RamExport>, LinkError> {
        let mut key = Vec::with_capacity(regions.len());
        for r in regions {
            let Some((file, offset)) = &r.file else {
                return Err(LinkError::Unsupported {
                    op: "dma map",
                    reason: format!("guest ram at {:#x} is not file backed", r.gpa),
                });
            };
            // A bar link reaches guest RAM only inside its shared region: anywhere else the
            // lender could not map it for its device (a VFIO domain needs the memory itself).
            if let Some(region) = self.client.endpoint().shared_region() {
                let inside = region.holds(file.as_fd()).unwrap_or(false)
                    && region.check_range(*offset, r.size).is_ok();
                if !inside {
                    return Err(LinkError::Unsupported {
                        op: "dma map",
                        reason: format!(
                            "guest ram at {:#x} is not inside the shared region {} of the bar \
                             link to {}: start lendvm with --memory SIZE,shared={}",
                            r.gpa,
                            region.path().display(),
                            self.client.hello().node,
                            region.path().display()
                        ),
                    });
                }
            }
            let memory = ntb::BackingId::of_file(file.as_fd(), *offset, r.size).map_err(|e| {
                LinkError::Unsupported {
                    op: "dma map",
                    reason: format!("guest ram at {:#x}: fstat of its file: {e}", r.gpa),
                }
            })?;
            key.push(RegionKey { gpa: r.gpa, memory });
        }
        // Held while exporting: a second device setting BME meanwhile waits and shares.
        let mut slot = self.ram.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(x) = slot.upgrade() {
            if x.key == key {
                return Ok(x);
            }
            // Guest RAM does not move while devices hold it; a different layout is a VMM
            // bug, served correctly by a second export.
            error!(
                "lender {}: guest ram export asked for {key:x?} while {:x?} is exported",
                self.client.hello().node,
                x.key
            );
        }
        let mut windows = Vec::with_capacity(regions.len());
        for (r, k) in regions.iter().zip(&key) {
            let Some((file, _)) = &r.file else {
                continue; // checked above
            };
            let label = format!("ram{:x}", r.gpa);
            let w = self
                .client
                .endpoint()
                .export_window(file.as_fd(), k.memory.offset, r.size, &label)
                .map_err(|e| link_err("export guest ram", ClientError::Fabric(e)))?;
            windows.push((r.gpa, r.size, w));
        }
        info!(
            "lender {}: guest ram exported ({} region(s), {:#x} bytes), shared by its leases",
            self.client.hello().node,
            windows.len(),
            windows.iter().map(|w| w.1).sum::<u64>()
        );
        let x = Arc::new(RamExport {
            key,
            windows,
            _count: Counted::new(&self.counters, |c| &c.ram_exports),
        });
        *slot = Arc::downgrade(&x);
        Ok(x)
    }
}
