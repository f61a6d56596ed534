//! The bar fabric's control path through the shared region, as Linux's `ntb_transport` puts
//! its queues in an NTB memory window.
//!
//! A `bar` link still starts on TCP: TLS 1.3, whose exporter binds the cluster token's proofs
//! to the session ([`crate::tls`]). Then, before the fabric hello, the two ends agree on the
//! control path inside TLS ([`negotiate`]):
//!
//! 1. the connecting side (the borrower) asks for a ring, or for tcp when its cluster file says
//!    `control_path = "tcp"`;
//! 2. the accepting side (the lender) takes a free slot of its region's ring area (the last
//!    [`RegionSpec::ring_area`](crate::RegionSpec::ring_area) bytes), sets it up with a fresh
//!    nonce and answers with the slot and the nonce, or answers tcp (its own `control_path`
//!    is tcp, or every slot is taken: then this link's control stays on TLS, logged);
//! 3. the borrower maps that slot of its own view of the region and checks the magic and the
//!    nonce: that proves both ends map the same memory (a `region` that is not the file
//!    behind the lender's BAR fails here, with that said, not later with lost messages).
//!
//! From then on every fabric frame of the link (requests, replies, doorbells, interrupts,
//! heartbeats, the hello and the authentication above the fabric) goes through the rings
//! ([`queue`]), moved by a pump thread per link ([`pump`]); TCP carries only one-byte kicks
//! that wake a sleeping consumer, and its end is the link's end. Framing and authentication
//! are those of [`crate::link`] unchanged: the pump gives the link a byte stream, as the TLS
//! pump does.
//!
//! Trust: the rings are plain memory of the region, like the windows beside them. Whoever can
//! write the region (every host on that NTB, and every borrower whose guest RAM is in it) can
//! write them; the region is one trust domain (docs/SECURITY.md). The pump checks every index
//! the peer writes and drops the link on nonsense ([`RingError::Corrupt`], counted in
//! [`violations`]), so a broken or hostile peer costs its own link, never the process.

mod pump;
mod queue;

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use rustls::Connection;

use crate::fabric::{ControlPath, FabricError, Result};
use crate::link::lock;
use crate::mem::Mapping;
use crate::region::{Region, RING_SLOT_SIZE};

pub(crate) use pump::Tuning;
pub use queue::RingError;
use queue::{Rings, NONCE_LEN};

/// Control rings this process dropped because the peer broke them (metrics).
pub(crate) static RING_VIOLATIONS: AtomicU64 = AtomicU64::new(0);

/// Control rings this process has dropped because the peer wrote what no correct peer
/// writes (an index out of bounds, data where only kicks may come).
pub fn violations() -> u64 {
    RING_VIOLATIONS.load(Ordering::Relaxed)
}

/// The borrower's request: magic, version, what it wants (1 ring, 0 tcp), reserved.
const REQ_MAGIC: [u8; 4] = *b"LVRQ";
const REQ_LEN: usize = 16;
/// The lender's answer: magic, status, slot, reserved, offset, size, nonce.
const REPLY_MAGIC: [u8; 4] = *b"LVRA";
const REPLY_LEN: usize = 48;
const VERSION: u32 = 1;
const STATUS_RING: u32 = 0;
const STATUS_TCP_CHOSEN: u32 = 1;
const STATUS_TCP_NO_SLOT: u32 = 2;

/// Ring slots in use (`true`), per region (by its file's `st_dev`, `st_ino`).
type SlotTable = HashMap<(u64, u64), Vec<bool>>;

/// The lender's slot allocator: one per process, since every listener of one region shares
/// its ring area.
fn slots() -> &'static Mutex<SlotTable> {
    static SLOTS: OnceLock<Mutex<SlotTable>> = OnceLock::new();
    SLOTS.get_or_init(Mutex::default)
}

/// A lender's ring slot; dropping it frees the slot for the next link.
pub(crate) struct SlotLease {
    key: (u64, u64),
    slot: u32,
}

impl SlotLease {
    fn take(region: &Region) -> Result<Option<SlotLease>> {
        let key = crate::mem::fd_file_id(region.as_fd())?;
        let mut all = lock(slots());
        let used = all
            .entry(key)
            .or_insert_with(|| vec![false; region.ring_slots() as usize]);
        used.resize(region.ring_slots() as usize, false);
        Ok(used.iter().position(|u| !u).map(|i| {
            used[i] = true;
            SlotLease {
                key,
                slot: i as u32,
            }
        }))
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        if let Some(s) = lock(slots())
            .get_mut(&self.key)
            .and_then(|v| v.get_mut(self.slot as usize))
        {
            *s = false;
        }
    }
}

/// A link's agreed rings, before its pump starts.
pub(crate) struct RingLink {
    rings: Rings,
    slot: Option<SlotLease>,
    index: u32,
    offset: u64,
}

impl RingLink {
    pub(crate) fn path(&self) -> ControlPath {
        ControlPath::Ring {
            slot: self.index,
            offset: self.offset,
        }
    }

