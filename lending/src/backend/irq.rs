//! Interrupt wiring: where a lent device's vectors go.
//!
//! A target is an eventfd the borrower passed (shm: the borrower's KVM irqfd, so the lender
//! signals the guest directly), a fabric doorbell bit, or an event message. Emulated devices
//! call the targets through [`LeaseIrqs`]; VFIO devices need eventfds, so non-eventfd targets
//! are fed by an [`IrqRelay`] thread (the paper's lender-side relay).

use std::collections::BTreeSet;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;

use emulated::{InterruptMode, InterruptSink};
use vmm_sys_util::eventfd::EventFd;

use crate::protocol::IrqKind;

/// Something that delivers one interrupt vector to the borrower.
pub trait IrqTrigger: Send + Sync {
    /// Deliver the interrupt (edge).
    fn trigger(&self);
    /// The eventfd behind the target, when there is one (VFIO signals it in the kernel).
    fn eventfd(&self) -> Option<&EventFd> {
        None
    }
}

impl IrqTrigger for EventFd {
    fn trigger(&self) {
        if let Err(e) = self.write(1) {
            log::warn!("interrupt eventfd write failed: {e}");
        }
    }

    fn eventfd(&self) -> Option<&EventFd> {
        Some(self)
    }
}

type Targets = Vec<Option<Arc<dyn IrqTrigger>>>;

fn read<T: Clone>(l: &RwLock<T>) -> T {
    match l.read() {
        Ok(g) => g.clone(),
        Err(p) => p.into_inner().clone(),
    }
}

fn write<T>(l: &RwLock<T>, v: T) {
    match l.write() {
        Ok(mut g) => *g = v,
        Err(p) => *p.into_inner() = v,
    }
}

/// The [`InterruptSink`] handed to an emulated device model: vectors go to whatever the
/// current lease set with SET_IRQS; with no lease nothing is signalled.
///
/// It counts what it signals, per MSI-X vector and INTx assertions, whatever the target
/// (eventfd, doorbell, event message), over its whole life ([`LeaseIrqs::counts`]); a vector
/// that is not wired is dropped and not counted.
pub struct LeaseIrqs {
    name: String,
    msix_vectors: u16,
    msix: RwLock<Targets>,
    intx: RwLock<Option<Arc<dyn IrqTrigger>>>,
    intx_disabled: AtomicBool,
    msix_signalled: Vec<AtomicU64>,
    intx_signalled: AtomicU64,
    /// Interrupts are being held for a hand-over ([`LeaseIrqs::hold`]); the fast path of
    /// every signal reads only this.
    holding: AtomicBool,
    held: Mutex<Held>,
}

/// Interrupts raised while held: recorded, not delivered.
#[derive(Default)]
struct Held {
    on: bool,
    msix: BTreeSet<u16>,
    intx: bool,
}

impl LeaseIrqs {
    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// From now on, interrupts are recorded as pending instead of delivered (the device is
    /// being handed to another borrower; the old targets are going away).
    pub fn hold(&self) {
        self.held().on = true;
        self.holding.store(true, Ordering::Release);
    }

    /// The interrupts recorded since [`LeaseIrqs::hold`]: MSI-X vectors, and whether INTx
    /// was asserted.
    pub fn pending(&self) -> (Vec<u32>, bool) {
        let h = self.held();
        (h.msix.iter().map(|&v| u32::from(v)).collect(), h.intx)
    }

    /// Ends holding; `replay`: delivers each recorded interrupt once to the current targets
    /// (the new borrower's), else drops them (a reset).
    pub fn release(&self, replay: bool) {
        let (msix, intx) = {
            let mut h = self.held();
            if !h.on {
                return;
            }
            self.holding.store(false, Ordering::Release);
            h.on = false;
            (std::mem::take(&mut h.msix), std::mem::take(&mut h.intx))
        };
        if !replay {
            return;
        }
        if !msix.is_empty() || intx {
            log::info!(
                "{}: replaying held interrupts: msi-x {msix:?}, intx {intx}",
                self.name
            );
        }
        for v in msix {
            self.signal_msix(v);
        }
        if intx {
            self.set_intx(true);
        }
    }

