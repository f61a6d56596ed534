//! IDT, exception reporting and interrupt tests: LAPIC timer, self-IPI, and an IOAPIC line
//! (COM1's IRQ 4, raised by the VMM through an irqfd).
//!
//! Handlers are tiny assembly stubs: count the interrupt, EOI the LAPIC, `iretq`. Exceptions
//! print their vector and stack words and end the run with code 3.

use core::ptr::{addr_of, addr_of_mut, read_volatile};

use crate::mmio::{read32, write32};
use crate::serial::Out;
use crate::Results;

pub const LAPIC_BASE: u64 = 0xfee0_0000;
const LAPIC_ID: u64 = 0x20;
const LAPIC_TPR: u64 = 0x80;
const LAPIC_EOI: u64 = 0xb0;
const LAPIC_SVR: u64 = 0xf0;
const LAPIC_ICR_LOW: u64 = 0x300;
const LAPIC_ICR_HIGH: u64 = 0x310;
const LAPIC_LVT_TIMER: u64 = 0x320;
const LAPIC_TIMER_INITIAL: u64 = 0x380;
const LAPIC_TIMER_DIVIDE: u64 = 0x3e0;

pub const TIMER_VECTOR: u8 = 0x30;
pub const IPI_VECTOR: u8 = 0x31;
pub const SERIAL_VECTOR: u8 = 0x32;
pub const SPURIOUS_VECTOR: u8 = 0xff;
/// Counted device vectors: `DEVICE_VECTOR_BASE + i` bumps `IRQ_COUNTS[i]` (i < 16).
pub const DEVICE_VECTOR_BASE: u8 = 0x40;
/// NVMe MSI-X table entry 0 (admin queue).
pub const NVME_ADMIN_VECTOR: u8 = 0x40;
/// NVMe MSI-X table entry 1 (the I/O completion queue).
pub const NVME_IO_VECTOR: u8 = 0x41;
/// dmatest MSI-X table entry 0.
pub const DMATEST_VECTOR: u8 = 0x42;
/// ACPI GED (IOAPIC pin 5, edge).
pub const GED_VECTOR: u8 = 0x48;
/// The periodic LAPIC tick that bounds every `wait_until` in real time.
pub const TICK_VECTOR: u8 = 0x4f;
/// Tick period: the LAPIC timer counts at 1 GHz under KVM (divide by 1).
const TICK_COUNT: u32 = 1_000_000;

pub const IOAPIC_BASE: u64 = 0xfec0_0000;
const IOAPIC_REGSEL: u64 = 0x00;
const IOAPIC_WIN: u64 = 0x10;
const SERIAL_IRQ: u32 = 4;

/// Interrupt counters, bumped by the assembly stubs.
#[no_mangle]
static mut IRQ_COUNT_TIMER: u64 = 0;
#[no_mangle]
static mut IRQ_COUNT_IPI: u64 = 0;
#[no_mangle]
static mut IRQ_COUNT_SERIAL: u64 = 0;
/// Counters of the device vectors 0x40..0x4f.
#[no_mangle]
static mut IRQ_COUNTS: [u64; 16] = [0; 16];

#[repr(C, packed)]
#[derive(Clone, Copy)]
struct IdtEntry {
    offset_low: u16,
    selector: u16,
    ist: u8,
    type_attr: u8,
    offset_mid: u16,
    offset_high: u32,
    reserved: u32,
}

const EMPTY: IdtEntry = IdtEntry {
    offset_low: 0,
    selector: 0,
    ist: 0,
    type_attr: 0,
    offset_mid: 0,
    offset_high: 0,
    reserved: 0,
};

#[repr(C, align(16))]
struct Idt([IdtEntry; 256]);

static mut IDT: Idt = Idt([EMPTY; 256]);

#[repr(C, packed)]
struct Idtr {
    limit: u16,
    base: u64,
}

