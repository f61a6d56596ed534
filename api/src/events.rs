//! The VMM's event stream: what `--event-monitor path=FILE|fd=N` writes and what
//! `GET /api/v1/vm.events` streams, as JSON lines in Cloud Hypervisor's shape:
//!
//! ```json
//! {"seq":7,"timestamp":{"secs":3,"nanos":120000},"source":"device","event":"device-removed",
//!  "properties":{"id":"nvme1","bdf":"0000:00:03.0"}}
//! ```
//!
//! `timestamp` is the time since the VMM started (as Cloud Hypervisor reports it); `seq`
//! numbers events from 1 so a client that reconnects can ask for what it missed
//! (`vm.events?since=SEQ`; the bus keeps the last [`RETAINED`] events).
//!
//! Emitting never blocks: the monitor file is written by its own thread behind a bounded
//! queue (an event that does not fit is counted and reported in the next line that does),
//! and API followers read a `tokio` broadcast channel. So a vCPU thread (DMA map on Bus
//! Master Enable) or the lender link's event thread may emit.

use std::collections::{BTreeMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use thiserror::Error;
use tokio::sync::broadcast;

/// Events kept for `vm.events?since=`.
pub const RETAINED: usize = 1024;
/// Events queued for the monitor writer before new ones are dropped (and counted).
const MONITOR_QUEUE: usize = 4096;
/// Events buffered per API follower before it lags.
const FOLLOWER_QUEUE: usize = 1024;

/// Errors setting up the event monitor.
#[derive(Debug, Error)]
pub enum EventError {
    #[error("event monitor {0:?}: expected path=FILE or fd=N")]
    BadSpec(String),
    #[error("event monitor fd {fd} is not an open file descriptor")]
    BadFd {
        fd: RawFd,
        #[source]
        source: io::Error,
    },
    #[error("cannot open event monitor file {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot start the event monitor thread")]
    Spawn(#[source] io::Error),
}

/// Where `--event-monitor` writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MonitorTarget {
    /// Appended to (created with mode 0600 if absent).
    Path(PathBuf),
    /// An fd inherited from the parent (e.g. a pipe); the monitor takes ownership.
    Fd(RawFd),
}

impl FromStr for MonitorTarget {
    type Err = EventError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(p) = s.strip_prefix("path=") {
            if p.is_empty() {
                return Err(EventError::BadSpec(s.into()));
            }
            return Ok(MonitorTarget::Path(PathBuf::from(p)));
        }
        if let Some(n) = s.strip_prefix("fd=") {
            return match n.parse::<RawFd>() {
                Ok(fd) if fd >= 0 => Ok(MonitorTarget::Fd(fd)),
                _ => Err(EventError::BadSpec(s.into())),
            };
        }
        Err(EventError::BadSpec(s.into()))
    }
}

/// Time since the VMM started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventTimestamp {
    pub secs: u64,
    pub nanos: u32,
}

/// One event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmEvent {
    pub seq: u64,
    pub timestamp: EventTimestamp,
    /// `vm`, `device`, `lease`, `dma`, `iommu`, `api`, `migration`.
    pub source: String,
    /// `vm-booted`, `device-removed`, ...
    pub event: String,
    #[serde(default)]
    pub properties: BTreeMap<String, Value>,
}

struct Ring {
    next_seq: u64,
    recent: VecDeque<Arc<VmEvent>>,
    followers: Option<broadcast::Sender<Arc<VmEvent>>>,
}

struct Monitor {
    tx: Option<SyncSender<Arc<VmEvent>>>,
    thread: Option<JoinHandle<()>>,
}

/// The event bus of one VMM. Shared (`Arc`) by the controller, the device models and the API
/// server.
pub struct EventBus {
    start: Instant,
    ring: Mutex<Ring>,
    monitor: Mutex<Monitor>,
    dropped: Arc<AtomicU64>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A subscription: the retained events after `since`, then live ones.
pub struct Subscription {
    pub backlog: Vec<Arc<VmEvent>>,
    /// `None` when the bus is already closed.
    pub live: Option<broadcast::Receiver<Arc<VmEvent>>>,
}

impl EventBus {
    /// A bus without a monitor file (events are only kept and streamed).
    pub fn new() -> Arc<Self> {
        let (tx, _) = broadcast::channel(FOLLOWER_QUEUE);
        Arc::new(EventBus {
            start: Instant::now(),
            ring: Mutex::new(Ring {
                next_seq: 1,
                recent: VecDeque::with_capacity(RETAINED),
                followers: Some(tx),
            }),
            monitor: Mutex::new(Monitor {
                tx: None,
                thread: None,
            }),
            dropped: Arc::new(AtomicU64::new(0)),
        })
    }

