//! Test doubles shared by the unit tests.

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

/// Records calls; `notifier` returns real eventfds.
pub struct MockGroup {
    pub calls: Mutex<Vec<GroupCall>>,
    fds: Vec<EventFd>,
}

impl MockGroup {
    pub fn new(count: u32) -> Self {
        Self {
            calls: Mutex::new(Vec::new()),
            fds: (0..count)
                .map(|_| EventFd::new(EFD_NONBLOCK).unwrap())
                .collect(),
        }
    }

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
}
