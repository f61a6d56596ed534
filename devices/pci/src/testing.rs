//! Test doubles for the crate's seams, shared by this crate's unit tests and (through the
//! `testing` feature) by the tests of device crates.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Mutex;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::interrupt::{InterruptError, InterruptIndex, InterruptSourceGroup, MsiIrqSourceConfig};

/// What a [`MockGroup`] was asked to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupCall {
    Trigger(InterruptIndex),
    Update(InterruptIndex, MsiIrqSourceConfig, bool),
    Enable,
    Disable,
}

/// Records calls; `notifier` (and, for an INTx group, `resample_notifier`) returns real
/// eventfds.
pub struct MockGroup {
    pub calls: Mutex<Vec<GroupCall>>,
    /// `Some(n)`: physical MSI destinations are APIC ids 0..n (and 0xff), as on a VM of n
    /// vCPUs; `None`: every destination exists.
    pub apic_ids: Mutex<Option<u32>>,
    fds: Vec<EventFd>,
    resample: Option<EventFd>,
}

impl MockGroup {
    /// An MSI/MSI-X group of `count` vectors.
    pub fn new(count: u32) -> Self {
        Self::with_resample(count, false)
    }

    /// A group of `count` vectors; with `resample` it is an INTx group (a resample eventfd,
    /// and `update` is refused).
    pub fn with_resample(count: u32, resample: bool) -> Self {
        Self {
            calls: Mutex::new(Vec::new()),
            apic_ids: Mutex::new(None),
            fds: (0..count)
                .map(|_| EventFd::new(EFD_NONBLOCK).unwrap())
                .collect(),
            resample: resample.then(|| EventFd::new(EFD_NONBLOCK).unwrap()),
        }
    }

    /// The calls recorded since the last `take`.
    pub fn take(&self) -> Vec<GroupCall> {
        std::mem::take(&mut *self.calls.lock().unwrap())
    }
}

impl InterruptSourceGroup for MockGroup {
    fn trigger(&self, index: InterruptIndex) -> Result<(), InterruptError> {
        self.calls.lock().unwrap().push(GroupCall::Trigger(index));
        Ok(())
    }
    fn notifier(&self, index: InterruptIndex) -> Option<&EventFd> {
        self.fds.get(index as usize)
    }
    fn update(
        &self,
        index: InterruptIndex,
        config: MsiIrqSourceConfig,
        masked: bool,
    ) -> Result<(), InterruptError> {
        if self.resample.is_some() {
            return Err(InterruptError::Unsupported("update on intx"));
        }
        if index >= self.count() {
            return Err(InterruptError::InvalidIndex {
                index,
                count: self.count(),
            });
        }
        self.calls
            .lock()
            .unwrap()
            .push(GroupCall::Update(index, config, masked));
        Ok(())
    }
    fn enable(&self) -> Result<(), InterruptError> {
        self.calls.lock().unwrap().push(GroupCall::Enable);
        Ok(())
    }
    fn disable(&self) -> Result<(), InterruptError> {
        self.calls.lock().unwrap().push(GroupCall::Disable);
        Ok(())
    }
    fn count(&self) -> InterruptIndex {
        self.fds.len() as u32
    }
    fn resample_notifier(&self, index: InterruptIndex) -> Option<&EventFd> {
        (index == 0).then_some(self.resample.as_ref()).flatten()
    }
    fn destination_exists(&self, config: &MsiIrqSourceConfig) -> bool {
        let dest = (config.low_addr >> 12) & 0xff;
        let physical = config.low_addr & (1 << 2) == 0;
        match *self.apic_ids.lock().unwrap() {
            Some(n) if physical => dest == 0xff || dest < n,
            _ => true,
        }
    }
}
