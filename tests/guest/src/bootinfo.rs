//! Boot information from the Linux zero page (`boot_params`) the VMM puts at RSI: the e820
//! map and the command line (`tests=a,b,...`, `exit=N`, `fault=NAME`).

use crate::serial::Out;
use crate::Results;

const E820_ENTRIES: u64 = 0x1e8;
const CMD_LINE_PTR: u64 = 0x228;
const CMDLINE_SIZE: u64 = 0x238;
const E820_TABLE: u64 = 0x2d0;
const E820_ENTRY_SIZE: u64 = 20;
const E820_MAX: usize = 128;
const E820_RAM: u32 = 1;

fn rd<T: Copy>(addr: u64) -> T {
    // SAFETY: the zero page and command line are identity-mapped guest RAM written by the VMM.
    unsafe { core::ptr::read_unaligned(addr as *const T) }
}

#[derive(Clone, Copy, Default)]
pub struct E820Entry {
    pub addr: u64,
    pub size: u64,
    pub kind: u32,
}

pub struct BootInfo {
    pub e820: [E820Entry; E820_MAX],
    pub e820_len: usize,
    pub cmdline: &'static [u8],
    pub exit_code: Option<u8>,
    pub fault: Option<&'static [u8]>,
    tests: Option<&'static [u8]>,
}

fn parse_u8(s: &[u8]) -> Option<u8> {
    if s.is_empty() || s.len() > 3 {
        return None;
    }
    let mut v: u32 = 0;
    for &c in s {
        if !c.is_ascii_digit() {
            return None;
        }
        v = v * 10 + (c - b'0') as u32;
    }
    (v <= 255).then_some(v as u8)
}

/// Parses a decimal or `0x`-prefixed hex number.
pub fn parse_u64(s: &[u8]) -> Option<u64> {
    let (digits, radix) = match s.strip_prefix(b"0x") {
        Some(h) => (h, 16u64),
        None => (s, 10u64),
    };
    if digits.is_empty() || digits.len() > 16 {
        return None;
    }
    let mut v: u64 = 0;
    for &c in digits {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' if radix == 16 => c - b'a' + 10,
            b'A'..=b'F' if radix == 16 => c - b'A' + 10,
            _ => return None,
        };
        v = v.checked_mul(radix)?.checked_add(d as u64)?;
    }
    Some(v)
}

impl BootInfo {
    pub fn read(zero_page: u64) -> Self {
        let mut info = BootInfo {
            e820: [E820Entry::default(); E820_MAX],
            e820_len: 0,
            cmdline: &[],
            exit_code: None,
            fault: None,
            tests: None,
        };
        let n = (rd::<u8>(zero_page + E820_ENTRIES) as usize).min(E820_MAX);
        for (i, slot) in info.e820.iter_mut().take(n).enumerate() {
            let base = zero_page + E820_TABLE + i as u64 * E820_ENTRY_SIZE;
            *slot = E820Entry {
                addr: rd(base),
                size: rd(base + 8),
                kind: rd(base + 16),
            };
        }
        info.e820_len = n;
        let ptr = rd::<u32>(zero_page + CMD_LINE_PTR) as u64;
        let max = (rd::<u32>(zero_page + CMDLINE_SIZE) as usize).min(65536);
        if ptr != 0 {
            let mut len = 0;
            while len < max && rd::<u8>(ptr + len as u64) != 0 {
                len += 1;
            }
            // SAFETY: `len` bytes at `ptr` were just read one by one; RAM lives forever.
            info.cmdline = unsafe { core::slice::from_raw_parts(ptr as *const u8, len) };
        }
        for word in info.cmdline.split(|&c| c == b' ') {
            if let Some(v) = word.strip_prefix(b"exit=") {
                info.exit_code = parse_u8(v);
            } else if let Some(v) = word.strip_prefix(b"fault=") {
                info.fault = Some(v);
            } else if let Some(v) = word.strip_prefix(b"tests=") {
                info.tests = Some(v);
            }
        }
        info
    }

    /// Whether test group `name` is selected (all are, without `tests=`).
    pub fn wants(&self, name: &str) -> bool {
        match self.tests {
            None => true,
            Some(_) => self.wants_explicitly(name),
        }
    }

    /// Whether `tests=` names group `name` (for groups that need a device or the host's
    /// cooperation and so never run by default).
    pub fn wants_explicitly(&self, name: &str) -> bool {
        match self.tests {
            None => false,
            Some(list) => list.split(|&c| c == b',').any(|t| t == name.as_bytes()),
        }
    }

    /// The value of `key=VALUE` on the command line (the last one wins).
    pub fn param(&self, key: &str) -> Option<&'static [u8]> {
        let mut found = None;
        for word in self.cmdline.split(|&c| c == b' ') {
            if let Some(rest) = word.strip_prefix(key.as_bytes()) {
                if let Some(v) = rest.strip_prefix(b"=") {
                    found = Some(v);
                }
            }
        }
        found
    }

    /// A numeric parameter (decimal or `0x` hex), or `default` if absent or malformed.
    pub fn param_u64(&self, key: &str, default: u64) -> u64 {
        self.param(key).and_then(parse_u64).unwrap_or(default)
    }

    /// The valid e820 entries (iterator: no bounds-check panics, see `tests/build.rs`).
    pub fn entries(&self) -> impl Iterator<Item = &E820Entry> {
        self.e820.iter().take(self.e820_len)
    }

    pub fn ram_bytes(&self) -> u64 {
        self.entries()
            .filter(|e| e.kind == E820_RAM)
            .map(|e| e.size)
            .sum()
    }
}

/// Prints the e820 map and checks it has RAM at 1 MiB (where this guest runs).
pub fn test(info: &BootInfo, r: &mut Results) {
    for e in info.entries() {
        Out.s("e820 ")
            .hex(e.addr)
            .s(" ")
            .hex(e.size)
            .s(" type ")
            .dec(e.kind as u64)
            .nl();
    }
    let covers_image = info
        .entries()
        .any(|e| e.kind == E820_RAM && e.addr <= 0x10_0000 && e.addr + e.size > 0x40_0000);
    r.report("bootinfo", info.e820_len > 0 && covers_image)
        .s("e820 ")
        .dec(info.e820_len as u64)
        .s(" entries ram ")
        .dec(info.ram_bytes() >> 20)
        .s(" MiB cmdline \"")
        .bytes(info.cmdline)
        .s("\"")
        .nl();
}
