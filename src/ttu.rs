//! How an unmap treats a frame's mappings (Linux's `enum ttu_flags`).

bitflags::bitflags! {
    /// How [`try_to_unmap`](crate::try_to_unmap) treats a frame's mappings (Linux's
    /// `enum ttu_flags`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct TtuFlags: u32 {
        /// Install migration entries instead of empty PTEs.
        const MIGRATION = 1 << 0;
        /// Unmap nothing: only find out whether a mapping still locks the
        /// frame in memory ([`SwapResult::Mlock`](crate::SwapResult::Mlock)) or not
        /// ([`SwapResult::Again`](crate::SwapResult::Again)).
        const MUNLOCK = 1 << 1;
        /// Unmap even mlocked mappings.
        const IGNORE_MLOCK = 1 << 2;
        /// Unmap even recently referenced mappings.
        const IGNORE_ACCESS = 1 << 3;
        /// Treat a hardware-poisoned frame like any other (without it, its
        /// PTEs become hwpoison entries so that later accesses are refused).
        const IGNORE_HWPOISON = 1 << 4;
        /// Defer TLB flushes into a [`TlbFlushUnmapBatch`](crate::TlbFlushUnmapBatch) where the
        /// architecture allows it.
        const BATCH_FLUSH = 1 << 5;
    }
}
