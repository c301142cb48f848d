//! The decisions of the x86_64 `Arch` that run without ring 0: which
//! instruction drops a page, and which PCID an ASID gets (CPU
//! registration and the all-but-self shorthand are tested in
//! `x86_64_cpus.rs`). The instructions themselves run in the QEMU and
//! Bochs test kernels (`qemu-test/`).
//!
//! This file is `x86_64.rs`'s `#[cfg(test)]` module (included by
//! `#[path]`), compiled into the test harness only: its `unwrap`s are test
//! assertions on values each test built itself, not library code.
use super::*;

#[test]
fn a_page_flush_reaches_every_pcid_that_may_hold_the_page() {
    let user = Asid::new(5).unwrap();
    // Without PCIDs: one context, `invlpg` whatever the ASID.
    assert_eq!(page_flush(user, false, false, 0), PageFlush::Invlpg);
    assert_eq!(page_flush(Asid::KERNEL, false, false, 0), PageFlush::Invlpg);
    // A user page of the loaded PCID, or of another one.
    assert_eq!(page_flush(user, true, false, 5), PageFlush::Invlpg);
    assert_eq!(page_flush(user, true, true, 9), PageFlush::InvpcidAddress(5));
    // A kernel page: global entries are dropped by `invlpg` in any
    // PCID; a kernel that cannot promise global mappings gets every
    // PCID flushed, whatever is loaded.
    assert_eq!(page_flush(Asid::KERNEL, true, true, 5), PageFlush::Invlpg);
    assert_eq!(page_flush(Asid::KERNEL, true, false, 5), PageFlush::EveryPcid);
    assert_eq!(page_flush(Asid::KERNEL, true, false, 0), PageFlush::EveryPcid);
    // An ASID wider than a PCID (only by a direct call): every PCID,
    // never the PCID its low bits would name.
    let wide = Asid::new(4096 + 5).unwrap();
    assert_eq!(page_flush(wide, true, true, 5), PageFlush::EveryPcid);
}

#[test]
fn new_acts_on_what_cr4_enables_and_refuses_more() {
    static CPUS: CpuTable = CpuTable::new();
    static TLB: TlbShootdown = TlbShootdown::new();
    // SAFETY: the value's registers are never touched here.
    let apic = unsafe { LocalApic::xapic(0x1000) };
    let build =
        |f: Features, cpu: &Supported, cr4: u64| X86_64::from_registers(apic, 0xf0, &CPUS, &TLB, f, cpu, cr4);
    let (pcid, invpcid, pge) = (true, true, true);
    let cpu = Supported {
        pcid,
        invpcid,
        pge,
        ..Supported::default()
    };
    let f = Features {
        pcid,
        invpcid,
        pge,
        kernel_global: true,
        ..Features::default()
    };
    // CPUID's answer with CR4.PCIDE clear: refused, no CR3 with PCIDs.
    assert!(matches!(
        build(f, &cpu, CR4_PGE),
        Err(Error::FeatureUnavailable { supported: true, .. })
    ));
    let arch = build(f, &cpu, CR4_PGE | CR4_PCIDE).unwrap();
    assert!(arch.uses_pcid() && arch.tagged_tlb() && arch.kernel_global);
    // One INVLPG per kernel page: the crate must see only global entries
    // changed through the kernel's space.
    assert!(arch.kernel_flush_needs_global());
    // Either half alone needs nothing: without the promise every kernel
    // page flush reaches every PCID, and without PCIDs every non-global
    // entry is the loaded space's.
    let arch = build(
        Features {
            kernel_global: false,
            ..f
        },
        &cpu,
        CR4_PGE | CR4_PCIDE,
    )
    .unwrap();
    assert!(arch.uses_pcid() && !arch.kernel_global);
    assert!(!arch.kernel_flush_needs_global());
    let arch = build(Features { pcid: false, ..f }, &cpu, CR4_PGE).unwrap();
    assert!(!arch.uses_pcid() && arch.kernel_global);
    assert!(!arch.kernel_flush_needs_global());
    // What the kernel enabled, read from the same registers: accepted.
    let enabled = Features::from_parts(cpu, CR4_PGE, 0, b"GenuineIntel");
    let arch = build(enabled, &cpu, CR4_PGE).unwrap();
    assert!(!arch.uses_pcid() && arch.invpcid && arch.pge_supported && !arch.kernel_global);
    assert!(!arch.kernel_flush_needs_global());
    // PCIDs on without INVPCID: accepted, but nothing is tagged; PGE
    // left out: no global shortcut, and full flushes still toggle it.
    let no_invpcid = Supported {
        invpcid: false,
        ..cpu
    };
    let f = Features {
        invpcid: false,
        pge: false,
        ..f
    };
    let arch = build(f, &no_invpcid, CR4_PGE | CR4_PCIDE).unwrap();
    assert!(!arch.uses_pcid() && arch.pge_supported && !arch.kernel_global);
    assert!(!arch.kernel_flush_needs_global());
}

