//! What a teardown costs per page table it frees: an `exit()` of a large
//! process tears down thousands of leaf tables, and the cost per table must
//! not grow with their number.
//!
//! `cargo run --release --example teardown_cost --features x86_64-mapper,mock`
//! builds four-level tables with the `x86_64` crate's `OffsetPageTable` in
//! host memory (one page in each of T leaf tables, T = 256 and 2,048),
//! tears the whole range down with `OffsetTeardown::munmap` on a simulated
//! machine, and prints the wall-clock time per table freed (the median of
//! several runs), for both sizes, measured in one run. Before the
//! teardown's table search resumed where it had found the last table, every
//! table freed cost a search from the range's start: 1.4 us per table at
//! 256 tables, 8.8 us at 2,048 on the machine the issue was measured on.

use std::time::{Duration, Instant};

use tlb_batch::arch::mock::{MockConfig, MockMachine};
use tlb_batch::mapper::{DeallocatorFrees, OffsetSpace};
use tlb_batch::{Asid, PageGather, PageRange, PAGE_SIZE};
use x86_64::structures::paging::{
    FrameAllocator, FrameDeallocator, Mapper, OffsetPageTable, Page, PageTable, PageTableFlags as F,
    PhysFrame, Size4KiB,
};
use x86_64::{PhysAddr, VirtAddr};

/// One leaf table maps 2 MiB.
const TABLE_SPAN: u64 = 2 << 20;
/// Where the mapped range starts (1 GiB-aligned, in the lower half).
const BASE: u64 = 1 << 30;
/// Runs per size; the median is printed.
const RUNS: usize = 5;

/// Page-table frames for `map_to`: leaked, zeroed host pages at their own
/// address (the physical-memory offset is 0).
struct HostPages;

// SAFETY: each frame is a fresh, zeroed, 4 KiB-aligned host page that is
// never handed out twice.
unsafe impl FrameAllocator<Size4KiB> for HostPages {
    fn allocate_frame(&mut self) -> Option<PhysFrame> {
        let page: &'static mut PageTable = Box::leak(Box::new(PageTable::new()));
        PhysFrame::from_start_address(PhysAddr::new(page as *mut PageTable as u64)).ok()
    }
}

/// Counts what the teardown frees (the host pages stay leaked).
#[derive(Default)]
struct Count(usize);

impl FrameDeallocator<Size4KiB> for Count {
    unsafe fn deallocate_frame(&mut self, _frame: PhysFrame) {
        self.0 += 1;
    }
}

/// Maps one page in each of `tables` leaf tables, tears the range down,
/// and returns the teardown's time and the tables it freed.
fn one_run(tables: u64) -> (Duration, usize) {
    let root: &'static mut PageTable = Box::leak(Box::new(PageTable::new()));
    let root_addr = root as *mut PageTable as u64;
    // SAFETY: every table frame an entry names is a leaked host page at its
    // own address (offset 0).
    let mut mapper = unsafe { OffsetPageTable::new(root, VirtAddr::new(0)) };
    for t in 0..tables {
        let page =
            Page::<Size4KiB>::from_start_address(VirtAddr::new(BASE + t * TABLE_SPAN)).expect("aligned");
        // Data frames are never dereferenced: any aligned address will do.
        let frame = PhysFrame::from_start_address(PhysAddr::new(0x10_0000 + t * PAGE_SIZE)).expect("aligned");
        // SAFETY: the tables are loaded nowhere; the frames are never read.
        unsafe {
            mapper.map_to(
                page,
                frame,
                F::PRESENT | F::WRITABLE | F::USER_ACCESSIBLE,
                &mut HostPages,
            )
        }
        .expect("a new mapping")
        .ignore();
    }
    let machine = MockMachine::new(MockConfig::x86_like(2)).expect("a machine");
    let mm = machine
        .new_mm_at(Asid::new(1).expect("an ASID"), root_addr)
        .expect("an address space");
    let cpu = machine.cpu(0).expect("CPU 0");
    let range = PageRange::new(BASE, tables * (TABLE_SPAN / PAGE_SIZE)).expect("a range");
    let mut count = Count::default();
    let mut gather = PageGather::new();
    // SAFETY: every frame is mapped once, and the page-table frames are
    // this address space's alone.
    let space = unsafe { OffsetSpace::new(&mut mapper, &mm).for_teardown() };
    // SAFETY: frames are not reference-counted.
    let mut frees = unsafe { DeallocatorFrees::new(&mut count) };
    let start = Instant::now();
    let summary = space
        .munmap(&cpu, &mut gather, range, &mut frees)
        .expect("the teardown");
    let took = start.elapsed();
    assert_eq!(summary.pages_unmapped as u64, tables);
    (took, summary.tables_freed)
}

fn main() {
    println!("Teardown cost per page table freed (OffsetTeardown::munmap over x86_64-crate tables, median of {RUNS} runs)");
    println!(
        "{:>7} {:>13} {:>12} {:>15}",
        "tables", "tables freed", "teardown", "per table"
    );
    let mut per_table = Vec::new();
    for tables in [256, 2048] {
        let mut runs: Vec<(Duration, usize)> = (0..RUNS).map(|_| one_run(tables)).collect();
        runs.sort();
        let (took, freed) = runs[RUNS / 2];
        let each = took.as_secs_f64() * 1e9 / freed as f64;
        per_table.push(each);
        println!("{tables:>7} {freed:>13} {:>10.2?} {each:>12.0} ns", took);
    }
    println!(
        "per-table cost at 2,048 tables against 256: {:.2}x (1x: linear in the tables freed)",
        per_table[1] / per_table[0]
    );
}