core::arch::global_asm!(
    ".section .text",
    ".irp n, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31",
    "exc_stub_\\n:",
    "    push \\n",
    "    jmp exc_common",
    ".endr",
    "exc_common:",
    "    mov rdi, [rsp]",
    "    lea rsi, [rsp + 8]",
    "    and rsp, -16",
    "    call guest_exception",
    "3:  hlt",
    "    jmp 3b",
    ".global irq_stub_timer",
    "irq_stub_timer:",
    "    push rax",
    "    add qword ptr [rip + IRQ_COUNT_TIMER], 1",
    "    mov eax, 0xfee000b0",
    "    mov dword ptr [rax], 0",
    "    pop rax",
    "    iretq",
    ".global irq_stub_ipi",
    "irq_stub_ipi:",
    "    push rax",
    "    add qword ptr [rip + IRQ_COUNT_IPI], 1",
    "    mov eax, 0xfee000b0",
    "    mov dword ptr [rax], 0",
    "    pop rax",
    "    iretq",
    ".global irq_stub_serial",
    "irq_stub_serial:",
    "    push rax",
    "    add qword ptr [rip + IRQ_COUNT_SERIAL], 1",
    "    mov eax, 0xfee000b0",
    "    mov dword ptr [rax], 0",
    "    pop rax",
    "    iretq",
    ".irp n, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15",
    "irq_stub_dev_\\n:",
    "    push rax",
    "    add qword ptr [rip + IRQ_COUNTS + 8 * \\n], 1",
    "    mov eax, 0xfee000b0",
    "    mov dword ptr [rax], 0",
    "    pop rax",
    "    iretq",
    ".endr",
    ".global irq_stub_spurious",
    "irq_stub_spurious:",
    "    iretq",
    ".section .rodata",
    ".balign 8",
    ".global exc_stub_table",
    "exc_stub_table:",
    ".irp n, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31",
    "    .quad exc_stub_\\n",
    ".endr",
    ".global dev_stub_table",
    "dev_stub_table:",
    ".irp n, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15",
    "    .quad irq_stub_dev_\\n",
    ".endr",
);

extern "C" {
    static exc_stub_table: [u64; 32];
    static dev_stub_table: [u64; 16];
    fn irq_stub_timer();
    fn irq_stub_ipi();
    fn irq_stub_serial();
    fn irq_stub_spurious();
}

#[no_mangle]
extern "C" fn guest_exception(vector: u64, frame: *const u64) -> ! {
    // SAFETY: `frame` points at the CPU-pushed exception frame on our stack.
    let (w0, w1, w2) = unsafe { (*frame, *frame.add(1), *frame.add(2)) };
    Out.s("TEST exception fail vector ")
        .dec(vector)
        .s(" frame ")
        .hex(w0)
        .s(" ")
        .hex(w1)
        .s(" ")
        .hex(w2)
        .nl();
    crate::exit::exit(3)
}

fn set_gate(vector: u8, handler: u64) {
    let e = IdtEntry {
        offset_low: handler as u16,
        selector: 0x08,
        ist: 0,
        type_attr: 0x8e, // present, DPL 0, 64-bit interrupt gate
        offset_mid: (handler >> 16) as u16,
        offset_high: (handler >> 32) as u32,
        reserved: 0,
    };
    // SAFETY: single-threaded guest; the IDT is only written here, before `sti`.
    unsafe { (*addr_of_mut!(IDT)).0[vector as usize] = e };
}

/// Installs the IDT (exceptions 0..31, timer, IPI, spurious). Interrupts stay off.
pub fn init() {
    for v in 0..32u8 {
        // SAFETY: the table is a static array of 32 code addresses.
        let h = unsafe { (*addr_of!(exc_stub_table))[v as usize] };
        set_gate(v, h);
    }
    set_gate(TIMER_VECTOR, irq_stub_timer as *const () as u64);
    set_gate(IPI_VECTOR, irq_stub_ipi as *const () as u64);
    set_gate(SERIAL_VECTOR, irq_stub_serial as *const () as u64);
    set_gate(SPURIOUS_VECTOR, irq_stub_spurious as *const () as u64);
    for i in 0..16u8 {
        // SAFETY: the table is a static array of 16 code addresses.
        let h = unsafe { (*addr_of!(dev_stub_table))[i as usize] };
        set_gate(DEVICE_VECTOR_BASE + i, h);
    }
    // Mask both 8259s: with LINT0 in ExtINT mode an unprogrammed PIC would deliver legacy
    // IRQs on vectors 0..15 (the exception vectors).
    crate::io::outb(0x21, 0xff);
    crate::io::outb(0xa1, 0xff);
    let idtr = Idtr {
        limit: (core::mem::size_of::<Idt>() - 1) as u16,
        base: addr_of!(IDT) as u64,
    };
    // SAFETY: `idtr` describes the static IDT, which lives forever.
    unsafe { core::arch::asm!("lidt [{}]", in(reg) &idtr, options(nostack, readonly)) };
    // Software-enable the LAPIC (device MSIs and the tick need it; the irq test does it too).
    lapic_write(LAPIC_TPR, 0);
    lapic_write(LAPIC_SVR, 0x100 | SPURIOUS_VECTOR as u32);
}

