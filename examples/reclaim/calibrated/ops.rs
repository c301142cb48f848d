//! Page migration and range teardown inside the calibrated workload, so
//! that `migrate_pages` and `MmuGather` meet Linux 6.1 in the same cells,
//! on the same running machine, as `shrink_page_list` does.
//!
//! # Migration: compaction
//!
//! Every [`COMPACT_PERIOD`] ticks a task that is running on its CPU
//! compacts memory directly, as an allocation of a higher order does in
//! Linux: it picks a random block of [`COMPACT_BLOCK`] frames, takes the
//! mapped ones (file pages on the LRU, anonymous pages of the tasks'
//! buffers, shared hot pages), at most [`COMPACT_MAX`] of them (Linux's
//! `COMPACT_CLUSTER_MAX`) and no more than the free frames above kswapd's
//! low mark (each needs a target frame: Linux's `compaction_suitable`
//! wants free memory above the watermark too), and migrates them. The
//! period is 1.28 ms of the model's time: a fragmented machine with a
//! steady demand for huge pages, about 800 calls a second. It is set high
//! so that each cell migrates a few hundred pages over its seeds (a few
//! dozen at 48 CPUs, whose runs are short and have one seed); what is
//! compared is IPIs per migrated page, not the rate. Compaction rather
//! than NUMA balancing: NUMA balancing's hinting faults migrate one page
//! per call (`migrate_misplaced_page`), where no policy can batch, while
//! compaction hands `migrate_pages` lists of pages of many address spaces.
//!
//! - **Linux 6.1** migrates page by page and does not batch its flushes
//!   (batched flushing during migration, commit 7e12beb8ca2a
//!   "migrate_pages: batch flushing TLB", came with the series merged
//!   after 6.1, in 6.4): it allocates the target first (`unmap_and_move`),
//!   then `try_to_migrate_one` clears each mapping with `ptep_clear_flush`,
//!   which flushes that one page at once (`flush_tlb_page`, to
//!   `mm_cpumask` less the lazy CPUs, `tlb_is_not_lazy`), and puts a
//!   migration entry in its place; the contents are copied, the migration
//!   entries become entries for the new frame (`remove_migration_ptes`) and
//!   the old frame is freed. The model does this by hand on the crate's
//!   `flush_tlb_page`, whose targets are Linux's rule.
//! - **The crate**: `tlb_batch::migrate_pages`, with a batch of
//!   [`SCAN`] pages.
//!
//! # Teardown: munmap of a task's buffers
//!
//! Every [`BUFFER_EVERY`] page reads a task maps an anonymous buffer of
//! one of [`BUFFER_SIZES`] pages (4 to 96: below, at and above Linux's
//! 33-page ceiling), writes [`BUFFER_TOUCH`] of its pages at each of its
//! next [`BUFFER_LIFE`] page reads (wherever it runs meanwhile), then
//! unmaps it; a task that finishes unmaps its buffer as it exits. That is
//! the churn of a program whose allocator serves large requests with mmap
//! and returns them with munmap (glibc does above its 128 KiB threshold):
//! about 400 munmaps a second per CPU. Each task has two slots for its
//! buffers, each on a page table of its own, and uses them in turn: one
//! holds nothing else, so the munmap frees its page table (Linux's
//! `free_pgtables` frees what lies between the neighbouring mappings); the
//! other has a neighbour, a read-only mapping of a shared page (a
//! library's) on its last page, which keeps the table. The buffers' frames
//! are not on the LRU: the model has no swap, and Linux 6.1 does not scan
//! anonymous pages without it.
//!
//! - **Linux 6.1** (`unmap_region`): `zap_pte_range` first calls
//!   `flush_tlb_batched_pending` (a whole-space flush when reclaim
//!   deferred a flush of the space since the last one), clears the PTEs,
//!   `free_pgtables` queues the emptied table (`freed_tables`), and
//!   `tlb_finish_mmu` flushes once, `flush_tlb_mm_range` over the range
//!   (the table's whole range when one was freed, so above the ceiling):
//!   page by page up to 33 pages, the whole space above; to `mm_cpumask`
//!   less the lazy CPUs, or all of it with the lazy ones when a table
//!   was freed (`native_flush_tlb_multi`: `on_each_cpu_mask` for
//!   `freed_tables`, else `tlb_is_not_lazy`). Then the frames and the
//!   table are freed. Linux's reclaim marks a space for the first step
//!   whenever it defers a flush with another CPU in `mm_cpumask`
//!   (`should_defer_flush`; `policies.rs`); Linux 6.1's migration never
//!   does, it does not defer.
//! - **The crate**: `MmuGather::unmap_range` (a `PageGather`) with a
//!   `TableHold` of [`HOLD_TABLES`] frames (the model has no lockless
//!   walkers): the flush reaches only the CPUs that run the space and are
//!   not lazy, and an emptied table that a lazy CPU may still walk through
//!   its paging-structure caches waits in the hold, allocated, until that
//!   CPU caught up, loaded another root or went offline. Each teardown and
//!   each tick frees the held tables whose CPUs have passed (no IPI); a
//!   hold without room makes the teardown interrupt the lazy CPUs as
//!   Linux's does; when the machine runs out of page-table frames, and at
//!   the end of the run, the hold is flushed (a whole-ASID flush to the
//!   CPUs still waited for), and those IPIs count as the teardowns'.
//!
//! # Accounting
//!
//! The peers built on the crate (`Peer::TlbBatch`, the pool, the
//! broadcast ones) use the crate's two operations; every other peer uses
//! Linux 6.1's (the seed RFC and Asterinas define none). The IPIs,
//! interrupts and cycles charged during an operation are counted in
//! [`OpFigures`], not in reclaim's figures; the initiator waits for each
//! round (at most one per shootdown that sent IPIs). TLB refills that a
//! full flush of a teardown causes later are charged where they happen,
//! with the rest of the run. The oracle watches the whole run: a stale
//! entry an operation leaves is a violation of that run.

