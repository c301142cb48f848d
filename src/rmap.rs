//! Reverse-map unmapping flags.
//!
//! `try_to_unmap` and `page_referenced` arrive with the reverse-map work;
//! the flags live here already because [`TlbFlushUnmapBatch::should_defer`]
//! reads them.
//!
//! [`TlbFlushUnmapBatch::should_defer`]: crate::TlbFlushUnmapBatch::should_defer

bitflags::bitflags! {
    /// How `try_to_unmap` treats a frame's mappings (Linux's
    /// `enum ttu_flags`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct TtuFlags: u32 {
        /// Install migration entries instead of empty PTEs.
        const MIGRATION = 1 << 0;
        /// Only clear mlock state; unmap nothing.
        const MUNLOCK = 1 << 1;
        /// Unmap even mlocked mappings.
        const IGNORE_MLOCK = 1 << 2;
        /// Unmap even recently referenced mappings.
        const IGNORE_ACCESS = 1 << 3;
        /// Unmap even a frame marked hardware-poisoned.
        const IGNORE_HWPOISON = 1 << 4;
        /// Defer TLB flushes into a [`TlbFlushUnmapBatch`](crate::TlbFlushUnmapBatch)
        /// where the architecture allows it.
        const BATCH_FLUSH = 1 << 5;
    }
}
