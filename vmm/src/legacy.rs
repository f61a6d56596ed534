//! Legacy port-I/O devices: the COM1 8250 UART and the debug-exit port.

use std::io::Write;
use std::sync::Arc;

use pci::{BusDevice, RestoreError, Snapshottable};
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::exit::{ExitNotifier, VmExit};

/// Raises the serial IRQ by writing the irqfd eventfd registered on GSI 4.
pub struct EventFdTrigger(EventFd);

impl EventFdTrigger {
    pub fn new(evt: EventFd) -> Self {
        Self(evt)
    }
}

impl Trigger for EventFdTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// Serial output sink that writes whole lines (the UART flushes after every byte).
pub struct LineOut {
    inner: Box<dyn Write + Send>,
    buf: Vec<u8>,
}

impl LineOut {
    pub fn new(inner: Box<dyn Write + Send>) -> Self {
        Self {
            inner,
            buf: Vec::with_capacity(256),
        }
    }

    /// Writes out whatever is buffered, including a partial last line.
    pub fn flush_all(&mut self) -> std::io::Result<()> {
        if !self.buf.is_empty() {
            self.inner.write_all(&self.buf)?;
            self.buf.clear();
        }
        self.inner.flush()
    }
}

impl Write for LineOut {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.last() == Some(&b'\n') || self.buf.len() >= 1024 {
            self.flush_all()
        } else {
            Ok(())
        }
    }
}

impl Drop for LineOut {
    fn drop(&mut self) {
        let _ = self.flush_all();
    }
}

/// The 8250 UART as a [`BusDevice`] (8 ports at 0x3f8).
pub struct SerialDevice {
    serial: Serial<EventFdTrigger, vm_superio::serial::NoEvents, LineOut>,
}

impl SerialDevice {
    pub fn new(irq: EventFd, out: Box<dyn Write + Send>) -> Self {
        Self {
            serial: Serial::new(EventFdTrigger::new(irq), LineOut::new(out)),
        }
    }

    /// Writes buffered output (called when the VM stops).
    pub fn flush(&mut self) {
        if let Err(e) = self.serial.writer_mut().flush_all() {
            log::warn!("serial output flush failed: {e}");
        }
    }
}

/// The 8250's receive FIFO size (vm-superio's, not exported).
const SERIAL_FIFO_SIZE: usize = 64;

/// Saved registers and receive FIFO of the 8250 (vm-superio's `SerialState`, with serde).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SerialSnapshot {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    pub in_buffer: Vec<u8>,
}

impl Snapshottable for SerialDevice {
    type State = SerialSnapshot;

