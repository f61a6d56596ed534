//! Worker wake-up: eventfd sleep (interrupt mode) or adaptive-backoff polling.

use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

use crate::NotifyMode;

const SPIN_ROUNDS: u32 = 200;
const YIELD_ROUNDS: u32 = 50;
const MAX_SLEEP: Duration = Duration::from_millis(1);

/// Waits for work. In polling mode an idle worker spins briefly, then yields, then sleeps with
/// exponential growth up to 1 ms; any wake on the eventfds resets the backoff.
pub(crate) struct Waiter {
    mode: NotifyMode,
    idle_rounds: u32,
    sleep: Duration,
}

impl Waiter {
    pub(crate) fn new(mode: NotifyMode) -> Self {
        Waiter {
            mode,
            idle_rounds: 0,
            sleep: Duration::from_micros(1),
        }
    }

    /// Tell the waiter the last pass found work.
    pub(crate) fn busy(&mut self) {
        self.idle_rounds = 0;
        self.sleep = Duration::from_micros(1);
    }

    /// Block until something may have happened. `fds` are eventfds to wait on (all drained on
    /// wake); `deadline` bounds the wait (interrupt coalescing timers).
    pub(crate) fn wait(
        &mut self,
        fds: &[&EventFd],
        extra_fd: Option<RawFd>,
        deadline: Option<Instant>,
    ) {
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
            .map(|f| libc::pollfd {
                fd: f.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        if let Some(fd) = extra_fd {
            pfds.push(libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            });
        }
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
            for (f, p) in fds.iter().zip(pfds.iter()) {
                if p.revents & libc::POLLIN != 0 {
                    let _ = f.read();
                }
            }
            self.busy();
        }
    }
}
