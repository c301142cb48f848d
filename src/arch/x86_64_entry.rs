//! The flush IPI's interrupt entry on stable Rust:
//! [`x86_64_flush_ipi_entry!`](crate::x86_64_flush_ipi_entry).

/// Defines an interrupt entry for the flush IPI's vector, on stable Rust
/// (a kernel on nightly may use an `extern "x86-interrupt" fn` instead).
/// Two forms:
///
/// - `x86_64_flush_ipi_entry!(pub tlb_flush_entry for arch());` defines
///   `pub unsafe extern "C" fn tlb_flush_entry()`, whose address goes in
///   the vector's IDT gate, and which calls
///   [`X86_64::flush_ipi_entry`](crate::arch::x86_64::X86_64::flush_ipi_entry)
///   (which also signals the end of interrupt) on the `&X86_64` that the
///   expression after `for` gives, evaluated in each interrupt.
/// - `x86_64_flush_ipi_entry!(pub tlb_flush_entry => tlb_flush_handler);`
///   calls `tlb_flush_handler` instead, an `extern "C" fn()` of the
///   kernel's that must call `flush_ipi_entry` itself (for a kernel that
///   counts or traces its interrupts there).
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
    ($vis:vis $name:ident for $arch:expr) => {
        $crate::x86_64_flush_ipi_entry!(@entry $vis $name, serve, {
            /// Serves the flush requests on the `Arch` the macro was given.
            extern "C" fn serve() {
                let arch: &$crate::arch::x86_64::X86_64 = $arch;
                arch.flush_ipi_entry();
            }
        });
    };
    ($vis:vis $name:ident => $handler:path) => {
        $crate::x86_64_flush_ipi_entry!(@entry $vis $name, $handler, {});
    };
    (@entry $vis:vis $name:ident, $handler:path, { $($item:item)* }) => {
        /// The flush IPI's interrupt entry
        /// (`tlb_batch::x86_64_flush_ipi_entry!`): an IDT gate's target,
        /// never a function to call.
        #[unsafe(naked)]
        $vis unsafe extern "C" fn $name() {
            $($item)*
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