    fn snapshot(&self) -> SerialSnapshot {
        let s = self.serial.state();
        SerialSnapshot {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }

    /// Rebuilds the 8250 from `state`, keeping this device's interrupt eventfd and output.
    fn restore(&mut self, state: &SerialSnapshot) -> Result<(), RestoreError> {
        let invalid = |why: String| RestoreError::Invalid {
            device: "serial",
            why,
        };
        // Checked before the 8250 is taken apart, so a refused state leaves it working.
        if state.in_buffer.len() > SERIAL_FIFO_SIZE {
            return Err(invalid(format!(
                "{} bytes in the receive FIFO, it holds {SERIAL_FIFO_SIZE}",
                state.in_buffer.len()
            )));
        }
        let irq = self
            .serial
            .interrupt_evt()
            .0
            .try_clone()
            .map_err(|e| invalid(format!("cannot clone the interrupt eventfd: {e}")))?;
        let placeholder =
            EventFd::new(0).map_err(|e| invalid(format!("cannot create an eventfd: {e}")))?;
        let old = std::mem::replace(
            &mut self.serial,
            Serial::new(
                EventFdTrigger::new(placeholder),
                LineOut::new(Box::new(std::io::sink())),
            ),
        );
        let out = old.into_writer();
        let st = vm_superio::serial::SerialState {
            baud_divisor_low: state.baud_divisor_low,
            baud_divisor_high: state.baud_divisor_high,
            interrupt_enable: state.interrupt_enable,
            interrupt_identification: state.interrupt_identification,
            line_control: state.line_control,
            line_status: state.line_status,
            modem_control: state.modem_control,
            modem_status: state.modem_status,
            scratch: state.scratch,
            in_buffer: state.in_buffer.clone(),
        };
        match Serial::from_state(
            &st,
            EventFdTrigger::new(irq),
            vm_superio::serial::NoEvents,
            out,
        ) {
            Ok(s) => {
                self.serial = s;
                Ok(())
            }
            Err(e) => Err(invalid(format!(
                "saved state refused ({} bytes in the receive FIFO): {e:?}",
                state.in_buffer.len()
            ))),
        }
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, _base: u64, offset: u64, data: &mut [u8]) {
        if data.len() == 1 && offset < 8 {
            data[0] = self.serial.read(offset as u8);
        } else {
            data.fill(0xff);
        }
    }

    fn write(&mut self, _base: u64, offset: u64, data: &[u8]) {
        if data.len() == 1 && offset < 8 {
            if let Err(e) = self.serial.write(offset as u8, data[0]) {
                log::warn!("serial write failed: {e:?}");
            }
        }
    }
}

/// Port 0xf4: a write of 1..4 bytes stops the VM; the low byte is the process exit code.
pub struct DebugExit {
    exit: Arc<ExitNotifier>,
}

impl DebugExit {
    pub fn new(exit: Arc<ExitNotifier>) -> Self {
        Self { exit }
    }
}

impl BusDevice for DebugExit {
    fn read(&mut self, _base: u64, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, _base: u64, _offset: u64, data: &[u8]) {
        let mut v = [0u8; 4];
        let n = data.len().min(4);
        v[..n].copy_from_slice(&data[..n]);
        let value = u32::from_le_bytes(v);
        if value > 255 {
            log::warn!("debug exit value {value:#x} exceeds 255; using the low byte");
        }
        self.exit.request(VmExit::DebugExit(value as u8));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, d: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(d);
            Ok(d.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn serial_writes_whole_lines() {
        let out = Shared::default();
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut dev = SerialDevice::new(evt, Box::new(out.clone()));
        for b in b"ab" {
            dev.write(0x3f8, 0, &[*b]);
        }
        assert!(out.0.lock().unwrap().is_empty());
        dev.write(0x3f8, 0, b"\n");
        assert_eq!(&*out.0.lock().unwrap(), b"ab\n");
        dev.write(0x3f8, 0, b"c");
        dev.flush();
        assert_eq!(&*out.0.lock().unwrap(), b"ab\nc");
        // LSR: transmitter empty.
        let mut lsr = [0u8];
        dev.read(0x3f8, 5, &mut lsr);
        assert_ne!(lsr[0] & 0x20, 0);
    }

    #[test]
    fn serial_state_round_trips_and_keeps_the_output() {
        let out = Shared::default();
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut dev = SerialDevice::new(evt, Box::new(out.clone()));
        dev.write(0x3f8, 3, &[0x80]); // DLAB
        dev.write(0x3f8, 0, &[0x0c]); // 9600 baud
        dev.write(0x3f8, 3, &[0x03]); // 8N1
        dev.write(0x3f8, 7, &[0x5a]); // scratch
        let saved = dev.snapshot();
        assert_eq!(
            (saved.baud_divisor_low, saved.line_control, saved.scratch),
            (0x0c, 0x03, 0x5a)
        );
        let out2 = Shared::default();
        let mut fresh = SerialDevice::new(
            EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            Box::new(out2.clone()),
        );
        fresh.restore(&saved).unwrap();
        assert_eq!(fresh.snapshot(), saved);
        let mut scratch = [0u8];
        fresh.read(0x3f8, 7, &mut scratch);
        assert_eq!(scratch[0], 0x5a);
        // Output still goes where this device wrote before the restore.
        fresh.write(0x3f8, 0, b"x");
        fresh.write(0x3f8, 0, b"\n");
        assert_eq!(&*out2.0.lock().unwrap(), b"x\n");
        // More than the FIFO holds is refused with a message, and the device keeps working.
        let bad = SerialSnapshot {
            in_buffer: vec![0; 4096],
            ..saved
        };
        let e = fresh.restore(&bad).unwrap_err().to_string();
        assert!(e.contains("4096 bytes"), "{e}");
        fresh.write(0x3f8, 0, b"y");
        fresh.write(0x3f8, 0, b"\n");
        assert_eq!(&*out2.0.lock().unwrap(), b"x\ny\n");
    }

    #[test]
    fn debug_exit_records_code() {
        let n = Arc::new(ExitNotifier::new());
        let mut d = DebugExit::new(n.clone());
        d.write(0xf4, 0, &[7, 0, 0, 0]);
        assert_eq!(n.wait(None), Some(VmExit::DebugExit(7)));
    }
}
