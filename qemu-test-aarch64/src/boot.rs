//! Entry points and exceptions: the boot CPU's `_start`, the secondary
//! CPUs' PSCI entry, the EL1 vector table, and the one load that may fault
//! on purpose ([`probe_read`]).
//!
//! QEMU's virt machine without `virtualization=on` or `secure=on` gives the
//! CPUs neither EL2 nor EL3, so `-kernel` enters `_start` at EL1 with the
//! MMU and caches off, and a secondary CPU started by PSCI CPU_ON enters at
//! EL1 too (PSCI starts it at the caller's level). `kernel_main` checks
//! CurrentEL and stops on anything else rather than handling an EL2 entry.

use core::arch::global_asm;
use core::sync::atomic::{AtomicU64, Ordering};

use crate::{halt, say, semihost};

/// Bytes of stack per CPU.
pub const STACK_SIZE: usize = 64 * 1024;

#[repr(C, align(16))]
pub struct Stacks(pub [[u8; STACK_SIZE]; crate::MAX_CPUS]);

/// Every CPU's stack; CPU 0's is used from `_start` on.
pub static mut STACKS: Stacks = Stacks([[0; STACK_SIZE]; crate::MAX_CPUS]);

/// What a secondary CPU's entry reads (with its MMU off, so the boot CPU
/// cleans it to the point of coherency first): its stack, its index, and
/// the MMU configuration to load.
#[repr(C)]
pub struct ApBoot {
    pub stack_top: u64,
    pub cpu: u64,
    pub mmu: crate::mmu::MmuConfig,
}

extern "C" {
    /// Loads MAIR/TCR/TTBR0, drops this CPU's stale TLB and instruction
    /// cache contents, then writes SCTLR_EL1 (turning the MMU on). Touches
    /// no stack and no memory but `config`.
    pub fn mmu_enable(config: *const crate::mmu::MmuConfig);
    /// The PSCI CPU_ON entry point of a secondary CPU; x0 (the context id)
    /// is the address of its [`ApBoot`].
    pub fn secondary_entry();
    static probe_load: u8;
    static probe_fault: u8;
    static probe_store: u8;
    static probe_store_fault: u8;
}

