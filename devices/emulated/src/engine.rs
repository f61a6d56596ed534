//! Asynchronous block I/O on the backing file: io_uring, or a thread pool fallback.
//!
//! The controller thread submits operations and never waits for them; completions are reaped
//! when the engine's eventfd fires (or on the next polling pass) and turned into CQEs.

use std::alloc::{self, Layout};
use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use vmm_sys_util::eventfd::EventFd;

/// Which engine to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineKind {
    /// io_uring when it can be set up, else the thread pool.
    #[default]
    Auto,
    /// io_uring only (construction fails if unavailable).
    IoUring,
    /// Blocking pread/pwrite on worker threads.
    ThreadPool,
}

/// Buffer alignment (satisfies O_DIRECT on 4 KiB-sector devices).
pub const BUF_ALIGN: usize = 4096;

/// A zeroed, 4 KiB-aligned heap buffer.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
    layout: Layout,
}

// SAFETY: the buffer owns its allocation exclusively; moving it between threads is fine.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// `len` zeroed bytes (at least one page is allocated).
    pub fn new(len: usize) -> Self {
        let cap = len.max(1).next_multiple_of(BUF_ALIGN);
        let layout = match Layout::from_size_align(cap, BUF_ALIGN) {
            Ok(l) => l,
            Err(_) => alloc::handle_alloc_error(Layout::new::<u8>()),
        };
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, len, layout }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes (allocated and zero-initialised) while self lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated with exactly this layout and is freed once.
        unsafe { alloc::dealloc(self.ptr, self.layout) }
    }
}

/// What an operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    /// Read `len` bytes at `offset` into the buffer.
    Read,
    /// Write the buffer at `offset`; `dsync` makes it durable before completion (FUA / write
    /// cache disabled).
    Write {
        /// RWF_DSYNC semantics.
        dsync: bool,
    },
    /// fdatasync.
    Flush,
    /// Zero `len` bytes at `offset`.
    WriteZeroes {
        /// Durable before completion.
        dsync: bool,
    },
}

/// One operation.
pub struct IoOp {
    /// Caller's tag, returned in [`IoDone`].
    pub tag: u64,
    /// What to do.
    pub kind: IoKind,
    /// Byte offset in the file.
    pub offset: u64,
    /// Byte length (read/write: the buffer's length).
    pub len: usize,
    /// Data buffer.
    pub buf: AlignedBuf,
}

/// A finished operation.
pub struct IoDone {
    /// The op's tag.
    pub tag: u64,
    /// The op's buffer (read data for reads).
    pub buf: AlignedBuf,
    /// Ok, or the errno.
    pub result: Result<(), i32>,
}

/// An asynchronous I/O engine.
pub trait Engine: Send {
    /// Queue `op`; gives it back if the engine is full (retry after reaping).
    fn submit(&mut self, op: IoOp) -> Result<(), IoOp>;
    /// Push queued submissions to the kernel/workers.
    fn commit(&mut self);
    /// Move finished operations into `out` (never blocks).
    fn reap(&mut self, out: &mut Vec<IoDone>);
    /// Eventfd that becomes readable when completions may be available.
    fn completion_event(&self) -> &EventFd;
    /// Operations submitted and not yet reaped.
    fn inflight(&self) -> usize;
    /// "io_uring" or "thread-pool".
    fn name(&self) -> &'static str;
}

/// Create the engine for `file`.
pub fn create_engine(
    file: Arc<File>,
    kind: EngineKind,
    depth: u32,
    threads: usize,
) -> std::io::Result<Box<dyn Engine>> {
    match kind {
        EngineKind::ThreadPool => Ok(Box::new(ThreadPool::new(file, threads, None)?)),
        EngineKind::IoUring => Ok(Box::new(UringEngine::new(file, depth)?)),
        EngineKind::Auto => match UringEngine::new(file.clone(), depth) {
            Ok(e) => Ok(Box::new(e)),
            Err(e) => {
                log::warn!("io_uring unavailable ({e}); using the thread-pool engine");
                Ok(Box::new(ThreadPool::new(file, threads, None)?))
            }
        },
    }
}

