//! Live migration between two lendvm processes (`vm.send-migration` /
//! `vm.receive-migration`), for a VM without lent devices.
//!
//! Precopy over a Unix or TCP socket ([`protocol`]): the source turns KVM's dirty logging on
//! for guest RAM, sends all of it while the guest runs, then in bounded rounds the pages the
//! guest dirtied meanwhile ([`send`]); once a round is small (or after
//! [`send::MAX_ROUNDS`]) it pauses the VM, sends the last dirty pages and the VM's state —
//! the snapshot document of [`crate::snapshot`], without RAM files — and waits for the
//! destination ([`receive`]) to restore it. Only then does the source stop; any failure
//! before leaves it running. See docs/ARCHITECTURE.md, "Life of a live migration (VMM side)".
//!
//! Lent devices would need a hand-over (quiesce, lease transfer, re-mapping the DMA window
//! at the destination): not done yet, a VM holding one is refused.

pub mod protocol;
pub mod receive;
pub mod send;

pub use protocol::{parse_url, MigrationError, MigrationUrl};