    /// A bus that also writes every event to `target`.
    pub fn with_monitor(target: &MonitorTarget) -> Result<Arc<Self>, EventError> {
        let file = match target {
            MonitorTarget::Path(p) => {
                use std::os::unix::fs::OpenOptionsExt;
                OpenOptions::new()
                    .create(true)
                    .append(true)
                    .mode(0o600)
                    .open(p)
                    .map_err(|source| EventError::Open {
                        path: p.clone(),
                        source,
                    })?
            }
            MonitorTarget::Fd(fd) => {
                // SAFETY: F_GETFD only queries the descriptor table; an invalid fd is EBADF.
                if unsafe { libc::fcntl(*fd, libc::F_GETFD) } < 0 {
                    return Err(EventError::BadFd {
                        fd: *fd,
                        source: io::Error::last_os_error(),
                    });
                }
                // SAFETY: the fd is open (checked above) and the user handed it to this
                // process for the monitor alone, so the File becomes its only owner.
                unsafe { File::from_raw_fd(*fd) }
            }
        };
        let bus = EventBus::new();
        let (tx, rx) = sync_channel::<Arc<VmEvent>>(MONITOR_QUEUE);
        let dropped = bus.dropped.clone();
        let thread = std::thread::Builder::new()
            .name("event-monitor".into())
            .spawn(move || write_monitor(file, rx, &dropped))
            .map_err(EventError::Spawn)?;
        *lock(&bus.monitor) = Monitor {
            tx: Some(tx),
            thread: Some(thread),
        };
        Ok(bus)
    }

    /// Records and publishes one event. Never blocks on a slow reader.
    pub fn emit<I, K>(&self, source: &str, event: &str, properties: I) -> u64
    where
        I: IntoIterator<Item = (K, Value)>,
        K: Into<String>,
    {
        let elapsed = self.start.elapsed();
        let properties = properties.into_iter().map(|(k, v)| (k.into(), v)).collect();
        let mut ring = lock(&self.ring);
        let seq = ring.next_seq;
        ring.next_seq += 1;
        let ev = Arc::new(VmEvent {
            seq,
            timestamp: EventTimestamp {
                secs: elapsed.as_secs(),
                nanos: elapsed.subsec_nanos(),
            },
            source: source.into(),
            event: event.into(),
            properties,
        });
        if ring.recent.len() == RETAINED {
            ring.recent.pop_front();
        }
        ring.recent.push_back(ev.clone());
        if let Some(f) = &ring.followers {
            // No receiver is not an error: nobody follows the stream right now.
            let _ = f.send(ev.clone());
        }
        // Under the ring lock, so the monitor file has the events in `seq` order.
        if let Some(tx) = &lock(&self.monitor).tx {
            match tx.try_send(ev.clone()) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        drop(ring);
        log::debug!("event {seq}: {source} {event}");
        seq
    }

    /// Retained events with `seq > since` (all retained ones for `since = 0`) plus a
    /// receiver for the ones emitted afterwards, taken atomically so none falls in between.
    pub fn subscribe(&self, since: Option<u64>) -> Subscription {
        let ring = lock(&self.ring);
        let backlog = match since {
            Some(s) => ring.recent.iter().filter(|e| e.seq > s).cloned().collect(),
            None => Vec::new(),
        };
        Subscription {
            backlog,
            live: ring.followers.as_ref().map(|f| f.subscribe()),
        }
    }

    /// Every retained event (tests, `vm.events` without following).
    pub fn recent(&self) -> Vec<Arc<VmEvent>> {
        lock(&self.ring).recent.iter().cloned().collect()
    }

    /// Ends every follower's stream and writes out what the monitor has queued. Later emits
    /// are still retained but nobody follows them. Idempotent.
    pub fn close(&self) {
        lock(&self.ring).followers = None;
        let mut m = lock(&self.monitor);
        m.tx = None;
        if let Some(t) = m.thread.take() {
            drop(m);
            if t.join().is_err() {
                log::error!("event monitor thread panicked");
            }
        }
    }
}

impl std::fmt::Debug for EventBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventBus")
            .field("next_seq", &lock(&self.ring).next_seq)
            .finish_non_exhaustive()
    }
}

impl Drop for EventBus {
    fn drop(&mut self) {
        self.close();
    }
}