    /// Records the interrupt if held; `true` when it was.
    fn record_held(&self, msix: Option<u16>) -> bool {
        if !self.holding.load(Ordering::Acquire) {
            return false;
        }
        let mut h = self.held();
        if !h.on {
            return false;
        }
        match msix {
            Some(v) => {
                h.msix.insert(v);
            }
            None => h.intx = true,
        }
        true
    }

    /// A sink for a device with `msix_vectors` MSI-X vectors.
    pub fn new(name: impl Into<String>, msix_vectors: u16) -> Self {
        LeaseIrqs {
            name: name.into(),
            msix_vectors,
            msix: RwLock::new(Vec::new()),
            intx: RwLock::new(None),
            intx_disabled: AtomicBool::new(false),
            msix_signalled: (0..msix_vectors).map(|_| AtomicU64::new(0)).collect(),
            intx_signalled: AtomicU64::new(0),
            holding: AtomicBool::new(false),
            held: Mutex::default(),
        }
    }

    /// Interrupts signalled so far: per MSI-X vector (from vector 0), and INTx assertions.
    pub fn counts(&self) -> (Vec<u64>, u64) {
        (
            self.msix_signalled
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect(),
            self.intx_signalled.load(Ordering::Relaxed),
        )
    }

    /// Replaces the targets of `kind`.
    pub fn set(&self, kind: IrqKind, targets: Targets) -> Result<(), super::BackendError> {
        match kind {
            IrqKind::Msix => {
                if targets.len() > usize::from(self.msix_vectors) {
                    return Err(super::BackendError::TooManyVectors {
                        kind,
                        count: targets.len(),
                        max: u32::from(self.msix_vectors),
                    });
                }
                write(&self.msix, targets);
            }
            IrqKind::Intx => {
                if targets.len() > 1 {
                    return Err(super::BackendError::TooManyVectors {
                        kind,
                        count: targets.len(),
                        max: 1,
                    });
                }
                write(&self.intx, targets.into_iter().next().flatten());
            }
            IrqKind::Msi => {
                if !targets.is_empty() {
                    return Err(super::BackendError::TooManyVectors {
                        kind,
                        count: targets.len(),
                        max: 0,
                    });
                }
            }
        }
        log::debug!("{}: {kind:?} interrupt targets replaced", self.name);
        Ok(())
    }

    /// Drops every target.
    pub fn clear(&self) {
        write(&self.msix, Vec::new());
        write(&self.intx, None);
    }

    /// Mirrors the command register's INTx Disable bit.
    pub fn set_intx_disabled(&self, disabled: bool) {
        self.intx_disabled.store(disabled, Ordering::Release);
    }
}

impl InterruptSink for LeaseIrqs {
    fn signal_msix(&self, vector: u16) {
        if self.record_held(Some(vector)) {
            return;
        }
        let t = match self.msix.read() {
            Ok(g) => g.get(usize::from(vector)).cloned().flatten(),
            Err(p) => p.into_inner().get(usize::from(vector)).cloned().flatten(),
        };
        match t {
            Some(t) => {
                t.trigger();
                if let Some(c) = self.msix_signalled.get(usize::from(vector)) {
                    c.fetch_add(1, Ordering::Relaxed);
                }
            }
            None => log::debug!("{}: msi-x vector {vector} not wired, dropped", self.name),
        }
    }

