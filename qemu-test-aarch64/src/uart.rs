//! The virt machine's PL011 UART at 0x0900_0000 (the DTB's `/pl011@9000000`
//! and `/chosen/stdout-path`), for `write!`.
//!
//! QEMU's PL011 transmits without any setup; the kernel only waits while
//! the transmit FIFO is full. The UART is reachable with the MMU off (every
//! access is then Device memory) and, with it on, through the identity
//! map's Device-nGnRnE block.

use core::fmt;

const BASE: usize = 0x0900_0000;
/// Data register.
const DR: usize = 0x00;
/// Flag register; bit 5 is "transmit FIFO full".
const FR: usize = 0x18;
const FR_TXFF: u32 = 1 << 5;

/// The console.
pub struct Uart;

impl Uart {
    fn put(b: u8) {
        // SAFETY: the PL011's flag and data registers, identity-mapped as
        // Device memory (or reached with the MMU off); 32-bit aligned
        // accesses, as the PL011 wants.
        unsafe {
            while core::ptr::read_volatile((BASE + FR) as *const u32) & FR_TXFF != 0 {}
            core::ptr::write_volatile((BASE + DR) as *mut u32, u32::from(b));
        }
    }
}

impl fmt::Write for Uart {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for b in s.bytes() {
            if b == b'\n' {
                Self::put(b'\r');
            }
            Self::put(b);
        }
        Ok(())
    }
}
