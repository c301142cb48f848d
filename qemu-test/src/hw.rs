//! Port I/O, the serial console, QEMU's and Bochs's exit ports, the IDT and interrupt
//! control for the test kernel.

use core::arch::asm;
use core::fmt;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::boot::isr_table;

/// Writes a byte to an I/O port.
///
/// # Safety
///
/// The port and value must be meaningful for the device behind it.
pub unsafe fn outb(port: u16, value: u8) {
    // SAFETY: the caller vouches for the device.
    unsafe { asm!("out dx, al", in("dx") port, in("al") value, options(nomem, nostack, preserves_flags)) };
}

/// Reads a byte from an I/O port.
///
/// # Safety
///
/// The port must be safe to read.
pub unsafe fn inb(port: u16) -> u8 {
    let value: u8;
    // SAFETY: the caller vouches for the device.
    unsafe { asm!("in al, dx", in("dx") port, out("al") value, options(nomem, nostack, preserves_flags)) };
    value
}

const COM1: u16 = 0x3f8;

/// The first serial port, for `write!`.
pub struct Serial;

static SERIAL_READY: AtomicBool = AtomicBool::new(false);

/// Sets COM1 to 8 data bits, no parity, one stop bit, 115200 baud, FIFOs
/// on. QEMU ignores the line settings, but Bochs honours them, and the
/// firmware or boot loader may leave fewer data bits (Bochs then drops the
/// top bits of every character).
fn serial_init() {
    // SAFETY: COM1's registers on a PC: divisor latch (LCR bit 7), divisor
    // 1, then 8N1 and the FIFO control register.
    unsafe {
        outb(COM1 + 1, 0x00);
        outb(COM1 + 3, 0x80);
        outb(COM1, 0x01);
        outb(COM1 + 1, 0x00);
        outb(COM1 + 3, 0x03);
        outb(COM1 + 2, 0x07);
    }
}

impl fmt::Write for Serial {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if !SERIAL_READY.swap(true, Ordering::SeqCst) {
            serial_init();
        }
        for b in s.bytes() {
            // SAFETY: COM1's line status and data registers on a PC.
            unsafe {
                while inb(COM1 + 5) & 0x20 == 0 {}
                outb(COM1, b);
            }
        }
        Ok(())
    }
}

/// Ends the run. Under QEMU, through its isa-debug-exit device (iobase
/// 0xf4): QEMU exits with `(code << 1) | 1`. Bochs has no such device and
/// ignores that write; the string "Shutdown" written to port 0x8900 (the
/// Bochs BIOS's power-off port) makes it stop, so the verdict there is the
/// serial log's last line, printed before this is called.
pub fn exit(code: u32) -> ! {
    // SAFETY: under QEMU the device is configured on its command line and a
    // write ends the emulation; elsewhere port 0xf4 is unassigned and the
    // write is dropped.
    unsafe { asm!("out dx, eax", in("dx") 0xf4u16, in("eax") code, options(nomem, nostack)) };
    // SAFETY: COM1's line status register: wait until the transmitter is
    // empty (bit 6), so that Bochs has written the last line out before it
    // stops.
    unsafe { while inb(COM1 + 5) & 0x40 == 0 {} }
    for b in b"Shutdown" {
        // SAFETY: port 0x8900 is Bochs's shutdown port and unassigned on
        // QEMU's PC; writing it has no other effect.
        unsafe { outb(0x8900, *b) };
    }
    loop {
        // SAFETY: halting with interrupts off parks the CPU for good.
        unsafe { asm!("cli; hlt", options(nomem, nostack)) };
    }
}

/// The exit code meaning every scenario passed (QEMU returns 33).
pub const EXIT_PASS: u32 = 0x10;
/// The exit code meaning a scenario failed (QEMU returns 35).
pub const EXIT_FAIL: u32 = 0x11;

#[repr(C, packed)]
#[derive(Clone, Copy)]
struct IdtEntry {
    offset_low: u16,
    selector: u16,
    ist: u8,
    attributes: u8,
    offset_mid: u16,
    offset_high: u32,
    zero: u32,
}

#[repr(C, align(16))]
struct Idt([IdtEntry; 256]);

static mut IDT: Idt = Idt([IdtEntry {
    offset_low: 0,
    selector: 0,
    ist: 0,
    attributes: 0,
    offset_mid: 0,
    offset_high: 0,
    zero: 0,
}; 256]);