// Both entries: mask interrupts, let EL1 use FP/SIMD (CPACR_EL1.FPEN = 0b11:
// the target's code uses NEON registers), install the vector table, then
// set a stack.
global_asm!(
    r#"
    .section .text.boot, "ax"
    .global _start
_start:
    msr daifset, #0xf
    mov x1, #(3 << 20)
    msr cpacr_el1, x1
    adrp x1, exception_vectors
    add x1, x1, :lo12:exception_vectors
    msr vbar_el1, x1
    isb
    adrp x1, {stacks}
    add x1, x1, :lo12:{stacks}
    add x1, x1, #{stack_size}
    mov sp, x1
    // Zero .bss (the stack above is part of it: nothing is on it yet).
    // x0, the DTB address, is kept for kernel_main.
    adrp x1, __bss_start
    add x1, x1, :lo12:__bss_start
    adrp x2, __bss_end
    add x2, x2, :lo12:__bss_end
1:  cmp x1, x2
    b.hs 2f
    str xzr, [x1], #8
    b 1b
2:  bl kernel_main
3:  wfi
    b 3b

    .section .text, "ax"
    .global secondary_entry
    .balign 4
secondary_entry:
    msr daifset, #0xf
    mov x1, #(3 << 20)
    msr cpacr_el1, x1
    adrp x1, exception_vectors
    add x1, x1, :lo12:exception_vectors
    msr vbar_el1, x1
    isb
    mov x19, x0
    ldr x1, [x19, #0]
    mov sp, x1
    add x0, x19, #16
    bl mmu_enable
    ldr x0, [x19, #8]
    bl ap_main
4:  wfi
    b 4b

    .global mmu_enable
    .balign 4
mmu_enable:
    ldr x1, [x0, #0]
    msr mair_el1, x1
    ldr x1, [x0, #8]
    msr tcr_el1, x1
    ldr x1, [x0, #16]
    msr ttbr0_el1, x1
    isb
    tlbi vmalle1
    ic iallu
    dsb nsh
    isb
    ldr x1, [x0, #24]
    msr sctlr_el1, x1
    isb
    ret

    // probe_read(va) -> (value, faulted): the load at probe_load may take a
    // data abort; the handler then resumes at probe_fault.
    .global probe_read
    .balign 4
probe_read:
    mov x1, #0
    .global probe_load
probe_load:
    ldr x0, [x0]
    ret
    .global probe_fault
probe_fault:
    mov x0, #0
    mov x1, #1
    ret

    // probe_write(va, value) -> faulted: the store at probe_store may take
    // a data abort (translation or permission fault); the handler then
    // resumes at probe_store_fault.
    .global probe_write
    .balign 4
probe_write:
    .global probe_store
probe_store:
    str x1, [x0]
    mov x0, #0
    ret
    .global probe_store_fault
probe_store_fault:
    mov x0, #1
    ret

    // The EL1 vector table: 16 entries of 0x80 bytes (synchronous, IRQ,
    // FIQ, SError for: current EL with SP_EL0, current EL with SP_ELx,
    // lower EL AArch64, lower EL AArch32). Each saves x0/x1, puts its
    // index in x1 and joins the common path, which saves the rest in an
    // ExceptionFrame on the current stack.
    .balign 2048
    .global exception_vectors
exception_vectors:
    .irp kind, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15
    .balign 128
    sub sp, sp, #{frame_size}
    stp x0, x1, [sp, #0]
    mov x1, #\kind
    b exception_common
    .endr

exception_common:
    stp x2, x3, [sp, #16]
    stp x4, x5, [sp, #32]
    stp x6, x7, [sp, #48]
    stp x8, x9, [sp, #64]
    stp x10, x11, [sp, #80]
    stp x12, x13, [sp, #96]
    stp x14, x15, [sp, #112]
    stp x16, x17, [sp, #128]
    stp x18, x19, [sp, #144]
    stp x20, x21, [sp, #160]
    stp x22, x23, [sp, #176]
    stp x24, x25, [sp, #192]
    stp x26, x27, [sp, #208]
    stp x28, x29, [sp, #224]
    mrs x2, elr_el1
    stp x30, x2, [sp, #240]
    mrs x2, spsr_el1
    mrs x3, esr_el1
    stp x2, x3, [sp, #256]
    mrs x2, far_el1
    stp x2, x1, [sp, #272]
    mov x0, sp
    bl exception_entry
    ldp x30, x2, [sp, #240]
    msr elr_el1, x2
    ldp x2, x3, [sp, #256]
    msr spsr_el1, x2
    ldp x28, x29, [sp, #224]
    ldp x26, x27, [sp, #208]
    ldp x24, x25, [sp, #192]
    ldp x22, x23, [sp, #176]
    ldp x20, x21, [sp, #160]
    ldp x18, x19, [sp, #144]
    ldp x16, x17, [sp, #128]
    ldp x14, x15, [sp, #112]
    ldp x12, x13, [sp, #96]
    ldp x10, x11, [sp, #80]
    ldp x8, x9, [sp, #64]
    ldp x6, x7, [sp, #48]
    ldp x4, x5, [sp, #32]
    ldp x2, x3, [sp, #16]
    ldp x0, x1, [sp, #0]
    add sp, sp, #{frame_size}
    eret
"#,
    stacks = sym STACKS,
    stack_size = const STACK_SIZE,
    frame_size = const core::mem::size_of::<ExceptionFrame>(),
);

/// The registers `exception_common` saves, in its order.
#[repr(C)]
pub struct ExceptionFrame {
    pub x: [u64; 31],
    pub elr: u64,
    pub spsr: u64,
    pub esr: u64,
    pub far: u64,
    /// The vector entry's index (0-15).
    pub kind: u64,
}

const _: () = assert!(core::mem::size_of::<ExceptionFrame>().is_multiple_of(16));

/// What [`probe_read`] returns, in x0 and x1 (AAPCS64 returns a 16-byte
/// composite in those two registers).
#[repr(C)]
pub struct Probe {
    pub value: u64,
    pub faulted: u64,
}

extern "C" {
    fn probe_read(va: u64) -> Probe;
    fn probe_write(va: u64, value: u64) -> u64;
}

/// Permission faults [`probe_write`] recovered from (writes refused by a
/// read-only entry) since boot, on every CPU.
pub static PERMISSION_FAULTS: AtomicU64 = AtomicU64::new(0);

/// Writes `value` to the 64-bit word at `va`; false if the store took a
/// translation or permission fault (nothing was written). Any other abort
/// is fatal.
pub fn probe_store_word(va: u64, value: u64) -> bool {
    // SAFETY: `probe_write` is a leaf routine that stores to `va`; a
    // translation or permission fault there resumes at
    // `probe_store_fault` (see `exception_entry`). Callers pass only test
    // pages, whose frames are this kernel's own statics, written only
    // through atomics; it follows the C calling convention.
    unsafe { probe_write(va, value) == 0 }
}

/// Reads the 64-bit word at `va`; `None` if the read took a translation
/// fault (the page is not mapped for this CPU). Any other abort is fatal.
pub fn probe(va: u64) -> Option<u64> {
    // SAFETY: `probe_read` is a leaf routine that loads from `va`; a data
    // abort there resumes at `probe_fault` (see `exception_entry`), so any
    // address is harmless to pass; it follows the C calling convention.
    let p = unsafe { probe_read(va) };
    (p.faulted == 0).then_some(p.value)
}

/// Exception class of a data abort taken without a change of level.
const EC_DATA_ABORT_SAME_EL: u64 = 0x25;
/// Vector index of "synchronous, current EL with SP_ELx".
const SYNC_CURRENT_SPX: u64 = 4;

#[no_mangle]
extern "C" fn exception_entry(frame: &mut ExceptionFrame) {
    let ec = frame.esr >> 26;
    let load = core::ptr::addr_of!(probe_load) as u64;
    // Data fault status code 0b0001LL: a translation fault at level LL.
    let translation_fault = frame.esr & 0x3c == 0x04;
    // 0b0011LL: a permission fault at level LL.
    let permission_fault = frame.esr & 0x3c == 0x0c;
    let store = core::ptr::addr_of!(probe_store) as u64;
    if frame.kind == SYNC_CURRENT_SPX
        && ec == EC_DATA_ABORT_SAME_EL
        && (translation_fault || permission_fault)
        && frame.elr == store
    {
        if permission_fault {
            PERMISSION_FAULTS.fetch_add(1, Ordering::Relaxed);
        }
        frame.elr = core::ptr::addr_of!(probe_store_fault) as u64;
        return;
    }
    if frame.kind == SYNC_CURRENT_SPX && ec == EC_DATA_ABORT_SAME_EL && translation_fault && frame.elr == load
    {
        frame.elr = core::ptr::addr_of!(probe_fault) as u64;
        return;
    }
    if semihost::exiting() {
        say!(
            "FATAL: the semihosting exit trapped (ESR {:#x}): run QEMU with -semihosting\n",
            frame.esr
        );
        halt();
    }
    say!(
        "FATAL: unexpected exception on CPU {}: vector {}, ESR {:#x} (class {:#x}), ELR {:#x}, FAR {:#x}\n",
        crate::cpu_index(),
        frame.kind,
        frame.esr,
        ec,
        frame.elr,
        frame.far
    );
    semihost::exit(crate::EXIT_FATAL)
}
