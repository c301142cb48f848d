//! Reverse-map unmapping never loses a dirty bit the hardware sets while
//! the unmap clears the PTE: a write put at a fixed instant of
//! `try_to_unmap` (before the unmap, just before the exchange, just after
//! it), on x86 and on hardware without the clean-write re-walk, and a write
//! truly racing the exchange on another thread.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{asid, config, va};
use tlb_batch::arch::mock::{Fault, MockMachine, MockSpace, Model, NoRewalk, X86Like};
use tlb_batch::{
    try_to_unmap, BoundedRmap, Frame, MappingFlags, MmTlbState, PageRange, PageTable, Pte, PteFlags,
    SwapResult, TlbFlushUnmapBatch, TtuFlags,
};

/// Something a test runs at a chosen instant inside an unmap.
type Action<'m> = Box<dyn FnOnce() + Send + 'm>;

/// A [`MockSpace`] that runs a one-shot action just before or just after
/// the next [`exchange`](PageTable::exchange) reaches the machine's PTE (the
/// unmap has already looked at the entry and chosen to clear it; its flush
/// comes after), and keeps every value an exchange returned. The exchange
/// itself is the machine's: the wrapper only says *when*, so a test can put
/// a hardware write at an exact point of `try_to_unmap` instead of hoping
/// the OS schedules it there.
struct AtClear<'m, M: Model> {
    space: MockSpace<'m, M>,
    before: Mutex<Option<Action<'m>>>,
    after: Mutex<Option<Action<'m>>>,
    returned: Mutex<Vec<Pte>>,
}

impl<'m, M: Model> AtClear<'m, M> {
    fn new(m: &'m MockMachine<M>, mm: &Arc<MmTlbState>) -> Self {
        AtClear {
            space: m.space(mm),
            before: Mutex::new(None),
            after: Mutex::new(None),
            returned: Mutex::new(Vec::new()),
        }
    }

    fn before_next_clear(&self, f: impl FnOnce() + Send + 'm) {
        *self.before.lock().unwrap() = Some(Box::new(f));
    }

    fn after_next_clear(&self, f: impl FnOnce() + Send + 'm) {
        *self.after.lock().unwrap() = Some(Box::new(f));
    }

    /// What the exchanges since the last call returned.
    fn take_returned(&self) -> Vec<Pte> {
        std::mem::take(&mut *self.returned.lock().unwrap())
    }
}

// SAFETY: every operation is the wrapped `MockSpace`'s; `exchange` only
// runs test code before and after the (atomic) exchange.
unsafe impl<M: Model> PageTable for AtClear<'_, M> {
    fn tlb_state(&self) -> &MmTlbState {
        self.space.tlb_state()
    }

    fn lookup(&self, va: u64) -> Pte {
        self.space.lookup(va)
    }

    fn exchange(&self, va: u64, new: Pte) -> Pte {
        let before = self.before.lock().unwrap().take();
        if let Some(f) = before {
            f();
        }
        let old = self.space.exchange(va, new);
        self.returned.lock().unwrap().push(old);
        let after = self.after.lock().unwrap().take();
        if let Some(f) = after {
            f();
        }
        old
    }

    fn test_and_clear_accessed(&self, va: u64) -> bool {
        self.space.test_and_clear_accessed(va)
    }

    fn set(&self, va: u64, pte: Pte) {
        self.space.set(va, pte);
    }

    fn next_populated(&self, range: PageRange) -> Option<u64> {
        self.space.next_populated(range)
    }
}

type AtClearMap<'a, 'm, M> = BoundedRmap<'a, AtClear<'m, M>, MockMachine<M>, 8>;

/// The PTE every round starts from: present, writable, clean and old.
fn clean_writable(f: Frame) -> Pte {
    Pte::new(f, PteFlags::PRESENT | PteFlags::WRITABLE | PteFlags::USER)
}

/// The property, checked after every unmap: if a write landed in the frame
/// since it was last cleaned, the unmap's one exchange returned the dirty
/// bit and the frame is marked dirty. Returns whether a write landed.
fn check_dirty_kept<M: Model>(
    m: &MockMachine<M>,
    f: Frame,
    before: u64,
    returned: &[Pte],
    what: &str,
) -> bool {
    assert_eq!(returned.len(), 1, "{what}: one exchange per unmap");
    let landed = m.frame_data(f).unwrap() != before;
    if landed {
        assert!(
            returned[0].is_dirty(),
            "{what}: a write landed but the exchange returned a clean PTE {:?}",
            returned[0]
        );
        assert!(
            m.frame_dirty(f).unwrap(),
            "{what}: a write landed and the exchange returned {:?}, but the frame is not marked dirty",
            returned[0]
        );
    }
    landed
}

