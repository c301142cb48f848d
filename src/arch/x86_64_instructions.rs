//! The privileged instructions the x86_64 [`Arch`](super::Arch) executes,
//! each in a small wrapper: `invlpg`, `INVPCID`, CR3 and CR4, MSRs,
//! `CPUID` and the vendor read from it, and masking interrupts around a
//! critical sequence. What CPUID and CR4 say about features is decoded in
//! `x86_64_features.rs`.
//!
//! The `x86_64` module re-exports every public item, so that a kernel can
//! use the same, documented wrappers.

use core::arch::asm;

/// The four kinds of `INVPCID` invalidation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub enum InvpcidKind {
    /// One address in one PCID (global entries excepted).
    Address = 0,
    /// Every non-global entry of one PCID.
    SingleContext = 1,
    /// Every entry of every PCID, global ones included.
    AllIncludingGlobal = 2,
    /// Every non-global entry of every PCID.
    AllExcludingGlobal = 3,
}

/// Invalidates the TLB entries for the page containing `va` in the current
/// PCID, and a global entry for it (and paging-structure caches for it).
///
/// # Safety
///
/// Ring 0 only. Invalidating never breaks memory safety by itself; the
/// function is `unsafe` because executing it outside ring 0 faults.
#[inline]
pub unsafe fn invlpg(va: u64) {
    // SAFETY: the caller runs in ring 0; invlpg reads no memory and only
    // drops cached translations.
    unsafe { asm!("invlpg [{}]", in(reg) va, options(nostack, preserves_flags)) };
}

/// Executes `INVPCID` of `kind` for `pcid` (and `va` for
/// [`InvpcidKind::Address`]).
///
/// # Safety
///
/// Ring 0 only, on a CPU whose CPUID reports INVPCID (otherwise #UD);
/// `pcid` below 4096 and `va` canonical (otherwise #GP).
#[inline]
pub unsafe fn invpcid(kind: InvpcidKind, pcid: u16, va: u64) {
    let descriptor: [u64; 2] = [u64::from(pcid), va];
    // SAFETY: the caller guarantees ring 0, INVPCID support and valid
    // operands; the descriptor lives on the stack for the instruction.
    unsafe {
        asm!(
            "invpcid {}, [{}]",
            in(reg) kind as u64,
            in(reg) descriptor.as_ptr(),
            options(nostack, preserves_flags, readonly)
        )
    };
}

/// Reads CR3 (page-table root and PCID).
///
/// # Safety
///
/// Ring 0 only.
#[inline]
pub unsafe fn read_cr3() -> u64 {
    let value: u64;
    // SAFETY: reading CR3 in ring 0 has no side effect.
    unsafe { asm!("mov {}, cr3", out(reg) value, options(nomem, nostack, preserves_flags)) };
    value
}

/// Writes CR3: switches to the page table at `value`'s root with its PCID;
/// without bit 63 set, flushes that PCID's non-global entries.
///
/// # Safety
///
/// Ring 0 only; `value` names a valid top-level page table that maps the
/// running code, its stack and everything the caller touches next.
#[inline]
pub unsafe fn write_cr3(value: u64) {
    // SAFETY: the caller guarantees the new root maps what runs next.
    unsafe { asm!("mov cr3, {}", in(reg) value, options(nostack, preserves_flags)) };
}

/// Reads CR4.
///
/// # Safety
///
/// Ring 0 only.
#[inline]
pub unsafe fn read_cr4() -> u64 {
    let value: u64;
    // SAFETY: reading CR4 in ring 0 has no side effect.
    unsafe { asm!("mov {}, cr4", out(reg) value, options(nomem, nostack, preserves_flags)) };
    value
}

/// Writes CR4.
///
/// # Safety
///
/// Ring 0 only; `value` must keep the paging mode the kernel runs in (PAE,
/// and PCIDE only with CR3's PCID at zero when turning it on).
#[inline]
pub unsafe fn write_cr4(value: u64) {
    // SAFETY: the caller guarantees a consistent paging configuration.
    unsafe { asm!("mov cr4, {}", in(reg) value, options(nostack, preserves_flags)) };
}

/// Reads a model-specific register.
///
/// # Safety
///
/// Ring 0 only; `msr` must exist on this CPU (otherwise #GP).
#[inline]
pub unsafe fn rdmsr(msr: u32) -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: the caller guarantees ring 0 and an existing MSR.
    unsafe {
        asm!("rdmsr", in("ecx") msr, out("eax") lo, out("edx") hi, options(nomem, nostack, preserves_flags))
    };
    (u64::from(hi) << 32) | u64::from(lo)
}