#[test]
fn pcids_are_the_asids_and_the_kernel_has_zero() {
    assert_eq!(X86_64::pcid_of(Asid::KERNEL), Some(0));
    assert_eq!(X86_64::pcid_of(Asid::new(1).unwrap()), Some(1));
    assert_eq!(X86_64::pcid_of(Asid::new(4095).unwrap()), Some(4095));
    // Wider than 12 bits: no PCID, never another address space's.
    assert_eq!(X86_64::pcid_of(Asid::new(4096).unwrap()), None);
    assert_eq!(X86_64::pcid_of(Asid::new(4096 + 5).unwrap()), None);
}

#[test]
fn a_kernel_given_cpu_index_is_checked_against_the_table() {
    static CPUS: CpuTable = CpuTable::new();
    static TLB: TlbShootdown = TlbShootdown::new();
    CPUS.register(1, 0x10).unwrap();
    // SAFETY: the value's registers are never touched: with an index
    // hook, `current_cpu` reads no APIC ID.
    let apic = unsafe { LocalApic::xapic(0x1000) };
    let arch = X86_64::from_registers(
        apic,
        0xf0,
        &CPUS,
        &TLB,
        Features::default(),
        &Supported::default(),
        0,
    )
    .unwrap();
    // SAFETY: no CPU runs crate code with this value; the test asks it.
    let one = unsafe { arch.with_cpu_index(|| 1) };
    assert_eq!(one.current_cpu(), Ok(CpuId::new(1).unwrap()));
    // SAFETY: as above.
    let unregistered = unsafe { X86_64 { ..one }.with_cpu_index(|| 2) };
    assert_eq!(
        unregistered.current_cpu(),
        Err(Error::UnregisteredCpu { hw_id: 2 })
    );
    // SAFETY: as above.
    let wild = unsafe { X86_64 { ..one }.with_cpu_index(|| usize::MAX) };
    assert!(matches!(wild.current_cpu(), Err(Error::CpuOutOfRange { .. })));
}

/// The entry macro assembles to the interrupt entry its docs describe:
/// nine pushes, `cld`, a call, nine pops and `iretq` (it is never called:
/// it ends with `iretq`; its bytes are read instead). Returns where the
/// call goes.
fn check_entry_bytes(entry: unsafe extern "C" fn()) -> usize {
    let start = entry as *const u8;
    // SAFETY: the function's code is mapped readable; 40 bytes cover it.
    let code = unsafe { core::slice::from_raw_parts(start, 40) };
    let pushes = [
        0x50, 0x51, 0x52, 0x56, 0x57, 0x41, 0x50, 0x41, 0x51, 0x41, 0x52, 0x41, 0x53,
    ];
    assert_eq!(&code[..13], &pushes, "push rax..r11");
    assert_eq!(code[13], 0xfc, "cld");
    assert_eq!(code[14], 0xe8, "call rel32");
    let pops = [
        0x41, 0x5b, 0x41, 0x5a, 0x41, 0x59, 0x41, 0x58, 0x5f, 0x5e, 0x5a, 0x59, 0x58,
    ];
    assert_eq!(&code[19..32], &pops, "pop r11..rax");
    assert_eq!(&code[32..34], &[0x48, 0xcf], "iretq");
    let rel = i32::from_le_bytes([code[15], code[16], code[17], code[18]]);
    (start as usize + 19).wrapping_add_signed(rel as isize)
}

#[test]
#[cfg_attr(miri, ignore = "reads machine code through a function pointer")]
fn the_flush_ipi_entry_macro_defines_an_interrupt_entry() {
    extern "C" fn handler() {}
    crate::x86_64_flush_ipi_entry!(entry => handler);
    assert_eq!(check_entry_bytes(entry), handler as extern "C" fn() as usize);
}

/// The `for` form: the same entry, calling a handler of its own (not the
/// `=>` form's) that serves the `Arch` it was given.
#[test]
#[cfg_attr(miri, ignore = "reads machine code through a function pointer")]
fn the_flush_ipi_entry_macro_serves_the_arch_it_is_given() {
    static ARCH: spin::Once<X86_64> = spin::Once::new();
    fn arch() -> &'static X86_64 {
        ARCH.get().unwrap()
    }
    extern "C" fn other() {}
    crate::x86_64_flush_ipi_entry!(entry => other);
    crate::x86_64_flush_ipi_entry!(served for arch());
    let target = check_entry_bytes(served);
    assert_ne!(target, other as extern "C" fn() as usize);
    assert_ne!(target, check_entry_bytes(entry));
}
