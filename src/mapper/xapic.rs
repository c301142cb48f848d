//! Mapping the local APIC's xAPIC register page with the `x86_64` crate's
//! [`Mapper`], the mapping that
//! [`LocalApic::xapic`](crate::arch::x86_64::LocalApic::xapic) needs.
//!
//! What the mapping must be, and why:
//!
//! - The frame: the physical page IA32_APIC_BASE names (bits 12 up to the
//!   CPU's physical-address width; 0xFEE0_0000 after reset), read on the
//!   CPU itself (SDM vol. 3A, 10.4.4 "Local APIC Status and Location";
//!   11.4.4 in the editions that number the APIC chapter 11). Every CPU's
//!   APIC answers at its own copy of that address, so one mapping serves
//!   all CPUs, as long as no kernel moved one CPU's base.
//! - 4 KiB: the registers fill one 4 KiB page (10.4.1 / 11.4.1). A huge
//!   page around it would also map whatever lies next to it.
//! - Present and writable (EOI and the interrupt command register are
//!   written), not user-accessible.
//! - Uncached: the SDM requires the strong uncacheable (UC) memory type
//!   for the APIC's registers (10.4.1 / 11.4.1). The entry sets PCD and
//!   PWT with PAT clear, which selects PAT entry 3, UC from reset (vol. 3A,
//!   11.12.3 "Selecting a Memory Type from the PAT" and 11.12.4
//!   "Programming the PAT" in the editions whose APIC chapter is 10; the
//!   titles stay when the chapters are renumbered). A kernel that
//!   reprogrammed PAT entry 3 maps the page itself.
//! - No-execute when the kernel runs with IA32_EFER.NXE set (bit 63 of an
//!   entry is reserved otherwise and faults on use: vol. 3A, 4.5 and 4.7),
//!   global when the kernel promises global kernel mappings
//!   ([`Features::kernel_global`](crate::arch::x86_64::Features::kernel_global)):
//!   [`XapicPage`] chooses both.
//! - Only in xAPIC mode: in x2APIC mode the registers are MSRs and the page
//!   is not decoded (vol. 3A, 10.12 / 11.12), and a disabled APIC answers
//!   nothing; [`xapic_frame`] refuses both.

use core::fmt;

use x86_64::structures::paging::mapper::{MapToError, MapperFlush};
use x86_64::structures::paging::{FrameAllocator, Mapper, Page, PageTableFlags, PhysFrame, Size4KiB};
use x86_64::PhysAddr;

/// IA32_APIC_BASE bit 11: the APIC is enabled.
const APIC_ENABLED: u64 = 1 << 11;
/// IA32_APIC_BASE bit 10: x2APIC mode (with bit 11).
const X2APIC_MODE: u64 = 1 << 10;
/// IA32_APIC_BASE bits 12 to 51: the register page's physical address
/// (the bits above the CPU's physical-address width read as zero).
const BASE_MASK: u64 = 0x000f_ffff_ffff_f000;

/// Why the xAPIC page was not mapped. Nothing was changed, except where a
/// [`Map`](Self::Map) error of the `x86_64` crate says otherwise.
#[derive(Debug)]
pub enum XapicMapError {
    /// IA32_APIC_BASE says the APIC is disabled (bit 11 clear).
    ApicDisabled,
    /// IA32_APIC_BASE says x2APIC mode (bit 10 set): the registers are MSRs
    /// ([`LocalApic::x2apic`](crate::arch::x86_64::LocalApic::x2apic)), and
    /// no page is needed.
    X2ApicMode,
    /// The `x86_64` crate's [`Mapper::map_to`] refused: the page is already
    /// mapped, lies in a huge page, or a table frame could not be had.
    Map(MapToError<Size4KiB>),
}

impl fmt::Display for XapicMapError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            XapicMapError::ApicDisabled => write!(f, "the local APIC is disabled (IA32_APIC_BASE bit 11)"),
            XapicMapError::X2ApicMode => {
                write!(f, "the local APIC is in x2APIC mode: its registers are MSRs")
            }
            XapicMapError::Map(MapToError::FrameAllocationFailed) => {
                write!(f, "no frame for a page table on the way to the xAPIC page")
            }
            XapicMapError::Map(MapToError::ParentEntryHugePage) => {
                write!(f, "the xAPIC page's virtual address lies in a huge page")
            }
            XapicMapError::Map(MapToError::PageAlreadyMapped(_)) => {
                write!(f, "the xAPIC page's virtual address is already mapped")
            }
        }
    }
}