fn errno_of(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

/// Run one operation synchronously (thread pool worker, aux ops).
fn run_blocking(file: &File, op: &mut IoOp) -> Result<(), i32> {
    match op.kind {
        IoKind::Read => {
            let buf = op.buf.as_mut_slice();
            let mut done = 0;
            while done < op.len {
                match file.read_at(&mut buf[done..op.len], op.offset + done as u64) {
                    Ok(0) => {
                        buf[done..op.len].fill(0);
                        break;
                    }
                    Ok(n) => done += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(errno_of(&e)),
                }
            }
            Ok(())
        }
        IoKind::Write { dsync } => {
            file.write_all_at(&op.buf.as_slice()[..op.len], op.offset)
                .map_err(|e| errno_of(&e))?;
            if dsync {
                file.sync_data().map_err(|e| errno_of(&e))?;
            }
            Ok(())
        }
        IoKind::Flush => file.sync_data().map_err(|e| errno_of(&e)),
        IoKind::WriteZeroes { dsync } => {
            zero_range(file, op.offset, op.len as u64)?;
            if dsync {
                file.sync_data().map_err(|e| errno_of(&e))?;
            }
            Ok(())
        }
    }
}

fn zero_range(file: &File, offset: u64, len: u64) -> Result<(), i32> {
    let fd = file.as_raw_fd();
    for mode in [
        libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
    ] {
        // SAFETY: plain syscall on an fd we own; no memory is passed.
        let r = unsafe { libc::fallocate(fd, mode, offset as libc::off_t, len as libc::off_t) };
        if r == 0 {
            return Ok(());
        }
    }
    // Fall back to writing zeroes (aligned buffer so O_DIRECT files work too).
    let chunk = AlignedBuf::new(1 << 20);
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(chunk.len() as u64) as usize;
        file.write_all_at(&chunk.as_slice()[..n], offset + done)
            .map_err(|e| errno_of(&e))?;
        done += n as u64;
    }
    Ok(())
}

struct PoolShared {
    queue: Mutex<PoolQueue>,
    cond: Condvar,
    done: Mutex<Vec<IoDone>>,
    stop: AtomicBool,
}

struct PoolQueue {
    /// Bound: the controller's in-flight commands (each fetched with a reserved CQ slot).
    ops: VecDeque<IoOp>,
}

/// Blocking I/O on worker threads.
pub struct ThreadPool {
    shared: Arc<PoolShared>,
    event: Arc<EventFd>,
    workers: Vec<JoinHandle<()>>,
    pending: Vec<IoOp>,
    inflight: usize,
}

impl ThreadPool {
    fn new(file: Arc<File>, threads: usize, event: Option<Arc<EventFd>>) -> std::io::Result<Self> {
        let event = match event {
            Some(e) => e,
            None => Arc::new(EventFd::new(libc::EFD_NONBLOCK)?),
        };
        let shared = Arc::new(PoolShared {
            queue: Mutex::new(PoolQueue {
                ops: VecDeque::new(),
            }),
            cond: Condvar::new(),
            done: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
        });
        let mut workers = Vec::new();
        for i in 0..threads.max(1) {
            let sh = shared.clone();
            let ev = event.clone();
            let f = file.clone();
            workers.push(
                std::thread::Builder::new()
                    .name(format!("emu-io{i}"))
                    .spawn(move || pool_worker(&sh, &ev, &f))?,
            );
        }
        Ok(ThreadPool {
            shared,
            event,
            workers,
            pending: Vec::new(),
            inflight: 0,
        })
    }
}

fn pool_worker(sh: &PoolShared, ev: &EventFd, file: &File) {
    loop {
        let mut op = {
            let mut q = match sh.queue.lock() {
                Ok(q) => q,
                Err(_) => return,
            };
            loop {
                if let Some(op) = q.ops.pop_front() {
                    break op;
                }
                if sh.stop.load(Ordering::Acquire) {
                    return;
                }
                q = match sh.cond.wait(q) {
                    Ok(q) => q,
                    Err(_) => return,
                };
            }
        };
        let result = run_blocking(file, &mut op);
        if let Ok(mut d) = sh.done.lock() {
            d.push(IoDone {
                tag: op.tag,
                buf: op.buf,
                result,
            });
        }
        if let Err(e) = ev.write(1) {
            log::warn!("io completion eventfd write failed: {e}");
        }
    }
}