/// How CPU 1's write reaches the PTE's dirty bit.
#[derive(Clone, Copy, Debug, PartialEq)]
enum WritePath {
    /// TLB miss: the walk sets the dirty bit in its locked update.
    Miss,
    /// CPU 1 first reads the page, so it caches a clean entry: x86 walks
    /// again to set the bit, `NoRewalk` sets it in place.
    CachedClean,
}

/// When CPU 1 writes, relative to CPU 0's unmap.
#[derive(Clone, Copy, Debug, PartialEq)]
enum WriteAt {
    /// After the previous round's flush and the remap, before the unmap
    /// starts.
    BeforeUnmap,
    /// Inside the unmap, after it looked at the PTE (still clean) and right
    /// before the exchange.
    JustBeforeClear,
    /// Inside the unmap, right after the exchange and before the flush: the
    /// write must fault and the frame stay clean (the control case, which
    /// shows the dirty check can tell the two apart).
    JustAfterClear,
}

/// One round per case: map the frame clean, have CPU 1 write at the case's
/// instant, unmap from CPU 0 (immediate flush), check the property and the
/// case's expected outcome, clean the frame. Returns how many writes
/// landed. One thread, synchronous IPIs: the schedule is the code's.
fn dirty_bit_rounds<M: Model>(rounds: usize, cases: &[(WritePath, WriteAt)]) -> usize {
    let m = MockMachine::<M>::with_model(config(2, 64)).unwrap();
    let mm = m.new_mm(asid(1)).unwrap();
    let space = AtClear::new(&m, &mm);
    // SAFETY: the frame's only mapping is recorded before any CPU uses it.
    let mut rm: AtClearMap<'_, '_, M> = unsafe { BoundedRmap::new(&m) };
    let f = m.alloc_frame().unwrap();
    space.set(va(0), clean_writable(f));
    rm.add(f, &space, va(0), MappingFlags::empty()).unwrap();
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    cpu1.switch_to(&mm).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let mut landed = 0;
    let mut token = 0u64;
    for round in 0..rounds {
        for &(path, at) in cases {
            token += 1;
            let before = m.frame_data(f).unwrap();
            assert!(!m.frame_dirty(f).unwrap());
            assert_eq!(m.cached_translations(f), [], "the last flush left nothing cached");
            if path == WritePath::CachedClean {
                cpu1.read(va(0)).unwrap();
                assert!(m.cached_translations(f).iter().all(|(_, e)| !e.dirty));
            }
            assert!(!m.pte(&mm, va(0)).unwrap().is_dirty());
            let wrote: Arc<Mutex<Option<Result<(), Fault>>>> = Arc::default();
            let write = {
                let (m, mm, wrote) = (&m, &mm, Arc::clone(&wrote));
                move || {
                    let clean = !m.pte(mm, va(0)).unwrap().is_dirty();
                    let r = cpu1.write(va(0), token);
                    *wrote.lock().unwrap() = Some(r);
                    // The bit comes from this very write.
                    assert!(r.is_err() || clean && m.pte(mm, va(0)).unwrap().is_dirty());
                }
            };
            match at {
                WriteAt::BeforeUnmap => write(),
                WriteAt::JustBeforeClear => space.before_next_clear(write),
                WriteAt::JustAfterClear => space.after_next_clear(write),
            }
            let r = try_to_unmap(&cpu0, &rm, f, TtuFlags::IGNORE_ACCESS, &mut batch).unwrap();
            assert_eq!(r, SwapResult::Success);
            assert!(batch.is_empty(), "flushed at once");
            let wrote = wrote.lock().unwrap().take().expect("CPU 1 wrote");
            let returned = space.take_returned();
            let case = format!("round {round}, {path:?} {at:?}");
            let hit = check_dirty_kept(&m, f, before, &returned, &case);
            if at == WriteAt::JustAfterClear {
                assert_eq!(wrote, Err(Fault::NotMapped { va: va(0) }), "{case}");
                assert!(
                    !hit && !returned[0].is_dirty() && !m.frame_dirty(f).unwrap(),
                    "{case}"
                );
            } else {
                assert_eq!(wrote, Ok(()), "{case}");
                assert!(
                    hit && m.frame_data(f).unwrap() == token,
                    "{case}: the write landed"
                );
                landed += 1;
            }
            assert_eq!(m.cached_translations(f), [], "{case}: flushed");
            // Clean the page (as a completed write-out does) and map it
            // again, writable and clean.
            m.start_io(f).unwrap();
            m.end_io(f).unwrap();
            space.set(va(0), clean_writable(f));
        }
    }
    assert_eq!(m.violations(), []);
    landed
}

