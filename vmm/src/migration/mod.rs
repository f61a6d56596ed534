//! Live migration between two lendvm processes (`vm.send-migration` /
//! `vm.receive-migration`), lent devices included.
//!
//! Precopy over a Unix or TCP socket ([`protocol`]): the source turns KVM's dirty logging on
//! for guest RAM, sends all of it while the guest runs, then in bounded rounds the pages the
//! guest dirtied meanwhile ([`send`]); once a round is small (or after
//! [`send::MAX_ROUNDS`]) it pauses the VM, sends the last dirty pages and the VM's state —
//! the snapshot document of [`crate::snapshot`], without RAM files — and waits for the
//! destination ([`receive`]) to restore it. Only then does the source stop; any failure
//! before leaves it running. See docs/ARCHITECTURE.md, "Life of a live migration (VMM side)".
//!
//! Lent devices stay on their lenders: each round also fetches their lender dirty log (device
//! DMA, which KVM cannot see); at the final pass each is quiesced for the hand-over and its
//! lease goes to the destination with a single-use transfer ticket in `STATE`, which the
//! destination presents before it acknowledges ([`orchestrate`], which drives both sides
//! of a migration through the controller's [`orchestrate::MigrationHost`]). See docs/ARCHITECTURE.md, "Life of a live
//! migration (VMM side)", for the failure rule.

pub mod auth;
pub mod orchestrate;
pub mod protocol;
pub mod receive;
pub mod send;

pub use protocol::{parse_url, MigrationError, MigrationUrl};
