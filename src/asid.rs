//! Address-space identifiers.

use core::fmt;

use crate::Error;

/// An address-space identifier as the TLB sees it (x86 PCID, arm64 ASID).
///
/// On hardware without tagged TLBs the value only tells address spaces apart
/// in this crate's bookkeeping. [`Asid::KERNEL`] is reserved for the kernel's
/// own (global) mappings, and 0 is reserved too (x86's PCID 0 is the
/// kernel's, arm64 kernels keep ASID 0 for themselves). How many values the
/// hardware tells apart is the architecture's to say
/// ([`Arch::asid_bits`](crate::Arch::asid_bits)); every entry point refuses a wider one.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Asid(u16);

impl Asid {
    /// The kernel address space: its entries are global (they survive
    /// address-space switches), so flushing it must include global entries.
    pub const KERNEL: Asid = Asid(u16::MAX);

    /// A user ASID, or [`Error::ReservedAsid`] for 0 and for the kernel's
    /// value (`u16::MAX`).
    pub const fn new(value: u16) -> Result<Asid, Error> {
        if value == u16::MAX || value == 0 {
            Err(Error::ReservedAsid)
        } else {
            Ok(Asid(value))
        }
    }

    /// The ASID with this raw value, unchecked: for values the crate itself
    /// stored from a valid `Asid`.
    pub(crate) const fn from_raw(value: u16) -> Asid {
        Asid(value)
    }

    /// The raw value.
    pub const fn value(self) -> u16 {
        self.0
    }

    /// Whether this is [`Asid::KERNEL`].
    pub const fn is_kernel(self) -> bool {
        self.0 == u16::MAX
    }
}

impl fmt::Debug for Asid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_kernel() {
            write!(f, "asid(kernel)")
        } else {
            write!(f, "asid({})", self.0)
        }
    }
}