/// This CPU's APIC id (MSI destination, IOAPIC destination).
pub fn apic_id() -> u32 {
    lapic_read(LAPIC_ID) >> 24
}

/// Interrupts taken so far on device vector `vector` (0x40..=0x4f; others read 0).
pub fn irq_count(vector: u8) -> u64 {
    let i = vector.wrapping_sub(DEVICE_VECTOR_BASE) as usize;
    // SAFETY: the counters are only written by the interrupt stubs; `get` bounds the index.
    unsafe {
        (*addr_of!(IRQ_COUNTS))
            .get(i)
            .map_or(0, |c| read_volatile(c))
    }
}

/// Routes IOAPIC pin `pin` to `vector` on this CPU (fixed, physical, active high, edge).
pub fn ioapic_route_edge(pin: u32, vector: u8) {
    ioapic_write(0x10 + 2 * pin + 1, apic_id() << 24);
    ioapic_write(0x10 + 2 * pin, vector as u32);
}

/// Masks IOAPIC pin `pin`.
pub fn ioapic_mask(pin: u32) {
    ioapic_write(0x10 + 2 * pin, 1 << 16);
}

/// Milliseconds of ticks taken so far (a lower bound of elapsed time: ticks that arrive
/// while interrupts are off coalesce).
pub fn ticks() -> u64 {
    irq_count(TICK_VECTOR)
}

/// Starts the periodic 1 ms LAPIC tick (idempotent); it bounds every [`wait_until`].
pub fn start_ticks() {
    if lapic_read(LAPIC_LVT_TIMER) == (1 << 17) | TICK_VECTOR as u32
        && lapic_read(LAPIC_TIMER_INITIAL) == TICK_COUNT
    {
        return;
    }
    lapic_write(LAPIC_TIMER_DIVIDE, 0xb); // divide by 1
    lapic_write(LAPIC_LVT_TIMER, (1 << 17) | TICK_VECTOR as u32); // periodic
    lapic_write(LAPIC_TIMER_INITIAL, TICK_COUNT);
}

/// Halts (interrupts on) until `cond()` holds or about `timeout_ms` ticks pass. `cond` runs
/// with interrupts off, before every `hlt` and after every wake-up (any interrupt: the tick,
/// a device MSI, the GED). Returns whether `cond` held. Interrupts are off on return.
/// The bound of a wait for something that must come (an interrupt, a completion): a wait
/// ends as soon as it comes, so this costs nothing when things work; it is long because on a
/// loaded two-core host the VMM's and the lender's threads can be off the CPU for seconds,
/// and a guess at the host's speed would fail by chance there.
pub const MUST_ARRIVE_MS: u64 = 30_000;

pub fn wait_until(mut cond: impl FnMut() -> bool, timeout_ms: u64) -> bool {
    start_ticks();
    let start = ticks();
    loop {
        cli();
        if cond() {
            return true;
        }
        if ticks().wrapping_sub(start) >= timeout_ms {
            return false;
        }
        // SAFETY: `sti; hlt` is atomic with respect to interrupts (STI shadow): a pending
        // interrupt wakes the `hlt` instead of being taken before it. The IDT is installed.
        unsafe { core::arch::asm!("sti", "hlt", options(nomem, nostack)) };
    }
}

/// Spins (interrupts off) up to `spins` times for `cond()`, then falls back to
/// [`wait_until`]: cheap for completions that are already there, bounded otherwise.
pub fn poll_then_wait(mut cond: impl FnMut() -> bool, spins: u32, timeout_ms: u64) -> bool {
    for _ in 0..spins {
        if cond() {
            return true;
        }
    }
    wait_until(cond, timeout_ms)
}

fn lapic_write(reg: u64, v: u32) {
    write32(LAPIC_BASE + reg, v)
}

