//! Flush generations, as Linux's `tlb_gen`: who must be interrupted when an
//! address space is flushed, and how a CPU that was not catches up.
//!
//! # The rule
//!
//! Every flush of a user address space advances its generation
//! ([`MmTlbState::tlb_gen`](crate::MmTlbState::tlb_gen)) once its PTEs are cleared and before its
//! targets are read ([`MmTlbState::flush_targets`](crate::MmTlbState::flush_targets) does both). Each CPU
//! keeps, for the ASIDs whose entries it may still hold, the generation it
//! has flushed up to. A flush then reaches only the CPUs that *run* the
//! address space now:
//!
//! - a CPU that switched away leaves the space's CPU set, on tagged TLBs
//!   too: its entries of that ASID stay in the TLB, but it cannot use them
//!   until it loads the ASID again, and [`switch_mm`](crate::switch_mm)
//!   compares generations first and flushes the ASID locally when the CPU
//!   is behind;
//! - a *lazy* CPU ([`enter_lazy_tlb`](crate::enter_lazy_tlb): idle, or a
//!   kernel thread on a borrowed space) keeps the space loaded and stays in
//!   its set, but is left out of its flushes; it catches up the same way
//!   before it runs user code again ([`leave_lazy_tlb`](crate::leave_lazy_tlb),
//!   or `switch_mm` to the same space). Two exceptions keep it reachable: a
//!   flush that frees page tables ([`MmTlbState::table_flush_targets`](crate::MmTlbState::table_flush_targets)),
//!   since its MMU may still walk the loaded root speculatively (unless the
//!   teardown keeps the tables in a [`TableHold`](crate::TableHold) until
//!   the CPU has caught up, by this same generation, or loaded another
//!   root), and the kernel's own address space, whose global entries it
//!   uses.
//!
//! This is the exact form of contract rule 2: an entry tagged with an ASID
//! a CPU has not loaded is not usable by it, so its frame may be freed or
//! reused, provided the CPU flushes that ASID before it loads it again. The
//! mock's oracle checks exactly that, at the load.
//!
//! # The clock
//!
//! A generation is a value of the machine's flush epoch (the counter a
//! [`FramePool`](crate::FramePool) already opens generations with), not a
//! per-space count: advancing an address space's generation publishes a
//! new epoch and stores it as the space's `tlb_gen`. A CPU records, for an
//! ASID, the epoch it read just before it last dropped that ASID's entries;
//! a CPU that dropped *every* entry after reading epoch `e` (its pass, see
//! [`TlbShootdown::passed_epoch`](crate::TlbShootdown::passed_epoch)) is
//! caught up on every space whose generation is at most `e`. So one full
//! local flush (a switch on an untagged TLB; a timer tick's
//! [`quiescent_flush`](crate::quiescent_flush) when it flushes, which it
//! does only while a pool waits for that CPU) catches up every ASID at
//! once, and pooled
//! frames and generations are judged by the same clock. A new address
//! space takes a fresh epoch at its first use, newer than anything any CPU
//! recorded, so a CPU that still holds entries a dead space left under the
//! same ASID flushes them before it loads the new one.
//!
//! # Compared with Linux
//!
//! Linux 6.1 (x86) keeps a per-`mm` counter and six dynamic ASID slots per
//! CPU, each remembering an `mm`'s `ctx_id` and the `tlb_gen` it flushed to;
//! the hardware PCID is the slot number, so a seventh address space evicts
//! a slot and flushes its PCID at load. Its flush handler compares the
//! request's generation with the slot's to flush a range only when that is
//! all that is missing. Since 6.4 x86 also leaves a switched-away CPU's bit
//! set in `mm_cpumask` and trims the mask at most once a tick, trading
//! occasional extra IPIs for fewer atomic updates on every switch.
//!
//! Here the kernel chooses ASIDs (one per address space, as arm64 and most
//! hobby kernels do), so a slot needs no `ctx_id`: a fresh generation at a
//! space's first use stands for it. A CPU keeps [`ASID_SLOTS`] slots; an
//! ASID without one is judged by the CPU's pass alone, which at worst costs
//! a local flush at the next load, never an IPI. A switch always takes the
//! CPU out of the previous space's set (6.1's choice): the crate's promise
//! is never more IPIs than Linux on any hardware, and a bit left set is an
//! IPI later.
//!
//! # Page flushes carry their step
//!
//! Linux's handler counts a range flush as a catch-up when the request's
//! `new_tlb_gen` is one past the CPU's. Generations here are epochs, not
//! consecutive counts, so a flush of single pages carries the step its
//! advance made instead: the space's generation before and after it. Each
//! advance stores a value of its own (one overtaken by a concurrent
//! flush's epoch publishes another), so nothing lies between a step's two
//! ends, and a CPU caught up to its start that flushes its pages is caught
//! up to its end ([`TlbShootdown::caught_up_generation`](crate::TlbShootdown::caught_up_generation)). Without that, a CPU that ran a
//! space through page flushes would flush its ASID again at its next load
//! after every switch. Such a record speaks for the space's flushes only:
//! a [`FramePool`](crate::FramePool) generation, whose epoch may be an
//! aging epoch older than entries the CPU still holds, is judged by the
//! CPU's whole-ASID flushes and passes alone.
//!
//! # Credits
//!
//! A [`TlbFlushUnmapBatch`](crate::TlbFlushUnmapBatch) flush leaves out a
//! target that holds none of the batch's entries: every entry was found
//! unaccessed since its frame's aging (on hardware whose fills set the
//! accessed bit), and the target dropped every entry of the batch's ASIDs
//! after reading that aging's epoch. On a tagged TLB such a CPU would
//! still be behind the space's generation and flush the whole ASID at its
//! next load. When each ASID the batch names carries its step and the
//! target had carried out every flush of the space up to the step's start,
//! it has in fact carried out every flush up to the step's end (the step's
//! own pages it never held), so the flush records that end for it: a
//! *credit*, written into the target's per-CPU record by the flushing CPU.
//! The target's slots are read for this under a sequence count that the
//! target makes odd while it hands a slot to another ASID, so that a
//! credit is never given on another ASID's values. A CPU keeps one credit;
//! a newer one for another ASID replaces it, which costs at most a local
//! flush. Linux 6.1 has no such record: it interrupts those CPUs.
//!
//! The condition on the step's start is what keeps a CPU that is switching
//! back into the space (in its set again, its catch-up not yet done) from
//! being credited past an earlier flush whose stale entry it still holds:
//! loom model (o) (`src/loom/mm.rs`) fails without it.
use crate::asid::Asid;
use crate::cpuset::{CpuId, CpuSet};
use crate::percpu::TlbShootdown;
use crate::sync::{atomic_array, fence, maybe_const_fn, AtomicU32, AtomicU64, AtomicU8, Ordering};

