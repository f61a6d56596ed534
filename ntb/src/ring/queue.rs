//! One link's control rings in the shared region: a slot of [`RING_SLOT_SIZE`] bytes with a
//! header and two single-producer single-consumer byte rings, one per direction.
//!
//! Layout of a slot (little-endian; every index in a cache line of its own, so a producer and
//! a consumer on two hosts do not write the same line):
//!
//! | offset | what | written by |
//! |---|---|---|
//! | 0x000 | magic `LVRING01` | the lender, last, when it sets the slot up |
//! | 0x008 | nonce (16 bytes, sent to the borrower inside TLS) | the lender |
//! | 0x018 | ring capacity in bytes (u32) | the lender |
//! | 0x040 + 0xc0·d | `tail` of direction d: bytes produced, free-running u64 | d's producer |
//! | 0x080 + 0xc0·d | `head` of direction d: bytes consumed, free-running u64 | d's consumer |
//! | 0x0c0 + 0xc0·d | `sleeping` of direction d: 1 while its consumer waits for a kick | both |
//! | 0x1000 + cap·d | the bytes of direction d | d's producer |
//!
//! Direction 0 carries the connecting side's bytes (borrower → lender), direction 1 the
//! accepting side's. A side keeps its own index in a local variable and only publishes it:
//! what it reads back from the region is the peer's index, which it checks (never past what
//! was produced, never more than the capacity, never backwards). A peer that writes anything
//! else has broken the ring: [`RingError::Corrupt`], and the link is dropped.

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use crate::mem::Mapping;
use crate::region::RING_SLOT_SIZE;

/// `LVRING01`.
const MAGIC: u64 = u64::from_le_bytes(*b"LVRING01");
const MAGIC_OFF: usize = 0x000;
const NONCE_OFF: usize = 0x008;
const CAP_OFF: usize = 0x018;
const DIR_BASE: usize = 0x040;
const DIR_STRIDE: usize = 0x0c0;
const TAIL: usize = 0x000;
const HEAD: usize = 0x040;
const SLEEPING: usize = 0x080;
/// Bytes of the header page.
pub(crate) const HEADER: usize = 0x1000;
/// Bytes of each direction's ring.
pub(crate) const CAP: usize = (RING_SLOT_SIZE as usize - HEADER) / 2;
/// Length of the nonce.
pub(crate) const NONCE_LEN: usize = 16;

/// Why a ring cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// The peer wrote indices that no correct producer or consumer can: the link is dropped.
    #[error("control ring broken by the peer: {0}")]
    Corrupt(String),
    /// The slot does not hold the ring the lender announced.
    #[error("{0}")]
    Mismatch(String),
}

/// The two rings of one link, seen from one side.
pub(crate) struct Rings {
    map: Mapping,
    /// The direction this side produces into.
    tx: usize,
    /// Bytes produced so far (ours; published as the tx `tail`).
    tx_tail: u64,
    /// The peer's consumer index as last seen (it never goes backwards).
    tx_head: u64,
    /// Bytes consumed so far (ours; published as the rx `head`).
    rx_head: u64,
}

impl Rings {
    /// Sets a slot up (the lender): zeroes the header, writes the capacity and `nonce`, then
    /// the magic last, so a borrower that sees the magic sees the rest.
    pub(crate) fn init(map: Mapping, nonce: &[u8; NONCE_LEN]) -> Result<Rings, RingError> {
        check_len(&map)?;
        let r = Rings {
            map,
            tx: 1,
            tx_tail: 0,
            tx_head: 0,
            rx_head: 0,
        };
        r.u64_at(MAGIC_OFF).store(0, Ordering::Relaxed);
        for d in 0..2 {
            for f in [TAIL, HEAD] {
                r.u64_at(DIR_BASE + d * DIR_STRIDE + f)
                    .store(0, Ordering::Relaxed);
            }
            r.u32_at(DIR_BASE + d * DIR_STRIDE + SLEEPING)
                .store(0, Ordering::Relaxed);
        }
        r.copy_in(NONCE_OFF, nonce);
        r.u32_at(CAP_OFF).store(CAP as u32, Ordering::Relaxed);
        r.u64_at(MAGIC_OFF).store(MAGIC, Ordering::Release);
        Ok(r)
    }

