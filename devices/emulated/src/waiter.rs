//! Worker wake-up: eventfd sleep (interrupt mode) or adaptive-backoff polling; the doorbell
//! kick count and the quiesce gate a worker shares with its model ([`WaitState`]).

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

use crate::NotifyMode;

const SPIN_ROUNDS: u32 = 200;
const YIELD_ROUNDS: u32 = 50;
const MAX_SLEEP: Duration = Duration::from_millis(1);
/// How long [`WaitState::quiesce`] waits for the worker to stop at its gate.
const PARK_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Default)]
struct Gate {
    /// The model asked the worker to stop before its next pass.
    quiesced: bool,
    /// Bus Master Enable is off (its last DMA window went): the worker fetches nothing, as
    /// a function without BME issues no DMA, until it is set again.
    no_bus_master: bool,
    /// The worker is stopped at the gate.
    parked: bool,
}

/// What a device's worker ([`Waiter`]) and its model share: the doorbell kicks the worker
/// read and the quiesce gate. The model's own wake-ups (quiesce, resume, INTx resample) go
/// through a separate eventfd ([`WaitState::wake`]), so they are never counted as kicks.
pub(crate) struct WaitState {
    /// Sum of the values read from the doorbell eventfd: every store + notify, ioeventfd
    /// kick or exact doorbell write, coalesced or not.
    kicks: AtomicU64,
    /// The model's wake-ups of the worker.
    wake: EventFd,
    gate: Mutex<Gate>,
    cond: Condvar,
}