impl Engine for ThreadPool {
    fn submit(&mut self, op: IoOp) -> Result<(), IoOp> {
        self.pending.push(op);
        self.inflight += 1;
        Ok(())
    }

    fn commit(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        if let Ok(mut q) = self.shared.queue.lock() {
            q.ops.extend(self.pending.drain(..));
        }
        self.shared.cond.notify_all();
    }

    fn reap(&mut self, out: &mut Vec<IoDone>) {
        if let Ok(mut d) = self.shared.done.lock() {
            self.inflight -= d.len().min(self.inflight);
            out.append(&mut d);
        }
    }

    fn completion_event(&self) -> &EventFd {
        &self.event
    }

    fn inflight(&self) -> usize {
        self.inflight
    }

    fn name(&self) -> &'static str {
        "thread-pool"
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        // Take the lock so no worker misses the stop between its check and its wait.
        drop(self.shared.queue.lock());
        self.shared.cond.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// io_uring engine; zeroing runs on one auxiliary worker sharing the completion eventfd.
pub struct UringEngine {
    ring: io_uring::IoUring,
    file: Arc<File>,
    slots: Vec<Option<IoOp>>,
    free: Vec<usize>,
    aux: ThreadPool,
    event: Arc<EventFd>,
    queued: usize,
    inflight: usize,
}

impl UringEngine {
    fn new(file: Arc<File>, depth: u32) -> std::io::Result<Self> {
        let depth = depth.clamp(8, 4096).next_power_of_two();
        let ring = io_uring::IoUring::new(depth)?;
        let event = Arc::new(EventFd::new(libc::EFD_NONBLOCK)?);
        ring.submitter().register_eventfd(event.as_raw_fd())?;
        let aux = ThreadPool::new(file.clone(), 1, Some(event.clone()))?;
        let n = depth as usize;
        Ok(UringEngine {
            ring,
            file,
            slots: (0..n).map(|_| None).collect(),
            free: (0..n).rev().collect(),
            aux,
            event,
            queued: 0,
            inflight: 0,
        })
    }

    fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

impl Engine for UringEngine {
    fn submit(&mut self, mut op: IoOp) -> Result<(), IoOp> {
        use io_uring::{opcode, types};
        if matches!(op.kind, IoKind::WriteZeroes { .. }) {
            self.inflight += 1;
            return self.aux.submit(op);
        }
        let Some(slot) = self.free.pop() else {
            return Err(op);
        };
        let fd = types::Fd(self.fd());
        let len = op.len as u32;
        let entry = match op.kind {
            IoKind::Read => opcode::Read::new(fd, op.buf.as_mut_slice().as_mut_ptr(), len)
                .offset(op.offset)
                .build(),
            IoKind::Write { dsync } => opcode::Write::new(fd, op.buf.as_slice().as_ptr(), len)
                .offset(op.offset)
                .rw_flags(if dsync { libc::RWF_DSYNC } else { 0 })
                .build(),
            IoKind::Flush | IoKind::WriteZeroes { .. } => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
        }
        .user_data(slot as u64);
        // SAFETY: the buffer the entry points to is owned by `op`, which stays in `slots`
        // (heap allocation does not move) until the completion for this slot is reaped.
        let pushed = unsafe { self.ring.submission().push(&entry) };
        if pushed.is_err() {
            self.free.push(slot);
            return Err(op);
        }
        self.slots[slot] = Some(op);
        self.queued += 1;
        self.inflight += 1;
        Ok(())
    }

    fn commit(&mut self) {
        self.aux.commit();
        if self.queued > 0 {
            match self.ring.submit() {
                Ok(_) => self.queued = 0,
                Err(e) => log::warn!("io_uring submit failed: {e}"),
            }
        }
    }