fn lapic_read(reg: u64) -> u32 {
    read32(LAPIC_BASE + reg)
}

fn count(c: *const u64) -> u64 {
    // SAFETY: the counters are only written by the interrupt stubs.
    unsafe { read_volatile(c) }
}

fn sti() {
    // SAFETY: the IDT is installed.
    unsafe { core::arch::asm!("sti", options(nomem, nostack)) }
}

fn cli() {
    // SAFETY: masking interrupts is always allowed at CPL 0.
    unsafe { core::arch::asm!("cli", options(nomem, nostack)) }
}

/// Spins (interrupts on) until `*c` reaches `want` or `limit` spins pass; returns the spins.
fn wait_for(c: *const u64, want: u64, limit: u32) -> Option<u32> {
    let mut spins = 0;
    sti();
    while count(c) < want {
        if spins >= limit {
            cli();
            return None;
        }
        spins += 1;
    }
    cli();
    Some(spins)
}

/// Bounded so a lost interrupt costs well under a second of emulated time.
const SPIN_LIMIT: u32 = 200_000;

/// LAPIC timer (one-shot) and a self-IPI, each delivered through the IDT and returned from
/// with `iretq`.
pub fn test(r: &mut Results) {
    lapic_write(LAPIC_TPR, 0);
    lapic_write(LAPIC_SVR, 0x100 | SPURIOUS_VECTOR as u32);
    let id = lapic_read(LAPIC_ID) >> 24;

    lapic_write(LAPIC_TIMER_DIVIDE, 0xb); // divide by 1
    lapic_write(LAPIC_LVT_TIMER, TIMER_VECTOR as u32); // one-shot, unmasked
    lapic_write(LAPIC_TIMER_INITIAL, 10_000);
    let timer_count = addr_of!(IRQ_COUNT_TIMER);
    let got = wait_for(timer_count, 1, SPIN_LIMIT);
    let o = r.report("irq-lapic-timer", got.is_some());
    match got {
        Some(spins) => o
            .s("vector ")
            .hex(TIMER_VECTOR as u64)
            .s(" delivered after ")
            .dec(spins as u64)
            .s(" spins, apic id ")
            .dec(id as u64)
            .nl(),
        None => o.s("no timer interrupt within the spin limit").nl(),
    }

    let ipi_count = addr_of!(IRQ_COUNT_IPI);
    lapic_write(LAPIC_ICR_HIGH, 0);
    lapic_write(LAPIC_ICR_LOW, (1 << 18) | IPI_VECTOR as u32); // shorthand: self, fixed
    let got = wait_for(ipi_count, 1, SPIN_LIMIT);
    let o = r.report("irq-self-ipi", got.is_some());
    match got {
        Some(spins) => o
            .s("vector ")
            .hex(IPI_VECTOR as u64)
            .s(" delivered after ")
            .dec(spins as u64)
            .s(" spins")
            .nl(),
        None => o.s("no IPI within the spin limit").nl(),
    }
    let _ = LAPIC_EOI;

    // IOAPIC pin 4 -> vector 0x32 (fixed, physical, edge, unmasked) to this CPU; then let the
    // UART raise its THR-empty interrupt.
    ioapic_write(0x10 + 2 * SERIAL_IRQ + 1, id << 24);
    ioapic_write(0x10 + 2 * SERIAL_IRQ, SERIAL_VECTOR as u32);
    let serial_count = addr_of!(IRQ_COUNT_SERIAL);
    crate::serial::enable_thre_interrupt(true);
    let got = wait_for(serial_count, 1, SPIN_LIMIT);
    crate::serial::enable_thre_interrupt(false);
    ioapic_write(0x10 + 2 * SERIAL_IRQ, 1 << 16); // mask the pin again
    let o = r.report("irq-ioapic-serial", got.is_some());
    match got {
        Some(spins) => o
            .s("irq 4 vector ")
            .hex(SERIAL_VECTOR as u64)
            .s(" delivered after ")
            .dec(spins as u64)
            .s(" spins")
            .nl(),
        None => o.s("no COM1 interrupt through the IOAPIC").nl(),
    }
}

fn ioapic_write(reg: u32, v: u32) {
    write32(IOAPIC_BASE + IOAPIC_REGSEL, reg);
    write32(IOAPIC_BASE + IOAPIC_WIN, v);
}
