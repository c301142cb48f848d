//! `TableHold`: a teardown that frees page tables leaves lazy CPUs alone
//! and holds the emptied tables until each of those CPUs has passed (it
//! caught up, loaded another root, or went offline). The mock's lazy CPUs
//! keep walk-cache pointers to the tables they walked, and its oracle
//! records a table freed under such a pointer
//! (`Violation::TableFreedWhileCached`), one a CPU loads again with it
//! (`LoadedWithStaleWalk`) and a walk through it (`WalkThroughFreedTable`).

#![cfg(feature = "mock")]

mod common;

use common::{asid, config, va};
use tlb_batch::arch::mock::{MockCpu, MockKernel, MockMachine, MockRmap, Violation, X86Like};
use tlb_batch::{
    shootdown, Error, FlushRequest, Frame, FreeFrames, MappingFlags, OwnedFrame, PageGather, PageRange,
    PageTable, TableFreePolicy, TableHold, TableTeardown, TeardownBacking, TeardownSummary,
    TABLE_HOLD_GROUPS,
};

/// Pages one leaf table translates.
const TABLE: usize = 512;

type M = MockMachine<X86Like>;

/// An address space with one writable page mapped at the start of each of
/// `tables` leaf tables; every CPU of `cpus` runs it and touches every
/// page (its walk cache then points to each table).
fn setup<'m>(m: &'m M, tables: usize, cpus: &[usize]) -> MockRmap<'m, X86Like> {
    let rmap = MockRmap::new(m, vec![m.space(&m.new_mm(asid(1)).unwrap())]);
    for t in 0..tables {
        let f = m.alloc_frame().unwrap();
        rmap.map(f, 0, va(t * TABLE), true, MappingFlags::empty())
            .unwrap();
    }
    for &c in cpus {
        let cpu = m.cpu(c).unwrap();
        cpu.switch_to(rmap.spaces()[0].mm()).unwrap();
        for t in 0..tables {
            cpu.read(va(t * TABLE)).unwrap();
        }
    }
    rmap
}

/// The leaf tables of the first `tables` regions, before the teardown.
fn leaf_tables(m: &M, rmap: &MockRmap<'_, X86Like>, tables: usize) -> Vec<Frame> {
    let mm = rmap.spaces()[0].mm();
    (0..tables)
        .map(|t| m.leaf_table(mm, va(t * TABLE)).unwrap())
        .collect()
}

/// Tears down the first `tables` leaf tables' whole range on CPU 0, tables
/// included, with `hold` (if any) and `policy`.
fn tear_down<const N: usize>(
    m: &M,
    rmap: &MockRmap<'_, X86Like>,
    tables: usize,
    hold: Option<&mut TableHold<N>>,
    policy: &mut TableFreePolicy<'_>,
) -> TeardownSummary {
    let cpu0 = m.cpu(0).unwrap();
    let mut kernel = MockKernel::new(rmap);
    let range = PageRange::new(va(0), (tables * TABLE) as u64).unwrap();
    let space = &rmap.spaces()[0];
    let refused = &mut |_, _| panic!("the mock frees every frame");
    let mut gather = PageGather::new();
    let s = match hold {
        Some(hold) => gather.unmap_range(
            &cpu0,
            space,
            &mut hold.around(&mut kernel),
            range,
            true,
            policy,
            refused,
        ),
        None => gather.unmap_range(&cpu0, space, &mut kernel, range, true, policy, refused),
    };
    s.unwrap()
}

/// Frees what a hold handed back, as the kernel frees page tables.
fn free_tables(rmap: &MockRmap<'_, X86Like>, mut back: tlb_batch::Flushed<8>) -> Vec<Frame> {
    let frames = back.frames_mut().iter().map(|f| f.frame()).collect();
    MockKernel::new(rmap).free_tables(back.frames_mut());
    assert!(back.frames_mut().is_empty(), "the mock frees every table");
    frames
}

fn interrupts(m: &M, cpu: usize) -> u64 {
    m.interrupts_taken(m.cpu(cpu).unwrap().id()).unwrap()
}

