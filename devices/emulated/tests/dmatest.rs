//! The dmatest copy engine.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test/bench code

use std::sync::Arc;
use std::time::{Duration, Instant};

use emulated::dmatest::*;
use emulated::testing::{CountingInterrupts, GuestIrq, GuestRam, TestMemory};
use emulated::{DeviceModel, HeapRegisters, InterruptMode, NotifyMode, RegisterMemory};

fn setup(
    notify: NotifyMode,
) -> (
    Arc<TestMemory>,
    Arc<HeapRegisters>,
    Arc<CountingInterrupts>,
    DmaTest,
) {
    let mem = TestMemory::with_window(8 << 20, 1 << 20, 4 << 20);
    let regs = Arc::new(HeapRegisters::new(BAR0_SIZE as usize));
    let irq = CountingInterrupts::new(VECTORS);
    let dev = DmaTest::new(regs.clone(), mem.clone(), irq.clone(), notify).unwrap();
    dev.start().unwrap();
    (mem, regs, irq, dev)
}

fn run_copy(dev: &DmaTest, src: u64, dst: u64, len: u32) -> u32 {
    dev.bar_write(0, REG_SRC, &src.to_le_bytes());
    dev.bar_write(0, REG_DST, &dst.to_le_bytes());
    dev.bar_write(0, REG_LEN, &len.to_le_bytes());
    dev.bar_write(0, REG_IRQ_VECTOR, &1u32.to_le_bytes());
    let mut b = [0u8; 4];
    dev.bar_read(0, REG_COMPLETED, &mut b);
    let before = u32::from_le_bytes(b);
    dev.bar_write(0, REG_CMD, &CMD_START.to_le_bytes());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        dev.bar_read(0, REG_COMPLETED, &mut b);
        if u32::from_le_bytes(b) != before {
            break;
        }
        assert!(Instant::now() < deadline, "copy did not complete");
        std::thread::sleep(Duration::from_micros(100));
    }
    dev.bar_read(0, REG_STATUS, &mut b);
    u32::from_le_bytes(b)
}

#[test]
fn dmatest_copy_in_window_raises_msix() {
    for notify in [NotifyMode::Interrupt, NotifyMode::Polling] {
        let (mem, regs, irq, dev) = setup(notify);
        assert_eq!(regs.read32(REG_ID), DMATEST_ID);
        let data: Vec<u8> = (0..65536u32).map(|i| (i * 31 % 255) as u8).collect();
        GuestRam::write(&*mem, 0x10_0000 + 100, &data);
        let st = run_copy(&dev, 0x10_0000 + 100, 0x20_0000 + 3, data.len() as u32);
        assert_eq!(st, STATUS_DONE);
        assert!(irq.wait(1, Duration::from_secs(5)));
        assert_eq!(irq.count(1), 1);
        let mut out = vec![0u8; data.len()];
        GuestRam::read(&*mem, 0x20_0000 + 3, &mut out);
        assert_eq!(out, data);
        assert_eq!(regs.read32(REG_FAULTS), 0);
    }
}

#[test]
fn dmatest_out_of_window_refused() {
    let (mem, regs, irq, dev) = setup(NotifyMode::Interrupt);
    mem.fill(0, 1 << 20, 0x77);
    mem.fill(4 << 20, 4 << 20, 0x66);
    // Destination outside (below the window), source outside (above), straddling the end.
    for (src, dst, len) in [
        (0x10_0000u64, 0x8_0000u64, 4096u32),
        (5 << 20, 0x20_0000, 4096),
        (0x10_0000, (4 << 20) - 100, 4096),
        (0x10_0000, 0x20_0000, MAX_LEN + 1),
    ] {
        let st = run_copy(&dev, src, dst, len);
        assert_eq!(st, STATUS_ERROR, "{src:#x}->{dst:#x}");
    }
    assert_eq!(regs.read32(REG_FAULTS), 4);
    assert!(mem.faults() >= 3);
    assert!(mem.check(0, 1 << 20, 0x77));
    assert!(mem.check(4 << 20, 4 << 20, 0x66));
    assert_eq!(irq.count(1), 4, "errors still complete with an interrupt");
}