impl core::error::Error for XapicMapError {}

/// The register page IA32_APIC_BASE (`apic_base`, the MSR's value) names,
/// when the APIC is enabled in xAPIC mode.
///
/// Errors: [`XapicMapError::ApicDisabled`], [`XapicMapError::X2ApicMode`].
pub fn xapic_frame(apic_base: u64) -> Result<PhysFrame<Size4KiB>, XapicMapError> {
    if apic_base & APIC_ENABLED == 0 {
        return Err(XapicMapError::ApicDisabled);
    }
    if apic_base & X2APIC_MODE != 0 {
        return Err(XapicMapError::X2ApicMode);
    }
    // The mask leaves a 4 KiB-aligned address below 2^52: neither step
    // changes it.
    Ok(PhysFrame::containing_address(PhysAddr::new_truncate(
        apic_base & BASE_MASK,
    )))
}

/// The choices the xAPIC page's entry leaves to the kernel; the rest of
/// its flags are fixed ([`flags`](Self::flags)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct XapicPage {
    /// Set the no-execute bit: only when IA32_EFER.NXE is on, where the
    /// bit exists (with NXE off it is reserved, and the first access
    /// faults).
    pub no_execute: bool,
    /// Set the global bit, as a kernel that promises
    /// [`Features::kernel_global`](crate::arch::x86_64::Features::kernel_global)
    /// must for every kernel mapping (it needs CR4.PGE).
    pub global: bool,
}

impl XapicPage {
    /// The entry's flags: present, writable, PCD and PWT (UC through the
    /// reset PAT), supervisor-only, and what `self` asks for.
    pub fn flags(&self) -> PageTableFlags {
        let mut flags = PageTableFlags::PRESENT
            | PageTableFlags::WRITABLE
            | PageTableFlags::NO_CACHE
            | PageTableFlags::WRITE_THROUGH;
        if self.no_execute {
            flags |= PageTableFlags::NO_EXECUTE;
        }
        if self.global {
            flags |= PageTableFlags::GLOBAL;
        }
        flags
    }
}

/// Maps the xAPIC register page that `apic_base` (IA32_APIC_BASE's value)
/// names at `page`, a 4 KiB page not mapped yet, with
/// [`XapicPage::flags`]; missing page tables come from `frames`. Then
/// [`LocalApic::xapic`](crate::arch::x86_64::LocalApic::xapic)`(page's
/// address)` reaches the registers.
///
/// Returns the `x86_64` crate's flush token for `page`: call `flush()` on
/// it (one `invlpg`) before the first access, or pass it on as that crate
/// describes.
///
/// Errors: [`XapicMapError::ApicDisabled`] and
/// [`XapicMapError::X2ApicMode`] before anything is changed;
/// [`XapicMapError::Map`] as [`Mapper::map_to`] reports it (an
/// already-mapped page is left as it was).
///
/// # Safety
///
/// [`Mapper::map_to`]'s: the new mapping must not break memory safety.
/// Here that means `frames` hands out only unused frames, and nothing
/// treats the APIC's physical page (or `page`) as memory. The mapping
/// stays while any `LocalApic` built on it is used.
pub unsafe fn map_xapic<M, A>(
    mapper: &mut M,
    frames: &mut A,
    page: Page<Size4KiB>,
    apic_base: u64,
    options: XapicPage,
) -> Result<MapperFlush<Size4KiB>, XapicMapError>
where
    M: Mapper<Size4KiB>,
    A: FrameAllocator<Size4KiB> + ?Sized,
{
    let frame = xapic_frame(apic_base)?;
    // SAFETY: the caller's guarantees are `map_to`'s: the frame is the
    // APIC's MMIO page, which nothing else uses as memory, mapped uncached.
    unsafe { mapper.map_to(page, frame, options.flags(), frames) }.map_err(XapicMapError::Map)
}