/// How a lazy CPU passes.
#[derive(Clone, Copy, Debug)]
enum Pass {
    /// It resumes the space (`switch_mm` to it: the catch-up).
    Resume,
    /// It switches to another space.
    SwitchAway,
    /// It goes offline.
    Offline,
}

/// CPU 1 walked the table and went lazy; CPU 0 tears the table down with a
/// hold: no IPI reaches CPU 1, the table waits, and comes back only once
/// CPU 1 passed, by each of the three ways, on tagged and untagged TLBs.
/// Afterwards CPU 1 runs the space again (a tagged TLB judges the walk
/// entries it kept under the old ASID at that load) without a violation.
#[test]
fn a_teardown_spares_a_lazy_cpu_and_holds_its_table_until_it_passed() {
    for tagged in [false, true] {
        for pass in [Pass::Resume, Pass::SwitchAway, Pass::Offline] {
            let at = format!("tagged {tagged}, {pass:?}");
            let m = M::new(tlb_batch::arch::mock::MockConfig {
                tagged_tlb: tagged,
                ..config(2, 64)
            })
            .unwrap();
            let rmap = setup(&m, 1, &[0, 1]);
            let mm = rmap.spaces()[0].mm().clone();
            let other = m.new_mm(asid(2)).unwrap();
            let table = leaf_tables(&m, &rmap, 1)[0];
            let cpu1 = m.cpu(1).unwrap();
            assert!(cpu1.walk_cache().iter().any(|w| w.table == table), "{at}");
            cpu1.enter_lazy().unwrap();
            let mut hold = TableHold::<8>::new();
            let s = tear_down(&m, &rmap, 1, Some(&mut hold), &mut TableFreePolicy::AfterFlush);
            // The oracle first: a table freed under CPU 1's cached pointer.
            assert_eq!(m.violations(), [], "{at}: the teardown");
            assert_eq!((s.tables_held, s.tables_freed, s.ipis_sent), (1, 0, 0), "{at}");
            assert_eq!((m.ipis_sent(), interrupts(&m, 1)), (0, 0), "{at}");
            assert_eq!((hold.len(), hold.waiting().len()), (1, 1), "{at}");
            // What a kernel does at every tick: free what comes back.
            let early = free_tables(&rmap, hold.release_passed(&m.cpu(0).unwrap()));
            assert_eq!(m.violations(), [], "{at}: released while CPU 1 is lazy");
            assert_eq!(early, [], "{at}");
            // A tick on the lazy CPU passes nothing (the hold's docs):
            // `quiescent_flush` does nothing on a lazy CPU.
            assert!(!tlb_batch::quiescent_flush(&cpu1), "{at}");
            assert_eq!(
                free_tables(&rmap, hold.release_passed(&m.cpu(0).unwrap())),
                [],
                "{at}"
            );
            assert!(
                cpu1.walk_cache().iter().any(|w| w.table == table),
                "{at}: still cached"
            );
            match pass {
                Pass::Resume => cpu1.switch_to(&mm).unwrap(),
                Pass::SwitchAway => cpu1.switch_to(&other).unwrap(),
                Pass::Offline => cpu1.go_offline(),
            }
            let back = hold.release_passed(&m.cpu(0).unwrap());
            assert_eq!(back.report().ipis_sent, 0, "{at}");
            assert_eq!(free_tables(&rmap, back), [table], "{at}");
            assert!(hold.is_empty(), "{at}");
            if matches!(pass, Pass::Offline) {
                cpu1.come_online();
            }
            // CPU 1 runs the space again, and walks it.
            cpu1.switch_to(&mm).unwrap();
            assert!(cpu1.read(va(0)).is_err(), "{at}: unmapped");
            assert_eq!(m.ipis_sent(), 0, "{at}");
            assert_eq!(m.violations(), [], "{at}");
        }
    }
}