    /// Starts the pump; returns the link's end of the byte stream and the pump thread.
    pub(crate) fn spawn(
        self,
        conn: Connection,
        tcp: TcpStream,
        peer: String,
    ) -> Result<(UnixStream, crate::workers::Worker)> {
        let (plain, local) = UnixStream::pair().map_err(FabricError::io("socketpair"))?;
        let tuning = if self.slot.is_some() {
            Tuning::LENDER
        } else {
            Tuning::BORROWER
        };
        let p = pump::Pump {
            conn,
            tcp,
            local,
            rings: self.rings,
            _slot: self.slot,
            tuning,
            peer,
            coarse: false,
        };
        let t = crate::workers::spawn("ntb-ring", move || p.run())
            .map_err(FabricError::io("spawn ring thread"))?;
        Ok((plain, t))
    }
}

fn left(deadline: Instant) -> Result<std::time::Duration> {
    let l = deadline.saturating_duration_since(Instant::now());
    if l.is_zero() {
        return Err(FabricError::Handshake(
            "control ring set-up: no answer within the connect timeout".into(),
        ));
    }
    Ok(l)
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> FabricError {
    move |e| FabricError::Handshake(format!("control ring set-up: {what}: {e}"))
}

/// Writes `bytes` as TLS application data, blocking until sent or `deadline`.
fn send(conn: &mut Connection, tcp: &TcpStream, bytes: &[u8], deadline: Instant) -> Result<()> {
    conn.writer()
        .write_all(bytes)
        .map_err(io_err("queue the message"))?;
    while conn.wants_write() {
        tcp.set_write_timeout(Some(left(deadline)?))
            .map_err(io_err("socket timeout"))?;
        conn.write_tls(&mut &*tcp).map_err(io_err("send"))?;
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes of TLS application data by `deadline`.
fn recv(conn: &mut Connection, tcp: &TcpStream, buf: &mut [u8], deadline: Instant) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match conn.reader().read(&mut buf[got..]) {
            Ok(0) => {
                return Err(FabricError::Handshake(
                    "control ring set-up: the peer closed the connection".into(),
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                tcp.set_read_timeout(Some(left(deadline)?))
                    .map_err(io_err("socket timeout"))?;
                match conn.read_tls(&mut &*tcp) {
                    Ok(0) => {
                        return Err(FabricError::Handshake(
                            "control ring set-up: the peer closed the connection".into(),
                        ))
                    }
                    Ok(_) => {
                        conn.process_new_packets()
                            .map_err(|e| io_err("tls")(io::Error::other(e)))?;
                    }
                    Err(e) => return Err(io_err("receive")(e)),
                }
                while conn.wants_write() {
                    conn.write_tls(&mut &*tcp).map_err(io_err("send"))?;
                }
            }
            Err(e) => return Err(io_err("receive")(e)),
        }
    }
    Ok(())
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn bad_region(region: &Region, problem: String) -> FabricError {
    FabricError::BadRegion {
        path: region.path().display().to_string(),
        problem,
    }
}

/// Agrees on a `bar` link's control path inside TLS, before the fabric hello (see the module
/// docs): `Some` rings, or `None` to keep control on TLS.
pub(crate) fn negotiate(
    conn: &mut Connection,
    tcp: &TcpStream,
    initiator: bool,
    region: &Region,
    deadline: Instant,
) -> Result<Option<RingLink>> {
    if initiator {
        let mut req = [0u8; REQ_LEN];
        req[..4].copy_from_slice(&REQ_MAGIC);
        req[4..8].copy_from_slice(&VERSION.to_le_bytes());
        req[8..12].copy_from_slice(&u32::from(region.ring_slots() > 0).to_le_bytes());
        send(conn, tcp, &req, deadline)?;
        let mut rep = [0u8; REPLY_LEN];
        recv(conn, tcp, &mut rep, deadline).map_err(|e| match e {
            FabricError::Handshake(m) => FabricError::Handshake(format!(
                "{m} (a lender that is not a bar node on its side closes it here: both \
                 cluster files must say fabric = \"bar\")"
            )),
            e => e,
        })?;
        if rep[..4] != REPLY_MAGIC || u32_at(&rep, 4) != VERSION {
            return Err(FabricError::Handshake(
                "control ring set-up: the lender's answer is not one (is it a bar node on \
                 its side too?)"
                    .into(),
            ));
        }
        let (status, index) = (u32_at(&rep, 8), u32_at(&rep, 12));
        let (offset, size) = (u64_at(&rep, 16), u64_at(&rep, 24));
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&rep[32..32 + NONCE_LEN]);
        match status {
            STATUS_RING => {}
            STATUS_TCP_CHOSEN => {
                if region.ring_slots() > 0 {
                    log::info!(
                        "control ring: the lender keeps control on tcp (control_path = \"tcp\" \
                         on its side)"
                    );
                }
                return Ok(None);
            }
            STATUS_TCP_NO_SLOT => {
                log::warn!(
                    "control ring: every ring slot of the lender's region is taken; this \
                     link's control stays on tcp (raise control_rings on both sides)"
                );
                return Ok(None);
            }
            s => {
                return Err(FabricError::Handshake(format!(
                    "control ring set-up: unknown status {s} from the lender"
                )))
            }
        }
        if region.ring_slots() == 0 {
            return Err(FabricError::Handshake(
                "control ring set-up: the lender set up a ring this node did not ask for".into(),
            ));
        }
        match region.ring_slot_offset(index) {
            Some(o) if o == offset && size == RING_SLOT_SIZE => {}
            _ => {
                return Err(bad_region(
                    region,
                    format!(
                        "the lender put this link's control ring at {offset:#x}+{size:#x} (slot \
                         {index}), but here slot {index} is {}: both sides' cluster files must \
                         give regions of the same size and the same control_rings",
                        region.ring_slot_offset(index).map_or_else(
                            || format!("beyond the {} slots", region.ring_slots()),
                            |o| format!("at {o:#x}")
                        )
                    ),
                ))
            }
        }
        let map = Mapping::map_shared(region.as_fd(), offset, RING_SLOT_SIZE)?;
        let rings = Rings::attach(map, &nonce).map_err(|e| {
            bad_region(
                region,
                format!(
                    "{e} at {offset:#x}, where the lender set this link's control ring up: this \
                     node's region is not the memory behind the lender's (region must be the \
                     file behind the lender's region_device BAR)"
                ),
            )
        })?;
        log::debug!("control ring: slot {index} at {offset:#x}");
        return Ok(Some(RingLink {
            rings,
            slot: None,
            index,
            offset,
        }));
    }
    let mut req = [0u8; REQ_LEN];
    recv(conn, tcp, &mut req, deadline)?;
    if req[..4] == crate::wire::MAGIC {
        // A fabric hello: the peer takes this node for a tcp node. Refuse it as the hello
        // check would, so that the peer's error says why.
        let why = "peer expects a tcp link, this is bar (give it this node with fabric = \
                   \"bar\" and its view of the region)";
        let id = u64_at(&req, 8);
        if let Ok(payload) = crate::wire::encode_payload(&crate::wire::ErrorReply::new(
            crate::wire::code::VERSION,
            why.to_string(),
        )) {
            if let Ok(frame) = crate::wire::encode_frame(
                crate::wire::FLAG_REPLY | crate::wire::FLAG_ERROR,
                crate::wire::op::HELLO,
                id,
                &payload,
                0,
            ) {
                let _ = send(conn, tcp, &frame, deadline);
            }
        }
        return Err(FabricError::Handshake(why.into()));
    }
    if req[..4] != REQ_MAGIC {
        return Err(FabricError::Handshake(
            "the peer did not ask for a bar link's control set-up: its cluster file does not \
             have this node as fabric = \"bar\" (with its view of the region)"
                .into(),
        ));
    }
    if u32_at(&req, 4) != VERSION {
        return Err(FabricError::Handshake(format!(
            "control ring set-up version {} from the peer, this node speaks {VERSION}",
            u32_at(&req, 4)
        )));
    }
    let wants = u32_at(&req, 8) == 1;
    let mut rep = [0u8; REPLY_LEN];
    rep[..4].copy_from_slice(&REPLY_MAGIC);
    rep[4..8].copy_from_slice(&VERSION.to_le_bytes());
    let slot = if wants && region.ring_slots() > 0 {
        SlotLease::take(region)?
    } else {
        None
    };
    let Some(slot) = slot else {
        let status = if wants && region.ring_slots() > 0 {
            log::warn!(
                "control ring: all {} ring slots of {} are taken; a link's control stays on \
                 tcp",
                region.ring_slots(),
                region.path().display()
            );
            STATUS_TCP_NO_SLOT
        } else {
            STATUS_TCP_CHOSEN
        };
        rep[8..12].copy_from_slice(&status.to_le_bytes());
        send(conn, tcp, &rep, deadline)?;
        return Ok(None);
    };
    let offset = region
        .ring_slot_offset(slot.slot)
        .ok_or_else(|| bad_region(region, format!("no ring slot {}", slot.slot)))?;
    let mut nonce = [0u8; NONCE_LEN];
    crate::tls::random(&mut nonce)?;
    let map = Mapping::map_shared(region.as_fd(), offset, RING_SLOT_SIZE)?;
    let rings = Rings::init(map, &nonce).map_err(|e| bad_region(region, e.to_string()))?;
    rep[8..12].copy_from_slice(&STATUS_RING.to_le_bytes());
    rep[12..16].copy_from_slice(&slot.slot.to_le_bytes());
    rep[16..24].copy_from_slice(&offset.to_le_bytes());
    rep[24..32].copy_from_slice(&RING_SLOT_SIZE.to_le_bytes());
    rep[32..32 + NONCE_LEN].copy_from_slice(&nonce);
    send(conn, tcp, &rep, deadline)?;
    let index = slot.slot;
    Ok(Some(RingLink {
        rings,
        slot: Some(slot),
        index,
        offset,
    }))
}

#[cfg(test)]
mod tests;
