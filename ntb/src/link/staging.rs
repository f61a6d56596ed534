//! Staged writes of a mediated window on a link that passes fds (shm).
//!
//! A mediated window is served by its exporter: the peer never maps the exporter's memory
//! (a cross-lender P2P grant must stay revocable, docs/SECURITY.md). Sent as window-write
//! messages, a large write crosses the socket (two kernel copies) and waits for one reply
//! per 1 MiB chunk: four thread hand-offs per chunk, which is where a cross-lender P2P copy
//! spent its time (docs/BENCHMARKS.md, P2P section).
//!
//! With staging, the exporter also creates a *staging ring*: a sealed memfd of its own
//! ([`RING_BYTES`] after a [`HEADER`] page) that holds only what the peer writes into it,
//! never the window's memory, and passes it with the window (`WINDOW_ADD_STAGED`). A write
//! then goes:
//!
//! 1. the writer waits until the ring has room (the exporter's drained count, in the
//!    header), copies a chunk (at most [`CHUNK`]) into the ring: the data's one copy on this
//!    side;
//! 2. it sends a small `WINDOW_COMMIT` (window, offset, ring position, length) with no
//!    reply; the write's last chunk carries a request id, answered only if it is refused;
//! 3. the exporter's reader takes the commit, checks it against the window and its own count
//!    of the ring (never against anything in the shared memory), copies the chunk from the
//!    ring into the window (the data's one copy on that side), and publishes its new drained
//!    count in the header;
//! 4. the write is done when the drained count reaches its end: every byte has landed.
//!
//! So the two copies run in parallel on two threads, and a write of any size costs no reply
//! message when it lands: the writer sees the count (it looks for a while, yielding the
//! CPU, then between short waits for a refusal). Revocation is unchanged: dropping the window ends the commits (they are
//! answered `UNKNOWN_WINDOW`) and the ring goes with it; the peer keeps at most a mapping of
//! the ring, which holds nothing of the exporter's.
//!
//! A peer can write anything into the ring and send any commit: a commit out of sequence or
//! out of range breaks that window's ring (every later commit is refused, by name) and never
//! the exporter. Memory cost: one ring per staged window, allocated as the peer touches it.

use super::*;

/// Bytes before the ring: the drained count (an `AtomicU64` at offset 0), on a page of its
/// own.
pub(super) const HEADER: usize = 4096;
/// Ring size of a staged window. Eight chunks: the writer fills one while the exporter
/// drains the ones before it.
pub(super) const RING_BYTES: usize = 2 << 20;
/// Largest chunk of one commit.
pub(super) const CHUNK: usize = 256 << 10;
/// Smallest and largest ring a peer may hand over (its memfd size less [`HEADER`]).
const MIN_RING: u64 = 64 << 10;
const MAX_RING: u64 = 64 << 20;
/// How long a writer spins (then yields the CPU) for ring room before it sleeps between
/// looks: the exporter drains a chunk in tens of microseconds.
const SPIN_FOR: Duration = Duration::from_micros(200);
const SLEEP_STEP: Duration = Duration::from_micros(50);

/// Errors of a staging ring.
#[derive(Debug, thiserror::Error)]
pub enum StagingError {
    #[error("staging ring of {have} bytes is outside {MIN_RING}..={MAX_RING} bytes")]
    RingSize { have: u64 },
    #[error("commit at ring position {got}, expected {want}")]
    Sequence { got: u64, want: u64 },
    #[error("commit of {len} bytes at ring offset {at} runs past the {ring}-byte ring")]
    PastRing { at: u64, len: u64, ring: u64 },
    #[error("the staging ring is broken by an earlier commit: {0}")]
    Broken(String),
    #[error("the peer's drained count {drained} is past what was written ({written})")]
    DrainedAhead { drained: u64, written: u64 },
}

fn drained_at(base: *mut u8) -> *const AtomicU64 {
    base.cast::<AtomicU64>()
}

/// The exporter's side: the ring's memory and its own count of it.
pub(super) struct StagingRing {
    mem: SharedMemory,
    state: Mutex<DrainState>,
}

