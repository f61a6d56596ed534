//! Wire format shared by the fabric links and the lender control protocol.
//!
//! Every message is a frame: a fixed 24-byte little-endian header followed by `len` payload
//! bytes. The header is:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `b"LNTB"` |
//! | 4 | 1 | version ([`VERSION`]) |
//! | 5 | 1 | flags ([`FLAG_REPLY`], [`FLAG_ERROR`]) |
//! | 6 | 2 | opcode (`< USER_OPCODE_BASE`: fabric-internal; above: the user's protocol) |
//! | 8 | 8 | request id (0 = one-way event; a reply echoes the request's id) |
//! | 16 | 4 | payload length (at most [`MAX_PAYLOAD`]) |
//! | 20 | 2 | number of file descriptors attached (shm only, at most [`MAX_FDS`]) |
//! | 22 | 2 | reserved, zero |
//!
//! Payloads of typed messages are `postcard`-encoded serde values ([`encode_payload`],
//! [`decode_payload`]); an error reply carries an [`ErrorReply`]. Window data payloads are a
//! small postcard prefix followed by raw bytes. Decoding never panics on any input.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Frame magic.
pub const MAGIC: [u8; 4] = *b"LNTB";
/// Current wire version. 2: staged writes of mediated windows (`WINDOW_ADD_STAGED`,
/// `WINDOW_COMMIT`); a node of version 1 would never see such a window, so the two refuse
/// to link, by name, at the handshake.
pub const VERSION: u8 = 2;
/// Size of the fixed header.
pub const HEADER_LEN: usize = 24;
/// Largest window data transfer carried by one message (like vfio-user's max_data_xfer_size).
pub const MAX_DATA_CHUNK: usize = 1 << 20;
/// Largest payload of one frame: one data chunk plus room for its prefix.
pub const MAX_PAYLOAD: usize = MAX_DATA_CHUNK + 4096;
/// Largest number of file descriptors attached to one frame: the kernel's own limit for one
/// `sendmsg` (`SCM_MAX_FD`). A device's interrupts are wired with one eventfd per vector in
/// one frame (the lender protocol's SET_IRQS), and 32 here left a device of more than 32
/// MSI-X vectors with none wired on shm (a GPU's or a many-queue NVMe's count; found by the
/// two-lender Linux case with 128 vectors). Each received descriptor is owned at once and
/// closed with its frame unless a handler keeps it, so a peer cannot pile them up.
pub const MAX_FDS: usize = 253;
/// First opcode available to protocols built on the fabric (the lender control protocol).
pub const USER_OPCODE_BASE: u16 = 0x100;

/// The frame is a reply to the request with the same id.
pub const FLAG_REPLY: u8 = 0x01;
/// The reply is an error; the payload is an [`ErrorReply`].
pub const FLAG_ERROR: u8 = 0x02;
const VALID_FLAGS: u8 = FLAG_REPLY | FLAG_ERROR;

/// Errors of the wire format.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum WireError {
    #[error("bad frame magic {found:02x?}, expected \"LNTB\"")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported wire version {0} (this build speaks {VERSION})")]
    UnsupportedVersion(u8),
    #[error("unknown flag bits {0:#04x}")]
    BadFlags(u8),
    #[error("error flag {0:#04x} set without the reply flag")]
    ErrorWithoutReply(u8),
    #[error("payload length {len} exceeds the maximum of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("{count} file descriptors attached, at most {max} allowed")]
    TooManyFds { count: usize, max: usize },
    #[error("reserved header bytes are {0:#06x}, must be zero")]
    Reserved(u16),
    #[error("frame truncated: have {have} bytes, need {need}")]
    Truncated { have: usize, need: usize },
    #[error("cannot encode payload: {0}")]
    Encode(String),
    #[error("cannot decode payload: {0}")]
    Decode(String),
    #[error("{0} trailing bytes after the payload")]
    TrailingBytes(usize),
}

/// The fixed frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub flags: u8,
    pub opcode: u16,
    pub id: u64,
    pub len: u32,
    pub fds: u16,
}