use std::ops::ControlFlow;

use tlb_batch::arch::mock::{MockKernel, Model as Hardware};
use tlb_batch::{
    flush_tlb_batched_pending, flush_tlb_page, migrate_pages, shootdown, Arch, FlushRequest, Flushed, Frame,
    MappingFlags, MigrateOutcome, PageGather, PageRange, PageTable, Rmap, TableFreePolicy, TableHold,
    TableTeardown, TeardownBacking, UnmapBatch, PAGE_SIZE,
};

use super::{Model, Run, Stream, HOT_BASE, KSWAPD_LOW, MEMORY, REGION_ALIGN};
use crate::policies::{handle, Peer, SCAN};

/// Ticks between two compaction calls (1.28 ms at 10 us a tick).
pub const COMPACT_PERIOD: u64 = 128;
/// Frames a compaction call scans.
pub const COMPACT_BLOCK: usize = 64;
/// Pages a compaction call migrates at most (Linux's COMPACT_CLUSTER_MAX).
pub const COMPACT_MAX: usize = 32;
/// Page reads between the starts of two buffers of a task.
pub const BUFFER_EVERY: usize = 256;
/// Page reads a buffer lives for.
pub const BUFFER_LIFE: usize = 8;
/// Pages of its buffer a task writes per page read.
pub const BUFFER_TOUCH: usize = 4;
/// The buffers' sizes in pages, taken in turn.
pub const BUFFER_SIZES: [usize; 5] = [4, 16, 33, 34, 96];
/// Where the buffers' slots start: two per task, one page table each.
const SCRATCH_BASE: u64 = 0x4000_0000;
/// Page-table frames the crate's teardowns may hold for lazy CPUs.
pub const HOLD_TABLES: usize = 32;

/// What one kind of operation did over a run.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct OpFigures {
    /// Calls made (compactions, teardowns).
    pub calls: u64,
    /// Pages migrated, or present pages unmapped.
    pub pages: u64,
    pub ipis: u64,
    pub interrupts: u64,
    pub cycles: u64,
    /// Teardowns that found a deferred flush of the space outstanding
    /// (`flush_tlb_batched_pending` then flushes the whole space first).
    pub pending: u64,
}