/// The hazard the hold avoids, shown to the oracle: the same teardown
/// done by hand with the flush skipping the lazy CPU and the table freed
/// right after it is a `TableFreedWhileCached` on that CPU.
#[test]
fn freeing_the_table_without_waiting_for_the_lazy_cpu_is_caught() {
    let m = M::new(config(2, 64)).unwrap();
    let rmap = setup(&m, 1, &[0, 1]);
    let space = &rmap.spaces()[0];
    let mm = space.mm();
    let cpu0 = m.cpu(0).unwrap();
    m.cpu(1).unwrap().enter_lazy().unwrap();
    let frame = space.lookup(va(0)).frame();
    space.clear(va(0));
    let table = space
        .detach_table(PageRange::new(va(0), TABLE as u64).unwrap())
        .unwrap();
    let mut req = FlushRequest::new();
    req.add_range(mm.asid(), table.range, 33);
    shootdown(&cpu0, &mm.flush_targets(&cpu0), &req).unwrap();
    assert_eq!(m.ipis_sent(), 0);
    rmap.remove_frame(frame);
    m.free_frame(frame).unwrap();
    m.free_frame(table.frame).unwrap();
    assert_eq!(
        m.violations(),
        [Violation::TableFreedWhileCached {
            frame: table.frame,
            cpu: m.cpu(1).unwrap().id()
        }]
    );
}

/// Two lazy CPUs; one resumes. Under memory pressure `flush` interrupts
/// only the one still lazy (with a whole-ASID flush), and hands every
/// table back.
#[test]
fn flush_interrupts_only_the_cpus_still_waited_for() {
    let m = M::new(config(3, 64)).unwrap();
    let rmap = setup(&m, 2, &[0, 1, 2]);
    let mm = rmap.spaces()[0].mm().clone();
    let tables = leaf_tables(&m, &rmap, 2);
    let (cpu1, cpu2) = (m.cpu(1).unwrap(), m.cpu(2).unwrap());
    cpu1.enter_lazy().unwrap();
    cpu2.enter_lazy().unwrap();
    let mut hold = TableHold::<8>::new();
    let s = tear_down(&m, &rmap, 2, Some(&mut hold), &mut TableFreePolicy::AfterFlush);
    assert_eq!((s.tables_held, s.ipis_sent), (2, 0));
    cpu1.switch_to(&mm).unwrap();
    assert!(
        hold.release_passed(&m.cpu(0).unwrap()).is_empty(),
        "CPU 2 is still lazy"
    );
    let back = hold.flush(&m.cpu(0).unwrap()).unwrap();
    assert_eq!(back.report().ipis_sent, 1);
    assert_eq!((interrupts(&m, 1), interrupts(&m, 2)), (0, 1));
    let mut freed = free_tables(&rmap, back);
    freed.sort();
    let mut expect = tables.clone();
    expect.sort();
    assert_eq!(freed, expect);
    assert!(cpu2.walk_cache().iter().all(|w| !tables.contains(&w.table)));
    assert!(hold.is_empty());
    // An empty hold flushes nothing.
    assert!(hold.flush(&m.cpu(0).unwrap()).unwrap().is_empty());
    assert_eq!(m.ipis_sent(), 1);
    assert_eq!(m.violations(), []);
}