#[test]
fn dmatest_intx_and_reset() {
    let (_mem, regs, irq, dev) = setup(NotifyMode::Polling);
    irq.set_mode(InterruptMode::Intx);
    assert_eq!(run_copy(&dev, 0x10_0000, 0x20_0000, 512), STATUS_DONE);
    assert!(irq.intx_level());
    dev.bar_write(0, REG_CMD, &CMD_ACK.to_le_bytes());
    let deadline = Instant::now() + Duration::from_secs(5);
    while irq.intx_level() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!irq.intx_level());
    // Read-only registers ignore writes; reset clears.
    dev.bar_write(0, REG_FAULTS, &9u32.to_le_bytes());
    assert_eq!(regs.read32(REG_FAULTS), 0);
    dev.reset();
    assert_eq!(regs.read32(REG_COMPLETED), 0);
    assert_eq!(regs.read64(REG_SRC), 0);
    let cs = dev.config_space();
    assert_eq!(&cs[0..2], &[0x36, 0x1b]);
}

#[test]
fn dmatest_intx_resample_reasserts_until_acked() {
    let (_mem, _regs, irq, dev) = setup(NotifyMode::Interrupt);
    irq.set_mode(InterruptMode::Intx);
    assert_eq!(run_copy(&dev, 0x10_0000, 0x20_0000, 512), STATUS_DONE);
    assert!(irq.intx_level());
    let n = irq.intx_signals();
    dev.intx_resample();
    assert_eq!(irq.intx_signals(), n + 1, "done, not acked: asserted again");
    dev.bar_write(0, REG_CMD, &CMD_ACK.to_le_bytes());
    let deadline = Instant::now() + Duration::from_secs(5);
    while irq.intx_level() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!irq.intx_level());
    dev.intx_resample();
    assert_eq!(irq.intx_signals(), n + 1, "acked: nothing to re-assert");
}

#[test]
fn dmatest_doorbell_range_covers_only_plain_registers() {
    let (_mem, _regs, _irq, dev) = setup(NotifyMode::Interrupt);
    let r = dev.bars()[0].doorbells.unwrap();
    for reg in [REG_SRC, REG_DST, REG_LEN, REG_IRQ_VECTOR, REG_CMD] {
        assert!(r.contains(reg, 4), "{reg:#x}");
    }
    for reg in [REG_ID, REG_STATUS, REG_FAULTS, REG_COMPLETED] {
        assert!(!r.contains(reg, 4), "{reg:#x}");
    }
}

/// Runs one copy with CMD flags (the buffer variants).
fn run_copy_flags(dev: &DmaTest, flags: u32, src: u64, dst: u64, len: u32) -> u32 {
    dev.bar_write(0, REG_SRC, &src.to_le_bytes());
    dev.bar_write(0, REG_DST, &dst.to_le_bytes());
    dev.bar_write(0, REG_LEN, &len.to_le_bytes());
    let mut b = [0u8; 4];
    dev.bar_read(0, REG_COMPLETED, &mut b);
    let before = u32::from_le_bytes(b);
    dev.bar_write(0, REG_CMD, &(CMD_START | flags).to_le_bytes());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        dev.bar_read(0, REG_COMPLETED, &mut b);
        if u32::from_le_bytes(b) != before {
            break;
        }
        assert!(Instant::now() < deadline, "copy did not complete");
        std::thread::sleep(Duration::from_micros(100));
    }
    dev.bar_read(0, REG_STATUS, &mut b);
    u32::from_le_bytes(b)
}