/// How many ASIDs each CPU remembers a generation for. An ASID evicted from
/// a CPU's slots is flushed at its next load on that CPU unless a full local
/// flush came in between.
#[cfg(not(all(test, loom)))]
pub const ASID_SLOTS: usize = 8;

/// In the loom harness (`cfg(all(test, loom))`), two slots keep the
/// modelled state small.
#[cfg(all(test, loom))]
pub const ASID_SLOTS: usize = 2;

static_assertions::const_assert!(ASID_SLOTS <= u8::MAX as usize);

const NO_ASID: u32 = u32::MAX;

/// A grant packs an ASID (16 bits) above a generation (48 bits).
const GRANT_SHIFT: u32 = 48;
const GRANT_GEN_MASK: u64 = (1 << GRANT_SHIFT) - 1;

/// One advance of an address space's generation, from the value it
/// replaced to the one it stored: no other flush of that space stored a
/// value in between (see [`MmTlbState::flush_targets`](crate::MmTlbState::flush_targets)),
/// so a CPU caught up to `from` that flushes this one flush's pages is
/// caught up to `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GenStep {
    pub(crate) from: u64,
    pub(crate) to: u64,
}

impl GenStep {
    /// The step covering `self` and then `next`, when `next` starts where
    /// `self` ends (no other flush of the space came between them).
    pub(crate) fn then(self, next: GenStep) -> Option<GenStep> {
        (next.from == self.to).then_some(GenStep {
            from: self.from,
            to: next.to,
        })
    }
}

