//! Model checks with loom of the real `FramePool`'s flush epochs and passes
//! (`scripts/loom.sh`: `RUSTFLAGS="--cfg loom" cargo test --release --lib loom::pool`).
//!
//! The models:
//!
//! - (h) a reclaimer unmaps a page with its flush deferred
//!   (`UnmapBatch::try_to_unmap`), pools the frame (`FramePool::defer`) and
//!   asks for it back (`FramePool::release_passed`) while the CPU caching
//!   the page runs `quiescent_flush`, and its TLB may refill the entry
//!   right after the flush: the frame comes back only once that CPU holds
//!   no entry for it, and some execution does give it back (the pass's
//!   epoch is read before the flush, the generation's published after the
//!   PTE clear);
//! - (h') the same, with the CPU passing by `switch_mm` to another address
//!   space (untagged TLB) instead;
//! - (h'') the same, with the CPU switching *into* the address space
//!   (`switch_mm`, untagged TLB), whose TLB may refill the page as it
//!   loads it: the frame comes back only once no entry can map it;
//! - (i) a reclaimer ages page 0 (`page_referenced`: the accessed bit is
//!   cleared, the frame's aging epoch published after), then unmaps and
//!   pools it, while the CPU caching it runs `quiescent_flush` and its TLB
//!   refills the entry, setting the accessed bit as x86 hardware does: the
//!   frame comes back only once that CPU holds no entry for it, whether the
//!   pool waited for the aging epoch (the bit was found clear) or a new one;
//! - (l) on a tagged TLB, the CPU caching page 0 switches to another
//!   address space (its entry stays, tagged) and back, while the reclaimer
//!   pools page 0 and asks for it back: the pool may hand the frame back
//!   while the entry is still cached under an ASID the CPU does not run
//!   (contract rule 2's exact form), but then the CPU's switch back flushes
//!   the ASID before it uses it, and it never runs the space with the
//!   entry after the frame came back.
//!
//! The model machine (simulated CPUs, their `Arch`, the bounds) is in
//! `machine.rs`, running a model in `run.rs`; the shootdown models (a) to
//! (d) are in `shootdown.rs`, the address-space models (e) to (g) in
//! `mm.rs`.

use std::ops::ControlFlow;
use std::sync::atomic::Ordering as StdOrdering;

use loom::sync::atomic::AtomicU64;
use loom::sync::atomic::Ordering;
use loom::sync::Arc;
use loom::thread;

use super::machine::{asid, Cpu, Machine, BASE, EMPTY, MAPPED, YOUNG};
use super::run::{cached_on, check, spawn_cpu};
use crate::{
    page_referenced, quiescent_flush, switch_mm, Asid, Frame, FramePool, Mapping, MappingFlags, MmTlbState,
    OwnedFrame, PageTable, Pte, PteFlags, Rmap, SwapResult, TlbFlushUnmapBatch, TtuFlags, UnmapBatch,
    Unmapped, PAGE_SIZE,
};

/// Model (h)'s frames: page 0's, which the model's reclaimer unmaps, and
/// page 1's, an older generation pooled before the model's CPUs start.
const FRAME0: Frame = Frame(0x100);
const FRAME1: Frame = Frame(0x101);

/// How many times model (h)'s reclaimer asks its pool for passed frames.
const RELEASE_TRIES: usize = 2;

/// Model (h)'s address space as the crate's reverse-map walk sees it:
/// page 0's PTE is [`Machine::pte`] (`MAPPED` stands for a present,
/// read-only, clean entry for [`FRAME0`]), page 1's is its own (for
/// [`FRAME1`]; no CPU's TLB model caches it).
struct PoolSpace {
    m: Arc<Machine>,
    mm: Arc<MmTlbState>,
    page1: AtomicU64,
}

impl PoolSpace {
    /// The PTE for `va`, and the frame its `MAPPED` stands for.
    fn entry(&self, va: u64) -> (&AtomicU64, Frame) {
        match va {
            BASE => (&self.m.pte, FRAME0),
            _ if va == BASE + PAGE_SIZE => (&self.page1, FRAME1),
            _ => panic!("model (h) has no PTE for {va:#x}"),
        }
    }

