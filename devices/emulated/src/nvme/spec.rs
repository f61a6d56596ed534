//! NVMe 1.4 register offsets, opcodes, status codes and entry layouts.

/// Controller Capabilities (64-bit).
pub const REG_CAP: u64 = 0x00;
/// Version.
pub const REG_VS: u64 = 0x08;
/// Interrupt Mask Set.
pub const REG_INTMS: u64 = 0x0c;
/// Interrupt Mask Clear.
pub const REG_INTMC: u64 = 0x10;
/// Controller Configuration.
pub const REG_CC: u64 = 0x14;
/// Controller Status.
pub const REG_CSTS: u64 = 0x1c;
/// NVM Subsystem Reset.
pub const REG_NSSR: u64 = 0x20;
/// Admin Queue Attributes.
pub const REG_AQA: u64 = 0x24;
/// Admin SQ base (64-bit).
pub const REG_ASQ: u64 = 0x28;
/// Admin CQ base (64-bit).
pub const REG_ACQ: u64 = 0x30;
/// Controller Memory Buffer Location.
pub const REG_CMBLOC: u64 = 0x38;
/// Controller Memory Buffer Size.
pub const REG_CMBSZ: u64 = 0x3c;
/// Controller Memory Buffer Memory Space Control (64-bit).
pub const REG_CMBMSC: u64 = 0x50;
/// Controller Memory Buffer Status.
pub const REG_CMBSTS: u64 = 0x58;
/// First doorbell.
pub const REG_DBS: u64 = 0x1000;

/// Offset of SQ `qid`'s tail doorbell (DSTRD = 0).
pub const fn sq_doorbell(qid: u16) -> u64 {
    REG_DBS + 8 * qid as u64
}

/// Offset of CQ `qid`'s head doorbell (DSTRD = 0).
pub const fn cq_doorbell(qid: u16) -> u64 {
    REG_DBS + 8 * qid as u64 + 4
}

/// CC.EN.
pub const CC_EN: u32 = 1;
/// CSTS.RDY.
pub const CSTS_RDY: u32 = 1;
/// CSTS.CFS.
pub const CSTS_CFS: u32 = 1 << 1;
/// CSTS.SHST = shutdown complete.
pub const CSTS_SHST_COMPLETE: u32 = 2 << 2;
/// CSTS.SHST = shutdown processing.
pub const CSTS_SHST_MASK: u32 = 3 << 2;

/// Memory page size (MPSMIN = MPSMAX = 4 KiB).
pub const PAGE_SIZE: u64 = 4096;
/// Submission queue entry size.
pub const SQE_SIZE: u64 = 64;
/// Completion queue entry size.
pub const CQE_SIZE: u64 = 16;

/// Admin opcodes.
pub mod admin {
    /// Delete I/O Submission Queue.
    pub const DELETE_SQ: u8 = 0x00;
    /// Create I/O Submission Queue.
    pub const CREATE_SQ: u8 = 0x01;
    /// Get Log Page.
    pub const GET_LOG_PAGE: u8 = 0x02;
    /// Delete I/O Completion Queue.
    pub const DELETE_CQ: u8 = 0x04;
    /// Create I/O Completion Queue.
    pub const CREATE_CQ: u8 = 0x05;
    /// Identify.
    pub const IDENTIFY: u8 = 0x06;
    /// Abort.
    pub const ABORT: u8 = 0x08;
    /// Set Features.
    pub const SET_FEATURES: u8 = 0x09;
    /// Get Features.
    pub const GET_FEATURES: u8 = 0x0a;
    /// Asynchronous Event Request.
    pub const ASYNC_EVENT: u8 = 0x0c;
    /// Keep Alive (not supported: Invalid Opcode).
    pub const KEEP_ALIVE: u8 = 0x18;
    /// Doorbell Buffer Config (shadow doorbells + EventIdx, OACS bit 8).
    pub const DBBUF_CONFIG: u8 = 0x7c;
}

