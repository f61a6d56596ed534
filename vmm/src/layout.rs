//! Guest physical memory map and fixed addresses (x86_64), as fixed by `docs/CONTRACTS.md`.

/// Flat GDT: null, 0x08 64-bit code, 0x10 data, 0x18 TSS placeholder.
pub const GDT_START: u64 = 0x500;
/// An empty IDT (limit 0): the guest installs its own.
pub const IDT_START: u64 = 0x520;
/// Linux `boot_params` (the "zero page").
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack pointer.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Identity page tables: PML4.
pub const PML4_START: u64 = 0x9000;
/// Identity page tables: the one PDPT.
pub const PDPT_START: u64 = 0xa000;
/// Identity page tables: four page directories (2 MiB pages) covering 4 GiB.
pub const PD_START: u64 = 0xb000;
/// Number of page directories (one per GiB).
pub const PD_COUNT: u64 = 4;
/// Extra page directory identity-mapping the first GiB of the 64-bit PCI BAR window.
pub const PD_MMIO64_START: u64 = 0xf000;
/// Kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
/// Maximum command line size including the NUL.
pub const CMDLINE_MAX_SIZE: usize = 0x10000;
/// Start of the EBDA / legacy hole (not RAM in e820).
pub const EBDA_START: u64 = 0x9fc00;
/// End of the legacy hole; low RAM for the kernel starts here.
pub const HIGH_MEMORY_START: u64 = 0x10_0000;
/// End of low RAM (start of the 32-bit PCI hole).
pub const MEM_32BIT_GAP_START: u64 = 0xc000_0000;
/// 32-bit PCI BAR window.
pub const PCI_MMIO32_START: u64 = 0xc000_0000;
/// Size of the 32-bit PCI BAR window.
pub const PCI_MMIO32_SIZE: u64 = 0x2000_0000;
/// PCI ECAM (MMCONFIG), segment 0.
pub const PCI_ECAM_START: u64 = 0xe000_0000;
/// ECAM size: 256 buses x 32 devices x 8 functions x 4 KiB.
pub const PCI_ECAM_SIZE: u64 = 0x1000_0000;
/// Platform MMIO: ACPI GED.
pub const ACPI_GED_START: u64 = 0xfe00_0000;
/// Platform MMIO: PCI hotplug controller (16 bytes).
pub const PCI_HOTPLUG_START: u64 = 0xfe00_1000;
/// IOAPIC.
pub const IOAPIC_START: u64 = 0xfec0_0000;
/// Local APIC.
pub const APIC_START: u64 = 0xfee0_0000;
/// High RAM starts at 4 GiB.
pub const RAM_64BIT_START: u64 = 0x1_0000_0000;

/// COM1.
pub const SERIAL_PORT: u64 = 0x3f8;
/// COM1 IRQ (IOAPIC pin / GSI).
pub const SERIAL_IRQ: u32 = 4;
/// Debug exit port: the value written becomes the `lendvm` exit code.
pub const DEBUG_EXIT_PORT: u64 = 0xf4;
/// PCI configuration mechanism #1 (0xcf8 address, 0xcfc..0xcff data).
pub const PCI_CONFIG_IO_PORT: u64 = 0xcf8;
/// Size of the config mechanism #1 port range.
pub const PCI_CONFIG_IO_PORT_SIZE: u64 = 8;

/// Number of legacy GSIs (IOAPIC pins); MSI GSIs are allocated above these.
pub const IOAPIC_PINS: u32 = 24;

/// 64-bit PCI BAR window start for a guest whose RAM ends at `ram_end` (1 GiB aligned).
pub fn pci_mmio64_start(ram_end: u64) -> u64 {
    const GIB: u64 = 1 << 30;
    ram_end.max(RAM_64BIT_START).div_ceil(GIB) * GIB
}
