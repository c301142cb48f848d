//! What the CPU can do ([`Supported`], from CPUID alone) and what the
//! kernel has turned on ([`Features`], CPUID together with CR4 and
//! IA32_APIC_BASE), and the check [`X86_64::new`](super::x86_64::X86_64::new)
//! makes before it trusts a `Features`.
//!
//! The two differ for every bit that needs enabling. A CPU that supports
//! PCIDs runs without them until the kernel sets CR4.PCIDE; until then CR3
//! holds no PCID, and a CR3 value with PCID bits or the no-flush bit is not
//! one the crate may load. Global pages and 5-level paging are the same
//! with CR4.PGE and CR4.LA57, and x2APIC mode with IA32_APIC_BASE.
//!
//! The decisions are pure functions of register values
//! ([`Supported::from_cpuid`], [`Features::from_parts`],
//! [`Features::check`]), so that they are unit-tested on the host; only
//! the `detect` functions read the hardware.
//!
//! The `x86_64` module re-exports every public item.

use super::x86_64_apic::IA32_APIC_BASE;
use super::x86_64_instructions::{cpuid, rdmsr, read_cr4, vendor_id, vendor_promises_fill_sets_accessed};
use crate::Error;

/// CR4 bit 7: global pages (SDM vol. 3A, 2.5 "Control Registers").
pub const CR4_PGE: u64 = 1 << 7;
/// CR4 bit 12: 5-level paging, 57-bit linear addresses (SDM vol. 3A, 2.5).
pub const CR4_LA57: u64 = 1 << 12;
/// CR4 bit 17: process-context identifiers (SDM vol. 3A, 2.5 and 4.10.1).
pub const CR4_PCIDE: u64 = 1 << 17;
/// CR3 bit 63 on a MOV to CR3 with CR4.PCIDE set: keep the new PCID's
/// entries (SDM vol. 3A, 4.10.4.1).
pub const CR3_NOFLUSH: u64 = 1 << 63;
/// IA32_APIC_BASE bit 11: the local APIC is enabled (SDM vol. 3A, 10.4.4;
/// 11.4.4 in the editions that number the APIC chapter 11).
pub const APIC_BASE_ENABLE: u64 = 1 << 11;
/// IA32_APIC_BASE bit 10 (EXTD): with bit 11, the local APIC runs in x2APIC
/// mode (SDM vol. 3A, 10.12.1; 11.12.1 in the later editions).
pub const APIC_BASE_X2APIC: u64 = 1 << 10;

// CPUID feature flags (SDM vol. 2A, the CPUID instruction: leaf 01H's
// feature information in ECX and EDX, leaf 07H subleaf 0's structured
// extended features in EBX and ECX).
const LEAF1_ECX_PCID: u32 = 1 << 17;
const LEAF1_ECX_X2APIC: u32 = 1 << 21;
const LEAF1_ECX_HYPERVISOR: u32 = 1 << 31;
const LEAF1_EDX_APIC: u32 = 1 << 9;
const LEAF1_EDX_PGE: u32 = 1 << 13;
const LEAF7_EBX_INVPCID: u32 = 1 << 10;
const LEAF7_ECX_LA57: u32 = 1 << 16;

/// What the CPU supports, as CPUID reports it, whether or not the kernel
/// has turned it on: what a kernel reads to decide what to enable.
///
/// Safe to read anywhere (CPUID runs in user mode too). Do not hand it to
/// the crate as [`Features`]: a supported feature the kernel has not
/// enabled is not one the crate may use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Supported {
    /// Process-context identifiers (CPUID.01H:ECX bit 17).
    pub pcid: bool,
    /// The `INVPCID` instruction (CPUID.(07H,0):EBX bit 10).
    pub invpcid: bool,
    /// x2APIC mode (CPUID.01H:ECX bit 21).
    pub x2apic: bool,
    /// A local APIC, and so the IA32_APIC_BASE MSR (CPUID.01H:EDX bit 9).
    pub apic: bool,
    /// Global pages (CPUID.01H:EDX bit 13).
    pub pge: bool,
    /// 5-level paging (CPUID.(07H,0):ECX bit 16).
    pub la57: bool,
    /// A hypervisor runs this kernel as a guest (CPUID.01H:ECX bit 31;
    /// the hypervisor sets it, so a clear bit proves nothing).
    pub hypervisor: bool,
}