impl OpFigures {
    /// `n` per page.
    pub fn per_page(&self, n: u64) -> f64 {
        n as f64 / self.pages.max(1) as f64
    }

    pub fn add(&mut self, o: &OpFigures) {
        self.calls += o.calls;
        self.pages += o.pages;
        self.ipis += o.ipis;
        self.interrupts += o.interrupts;
        self.cycles += o.cycles;
        self.pending += o.pending;
    }
}

/// Whether `peer` runs the crate's operations (else Linux 6.1's).
pub fn crate_ops(peer: Peer) -> bool {
    matches!(
        peer,
        Peer::TlbBatch | Peer::TlbBatchPool | Peer::BroadcastAlways | Peer::BroadcastWide
    )
}

/// A task's live buffer.
#[derive(Clone, Copy)]
pub(super) struct Buffer {
    /// 0: the slot alone on its table; 1: the one with a neighbour.
    pub slot: usize,
    pub pages: usize,
    /// Page reads left before it is unmapped.
    pub reads_left: usize,
    /// The next page written.
    pub next: usize,
}

/// The operations' state of a run.
pub(super) struct Ops {
    pub on: bool,
    pub buffers: Vec<Option<Buffer>>,
    /// Buffers each task has mapped so far.
    pub made: Vec<usize>,
    /// The crate's teardowns' tables waiting for lazy CPUs.
    pub tables: TableHold<HOLD_TABLES>,
}

impl Ops {
    pub fn new(on: bool, tasks: usize) -> Self {
        Ops {
            on,
            buffers: vec![None; tasks],
            made: vec![0; tasks],
            tables: TableHold::new(),
        }
    }
}

/// The machine's counters an operation is charged from.
#[derive(Clone, Copy)]
struct Snap {
    ipis: u64,
    interrupts: u64,
    cycles: u64,
    shootdowns: u64,
}

/// Task `t`'s buffer slot `slot`: its first address.
pub(super) fn slot_va(t: usize, slot: usize) -> u64 {
    SCRATCH_BASE + ((2 * t + slot) * REGION_ALIGN) as u64 * PAGE_SIZE
}

/// The whole of a slot: one page table's range.
fn slot_range(t: usize, slot: usize) -> PageRange {
    PageRange::new(slot_va(t, slot), REGION_ALIGN as u64).expect("an aligned slot")
}

impl<'m, H: Hardware> Model<'m, H> {
    fn snap(&self) -> Snap {
        Snap {
            ipis: self.m.ipis_sent(),
            interrupts: self
                .m
                .cpus()
                .map(|c| self.m.interrupts_taken(c.id()).expect("a CPU"))
                .sum(),
            cycles: self.m.costs().total(),
            shootdowns: self.m.stats().shootdowns,
        }
    }

    /// Charges what happened since `before` to one call of an operation
    /// made on CPU `c` over `pages` pages; the CPU waits for its rounds.
    fn record(&mut self, c: usize, before: Snap, pages: u64, munmap: bool) {
        let after = self.snap();
        let f = OpFigures {
            calls: 1,
            pages,
            ipis: after.ipis - before.ipis,
            interrupts: after.interrupts - before.interrupts,
            cycles: after.cycles - before.cycles,
            pending: 0,
        };
        self.wait(c, (after.shootdowns - before.shootdowns).min(f.ipis));
        if munmap {
            self.fig.munmap.add(&f);
        } else {
            self.fig.migrate.add(&f);
        }
    }

    /// Maps every task's neighbour page (on the last page of its second
    /// slot): hot page 0's frame, read-only, a shared library's page.
    pub(super) fn place_neighbours(&mut self) {
        if !self.ops.on || self.cell.hot == 0 {
            return;
        }
        for t in 0..self.tasks.len() {
            let space = self.tasks[t].space;
            let frame = self.rmap.spaces()[space].lookup(HOT_BASE).frame();
            let va = slot_va(t, 1) + (REGION_ALIGN as u64 - 1) * PAGE_SIZE;
            self.rmap
                .map(frame, space, va, false, MappingFlags::empty())
                .expect("a known space");
        }
    }

