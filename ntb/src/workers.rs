//! Threads that outlive their task and take the next one.
//!
//! Every link starts a reader and a service thread on each end, the listener a handshake
//! thread per connection, and a new lender session adds its own; a hot-add that opens a
//! session starts about eight threads and the removal before it ended as many. On this
//! project's hosts (KVM guests, PVM), a thread's start and end (`clone3`, its stack's `mmap`
//! and `munmap`, the TLB shootdowns) were about a fifth of a link set-up's CPU time
//! (docs/BENCHMARKS.md, fabric section). [`spawn`] runs a task on a parked thread when one
//! is idle and starts a thread only when none is; a thread parks for [`IDLE`] after its
//! task and then ends, so a quiet process keeps no threads, and at most [`MAX_IDLE`] park.

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// How long a thread waits for its next task before it ends.
pub const IDLE: Duration = Duration::from_secs(10);
/// Most threads parked at once; a thread finding the park full ends.
pub const MAX_IDLE: usize = 32;

type Task = Box<dyn FnOnce() + Send>;

/// Parked threads: an id and the channel that hands it a task.
static PARK: Mutex<Vec<(u64, mpsc::Sender<Job>)>> = Mutex::new(Vec::new());
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

struct Job {
    name: String,
    task: Task,
    done: Arc<Done>,
}

/// Where a task is: running (`None`), returned (`Some(true)`) or ended by a panic.
#[derive(Default)]
struct Done {
    finished: Mutex<Option<bool>>,
    cond: Condvar,
}

/// [`Worker::join`] of a task that panicked.
#[derive(Debug, PartialEq, Eq)]
pub struct Panicked;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A task started by [`spawn`]; `join` waits for it (not for its thread, which may go on).
#[must_use = "a task's handle is how its end is awaited"]
pub struct Worker {
    done: Arc<Done>,
}

impl Worker {
    /// Waits until the task has returned, or panicked (its thread then ended).
    pub fn join(self) -> Result<(), Panicked> {
        let mut f = lock(&self.done.finished);
        loop {
            match *f {
                Some(true) => return Ok(()),
                Some(false) => return Err(Panicked),
                None => f = self.done.cond.wait(f).unwrap_or_else(|e| e.into_inner()),
            }
        }
    }

    /// Whether the task has returned (or panicked).
    pub fn is_finished(&self) -> bool {
        lock(&self.done.finished).is_some()
    }
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("finished", &self.is_finished())
            .finish()
    }
}

/// Marks the task finished when dropped: after it returns, and while a panic unwinds.
struct FinishOnDrop(Arc<Done>);

impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        *lock(&self.0.finished) = Some(!std::thread::panicking());
        self.0.cond.notify_all();
    }
}

/// Runs `task` on a parked thread, or on a new one named `name` (as `/proc` and `ps` show
/// it: at most 15 bytes are kept) when none is parked.
pub fn spawn(
    name: impl Into<String>,
    task: impl FnOnce() + Send + 'static,
) -> std::io::Result<Worker> {
    let done = Arc::new(Done::default());
    let mut job = Job {
        name: name.into(),
        task: Box::new(task),
        done: Arc::clone(&done),
    };
    {
        // Sent under the park's lock: a thread that timed out checks the park under the same
        // lock before it ends, so a task handed to it is never lost (`park`).
        let mut park = lock(&PARK);
        while let Some((_, tx)) = park.pop() {
            match tx.send(job) {
                Ok(()) => return Ok(Worker { done }),
                Err(mpsc::SendError(j)) => job = j,
            }
        }
    }
    let name = job.name.clone();
    std::thread::Builder::new()
        .name(name)
        .spawn(move || run(job))?;
    Ok(Worker { done })
}

/// A thread's life: its first task, then each one handed to it while parked.
fn run(first: Job) {
    let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (tx, rx) = mpsc::channel::<Job>();
    let mut job = first;
    let mut renamed = false;
    loop {
        if renamed {
            set_name(&job.name);
        }
        let finish = FinishOnDrop(job.done);
        (job.task)();
        drop(finish);
        renamed = true;
        match park(id, &tx, &rx) {
            Some(next) => job = next,
            None => return,
        }
    }
}

