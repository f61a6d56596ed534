//! Identify data structures and log pages.

use super::NvmeConfig;

fn put_str(b: &mut [u8], s: &str) {
    b.fill(b' ');
    for (d, c) in b
        .iter_mut()
        .zip(s.bytes().filter(|c| c.is_ascii_graphic() || *c == b' '))
    {
        *d = c;
    }
}

fn put16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}

fn put32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// NVMe version reported in VS and Identify (1.4.0).
pub const VERSION: u32 = 0x0001_0400;

/// Identify Controller (CNS 1).
pub fn controller(cfg: &NvmeConfig, max_cmds: u16) -> [u8; 4096] {
    let mut b = [0u8; 4096];
    put16(&mut b, 0, cfg.identity.vendor_id);
    put16(&mut b, 2, cfg.identity.subsystem_vendor_id);
    put_str(&mut b[4..24], &cfg.serial);
    put_str(&mut b[24..64], &cfg.model);
    put_str(&mut b[64..72], &cfg.firmware);
    b[72] = 6; // RAB
    b[73..76].copy_from_slice(&[0x00, 0x54, 0x52]); // IEEE OUI (Red Hat 525400, LSB first)
    b[77] = cfg.mdts;
    put16(&mut b, 78, 1); // CNTLID
    put32(&mut b, 80, VERSION);
    put32(&mut b, 84, 1_000_000); // RTD3R 1 s
    put32(&mut b, 88, 1_000_000); // RTD3E 1 s
    b[111] = 1; // CNTRLTYPE: I/O controller
                // OACS: Doorbell Buffer Config (bit 8) when shadow doorbells are on; nothing else.
    put16(&mut b, 256, if cfg.dbbuf { 1 << 8 } else { 0 });
    b[258] = 3; // ACL: 4 outstanding aborts
    b[259] = 3; // AERL: 4 outstanding AERs
    b[260] = 0x3; // FRMW: slot 1 read-only, 1 slot
    b[261] = 0x04; // LPA: extended data for Get Log Page
    b[262] = 0; // ELPE: 1 error log entry
    put16(&mut b, 266, 0x0157); // WCTEMP 343 K
    put16(&mut b, 268, 0x0175); // CCTEMP 373 K
    b[512] = 0x66; // SQES
    b[513] = 0x44; // CQES
    put16(&mut b, 514, max_cmds); // MAXCMD
    put32(&mut b, 516, 1); // NN
    put16(&mut b, 520, (1 << 2) | (1 << 3)); // ONCS: DSM, Write Zeroes
    b[525] = 1; // VWC present
    put16(&mut b, 526, 0); // AWUN
    put16(&mut b, 528, 0); // AWUPF
    b[530] = 0; // NVSCC
    let nqn = subsystem_nqn(cfg);
    let n = nqn.len().min(255);
    b[768..768 + n].copy_from_slice(&nqn.as_bytes()[..n]);
    // Power state 0: 25 W, entry/exit latency 0.
    put16(&mut b, 2048, 2500);
    b
}

/// The subsystem NQN: `nqn.2019-08.org.lendvm:nvme:[<subsystem>:]<serial>`.
pub fn subsystem_nqn(cfg: &NvmeConfig) -> String {
    if cfg.subsystem.is_empty() {
        format!("nqn.2019-08.org.lendvm:nvme:{}", cfg.serial.trim())
    } else {
        format!(
            "nqn.2019-08.org.lendvm:nvme:{}:{}",
            cfg.subsystem,
            cfg.serial.trim()
        )
    }
}

/// 16 bytes derived from the subsystem and serial (stable NGUID/UUID seed).
pub fn ns_guid(cfg: &NvmeConfig) -> [u8; 16] {
    // FNV-1a over the serial, expanded into two halves.
    let mut h1: u64 = 0xcbf2_9ce4_8422_2325;
    let mut h2: u64 = 0x8422_2325_cbf2_9ce4;
    for c in cfg
        .subsystem
        .bytes()
        .chain(cfg.serial.bytes())
        .chain(cfg.model.bytes())
    {
        h1 = (h1 ^ u64::from(c)).wrapping_mul(0x0100_0000_01b3);
        h2 = (h2 ^ u64::from(c)).wrapping_mul(0x0000_0100_0000_01b3 ^ 0x5bd1_e995);
    }
    let mut g = [0u8; 16];
    g[..8].copy_from_slice(&h1.to_be_bytes());
    g[8..].copy_from_slice(&h2.to_be_bytes());
    g
}

