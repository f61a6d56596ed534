//! Lender-side filter of borrower config writes.
//!
//! The borrower's VMM virtualizes what the guest sees; what it forwards to the lender must not
//! let it take over the function:
//!
//! * BARs and the expansion ROM (0x10..0x28, 0x30): the lender owns the real addresses.
//! * Identity and header fields other than command, status, cache line size, latency timer and
//!   interrupt line: read-only.
//! * MSI, MSI-X and power-management capabilities: interrupt routing is set with SET_IRQS and
//!   power state belongs to the lender.
//! * PCIe device control "initiate FLR" bit: use RESET.
//! * Command register Bus Master Enable: silently kept at the lender's value (the lender sets
//!   it when a DMA window is mapped and clears it when the last one goes).
//! * Status register Capabilities List bit: kept at the device's value (an emulated device
//!   stores status bytes; clearing the bit would hide every capability from the walk that
//!   decides what is protected).
//!
//! The extended space (0x100–0xFFF) is virtualized by [`extended`]: hidden capabilities
//! (SR-IOV, ATS, PRI, PASID, resizable BAR, anything unknown) are unlinked, AER and ACS are
//! read-only, and no borrower write reaches it. [`ConfigGate`] is the per-lease entry point
//! that applies all of this, checks sizes and alignment, counts and logs (rate-limited).

pub mod extended;
#[cfg(test)]
mod fuzz;
mod gate;

use thiserror::Error;

use super::capabilities;

pub use gate::{virtualized_info, ConfigGate, GateCounts, WriteOutcome};

/// Command register bit: I/O Space.
pub const CMD_IO: u16 = 1 << 0;
/// Command register bit: Memory Space.
pub const CMD_MEMORY: u16 = 1 << 1;
/// Command register bit: Bus Master Enable.
pub const CMD_BUS_MASTER: u16 = 1 << 2;
/// Command bits the lender owns on the real device: the borrower's own decode and bus
/// mastering are its VMM's business (it decodes the guest's BAR addresses and maps DMA on
/// Bus Master Enable), and the lender's BAR accesses need decoding on: vfio-pci refuses a
/// BAR read or write with EIO while the function's Memory Space bit is clear.
pub const CMD_LENDER_OWNED: u16 = CMD_IO | CMD_MEMORY | CMD_BUS_MASTER;
/// Status register (low byte) bit: Capabilities List.
pub const STATUS_CAP_LIST: u8 = 1 << 4;

/// A config write the borrower may not make.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("config write of {len} bytes at {offset:#x} touches {what}, which the lender owns{hint}")]
pub struct FilterError {
    /// Offset of the write.
    pub offset: u16,
    /// Length of the write.
    pub len: usize,
    /// What it touches.
    pub what: String,
    /// What to do instead.
    pub hint: &'static str,
}

#[derive(Debug, Clone)]
struct Protected {
    start: usize,
    end: usize,
    what: String,
    hint: &'static str,
}

/// The protected ranges of one function's config space.
#[derive(Debug, Clone)]
pub struct ConfigFilter {
    protected: Vec<Protected>,
    flr_bit_at: Option<usize>,
    /// The device's Capabilities List status bit (0x10 of the status low byte): read-only,
    /// kept at this value, because the filter's own capability walk depends on it.
    status_caps: u8,
}

impl ConfigFilter {
    /// Builds the filter from a config snapshot (capabilities located by walking the list).
    pub fn from_config(config: &[u8]) -> ConfigFilter {
        let mut p = vec![
            Protected {
                start: 0x00,
                end: 0x04,
                what: "vendor/device id".into(),
                hint: "",
            },
            Protected {
                start: 0x08,
                end: 0x0c,
                what: "revision/class code".into(),
                hint: "",
            },
            Protected {
                start: 0x0e,
                end: 0x10,
                what: "header type/bist".into(),
                hint: "",
            },
            Protected {
                start: 0x10,
                end: 0x28,
                what: "the base address registers".into(),
                hint: "; the borrower virtualizes bar addresses",
            },
            Protected {
                start: 0x28,
                end: 0x30,
                what: "cardbus/subsystem ids".into(),
                hint: "",
            },
            Protected {
                start: 0x30,
                end: 0x34,
                what: "the expansion rom bar".into(),
                hint: "",
            },
            Protected {
                start: 0x34,
                end: 0x3c,
                what: "the capability pointer".into(),
                hint: "",
            },
            Protected {
                start: 0x3d,
                end: 0x40,
                what: "interrupt pin/min_gnt/max_lat".into(),
                hint: "",
            },
        ];
        let mut flr_bit_at = None;
        for cap in capabilities(config).into_iter().filter(|c| !c.extended) {
            let start = usize::from(cap.offset);
            match cap.id {
                0x01 => p.push(Protected {
                    start,
                    end: start + 8,
                    what: format!("the power management capability at {start:#x}"),
                    hint: "",
                }),
                0x05 => p.push(Protected {
                    start,
                    end: start + 24,
                    what: format!("the msi capability at {start:#x}"),
                    hint: "; use SET_IRQS",
                }),
                0x11 => p.push(Protected {
                    start,
                    end: start + 12,
                    what: format!("the msi-x capability at {start:#x}"),
                    hint: "; use SET_IRQS",
                }),
                0x10 => {
                    // Device control register at +8; bit 15 = initiate FLR (byte +9, bit 7).
                    flr_bit_at = Some(start + 9);
                    // Capability header and device capabilities are read-only.
                    p.push(Protected {
                        start,
                        end: start + 8,
                        what: format!("the pci express capability header at {start:#x}"),
                        hint: "",
                    });
                }
                _ => {}
            }
        }
        ConfigFilter {
            protected: p,
            flr_bit_at,
            status_caps: config.get(6).copied().unwrap_or(0) & STATUS_CAP_LIST,
        }
    }

