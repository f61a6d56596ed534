//! Shared by `tests/p2p.rs` and `tests/p2p_lenders.rs`: guest RAM exported to a lender and
//! a dmatest engine driven through its lease's BAR0, as a guest driver would.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use emulated::dmatest::{
    CMD_START, REG_CMD, REG_DST, REG_FAULTS, REG_LEN, REG_SRC, REG_STATUS, STATUS_DONE,
    STATUS_ERROR,
};
use lending::client::Lease;
use lending::LenderClient;
use ntb::{ExportedWindow, PeerWindow, SharedMemory};

pub const PAGE: u64 = 0x1000;
/// Guest RAM: 16 pages at GPA 1 MiB.
pub const RAM_GPA: u64 = 0x10_0000;
pub const RAM_SIZE: u64 = 16 * PAGE;
/// The dmatest's completion counter register.
const REG_DONE: u64 = 0x28;

/// Guest RAM exported over a client's link and mapped for a lease at IOVA = GPA.
pub struct Ram {
    pub mem: SharedMemory,
    _win: ExportedWindow,
}

pub fn ram_for(c: &LenderClient, lease: &Lease) -> Ram {
    let mem = SharedMemory::new("p2p-guest-ram", RAM_SIZE).unwrap();
    let win = c
        .endpoint()
        .export_window(mem.fd(), 0, RAM_SIZE, &format!("ram-{}", lease.id()))
        .unwrap();
    lease.map_dma(RAM_GPA, RAM_SIZE, win.id()).unwrap();
    Ram { mem, _win: win }
}

pub fn w32(l: &Lease, off: u64, v: u32) {
    l.bar_write(0, off, &v.to_le_bytes()).unwrap();
}

pub fn w64(l: &Lease, off: u64, v: u64) {
    l.bar_write(0, off, &v.to_le_bytes()).unwrap();
}

pub fn r32(l: &Lease, off: u64) -> u32 {
    u32::from_le_bytes(l.bar_read(0, off, 4).unwrap().try_into().unwrap())
}

/// Runs one copy on `l`'s dmatest and returns (error?, FAULTS register).
pub fn copy(l: &Lease, cmd: u32, src: u64, dst: u64, len: u32) -> (bool, u32) {
    // No CMD_ACK needed: START sets STATUS anew.
    let done_before = r32(l, REG_DONE);
    w64(l, REG_SRC, src);
    w64(l, REG_DST, dst);
    w32(l, REG_LEN, len);
    w32(l, REG_CMD, CMD_START | cmd);
    let t0 = Instant::now();
    while r32(l, REG_DONE) == done_before {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "copy never completed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let st = r32(l, REG_STATUS);
    assert_ne!(st & (STATUS_DONE | STATUS_ERROR), 0, "status {st:#x}");
    (st & STATUS_ERROR != 0, r32(l, REG_FAULTS))
}

pub fn read_win(w: &dyn PeerWindow, off: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    w.read_at(off, &mut v).unwrap();
    v
}