fn gate(handler: u64) -> IdtEntry {
    IdtEntry {
        offset_low: handler as u16,
        selector: 0x08,
        ist: 0,
        attributes: 0x8e,
        offset_mid: (handler >> 16) as u16,
        offset_high: (handler >> 32) as u32,
        zero: 0,
    }
}

/// Fills the IDT (exceptions 0-31, the flush vector 0xf0, the spurious
/// vector 0xff). Call once, on the boot CPU, before any CPU loads it.
pub fn build_idt() {
    // SAFETY: runs once on the boot CPU before other CPUs exist and before
    // interrupts are enabled, so nothing reads the table concurrently;
    // `isr_table` is the stub table from boot.rs.
    unsafe {
        let idt = &mut *core::ptr::addr_of_mut!(IDT);
        let table = &*core::ptr::addr_of!(isr_table);
        for (v, &h) in table.iter().take(32).enumerate() {
            idt.0[v] = gate(h);
        }
        idt.0[0xf0] = gate(table[32]);
        idt.0[0xff] = gate(table[33]);
    }
}

/// Loads the IDT on the running CPU.
pub fn load_idt() {
    #[repr(C, packed)]
    struct Pointer {
        limit: u16,
        base: u64,
    }
    let ptr = Pointer {
        limit: (core::mem::size_of::<Idt>() - 1) as u16,
        base: core::ptr::addr_of!(IDT) as u64,
    };
    // SAFETY: the IDT is built (before any CPU loads it) and lives forever.
    unsafe { asm!("lidt [{}]", in(reg) &ptr, options(readonly, nostack, preserves_flags)) };
}

/// Masks every line of the legacy 8259 PICs: the BIOS leaves IRQ 0 (the
/// timer) on vector 8, where it would look like a double fault.
pub fn mask_legacy_pic() {
    // SAFETY: the PICs' data ports; all ones masks every IRQ line.
    unsafe {
        outb(0x21, 0xff);
        outb(0xa1, 0xff);
    }
}

/// Enables interrupts.
pub fn sti() {
    // SAFETY: the IDT is loaded and the APIC programmed before any caller
    // enables interrupts.
    unsafe { asm!("sti", options(nomem, nostack)) };
}

/// Disables interrupts.
pub fn cli() {
    // SAFETY: masking interrupts is always safe.
    unsafe { asm!("cli", options(nomem, nostack)) };
}

/// The faulting address of the last page fault.
pub fn cr2() -> u64 {
    let v: u64;
    // SAFETY: reading CR2 in ring 0 has no side effect.
    unsafe { asm!("mov {}, cr2", out(reg) v, options(nomem, nostack, preserves_flags)) };
    v
}

/// The time-stamp counter.
pub fn rdtsc() -> u64 {
    // SAFETY: RDTSC is allowed in ring 0 and has no side effect.
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// TSC ticks per microsecond, measured at boot ([`calibrate_tsc`]).
static TSC_PER_US: AtomicU64 = AtomicU64::new(1);

/// PIT input clock ticks in 10 ms (1.193182 MHz).
const PIT_10MS: u16 = 11_932;

/// Measures the TSC against 10 ms of the PIT's channel 2 (gated by port
/// 0x61, its output read back there), for [`now_us`]. Call once, on the
/// boot CPU, before other CPUs start.
pub fn calibrate_tsc() {
    // SAFETY: the PC's port 0x61 (channel 2's gate in bit 0, the speaker
    // off in bit 1, its output in bit 5) and the PIT's mode and channel 2
    // registers; nothing else in this kernel uses channel 2 or the speaker.
    let ticks = unsafe {
        outb(0x61, (inb(0x61) & !0x02) | 0x01);
        // Channel 2, low then high byte, mode 0 (output high at terminal
        // count), binary.
        outb(0x43, 0xb0);
        outb(0x42, PIT_10MS as u8);
        outb(0x42, (PIT_10MS >> 8) as u8);
        let start = rdtsc();
        let mut polls = 0u64;
        while inb(0x61) & 0x20 == 0 && polls < 100_000_000 {
            polls += 1;
        }
        rdtsc() - start
    };
    TSC_PER_US.store((ticks / 10_000).max(1), Ordering::Relaxed);
}

/// Microseconds since the TSC's reset, as calibrated.
pub fn now_us() -> u64 {
    rdtsc() / TSC_PER_US.load(Ordering::Relaxed)
}

/// Busy-waits about `n` pause instructions.
pub fn spin(n: u64) {
    for _ in 0..n {
        core::hint::spin_loop();
    }
}