impl Supported {
    /// Decodes CPUID leaf 1's ECX and EDX and leaf 7 subleaf 0's EBX and
    /// ECX (zero when the CPU has no leaf 7).
    pub const fn from_cpuid(leaf1_ecx: u32, leaf1_edx: u32, leaf7_ebx: u32, leaf7_ecx: u32) -> Supported {
        Supported {
            pcid: leaf1_ecx & LEAF1_ECX_PCID != 0,
            invpcid: leaf7_ebx & LEAF7_EBX_INVPCID != 0,
            x2apic: leaf1_ecx & LEAF1_ECX_X2APIC != 0,
            apic: leaf1_edx & LEAF1_EDX_APIC != 0,
            pge: leaf1_edx & LEAF1_EDX_PGE != 0,
            la57: leaf7_ecx & LEAF7_ECX_LA57 != 0,
            hypervisor: leaf1_ecx & LEAF1_ECX_HYPERVISOR != 0,
        }
    }

    /// Reads CPUID on the running CPU.
    pub fn detect() -> Supported {
        let (_, _, ecx1, edx1) = cpuid(1, 0);
        let (ebx7, ecx7) = if cpuid(0, 0).0 >= 7 {
            let (_, ebx, ecx, _) = cpuid(7, 0);
            (ebx, ecx)
        } else {
            (0, 0)
        };
        Supported::from_cpuid(ecx1, edx1, ebx7, ecx7)
    }
}

/// The same as [`Supported::detect`]: what the CPU can do, enabled or not.
pub fn cpu_supports() -> Supported {
    Supported::detect()
}

/// The TLB-related features the kernel has enabled on this CPU, supported
/// and turned on both, plus two promises only the kernel can make: what
/// [`X86_64::new`](super::x86_64::X86_64::new) takes.
///
/// [`detect`](Self::detect) fills it from the hardware: CPUID for what the
/// CPU supports, CR4 and IA32_APIC_BASE for what is on, so that a kernel
/// passes its answer straight to `X86_64::new`, on each CPU after that
/// CPU's own CR4 is set up. A kernel deciding what to enable reads
/// [`Supported`] instead. A hand-built value must say no more than the
/// hardware: `X86_64::new` reads CR4 and CPUID and refuses a claim they
/// contradict ([`check`](Self::check)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Features {
    /// PCIDs are on: CR4.PCIDE is set. The crate tags address spaces with
    /// PCIDs only when [`invpcid`](Self::invpcid) holds too (flushing a
    /// page of an address space that is not loaded needs `INVPCID`);
    /// without it every CR3 it loads carries PCID 0, which is legal with
    /// CR4.PCIDE on or off.
    pub pcid: bool,
    /// The CPU has the `INVPCID` instruction (it needs no enabling).
    pub invpcid: bool,
    /// The local APIC runs in x2APIC mode (IA32_APIC_BASE bits 11 and 10).
    /// For the kernel's information: which registers the crate uses is
    /// the [`LocalApic`](super::x86_64::LocalApic) it is given.
    pub x2apic: bool,
    /// Global pages are on: CR4.PGE is set.
    pub pge: bool,
    /// 5-level paging is on: CR4.LA57 is set, and addresses have 57
    /// canonical bits instead of 48.
    pub la57: bool,
    /// The kernel promises that every kernel mapping has its global bit set
    /// (which needs [`pge`](Self::pge)). With PCIDs, flushing a kernel page
    /// is then one `invlpg` (it drops a global entry whatever PCID is
    /// loaded); without the promise a kernel page may sit, non-global, in
    /// every PCID's entries, and each kernel-page flush also drops every
    /// non-global entry of every PCID (`INVPCID` all-contexts), which is
    /// correct but costs every address space its TLB.
    /// [`detect`](Self::detect) leaves it false, the safe choice.
    pub kernel_global: bool,
    /// A hypervisor runs this kernel as a guest (CPUID leaf 1, ECX bit 31;
    /// the bit is the hypervisor's to set, so a clear one proves nothing).
    /// Reported for [`fill_sets_accessed`](Self::fill_sets_accessed)'s sake.
    pub hypervisor: bool,
    /// The kernel's declaration that on every CPU a TLB fill sets the PTE's
    /// accessed bit before the translation is cached
    /// ([`Arch::fill_sets_accessed`](super::Arch::fill_sets_accessed)
    /// answers it), which lets frame pools use aging epochs.
    /// [`detect`](Self::detect) sets it when the vendor documents the
    /// promise ([`vendor_promises_fill_sets_accessed`]: Intel and AMD).
    ///
    /// A kernel clears it when it cannot vouch for the TLB that really
    /// serves its accesses. On bare metal that is the processor's. In a
    /// guest ([`hypervisor`](Self::hypervisor)) with hardware nested paging
    /// (Intel EPT, AMD NPT) the processor walks the guest's own page tables
    /// and sets their accessed bits, so the vendor's promise carries over;
    /// with shadow paging the hypervisor fills the TLB from tables of its
    /// own, and the promise holds only if it sets the guest PTE's accessed
    /// bit before it installs a shadow entry for it (as a hypervisor must
    /// to emulate x86 faithfully, but a guest cannot check it). A guest
    /// that neither knows that its hypervisor uses nested paging nor
    /// trusts its shadow paging should clear the field. A kernel may set
    /// it for another vendor only on that vendor's written promise.
    /// Clearing it is always safe: pooled frames then wait for flushes
    /// after their unmap.
    pub fill_sets_accessed: bool,
}

