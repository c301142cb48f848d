//! A [`PageTable`] wrapper that counts the calls the crate makes: how a
//! test or a benchmark sees what an operation costs in page-table work,
//! independently of time.

use core::cell::{Cell, RefCell};
use std::vec::Vec;

use crate::gather::{DetachedTable, TableBounds, TableTeardown};
use crate::mm::MmTlbState;
use crate::page_size::PageSize;
use crate::pte::Pte;
use crate::range::PageRange;
use crate::rmap::PageTable;
use crate::Error;

/// Wraps a page table and counts every call to it (all methods but
/// [`tlb_state`](PageTable::tlb_state)). With a budget, a walk whose cost
/// follows a huge range's size stops soon after the budget is spent instead
/// of running for hours: past it, [`next_populated`](PageTable::next_populated)
/// answers `None` (nothing more is mapped), and
/// [`exceeded`](Self::exceeded) says so.
#[derive(Debug)]
pub struct CountingTable<P> {
    inner: P,
    calls: Cell<u64>,
    budget: u64,
    searches: RefCell<Vec<PageRange>>,
}

impl<P: PageTable> CountingTable<P> {
    /// Counts the calls made to `inner`, without a budget.
    pub fn new(inner: P) -> Self {
        CountingTable::with_budget(inner, u64::MAX)
    }

    /// Counts the calls made to `inner`; past `budget` calls, the table
    /// reports nothing more mapped, so walks end (see the type's docs).
    pub fn with_budget(inner: P, budget: u64) -> Self {
        CountingTable {
            inner,
            calls: Cell::new(0),
            budget,
            searches: RefCell::new(Vec::new()),
        }
    }

    /// The ranges [`detach_table`](TableTeardown::detach_table) and
    /// [`detach_table_bounded`](TableTeardown::detach_table_bounded) were
    /// asked to search, in order (how a teardown's table searches add up).
    pub fn detach_searches(&self) -> Vec<PageRange> {
        self.searches.borrow().clone()
    }

    /// Calls so far.
    pub fn calls(&self) -> u64 {
        self.calls.get()
    }

    /// Calls so far, starting the count again from zero.
    pub fn take_calls(&self) -> u64 {
        self.calls.replace(0)
    }

    /// The wrapped page table.
    pub fn inner(&self) -> &P {
        &self.inner
    }

    /// Whether more calls were made than the budget allows.
    pub fn exceeded(&self) -> bool {
        self.calls.get() > self.budget
    }

    fn tick(&self) {
        self.calls.set(self.calls.get().saturating_add(1));
    }
}

// SAFETY: every call is forwarded unchanged to `inner`, whose guarantees
// therefore hold.
unsafe impl<P: PageTable> PageTable for CountingTable<P> {
    fn tlb_state(&self) -> &MmTlbState {
        self.inner.tlb_state()
    }

    fn lookup(&self, va: u64) -> Pte {
        self.tick();
        self.inner.lookup(va)
    }

    fn exchange(&self, va: u64, new: Pte) -> Pte {
        self.tick();
        self.inner.exchange(va, new)
    }

    fn test_and_clear_accessed(&self, va: u64) -> bool {
        self.tick();
        self.inner.test_and_clear_accessed(va)
    }

    fn set(&self, va: u64, pte: Pte) {
        self.tick();
        self.inner.set(va, pte)
    }

    fn clear(&self, va: u64) -> Pte {
        self.tick();
        self.inner.clear(va)
    }

    fn next_populated(&self, range: PageRange) -> Option<u64> {
        self.tick();
        if self.exceeded() {
            return None;
        }
        self.inner.next_populated(range)
    }

    fn with_table_locked(&self, va: u64, body: &mut dyn FnMut()) {
        self.tick();
        self.inner.with_table_locked(va, body)
    }

    fn entry_size(&self, va: u64) -> PageSize {
        self.tick();
        self.inner.entry_size(va)
    }

    fn check_range(&self, range: PageRange) -> Result<(), Error> {
        self.tick();
        self.inner.check_range(range)
    }

    fn root(&self) -> Option<u64> {
        self.inner.root()
    }
}

// SAFETY: forwarded unchanged to `inner`.
unsafe impl<P: TableTeardown> TableTeardown for CountingTable<P> {
    fn detach_table(&self, range: PageRange) -> Option<DetachedTable> {
        self.tick();
        self.searches.borrow_mut().push(range);
        self.inner.detach_table(range)
    }

    fn detach_table_bounded(&self, range: PageRange, bounds: TableBounds) -> Option<DetachedTable> {
        self.tick();
        self.searches.borrow_mut().push(range);
        self.inner.detach_table_bounded(range, bounds)
    }
}
