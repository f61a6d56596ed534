//! The ring pump: one thread per ring link that moves the link's plaintext bytes between its
//! end of a Unix socket pair and the control rings in the shared region, as the TLS pump
//! ([`crate::tls`]) does between that socket and TLS records.
//!
//! Waiting: after any traffic the pump polls the rx ring with short naps (a reply, or the next
//! trapped access, usually follows within milliseconds); once quiet for [`Tuning::hot`] it
//! marks its consumer asleep in the ring header and blocks on the TLS socket, and the peer's
//! producer sends a one-byte kick there when it finds the mark. A kick is the only
//! application data on TLS after the set-up; anything else is a broken peer. The TCP
//! connection stays open for the kicks and as the link's liveness: when it ends, the pump
//! hands the link every byte already in the rx ring and closes.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rustls::Connection;

use super::queue::{RingError, Rings, CAP};
use super::{SlotLease, RING_VIOLATIONS};

/// The one byte a kick carries.
pub(crate) const KICK: u8 = b'K';
/// How long a closing pump waits for the peer to take what it wrote last (its GOODBYE).
const LINGER: Duration = Duration::from_secs(1);
/// The longest a pump blocks on the socket before it looks at the ring again, asleep or not
/// (a kick is never needed for correctness after this: it bounds a lost wake-up's cost).
const IDLE_WAIT: Duration = Duration::from_millis(500);

/// How eagerly a pump polls.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tuning {
    /// How long after the last traffic the pump keeps polling before it sleeps.
    pub(crate) hot: Duration,
    /// First and longest nap between polls while hot (doubling in between).
    pub(crate) nap_min: Duration,
    pub(crate) nap_max: Duration,
}

impl Tuning {
    /// The lender's side: hot for 20 ms after traffic (the borrower's next trapped access
    /// usually follows a reply within that), naps of 200 µs growing to 2 ms. On an emulated
    /// lender (L1 here) each wake-up costs milliseconds of its one vCPU: with naps from
    /// 50 µs and three system calls per nap the pump took 40% of L1 while a lent e1000e
    /// was probed (`L1-CPU` samples, docs/VFIO.md), more than the thread doing the device's
    /// accesses. A quiet link costs one wake-up per [`IDLE_WAIT`].
    pub(crate) const LENDER: Tuning = Tuning {
        hot: Duration::from_millis(20),
        nap_min: Duration::from_micros(200),
        nap_max: Duration::from_millis(2),
    };
    /// The borrower's side: a reply comes after the lender's work, which takes longer than
    /// a lender waits for the next request (a DMA map, a reset, an emulated lender's every
    /// answer), and a kick back would cost a TCP round trip: hot for 250 ms, naps of 20 µs
    /// growing to 1 ms (about a thousand cheap wake-ups a second while busy, on a host core).
    /// Heartbeats count as traffic: with the default 250 ms heartbeat a borrower's pump
    /// stays hot for as long as its link is up.
    pub(crate) const BORROWER: Tuning = Tuning {
        hot: Duration::from_millis(250),
        nap_min: Duration::from_micros(20),
        nap_max: Duration::from_millis(1),
    };
}

/// Tests: pumps whose TCP connection's local address is this one (a test's listener: its
/// lender side) behave as on a kernel with coarse timers; tests running beside keep theirs.
#[cfg(test)]
pub(crate) static COARSE_LOCAL: std::sync::Mutex<Option<std::net::SocketAddr>> =
    std::sync::Mutex::new(None);
/// Tests: kicks taken by pumps that waited for kicks because their timers are coarse.
#[cfg(test)]
pub(crate) static COARSE_KICKS_TAKEN: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);

/// Whether this kernel's timers are coarser than a pump's naps: `clock_getres` of
/// `CLOCK_MONOTONIC` says the tick (10 ms at HZ=100) where high-resolution timers are off,
/// and a 200 µs `ppoll` then sleeps until the next tick. L1's kernel here is such a kernel:
/// under TCG a status request's round trip through the rings took 10 ms against 2-4 ms on
/// TCP (docs/BENCHMARKS.md, section l1), every message waiting for the lender's next tick.
/// A pump on such a kernel does not nap: whenever it has nothing to move it marks itself
/// asleep, so that the peer kicks it, and blocks until the kick, its link or the end.
fn coarse_timers(_tcp: &TcpStream) -> bool {
    #[cfg(test)]
    if let (Ok(forced), Ok(local)) = (COARSE_LOCAL.lock(), _tcp.local_addr()) {
        if *forced == Some(local) {
            return true;
        }
    }
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid, writable timespec that lives for the call.
    let r = unsafe { libc::clock_getres(libc::CLOCK_MONOTONIC, &mut ts) };
    r == 0 && (ts.tv_sec > 0 || ts.tv_nsec >= 1_000_000)
}