impl Header {
    /// Whether this frame is a reply.
    pub fn is_reply(&self) -> bool {
        self.flags & FLAG_REPLY != 0
    }

    /// Whether this frame is an error reply.
    pub fn is_error(&self) -> bool {
        self.flags & FLAG_ERROR != 0
    }

    /// Checks the fields a sender controls.
    pub fn validate(&self) -> Result<(), WireError> {
        if self.flags & !VALID_FLAGS != 0 {
            return Err(WireError::BadFlags(self.flags));
        }
        if self.is_error() && !self.is_reply() {
            return Err(WireError::ErrorWithoutReply(self.flags));
        }
        if self.len as usize > MAX_PAYLOAD {
            return Err(WireError::TooLarge {
                len: self.len as usize,
                max: MAX_PAYLOAD,
            });
        }
        if self.fds as usize > MAX_FDS {
            return Err(WireError::TooManyFds {
                count: self.fds as usize,
                max: MAX_FDS,
            });
        }
        Ok(())
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.flags;
        b[6..8].copy_from_slice(&self.opcode.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..20].copy_from_slice(&self.len.to_le_bytes());
        b[20..22].copy_from_slice(&self.fds.to_le_bytes());
        b
    }

    /// Decodes and validates a header from the first [`HEADER_LEN`] bytes of `buf`.
    pub fn decode(buf: &[u8]) -> Result<Header, WireError> {
        let b: &[u8; HEADER_LEN] = buf
            .get(..HEADER_LEN)
            .and_then(|s| s.try_into().ok())
            .ok_or(WireError::Truncated {
                have: buf.len(),
                need: HEADER_LEN,
            })?;
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(WireError::BadMagic { found: magic });
        }
        if b[4] != VERSION {
            return Err(WireError::UnsupportedVersion(b[4]));
        }
        let reserved = u16::from_le_bytes([b[22], b[23]]);
        if reserved != 0 {
            return Err(WireError::Reserved(reserved));
        }
        let h = Header {
            flags: b[5],
            opcode: u16::from_le_bytes([b[6], b[7]]),
            id: u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]),
            len: u32::from_le_bytes([b[16], b[17], b[18], b[19]]),
            fds: u16::from_le_bytes([b[20], b[21]]),
        };
        h.validate()?;
        Ok(h)
    }
}

/// A decoded frame (file descriptors travel beside it, not in it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub header: Header,
    pub payload: Vec<u8>,
}

/// Encodes a frame into one buffer; fails if the payload is too large.
pub fn encode_frame(
    flags: u8,
    opcode: u16,
    id: u64,
    payload: &[u8],
    fds: usize,
) -> Result<Vec<u8>, WireError> {
    let header = encode_header(flags, opcode, id, payload.len(), fds)?;
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&header);
    out.extend_from_slice(payload);
    Ok(out)
}

/// The header of a frame whose payload is `len` bytes, checked as [`encode_frame`] checks it:
/// for a payload sent from several buffers without first copying them into one.
pub fn encode_header(
    flags: u8,
    opcode: u16,
    id: u64,
    len: usize,
    fds: usize,
) -> Result<[u8; HEADER_LEN], WireError> {
    let header = Header {
        flags,
        opcode,
        id,
        len: u32::try_from(len).map_err(|_| WireError::TooLarge {
            len,
            max: MAX_PAYLOAD,
        })?,
        fds: u16::try_from(fds).map_err(|_| WireError::TooManyFds {
            count: fds,
            max: MAX_FDS,
        })?,
    };
    header.validate()?;
    Ok(header.encode())
}

/// Decodes one frame from the front of `buf`.
///
/// Returns `Ok(None)` when `buf` holds a valid but incomplete frame, and the frame plus the
/// number of bytes it used otherwise.
pub fn decode_frame(buf: &[u8]) -> Result<Option<(Frame, usize)>, WireError> {
    if buf.len() < HEADER_LEN {
        // Check what we have so garbage is rejected early.
        if buf.len() >= 4 && buf[..4] != MAGIC {
            let mut found = [0u8; 4];
            found.copy_from_slice(&buf[..4]);
            return Err(WireError::BadMagic { found });
        }
        return Ok(None);
    }
    let header = Header::decode(buf)?;
    let total = HEADER_LEN + header.len as usize;
    let Some(payload) = buf.get(HEADER_LEN..total) else {
        return Ok(None);
    };
    Ok(Some((
        Frame {
            header,
            payload: payload.to_vec(),
        },
        total,
    )))
}