/// A hold without room for the teardown's tables (or one of another
/// machine) falls back to what a teardown does without one: the flush
/// reaches the lazy CPU and the tables are freed after it. With no lazy
/// CPU, nothing is held either.
#[test]
fn without_room_or_lazy_cpus_the_tables_are_freed_at_once() {
    // Room for one table, two to free.
    let m = M::new(config(2, 64)).unwrap();
    let rmap = setup(&m, 2, &[0, 1]);
    m.cpu(1).unwrap().enter_lazy().unwrap();
    let mut small = TableHold::<1>::new();
    let s = tear_down(&m, &rmap, 2, Some(&mut small), &mut TableFreePolicy::AfterFlush);
    assert_eq!((s.tables_held, s.tables_freed, s.ipis_sent), (0, 2, 1));
    assert!(small.is_empty());
    assert_eq!(m.violations(), []);

    // A hold that holds another machine's tables.
    let n = M::new(config(2, 64)).unwrap();
    let other = setup(&n, 1, &[0, 1]);
    n.cpu(1).unwrap().enter_lazy().unwrap();
    let mut hold = TableHold::<8>::new();
    assert_eq!(
        tear_down(&n, &other, 1, Some(&mut hold), &mut TableFreePolicy::AfterFlush).tables_held,
        1
    );
    let m = M::new(config(2, 64)).unwrap();
    let rmap = setup(&m, 1, &[0, 1]);
    m.cpu(1).unwrap().enter_lazy().unwrap();
    let s = tear_down(&m, &rmap, 1, Some(&mut hold), &mut TableFreePolicy::AfterFlush);
    assert_eq!((s.tables_held, s.tables_freed, s.ipis_sent), (0, 1, 1));
    assert!(
        hold.release_passed(&m.cpu(0).unwrap()).is_empty(),
        "not this machine's"
    );
    assert_eq!(hold.flush(&m.cpu(0).unwrap()).err(), Some(Error::OtherMachine));
    assert_eq!(hold.len(), 1);
    let _ = free_tables(&other, hold.flush(&n.cpu(0).unwrap()).unwrap());
    assert_eq!((m.violations(), n.violations()), (vec![], vec![]));

    // No lazy CPU: nothing to wait for.
    let m = M::new(config(2, 64)).unwrap();
    let rmap = setup(&m, 1, &[0, 1]);
    let mut hold = TableHold::<8>::new();
    let s = tear_down(&m, &rmap, 1, Some(&mut hold), &mut TableFreePolicy::AfterFlush);
    assert_eq!((s.tables_held, s.tables_freed, s.ipis_sent), (0, 1, 1));
    assert!(hold.is_empty());
    assert_eq!(m.violations(), []);
}

/// The lockless walkers' policy still runs, before the tables go into the
/// hold: the IPI sync reaches every other CPU (the lazy one included: it
/// is about software walkers, not the MMU's caches), a grace period is
/// waited for.
#[test]
fn the_lockless_walkers_policy_runs_before_the_tables_are_held() {
    let m = M::new(config(2, 64)).unwrap();
    let rmap = setup(&m, 1, &[0, 1]);
    m.cpu(1).unwrap().enter_lazy().unwrap();
    let mut hold = TableHold::<8>::new();
    let s = tear_down(&m, &rmap, 1, Some(&mut hold), &mut TableFreePolicy::IpiSync);
    assert_eq!((s.tables_held, s.syncs, s.ipis_sent), (1, 1, 1));
    let m = M::new(config(2, 64)).unwrap();
    let rmap = setup(&m, 1, &[0, 1]);
    m.cpu(1).unwrap().enter_lazy().unwrap();
    let mut hold = TableHold::<8>::new();
    let mut waited = 0;
    let mut grace = || waited += 1;
    let s = tear_down(
        &m,
        &rmap,
        1,
        Some(&mut hold),
        &mut TableFreePolicy::GracePeriod(&mut grace),
    );
    assert_eq!((s.tables_held, s.ipis_sent, waited), (1, 0, 1));
    assert_eq!(m.violations(), []);
    let _ = hold.flush(&m.cpu(0).unwrap()).unwrap();
}