#[derive(Default)]
struct DrainState {
    /// Ring position (bytes committed and drained so far) of the next commit.
    next: u64,
    /// Why the ring is unusable, once a commit broke it.
    broken: Option<String>,
}

impl StagingRing {
    pub(super) fn new(label: &str) -> Result<StagingRing> {
        let mem = SharedMemory::new(&format!("staging-{label}"), (HEADER + RING_BYTES) as u64)?;
        Ok(StagingRing {
            mem,
            state: Mutex::new(DrainState::default()),
        })
    }

    pub(super) fn fd(&self) -> BorrowedFd<'_> {
        self.mem.fd()
    }

    /// Copies a committed chunk from the ring into `map` at `c.offset` and publishes the new
    /// drained count. `map` is ordinary memory (staging is never offered for registers).
    pub(super) fn drain(
        &self,
        map: &Mapping,
        c: &msg::WindowCommit,
    ) -> std::result::Result<(), ErrorReply> {
        let mut st = lock(&self.state);
        if let Some(why) = &st.broken {
            return Err(ErrorReply::new(
                code::INVALID,
                StagingError::Broken(why.clone()).to_string(),
            ));
        }
        let ring = RING_BYTES as u64;
        let len = u64::from(c.len);
        let at = c.pos % ring;
        let checked = if c.pos != st.next {
            Err((
                code::INVALID,
                StagingError::Sequence {
                    got: c.pos,
                    want: st.next,
                }
                .to_string(),
            ))
        } else if len > ring - at {
            Err((
                code::INVALID,
                StagingError::PastRing { at, len, ring }.to_string(),
            ))
        } else {
            crate::mem::check_range(c.offset, len, map.len() as u64)
                .map_err(|e| (code::OUT_OF_RANGE, e.to_string()))
        };
        if let Err((code, why)) = checked {
            // Later commits of this writer follow from this one: refuse them all, by name.
            st.broken = Some(why.clone());
            return Err(ErrorReply::new(code, why));
        }
        // SAFETY: `at + len <= RING_BYTES` (checked), so the source lies inside the ring
        // after the header, in the live mapping `self.mem` keeps; `check_range` put the
        // destination inside `map`, which the caller keeps alive. Two distinct mappings:
        // the ranges cannot overlap. Raw copies: the peer may change the ring meanwhile
        // (then it wrote torn data into its own window range, as a device racing a DMA).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.mem.as_ptr().add(HEADER + at as usize),
                map.as_ptr().add(c.offset as usize),
                len as usize,
            );
        }
        st.next += len;
        // SAFETY: the header page starts the live mapping and is 8-byte aligned.
        unsafe { (*drained_at(self.mem.as_ptr())).store(st.next, Ordering::Release) };
        Ok(())
    }
}

/// The writer's side: its mapping of the exporter's ring and its position in it.
pub(super) struct StagingWriter {
    map: Mapping,
    ring: u64,
    /// Bytes committed so far; held for a whole write, so that one write's chunks are
    /// consecutive in the ring and on the link.
    head: Mutex<u64>,
}

impl StagingWriter {
    /// Maps the exporter's ring `fd`, already checked to be sealed.
    pub(super) fn map(fd: BorrowedFd<'_>) -> Result<StagingWriter> {
        let size = fd_size(fd)?;
        let ring = size.saturating_sub(HEADER as u64);
        if !(MIN_RING..=MAX_RING).contains(&ring) || !ring.is_multiple_of(4096) {
            return Err(FabricError::BadRegion {
                path: "staging ring".into(),
                problem: StagingError::RingSize { have: ring }.to_string(),
            });
        }
        Ok(StagingWriter {
            map: Mapping::map_shared(fd, 0, size)?,
            ring,
            head: Mutex::new(0),
        })
    }

    fn drained(&self) -> u64 {
        // SAFETY: the header page starts the live mapping and is 8-byte aligned; the
        // exporter stores to it, atomically.
        unsafe { (*drained_at(self.map.as_ptr())).load(Ordering::Acquire) }
    }