/// The whole xAPIC set-up on the running CPU, for a kernel whose tables
/// the `x86_64` crate manages: reads IA32_APIC_BASE, maps its register
/// page at `page` ([`map_xapic`]), flushes that page from this CPU's TLB,
/// and returns the [`LocalApic`](crate::arch::x86_64::LocalApic) that
/// reaches it (for [`X86_64::new`](crate::arch::x86_64::X86_64::new)).
/// Call it once, on the boot CPU: every CPU's registers are at the same
/// address (each reaches its own APIC there), and the mapping belongs to
/// the kernel's half, which every address space shares.
///
/// Errors: as for [`map_xapic`], with nothing mapped.
///
/// # Safety
///
/// Ring 0 (it reads an MSR), and [`map_xapic`]'s: `frames` hands out only
/// unused frames, nothing treats the APIC's physical page or `page` as
/// memory, and the mapping stays for as long as the returned value or a
/// copy of it is used.
#[cfg(all(target_arch = "x86_64", not(all(test, loom))))]
pub unsafe fn map_local_xapic<M, A>(
    mapper: &mut M,
    frames: &mut A,
    page: Page<Size4KiB>,
    options: XapicPage,
) -> Result<crate::arch::x86_64::LocalApic, XapicMapError>
where
    M: Mapper<Size4KiB>,
    A: FrameAllocator<Size4KiB> + ?Sized,
{
    use crate::arch::x86_64::{invlpg, rdmsr, LocalApic, IA32_APIC_BASE};
    // SAFETY: ring 0 (the caller's promise); the MSR exists on every CPU
    // with a local APIC.
    let apic_base = unsafe { rdmsr(IA32_APIC_BASE) };
    // SAFETY: the caller's promise is `map_xapic`'s. The flush is done
    // below, by the crate's own `invlpg` (the `x86_64` crate's needs its
    // `instructions` feature).
    unsafe { map_xapic(mapper, frames, page, apic_base, options) }?.ignore();
    // SAFETY: ring 0 (the caller's promise).
    unsafe { invlpg(page.start_address().as_u64()) };
    // SAFETY: the page maps the APIC's registers uncached, as
    // `LocalApic::xapic` asks, for as long as the caller uses the value.
    Ok(unsafe { LocalApic::xapic(page.start_address().as_u64() as usize) })
}

#[cfg(test)]
mod tests {
    //! The decoding and the flags; the mapping itself is tested over real
    //! tables in `tests/x86_64_mapper_xapic.rs`.
    use super::*;

    #[test]
    fn the_frame_is_the_base_field_of_an_enabled_xapic() {
        // After reset: enabled, bootstrap processor (bit 8), 0xFEE0_0000.
        let frame = xapic_frame(0xfee0_0900).unwrap();
        assert_eq!(frame.start_address().as_u64(), 0xfee0_0000);
        // Bits below 12 and above 51 are not the address.
        let frame = xapic_frame(0xfff0_0001_2345_6fff & !X2APIC_MODE).unwrap();
        assert_eq!(frame.start_address().as_u64(), 0x0001_2345_6000);
        assert!(matches!(
            xapic_frame(0xfee0_0000),
            Err(XapicMapError::ApicDisabled)
        ));
        assert!(matches!(xapic_frame(0xfee0_0c00), Err(XapicMapError::X2ApicMode)));
    }

    #[test]
    fn the_entry_is_uncached_writable_and_supervisor_only() {
        let f = XapicPage::default().flags();
        let fixed = PageTableFlags::PRESENT
            | PageTableFlags::WRITABLE
            | PageTableFlags::NO_CACHE
            | PageTableFlags::WRITE_THROUGH;
        assert_eq!(f, fixed);
        let all = XapicPage {
            no_execute: true,
            global: true,
        }
        .flags();
        assert_eq!(all, fixed | PageTableFlags::NO_EXECUTE | PageTableFlags::GLOBAL);
        assert!(!all.contains(PageTableFlags::USER_ACCESSIBLE) && !all.contains(PageTableFlags::HUGE_PAGE));
    }
}
