#!/usr/bin/env bash
# Model-checks the cross-CPU shootdown protocol with loom. The models are
# unit tests of the library in src/loom/: shootdown.rs (models (a) to (d),
# (offline)), mm.rs ((e) to (g), (j), (k), (m) to (o)), pool.rs ((h) to
# (i), (l)) and tables.rs ((p'), (p'')), over the model machine of src/loom/machine.rs and run.rs,
# compiled only under `cfg(all(test, loom))`.
#
# In the library's own test harness built with `--cfg loom` (and only
# there: the plain library keeps core's atomics, so loom is only a
# dev-dependency) the crate's atomics come from loom (src/sync.rs), with
# MAX_CPUS = 64 and MAX_FLUSH_ENTRIES = 4 to keep the state small, so loom
# explores the interleavings and weak-memory outcomes of the real
# `shootdown`, `ipi_sync` and `handle_flush_ipi` (inboxes, `ipi_pending`
# flags, request slots and their `remaining` acknowledgement counters) and
# of `FramePool`'s flush epochs and passes.
# Each simulated CPU is a loom thread whose Arch latches IPIs and takes
# them at its instruction boundaries while its interrupts are enabled.
# The models check that:
#
#   (a) two CPUs shooting at each other with interrupts disabled both
#       return: each waiting initiator serves the other's request;
#   (b) two initiators shooting at one CPU both have their requests carried
#       out, including when one interrupt carries both (coalesced IPIs);
#   (c) an initiator with interrupts disabled serves a request that arrives
#       in its own inbox while it waits, and `ipi_sync` returns, but not
#       while a CPU is still inside an interrupts-off lockless walk that
#       began before it;
#   (d) back-to-back shootdowns reuse the request slot safely;
#   (offline) a shootdown whose target goes offline (`take_cpu_offline`,
#       interrupts off) and parks returns, with the request carried out
#       whenever the initiator read the online set before the target left;
#   (e) a CPU switching to an address space (`switch_mm`) while another
#       clears a PTE and computes the flush targets is either a target or
#       walks the cleared PTE (the fence pair of `switch_mm` and
#       `flush_targets`);
#   (f) a deferral (`note_batched_pending`) racing
#       `flush_tlb_batched_pending` is either flushed, with no CPU caching
#       the page afterwards, or still pending;
#   (g) of two `flush_tlb_batched_pending` callers, one that skips comes
#       after the other's flush;
#   (h) a frame pooled by a reclaimer (`UnmapBatch::try_to_unmap`,
#       `FramePool::defer`) comes back from `FramePool::release_passed`
#       only once the CPU that cached it flushed past its epoch in
#       `quiescent_flush`, even though that CPU's TLB may refill the entry
#       right after its flush (the pass's epoch is read before the flush,
#       the generation's is published after the PTE clear);
#   (h') the same when the CPU passes by `switch_mm` to another address
#       space without tagged TLBs;
#   (h'') the same when the CPU switches into the address space
#       (`switch_mm`, untagged), which may refill the entry as it loads;
#   (i) an aged frame (`page_referenced`) comes back only once the CPU
#       flushed past the aging, with fills that set the accessed bit;
#   (j) on a tagged TLB, a CPU switching back to a space it left (its
#       entry kept) while another CPU unmaps is either a flush target or
#       flushes the ASID by generation before it loads it;
#   (k) a lazy CPU resuming (`leave_lazy_tlb`) while another CPU unmaps,
#       skipping lazy CPUs, is either a target or catches up;
#   (l) on a tagged TLB, a pooled frame may come back while the CPU that
#       cached it runs another space, never while it can use the entry;
#   (m) a batch's flush may skip a recorded target that switched away,
#       never one that still caches the page;
#   (n) a CPU's own page flush carries it forward by generation only
#       past flushes it carried out, while a batched unmap advances too;
#   (o) on a tagged TLB, an aged batch credits a CPU with its flush only
#       when that CPU had caught up to the step's start, never one that
#       switches back while it still owes the catch-up of an earlier flush;
#   (offline) a shootdown whose target goes offline (`take_cpu_offline`)
#       and parks still returns;
#   (p') (p'') on a tagged TLB, a page table a teardown holds for a CPU
#       that was lazy at its flush (`TableHold`) is released only once
#       that CPU's MMU can no longer walk through its cached pointer,
#       while it resumes (`leave_lazy_tlb`) or switches away and back;
#
# and, in every execution of (a) to (d): every shootdown returns only
# after every target has carried its request out, each request is carried
# out exactly once, no inbox keeps a request, no latched IPI is left
# untaken, and the crate's counters agree with what the simulated CPUs did.
#
# Each model has a preemption bound (in its file); LOOM_MAX_PREEMPTIONS
# overrides it for all of them. About 8 minutes on 2 cores, most of it
# models (c) and (a). Which model catches the weakening of each ordering in
# shootdown.rs and mm.rs is noted beside the ordering.
#
# Usage: scripts/loom.sh [FILTER] [cargo test arguments...]. FILTER, if the
# first argument is not an option, replaces the default `loom::` (all the
# models): one group (`loom::pool::`) or one model (`loom::mm::e_`). It
# must match models only: the library's other unit tests are not loom
# models, and several fail on loom's atomics outside one (the plain
# `cargo test` runs them). libtest takes several filters as alternatives,
# not as a narrowing, hence the replacement.
set -euo pipefail
cd "$(dirname "$0")/.."
filter=loom::
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    filter=$1
    shift
fi
RUSTFLAGS="${RUSTFLAGS:-} --cfg loom" exec cargo test --release --lib "$filter" "$@"