impl Features {
    /// Combines what the CPU supports with CR4's and IA32_APIC_BASE's
    /// values into what is enabled; `vendor` (CPUID leaf 0's string)
    /// decides [`fill_sets_accessed`](Self::fill_sets_accessed).
    /// [`kernel_global`](Self::kernel_global), which only the kernel
    /// knows, stays false. Pass 0 as `apic_base` on a CPU without a local
    /// APIC.
    pub const fn from_parts(cpu: Supported, cr4: u64, apic_base: u64, vendor: &[u8; 12]) -> Features {
        let x2apic_mode = APIC_BASE_ENABLE | APIC_BASE_X2APIC;
        Features {
            pcid: cpu.pcid && cr4 & CR4_PCIDE != 0,
            invpcid: cpu.invpcid,
            x2apic: cpu.x2apic && apic_base & x2apic_mode == x2apic_mode,
            pge: cpu.pge && cr4 & CR4_PGE != 0,
            la57: cpu.la57 && cr4 & CR4_LA57 != 0,
            kernel_global: false,
            hypervisor: cpu.hypervisor,
            fill_sets_accessed: vendor_promises_fill_sets_accessed(vendor),
        }
    }

    /// What the running CPU has enabled: CPUID, CR4 and (when CPUID
    /// reports a local APIC) IA32_APIC_BASE, through
    /// [`from_parts`](Self::from_parts). Call it on each CPU after its CR4
    /// and APIC mode are set up; what another CPU enabled is not read.
    ///
    /// # Safety
    ///
    /// Ring 0 only: reading CR4 or an MSR elsewhere faults (#GP). It reads
    /// and changes nothing else.
    pub unsafe fn detect() -> Features {
        let cpu = Supported::detect();
        // SAFETY: ring 0 is the caller's guarantee; reading CR4 has no
        // side effect.
        let cr4 = unsafe { read_cr4() };
        let apic_base = if cpu.apic {
            // SAFETY: ring 0, and IA32_APIC_BASE exists on every CPU that
            // reports a local APIC (SDM vol. 3A, 10.4.4 / 11.4.4).
            unsafe { rdmsr(IA32_APIC_BASE) }
        } else {
            0
        };
        Features::from_parts(cpu, cr4, apic_base, &vendor_id())
    }

    /// Whether the crate may act on these claims, given what the CPU
    /// supports and CR4's value: the check
    /// [`X86_64::new`](super::x86_64::X86_64::new) makes.
    ///
    /// Refused, as [`Error::FeatureUnavailable`]:
    /// - [`invpcid`](Self::invpcid) on a CPU without `INVPCID`: the
    ///   instruction would raise #UD (SDM vol. 2A, INVPCID);
    /// - [`pcid`](Self::pcid) on a CPU without PCIDs, or with CR4.PCIDE
    ///   clear: CR3's low twelve bits are then no PCID (SDM vol. 3A, 4.5,
    ///   the use of CR3 with CR4.PCIDE = 0) and the no-flush bit 63 is
    ///   reserved, so the CR3 values the crate would load are wrong or
    ///   fault;
    /// - [`pge`](Self::pge) with CR4.PGE clear (or unsupported): kernel
    ///   mappings are then not global whatever their G bit says (SDM vol.
    ///   3A, 4.10.2.4), and [`kernel_global`](Self::kernel_global) would
    ///   leave their copies in other PCIDs unflushed;
    /// - [`la57`](Self::la57) with CR4.LA57 clear (or unsupported):
    ///   addresses above 48 bits would reach `INVPCID`, which faults on a
    ///   non-canonical address.
    ///
    /// Claiming less than is enabled is accepted: the crate then uses less
    /// of the hardware (PCID 0 for every CR3 it loads, which suffices as
    /// long as the kernel loads no other PCID itself; no single-`invlpg`
    /// kernel-page flush; 48-bit addresses). Its full flushes do not rest
    /// on the claim: they toggle CR4.PGE whenever CPUID reports it.
    pub const fn check(&self, cpu: &Supported, cr4: u64) -> Result<(), Error> {
        if self.invpcid && !cpu.invpcid {
            return Err(unsupported("INVPCID"));
        }
        if self.pcid {
            if !cpu.pcid {
                return Err(unsupported("PCID"));
            }
            if cr4 & CR4_PCIDE == 0 {
                return Err(not_enabled("PCID (CR4.PCIDE)"));
            }
        }
        if self.pge {
            if !cpu.pge {
                return Err(unsupported("global pages"));
            }
            if cr4 & CR4_PGE == 0 {
                return Err(not_enabled("global pages (CR4.PGE)"));
            }
        }
        if self.la57 {
            if !cpu.la57 {
                return Err(unsupported("5-level paging"));
            }
            if cr4 & CR4_LA57 == 0 {
                return Err(not_enabled("5-level paging (CR4.LA57)"));
            }
        }
        Ok(())
    }
}

