//! The C memory functions the compiler may call, with `rep movsb` / `rep stosb` (no SSE).

use core::arch::asm;

#[no_mangle]
/// # Safety
/// Standard `memcpy` contract.
pub unsafe extern "C" fn memcpy(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // SAFETY: caller guarantees both ranges are valid and do not overlap.
    unsafe {
        asm!("rep movsb", inout("rcx") n => _, inout("rdi") dst => _, inout("rsi") src => _,
             options(nostack, preserves_flags));
    }
    dst
}

#[no_mangle]
/// # Safety
/// Standard `memmove` contract.
pub unsafe extern "C" fn memmove(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    if (dst as usize) <= (src as usize) || (dst as usize) >= (src as usize).wrapping_add(n) {
        // SAFETY: forward copy is safe when dst is below src or the ranges are disjoint.
        return unsafe { memcpy(dst, src, n) };
    }
    // SAFETY: backward copy with the direction flag set, restored afterwards.
    unsafe {
        asm!("std", "rep movsb", "cld",
             inout("rcx") n => _, inout("rdi") dst.add(n - 1) => _, inout("rsi") src.add(n - 1) => _,
             options(nostack));
    }
    dst
}

#[no_mangle]
/// # Safety
/// Standard `memset` contract.
pub unsafe extern "C" fn memset(dst: *mut u8, c: i32, n: usize) -> *mut u8 {
    // SAFETY: caller guarantees the range is valid.
    unsafe {
        asm!("rep stosb", inout("rcx") n => _, inout("rdi") dst => _, in("al") c as u8,
             options(nostack, preserves_flags));
    }
    dst
}

#[no_mangle]
/// # Safety
/// Standard `memcmp` contract.
pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    let mut i = 0;
    while i < n {
        // SAFETY: caller guarantees both ranges are valid for `n` bytes.
        let (x, y) = unsafe { (*a.add(i), *b.add(i)) };
        if x != y {
            return x as i32 - y as i32;
        }
        i += 1;
    }
    0
}

#[no_mangle]
/// # Safety
/// Standard `bcmp` contract.
pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    // SAFETY: same contract as memcmp.
    unsafe { memcmp(a, b, n) }
}