    /// Takes a slot the lender set up (the borrower): its magic, capacity and `nonce` must be
    /// the ones announced, which proves both ends map the same memory.
    pub(crate) fn attach(map: Mapping, nonce: &[u8; NONCE_LEN]) -> Result<Rings, RingError> {
        check_len(&map)?;
        let r = Rings {
            map,
            tx: 0,
            tx_tail: 0,
            tx_head: 0,
            rx_head: 0,
        };
        let magic = r.u64_at(MAGIC_OFF).load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(RingError::Mismatch(format!(
                "no control ring there (magic {magic:#018x})"
            )));
        }
        let mut seen = [0u8; NONCE_LEN];
        r.copy_out(NONCE_OFF, &mut seen);
        let cap = r.u32_at(CAP_OFF).load(Ordering::Relaxed);
        if seen != *nonce || cap as usize != CAP {
            return Err(RingError::Mismatch(
                "a control ring set up for another link is there".into(),
            ));
        }
        Ok(r)
    }

    fn dir(&self, d: usize, field: usize) -> usize {
        DIR_BASE + d * DIR_STRIDE + field
    }

    fn rx(&self) -> usize {
        1 - self.tx
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= HEADER);
        // SAFETY: `off` is an 8-aligned offset inside the header page of the live mapping
        // (constants above; the mapping is page-aligned and at least a slot long, checked at
        // construction); AtomicU64 has the layout of u64, and every access to shared memory
        // that another process may write concurrently goes through atomics.
        unsafe { &*self.map.as_ptr().add(off).cast::<AtomicU64>() }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= HEADER);
        // SAFETY: as in `u64_at`, 4-aligned.
        unsafe { &*self.map.as_ptr().add(off).cast::<AtomicU32>() }
    }

    fn copy_in(&self, off: usize, data: &[u8]) {
        debug_assert!(off + data.len() <= self.map.len());
        // SAFETY: the range is inside the mapping (callers stay within a ring or the header);
        // `data` is a distinct local buffer. The peer may write the region concurrently
        // (only a broken peer would, into our half): plain bytes, like guest memory.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.map.as_ptr().add(off), data.len())
        };
    }

    fn copy_out(&self, off: usize, buf: &mut [u8]) {
        debug_assert!(off + buf.len() <= self.map.len());
        // SAFETY: as in `copy_in`, the other way.
        unsafe {
            std::ptr::copy_nonoverlapping(self.map.as_ptr().add(off), buf.as_mut_ptr(), buf.len())
        };
    }

    /// Reads the peer's consumer index of our tx direction (checked), which moves
    /// [`Rings::tx_unread`].
    pub(crate) fn refresh_tx(&mut self) -> Result<(), RingError> {
        self.peer_head().map(|_| ())
    }

    /// The peer's consumer index of our tx direction, checked.
    fn peer_head(&mut self) -> Result<u64, RingError> {
        let head = self.u64_at(self.dir(self.tx, HEAD)).load(Ordering::Acquire);
        if head < self.tx_head || head > self.tx_tail {
            return Err(RingError::Corrupt(format!(
                "the peer's read index {head:#x} is outside [{:#x}, {:#x}] (what it read \
                 before, what was written)",
                self.tx_head, self.tx_tail
            )));
        }
        self.tx_head = head;
        Ok(head)
    }

    /// Bytes the peer has produced into our rx direction and we have not taken, checked.
    pub(crate) fn rx_pending(&self) -> Result<usize, RingError> {
        let tail = self
            .u64_at(self.dir(self.rx(), TAIL))
            .load(Ordering::Acquire);
        match tail.checked_sub(self.rx_head) {
            Some(n) if n <= CAP as u64 => Ok(n as usize),
            _ => Err(RingError::Corrupt(format!(
                "the peer's write index {tail:#x} is not within {CAP:#x} bytes after the \
                 read index {:#x}",
                self.rx_head
            ))),
        }
    }

    /// Copies as much of `data` as fits into the tx ring and publishes it; returns the bytes
    /// taken (0 when the ring is full: back-pressure, nothing is dropped or queued here).
    pub(crate) fn push(&mut self, data: &[u8]) -> Result<usize, RingError> {
        let head = self.peer_head()?;
        let free = CAP - (self.tx_tail - head) as usize;
        let n = free.min(data.len());
        if n == 0 {
            return Ok(0);
        }
        let base = HEADER + self.tx * CAP;
        let at = (self.tx_tail % CAP as u64) as usize;
        let first = n.min(CAP - at);
        self.copy_in(base + at, &data[..first]);
        self.copy_in(base, &data[first..n]);
        self.tx_tail += n as u64;
        self.u64_at(self.dir(self.tx, TAIL))
            .store(self.tx_tail, Ordering::Release);
        Ok(n)
    }

    /// Whether the peer's consumer went to sleep and needs a kick; taking the flag means only
    /// one kick per sleep. After [`Rings::push`]: the fence orders our tail store before the
    /// flag's read, as the consumer's orders its flag store before its tail's re-read, so one
    /// of the two sees the other (no lost wake-up).
    pub(crate) fn take_peer_sleeping(&self) -> bool {
        fence(Ordering::SeqCst);
        self.u32_at(self.dir(self.tx, SLEEPING))
            .swap(0, Ordering::AcqRel)
            != 0
    }

    /// Copies up to `buf.len()` pending rx bytes out and frees their room; returns how many.
    pub(crate) fn pop(&mut self, buf: &mut [u8]) -> Result<usize, RingError> {
        let n = self.rx_pending()?.min(buf.len());
        if n == 0 {
            return Ok(0);
        }
        let base = HEADER + self.rx() * CAP;
        let at = (self.rx_head % CAP as u64) as usize;
        let first = n.min(CAP - at);
        self.copy_out(base + at, &mut buf[..first]);
        self.copy_out(base, &mut buf[first..n]);
        self.rx_head += n as u64;
        self.u64_at(self.dir(self.rx(), HEAD))
            .store(self.rx_head, Ordering::Release);
        Ok(n)
    }

    /// Says that this side's consumer is about to sleep (`true`) or is awake; after setting
    /// it, re-check [`Rings::rx_pending`] before sleeping (see [`Rings::take_peer_sleeping`]).
    pub(crate) fn set_sleeping(&self, sleeping: bool) {
        self.u32_at(self.dir(self.rx(), SLEEPING))
            .store(u32::from(sleeping), Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Bytes this side has produced and the peer has not consumed yet.
    pub(crate) fn tx_unread(&self) -> usize {
        (self.tx_tail - self.tx_head) as usize
    }
}

fn check_len(map: &Mapping) -> Result<(), RingError> {
    if (map.len() as u64) < RING_SLOT_SIZE {
        return Err(RingError::Mismatch(format!(
            "a control ring needs {RING_SLOT_SIZE:#x} bytes, the mapping has {:#x}",
            map.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::SharedMemory;
    use std::os::fd::AsFd;

    fn pair() -> (SharedMemory, Rings, Rings) {
        let mem = SharedMemory::new("ring-test", RING_SLOT_SIZE).unwrap();
        let nonce = [7u8; NONCE_LEN];
        let a = Rings::init(
            Mapping::map_shared(mem.fd(), 0, RING_SLOT_SIZE).unwrap(),
            &nonce,
        )
        .unwrap();
        let b = Rings::attach(
            Mapping::map_shared(mem.as_fd(), 0, RING_SLOT_SIZE).unwrap(),
            &nonce,
        )
        .unwrap();
        (mem, a, b)
    }

    #[test]
    fn bytes_cross_both_ways_and_wrap_around() {
        let (_mem, mut lender, mut borrower) = pair();
        let mut buf = vec![0u8; CAP];
        // Many rounds of odd sizes: every position of the wrap is crossed.
        let mut sent = 0u64;
        for round in 0..200u64 {
            let len = (round * 997 % 5000 + 1) as usize;
            let data: Vec<u8> = (0..len).map(|i| (sent + i as u64) as u8).collect();
            assert_eq!(borrower.push(&data).unwrap(), len);
            let got = lender.pop(&mut buf).unwrap();
            assert_eq!(&buf[..got], &data[..], "round {round}");
            sent += len as u64;
            assert_eq!(lender.push(&data[..len / 2]).unwrap(), len / 2);
            assert_eq!(borrower.pop(&mut buf).unwrap(), len / 2);
        }
    }

    #[test]
    fn a_full_ring_takes_nothing_more_until_the_peer_reads() {
        let (_mem, mut lender, mut borrower) = pair();
        let data = vec![0x5au8; CAP + 100];
        assert_eq!(borrower.push(&data).unwrap(), CAP);
        assert_eq!(borrower.push(&data).unwrap(), 0, "full: back-pressure");
        assert_eq!(borrower.tx_unread(), CAP);
        let mut buf = vec![0u8; 1000];
        assert_eq!(lender.pop(&mut buf).unwrap(), 1000);
        assert_eq!(borrower.push(&data).unwrap(), 1000);
        let mut all = vec![0u8; 2 * CAP];
        assert_eq!(lender.pop(&mut all).unwrap(), CAP);
        assert!(all[..CAP].iter().all(|&b| b == 0x5a));
    }

    #[test]
    fn a_sleeping_consumer_is_kicked_once() {
        let (_mem, lender, mut borrower) = pair();
        lender.set_sleeping(true);
        borrower.push(b"x").unwrap();
        assert!(borrower.take_peer_sleeping());
        assert!(!borrower.take_peer_sleeping(), "one kick per sleep");
    }

    #[test]
    fn indices_no_correct_peer_writes_break_the_ring() {
        let (mem, mut lender, mut borrower) = pair();
        borrower.push(b"hello").unwrap();
        // The borrower's tail (direction 0) pushed past the capacity.
        let tail0 = DIR_BASE + TAIL;
        mem.write_at(tail0 as u64, &(CAP as u64 + 6).to_le_bytes())
            .unwrap();
        let e = lender.pop(&mut [0u8; 16]).unwrap_err();
        assert!(matches!(e, RingError::Corrupt(_)), "{e}");
        // A read index past what was written, and one that goes backwards.
        let head1 = DIR_BASE + DIR_STRIDE + HEAD;
        lender.push(b"abc").unwrap();
        mem.write_at(head1 as u64, &99u64.to_le_bytes()).unwrap();
        let e = lender.push(b"d").unwrap_err();
        assert!(e.to_string().contains("read index"), "{e}");
        let (mem, mut lender, mut borrower) = pair();
        lender.push(b"abc").unwrap();
        borrower.pop(&mut [0u8; 3]).unwrap();
        lender.push(b"d").unwrap();
        mem.write_at(head1 as u64, &1u64.to_le_bytes()).unwrap();
        assert!(
            lender.push(b"e").is_err(),
            "a read index that went backwards"
        );
    }

    #[test]
    fn a_slot_set_up_for_another_link_is_refused() {
        let mem = SharedMemory::new("ring-test", RING_SLOT_SIZE).unwrap();
        let map = || Mapping::map_shared(mem.fd(), 0, RING_SLOT_SIZE).unwrap();
        let e = Rings::attach(map(), &[1; NONCE_LEN]).err().unwrap();
        assert!(e.to_string().contains("no control ring there"), "{e}");
        Rings::init(map(), &[1; NONCE_LEN]).unwrap();
        let e = Rings::attach(map(), &[2; NONCE_LEN]).err().unwrap();
        assert!(e.to_string().contains("another link"), "{e}");
        Rings::attach(map(), &[1; NONCE_LEN]).unwrap();
    }
}