/// One CPU's remembered ASIDs and the generation each is flushed up to.
/// Only the owning CPU writes it (with interrupts off, or from its own
/// flush handler); atomics keep the other CPUs' reads race-free.
///
/// Two values per ASID. `flushed` is an epoch read just before the CPU
/// dropped every entry of the ASID: it covers every PTE cleared before
/// that epoch was published, which is what a [`FramePool`](crate::FramePool)
/// generation (an epoch of its own, perhaps an aging epoch) is judged by.
/// `caught`, never below `flushed`, may also have been carried forward by
/// page flushes ([`AsidSlots::follow`]): it covers every flush of the space
/// whose generation is at most it, which is what a load compares with
/// the space's `tlb_gen`, and no more.
///
/// Another CPU may carry `caught` forward too, through the *grant*: a
/// flush that leaves this CPU out because it holds none of the flush's
/// entries, while it is caught up to the flush's step's start, records
/// the step's end here (see [`AsidSlots::grant`]). Such a flush reads the
/// slots under `seq`, which the owner makes odd while it reassigns one, so
/// that it never takes another ASID's values for the one it asks about.
pub(crate) struct AsidSlots {
    asid: [AtomicU32; ASID_SLOTS],
    flushed: [AtomicU64; ASID_SLOTS],
    caught: [AtomicU64; ASID_SLOTS],
    next_victim: AtomicU8,
    /// One granted generation, with its ASID ([`GRANT_SHIFT`]); 0 for none.
    granted: AtomicU64,
    /// Odd while the owner reassigns a slot (a seqlock's count).
    seq: AtomicU64,
}

impl AsidSlots {
    maybe_const_fn! {
        pub(crate) fn new() -> Self {
            AsidSlots {
                asid: atomic_array![AtomicU32::new(NO_ASID); ASID_SLOTS],
                flushed: atomic_array![AtomicU64::new(0); ASID_SLOTS],
                caught: atomic_array![AtomicU64::new(0); ASID_SLOTS],
                next_victim: AtomicU8::new(0),
                granted: AtomicU64::new(0),
                seq: AtomicU64::new(0),
            }
        }
    }

    fn find(&self, asid: Asid) -> Option<usize> {
        let raw = u32::from(asid.value());
        self.asid.iter().position(|a| a.load(Ordering::Relaxed) == raw)
    }

    /// The generation `asid` is known to be flushed up to on this CPU by a
    /// flush of that ASID alone (0 when it has no slot).
    pub(crate) fn flushed(&self, asid: Asid) -> u64 {
        self.find(asid)
            .map_or(0, |i| self.flushed[i].load(Ordering::Relaxed))
    }

    /// The generation of `asid`'s address space this CPU has carried out
    /// every flush up to, by flushes of the whole ASID or of the pages
    /// each flush named (0 when it has no slot).
    pub(crate) fn caught(&self, asid: Asid) -> u64 {
        self.find(asid)
            .map_or(0, |i| self.caught[i].load(Ordering::Relaxed))
            .max(self.granted(asid))
    }

    /// The generation another CPU's flush granted `asid` (0 for none).
    fn granted(&self, asid: Asid) -> u64 {
        let g = self.granted.load(Ordering::Acquire);
        if g >> GRANT_SHIFT == u64::from(asid.value()) {
            g & GRANT_GEN_MASK
        } else {
            0
        }
    }

    /// Records, from any CPU, that this one holds no entry of `asid` left
    /// by any flush of its space up to generation `to`. The caller knows
    /// it: this CPU was caught up to a step's start (read with
    /// [`stable`](Self::stable)) and holds none of the entries that step's
    /// flush covers. One ASID is remembered: a grant for another replaces
    /// it (the lost one costs a local flush at most). A generation past 48
    /// bits is not recorded.
    pub(crate) fn grant(&self, asid: Asid, to: u64) {
        if to > GRANT_GEN_MASK {
            return;
        }
        let new = (u64::from(asid.value()) << GRANT_SHIFT) | to;
        let mut cur = self.granted.load(Ordering::Relaxed);
        loop {
            if cur >> GRANT_SHIFT == u64::from(asid.value()) && cur & GRANT_GEN_MASK >= to {
                return;
            }
            match self
                .granted
                .compare_exchange_weak(cur, new, Ordering::Release, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(now) => cur = now,
            }
        }
    }