/// Encodes a typed payload.
pub fn encode_payload<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, WireError> {
    let v = postcard::to_allocvec(value).map_err(|e| WireError::Encode(e.to_string()))?;
    if v.len() > MAX_PAYLOAD {
        return Err(WireError::TooLarge {
            len: v.len(),
            max: MAX_PAYLOAD,
        });
    }
    Ok(v)
}

/// Decodes a typed payload; the whole buffer must be used.
pub fn decode_payload<T: DeserializeOwned>(buf: &[u8]) -> Result<T, WireError> {
    let (value, rest) = decode_prefix(buf)?;
    if !rest.is_empty() {
        return Err(WireError::TrailingBytes(rest.len()));
    }
    Ok(value)
}

/// Decodes a typed value from the front of `buf`, returning the remaining bytes.
pub fn decode_prefix<T: DeserializeOwned>(buf: &[u8]) -> Result<(T, &[u8]), WireError> {
    postcard::take_from_bytes(buf).map_err(|e| WireError::Decode(e.to_string()))
}

/// Error codes of [`ErrorReply`]. Protocols on top may define codes from 0x100 on.
pub mod code {
    /// The request was malformed.
    pub const INVALID: u32 = 1;
    /// The opcode is not known to the receiver.
    pub const UNKNOWN_OPCODE: u32 = 2;
    /// No such window.
    pub const UNKNOWN_WINDOW: u32 = 3;
    /// Offset/length outside the window or register file.
    pub const OUT_OF_RANGE: u32 = 4;
    /// The receiver's wire version or capabilities do not match.
    pub const VERSION: u32 = 5;
    /// The request is valid but not supported by this node.
    pub const UNSUPPORTED: u32 = 6;
    /// The receiver is busy / out of resources.
    pub const BUSY: u32 = 7;
    /// Internal failure on the receiver.
    pub const INTERNAL: u32 = 8;
}

/// Payload of an error reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    pub code: u32,
    pub message: String,
}

impl ErrorReply {
    pub fn new(code: u32, message: impl Into<String>) -> Self {
        ErrorReply {
            code,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for ErrorReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "error {}: {}", self.code, self.message)
    }
}

/// Fabric-internal opcodes (below [`USER_OPCODE_BASE`]).
pub mod op {
    pub const HELLO: u16 = 0x01;
    pub const GOODBYE: u16 = 0x02;
    pub const HEARTBEAT: u16 = 0x03;
    pub const WINDOW_ADD: u16 = 0x10;
    /// A window inside the link's shared region (`bar`): `fd_offset` is the offset in the
    /// region, no fd is attached.
    pub const WINDOW_ADD_SHARED: u16 = 0x14;
    pub const WINDOW_REMOVE: u16 = 0x11;
    pub const WINDOW_READ: u16 = 0x12;
    pub const WINDOW_WRITE: u16 = 0x13;
    /// A mediated window with a staging ring (shm): the payload is a [`super::msg::WindowAdd`]
    /// and the one attached fd is the ring (`link::staging`), never the window's memory.
    pub const WINDOW_ADD_STAGED: u16 = 0x15;
    /// A chunk of a staged write is in the ring ([`super::msg::WindowCommit`]). A landed
    /// chunk shows in the ring's drained count; a refused one is answered (an error reply)
    /// when it carries a request id (a write's last chunk), and only logged otherwise.
    pub const WINDOW_COMMIT: u16 = 0x16;
    pub const DOORBELL: u16 = 0x20;
    pub const SPAD_WRITE: u16 = 0x30;
    pub const SPAD_READ: u16 = 0x31;
}

/// Payloads of the fabric-internal messages.
pub mod msg {
    use serde::{Deserialize, Serialize};

    use crate::fabric::{FabricKind, WindowLimits};