/// Identify Namespace (CNS 0) for namespace 1.
pub fn namespace(cfg: &NvmeConfig, nsze: u64) -> [u8; 4096] {
    let mut b = [0u8; 4096];
    put64(&mut b, 0, nsze); // NSZE
    put64(&mut b, 8, nsze); // NCAP
    put64(&mut b, 16, nsze); // NUSE
    b[24] = 0; // NSFEAT
    b[25] = 0; // NLBAF: one format
    b[26] = 0; // FLBAS: format 0
    let g = ns_guid(cfg);
    b[104..120].copy_from_slice(&g); // NGUID
    b[120..128].copy_from_slice(&g[..8]); // EUI64
    let lbads = cfg.lba_size.trailing_zeros();
    put32(&mut b, 128, lbads << 16); // LBAF0: MS 0, LBADS, RP 0 (best)
    b
}

/// Active namespace id list (CNS 2): ids greater than `after`.
pub fn active_ns_list(after: u32) -> [u8; 4096] {
    let mut b = [0u8; 4096];
    if after < 1 {
        put32(&mut b, 0, 1);
    }
    b
}

/// Namespace identification descriptor list (CNS 3): NGUID and UUID.
pub fn ns_descriptors(cfg: &NvmeConfig) -> [u8; 4096] {
    let mut b = [0u8; 4096];
    let g = ns_guid(cfg);
    // NGUID descriptor.
    b[0] = 2;
    b[1] = 16;
    b[4..20].copy_from_slice(&g);
    // UUID descriptor (RFC 4122 variant, version 4 bits set on a derived value).
    let mut u = g;
    u.reverse();
    u[6] = (u[6] & 0x0f) | 0x40;
    u[8] = (u[8] & 0x3f) | 0x80;
    b[20] = 3;
    b[21] = 16;
    b[24..40].copy_from_slice(&u);
    b
}

/// Counters the SMART log reports.
#[derive(Debug, Default, Clone, Copy)]
pub struct SmartCounters {
    /// Bytes read by host commands.
    pub bytes_read: u64,
    /// Bytes written by host commands.
    pub bytes_written: u64,
    /// Read commands.
    pub read_cmds: u64,
    /// Write commands.
    pub write_cmds: u64,
    /// Media/data errors.
    pub media_errors: u64,
}

/// SMART / Health Information log (LID 2), 512 bytes.
pub fn smart_log(c: &SmartCounters, power_on_secs: u64) -> Vec<u8> {
    let mut b = vec![0u8; 512];
    b[0] = 0; // critical warning
    put16(&mut b, 1, 0x0143); // composite temperature 323 K
    b[3] = 100; // available spare
    b[4] = 10; // spare threshold
    b[5] = 0; // percentage used
              // Data units are thousands of 512-byte units, rounded up.
    let du = |bytes: u64| (bytes / 512).div_ceil(1000);
    put64(&mut b, 32, du(c.bytes_read));
    put64(&mut b, 48, du(c.bytes_written));
    put64(&mut b, 64, c.read_cmds);
    put64(&mut b, 80, c.write_cmds);
    put64(&mut b, 112, 1); // power cycles
    put64(&mut b, 128, power_on_secs / 3600);
    put64(&mut b, 160, c.media_errors);
    b
}

/// Firmware Slot Information log (LID 3), 512 bytes.
pub fn fw_slot_log(cfg: &NvmeConfig) -> Vec<u8> {
    let mut b = vec![0u8; 512];
    b[0] = 1; // active slot 1
    put_str(&mut b[8..16], &cfg.firmware);
    b
}

/// Error Information log (LID 1): one all-zero 64-byte entry.
pub fn error_log() -> Vec<u8> {
    vec![0u8; 64]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two lenders lending at the same address give the same serial; their node names keep
    /// the subsystems (and namespace IDs) apart, so a guest borrowing both sees two
    /// subsystems instead of one controller ID twice.
    #[test]
    fn the_subsystem_keeps_same_serial_controllers_apart() {
        let a = NvmeConfig {
            serial: "LENDVM000082000".into(),
            subsystem: "node1".into(),
            ..Default::default()
        };
        let b = NvmeConfig {
            subsystem: "node2".into(),
            ..a.clone()
        };
        assert_eq!(
            subsystem_nqn(&a),
            "nqn.2019-08.org.lendvm:nvme:node1:LENDVM000082000"
        );
        assert_ne!(subsystem_nqn(&a), subsystem_nqn(&b));
        assert_ne!(ns_guid(&a), ns_guid(&b));
        let plain = NvmeConfig {
            subsystem: String::new(),
            ..a.clone()
        };
        assert_eq!(
            subsystem_nqn(&plain),
            "nqn.2019-08.org.lendvm:nvme:LENDVM000082000"
        );
    }
}
