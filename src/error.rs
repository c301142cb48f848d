//! The crate's error type.

use core::fmt;

/// Everything that can go wrong at a public entry point of this crate.
///
/// Bad input never panics: it comes back as one of these values, and the
/// operation that reported it changed nothing (a batch that could not be
/// flushed is still pending, so no flush is ever lost).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Error {
    /// A CPU index at or above [`MAX_CPUS`](crate::MAX_CPUS), or a CPU the
    /// machine does not have.
    CpuOutOfRange {
        /// The index that was given.
        cpu: usize,
        /// The first index that is out of range.
        limit: usize,
    },
    /// A virtual address that should be page-aligned is not.
    Unaligned {
        /// The address that was given.
        addr: u64,
    },
    /// A range whose start lies above its end, or whose end overflows.
    InvalidRange {
        /// First address of the range.
        start: u64,
        /// One past the last address of the range.
        end: u64,
    },
    /// The reserved kernel ASID value was given where a user ASID belongs.
    ReservedAsid,
    /// A fixed-capacity reverse map has no room for another mapping.
    RmapFull {
        /// How many mappings it holds.
        capacity: usize,
    },
    /// A shootdown was started on a CPU whose own request slot is already in
    /// use: the caller re-entered the shootdown code from an interrupt on the
    /// same CPU. Nothing was flushed and nothing was lost; retry from a
    /// context that is not nested inside another shootdown.
    ShootdownReentered {
        /// The CPU that tried to start a second shootdown.
        cpu: usize,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Error::CpuOutOfRange { cpu, limit } => {
                write!(f, "CPU index {cpu} is out of range (limit {limit})")
            }
            Error::Unaligned { addr } => write!(f, "address {addr:#x} is not page-aligned"),
            Error::InvalidRange { start, end } => {
                write!(f, "invalid range {start:#x}..{end:#x}")
            }
            Error::ReservedAsid => write!(f, "the kernel ASID is reserved"),
            Error::RmapFull { capacity } => write!(f, "the reverse map is full ({capacity} mappings)"),
            Error::ShootdownReentered { cpu } => {
                write!(f, "CPU {cpu} re-entered a TLB shootdown while one was in flight")
            }
        }
    }
}

impl core::error::Error for Error {}
