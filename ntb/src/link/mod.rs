//! The link core shared by the shm and tcp backends: framing over a stream socket, the
//! handshake ([`crate::accept`] runs it off the accepting thread), request/reply routing
//! ([`sink`]: window-read replies straight into the reader's buffer),
//! heartbeats and peer-gone detection, window tables, doorbells and scratchpads.
//!
//! By concern: [`stream`] (sockets and framing), [`handshake`], [`state`] (the shared state,
//! the reader and service threads), [`window`] (exports and peer windows), [`staging`] (the
//! staging ring of a mediated window's writes on shm), [`endpoint`] (the [`Endpoint`]
//! implementation).
//!
//! Each link runs two threads: a reader (never blocks on writes; it answers fabric-internal
//! requests through the service thread) and a service thread (sends those replies, copying a
//! window read's bytes into its one reused buffer as it sends them, and the heartbeats).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{self, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::fabric::{
    stage_raw, BackingId, ControlPath, Endpoint, ExportedWindow, FabricError, FabricKind, Incoming,
    LinkConfig, LinkStats, Message, NodeId, PeerWindow, RequestId, Result, WindowId, WindowInfo,
    WindowLimits,
};
use crate::mem::{fd_has_fixed_extent, fd_seals, fd_size, Mapping, SharedMemory};
use crate::region::Region;
use crate::tls::stream::TlsStream;
use crate::wire::{
    self, code, msg, op, ErrorReply, Header, FLAG_ERROR, FLAG_REPLY, HEADER_LEN, MAX_FDS, VERSION,
};

/// Bound on one window read/write message round trip.
pub(crate) const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest window label.
pub const MAX_LABEL: usize = 256;
/// Most received messages (requests, events, window notices) waiting for the user.
pub(crate) const MAX_INCOMING: usize = 4096;
/// Most payload bytes of those messages (4096 messages of up to ~1 MiB would be 4 GiB): 32
/// maximal messages. A message is always taken when nothing waits, whatever its size.
pub(crate) const MAX_INCOMING_BYTES: usize = 32 * wire::MAX_PAYLOAD;

/// What a waiting message counts against [`MAX_INCOMING_BYTES`].
fn incoming_bytes(i: &Incoming) -> usize {
    match i {
        Incoming::Request { msg, .. } | Incoming::Event(msg) => msg.payload.len(),
        Incoming::WindowAdded(w) => w.label.len(),
        Incoming::WindowRemoved(_) => 0,
    }
}

/// Lets a log line through at most once per `every`; counts the ones held back. Public so the
/// lender's own peer-triggerable logs (config filter) use the same pattern.
#[derive(Debug)]
pub struct RateLimit {
    every: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl RateLimit {
    pub fn new(every: Duration) -> RateLimit {
        RateLimit {
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(held back since the last line)` when a line may be logged now.
    pub fn hit(&self) -> Option<u64> {
        let now = Instant::now();
        let mut st = lock(&self.state);
        match st.0 {
            Some(t) if now.duration_since(t) < self.every => {
                st.1 += 1;
                None
            }
            _ => {
                st.0 = Some(now);
                Some(std::mem::take(&mut st.1))
            }
        }
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

mod endpoint;
mod handshake;
mod sink;
mod staging;
mod state;
mod stream;
mod window;

pub(crate) use endpoint::*;
pub(crate) use handshake::*;
use sink::*;
use staging::*;
pub(crate) use state::*;
pub(crate) use stream::*;
use window::*;