    /// First message of a link, both ways (request from the connector, reply from the
    /// listener). On shm the sender attaches its doorbell eventfds and then its scratchpad
    /// memfd, in that order.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Hello {
        pub version: u8,
        pub node: String,
        pub kind: FabricKind,
        pub limits: WindowLimits,
        pub doorbells: u32,
        pub scratchpads: u32,
        pub heartbeat_ms: u32,
    }

    /// A window exported to the peer; on shm its memfd is attached.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct WindowAdd {
        pub id: u32,
        pub size: u64,
        pub fd_offset: u64,
        pub label: String,
    }

    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct WindowRemove {
        pub id: u32,
    }

    /// Read request; the reply payload is the raw bytes.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct WindowRead {
        pub id: u32,
        pub offset: u64,
        pub len: u32,
    }

    /// Prefix of a write request; the raw bytes follow it. The reply is empty.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct WindowWrite {
        pub id: u32,
        pub offset: u64,
    }

    /// `len` bytes at ring position `pos` (bytes committed before them) go to window `id` at
    /// `offset`.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct WindowCommit {
        pub id: u32,
        pub offset: u64,
        pub pos: u64,
        pub len: u32,
    }

    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Doorbell {
        pub bits: u64,
    }

    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct SpadWrite {
        pub index: u32,
        pub value: u32,
    }

    /// Read request; the reply is a postcard `u32`.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct SpadRead {
        pub index: u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_roundtrip() {
        let h = Header {
            flags: FLAG_REPLY | FLAG_ERROR,
            opcode: 0x1234,
            id: 0xdead_beef_0102,
            len: 77,
            fds: 3,
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn frame_roundtrip_and_incomplete() {
        let f = encode_frame(0, 0x100, 7, b"hello", 0).unwrap();
        for cut in 0..f.len() {
            assert_eq!(decode_frame(&f[..cut]).unwrap(), None, "cut at {cut}");
        }
        let (frame, used) = decode_frame(&f).unwrap().unwrap();
        assert_eq!(used, f.len());
        assert_eq!(frame.payload, b"hello");
        assert_eq!(frame.header.id, 7);
    }

    #[test]
    fn rejects_bad_headers() {
        let good = encode_frame(0, 1, 0, &[], 0).unwrap();
        let mut b = good.clone();
        b[0] = b'X';
        assert!(matches!(decode_frame(&b), Err(WireError::BadMagic { .. })));
        let mut b = good.clone();
        b[4] = 9;
        assert_eq!(decode_frame(&b), Err(WireError::UnsupportedVersion(9)));
        let mut b = good.clone();
        b[5] = 0x80;
        assert_eq!(decode_frame(&b), Err(WireError::BadFlags(0x80)));
        let mut b = good.clone();
        b[5] = FLAG_ERROR;
        assert_eq!(decode_frame(&b), Err(WireError::ErrorWithoutReply(2)));
        let mut b = good.clone();
        b[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode_frame(&b), Err(WireError::TooLarge { .. })));
        let mut b = good.clone();
        b[20..22].copy_from_slice(&(MAX_FDS as u16 + 1).to_le_bytes());
        assert!(matches!(
            decode_frame(&b),
            Err(WireError::TooManyFds { .. })
        ));
        let mut b = good;
        b[23] = 1;
        assert_eq!(decode_frame(&b), Err(WireError::Reserved(0x100)));
        assert!(encode_frame(0, 1, 0, &vec![0; MAX_PAYLOAD + 1], 0).is_err());
    }

    #[test]
    fn payload_roundtrip_and_trailing() {
        let e = ErrorReply::new(code::UNKNOWN_WINDOW, "no window 3");
        let b = encode_payload(&e).unwrap();
        assert_eq!(decode_payload::<ErrorReply>(&b).unwrap(), e);
        let mut t = b.clone();
        t.push(0);
        assert_eq!(
            decode_payload::<ErrorReply>(&t),
            Err(WireError::TrailingBytes(1))
        );
        assert!(decode_payload::<ErrorReply>(&b[..b.len() - 1]).is_err());
    }
}