    /// Checks a write and returns the bytes to actually write (command BME replaced by the
    /// lender's current value `current_cmd`).
    pub fn filter_write(
        &self,
        offset: u16,
        data: &[u8],
        current_cmd: u16,
    ) -> Result<Vec<u8>, FilterError> {
        let start = usize::from(offset);
        let end = start + data.len();
        for p in &self.protected {
            if start < p.end && p.start < end {
                return Err(FilterError {
                    offset,
                    len: data.len(),
                    what: p.what.clone(),
                    hint: p.hint,
                });
            }
        }
        if let Some(at) = self.flr_bit_at {
            if (start..end).contains(&at) && data[at - start] & 0x80 != 0 {
                return Err(FilterError {
                    offset,
                    len: data.len(),
                    what: "the initiate-flr bit".into(),
                    hint: "; use RESET",
                });
            }
        }
        let mut out = data.to_vec();
        // Command register low byte holds I/O Space, Memory Space and BME: the lender's.
        if (start..end).contains(&4) {
            let i = 4 - start;
            let owned = CMD_LENDER_OWNED as u8;
            out[i] = (out[i] & !owned) | (current_cmd as u8 & owned);
        }
        // Status low byte: Capabilities List stays the device's.
        if (start..end).contains(&6) {
            let i = 6 - start;
            out[i] = (out[i] & !STATUS_CAP_LIST) | self.status_caps;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Vec<u8> {
        let mut c = vec![0u8; 256];
        c[6] = 0x10;
        c[0x34] = 0x40;
        c[0x40] = 0x01; // PM
        c[0x41] = 0x50;
        c[0x50] = 0x11; // MSI-X
        c[0x51] = 0x60;
        c[0x60] = 0x10; // PCIe
        c[0x61] = 0x00;
        c
    }

    #[test]
    fn protected_ranges_are_refused() {
        let f = ConfigFilter::from_config(&config());
        for (off, len) in [
            (0x10u16, 4usize),
            (0x24, 4),
            (0x0e, 4),
            (0x30, 4),
            (0x42, 2),
            (0x52, 2),
            (0x4f, 2),
            (0x00, 2),
        ] {
            let e = f.filter_write(off, &vec![0xff; len], 0).unwrap_err();
            assert_eq!(e.offset, off);
        }
        let e = f.filter_write(0x52, &[0, 0x80], 0).unwrap_err();
        assert!(e.to_string().contains("msi-x capability at 0x50"), "{e}");
        assert!(e.to_string().contains("SET_IRQS"), "{e}");
        // FLR bit in PCIe device control (0x68, bit 15).
        assert!(f.filter_write(0x68, &[0x10, 0x80], 0).is_err());
        assert!(f.filter_write(0x68, &[0x10, 0x28], 0).is_ok());
        // Cache line size, interrupt line, device-specific space: fine.
        assert!(f.filter_write(0x0c, &[0x10], 0).is_ok());
        assert!(f.filter_write(0x3c, &[0x0b], 0).is_ok());
        assert!(f.filter_write(0xa0, &[1, 2, 3, 4], 0).is_ok());
    }

    #[test]
    fn decode_and_bus_master_stay_with_the_lender() {
        let f = ConfigFilter::from_config(&config());
        // Borrower sets MEM|BME; lender has both clear.
        assert_eq!(
            f.filter_write(4, &[0x06, 0x00], 0).unwrap(),
            vec![0x00, 0x00]
        );
        // Borrower clears MEM and BME, sets INTx Disable; lender has IO|MEM|BME set: they
        // stay (vfio-pci refuses BAR accesses with Memory Space clear), INTx Disable passes.
        assert_eq!(
            f.filter_write(4, &[0x00, 0x04], 0x0007).unwrap(),
            vec![0x07, 0x04]
        );
        // Borrower clears BME; lender has it set.
        assert_eq!(f.filter_write(4, &[0x02], 0x0004).unwrap(), vec![0x04]);
        // Status writes go through, except that Capabilities List stays the device's.
        assert_eq!(
            f.filter_write(6, &[0xff, 0xff], 0).unwrap(),
            vec![0xff, 0xff]
        );
        assert_eq!(
            f.filter_write(6, &[0x00, 0xff], 0).unwrap(),
            vec![0x10, 0xff]
        );
        assert_eq!(
            f.filter_write(4, &[0, 0, 0, 0], 0).unwrap(),
            vec![0, 0, 0x10, 0]
        );
    }
}