    fn pte_of(value: u64, frame: Frame) -> Pte {
        if value & MAPPED == 0 {
            return Pte::EMPTY;
        }
        let mut flags = PteFlags::PRESENT | PteFlags::USER;
        if value & YOUNG != 0 {
            flags |= PteFlags::ACCESSED;
        }
        Pte::new(frame, flags)
    }
}

// SAFETY: a model: `exchange` is one atomic swap (the entry has no
// accessed or dirty bit for hardware to set), `lookup` loads the entry as
// it is, and `tlb_state` is the address space the CPUs run.
unsafe impl PageTable for PoolSpace {
    fn tlb_state(&self) -> &MmTlbState {
        &self.mm
    }

    fn lookup(&self, va: u64) -> Pte {
        let (pte, frame) = self.entry(va);
        PoolSpace::pte_of(pte.load(Ordering::Relaxed), frame)
    }

    fn exchange(&self, va: u64, new: Pte) -> Pte {
        assert_eq!(new, Pte::EMPTY, "model (h) only clears PTEs");
        let (pte, frame) = self.entry(va);
        // Relaxed, the weakest: only the crate's own orderings may order
        // the clear before the pool's epoch (the full fence in
        // `flush_targets`, which the unmap runs after the clear, and
        // `publish_epoch`'s `fetch_add`).
        PoolSpace::pte_of(pte.swap(EMPTY, Ordering::Relaxed), frame)
    }

    fn test_and_clear_accessed(&self, va: u64) -> bool {
        // Relaxed, the weakest: the crate's publish of the aging epoch
        // must order the clear by itself (model (i)).
        let (pte, _) = self.entry(va);
        pte.fetch_and(!YOUNG, Ordering::Relaxed) & YOUNG != 0
    }

    fn set(&self, va: u64, pte: Pte) {
        panic!("model (h) never sets a PTE ({va:#x}: {pte:?})");
    }
}

/// Model (h)'s reverse map: each frame has its one mapping in
/// [`PoolSpace`]. It keeps page 0's aging epoch (model (i); `u64::MAX`:
/// none).
struct PoolRmap(PoolSpace, AtomicU64);

// SAFETY: `walk` reports the one place each frame is mapped.
unsafe impl Rmap for PoolRmap {
    type Space = PoolSpace;

    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, PoolSpace>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        let va = if frame == FRAME0 { BASE } else { BASE + PAGE_SIZE };
        visit(Mapping {
            space: &self.0,
            va,
            flags: MappingFlags::empty(),
        })
    }

    fn set_dirty(&self, frame: Frame) {
        panic!("model (h)'s PTEs are clean ({frame:?})");
    }

    fn aged_epoch(&self, frame: Frame) -> Option<u64> {
        let e = self.1.load(Ordering::Relaxed);
        (frame == FRAME0 && e != u64::MAX).then_some(e)
    }

    fn set_aged_epoch(&self, frame: Frame, epoch: Option<u64>) {
        if frame == FRAME0 {
            self.1.store(epoch.unwrap_or(u64::MAX), Ordering::Relaxed);
        }
    }
}

/// Unmaps `frame` through the crate's reverse-map walk with its flush
/// deferred (`UnmapBatch::try_to_unmap`), and pools it (`FramePool::defer`).
fn pool_frame(cpu: &Cpu, rmap: &PoolRmap, pool: &mut FramePool<2>, frame: Frame) {
    let mut batch = UnmapBatch::<1>::new();
    // SAFETY: a model: the frame is never freed.
    let page = unsafe { OwnedFrame::new(frame) };
    let unmapped = batch.try_to_unmap(cpu, rmap, page, TtuFlags::IGNORE_ACCESS);
    assert_eq!(unmapped, Ok(Unmapped::Held(SwapResult::Success)));
    assert_eq!(pool.defer(cpu, &mut batch), Ok(1));
    assert!(batch.is_empty());
}

