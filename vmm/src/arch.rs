//! x86_64 vCPU boot state: GDT, identity page tables, long-mode sregs, regs, FPU, MSRs, LAPIC.
//!
//! The guest enters directly in 64-bit mode (`docs/CONTRACTS.md`, boot contract).

use kvm_bindings::{
    kvm_fpu, kvm_lapic_state, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, Msrs,
};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress};

use crate::layout::{
    BOOT_STACK_POINTER, GDT_START, IDT_START, PDPT_START, PD_COUNT, PD_MMIO64_START, PD_START,
    PML4_START, ZERO_PAGE_START,
};
use crate::memory::GuestMemory;

/// Errors of vCPU register set-up.
#[derive(Debug, thiserror::Error)]
pub enum ArchError {
    #[error("cannot write the {what} at guest address {addr:#x}")]
    GuestWrite { what: &'static str, addr: u64 },
    #[error("KVM rejected the vCPU {what}")]
    Kvm {
        what: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("cannot build the MSR list")]
    MsrList,
}

/// Flat GDT: null, 64-bit code (0x08), data (0x10), TSS (0x18).
pub const GDT: [u64; 4] = [
    0,
    0x00af_9b00_0000_ffff,
    0x00cf_9300_0000_ffff,
    0x008f_8b00_0000_ffff,
];
/// Code segment selector.
pub const CODE_SELECTOR: u16 = 0x08;
/// Data segment selector.
pub const DATA_SELECTOR: u16 = 0x10;
/// TSS selector.
pub const TSS_SELECTOR: u16 = 0x18;

const X86_CR0_PE: u64 = 1 << 0;
const X86_CR0_ET: u64 = 1 << 4;
const X86_CR0_NE: u64 = 1 << 5;
const X86_CR0_PG: u64 = 1 << 31;
const X86_CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

fn segment_from_gdt(entry: u64, selector: u16) -> kvm_segment {
    let base = ((entry >> 16) & 0xff_ffff) | (((entry >> 56) & 0xff) << 24);
    let limit_raw = (entry & 0xffff) | (((entry >> 48) & 0xf) << 16);
    let g = ((entry >> 55) & 1) as u8;
    let limit = if g == 1 {
        (limit_raw << 12) | 0xfff
    } else {
        limit_raw
    };
    kvm_segment {
        base,
        limit: limit as u32,
        selector,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g,
        avl: ((entry >> 52) & 1) as u8,
        unusable: if (entry >> 47) & 1 == 1 { 0 } else { 1 },
        padding: 0,
    }
}

fn write<T: vm_memory::ByteValued>(
    mem: &GuestMemory,
    val: T,
    addr: u64,
    what: &'static str,
) -> Result<(), ArchError> {
    mem.write_obj(val, GuestAddress(addr))
        .map_err(|_| ArchError::GuestWrite { what, addr })
}

/// Writes the GDT, an empty IDT and identity page tables (2 MiB pages) for the first 4 GiB and
/// for the first GiB of the 64-bit PCI BAR window at `mmio64_start` (1 GiB aligned, below
/// 512 GiB), so a guest that does not build its own page tables reaches 64-bit BARs.
pub fn setup_boot_tables(mem: &GuestMemory, mmio64_start: u64) -> Result<(), ArchError> {
    for (i, e) in GDT.iter().enumerate() {
        write(mem, *e, GDT_START + 8 * i as u64, "GDT")?;
    }
    write(mem, 0u64, IDT_START, "IDT")?;
    write(mem, PDPT_START | 0x3, PML4_START, "PML4")?;
    for pd in 0..PD_COUNT {
        let pd_base = PD_START + pd * 0x1000;
        write(mem, pd_base | 0x3, PDPT_START + pd * 8, "PDPT")?;
        for i in 0..512u64 {
            let phys = ((pd << 9) | i) << 21;
            // Present | writable | page size (2 MiB).
            write(mem, phys | 0x83, pd_base + i * 8, "page directory")?;
        }
    }
    let gib = mmio64_start >> 30;
    if mmio64_start.is_multiple_of(1 << 30) && (PD_COUNT..512).contains(&gib) {
        write(mem, PD_MMIO64_START | 0x3, PDPT_START + gib * 8, "PDPT")?;
        for i in 0..512u64 {
            let phys = mmio64_start + (i << 21);
            write(mem, phys | 0x83, PD_MMIO64_START + i * 8, "page directory")?;
        }
    }
    Ok(())
}

/// Long-mode special registers: flat segments, GDT/IDT, paging on, no PCID (fails on PVM).
pub fn setup_sregs(vcpu: &VcpuFd) -> Result<(), ArchError> {
    let mut sregs: kvm_sregs = vcpu.get_sregs().map_err(|source| ArchError::Kvm {
        what: "special registers (get)",
        source,
    })?;
    let code = segment_from_gdt(GDT[1], CODE_SELECTOR);
    let data = segment_from_gdt(GDT[2], DATA_SELECTOR);
    let tss = segment_from_gdt(GDT[3], TSS_SELECTOR);
    sregs.gdt.base = GDT_START;
    sregs.gdt.limit = (std::mem::size_of_val(&GDT) - 1) as u16;
    sregs.idt.base = IDT_START;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;
    sregs.cr3 = PML4_START;
    sregs.cr4 |= X86_CR4_PAE;
    sregs.cr0 |= X86_CR0_PE | X86_CR0_PG | X86_CR0_ET | X86_CR0_NE;
    sregs.efer |= EFER_LME | EFER_LMA;
    vcpu.set_sregs(&sregs).map_err(|source| ArchError::Kvm {
        what: "special registers",
        source,
    })
}

/// General registers: entry point, stack, RSI = boot_params, interrupts off.
pub fn setup_regs(vcpu: &VcpuFd, entry: u64) -> Result<(), ArchError> {
    let regs = kvm_regs {
        rflags: 0x2,
        rip: entry,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rsi: ZERO_PAGE_START,
        ..Default::default()
    };
    vcpu.set_regs(&regs).map_err(|source| ArchError::Kvm {
        what: "registers",
        source,
    })
}

/// x87 control word and MXCSR reset values.
pub fn setup_fpu(vcpu: &VcpuFd) -> Result<(), ArchError> {
    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(|source| ArchError::Kvm {
        what: "FPU state",
        source,
    })
}

/// Boot MSRs (the Firecracker set), as `(index, value, name)`.
pub const BOOT_MSRS: &[(u32, u64, &str)] = &[
    (0x174, 0, "IA32_SYSENTER_CS"),
    (0x175, 0, "IA32_SYSENTER_ESP"),
    (0x176, 0, "IA32_SYSENTER_EIP"),
    (0xc000_0081, 0, "STAR"),
    (0xc000_0083, 0, "CSTAR"),
    (0xc000_0102, 0, "KERNEL_GS_BASE"),
    (0xc000_0084, 0, "SFMASK"),
    (0xc000_0082, 0, "LSTAR"),
    (0x10, 0, "IA32_TSC"),
    (0x1a0, 1, "IA32_MISC_ENABLE (fast strings)"),
    (0x2ff, (1 << 11) | 6, "MTRR_DEF_TYPE (enabled, write-back)"),
];

/// Sets [`BOOT_MSRS`], skipping (and logging) any KVM refuses; returns the names it took.
pub fn setup_msrs(vcpu: &VcpuFd) -> Result<Vec<&'static str>, ArchError> {
    let mut accepted = Vec::new();
    for (index, data, name) in BOOT_MSRS {
        let msrs = Msrs::from_entries(&[kvm_msr_entry {
            index: *index,
            data: *data,
            ..Default::default()
        }])
        .map_err(|_| ArchError::MsrList)?;
        match vcpu.set_msrs(&msrs) {
            Ok(1) => accepted.push(*name),
            Ok(_) => log::debug!("KVM did not accept MSR {index:#x} ({name}); skipped"),
            Err(e) => log::debug!("setting MSR {index:#x} ({name}) failed: {e}; skipped"),
        }
    }
    Ok(accepted)
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn lapic_reg(state: &kvm_lapic_state, off: usize) -> u32 {
    let b = &state.regs[off..off + 4];
    u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
}

fn set_lapic_reg(state: &mut kvm_lapic_state, off: usize, v: u32) {
    for (i, b) in v.to_le_bytes().iter().enumerate() {
        state.regs[off + i] = *b as _;
    }
}

fn delivery_mode(reg: u32, mode: u32) -> u32 {
    (reg & !0x700) | (mode << 8)
}

/// LAPIC LINT0 = ExtINT (the PIC), LINT1 = NMI, as on a PC.
pub fn setup_lapic(vcpu: &VcpuFd) -> Result<(), ArchError> {
    let mut state = vcpu.get_lapic().map_err(|source| ArchError::Kvm {
        what: "LAPIC (get)",
        source,
    })?;
    let lvt0 = lapic_reg(&state, APIC_LVT0);
    set_lapic_reg(&mut state, APIC_LVT0, delivery_mode(lvt0, APIC_MODE_EXTINT));
    let lvt1 = lapic_reg(&state, APIC_LVT1);
    set_lapic_reg(&mut state, APIC_LVT1, delivery_mode(lvt1, APIC_MODE_NMI));
    vcpu.set_lapic(&state).map_err(|source| ArchError::Kvm {
        what: "LAPIC",
        source,
    })
}

/// Walks the guest's 4-level page tables (CR3) to translate `gva`; `None` if not mapped.
pub fn translate(mem: &GuestMemory, cr3: u64, gva: u64) -> Option<u64> {
    const ADDR: u64 = 0x000f_ffff_ffff_f000;
    let mut table = cr3 & ADDR;
    for level in (0..4).rev() {
        let shift = 12 + 9 * level;
        let idx = (gva >> shift) & 0x1ff;
        let entry: u64 = mem.read_obj(GuestAddress(table + idx * 8)).ok()?;
        if entry & 1 == 0 {
            return None;
        }
        if level > 0 && level < 3 && entry & 0x80 != 0 {
            let page_mask = (1u64 << shift) - 1;
            return Some((entry & ADDR & !page_mask) | (gva & page_mask));
        }
        table = entry & ADDR;
    }
    Some(table | (gva & 0xfff))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::GuestRam;

    #[test]
    fn identity_tables_translate_to_themselves() {
        let ram = GuestRam::new(32 << 20).unwrap();
        setup_boot_tables(ram.memory(), 1 << 32).unwrap();
        for gva in [
            0u64,
            0x7000,
            0x20_1234,
            0xfee0_0030,
            0xffff_f000,
            0xe000_0000,
        ] {
            assert_eq!(translate(ram.memory(), PML4_START, gva), Some(gva));
        }
        // The first GiB of the 64-bit BAR window, nothing after it.
        assert_eq!(translate(ram.memory(), PML4_START, 1 << 32), Some(1 << 32));
        let top = (1u64 << 32) + (1 << 30) - 8;
        assert_eq!(translate(ram.memory(), PML4_START, top), Some(top));
        assert_eq!(
            translate(ram.memory(), PML4_START, (1 << 32) + (1 << 30)),
            None
        );
    }

    #[test]
    fn gdt_segments_decode() {
        let cs = segment_from_gdt(GDT[1], CODE_SELECTOR);
        assert_eq!((cs.l, cs.db, cs.type_, cs.present, cs.g), (1, 0, 0xb, 1, 1));
        assert_eq!(cs.limit, 0xffff_ffff);
        let ds = segment_from_gdt(GDT[2], DATA_SELECTOR);
        assert_eq!((ds.l, ds.db, ds.type_), (0, 1, 3));
    }
}
