//! The endpoint test function: the register protocol Linux's `pci_endpoint_test` driver
//! speaks (IRQ_NUMBER, then COMMAND; its handler reads and clears STATUS), at a GPU's
//! interrupt count.

use std::sync::Arc;

use emulated::epftest::*;
use emulated::testing::CountingInterrupts;
use emulated::{DeviceModel, HeapRegisters, InterruptMode, RegisterMemory};

fn w32(dev: &EpfTest, off: u64, v: u32) {
    dev.bar_write(0, off, &v.to_le_bytes());
}

/// What the driver does for PCITEST_MSIX n: IRQ_TYPE, IRQ_NUMBER, COMMAND; then its handler
/// reads STATUS and writes it back without the raised bit.
fn raise(dev: &EpfTest, regs: &HeapRegisters, n: u32) -> bool {
    w32(dev, REG_IRQ_TYPE, 2);
    w32(dev, REG_IRQ_NUMBER, n);
    w32(dev, REG_COMMAND, COMMAND_RAISE_MSIX_IRQ);
    let st = regs.read32(REG_STATUS);
    w32(dev, REG_STATUS, st & !STATUS_IRQ_RAISED);
    st & STATUS_IRQ_RAISED != 0
}

#[test]
fn every_vector_of_a_2048_vector_table_is_raised_on_request_and_nothing_else() {
    let regs = Arc::new(HeapRegisters::new(BAR0_SIZE as usize));
    let irq = CountingInterrupts::new(MAX_VECTORS);
    let dev = EpfTest::new(regs.clone(), irq.clone(), MAX_VECTORS).unwrap();
    dev.start().unwrap();
    let m = dev.msix().unwrap();
    assert_eq!((m.vectors, m.table_bar, m.pba_offset), (2048, 1, 0x8000));
    assert_eq!(dev.bars()[1].size, 0x10000, "table and PBA in BAR1");
    assert_eq!(dev.config_space()[0x00..0x04], [0x36, 0x1b, 0x06, 0x11]);
    // MSI-X off: nothing is signalled, the status says nothing was raised.
    irq.set_mode(InterruptMode::None);
    assert!(!raise(&dev, &regs, 1));
    assert_eq!(irq.count(0), 0);
    irq.set_mode(InterruptMode::MsiX { vectors: 2048 });
    for n in 1..=2048u32 {
        assert!(raise(&dev, &regs, n), "vector {n}");
    }
    assert!((0..2048).all(|v| irq.count(v) == 1), "each vector once");
    // Past the table (and 0, the driver's numbers are 1-based): refused.
    for n in [0, 2049, u32::MAX] {
        assert!(!raise(&dev, &regs, n), "{n}");
    }
    assert!((0..2048).all(|v| irq.count(v) == 1));
    // The data commands are not implemented: their failure bits, no interrupt.
    w32(&dev, REG_COMMAND, 1 << 3);
    assert_eq!(regs.read32(REG_STATUS) & (1 << 1), 1 << 1);
    dev.reset();
    assert_eq!(regs.read32(REG_STATUS), 0);
}

#[test]
fn a_vector_count_outside_the_pci_limit_is_refused() {
    let regs = Arc::new(HeapRegisters::new(BAR0_SIZE as usize));
    for bad in [0u16, 2049] {
        let e = EpfTest::new(regs.clone(), CountingInterrupts::new(1), bad)
            .err()
            .unwrap();
        assert!(e.to_string().contains("1 to 2048"), "{e}");
    }
    assert_eq!(msix_bar_size(128), 0x2000);
    assert_eq!(msix_bar_size(1), 0x2000);
}
