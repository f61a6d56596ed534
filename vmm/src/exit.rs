//! How a VM run ends: the first reason reported wins, and every vCPU thread stops.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use vmm_sys_util::eventfd::EventFd;

/// Why the VM stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmExit {
    /// The guest wrote this code to the debug-exit port 0xf4.
    DebugExit(u8),
    /// The guest shut down or reset (triple fault, `KVM_EXIT_SHUTDOWN`, system event).
    Shutdown(String),
    /// The VMM stopped the guest on an error (emulation failure, failed entry, KVM error).
    Error(String),
}

impl VmExit {
    /// Process exit code for `lendvm`: the debug-exit value, 0 for a shutdown, 1 for an error.
    pub fn exit_code(&self) -> i32 {
        match self {
            VmExit::DebugExit(c) => i32::from(*c),
            VmExit::Shutdown(_) => 0,
            VmExit::Error(_) => 1,
        }
    }
}

/// Shared stop flag plus the first exit reason. The VMM's event loop also polls
/// [`ExitNotifier::eventfd`], which becomes readable when an exit is requested.
pub struct ExitNotifier {
    stop: AtomicBool,
    reason: Mutex<Option<VmExit>>,
    cv: Condvar,
    evt: Option<EventFd>,
}

impl Default for ExitNotifier {
    fn default() -> Self {
        Self::new()
    }
}

impl ExitNotifier {
    pub fn new() -> Self {
        let evt = match EventFd::new(libc::EFD_NONBLOCK) {
            Ok(e) => Some(e),
            Err(e) => {
                log::warn!("exit notifier eventfd: {e}; the event loop polls instead");
                None
            }
        };
        Self {
            stop: AtomicBool::new(false),
            reason: Mutex::new(None),
            cv: Condvar::new(),
            evt,
        }
    }

    /// Readable once an exit was requested (never reset), if the eventfd could be created.
    pub fn eventfd(&self) -> Option<&EventFd> {
        self.evt.as_ref()
    }

    /// The recorded exit reason, if any (non-blocking).
    pub fn reason(&self) -> Option<VmExit> {
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records `reason` unless one is already recorded, and raises the stop flag.
    pub fn request(&self, reason: VmExit) {
        let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_none() {
            log::debug!("VM exit requested: {reason:?}");
            *r = Some(reason);
        }
        self.stop.store(true, Ordering::SeqCst);
        self.cv.notify_all();
        if let Some(e) = &self.evt {
            let _ = e.write(1);
        }
    }

    /// Whether vCPUs must stop.
    pub fn should_stop(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Waits up to `timeout` (forever if `None`) for an exit reason.
    pub fn wait(&self, timeout: Option<Duration>) -> Option<VmExit> {
        let guard = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        let guard = match timeout {
            None => self
                .cv
                .wait_while(guard, |r| r.is_none())
                .unwrap_or_else(|e| e.into_inner()),
            Some(t) => {
                self.cv
                    .wait_timeout_while(guard, t, |r| r.is_none())
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
        };
        guard.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_reason_wins() {
        let n = ExitNotifier::new();
        assert!(!n.should_stop());
        assert_eq!(n.wait(Some(Duration::from_millis(1))), None);
        n.request(VmExit::DebugExit(7));
        n.request(VmExit::Shutdown("late".into()));
        assert!(n.should_stop());
        assert_eq!(n.wait(None), Some(VmExit::DebugExit(7)));
        assert_eq!(VmExit::DebugExit(7).exit_code(), 7);
        assert_eq!(VmExit::Error(String::new()).exit_code(), 1);
    }
}