#[test]
fn a_dirty_bit_set_by_hardware_during_the_clear_is_never_lost() {
    // Whenever a write landed in the frame, the unmap's exchange returned
    // the dirty bit and the frame is marked dirty; each round puts CPU 1's
    // write at a fixed point (between the last flush and the clear, the
    // last instant before the exchange, just after it), so every round
    // checks the case that matters, whatever the host's load.
    const ROUNDS: usize = 200;
    use WriteAt::*;
    use WritePath::*;
    let x86 = [
        (Miss, BeforeUnmap),
        (Miss, JustBeforeClear),
        (CachedClean, BeforeUnmap),
        (CachedClean, JustBeforeClear),
        (Miss, JustAfterClear),
    ];
    assert_eq!(dirty_bit_rounds::<X86Like>(ROUNDS, &x86), 4 * ROUNDS);
    // Without the re-walk, a write through a cached clean entry sets the
    // bit in place (while the PTE still maps the frame).
    let no_rewalk = [
        (CachedClean, BeforeUnmap),
        (CachedClean, JustBeforeClear),
        (Miss, JustAfterClear),
    ];
    assert_eq!(dirty_bit_rounds::<NoRewalk>(ROUNDS, &no_rewalk), 2 * ROUNDS);
}

#[test]
fn a_dirty_bit_set_by_hardware_racing_the_clear_is_never_lost() {
    // The same property with the write truly concurrent with the exchange:
    // only a real race can put a write between an exchange's read and its
    // store (a non-atomic exchange loses the bit then). Bounded by rounds,
    // not time. In each round CPU 0 unmaps `PAGES` pages one after the
    // other and CPU 1 writes each once, hand-shaken page by page: CPU 0
    // releases CPU 1's write from inside the unmap, just before the
    // exchange, then one side spins a little before going on. The test
    // steers that delay towards where the two meet (a write that beat the
    // clear makes the next exchange come sooner, one that faulted after it
    // later), so that on an idle host many pages line the write up with
    // the exchange, whatever the host's speed. Whether a write lands
    // before the clear or faults after it is up to the scheduler: the
    // property is checked for every page either way, and nothing is
    // required of how many writes beat the clear (the test above covers
    // that deterministically).
    //
    // Synchronous delivery: CPU 0's flush reaches CPU 1's TLB at once
    // (after the access CPU 1 may be in the middle of), so CPU 0 never
    // waits for a busy host to schedule CPU 1 just to take an interrupt.
    // A side that waits for the other spins briefly, then sleeps until
    // woken; CPU 0 waits only once a round, for CPU 1 to finish its
    // writes, and then checks and remaps every page.
    const ROUNDS: usize = 250;
    const PAGES: usize = 8;
    // Spin-loop iterations, either side.
    const MAX_OFFSET: isize = 1 << 10;
    const MAX_STEP: isize = 1 << 8;
    // How long a waiting side spins before it sleeps: long enough that on
    // an idle host CPU 1 is still spinning when CPU 0 releases its next
    // write (it then reacts in a few instructions, so the steering can
    // line the two up closely); a busy host costs at most this much per
    // wait.
    const PATIENCE: Duration = Duration::from_micros(500);
    common::within(300, || {
        // CPU 0 has released this many writes (counted across rounds).
        let go = AtomicUsize::new(0);
        // How long CPU 1 spins once released.
        let writer_delay = AtomicUsize::new(0);
        // CPU 1 has made this many writes; whether each of this round's
        // landed.
        let written = AtomicUsize::new(0);
        let landed: [AtomicBool; PAGES] = Default::default();
        // A side failed: the other stops waiting for it.
        let stop = AtomicBool::new(false);
        // Waits until `done`, or until the other side failed (false).
        let wait = |done: &dyn Fn() -> bool| {
            let start = Instant::now();
            while !done() {
                if stop.load(Ordering::SeqCst) {
                    return false;
                }
                if start.elapsed() < PATIENCE {
                    core::hint::spin_loop();
                } else {
                    std::thread::park();
                }
            }
            true
        };
        let failure = Mutex::new(None);
        // Runs one side; a panic stops the other side instead of leaving it
        // waiting, and is raised once both are done.
        let side = |other: &std::thread::Thread, body: &mut dyn FnMut()| {
            if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
                stop.store(true, Ordering::SeqCst);
                other.unpark();
                failure.lock().unwrap().get_or_insert(p);
            }
        };
        let (mut early, mut late) = (0, 0);
        let m = MockMachine::new(config(2, 64)).unwrap();
        let mm = m.new_mm(asid(1)).unwrap();
        let space = AtClear::new(&m, &mm);
        // SAFETY: each frame's only mapping is recorded before any CPU uses
        // it.
        let mut rm: AtClearMap<'_, '_, X86Like> = unsafe { BoundedRmap::new(&m) };
        let frames: Vec<Frame> = (0..PAGES).map(|_| m.alloc_frame().unwrap()).collect();
        for (page, &f) in frames.iter().enumerate() {
            space.set(va(page), clean_writable(f));
            rm.add(f, &space, va(page), MappingFlags::empty()).unwrap();
        }
        let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
        cpu1.switch_to(&mm).unwrap();
        let unmapper = std::thread::current();
        std::thread::scope(|s| {
            let writer = s.spawn(|| {
                side(&unmapper, &mut || {
                    for n in 1..=ROUNDS * PAGES {
                        if !wait(&|| go.load(Ordering::SeqCst) >= n) {
                            return;
                        }
                        for _ in 0..writer_delay.load(Ordering::SeqCst) {
                            core::hint::spin_loop();
                        }
                        let page = va((n - 1) % PAGES);
                        let r = cpu1.write(page, n as u64);
                        assert!(r == Ok(()) || r == Err(Fault::NotMapped { va: page }), "{r:?}");
                        landed[(n - 1) % PAGES].store(r.is_ok(), Ordering::SeqCst);
                        written.store(n, Ordering::SeqCst);
                        unmapper.unpark();
                    }
                });
            });
            let writer = writer.thread();
            side(writer, &mut || {
                let mut batch = TlbFlushUnmapBatch::new();
                // Positive: CPU 0 spins before the exchange; negative: CPU 1
                // spins before the write. Its step grows by one while the
                // outcome repeats and halves when it flips, so that it soon
                // dithers about where the two meet. It learns each outcome
                // as soon as CPU 1 reports it, without waiting for it.
                let (mut offset, mut step, mut last_early): (isize, isize, bool) = (0, 1, false);
                let mut learned = 0;
                let mut learn = |upto: usize| {
                    for n in learned + 1..=upto {
                        let early = landed[(n - 1) % PAGES].load(Ordering::SeqCst);
                        step = if early == last_early { step + 1 } else { step / 2 }.clamp(1, MAX_STEP);
                        last_early = early;
                        offset =
                            if early { offset - step } else { offset + step }.clamp(-MAX_OFFSET, MAX_OFFSET);
                    }
                    learned = learned.max(upto);
                    offset
                };
                for round in 0..ROUNDS {
                    let before: Vec<u64> = frames.iter().map(|&f| m.frame_data(f).unwrap()).collect();
                    let mut returned = Vec::new();
                    for (page, &f) in frames.iter().enumerate() {
                        let n = round * PAGES + page + 1;
                        let offset = learn(written.load(Ordering::SeqCst));
                        let delay = offset.max(0).unsigned_abs();
                        writer_delay.store(offset.min(0).unsigned_abs(), Ordering::SeqCst);
                        let (go, release) = (&go, writer.clone());
                        space.before_next_clear(move || {
                            go.store(n, Ordering::SeqCst);
                            release.unpark();
                            for _ in 0..delay {
                                core::hint::spin_loop();
                            }
                        });
                        let r = try_to_unmap(&cpu0, &rm, f, TtuFlags::IGNORE_ACCESS, &mut batch);
                        // Released already, unless the unmap never reached
                        // the exchange (then the checks below say so).
                        go.store(n, Ordering::SeqCst);
                        writer.unpark();
                        assert_eq!(r, Ok(SwapResult::Success));
                        returned.push(space.take_returned());
                    }
                    // This round's writes are done, before or after the clears.
                    if !wait(&|| written.load(Ordering::SeqCst) >= (round + 1) * PAGES) {
                        return;
                    }
                    learn((round + 1) * PAGES);
                    for (page, &f) in frames.iter().enumerate() {
                        let what = format!("round {round}, page {page}");
                        let hit = check_dirty_kept(&m, f, before[page], &returned[page], &what);
                        assert_eq!(hit, landed[page].load(Ordering::SeqCst), "{what}: CPU 1's write");
                        *if hit { &mut early } else { &mut late } += 1;
                        m.start_io(f).unwrap();
                        m.end_io(f).unwrap();
                        space.set(va(page), clean_writable(f));
                    }
                }
            });
        });
        if let Some(p) = failure.into_inner().unwrap() {
            std::panic::resume_unwind(p);
        }
        eprintln!("racing the clear: {early} writes landed before it, {late} faulted after it");
        assert_eq!(early + late, ROUNDS * PAGES);
        assert_eq!(m.violations(), []);
    });
}
