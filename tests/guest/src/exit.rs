//! Ending the run: `EXIT <code>` on the console, then the code to the debug-exit port.

use crate::io::outl;
use crate::serial::Out;

pub const DEBUG_EXIT_PORT: u16 = 0xf4;

pub fn exit(code: u8) -> ! {
    Out.s("EXIT ").dec(code as u64).nl();
    outl(DEBUG_EXIT_PORT, code as u32);
    loop {
        // SAFETY: nothing to do but stop; the VMM ends the VM on the port write above.
        unsafe { core::arch::asm!("cli", "hlt", options(nomem, nostack)) }
    }
}