const fn unsupported(feature: &'static str) -> Error {
    Error::FeatureUnavailable {
        feature,
        supported: false,
    }
}

const fn not_enabled(feature: &'static str) -> Error {
    Error::FeatureUnavailable {
        feature,
        supported: true,
    }
}

#[cfg(test)]
mod tests {
    //! The decisions, from register values alone, and CPUID itself (user
    //! mode may execute it). Reading CR4 needs ring 0: the QEMU and Bochs
    //! test kernels (`qemu-test/`) run [`Features::detect`].
    use super::*;

    /// A CPU with every feature here (leaf 1 ECX/EDX, leaf 7 EBX/ECX).
    const EVERYTHING: Supported = Supported::from_cpuid(
        LEAF1_ECX_PCID | LEAF1_ECX_X2APIC | LEAF1_ECX_HYPERVISOR,
        LEAF1_EDX_APIC | LEAF1_EDX_PGE,
        LEAF7_EBX_INVPCID,
        LEAF7_ECX_LA57,
    );
    const INTEL: &[u8; 12] = b"GenuineIntel";

    #[test]
    fn cpuid_bits_decode_to_what_the_cpu_supports() {
        assert_eq!(
            EVERYTHING,
            Supported {
                pcid: true,
                invpcid: true,
                x2apic: true,
                apic: true,
                pge: true,
                la57: true,
                hypervisor: true,
            }
        );
        assert_eq!(Supported::from_cpuid(0, 0, 0, 0), Supported::default());
        // Neighbouring bits mean other things.
        let others = Supported::from_cpuid(
            !(LEAF1_ECX_PCID | LEAF1_ECX_X2APIC | LEAF1_ECX_HYPERVISOR),
            !(LEAF1_EDX_APIC | LEAF1_EDX_PGE),
            !LEAF7_EBX_INVPCID,
            !LEAF7_ECX_LA57,
        );
        assert_eq!(others, Supported::default());
    }

    #[test]
    fn a_supported_feature_the_kernel_has_not_enabled_is_not_reported() {
        // `-cpu max` before the kernel touched CR4: everything supported,
        // nothing on but the local APIC in xAPIC mode.
        let f = Features::from_parts(EVERYTHING, 0, APIC_BASE_ENABLE, INTEL);
        assert!(!f.pcid && !f.pge && !f.la57 && !f.x2apic);
        // INVPCID needs no enabling; the CPUID facts carry over.
        assert!(f.invpcid && f.hypervisor && f.fill_sets_accessed);
        assert!(!f.kernel_global, "a promise only the kernel makes");
        // And the crate accepts that answer.
        assert_eq!(f.check(&EVERYTHING, 0), Ok(()));
    }

    #[test]
    fn enabled_features_are_reported() {
        let cr4 = CR4_PCIDE | CR4_PGE | CR4_LA57;
        let f = Features::from_parts(EVERYTHING, cr4, APIC_BASE_ENABLE | APIC_BASE_X2APIC, INTEL);
        assert!(f.pcid && f.invpcid && f.pge && f.la57 && f.x2apic);
        assert_eq!(f.check(&EVERYTHING, cr4), Ok(()));
        // Each bit alone.
        assert!(Features::from_parts(EVERYTHING, CR4_PCIDE, 0, INTEL).pcid);
        assert!(Features::from_parts(EVERYTHING, CR4_PGE, 0, INTEL).pge);
        assert!(Features::from_parts(EVERYTHING, CR4_LA57, 0, INTEL).la57);
        // x2APIC mode needs the enable bit as well as EXTD.
        assert!(!Features::from_parts(EVERYTHING, 0, APIC_BASE_X2APIC, INTEL).x2apic);
    }

