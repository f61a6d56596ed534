//! COM1 output (polled) and number printing without `core::fmt`.

use crate::io::{inb, outb};

const COM1: u16 = 0x3f8;
const LSR: u16 = COM1 + 5;
const LSR_THRE: u8 = 0x20;

pub fn init() {
    outb(COM1 + 1, 0x00); // IER: no interrupts
    outb(COM1 + 3, 0x80); // DLAB
    outb(COM1, 0x01); // 115200 baud
    outb(COM1 + 1, 0x00);
    outb(COM1 + 3, 0x03); // 8N1
    outb(COM1 + 2, 0xc7); // FIFO
    outb(COM1 + 4, 0x0b); // DTR RTS OUT2
}

/// Enables (or disables) the UART's transmitter-empty interrupt (IER bit 1).
pub fn enable_thre_interrupt(on: bool) {
    outb(COM1 + 1, if on { 0x02 } else { 0x00 });
}

pub fn putc(c: u8) {
    let mut spins = 0u32;
    while inb(LSR) & LSR_THRE == 0 && spins < 100_000 {
        spins += 1;
    }
    outb(COM1, c);
}

/// Chained console writer: `Out.s("x = ").hex(v).nl()`.
#[derive(Clone, Copy)]
pub struct Out;

impl Out {
    pub fn s(self, s: &str) -> Self {
        for b in s.bytes() {
            putc(b);
        }
        self
    }

    pub fn bytes(self, s: &[u8]) -> Self {
        for &b in s {
            putc(b);
        }
        self
    }

    pub fn dec(self, mut v: u64) -> Self {
        let mut buf = [0u8; 20];
        let mut i = buf.len();
        loop {
            i -= 1;
            buf[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 || i == 0 {
                break;
            }
        }
        self.bytes(buf.get(i..).unwrap_or(&[]))
    }

    /// `0x` and lower-case hex digits, no leading zeros.
    pub fn hex(self, v: u64) -> Self {
        let digits = if v == 0 {
            1
        } else {
            (67 - v.leading_zeros() as usize) / 4
        };
        self.s("0x").hex_digits(v, digits)
    }

    /// Exactly `digits` hex digits, zero padded, no prefix.
    pub fn hex_digits(self, v: u64, digits: usize) -> Self {
        let mut d = digits;
        while d > 0 {
            d -= 1;
            let nib = ((v >> (d * 4)) & 0xf) as u8;
            putc(if nib < 10 {
                b'0' + nib
            } else {
                b'a' + nib - 10
            });
        }
        self
    }

    pub fn nl(self) {
        putc(b'\n');
    }
}