/// A teardown whose flush went through and whose IPI sync failed (nested
/// in a shootdown) keeps what its tables wait for: `finish`, with the
/// hold, holds them then, still without interrupting the lazy CPU for the
/// flush; with a hold that has no room, it interrupts that CPU first.
#[test]
fn a_failed_sync_keeps_what_the_tables_wait_for() {
    for room in [true, false] {
        let m = M::new(config(3, 64)).unwrap();
        let rmap = setup(&m, 1, &[0, 1]);
        m.cpu(1).unwrap().enter_lazy().unwrap();
        let cpu0: MockCpu<'_, X86Like> = m.cpu(0).unwrap();
        let space = &rmap.spaces()[0];
        let mut kernel = MockKernel::new(&rmap);
        let mut hold = TableHold::<8>::new();
        let mut gather = PageGather::new();
        let range = PageRange::new(va(0), TABLE as u64).unwrap();
        let first = cpu0
            .in_shootdown(|| {
                gather.unmap_range(
                    &cpu0,
                    space,
                    &mut hold.around(&mut kernel),
                    range,
                    true,
                    &mut TableFreePolicy::IpiSync,
                    &mut |_, _| panic!("nothing refused"),
                )
            })
            .unwrap();
        assert!(matches!(first, Err(Error::ShootdownReentered { .. })));
        assert_eq!(m.ipis_sent(), 0, "the flush left the lazy CPU out");
        let s = if room {
            gather.finish(
                &cpu0,
                space,
                &mut hold.around(&mut kernel),
                &mut TableFreePolicy::AfterFlush,
                &mut |_, _| panic!("nothing refused"),
            )
        } else {
            // A backing without a hold: the lazy CPU gets a flush now.
            gather.finish(
                &cpu0,
                space,
                &mut kernel,
                &mut TableFreePolicy::AfterFlush,
                &mut |_, _| panic!("nothing refused"),
            )
        }
        .unwrap();
        assert!(gather.is_empty());
        if room {
            assert_eq!((s.tables_held, s.tables_freed, m.ipis_sent()), (1, 0, 0));
            let _ = hold.flush(&cpu0).unwrap();
        } else {
            assert_eq!((s.tables_held, s.tables_freed, m.ipis_sent()), (0, 1, 1));
            assert_eq!(s.ipis_sent, 1, "the summary counts the lazy CPU's flush");
        }
        assert_eq!(m.violations(), [], "room {room}");
    }
}

/// A kernel's backing that records the dirty bits a teardown hands it.
struct DirtyLog<'r, 'm> {
    kernel: MockKernel<'r, 'm, X86Like>,
    dirty: Vec<Frame>,
}

impl FreeFrames for DirtyLog<'_, '_> {
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
        self.kernel.free_batch(frames);
    }
}

impl TeardownBacking for DirtyLog<'_, '_> {
    fn set_dirty(&mut self, frame: Frame) {
        self.dirty.push(frame);
        self.kernel.set_dirty(frame);
    }

    fn free_tables<const N: usize>(&mut self, tables: &mut heapless::Vec<OwnedFrame, N>) {
        self.kernel.free_tables(tables);
    }
}

/// What a hold reports while it holds tables and after it gave them back
/// (`len`, `room`, `groups`, `is_empty`, `waiting` and its `Debug`), and
/// that the backing it wraps still gets the teardown's dirty bits.
#[test]
fn a_hold_reports_what_it_holds_and_passes_dirty_bits_on() {
    let m = M::new(config(2, 64)).unwrap();
    let rmap = setup(&m, 2, &[0, 1]);
    let written: Vec<Frame> = (0..2)
        .map(|t| {
            m.cpu(0).unwrap().write(va(t * TABLE), 7).unwrap();
            rmap.spaces()[0].lookup(va(t * TABLE)).frame()
        })
        .collect();
    m.cpu(1).unwrap().enter_lazy().unwrap();
    let fresh = TableHold::<8>::new();
    assert_eq!(
        (fresh.len(), fresh.room(), fresh.groups(), fresh.is_empty()),
        (0, 8, 0, true)
    );

    let mut hold = TableHold::<8>::new();
    let mut log = DirtyLog {
        kernel: MockKernel::new(&rmap),
        dirty: Vec::new(),
    };
    let cpu0 = m.cpu(0).unwrap();
    let range = PageRange::new(va(0), (2 * TABLE) as u64).unwrap();
    let s = PageGather::new()
        .unmap_range(
            &cpu0,
            &rmap.spaces()[0],
            &mut hold.around(&mut log),
            range,
            true,
            &mut TableFreePolicy::AfterFlush,
            &mut |_, _| panic!("the mock frees every frame"),
        )
        .unwrap();
    assert_eq!((s.tables_held, s.tables_freed, s.ipis_sent), (2, 0, 0));
    let mut dirty = log.dirty.clone();
    dirty.sort();
    assert_eq!(dirty, written, "the wrapped backing got both dirty bits");
    assert_eq!(
        (hold.len(), hold.room(), hold.groups(), hold.is_empty()),
        (2, 6, 1, false)
    );
    assert_eq!(hold.waiting().len(), 1);
    let shown = format!("{hold:?}");
    assert!(
        shown.starts_with("TableHold") && shown.contains("frames: 2") && shown.contains("groups: 1"),
        "{shown}"
    );

    m.cpu(1).unwrap().switch_to(rmap.spaces()[0].mm()).unwrap();
    let back = free_tables(&rmap, hold.release_passed(&cpu0));
    assert_eq!(back.len(), 2);
    assert_eq!(
        (hold.len(), hold.room(), hold.groups(), hold.is_empty()),
        (0, 8, 0, true)
    );
    assert_eq!(m.violations(), []);
}