/// Asks `pool` for passed frames up to [`RELEASE_TRIES`] times; returns
/// whether page 0's frame came back, which it must only once CPU 1 no
/// longer caches it (models (h) to (i)).
fn release_page0(cpu: &Cpu, pool: &mut FramePool<2>) -> bool {
    for _ in 0..RELEASE_TRIES {
        let mut back = pool.release_passed(cpu);
        if back.frames_mut().iter().any(|f| f.frame() == FRAME0) {
            assert!(
                !cpu.m.cached[1].load(Ordering::Relaxed),
                "the pool handed page 0's frame back while cpu1 still caches it"
            );
            return true;
        }
        thread::yield_now();
    }
    false
}

/// How CPU 1 flushes its TLB in models (h) to (h'').
#[derive(Clone, Copy, PartialEq)]
enum Pass {
    /// `quiescent_flush`, as at a timer tick (model (h)).
    Quiescent,
    /// `switch_mm` from the address space to another one, without tagged
    /// TLBs (model (h')).
    SwitchAway,
    /// `switch_mm` from another address space into this one, without
    /// tagged TLBs (model (h'')).
    SwitchIn,
}

/// (h) CPU 1 runs the address space with page 0 cached, and owes a flush
/// to an older pooled generation (page 1's, epoch 1). CPU 0, a reclaimer,
/// unmaps page 0 with its flush deferred (`UnmapBatch::try_to_unmap`) and
/// pools the frame (`FramePool::defer`: epoch 2), then asks the pool for
/// passed frames (`release_passed`) up to [`RELEASE_TRIES`] times; CPU 1
/// meanwhile runs `quiescent_flush`, and its TLB may refill page 0 right
/// after the flush. If CPU 0 gets page 0's frame back, CPU 1 no longer
/// caches it: CPU 1 read epoch 2 before it flushed, so the PTE was cleared
/// by then and the refill found nothing (the clear comes before the
/// epoch's `fetch_add`, the passer's load of the epoch acquires it; the
/// pool's load of `passed` acquires the flush). Reading the epoch after the
/// flush, or giving page 0's generation no epoch of its own, lets the frame
/// come back while the refilled entry maps it; without the refill neither
/// shows.
#[test]
fn h_pooled_frame_released_only_after_its_cpu_flushed_past_it() {
    pool_model("(h) FramePool vs quiescent_flush", Pass::Quiescent);
}

/// (h') Model (h), but CPU 1 passes by switching to another address space
/// (`switch_mm`, untagged TLB) instead of `quiescent_flush`. CPU 0's unmap
/// may then find CPU 1 gone from the address space and flush at once (to
/// no CPU): that frame comes back at the first try. Recording the pass
/// before the switch lets the frame come back while CPU 1 still caches it.
#[test]
fn h2_pooled_frame_released_only_after_its_cpu_switched_away() {
    pool_model("(h') FramePool vs switch_mm away", Pass::SwitchAway);
}

/// (h'') CPU 1 runs another address space, and switches into page 0's
/// (`switch_mm`, untagged TLB) while CPU 0 unmaps and pools page 0 as in
/// (h); loading the address space may refill page 0 at once. Either CPU
/// 0's unmap missed CPU 1 and CPU 1's refill finds the PTE cleared (model
/// (e)'s fence pair), or CPU 1 is a target and the frame comes back only
/// once CPU 1 passed epoch 2, which it read before it switched, after the
/// clear. Reading the epoch after the switch lets the frame come back while
/// the refilled entry maps it.
#[test]
fn h3_pooled_frame_released_only_after_its_cpu_switched_in() {
    pool_model("(h'') FramePool vs switch_mm in", Pass::SwitchIn);
}