    /// Waits until `want` bytes after `head` are free; `live` says whether to go on.
    fn wait_room(&self, head: u64, want: u64, live: &dyn Fn() -> Result<()>) -> Result<()> {
        let start = Instant::now();
        let mut looks = 0u32;
        loop {
            let drained = self.drained();
            let used = head
                .checked_sub(drained)
                .ok_or_else(|| {
                    FabricError::Remote(ErrorReply::new(
                        code::INVALID,
                        StagingError::DrainedAhead {
                            drained,
                            written: head,
                        }
                        .to_string(),
                    ))
                })?
                .min(self.ring);
            if self.ring - used >= want {
                return Ok(());
            }
            looks = looks.wrapping_add(1);
            if looks.is_multiple_of(64) {
                live()?;
            }
            let waited = start.elapsed();
            if waited >= IO_TIMEOUT {
                return Err(FabricError::Timeout(IO_TIMEOUT));
            }
            if waited < SPIN_FOR {
                std::thread::yield_now();
            } else {
                std::thread::sleep(SLEEP_STEP);
            }
        }
    }

    /// Writes `len` bytes from `src` into window `w` at `offset` through the ring: returns
    /// once the exporter's drained count shows every byte landed, or with its refusal.
    ///
    /// # Safety
    /// `src` must be valid for reads of `len` bytes for the call (others may change them).
    pub(super) unsafe fn write(
        &self,
        w: &MessageWindow,
        offset: u64,
        src: *const u8,
        len: usize,
    ) -> Result<()> {
        let live = || w.check(offset, 0);
        let mut head = lock(&self.head);
        let mut done = 0usize;
        let last = loop {
            let pos = *head % self.ring;
            let n = (len - done).min(CHUNK).min((self.ring - pos) as usize);
            self.wait_room(*head, n as u64, &live)?;
            // SAFETY: `pos + n <= ring` and the ring follows the header inside the live
            // mapping; `src + done .. + n` lies in the caller's span (this function's
            // contract). Raw copy: the exporter only reads drained chunks, which this one
            // is not.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.add(done),
                    self.map.as_ptr().add(HEADER + pos as usize),
                    n,
                );
            }
            let commit = wire::encode_payload(&msg::WindowCommit {
                id: w.info.id,
                offset: offset + done as u64,
                pos: *head,
                len: n as u32,
            })?;
            *head += n as u64;
            done += n;
            if done == len {
                break w.inner.start_request(op::WINDOW_COMMIT, &commit, &[])?;
            }
            w.inner.send_frame(0, op::WINDOW_COMMIT, 0, &commit, &[])?;
        };
        let end = *head;
        // Later writes may queue their chunks behind this one's while it waits.
        drop(head);
        self.wait_landed(w, end, last)
    }

    /// Waits until the exporter's drained count reaches `end` (every byte of the write has
    /// landed) or it refuses the write's last commit `(id, rx)`. The count is in the ring's
    /// header, so a write that lands while this thread still looks costs no reply and no
    /// wake-up; after [`SPIN_FOR`] it looks between short waits for a refusal.
    fn wait_landed(&self, w: &MessageWindow, end: u64, (id, rx): (u64, ReplyRx)) -> Result<()> {
        let start = Instant::now();
        loop {
            if self.drained() >= end {
                w.inner.forget_request(id);
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= IO_TIMEOUT {
                w.inner.forget_request(id);
                return Err(FabricError::Timeout(IO_TIMEOUT));
            }
            let got = if waited < SPIN_FOR {
                std::thread::yield_now();
                rx.try_recv()
                    .map_err(|e| e == mpsc::TryRecvError::Disconnected)
            } else {
                rx.recv_timeout(SLEEP_STEP)
                    .map_err(|e| e == mpsc::RecvTimeoutError::Disconnected)
            };
            match got {
                // Answered: a refusal (the exporter answers a last commit only then).
                Ok(r) => return w.settle(r).map(|_| ()),
                Err(true) => return Err(w.inner.gone_err()),
                Err(false) => {}
            }
        }
    }
}