/// NVM command set opcodes.
pub mod io {
    /// Flush.
    pub const FLUSH: u8 = 0x00;
    /// Write.
    pub const WRITE: u8 = 0x01;
    /// Read.
    pub const READ: u8 = 0x02;
    /// Write Zeroes.
    pub const WRITE_ZEROES: u8 = 0x08;
    /// Dataset Management.
    pub const DSM: u8 = 0x09;
}

/// Feature identifiers.
pub mod feat {
    /// Arbitration.
    pub const ARBITRATION: u8 = 0x01;
    /// Power Management.
    pub const POWER_MGMT: u8 = 0x02;
    /// Temperature Threshold.
    pub const TEMP_THRESHOLD: u8 = 0x04;
    /// Error Recovery.
    pub const ERROR_RECOVERY: u8 = 0x05;
    /// Volatile Write Cache.
    pub const VOLATILE_WC: u8 = 0x06;
    /// Number of Queues.
    pub const NUM_QUEUES: u8 = 0x07;
    /// Interrupt Coalescing.
    pub const IRQ_COALESCING: u8 = 0x08;
    /// Interrupt Vector Configuration.
    pub const IRQ_VECTOR_CONFIG: u8 = 0x09;
    /// Write Atomicity Normal.
    pub const WRITE_ATOMICITY: u8 = 0x0a;
    /// Asynchronous Event Configuration.
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0b;
}

/// Status values: `SCT << 8 | SC` (DNR is added when posting).
pub mod status {
    /// Successful Completion.
    pub const SUCCESS: u16 = 0x000;
    /// Invalid Command Opcode.
    pub const INVALID_OPCODE: u16 = 0x001;
    /// Invalid Field in Command.
    pub const INVALID_FIELD: u16 = 0x002;
    /// Data Transfer Error.
    pub const DATA_TRANSFER_ERROR: u16 = 0x004;
    /// Internal Error.
    pub const INTERNAL_ERROR: u16 = 0x006;
    /// Command Aborted due to SQ Deletion.
    pub const ABORTED_SQ_DELETION: u16 = 0x008;
    /// Invalid Namespace or Format.
    pub const INVALID_NAMESPACE: u16 = 0x00b;
    /// PRP Offset Invalid.
    pub const PRP_OFFSET_INVALID: u16 = 0x013;
    /// LBA Out of Range.
    pub const LBA_OUT_OF_RANGE: u16 = 0x080;
    /// Completion Queue Invalid.
    pub const CQ_INVALID: u16 = 0x100;
    /// Invalid Queue Identifier.
    pub const INVALID_QID: u16 = 0x101;
    /// Invalid Queue Size.
    pub const INVALID_QSIZE: u16 = 0x102;
    /// Asynchronous Event Request Limit Exceeded.
    pub const AER_LIMIT_EXCEEDED: u16 = 0x105;
    /// Invalid Interrupt Vector.
    pub const INVALID_VECTOR: u16 = 0x108;
    /// Invalid Log Page.
    pub const INVALID_LOG_PAGE: u16 = 0x109;
    /// Invalid Queue Deletion.
    pub const INVALID_QUEUE_DELETION: u16 = 0x10c;
    /// Feature Identifier Not Saveable.
    pub const FEATURE_NOT_SAVEABLE: u16 = 0x10d;
    /// Write Fault (media error).
    pub const WRITE_FAULT: u16 = 0x280;
    /// Unrecovered Read Error (media error).
    pub const UNRECOVERED_READ: u16 = 0x281;
}

/// A 64-byte submission queue entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sqe {
    /// Command dword 0..=15.
    pub dw: [u32; 16],
}