/// The buffer in BAR0: RAM → buffer, buffer → buffer, buffer → RAM; offsets outside the
/// buffer or unaligned are refused and counted; only the buffer is peer memory; a reset
/// clears it.
#[test]
fn dmatest_buffer_copies_bounds_and_reset() {
    let (mem, regs, _irq, dev) = setup(NotifyMode::Interrupt);
    assert_eq!(dev.peer_memory(0), Some((BUF_OFFSET, BUF_SIZE)));
    assert_eq!(dev.peer_memory(1), None);
    let data: Vec<u8> = (0..0x2000u32).map(|i| (i * 13 + 7) as u8).collect();
    GuestRam::write(&*mem, 0x10_0000, &data);
    assert_eq!(
        run_copy_flags(&dev, CMD_DST_BUF, 0x10_0000, 0x800, 0x2000),
        STATUS_DONE
    );
    let word = |off: u64| regs.read64(BUF_OFFSET + off).to_le_bytes();
    assert_eq!(word(0x800), data[..8]);
    assert_eq!(
        run_copy_flags(&dev, CMD_SRC_BUF | CMD_DST_BUF, 0x800, 0x8000, 0x2000),
        STATUS_DONE
    );
    assert_eq!(
        run_copy_flags(&dev, CMD_SRC_BUF, 0x8000, 0x30_0000, 0x2000),
        STATUS_DONE
    );
    let mut out = vec![0u8; 0x2000];
    GuestRam::read(&*mem, 0x30_0000, &mut out);
    assert_eq!(out, data);
    for (flags, src, dst, len) in [
        (CMD_DST_BUF, 0x10_0000u64, BUF_SIZE - 8, 16u32),
        (CMD_SRC_BUF, BUF_SIZE, 0x30_0000, 8),
        (CMD_SRC_BUF, 4, 0x30_0000, 8),
        (CMD_DST_BUF, 0x10_0000, 0, 12),
        (CMD_SRC_BUF, u64::MAX - 7, 0x30_0000, 8),
    ] {
        let st = run_copy_flags(&dev, flags, src, dst, len);
        assert_eq!(st, STATUS_ERROR, "{flags:#x} {src:#x}->{dst:#x} {len:#x}");
    }
    assert_eq!(regs.read32(REG_FAULTS), 5);
    dev.reset();
    assert!((BUF_OFFSET..BAR0_SIZE)
        .step_by(8)
        .all(|o| regs.read64(o) == 0));
}

/// A configured buffer (`dmatest:buf=`): BAR0 grows to the next power of two, the buffer is
/// the peer memory, a copy may be as long as the buffer (beyond MAX_LEN), the bounds move
/// with it, and a too-small register memory or a bad size is refused.
#[test]
fn dmatest_buffer_size_is_configurable() {
    let buf = 2u64 << 20;
    assert_eq!(bar0_size_for(BUF_SIZE), BAR0_SIZE, "default unchanged");
    assert_eq!(bar0_size_for(buf), 4 << 20);
    let mem = TestMemory::with_window(8 << 20, 1 << 20, 4 << 20);
    let irq = CountingInterrupts::new(VECTORS);
    let small = Arc::new(HeapRegisters::new(BAR0_SIZE as usize));
    assert!(
        DmaTest::with_buffer(small, mem.clone(), irq.clone(), NotifyMode::Interrupt, buf).is_err()
    );
    for bad in [0, 100, MAX_BUF_SIZE + 4096] {
        let regs = Arc::new(HeapRegisters::new(BAR0_SIZE as usize));
        let e = DmaTest::with_buffer(regs, mem.clone(), irq.clone(), NotifyMode::Interrupt, bad)
            .err()
            .unwrap();
        assert!(e.to_string().contains("multiple of 4 KiB"), "{e}");
    }
    let regs = Arc::new(HeapRegisters::new(bar0_size_for(buf) as usize));
    let dev =
        DmaTest::with_buffer(regs.clone(), mem.clone(), irq, NotifyMode::Interrupt, buf).unwrap();
    dev.start().unwrap();
    assert_eq!(dev.peer_memory(0), Some((BUF_OFFSET, buf)));
    assert_eq!(dev.bars()[0].size, 4 << 20);
    // 2 MiB from RAM into the buffer: longer than MAX_LEN, within the buffer.
    let data: Vec<u8> = (0..buf as u32).map(|i| (i * 7 + 1) as u8).collect();
    GuestRam::write(&*mem, 0x10_0000, &data);
    assert_eq!(
        run_copy_flags(&dev, CMD_DST_BUF, 0x10_0000, 0, buf as u32),
        STATUS_DONE
    );
    assert_eq!(
        regs.read64(BUF_OFFSET + buf - 8).to_le_bytes(),
        data[data.len() - 8..]
    );
    // One word past the end is refused.
    assert_eq!(
        run_copy_flags(&dev, CMD_DST_BUF, 0x10_0000, buf - 8, 16),
        STATUS_ERROR
    );
    dev.reset();
    assert_eq!(
        regs.read64(BUF_OFFSET + buf - 8),
        0,
        "reset clears the whole buffer"
    );
}