    /// `read(self)` taken from another CPU, or `None` when the owner
    /// reassigned a slot meanwhile (its values may then mix two ASIDs').
    /// The reads inside are of single atomics; what they show of `asid`
    /// is then a value the owner really recorded for it, or older.
    pub(crate) fn stable<T>(&self, read: impl Fn(&Self) -> T) -> Option<T> {
        let before = self.seq.load(Ordering::Acquire);
        if before % 2 == 1 {
            return None;
        }
        let value = read(self);
        // Pairs with the release fence in `record`: a read above that saw
        // a reassignment's store makes the count read below see it odd,
        // or past.
        fence(Ordering::Acquire);
        (self.seq.load(Ordering::Relaxed) == before).then_some(value)
    }

    /// Records that this CPU carried out the page flushes of `step` for
    /// `asid`, after every flush up to `step.from` (by its slot, or by
    /// `passed`, its last full flush): it is then caught up to `step.to`.
    /// Does nothing when the ASID has no slot or the CPU is behind
    /// `step.from`: a flush it missed may lie in between, and the next
    /// load then flushes the ASID (a handler takes no slot).
    pub(crate) fn follow(&self, asid: Asid, step: GenStep, passed: u64) {
        if let Some(i) = self.find(asid) {
            let caught = self.caught[i].load(Ordering::Relaxed).max(self.granted(asid));
            if caught.max(passed) >= step.from {
                self.caught[i].fetch_max(step.to, Ordering::Relaxed);
            }
        }
    }

    /// Records that this CPU dropped every entry of `asid` after reading
    /// epoch `epoch`, taking a slot (the oldest taken one, round robin)
    /// when the ASID has none.
    pub(crate) fn record(&self, asid: Asid, epoch: u64) {
        let i = match self.find(asid) {
            Some(i) => i,
            None => {
                // Odd while the slot holds a mix (see `stable`).
                self.seq.fetch_add(1, Ordering::Relaxed);
                fence(Ordering::Release);
                let i = usize::from(self.next_victim.load(Ordering::Relaxed)) % ASID_SLOTS;
                // `i + 1` <= ASID_SLOTS, which fits in u8 (asserted).
                self.next_victim
                    .store(((i + 1) % ASID_SLOTS) as u8, Ordering::Relaxed);
                self.flushed[i].store(0, Ordering::Relaxed);
                self.caught[i].store(0, Ordering::Relaxed);
                self.asid[i].store(u32::from(asid.value()), Ordering::Relaxed);
                self.flushed[i].store(epoch, Ordering::Relaxed);
                self.caught[i].store(epoch, Ordering::Relaxed);
                self.seq.fetch_add(1, Ordering::Release);
                return;
            }
        };
        self.flushed[i].fetch_max(epoch, Ordering::Relaxed);
        self.caught[i].fetch_max(epoch, Ordering::Relaxed);
    }

    /// Raises the record of `asid` to `epoch` if it has a slot (a flush of
    /// that ASID made by an interrupt handler, which takes no slot).
    pub(crate) fn raise(&self, asid: Asid, epoch: u64) {
        if let Some(i) = self.find(asid) {
            self.flushed[i].fetch_max(epoch, Ordering::Relaxed);
            self.caught[i].fetch_max(epoch, Ordering::Relaxed);
        }
    }

    /// Forgets every ASID (the CPU flushed everything, or the machine was
    /// reset).
    pub(crate) fn clear(&self) {
        self.granted.store(0, Ordering::Relaxed);
        for a in &self.asid {
            a.store(NO_ASID, Ordering::Relaxed);
        }
        self.next_victim.store(0, Ordering::Relaxed);
    }
}