    fn set_intx(&self, asserted: bool) {
        // Edge-signal the borrower on assertion; the borrower's VMM resamples the level with
        // a config/BAR read when the guest acknowledges.
        if asserted {
            if self.record_held(None) {
                return;
            }
            if let Some(t) = read(&self.intx) {
                t.trigger();
                self.intx_signalled.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn mode(&self) -> InterruptMode {
        let msix_on = match self.msix.read() {
            Ok(g) => !g.is_empty(),
            Err(p) => !p.into_inner().is_empty(),
        };
        if msix_on {
            InterruptMode::MsiX {
                vectors: self.msix_vectors,
            }
        } else if !self.intx_disabled.load(Ordering::Acquire) && read(&self.intx).is_some() {
            InterruptMode::Intx
        } else {
            InterruptMode::None
        }
    }
}

/// Forwards local eventfds (signalled by the kernel, e.g. VFIO) to arbitrary targets.
/// Dropping it stops and joins the thread.
pub struct IrqRelay {
    /// Names the relay in its log lines.
    what: String,
    stop: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
}

impl IrqRelay {
    /// Starts relaying `sources[i]` → `targets[i]`.
    pub fn start(
        name: &str,
        sources: Vec<EventFd>,
        targets: Vec<Arc<dyn IrqTrigger>>,
    ) -> std::io::Result<IrqRelay> {
        Self::watch(
            format!("irq-relay-{name}"),
            "irq relay".into(),
            sources,
            move |i| {
                targets[i].trigger();
                true
            },
        )
    }

    /// Starts a thread named `thread` that waits on `sources` and, each time `sources[i]` is
    /// signalled, drains it and calls `on_signal(i)`. The thread ends when `on_signal` returns
    /// false or the relay is dropped; `what` names it in log lines.
    pub(crate) fn watch(
        thread: String,
        what: String,
        sources: Vec<EventFd>,
        on_signal: impl FnMut(usize) -> bool + Send + 'static,
    ) -> std::io::Result<IrqRelay> {
        let stop = Arc::new(EventFd::new(libc::EFD_NONBLOCK)?);
        let stop2 = Arc::clone(&stop);
        let what2 = what.clone();
        let thread = std::thread::Builder::new()
            .name(thread)
            .spawn(move || relay_loop(&what2, &stop2, &sources, on_signal))?;
        Ok(IrqRelay {
            what,
            stop,
            thread: Some(thread),
        })
    }
}

fn relay_loop(
    what: &str,
    stop: &EventFd,
    sources: &[EventFd],
    mut on_signal: impl FnMut(usize) -> bool,
) {
    let mut pfds: Vec<libc::pollfd> = std::iter::once(stop.as_raw_fd())
        .chain(sources.iter().map(|s| s.as_raw_fd()))
        .map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        // SAFETY: `pfds` is a valid array of initialised pollfd structures of this length.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, -1) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            log::error!("{what} poll failed: {e}");
            return;
        }
        if pfds[0].revents != 0 {
            return;
        }
        for (i, p) in pfds.iter_mut().enumerate().skip(1) {
            if p.revents & libc::POLLIN != 0 {
                let _ = sources[i - 1].read();
                if !on_signal(i - 1) {
                    return;
                }
            }
            p.revents = 0;
        }
    }
}

impl Drop for IrqRelay {
    fn drop(&mut self) {
        if let Err(e) = self.stop.write(1) {
            log::error!("{} stop failed: {e}", self.what);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;
    use std::time::{Duration, Instant};

    #[derive(Default)]
    struct Count(AtomicU32);
    impl IrqTrigger for Count {
        fn trigger(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn lease_irqs_route_and_mode() {
        let s = LeaseIrqs::new("t", 2);
        assert_eq!(s.mode(), InterruptMode::None);
        let c = Arc::new(Count::default());
        let fd = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        s.set(IrqKind::Intx, vec![Some(c.clone() as Arc<dyn IrqTrigger>)])
            .unwrap();
        assert_eq!(s.mode(), InterruptMode::Intx);
        s.set_intx(true);
        assert_eq!(c.0.load(Ordering::SeqCst), 1);
        s.set(
            IrqKind::Msix,
            vec![None, Some(fd.clone() as Arc<dyn IrqTrigger>)],
        )
        .unwrap();
        assert_eq!(s.mode(), InterruptMode::MsiX { vectors: 2 });
        s.signal_msix(0); // not wired
        s.signal_msix(1);
        s.signal_msix(9); // out of range
        assert_eq!(fd.read().unwrap(), 1);
        // Counted where signalled, whatever the target; dropped vectors are not.
        s.set_intx(true);
        assert_eq!(s.counts(), (vec![0, 1], 2));
        assert!(s.set(IrqKind::Msix, vec![None, None, None]).is_err());
        s.clear();
        assert_eq!(s.mode(), InterruptMode::None);
    }

    #[test]
    fn relay_forwards_and_stops() {
        let src = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let src_w = src.try_clone().unwrap();
        let c = Arc::new(Count::default());
        let relay =
            IrqRelay::start("t", vec![src], vec![c.clone() as Arc<dyn IrqTrigger>]).unwrap();
        src_w.write(1).unwrap();
        let t0 = Instant::now();
        while c.0.load(Ordering::SeqCst) == 0 && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(c.0.load(Ordering::SeqCst), 1);
        drop(relay);
    }
}