impl WaitState {
    pub(crate) fn new() -> std::io::Result<Arc<Self>> {
        Ok(Arc::new(WaitState {
            kicks: AtomicU64::new(0),
            wake: EventFd::new(libc::EFD_NONBLOCK)?,
            gate: Mutex::new(Gate::default()),
            cond: Condvar::new(),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, Gate> {
        self.gate.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Doorbell notifications the worker has read so far (exact once it drained the
    /// eventfd: an interrupt-mode worker does at once, a busy polling worker when it idles).
    pub(crate) fn kicks(&self) -> u64 {
        self.kicks.load(Ordering::Relaxed)
    }

    /// Wakes the worker without counting a kick.
    pub(crate) fn wake(&self) {
        if let Err(e) = self.wake.write(1) {
            log::warn!("worker wake eventfd write failed: {e}");
        }
    }

    /// `true`: the worker stops before its next pass (it finishes the pass it is in) and
    /// stays stopped until `quiesce(false)`; returns once it is stopped, or after a bound
    /// (a worker that is not running or in a long pass), logged. `false`: it goes on.
    pub(crate) fn quiesce(&self, name: &str, stop: bool) {
        let mut g = self.lock();
        if g.quiesced == stop {
            return;
        }
        g.quiesced = stop;
        self.cond.notify_all();
        if !stop {
            log::info!("{name}: resumed");
            return;
        }
        drop(g);
        if self.park(|g| g.quiesced) {
            log::info!("{name}: quiesced");
        } else {
            log::warn!(
                "{name}: worker not parked after {PARK_TIMEOUT:?}; it stops before its next pass"
            );
        }
    }

    /// Wakes the worker (one asleep on its eventfds must come to the gate) and waits, at
    /// most [`PARK_TIMEOUT`], until it is parked or `holding` no longer holds it; false on
    /// the timeout.
    fn park(&self, holding: impl Fn(&Gate) -> bool) -> bool {
        self.wake();
        let deadline = Instant::now() + PARK_TIMEOUT;
        let mut g = self.lock();
        while holding(&g) && !g.parked {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            g = match self.cond.wait_timeout(g, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        true
    }

    /// Bus Master Enable: `false` stops the worker before its next pass, like a quiesce but
    /// independent of one (a hand-over quiesce and a cleared BME each hold it), and returns
    /// once it is stopped (bounded, logged): the host unmaps the device's DMA windows only
    /// then, so no doorbell that arrived before can make the model touch memory that is
    /// gone. `true`: the worker goes on unless quiesced.
    pub(crate) fn bus_master(&self, name: &str, enable: bool) {
        let mut g = self.lock();
        if g.no_bus_master != enable {
            return;
        }
        g.no_bus_master = !enable;
        self.cond.notify_all();
        if enable {
            return;
        }
        drop(g);
        if !self.park(|g| g.no_bus_master) {
            log::warn!(
                "{name}: worker not stopped {PARK_TIMEOUT:?} after Bus Master Enable went off; \
                 it stops before its next pass"
            );
        }
    }

    /// Waits until the worker is parked at the gate of a quiesce, at most until `deadline`;
    /// `false` when not quiesced or the deadline passed (a worker still in a long pass).
    /// A worker that is not running counts as parked (`running` false).
    pub(crate) fn wait_parked(&self, running: bool, deadline: Instant) -> bool {
        let mut g = self.lock();
        loop {
            if !g.quiesced {
                return false;
            }
            if g.parked || !running {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            g = match self.cond.wait_timeout(g, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }

    /// Worker side: blocks while quiesced or without Bus Master Enable.
    fn gate(&self) {
        let mut g = self.lock();
        if !g.quiesced && !g.no_bus_master {
            return;
        }
        g.parked = true;
        self.cond.notify_all();
        while g.quiesced || g.no_bus_master {
            g = self.cond.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        g.parked = false;
    }
}

/// Waits for work. In polling mode an idle worker spins briefly, then yields, then sleeps with
/// exponential growth up to 1 ms; any wake on the eventfds resets the backoff. While the
/// [`WaitState`] is quiesced, the worker stops in [`Waiter::busy`] / [`Waiter::wait`], i.e.
/// between passes: it fetches nothing (no doorbell, no descriptor, no completion posting)
/// until resumed.
pub(crate) struct Waiter {
    mode: NotifyMode,
    state: Arc<WaitState>,
    idle_rounds: u32,
    sleep: Duration,
}

impl Waiter {
    pub(crate) fn new(mode: NotifyMode, state: Arc<WaitState>) -> Self {
        Waiter {
            mode,
            state,
            idle_rounds: 0,
            sleep: Duration::from_micros(1),
        }
    }

    fn reset_backoff(&mut self) {
        self.idle_rounds = 0;
        self.sleep = Duration::from_micros(1);
    }

    /// Tell the waiter the last pass found work (stops here while quiesced).
    pub(crate) fn busy(&mut self) {
        self.reset_backoff();
        self.state.gate();
    }

    /// Block until something may have happened, then stop here while quiesced. `fds` are
    /// eventfds to wait on (all drained on wake); `fds[0]` is the device's doorbell eventfd,
    /// whose values are counted as kicks. `deadline` bounds the wait (interrupt coalescing
    /// timers).
    pub(crate) fn wait(
        &mut self,
        fds: &[&EventFd],
        extra_fd: Option<RawFd>,
        deadline: Option<Instant>,
    ) {
        self.sleep_once(fds, extra_fd, deadline);
        self.state.gate();
    }

    fn sleep_once(&mut self, fds: &[&EventFd], extra_fd: Option<RawFd>, deadline: Option<Instant>) {
        let timeout = match self.mode {
            NotifyMode::Interrupt => deadline.map(|d| d.saturating_duration_since(Instant::now())),
            NotifyMode::Polling => {
                self.idle_rounds = self.idle_rounds.saturating_add(1);
                if self.idle_rounds < SPIN_ROUNDS {
                    std::hint::spin_loop();
                    return;
                }
                if self.idle_rounds < SPIN_ROUNDS + YIELD_ROUNDS {
                    std::thread::yield_now();
                    return;
                }
                let s = self.sleep;
                self.sleep = (self.sleep * 2).min(MAX_SLEEP);
                Some(match deadline {
                    Some(d) => s.min(d.saturating_duration_since(Instant::now())),
                    None => s,
                })
            }
        };
        let mut pfds: Vec<libc::pollfd> = fds
            .iter()
            .map(|f| f.as_raw_fd())
            .chain(std::iter::once(self.state.wake.as_raw_fd()))
            .chain(extra_fd)
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let ts = timeout.map(|t| libc::timespec {
            tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: t.subsec_nanos() as libc::c_long,
        });
        let tsp = ts
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: `pfds` is a valid, initialised array of pollfd of the given length; `tsp` is
        // null or points to a live timespec; a null sigmask leaves the mask unchanged.
        let n = unsafe {
            libc::ppoll(
                pfds.as_mut_ptr(),
                pfds.len() as libc::nfds_t,
                tsp,
                std::ptr::null(),
            )
        };
        if n > 0 {
            for (i, (f, p)) in fds.iter().zip(pfds.iter()).enumerate() {
                if p.revents & libc::POLLIN != 0 {
                    if let Ok(v) = f.read() {
                        if i == 0 {
                            self.state.kicks.fetch_add(v, Ordering::Relaxed);
                        }
                    }
                }
            }
            if pfds[fds.len()].revents & libc::POLLIN != 0 {
                let _ = self.state.wake.read();
            }
            self.reset_backoff();
        }
    }
}