/// What the pump owns.
pub(crate) struct Pump {
    pub(crate) conn: Connection,
    pub(crate) tcp: TcpStream,
    pub(crate) local: UnixStream,
    pub(crate) rings: Rings,
    /// The lender's slot, freed when the pump ends (`None` on the borrower).
    /// Held for its `Drop`: the slot goes back when the pump ends.
    pub(crate) _slot: Option<SlotLease>,
    pub(crate) tuning: Tuning,
    pub(crate) peer: String,
    /// Whether this kernel's timers are coarse ([`coarse_timers`]): set when the pump starts.
    pub(crate) coarse: bool,
}

fn would_block(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

fn corrupt(e: RingError) -> io::Error {
    RING_VIOLATIONS.fetch_add(1, Ordering::Relaxed);
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// What a [`wait`] found ready.
#[derive(Debug, Clone, Copy)]
struct Ready {
    tcp: bool,
    local: bool,
}

/// `poll` on the socket and the link's end, for up to `timeout` (µs precision). Says which
/// of them has something (or an error or hang-up) to take, so that a nap that ends with
/// nothing costs no further system calls: on an emulated lender every call costs its one
/// vCPU a great deal, and most naps end with nothing but the ring to look at.
fn wait(
    tcp: &TcpStream,
    local: &UnixStream,
    local_ev: i16,
    timeout: Duration,
) -> io::Result<Ready> {
    let mut p = [
        libc::pollfd {
            fd: tcp.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: local.as_raw_fd(),
            events: local_ev,
            revents: 0,
        },
    ];
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: two valid pollfds and a valid timespec, all live for the call; no signal mask.
    let r = unsafe { libc::ppoll(p.as_mut_ptr(), 2, &ts, std::ptr::null()) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
        // Interrupted: look at everything, as before this optimisation.
        return Ok(Ready {
            tcp: true,
            local: true,
        });
    }
    Ok(Ready {
        tcp: p[0].revents != 0,
        local: p[1].revents != 0,
    })
}

impl Pump {
    /// Runs until either side closes or the peer breaks the ring; then closes both.
    pub(crate) fn run(mut self) {
        let r = self.pump();
        if let Err(e) = &r {
            if e.kind() == io::ErrorKind::InvalidData {
                log::warn!(
                    "control ring with {} dropped: {e} ({} ring violations in this process)",
                    self.peer,
                    RING_VIOLATIONS.load(Ordering::Relaxed)
                );
            } else {
                log::debug!("control ring with {} ended: {e}", self.peer);
            }
        }
        let _ = self.tcp.shutdown(Shutdown::Both);
        let _ = self.local.shutdown(Shutdown::Both);
        // `slot` drops with self: the lender may hand it to the next link.
    }

    /// Reads kicks (and the end) off the TLS socket; `Ok(false)` once the peer closed it.
    fn read_tcp(&mut self) -> io::Result<bool> {
        match self.conn.read_tls(&mut &self.tcp) {
            Ok(0) => return Ok(false),
            Ok(_) => {
                self.conn
                    .process_new_packets()
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            }
            Err(e) if would_block(&e) => {}
            Err(_) => return Ok(false),
        }
        let mut b = [0u8; 64];
        loop {
            match self.conn.reader().read(&mut b) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    #[cfg(test)]
                    if self.coarse {
                        COARSE_KICKS_TAKEN.fetch_add(n as u64, Ordering::Relaxed);
                    }
                    if let Some(x) = b[..n].iter().find(|&&x| x != KICK) {
                        return Err(corrupt(RingError::Corrupt(format!(
                            "byte {x:#04x} on the TLS connection, where only kicks may come"
                        ))));
                    }
                }
                Err(e) if would_block(&e) => return Ok(true),
                Err(_) => return Ok(false),
            }
        }
    }

    fn kick(&mut self) -> io::Result<()> {
        self.conn.writer().write_all(&[KICK])?;
        self.flush_tls()
    }

    fn flush_tls(&mut self) -> io::Result<()> {
        while self.conn.wants_write() {
            match self.conn.write_tls(&mut &self.tcp) {
                Ok(_) => {}
                // A kick is one small record: if the socket buffer is full, the peer is
                // not reading it, and it is not asleep either.
                Err(e) if would_block(&e) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn pump(&mut self) -> io::Result<()> {
        self.tcp.set_nonblocking(true)?;
        self.local.set_nonblocking(true)?;
        // Bytes from the link not yet in the tx ring: at most one read, never more (the link
        // blocks in its own socket when the ring is full: back-pressure, no queue here).
        let mut out = vec![0u8; CAP];
        let (mut out_start, mut out_end) = (0usize, 0usize);
        // Bytes from the rx ring not yet taken by the link: at most one ring's worth.
        let mut inb = vec![0u8; CAP];
        let (mut in_start, mut in_end) = (0usize, 0usize);
        let mut local_eof = false;
        // Whether the link's end may have bytes for us: a read is tried only then (it is
        // cleared by a read that would block, set by poll).
        let mut local_readable = true;
        let mut tcp_open = true;
        let mut last = Instant::now();
        let mut nap = self.tuning.nap_min;
        let coarse = coarse_timers(&self.tcp);
        self.coarse = coarse;
        if coarse {
            log::info!(
                "control ring with {}: this kernel's timers are coarse (no high-resolution \
                 timers): the pump waits for kicks instead of napping",
                self.peer
            );
        }
        loop {
            let mut moved = false;
            if out_start == out_end && !local_eof && local_readable {
                match (&self.local).read(&mut out) {
                    Ok(0) => local_eof = true,
                    Ok(n) => (out_start, out_end) = (0, n),
                    Err(e) if would_block(&e) => local_readable = false,
                    Err(_) => local_eof = true,
                }
            }
            if out_start < out_end {
                let n = self.rings.push(&out[out_start..out_end]).map_err(corrupt)?;
                if n > 0 {
                    out_start += n;
                    moved = true;
                    if self.rings.take_peer_sleeping() && tcp_open {
                        self.kick()?;
                    }
                }
            }
            if in_start == in_end {
                let n = self.rings.pop(&mut inb).map_err(corrupt)?;
                if n > 0 {
                    (in_start, in_end) = (0, n);
                    moved = true;
                }
            }
            if in_start < in_end {
                match (&self.local).write(&inb[in_start..in_end]) {
                    Ok(n) => in_start += n,
                    Err(e) if would_block(&e) => {}
                    // The link stopped reading (it is closing): drop what it would have read.
                    Err(_) => in_start = in_end,
                }
            }
            if !tcp_open || local_eof {
                return self.finish(local_eof, &out[out_start..out_end], &inb[in_start..in_end]);
            }
            if moved {
                // Busy: look at the link's end again too, or its bytes would wait behind a
                // stream of the peer's until a nap.
                local_readable = true;
                last = Instant::now();
                nap = self.tuning.nap_min;
                continue;
            }
            // Nothing moved: wait for the link, the peer's bytes, a kick or the end.
            let quiet = out_start == out_end && in_start == in_end;
            let asleep = quiet && (coarse || last.elapsed() >= self.tuning.hot);
            if asleep {
                self.rings.set_sleeping(true);
                if self.rings.rx_pending().map_err(corrupt)? > 0 {
                    self.rings.set_sleeping(false);
                    continue;
                }
            }
            let mut local_ev = 0;
            if out_start == out_end {
                local_ev |= libc::POLLIN;
            }
            if in_start < in_end {
                local_ev |= libc::POLLOUT;
            }
            let timeout = if asleep { IDLE_WAIT } else { nap };
            let ready = wait(&self.tcp, &self.local, local_ev, timeout)?;
            if asleep {
                self.rings.set_sleeping(false);
            } else {
                nap = (nap * 2).min(self.tuning.nap_max);
            }
            if ready.local {
                local_readable = true;
            }
            if ready.tcp {
                tcp_open = self.read_tcp()?;
            }
            self.flush_tls()?;
        }
    }

    /// The end: when the peer closed, hands the link what the rx ring still holds; when the
    /// link closed, lets the peer take what it wrote last (bounded), then says goodbye.
    fn finish(&mut self, local_eof: bool, mut out: &[u8], inb: &[u8]) -> io::Result<()> {
        let until = Instant::now() + LINGER;
        let mut buf = vec![0u8; CAP];
        self.local.set_nonblocking(false)?;
        self.local.set_write_timeout(Some(LINGER))?;
        if !local_eof {
            // The peer closed: everything it wrote before is in the ring already.
            let _ = (&self.local).write_all(inb);
            loop {
                let n = self.rings.pop(&mut buf).map_err(corrupt)?;
                if n == 0 || (&self.local).write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            return Ok(());
        }
        // The link closed: its last bytes (the fabric's GOODBYE) into the ring, then wait
        // until the peer took them before the TCP end can overtake them.
        while Instant::now() < until {
            if !out.is_empty() {
                let n = self.rings.push(out).map_err(corrupt)?;
                out = &out[n..];
                if n > 0 && self.rings.take_peer_sleeping() {
                    self.kick()?;
                }
            }
            if out.is_empty() && self.rings.tx_unread() == 0 {
                break;
            }
            std::thread::sleep(self.tuning.nap_max);
            self.rings.refresh_tx().map_err(corrupt)?;
        }
        self.conn.send_close_notify();
        self.tcp.set_nonblocking(false)?;
        self.tcp
            .set_write_timeout(Some(Duration::from_millis(200)))?;
        while self.conn.wants_write() {
            if self.conn.write_tls(&mut &self.tcp).is_err() {
                break;
            }
        }
        let _ = self.tcp.shutdown(Shutdown::Write);
        Ok(())
    }
}
