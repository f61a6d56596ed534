//! The VMM's control loop on `event-manager`: one subscriber per event source, all on the
//! main thread, sharing the [`Controller`].
//!
//! | subscriber | fd | does |
//! |---|---|---|
//! | [`ApiSubscriber`] | the API eventfd | answers queued REST requests |
//! | [`EjectSubscriber`] | the hotplug eject eventfd | tears down what the guest ejected |
//! | [`ExitSubscriber`] | the exit notifier's eventfd | ends the loop |
//! | [`ReleaseSubscriber`] | a timerfd, armed only while a drop is deferred | drops devices a vCPU let go of |
//! | one [`LeaseSubscriber`] per device | an eventfd the device's link writes on lease loss | surprise removal |
//!
//! Nothing wakes on a timer: a lost lease arrives as an event within milliseconds of the
//! link noticing it. Device subscribers are added and removed between dispatches, from the
//! changes the controller queues ([`Controller::take_subscriber_changes`]).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

use acpi::EjectReceiver;
use api::request::{serve_pending, ApiMessage};
use event_manager::{
    EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberId, SubscriberOps,
};
use thiserror::Error;
use vmm_sys_util::eventfd::EventFd;

use crate::control::{Controller, SubscriberChange};
use crate::exit::{ExitNotifier, VmExit};

/// Errors setting up the loop.
#[derive(Debug, Error)]
pub enum EventLoopError {
    #[error("cannot create the event manager")]
    Manager(#[source] event_manager::Error),
    #[error("cannot register the {what} subscriber")]
    Register {
        what: &'static str,
        #[source]
        source: event_manager::Error,
    },
    #[error("the exit notifier has no eventfd")]
    NoExitFd,
}

/// The API request channel and its eventfd.
pub struct ApiChannel {
    pub rx: Receiver<ApiMessage>,
    pub evt: EventFd,
}

type Ctl = Rc<RefCell<Controller>>;

fn register(ops: &mut EventOps, fd: RawFd, what: &str) {
    if let Err(e) = ops.add(Events::new_raw(fd, EventSet::IN)) {
        log::error!("event loop: cannot watch the {what} fd {fd}: {e}");
    }
}

/// Answers REST requests.
pub struct ApiSubscriber {
    ctl: Ctl,
    api: Rc<ApiChannel>,
}

impl MutEventSubscriber for ApiSubscriber {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        serve_pending(&self.api.rx, &self.api.evt, &mut *self.ctl.borrow_mut());
    }

    fn init(&mut self, ops: &mut EventOps) {
        register(ops, self.api.evt.as_raw_fd(), "api");
    }
}

/// Tears down the devices the guest ejected.
pub struct EjectSubscriber {
    ctl: Ctl,
    ejects: Rc<EjectReceiver>,
}

impl MutEventSubscriber for EjectSubscriber {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        let slots = self.ejects.drain();
        self.ctl.borrow_mut().on_ejects(&slots);
    }

    fn init(&mut self, ops: &mut EventOps) {
        register(ops, self.ejects.eventfd().as_raw_fd(), "eject");
    }
}

/// Ends the loop when the VM exits (the eventfd is never reset, so it stays readable).
pub struct ExitSubscriber {
    fd: RawFd,
    done: Rc<Cell<bool>>,
}

impl MutEventSubscriber for ExitSubscriber {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        self.done.set(true);
    }

    fn init(&mut self, ops: &mut EventOps) {
        register(ops, self.fd, "exit");
    }
}

/// Retries deferred device drops.
pub struct ReleaseSubscriber {
    ctl: Ctl,
    fd: RawFd,
}

impl MutEventSubscriber for ReleaseSubscriber {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        self.ctl.borrow_mut().on_release_timer();
    }

    fn init(&mut self, ops: &mut EventOps) {
        register(ops, self.fd, "release timer");
    }
}

/// One device's lease-loss eventfd.
pub struct LeaseSubscriber {
    ctl: Ctl,
    id: String,
    lost: EventFd,
}