/// Which of the user address spaces that `named` accepts `cpu` runs now:
/// the one it has loaded, and the one a switch in progress is leaving (its
/// root stays loaded until the switch loads the next one), each if
/// `named` accepts it; both `None` for a lazy CPU, which runs no user
/// code.
///
/// A CPU that runs none of them holds their entries only under an ASID it
/// does not run, or lazily, and flushes them by generation before it uses
/// them, provided each space's generation advanced after the PTEs in
/// question were cleared and before this is asked (which
/// [`MmTlbState::flush_targets`](crate::MmTlbState::flush_targets) does).
/// Sound against a CPU switching or resuming concurrently: a CPU records
/// the ASID it leaves, then the one it loads, and clears its lazy mark,
/// before it reads the generation; so if this reads the old state, the
/// CPU's generation check sees the advance. The loaded ASID is read
/// first: a reader that sees a switch's new one sees the one it leaves.
pub(crate) fn running(
    state: &TlbShootdown,
    cpu: CpuId,
    named: impl Fn(Asid) -> bool,
) -> (Option<Asid>, Option<Asid>) {
    if state.is_lazy(cpu) {
        return (None, None);
    }
    let user = |a: Option<Asid>| a.filter(|a| !a.is_kernel() && named(*a));
    let loaded = user(state.loaded_asid(cpu));
    let leaving = user(state.leaving_asid(cpu));
    (loaded, leaving)
}

/// Whether `cpu` may still use entries of the user address spaces named by
/// `asids` (any user space when `many`) without flushing them first (see
/// [`running`]).
pub(crate) fn may_use(state: &TlbShootdown, cpu: CpuId, asids: &[Asid], many: bool) -> bool {
    let (loaded, leaving) = running(state, cpu, |a| many || asids.contains(&a));
    loaded.is_some() || leaving.is_some()
}

/// The CPUs of `targets` that [`may_use`] entries of the named spaces: a
/// deferred flush recorded for CPUs that have since switched away, or gone
/// lazy, need not interrupt them.
pub(crate) fn still_running(state: &TlbShootdown, targets: &CpuSet, asids: &[Asid], many: bool) -> CpuSet {
    let mut set = CpuSet::new();
    for cpu in targets {
        if may_use(state, cpu, asids, many) {
            set.insert(cpu);
        }
    }
    set
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn asid(v: u16) -> Asid {
        Asid::new(v).unwrap()
    }

    #[test]
    fn a_grant_raises_caught_for_its_asid_only_and_never_flushed() {
        let s = AsidSlots::new();
        s.record(asid(1), 5);
        s.grant(asid(1), 9);
        assert_eq!((s.flushed(asid(1)), s.caught(asid(1))), (5, 9));
        assert_eq!(s.caught(asid(2)), 0);
        s.grant(asid(1), 7);
        assert_eq!(s.caught(asid(1)), 9, "a grant never lowers");
        // Another ASID's grant replaces it: the first falls back to its slot.
        s.grant(asid(2), 8);
        assert_eq!((s.caught(asid(1)), s.caught(asid(2))), (5, 8));
        // Without a slot the grant still stands, and a page flush that
        // follows it carries a slot that exists.
        assert_eq!(s.flushed(asid(2)), 0);
        s.record(asid(2), 3);
        s.follow(asid(2), GenStep { from: 8, to: 12 }, 0);
        assert_eq!(s.caught(asid(2)), 12);
        s.clear();
        assert_eq!(s.caught(asid(2)), 0, "a reset forgets grants too");
    }

    #[test]
    fn a_grant_past_48_bits_is_not_recorded() {
        let s = AsidSlots::new();
        s.grant(asid(3), 1 << 48);
        assert_eq!(s.caught(asid(3)), 0);
        s.grant(asid(3), (1 << 48) - 1);
        assert_eq!(s.caught(asid(3)), (1 << 48) - 1);
    }

    #[test]
    fn a_read_across_a_slot_reassignment_is_refused() {
        let s = AsidSlots::new();
        for a in 1..=ASID_SLOTS as u16 {
            s.record(asid(a), 4);
        }
        assert_eq!(s.stable(|s| s.caught(asid(1))), Some(4));
        // A raise of a slot that exists reassigns nothing.
        assert_eq!(
            s.stable(|s| {
                s.record(asid(1), 6);
                s.caught(asid(1))
            }),
            Some(6)
        );
        // A new ASID evicts one: a read around it cannot be trusted.
        assert_eq!(
            s.stable(|s| {
                let before = s.caught(asid(1));
                s.record(asid(ASID_SLOTS as u16 + 1), 9);
                before
            }),
            None
        );
        assert_eq!(s.stable(|s| s.caught(asid(1))), Some(0), "slot 0 was evicted");
    }
}