/// Models (h) to (h''): see there.
fn pool_model(name: &str, pass: Pass) {
    let seen = check(name, 4, move |seen| {
        let m = Machine::new(2);
        let mm = Arc::new(MmTlbState::new(asid(), 0x1000));
        let other = Arc::new(MmTlbState::new(Asid::new(2).unwrap(), 0x2000));
        if pass == Pass::SwitchIn {
            // SAFETY: a model: the root is never dereferenced.
            unsafe { switch_mm(&Cpu::detached(1, &m, seen), None, &other).unwrap() };
        } else {
            cached_on(&m, seen, 1, &mm);
        }
        let rmap = PoolRmap(
            PoolSpace {
                m: m.clone(),
                mm: mm.clone(),
                page1: AtomicU64::new(MAPPED),
            },
            AtomicU64::new(u64::MAX),
        );
        let mut pool = FramePool::<2>::new();
        pool_frame(&Cpu::detached(0, &m, seen), &rmap, &mut pool, FRAME1);
        let deferred_before = m.tlb.stats().pages_deferred;

        let h0 = spawn_cpu(&m, seen, 0, move |cpu| {
            pool_frame(&cpu, &rmap, &mut pool, FRAME0);
            let released = release_page0(&cpu, &mut pool);
            cpu.finish();
            usize::from(released)
        });
        let h1 = spawn_cpu(&m, seen, 1, move |cpu| {
            cpu.refill_after_flush.set(true);
            match pass {
                Pass::Quiescent => {
                    assert!(quiescent_flush(&cpu), "cpu1 owes page 1's generation a flush");
                }
                // SAFETY: a model: the roots are never dereferenced.
                Pass::SwitchAway => unsafe { switch_mm(&cpu, Some(&mm), &other).unwrap() },
                // SAFETY: as above.
                Pass::SwitchIn => unsafe { switch_mm(&cpu, Some(&other), &mm).unwrap() },
            }
            // Takes interrupts until both are done: in (h'') CPU 0's unmap
            // may miss CPU 1 when it decides whether to defer, then find it
            // when it flushes at once, and shoot page 0 at it.
            cpu.finish()
        });
        let released = h0.join().unwrap() == 1;
        h1.join().unwrap();
        // Nor does CPU 1 cache the frame again later.
        assert!(!released || !m.cached[1].load(Ordering::Relaxed));
        seen.outcome(released);
        if m.tlb.stats().pages_deferred == deferred_before {
            seen.flushed_at_once.fetch_add(1, StdOrdering::Relaxed);
        }
    });
    seen.both_outcomes([
        "cpu0 never got page 0's frame back",
        "cpu0 got page 0's frame back",
    ]);
    let at_once = seen.flushed_at_once.load(StdOrdering::Relaxed);
    if pass == Pass::Quiescent {
        assert_eq!(at_once, 0, "cpu1 never leaves the address space in (h)");
    } else {
        assert!(
            at_once > 0,
            "no execution where cpu0's unmap missed cpu1 and flushed at once"
        );
    }
}

/// (i) Page 0 is young and cached on CPU 1, which owes an older pooled
/// generation (page 1's) a flush. CPU 0 ages page 0 (`page_referenced`:
/// clears the accessed bit, publishes the aging epoch), unmaps it with its
/// flush deferred and pools it, then asks for passed frames; CPU 1 runs
/// `quiescent_flush`, and its TLB refills page 0 right after the flush,
/// setting the accessed bit first. If the unmap found the bit clear, the
/// generation waits for the aging epoch only; CPU 1 then flushed after the
/// clear (it read that epoch, published after the clear), and any refill
/// since would have set the bit. Publishing no new epoch at the aging (the
/// current one instead), or trusting the aging epoch although the bit was
/// found set, lets the frame come back while CPU 1 caches it.
#[test]
fn i_aged_frame_released_only_after_its_cpu_flushed_past_the_aging() {
    let seen = check("(i) aging epochs vs quiescent_flush", 4, move |seen| {
        let m = Machine::new(2);
        let mm = Arc::new(MmTlbState::new(asid(), 0x1000));
        cached_on(&m, seen, 1, &mm);
        m.pte.store(MAPPED | YOUNG, Ordering::Relaxed);
        let rmap = PoolRmap(
            PoolSpace {
                m: m.clone(),
                mm: mm.clone(),
                page1: AtomicU64::new(MAPPED),
            },
            AtomicU64::new(u64::MAX),
        );
        let mut pool = FramePool::<2>::new();
        pool_frame(&Cpu::detached(0, &m, seen), &rmap, &mut pool, FRAME1);

        let h0 = spawn_cpu(&m, seen, 0, move |cpu| {
            let mut scratch = TlbFlushUnmapBatch::new();
            page_referenced(&cpu, &rmap, FRAME0, &mut scratch).unwrap();
            assert!(scratch.is_empty());
            pool_frame(&cpu, &rmap, &mut pool, FRAME0);
            let released = release_page0(&cpu, &mut pool);
            cpu.finish();
            usize::from(released)
        });
        let h1 = spawn_cpu(&m, seen, 1, move |cpu| {
            cpu.refill_after_flush.set(true);
            cpu.walk_sets_accessed.set(true);
            assert!(quiescent_flush(&cpu), "cpu1 owes page 1's generation a flush");
            cpu.finish()
        });
        let released = h0.join().unwrap() == 1;
        h1.join().unwrap();
        assert!(!released || !m.cached[1].load(Ordering::Relaxed));
        seen.outcome(released);
    });
    seen.both_outcomes([
        "cpu0 never got page 0's frame back",
        "cpu0 got page 0's frame back",
    ]);
}