impl MutEventSubscriber for LeaseSubscriber {
    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        let _ = self.lost.read();
        log::debug!("{}: lease event", self.id);
        self.ctl.borrow_mut().check_leases();
    }

    fn init(&mut self, ops: &mut EventOps) {
        register(ops, self.lost.as_raw_fd(), "lease");
    }
}

/// The loop: the event manager, the controller it drives and the device subscribers.
pub struct EventLoop {
    em: EventManager<Box<dyn MutEventSubscriber>>,
    ctl: Ctl,
    done: Rc<Cell<bool>>,
    exit: Arc<ExitNotifier>,
    devices: HashMap<u64, SubscriberId>,
}

impl EventLoop {
    /// Subscribes the fixed sources. The controller is shared with the caller, who gets it
    /// back (for teardown) when the loop is dropped.
    pub fn new(
        ctl: Ctl,
        api: Option<Rc<ApiChannel>>,
        ejects: EjectReceiver,
        exit: Arc<ExitNotifier>,
    ) -> Result<Self, EventLoopError> {
        let mut em: EventManager<Box<dyn MutEventSubscriber>> =
            EventManager::new().map_err(EventLoopError::Manager)?;
        let done = Rc::new(Cell::new(false));
        if let Some(api) = api {
            em.add_subscriber(Box::new(ApiSubscriber {
                ctl: ctl.clone(),
                api,
            }));
        }
        em.add_subscriber(Box::new(EjectSubscriber {
            ctl: ctl.clone(),
            ejects: Rc::new(ejects),
        }));
        let exit_fd = exit.eventfd().ok_or(EventLoopError::NoExitFd)?.as_raw_fd();
        em.add_subscriber(Box::new(ExitSubscriber {
            fd: exit_fd,
            done: done.clone(),
        }));
        if let Some(fd) = ctl.borrow().release_timer_fd() {
            em.add_subscriber(Box::new(ReleaseSubscriber {
                ctl: ctl.clone(),
                fd,
            }));
        }
        let mut lp = EventLoop {
            em,
            ctl,
            done,
            exit,
            devices: HashMap::new(),
        };
        // Boot devices were attached before the loop existed.
        lp.apply_changes();
        // A loss before the subscribers existed left its eventfd readable: nothing is missed.
        Ok(lp)
    }

    fn apply_changes(&mut self) {
        let changes = self.ctl.borrow_mut().take_subscriber_changes();
        for c in changes {
            match c {
                SubscriberChange::Add { key, id, lost } => {
                    log::debug!("event loop: watching the lease of {id}");
                    let sid = self.em.add_subscriber(Box::new(LeaseSubscriber {
                        ctl: self.ctl.clone(),
                        id,
                        lost,
                    }));
                    self.devices.insert(key, sid);
                }
                SubscriberChange::Remove { key } => {
                    if let Some(sid) = self.devices.remove(&key) {
                        if let Err(e) = self.em.remove_subscriber(sid) {
                            log::warn!("event loop: removing a lease subscriber: {e}");
                        }
                    }
                }
            }
        }
    }

    /// Device subscribers currently registered (tests).
    pub fn lease_subscribers(&self) -> usize {
        self.devices.len()
    }

    /// Dispatches one batch of events (waiting at most `timeout_ms`, -1: forever); returns
    /// the exit reason once the VM exited.
    pub fn run_once(&mut self, timeout_ms: i32) -> Option<VmExit> {
        if let Err(e) = self.em.run_with_timeout(timeout_ms) {
            log::error!("event loop: {e}");
        }
        self.apply_changes();
        if self.done.get() {
            return self.exit.reason();
        }
        None
    }

    /// Runs until the VM exits; returns why. The vCPUs must be running; the caller stops
    /// them and calls [`Controller::teardown_all`] afterwards.
    pub fn run(&mut self) -> VmExit {
        loop {
            if let Some(reason) = self.exit.reason() {
                self.ctl.borrow_mut().note_exit();
                return reason;
            }
            if let Some(reason) = self.run_once(-1) {
                self.ctl.borrow_mut().note_exit();
                return reason;
            }
        }
    }
}