/// A memfd of `len` bytes, mapped shared (the lender's register memory is one); unmapped and
/// closed on drop.
struct Memfd {
    fd: std::os::fd::OwnedFd,
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is shared memory reached only through atomics and raw copies.
unsafe impl Send for Memfd {}
// SAFETY: as above.
unsafe impl Sync for Memfd {}

impl Memfd {
    fn new(len: usize) -> Memfd {
        use std::os::fd::FromRawFd;
        // SAFETY: plain syscalls; the fd is owned right away, the mapping by the value.
        unsafe {
            let fd = libc::memfd_create(c"dmatest-large".as_ptr(), 0);
            assert!(fd >= 0);
            let fd = std::os::fd::OwnedFd::from_raw_fd(fd);
            use std::os::fd::AsRawFd;
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t), 0);
            let base = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                fd.as_raw_fd(),
                0,
            );
            assert_ne!(base, libc::MAP_FAILED);
            Memfd {
                fd,
                base: base.cast(),
                len,
            }
        }
    }

    /// Bytes of memory the file holds (allocated blocks).
    fn allocated(&self) -> u64 {
        use std::os::fd::AsRawFd;
        // SAFETY: a C struct of integers, for which all zeroes is a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat into that struct on an fd we own.
        let r = unsafe { libc::fstat(self.fd.as_raw_fd(), &mut st) };
        assert_eq!(r, 0);
        st.st_blocks as u64 * 512
    }
}

