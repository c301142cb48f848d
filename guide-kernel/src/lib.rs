//! The glue that `docs/embedding-x86_64.md` walks through, for a
//! tutorial-style x86_64 kernel (bootloader-based, paging with the `x86_64`
//! crate's `OffsetPageTable`). Every ```rust block of the guide is a
//! verbatim excerpt of these files, between `// guide: NAME` and
//! `// guide: end` markers; `scripts/guide-check.sh` builds the crate for
//! `x86_64-unknown-none` and checks that the excerpts match.
//!
//! It is a library: it compiles the calls, it does not boot. The kernel's
//! own pieces (its frame allocator, its per-CPU area, its APIC IDs) are
//! parameters.

#![no_std]

pub mod munmap;
pub mod reclaim;
pub mod sketch;
pub mod tlb;