fn write_monitor(file: File, rx: std::sync::mpsc::Receiver<Arc<VmEvent>>, dropped: &AtomicU64) {
    let mut out = io::BufWriter::new(file);
    let mut reported = 0;
    while let Ok(ev) = rx.recv() {
        let lost = dropped.load(Ordering::Relaxed);
        let line = if lost != reported {
            // Say how many lines a full queue cost, in the next line that is written.
            let mut ev = (*ev).clone();
            ev.properties
                .insert("monitor_dropped".into(), Value::from(lost));
            reported = lost;
            serde_json::to_string(&ev)
        } else {
            serde_json::to_string(&*ev)
        };
        let res = match line {
            Ok(l) => writeln!(out, "{l}").and_then(|()| out.flush()),
            Err(e) => {
                log::warn!("event monitor: cannot encode event {}: {e}", ev.seq);
                Ok(())
            }
        };
        if let Err(e) = res {
            log::error!("event monitor: write failed, no more events are written: {e}");
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn spec_parses() {
        assert_eq!(
            "path=/tmp/x".parse::<MonitorTarget>().unwrap(),
            MonitorTarget::Path("/tmp/x".into())
        );
        assert_eq!(
            "fd=3".parse::<MonitorTarget>().unwrap(),
            MonitorTarget::Fd(3)
        );
        for bad in ["", "path=", "fd=-1", "fd=x", "file=/x"] {
            let e = bad.parse::<MonitorTarget>().unwrap_err();
            assert!(e.to_string().contains("path=FILE or fd=N"), "{bad}: {e}");
        }
    }

    #[test]
    fn bad_fd_is_refused() {
        let e = EventBus::with_monitor(&MonitorTarget::Fd(987_654))
            .err()
            .unwrap();
        assert!(e.to_string().contains("987654"), "{e}");
    }

    #[test]
    fn monitor_file_gets_json_lines_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let bus = EventBus::with_monitor(&MonitorTarget::Path(path.clone())).unwrap();
        bus.emit("vm", "vm-booted", [("cpus", Value::from(2))]);
        bus.emit("device", "device-added", [("id", Value::from("nvme0"))]);
        bus.close();
        let text = std::fs::read_to_string(&path).unwrap();
        let evs: Vec<VmEvent> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(evs.len(), 2);
        assert_eq!(evs[0].event, "vm-booted");
        assert_eq!(evs[0].seq, 1);
        assert_eq!(evs[0].properties["cpus"], 2);
        assert_eq!(evs[1].event, "device-added");
        assert_eq!(evs[1].seq, 2);
        let mode = std::fs::metadata(&path).unwrap().permissions();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(mode.mode() & 0o777, 0o600);
    }

    #[test]
    fn monitor_fd_takes_an_inherited_pipe() {
        use std::io::Read;
        use std::os::fd::IntoRawFd;
        let (mut rx, tx) = std::io::pipe().unwrap();
        let fd = tx.into_raw_fd();
        let bus = EventBus::with_monitor(&MonitorTarget::Fd(fd)).unwrap();
        bus.emit("vm", "vm-paused", Vec::<(String, Value)>::new());
        // Closing the bus closes the write end, so the read ends.
        bus.close();
        drop(bus);
        let mut text = String::new();
        rx.read_to_string(&mut text).unwrap();
        let ev: VmEvent = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(ev.event, "vm-paused");
    }

    #[test]
    fn subscribe_replays_after_since_then_follows() {
        let bus = EventBus::new();
        for i in 0..3 {
            bus.emit("vm", "e", [("i", Value::from(i))]);
        }
        let mut sub = bus.subscribe(Some(1));
        assert_eq!(
            sub.backlog.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [2, 3]
        );
        bus.emit("vm", "later", Vec::<(String, Value)>::new());
        let live = sub.live.as_mut().unwrap();
        assert_eq!(live.try_recv().unwrap().event, "later");
        bus.close();
        assert!(matches!(
            live.try_recv(),
            Err(broadcast::error::TryRecvError::Closed)
        ));
        assert!(bus.subscribe(None).live.is_none());
    }

    #[test]
    fn ring_keeps_the_last_events() {
        let bus = EventBus::new();
        for _ in 0..RETAINED + 5 {
            bus.emit("vm", "e", Vec::<(String, Value)>::new());
        }
        let r = bus.recent();
        assert_eq!(r.len(), RETAINED);
        assert_eq!(r[0].seq, 6);
    }
}