    #[test]
    fn an_enabled_bit_on_a_cpu_that_does_not_report_it_is_not_trusted() {
        let none = Supported::default();
        let f = Features::from_parts(none, CR4_PCIDE | CR4_PGE | CR4_LA57, !0, b"AuthenticAMD");
        assert!(!f.pcid && !f.invpcid && !f.pge && !f.la57 && !f.x2apic);
        assert!(f.fill_sets_accessed);
        assert!(!Features::from_parts(none, 0, 0, b"HygonGenuine").fill_sets_accessed);
    }

    #[test]
    fn pcid_claimed_while_cr4_pcide_is_off_is_refused() {
        // The README's old mistake: CPUID's answer passed as what is on.
        let claimed = Features {
            pcid: true,
            invpcid: true,
            pge: true,
            ..Features::default()
        };
        assert_eq!(
            claimed.check(&EVERYTHING, CR4_PGE),
            Err(Error::FeatureUnavailable {
                feature: "PCID (CR4.PCIDE)",
                supported: true
            })
        );
        assert_eq!(claimed.check(&EVERYTHING, CR4_PGE | CR4_PCIDE), Ok(()));
    }

    #[test]
    fn claims_the_cpu_cannot_back_are_refused() {
        let cpu = Supported {
            pcid: true,
            pge: true,
            ..Supported::default()
        };
        let everything_on = CR4_PCIDE | CR4_PGE | CR4_LA57;
        let invpcid = Features {
            invpcid: true,
            ..Features::default()
        };
        assert_eq!(
            invpcid.check(&cpu, everything_on),
            Err(Error::FeatureUnavailable {
                feature: "INVPCID",
                supported: false
            })
        );
        let pcid = Features {
            pcid: true,
            ..Features::default()
        };
        assert_eq!(
            pcid.check(&Supported::default(), everything_on),
            Err(Error::FeatureUnavailable {
                feature: "PCID",
                supported: false
            })
        );
        // PCIDs without INVPCID are accepted: the crate then tags nothing.
        assert_eq!(pcid.check(&cpu, CR4_PCIDE), Ok(()));
        let la57 = Features {
            la57: true,
            ..Features::default()
        };
        assert!(matches!(
            la57.check(&cpu, everything_on),
            Err(Error::FeatureUnavailable { supported: false, .. })
        ));
        assert!(matches!(
            la57.check(&EVERYTHING, 0),
            Err(Error::FeatureUnavailable { supported: true, .. })
        ));
        let pge = Features {
            pge: true,
            kernel_global: true,
            ..Features::default()
        };
        assert!(matches!(
            pge.check(&cpu, 0),
            Err(Error::FeatureUnavailable { supported: true, .. })
        ));
        assert!(matches!(
            pge.check(&Supported::default(), CR4_PGE),
            Err(Error::FeatureUnavailable { supported: false, .. })
        ));
        assert_eq!(pge.check(&cpu, CR4_PGE), Ok(()));
    }

    #[test]
    fn what_detect_reads_is_what_a_fresh_check_accepts() {
        // Any answer `from_parts` gives passes `check` with the same
        // registers, whatever they hold.
        for cr4 in [
            0,
            CR4_PCIDE,
            CR4_PGE,
            CR4_LA57,
            CR4_PCIDE | CR4_PGE | CR4_LA57,
            !0,
        ] {
            for cpu in [Supported::default(), EVERYTHING] {
                let f = Features::from_parts(cpu, cr4, !0, INTEL);
                assert_eq!(f.check(&cpu, cr4), Ok(()), "{cpu:?} cr4 {cr4:#x}");
            }
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "CPUID is inline assembly, which Miri cannot run")]
    fn cpu_supports_reads_this_cpus_cpuid() {
        let s = cpu_supports();
        assert_eq!(s, Supported::detect());
        assert_eq!(s.hypervisor, cpuid(1, 0).2 & LEAF1_ECX_HYPERVISOR != 0);
        assert_eq!(s.pcid, cpuid(1, 0).2 & LEAF1_ECX_PCID != 0);
    }
}