    /// After task `t` read a page on CPU `c`: it writes its buffer, unmaps
    /// it at the end of its life, or maps a new one when it is time.
    pub(super) fn buffer_step(&mut self, c: usize, t: usize) {
        if !self.ops.on {
            return;
        }
        if let Some(mut b) = self.ops.buffers[t] {
            let cpu = self.cpu(c);
            for _ in 0..BUFFER_TOUCH.min(b.pages) {
                let va = slot_va(t, b.slot) + (b.next % b.pages) as u64 * PAGE_SIZE;
                cpu.write(va, va).expect("a buffer page stays mapped");
                b.next += 1;
            }
            b.reads_left -= 1;
            self.ops.buffers[t] = Some(b);
            if b.reads_left == 0 {
                self.unmap_buffer(c, t);
            }
            return;
        }
        if !(self.tasks[t].pos + 7 * t).is_multiple_of(BUFFER_EVERY) {
            return;
        }
        let made = self.ops.made[t];
        self.ops.made[t] += 1;
        let slot = if self.cell.hot == 0 { 0 } else { made % 2 };
        self.map_buffer(c, t, slot, BUFFER_SIZES[(made + t) % BUFFER_SIZES.len()]);
    }

    /// Task `t`, on CPU `c`, maps a buffer of `pages` fresh pages in its
    /// slot `slot`.
    pub(super) fn map_buffer(&mut self, c: usize, t: usize, slot: usize, pages: usize) {
        let space = self.tasks[t].space;
        for p in 0..pages {
            let f = self.alloc(c);
            let va = slot_va(t, slot) + p as u64 * PAGE_SIZE;
            if self
                .rmap
                .map_fresh(f, space, va, true, MappingFlags::empty())
                .is_err()
            {
                // Out of page-table frames: the held ones go back now.
                assert!(!self.ops.tables.is_empty(), "out of page-table frames");
                self.flush_tables(c);
                self.rmap
                    .map_fresh(f, space, va, true, MappingFlags::empty())
                    .expect("a known space, and a table frame");
            }
        }
        self.ops.buffers[t] = Some(Buffer {
            slot,
            pages,
            reads_left: BUFFER_LIFE,
            next: 0,
        });
    }

    /// Task `t`, on CPU `c`, unmaps its buffer (if it has one) with the
    /// peer's policy.
    pub(super) fn unmap_buffer(&mut self, c: usize, t: usize) {
        let Some(b) = self.ops.buffers[t].take() else {
            return;
        };
        let space = self.tasks[t].space;
        // The slot alone on its table: the munmap reaches from one
        // neighbouring mapping to the next, so the table goes too.
        let (range, free_tables) = if b.slot == 0 {
            (slot_range(t, 0), true)
        } else {
            (
                PageRange::new(slot_va(t, 1), b.pages as u64).expect("an aligned buffer"),
                false,
            )
        };
        let pending = self.rmap.spaces()[space].tlb_state().batched_flush_pending();
        let before = self.snap();
        let pages = if crate_ops(self.peer) {
            self.crate_munmap(c, space, range, free_tables)
        } else {
            self.linux_munmap(c, space, range, free_tables)
        };
        self.record(c, before, pages, true);
        self.fig.munmap.pending += u64::from(pending);
    }

    /// `MmuGather::unmap_range` with the hold; returns the pages unmapped.
    fn crate_munmap(&mut self, c: usize, space: usize, range: PageRange, free_tables: bool) -> u64 {
        let cpu = self.cpu(c);
        let mut kernel = MockKernel::new(&self.rmap);
        let mut passed = self.ops.tables.release_passed(&cpu);
        kernel.free_tables(passed.frames_mut());
        assert!(passed.is_empty(), "the mock frees every table");
        let mut gather = PageGather::new();
        let s = gather
            .unmap_range(
                &cpu,
                &self.rmap.spaces()[space],
                &mut self.ops.tables.around(&mut kernel),
                range,
                free_tables,
                &mut TableFreePolicy::AfterFlush,
                &mut |_, _| panic!("the mock frees every frame"),
            )
            .expect("not nested");
        s.pages_unmapped as u64
    }