impl Drop for Memfd {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping this value made.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// A GPU-aperture-sized buffer (`dmatest:buf=` near 64 GiB) on a memfd, as on the lender:
/// BAR0 becomes a 64-bit prefetchable BAR (MSI-X moves to BAR 2), the buffer costs memory
/// only where written (the first page, one past 4 GiB, the last), copies out of it work at
/// any offset, a copy longer than the large-buffer limit is refused (the staging buffer must
/// not grow to the aperture), and a reset gives the pages back instead of writing 64 GiB of
/// zeroes.
#[test]
fn dmatest_a_large_buffer_is_a_sparse_64bit_prefetchable_bar() {
    let buf = (64u64 << 30) - BUF_OFFSET;
    let size = bar0_size_for(buf);
    assert_eq!(size, 64 << 30);
    let shm = Memfd::new(size as usize);
    let base = shm.base;
    // SAFETY: the mapping is page aligned, `size` bytes long and owned by `shm`, which the
    // registers keep.
    let regs =
        Arc::new(unsafe { emulated::MappedRegisters::with_backing(shm, base, size as usize) });
    let mem = TestMemory::with_window(8 << 20, 1 << 20, 4 << 20);
    let irq = CountingInterrupts::new(VECTORS);
    let dev =
        DmaTest::with_buffer(regs.clone(), mem.clone(), irq, NotifyMode::Interrupt, buf).unwrap();
    dev.start().unwrap();
    let bars = dev.bars();
    assert_eq!(
        (bars[0].size, bars[0].is_64bit, bars[0].prefetchable),
        (64 << 30, true, true)
    );
    assert_eq!(bars[1].index, 2, "MSI-X past the 64-bit BAR's two slots");
    assert_eq!(dev.msix().unwrap().table_bar, 2);
    let cfg = dev.config_space();
    assert_eq!(cfg[0x10] & 0xf, 0xc, "BAR0: memory, 64-bit, prefetchable");
    let offsets = [0u64, (4 << 30) + 0x1238, buf - 8];
    for (i, &o) in offsets.iter().enumerate() {
        regs.write64(BUF_OFFSET + o, 0x5a5a_0000 + i as u64);
    }
    let held = regs.backing().allocated();
    assert!(
        held <= 3 * 4096 + 3 * (2 << 20),
        "{held} bytes held for three words"
    );
    // Each word copied out of the buffer into RAM.
    for (i, &o) in offsets.iter().enumerate() {
        let ram = 0x10_0000 + 8 * i as u64;
        assert_eq!(run_copy_flags(&dev, CMD_SRC_BUF, o, ram, 8), STATUS_DONE);
        let mut got = [0u8; 8];
        GuestRam::read(&*mem, ram, &mut got);
        assert_eq!(
            u64::from_le_bytes(got),
            0x5a5a_0000 + i as u64,
            "offset {o:#x}"
        );
    }
    assert_eq!(
        run_copy_flags(&dev, CMD_SRC_BUF, 0, 0x10_0000, (MAX_BIG_COPY + 8) as u32),
        STATUS_ERROR,
        "a copy past the large-buffer limit"
    );
    dev.reset();
    // Before any read: a load from a hole in shared memory allocates its page.
    let after = regs.backing().allocated();
    assert!(
        after <= 4096,
        "{after} bytes still held after the reset (the registers' page)"
    );
    for &o in &offsets {
        assert_eq!(regs.read64(BUF_OFFSET + o), 0, "offset {o:#x} after reset");
    }
}

/// A resizable BAR0 (`with_resizable_bar0`): 64-bit prefetchable at any size, offering 1 MiB
/// to the whole buffer, starting where it was told; copies follow the current size; sizes
/// it does not offer are refused by name and change nothing.
#[test]
fn dmatest_a_resizable_bar0_offers_its_sizes_and_copies_follow_the_current_one() {
    let buf = (64u64 << 20) - BUF_OFFSET;
    let regs = Arc::new(HeapRegisters::new(bar0_size_for(buf) as usize));
    let mem = TestMemory::with_window(8 << 20, 1 << 20, 4 << 20);
    let irq = CountingInterrupts::new(VECTORS);
    assert!(
        DmaTest::with_buffer(
            regs.clone(),
            mem.clone(),
            irq.clone(),
            NotifyMode::Interrupt,
            buf
        )
        .unwrap()
        .with_resizable_bar0(3 << 20)
        .is_err(),
        "3 MiB is not a power of two"
    );
    let odd = DmaTest::with_buffer(
        regs.clone(),
        mem.clone(),
        irq.clone(),
        NotifyMode::Interrupt,
        (48 << 20) - BUF_OFFSET,
    )
    .unwrap()
    .with_resizable_bar0(1 << 20)
    .err()
    .unwrap();
    assert!(odd.to_string().contains("power of two less 4K"), "{odd}");
    let dev = DmaTest::with_buffer(regs, mem.clone(), irq, NotifyMode::Interrupt, buf)
        .unwrap()
        .with_resizable_bar0(1 << 20)
        .unwrap();
    dev.start().unwrap();
    let r = dev.resizable_bars();
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].index, r[0].sizes, r[0].current), (0, 0x7f, 1 << 20));
    let bars = dev.bars();
    assert_eq!(
        (
            bars[0].size,
            bars[0].is_64bit,
            bars[0].prefetchable,
            bars[1].index
        ),
        (1 << 20, true, true, 2)
    );
    // Past the 1 MiB BAR: refused; after growing to 64 MiB the same copy works.
    let far = (32 << 20) - 8;
    assert_eq!(
        run_copy_flags(&dev, CMD_SRC_BUF, far, 0x10_0000, 8),
        STATUS_ERROR
    );
    dev.resize_bar(0, 64 << 20).unwrap();
    assert_eq!(dev.bars()[0].size, 64 << 20);
    assert_eq!(
        run_copy_flags(&dev, CMD_SRC_BUF, far, 0x10_0000, 8),
        STATUS_DONE
    );
    for bad in [128 << 20, 3 << 20, 4096] {
        let e = dev.resize_bar(0, bad).unwrap_err().to_string();
        assert!(e.contains("offers sizes 0x7f"), "{bad:#x}: {e}");
    }
    assert!(dev.resize_bar(2, 1 << 20).is_err(), "the msi-x bar");
    assert_eq!(dev.bars()[0].size, 64 << 20);
    dev.reset();
    assert_eq!(dev.bars()[0].size, 64 << 20, "a reset keeps the size");
}
