//! Port I/O.

use core::arch::asm;

pub fn outb(port: u16, v: u8) {
    // SAFETY: port I/O has no memory effects visible to Rust.
    unsafe {
        asm!("out dx, al", in("dx") port, in("al") v, options(nomem, nostack, preserves_flags))
    }
}

pub fn inb(port: u16) -> u8 {
    let v: u8;
    // SAFETY: as above.
    unsafe {
        asm!("in al, dx", in("dx") port, out("al") v, options(nomem, nostack, preserves_flags))
    }
    v
}

pub fn outl(port: u16, v: u32) {
    // SAFETY: as above.
    unsafe {
        asm!("out dx, eax", in("dx") port, in("eax") v, options(nomem, nostack, preserves_flags))
    }
}

pub fn inl(port: u16) -> u32 {
    let v: u32;
    // SAFETY: as above.
    unsafe {
        asm!("in eax, dx", in("dx") port, out("eax") v, options(nomem, nostack, preserves_flags))
    }
    v
}