/// With every group slot in use, a teardown of the newest group's space
/// joins that group (its tables held, counted with it, and handed back
/// with it); a teardown of another space finds no room and falls back to
/// interrupting its lazy CPU.
#[test]
fn a_full_hold_takes_the_newest_groups_space_only() {
    let m = M::new(config(3, 64)).unwrap();
    let tables = TABLE_HOLD_GROUPS + 1;
    let rmap = setup(&m, tables, &[0, 1]);
    m.cpu(1).unwrap().enter_lazy().unwrap();
    let cpu0 = m.cpu(0).unwrap();
    let mut hold = TableHold::<64>::new();
    let mut kernel = MockKernel::new(&rmap);
    for t in 0..tables {
        // One teardown per leaf table: one group each, until the slots
        // run out and the last one joins the newest.
        let range = PageRange::new(va(t * TABLE), TABLE as u64).unwrap();
        let s = PageGather::new()
            .unmap_range(
                &cpu0,
                &rmap.spaces()[0],
                &mut hold.around(&mut kernel),
                range,
                true,
                &mut TableFreePolicy::AfterFlush,
                &mut |_, _| panic!("the mock frees every frame"),
            )
            .unwrap();
        assert_eq!(
            (s.tables_held, s.tables_freed, s.ipis_sent),
            (1, 0, 0),
            "teardown {t}"
        );
    }
    assert_eq!((hold.len(), hold.groups()), (tables, TABLE_HOLD_GROUPS));

    // Another space, lazy on CPU 2: no room for its table.
    let other = MockRmap::new(&m, vec![m.space(&m.new_mm(asid(2)).unwrap())]);
    other
        .map(m.alloc_frame().unwrap(), 0, va(0), true, MappingFlags::empty())
        .unwrap();
    let cpu2 = m.cpu(2).unwrap();
    cpu2.switch_to(other.spaces()[0].mm()).unwrap();
    cpu2.read(va(0)).unwrap();
    cpu2.enter_lazy().unwrap();
    let s = PageGather::new()
        .unmap_range(
            &cpu0,
            &other.spaces()[0],
            &mut hold.around(&mut MockKernel::new(&other)),
            PageRange::new(va(0), TABLE as u64).unwrap(),
            true,
            &mut TableFreePolicy::AfterFlush,
            &mut |_, _| panic!("the mock frees every frame"),
        )
        .unwrap();
    assert_eq!((s.tables_held, s.tables_freed, s.ipis_sent), (0, 1, 1));
    assert_eq!((hold.len(), hold.groups()), (tables, TABLE_HOLD_GROUPS));

    // CPU 1 passes: every table comes back, the joined one with its group.
    m.cpu(1).unwrap().switch_to(rmap.spaces()[0].mm()).unwrap();
    assert_eq!(free_tables_n(&rmap, hold.release_passed(&cpu0)).len(), tables);
    assert!(hold.is_empty());
    assert_eq!(m.violations(), []);
}

/// Frees what a hold of 64 handed back.
fn free_tables_n(rmap: &MockRmap<'_, X86Like>, mut back: tlb_batch::Flushed<64>) -> Vec<Frame> {
    let frames = back.frames_mut().iter().map(|f| f.frame()).collect();
    MockKernel::new(rmap).free_tables(back.frames_mut());
    assert!(back.frames_mut().is_empty(), "the mock frees every table");
    frames
}
