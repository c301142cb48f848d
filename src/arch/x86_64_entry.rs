//! The flush IPI's interrupt entry on stable Rust:
//! [`x86_64_flush_ipi_entry!`](crate::x86_64_flush_ipi_entry).

/// Defines an interrupt entry for the flush IPI's vector, on stable Rust
/// (a kernel on nightly may use an `extern "x86-interrupt" fn` instead):
/// `x86_64_flush_ipi_entry!(pub tlb_flush_entry => tlb_flush_handler);`
/// defines `pub unsafe extern "C" fn tlb_flush_entry()`, whose address
/// goes in the vector's IDT gate, and which calls `tlb_flush_handler`, an
/// `extern "C" fn()` of the kernel's that calls
/// [`X86_64::flush_ipi_entry`](crate::arch::x86_64::X86_64::flush_ipi_entry)
/// (which also signals the end of interrupt).
///
/// The entry saves the nine registers the System V ABI lets a function
/// change (`rax`, `rcx`, `rdx`, `rsi`, `rdi`, `r8` to `r11`), clears the
/// direction flag, calls the handler with the stack 16-byte aligned as
/// the ABI asks at a call (the processor aligns it to 16 before it pushes
/// the five words of the interrupt frame, and the nine pushes bring it
/// back to a multiple of 16: Intel SDM vol. 3A 6.14.2), restores them and
/// returns with `iretq`. It saves no SSE, AVX or x87 state: right for
/// kernel code built, as `x86_64-unknown-none` builds it, without those
/// registers; a kernel whose interrupt handlers use them saves them
/// itself. The kernel's code must not use a red zone either (that target
/// has none).
///
/// The defined function is `unsafe` to call, and must never be called as
/// a function: it ends with `iretq`. Install it as an interrupt gate (for
/// example with the `x86_64` crate's `set_handler_addr`, whose safety
/// contract this entry keeps).
///
/// Needs Rust 1.88 or newer in the kernel's crate (naked functions).
#[macro_export]
macro_rules! x86_64_flush_ipi_entry {
    ($vis:vis $name:ident => $handler:path) => {
        /// The flush IPI's interrupt entry
        /// (`tlb_batch::x86_64_flush_ipi_entry!`): an IDT gate's target,
        /// never a function to call.
        #[unsafe(naked)]
        $vis unsafe extern "C" fn $name() {
            // SAFETY: an interrupt entry: every register the handler (an
            // `extern "C" fn()`) may change is saved and restored, the
            // stack is aligned for the call, and `iretq` returns to the
            // interrupted code with its frame as the processor pushed it.
            core::arch::naked_asm!(
                "push rax", "push rcx", "push rdx", "push rsi", "push rdi",
                "push r8", "push r9", "push r10", "push r11",
                "cld",
                "call {handler}",
                "pop r11", "pop r10", "pop r9", "pop r8",
                "pop rdi", "pop rsi", "pop rdx", "pop rcx", "pop rax",
                "iretq",
                handler = sym $handler,
            );
        }
    };
}