/// Writes a model-specific register.
///
/// # Safety
///
/// Ring 0 only; `msr` must exist and accept `value`, and writing it must
/// not break what the kernel relies on.
#[inline]
pub unsafe fn wrmsr(msr: u32, value: u64) {
    // SAFETY: the caller guarantees ring 0 and a meaningful write.
    unsafe {
        asm!(
            "wrmsr",
            in("ecx") msr,
            in("eax") value as u32,
            in("edx") (value >> 32) as u32,
            options(nostack, preserves_flags)
        )
    };
}

/// The spin-wait hint.
#[inline]
pub fn pause() {
    core::hint::spin_loop();
}

/// RFLAGS.IF: maskable interrupts are enabled.
const RFLAGS_IF: u64 = 1 << 9;

/// Runs `f` with maskable interrupts disabled, then restores the interrupt
/// flag to what it was (enabled again only if it was enabled before).
///
/// # Safety
///
/// Ring 0 only (`cli` faults elsewhere); `f` must not rely on taking
/// interrupts.
#[inline]
pub(super) unsafe fn without_interrupts<R>(f: impl FnOnce() -> R) -> R {
    let rflags: u64;
    // SAFETY: reading RFLAGS through the stack has no other effect; no
    // `nomem`, so the compiler keeps memory accesses on their side of it.
    unsafe { asm!("pushfq", "pop {}", out(reg) rflags, options(preserves_flags)) };
    // SAFETY: ring 0 (the caller's guarantee); `cli` only masks interrupts.
    unsafe { asm!("cli", options(nostack)) };
    let result = f();
    if rflags & RFLAGS_IF != 0 {
        // SAFETY: ring 0; interrupts were enabled on entry, so enabling
        // them again restores the caller's state.
        unsafe { asm!("sti", options(nostack)) };
    }
    result
}

/// `CPUID` leaf `leaf`, subleaf `subleaf`: (eax, ebx, ecx, edx).
#[inline]
pub fn cpuid(leaf: u32, subleaf: u32) -> (u32, u32, u32, u32) {
    // SAFETY: CPUID exists on every x86_64 CPU and only reads identification
    // registers. Rust 1.94 made `__cpuid_count` safe; the minimum supported
    // Rust needs the `unsafe` block, which newer compilers call unused.
    #[allow(unused_unsafe)]
    let r = unsafe { core::arch::x86_64::__cpuid_count(leaf, subleaf) };
    (r.eax, r.ebx, r.ecx, r.edx)
}

/// CPUID leaf 0's vendor identification string: the twelve bytes of EBX,
/// EDX and ECX, in that order (`b"GenuineIntel"`, `b"AuthenticAMD"`, ...).
pub fn vendor_id() -> [u8; 12] {
    let (_, ebx, ecx, edx) = cpuid(0, 0);
    let mut id = [0; 12];
    id[..4].copy_from_slice(&ebx.to_le_bytes());
    id[4..8].copy_from_slice(&edx.to_le_bytes());
    id[8..].copy_from_slice(&ecx.to_le_bytes());
    id
}

/// Whether the vendor whose CPUID identification string is `vendor_id`
/// documents that its TLB fills set a PTE's accessed bit before they cache
/// the translation (what [`Arch::fill_sets_accessed`](super::Arch::fill_sets_accessed)
/// promises): Intel in SDM vol. 3A, section 4.10.2.3 "Details of TLB Use";
/// AMD in APM vol. 2, sections 5.4.2 "Notes on Accessed and Dirty Bits"
/// and 5.5.3 (speculative caching). Every other vendor gets false, Hygon
/// included (its CPUs derive from AMD's, but no text of its own was
/// found). A false answer only costs time: frame pools then wait for
/// flushes after each unmap.
pub const fn vendor_promises_fill_sets_accessed(vendor_id: &[u8; 12]) -> bool {
    matches!(vendor_id, b"GenuineIntel" | b"AuthenticAMD")
}

#[cfg(test)]
mod tests {
    //! What runs without ring 0: the vendor decision (CPUID itself is
    //! tested with the feature bits, in `x86_64_features.rs`).
    use super::*;

    #[test]
    fn only_intel_and_amd_promise_that_fills_set_the_accessed_bit() {
        assert!(vendor_promises_fill_sets_accessed(b"GenuineIntel"));
        assert!(vendor_promises_fill_sets_accessed(b"AuthenticAMD"));
        for other in [
            b"HygonGenuine",
            b"CentaurHauls",
            b"  Shanghai  ",
            b"GenuineIotel",
            b"GenuineTMx86",
            b"Geode by NSC",
            // Hypervisors' signatures (CPUID leaf 0x4000_0000), not vendors.
            b"KVMKVMKVM\0\0\0",
            b"VMwareVMware",
            b"TCGTCGTCGTCG",
            b"genuineintel",
            &[0; 12],
        ] {
            assert!(!vendor_promises_fill_sets_accessed(other), "{other:?}");
        }
    }
}