impl Sqe {
    /// Build from bytes.
    pub fn from_bytes(b: &[u8; 64]) -> Self {
        let mut dw = [0u32; 16];
        for (i, d) in dw.iter_mut().enumerate() {
            *d = u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
        }
        Sqe { dw }
    }
    /// Encode to bytes.
    pub fn to_bytes(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        for (i, d) in self.dw.iter().enumerate() {
            b[4 * i..4 * i + 4].copy_from_slice(&d.to_le_bytes());
        }
        b
    }
    /// A command with `opcode` and command id `cid`.
    pub fn new(opcode: u8, cid: u16) -> Self {
        let mut s = Sqe::default();
        s.dw[0] = u32::from(opcode) | (u32::from(cid) << 16);
        s
    }
    /// Opcode.
    pub fn opcode(&self) -> u8 {
        self.dw[0] as u8
    }
    /// Fused operation bits.
    pub fn fuse(&self) -> u8 {
        ((self.dw[0] >> 8) & 3) as u8
    }
    /// PRP or SGL selector (0 = PRP).
    pub fn psdt(&self) -> u8 {
        ((self.dw[0] >> 14) & 3) as u8
    }
    /// Command identifier.
    pub fn cid(&self) -> u16 {
        (self.dw[0] >> 16) as u16
    }
    /// Namespace id.
    pub fn nsid(&self) -> u32 {
        self.dw[1]
    }
    /// PRP entry 1.
    pub fn prp1(&self) -> u64 {
        u64::from(self.dw[6]) | (u64::from(self.dw[7]) << 32)
    }
    /// PRP entry 2.
    pub fn prp2(&self) -> u64 {
        u64::from(self.dw[8]) | (u64::from(self.dw[9]) << 32)
    }
    /// Set namespace id.
    pub fn set_nsid(&mut self, nsid: u32) -> &mut Self {
        self.dw[1] = nsid;
        self
    }
    /// Set PRP1/PRP2.
    pub fn set_prps(&mut self, prp1: u64, prp2: u64) -> &mut Self {
        self.dw[6] = prp1 as u32;
        self.dw[7] = (prp1 >> 32) as u32;
        self.dw[8] = prp2 as u32;
        self.dw[9] = (prp2 >> 32) as u32;
        self
    }
    /// Set command dword `n` (10..=15).
    pub fn set_cdw(&mut self, n: usize, v: u32) -> &mut Self {
        self.dw[n] = v;
        self
    }
}

/// A 16-byte completion queue entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cqe {
    /// Command specific result.
    pub dw0: u32,
    /// SQ head pointer.
    pub sq_head: u16,
    /// SQ identifier.
    pub sq_id: u16,
    /// Command identifier.
    pub cid: u16,
    /// Phase tag.
    pub phase: bool,
    /// Status field without the phase bit: SC | SCT << 8 | CRD << 11 | M << 13 | DNR << 14.
    pub status: u16,
}

impl Cqe {
    /// Encode.
    pub fn to_bytes(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..4].copy_from_slice(&self.dw0.to_le_bytes());
        b[8..10].copy_from_slice(&self.sq_head.to_le_bytes());
        b[10..12].copy_from_slice(&self.sq_id.to_le_bytes());
        b[12..14].copy_from_slice(&self.cid.to_le_bytes());
        let sf = u16::from(self.phase) | (self.status << 1);
        b[14..16].copy_from_slice(&sf.to_le_bytes());
        b
    }
    /// Decode.
    pub fn from_bytes(b: &[u8; 16]) -> Self {
        let sf = u16::from_le_bytes([b[14], b[15]]);
        Cqe {
            dw0: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            sq_head: u16::from_le_bytes([b[8], b[9]]),
            sq_id: u16::from_le_bytes([b[10], b[11]]),
            cid: u16::from_le_bytes([b[12], b[13]]),
            phase: sf & 1 != 0,
            status: sf >> 1,
        }
    }
    /// `SCT << 8 | SC` without the DNR/M/CRD bits.
    pub fn code(&self) -> u16 {
        self.status & 0x7ff
    }
    /// Do Not Retry.
    pub fn dnr(&self) -> bool {
        self.status & (1 << 14) != 0
    }
}