/// Parks the thread until a task comes; `None` when it should end (idle for [`IDLE`], or the
/// park is full).
fn park(id: u64, tx: &mpsc::Sender<Job>, rx: &mpsc::Receiver<Job>) -> Option<Job> {
    {
        let mut p = lock(&PARK);
        if p.len() >= MAX_IDLE {
            return None;
        }
        p.push((id, tx.clone()));
    }
    loop {
        match rx.recv_timeout(IDLE) {
            Ok(job) => return Some(job),
            Err(mpsc::RecvTimeoutError::Disconnected) => return None,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let mut p = lock(&PARK);
                if let Some(i) = p.iter().position(|(pid, _)| *pid == id) {
                    p.remove(i);
                    return None;
                }
                // Taken from the park: its task was sent under the lock just held, so it is
                // in the channel already.
            }
        }
    }
}

/// The calling thread's name as the kernel shows it (`comm`, 15 bytes at most).
fn set_name(name: &str) {
    let mut buf = [0u8; 16];
    let n = name.len().min(15);
    buf[..n].copy_from_slice(&name.as_bytes()[..n]);
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes from the pointer;
    // `buf` is 16 bytes with at least one trailing NUL and outlives the call.
    unsafe { libc::prctl(libc::PR_SET_NAME, buf.as_ptr() as libc::c_ulong, 0, 0, 0) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn comm() -> String {
        std::fs::read_to_string("/proc/thread-self/comm")
            .unwrap()
            .trim()
            .to_string()
    }

    #[test]
    fn a_finished_task_leaves_its_thread_for_the_next_one_under_the_new_name() {
        let (tx, rx) = mpsc::channel();
        let t = tx.clone();
        spawn("wk-first", move || {
            t.send((std::thread::current().id(), comm())).unwrap()
        })
        .unwrap()
        .join()
        .unwrap();
        let (first, name1) = rx.recv().unwrap();
        assert_eq!(name1, "wk-first");
        // Tests run in parallel and share the park: ask until our thread is the one reused
        // (bounded), each on a name of its own.
        let mut reused = false;
        for i in 0..200 {
            let t = tx.clone();
            let name = format!("wk-next-{i}");
            spawn(name.clone(), move || {
                t.send((std::thread::current().id(), comm())).unwrap()
            })
            .unwrap()
            .join()
            .unwrap();
            let (id, n) = rx.recv().unwrap();
            assert_eq!(n, name, "every task runs under its own name");
            if id == first {
                reused = true;
                break;
            }
        }
        assert!(reused, "the parked thread was never reused");
    }

    #[test]
    fn join_waits_for_the_task_and_a_panicking_task_still_finishes() {
        let hits = Arc::new(AtomicUsize::new(0));
        let h = Arc::clone(&hits);
        let w = spawn("wk-slow", move || {
            std::thread::sleep(Duration::from_millis(50));
            h.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        w.join().unwrap();
        assert_eq!(
            hits.load(Ordering::SeqCst),
            1,
            "join returned before the task did"
        );
        let w = spawn("wk-panic", || panic!("a task that panics")).unwrap();
        assert_eq!(w.join(), Err(Panicked));
        // The pool still runs tasks after a panic took one of its threads.
        let h = Arc::clone(&hits);
        spawn("wk-after", move || {
            h.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap()
        .join()
        .unwrap();
        assert_eq!(hits.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn many_tasks_at_once_each_run_once() {
        let hits = Arc::new(AtomicUsize::new(0));
        let workers: Vec<Worker> = (0..64)
            .map(|i| {
                let h = Arc::clone(&hits);
                spawn(format!("wk-many-{i}"), move || {
                    std::thread::sleep(Duration::from_millis(5));
                    h.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap()
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        assert_eq!(hits.load(Ordering::SeqCst), 64);
        assert!(lock(&PARK).len() <= MAX_IDLE, "the park is bounded");
    }
}
