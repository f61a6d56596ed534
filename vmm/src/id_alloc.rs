//! Numbered KVM resources (GSIs, memslots) handed out from a fixed range.

use std::collections::BTreeSet;

/// Hands out numbers in `[first, end)`, reusing freed ones (lowest first).
#[derive(Debug)]
pub struct IdAllocator {
    /// What the numbers are, for log lines (`GSI`, `memslot`).
    what: &'static str,
    first: u32,
    next: u32,
    end: u32,
    free: BTreeSet<u32>,
}

impl IdAllocator {
    pub fn new(what: &'static str, first: u32, end: u32) -> Self {
        Self {
            what,
            first,
            next: first,
            end,
            free: BTreeSet::new(),
        }
    }

    /// Takes one number, or `None` when all are in use.
    pub fn allocate(&mut self) -> Option<u32> {
        if let Some(id) = self.free.pop_first() {
            return Some(id);
        }
        (self.next < self.end).then(|| {
            self.next += 1;
            self.next - 1
        })
    }

    /// Returns `id` to the pool.
    pub fn release(&mut self, id: u32) {
        let what = self.what;
        if id < self.first || id >= self.next {
            log::warn!("{what} {id} was never allocated here");
        } else if !self.free.insert(id) {
            log::warn!("{what} {id} released twice");
        }
    }

    /// Numbers currently handed out.
    pub fn in_use(&self) -> usize {
        (self.next - self.first) as usize - self.free.len()
    }
}