    fn reap(&mut self, out: &mut Vec<IoDone>) {
        let before = out.len();
        self.aux.reap(out);
        let mut cqes = Vec::new();
        for c in self.ring.completion() {
            cqes.push((c.user_data() as usize, c.result()));
        }
        for (slot, res) in cqes {
            let Some(mut op) = self.slots.get_mut(slot).and_then(Option::take) else {
                log::warn!("io_uring completion for unknown slot {slot}");
                continue;
            };
            self.free.push(slot);
            let result = if res < 0 {
                Err(-res)
            } else {
                let n = res as usize;
                match op.kind {
                    IoKind::Read if n < op.len => {
                        // Short read: finish it synchronously (rare: EOF or signal).
                        let mut rest = IoOp {
                            tag: 0,
                            kind: IoKind::Read,
                            offset: op.offset + n as u64,
                            len: op.len - n,
                            buf: AlignedBuf::new(op.len - n),
                        };
                        let r = run_blocking(&self.file, &mut rest);
                        let l = op.len;
                        op.buf.as_mut_slice()[n..l].copy_from_slice(rest.buf.as_slice());
                        r
                    }
                    IoKind::Write { dsync } if n < op.len => {
                        let l = op.len;
                        self.file
                            .write_all_at(&op.buf.as_slice()[n..l], op.offset + n as u64)
                            .map_err(|e| errno_of(&e))
                            .and_then(|_| {
                                if dsync {
                                    self.file.sync_data().map_err(|e| errno_of(&e))
                                } else {
                                    Ok(())
                                }
                            })
                    }
                    _ => Ok(()),
                }
            };
            out.push(IoDone {
                tag: op.tag,
                buf: op.buf,
                result,
            });
        }
        self.inflight -= (out.len() - before).min(self.inflight);
    }

    fn completion_event(&self) -> &EventFd {
        &self.event
    }

    fn inflight(&self) -> usize {
        self.inflight
    }

    fn name(&self) -> &'static str {
        "io_uring"
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        // Buffers of in-flight operations must outlive the kernel's use of them.
        let mut sink = Vec::new();
        let mut rounds = 0;
        while self.slots.iter().any(Option::is_some) && rounds < 10_000 {
            if let Err(e) = self.ring.submit_and_wait(1) {
                log::warn!("io_uring drain failed: {e}");
                break;
            }
            self.reap(&mut sink);
            rounds += 1;
        }
        if self.slots.iter().any(Option::is_some) {
            // Leak rather than free memory the kernel may still write.
            for s in self.slots.iter_mut() {
                if let Some(op) = s.take() {
                    std::mem::forget(op);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(kind: EngineKind) {
        let f = tempfile::tempfile().unwrap();
        f.set_len(1 << 20).unwrap();
        let mut e = create_engine(Arc::new(f), kind, 16, 2).unwrap();
        let mut buf = AlignedBuf::new(8192);
        buf.as_mut_slice().fill(0xab);
        e.submit(IoOp {
            tag: 1,
            kind: IoKind::Write { dsync: false },
            offset: 4096,
            len: 8192,
            buf,
        })
        .ok()
        .unwrap();
        e.commit();
        let mut out = Vec::new();
        for _ in 0..2000 {
            e.reap(&mut out);
            if !out.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].result, Ok(()));
        out.clear();
        for (tag, kind) in [(2, IoKind::Flush), (3, IoKind::WriteZeroes { dsync: true })] {
            e.submit(IoOp {
                tag,
                kind,
                offset: 8192,
                len: 4096,
                buf: AlignedBuf::new(0),
            })
            .ok()
            .unwrap();
        }
        e.submit(IoOp {
            tag: 4,
            kind: IoKind::Read,
            offset: 4096,
            len: 8192,
            buf: AlignedBuf::new(8192),
        })
        .ok()
        .unwrap();
        e.commit();
        // Read may race the zeroing; wait for everything, then read again.
        for _ in 0..2000 {
            e.reap(&mut out);
            if out.len() == 3 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(out.len(), 3);
        assert!(out.iter().all(|d| d.result.is_ok()));
        assert_eq!(e.inflight(), 0);
        out.clear();
        e.submit(IoOp {
            tag: 5,
            kind: IoKind::Read,
            offset: 4096,
            len: 8192,
            buf: AlignedBuf::new(8192),
        })
        .ok()
        .unwrap();
        e.commit();
        for _ in 0..2000 {
            e.reap(&mut out);
            if !out.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let d = out[0].buf.as_slice();
        assert!(d[..4096].iter().all(|&b| b == 0xab));
        assert!(d[4096..].iter().all(|&b| b == 0));
    }

    #[test]
    fn thread_pool_engine_roundtrip() {
        roundtrip(EngineKind::ThreadPool);
    }

    #[test]
    fn auto_engine_roundtrip() {
        roundtrip(EngineKind::Auto);
    }
}