    /// Frees the held tables whose lazy CPUs have passed (no IPI): every
    /// tick, on the first CPU.
    pub(super) fn release_tables(&mut self) {
        if self.ops.tables.is_empty() {
            return;
        }
        let back = self.ops.tables.release_passed(&self.cpu(0));
        self.free_tables(back);
    }

    /// Flushes the hold on CPU `c` (memory pressure, the end of the run)
    /// and frees every table, charging its IPIs to the teardowns.
    pub(super) fn flush_tables(&mut self, c: usize) {
        if self.ops.tables.is_empty() {
            return;
        }
        let before = self.snap();
        let back = self.ops.tables.flush(&self.cpu(c)).expect("not nested");
        self.free_tables(back);
        let after = self.snap();
        let f = OpFigures {
            ipis: after.ipis - before.ipis,
            interrupts: after.interrupts - before.interrupts,
            cycles: after.cycles - before.cycles,
            ..OpFigures::default()
        };
        self.wait(c, (after.shootdowns - before.shootdowns).min(f.ipis));
        self.fig.munmap.add(&f);
    }

    fn free_tables(&self, mut back: Flushed<HOLD_TABLES>) {
        MockKernel::new(&self.rmap).free_tables(back.frames_mut());
        assert!(back.is_empty(), "the mock frees every table");
    }

    /// Linux 6.1's `unmap_region` (see the module docs); returns the pages
    /// unmapped.
    fn linux_munmap(&mut self, c: usize, space: usize, range: PageRange, free_tables: bool) -> u64 {
        let cpu = self.cpu(c);
        let s = &self.rmap.spaces()[space];
        let mm = s.tlb_state();
        flush_tlb_batched_pending(&cpu, mm).expect("not nested");
        let ceiling = <tlb_batch::arch::mock::MockCpu<'m, H> as Arch>::FULL_FLUSH_CEILING;
        let mut request = FlushRequest::new();
        let mut frames = Vec::new();
        for p in 0..range.pages() {
            let va = range.start() + p * PAGE_SIZE;
            if !s.lookup(va).is_present() {
                continue;
            }
            let old = s.clear(va);
            if old.is_dirty() {
                self.rmap.set_dirty(old.frame());
            }
            request.add_range(mm.asid(), PageRange::new(va, 1).expect("a page"), ceiling);
            frames.push(old.frame());
        }
        let mut tables = Vec::new();
        if free_tables {
            while let Some(table) = s.detach_table(range) {
                request.add_range(mm.asid(), table.range, ceiling);
                tables.push(table.frame);
            }
        }
        if !request.is_empty() {
            let targets = if tables.is_empty() {
                mm.flush_targets(&cpu)
            } else {
                mm.table_flush_targets(&cpu)
            };
            shootdown(&cpu, &targets, &request).expect("not nested");
        }
        for &f in &frames {
            self.rmap.remove_frame(f);
            self.m.free_frame(f).expect("unmapped and flushed");
        }
        for f in tables {
            self.m.free_frame(f).expect("a detached table, flushed");
        }
        frames.len() as u64
    }

    /// One tick's compaction, if it is time and a task is running.
    pub(super) fn compact_tick(&mut self) {
        if !self.ops.on || self.now % COMPACT_PERIOD != COMPACT_PERIOD / 2 {
            return;
        }
        let busy: Vec<usize> = (0..self.cpus.len())
            .filter(|&c| matches!(self.cpus[c].run, Run::Worker(_)))
            .collect();
        if busy.is_empty() {
            return;
        }
        let c = busy[self.random(Stream::Ops, busy.len())];
        let room = self.m.free_frames().saturating_sub(KSWAPD_LOW).min(COMPACT_MAX);
        let frames_total = MEMORY + self.cell.hot;
        let first = self.random(Stream::Ops, frames_total / COMPACT_BLOCK) * COMPACT_BLOCK;
        let frames: Vec<Frame> = (first..first + COMPACT_BLOCK)
            .map(|p| Frame(p as u64))
            .filter(|&f| self.rmap.mapcount(f) > 0)
            .take(room)
            .collect();
        self.migrate_frames(c, frames);
    }