/// (l) Tagged TLB. CPU 1 runs the address space with page 0 cached, owing
/// page 1's older generation a flush as in (h); it switches to another
/// address space and back (`switch_mm` both ways), keeping page 0's entry
/// across the first switch. CPU 0 unmaps and pools page 0 and asks for
/// passed frames meanwhile. The pool may hand page 0's frame back once CPU
/// 1 runs the other space: CPU 1 left a record of the space it leaves
/// before it loads the other one, and the generation its switch back
/// compares against moved when page 0 was unmapped. Whatever the
/// interleaving, CPU 1 ends up running the space without page 0's entry
/// whenever the frame came back. Giving the pool the new loaded ASID
/// without the one being left, or skipping the generation check, fails.
#[test]
fn l_tagged_switch_away_and_back_while_the_pool_releases() {
    let seen = check("(l) FramePool vs tagged switch away and back", 3, move |seen| {
        let m = Machine::tagged(2);
        let mm = Arc::new(MmTlbState::new(asid(), 0x1000));
        let other = Arc::new(MmTlbState::new(Asid::new(2).unwrap(), 0x2000));
        cached_on(&m, seen, 1, &mm);
        let rmap = PoolRmap(
            PoolSpace {
                m: m.clone(),
                mm: mm.clone(),
                page1: AtomicU64::new(MAPPED),
            },
            AtomicU64::new(u64::MAX),
        );
        let mut pool = FramePool::<2>::new();
        pool_frame(&Cpu::detached(0, &m, seen), &rmap, &mut pool, FRAME1);
        let released = Arc::new(loom::sync::atomic::AtomicBool::new(false));
        let flag = released.clone();
        let h0 = spawn_cpu(&m, seen, 0, move |cpu| {
            pool_frame(&cpu, &rmap, &mut pool, FRAME0);
            let mut back = false;
            for _ in 0..RELEASE_TRIES {
                let mut got = pool.release_passed(&cpu);
                if got.frames_mut().iter().any(|f| f.frame() == FRAME0) {
                    back = true;
                    flag.store(true, Ordering::SeqCst);
                    break;
                }
                thread::yield_now();
            }
            cpu.finish();
            usize::from(back)
        });
        let h1 = spawn_cpu(&m, seen, 1, move |cpu| {
            // SAFETY: a model: the roots are never dereferenced.
            unsafe { switch_mm(&cpu, Some(&mm), &other).unwrap() };
            // SAFETY: as above.
            unsafe { switch_mm(&cpu, Some(&other), &mm).unwrap() };
            // Back on the space: if the frame came back already, the entry
            // must be gone before this CPU could use it.
            let stale_use = released.load(Ordering::SeqCst) && cpu.m.caches(1);
            cpu.finish();
            usize::from(stale_use)
        });
        let back = h0.join().unwrap() == 1;
        let stale_use = h1.join().unwrap() == 1;
        assert!(
            !stale_use,
            "cpu1 ran the space with page 0's entry after the frame came back"
        );
        assert!(
            !back || !m.caches(1),
            "the frame came back and cpu1 still caches it"
        );
        seen.outcome(back);
    });
    seen.both_outcomes([
        "cpu0 never got page 0's frame back",
        "cpu0 got page 0's frame back",
    ]);
}