    /// Migrates `frames` on CPU `c` with the peer's policy, and follows the
    /// moved LRU pages to their new frames. Returns the pages moved.
    pub(super) fn migrate_frames(&mut self, c: usize, frames: Vec<Frame>) -> u64 {
        if frames.is_empty() {
            return 0;
        }
        let before = self.snap();
        let moved = if crate_ops(self.peer) {
            self.crate_migrate(c, frames)
        } else {
            self.linux_migrate(c, frames)
        };
        for &(old, new) in &moved {
            self.follow(old, new);
        }
        let n = moved.len() as u64;
        self.record(c, before, n, false);
        n
    }

    /// `tlb_batch::migrate_pages`; returns the (old, new) frames moved.
    fn crate_migrate(&mut self, c: usize, frames: Vec<Frame>) -> Vec<(Frame, Frame)> {
        let cpu = self.cpu(c);
        let mut kernel = MockKernel::new(&self.rmap);
        let mut batch = UnmapBatch::<SCAN>::new();
        let mut moved = Vec::new();
        let done = migrate_pages(
            &cpu,
            &self.rmap,
            &mut kernel,
            &mut batch,
            frames.into_iter().map(handle),
            &mut |o| match o {
                MigrateOutcome::Migrated { old, new } => moved.push((old, new.into_frame())),
                MigrateOutcome::Failed { frame, .. } => {
                    // Back where it was, mapped as before.
                    let _ = frame.into_frame();
                }
                MigrateOutcome::OldFrameRefused(_) => panic!("the mock frees every frame"),
            },
        );
        assert!(done.is_ok(), "not nested");
        moved
    }

    /// Linux 6.1's `migrate_pages`, page by page (see the module docs);
    /// returns the (old, new) frames moved.
    fn linux_migrate(&mut self, c: usize, frames: Vec<Frame>) -> Vec<(Frame, Frame)> {
        let cpu = self.cpu(c);
        let rmap = &self.rmap;
        let mut moved = Vec::new();
        for old in frames {
            // `unmap_and_move` gets the target before it unmaps.
            let Ok(new) = self.m.alloc_frame() else {
                break;
            };
            // `try_to_migrate_one` for each mapping: `ptep_clear_flush`,
            // then the migration entry.
            let _ = rmap.walk(old, &mut |m| {
                if m.space.lookup(m.va).maps(old) {
                    let cleared = m.space.clear(m.va);
                    flush_tlb_page(&cpu, m.space.tlb_state(), m.va).expect("not nested");
                    if cleared.is_dirty() {
                        rmap.set_dirty(old);
                    }
                    m.space.set(m.va, cleared.to_migration());
                }
                ControlFlow::Continue(())
            });
            self.m.copy_frame(old, new).expect("two frames in use");
            // `remove_migration_ptes`: the entries now map the new frame.
            let _ = rmap.walk(old, &mut |m| {
                let pte = m.space.lookup(m.va);
                if pte.is_migration() && pte.frame() == old {
                    if let Some(present) = pte.from_migration(new) {
                        m.space.set(m.va, present);
                    }
                }
                ControlFlow::Continue(())
            });
            rmap.move_frame(old, new);
            self.m.free_frame(old).expect("unmapped and flushed");
            moved.push((old, new));
        }
        moved
    }

    /// A page on the LRU (or a CPU's add batch) moved from `old` to `new`.
    fn follow(&mut self, old: Frame, new: Frame) {
        if let Some(f) = self.lru.iter_mut().find(|f| **f == old) {
            *f = new;
            return;
        }
        for cpu in &mut self.cpus {
            if let Some(f) = cpu.add_batch.iter_mut().find(|f| **f == old) {
                *f = new;
                return;
            }
        }
    }
}
