//! The crate's demonstration: one address space running on every CPU of a
//! simulated machine, 1,000 of its pages unmapped by CPU 0, three ways:
//! a flush per page, one batched flush, and one batched flush on
//! broadcast-invalidation hardware. Prints IPIs, interrupts taken and
//! simulated cycles per unmapped page, and what the oracle saw.
//!
//! Run with `cargo run --release --example demo`.

use std::process::ExitCode;

use tlb_batch::arch::mock::{BroadcastTlbi, MockConfig, MockMachine, Model, X86Like};
use tlb_batch::{flush_tlb_page, Asid, TlbFlushUnmapBatch, TtuFlags, PAGE_SIZE};

const PAGES: usize = 1000;
const BASE: u64 = 0x40_0000;

#[derive(Clone, Copy, PartialEq)]
enum Policy {
    PerPage,
    Batched,
}

struct Figures {
    ipis: u64,
    interrupts: u64,
    cycles: u64,
    violations: usize,
    stale: usize,
}

fn run<M: Model>(cpus: usize, policy: Policy) -> Figures {
    let m = MockMachine::<M>::with_model(MockConfig {
        frames: PAGES + 16,
        ..MockConfig::x86_like(cpus)
    })
    .expect("a valid machine shape");
    let mm = m.new_mm(Asid::new(1).expect("a user ASID"));
    let va = |i: usize| BASE + i as u64 * PAGE_SIZE;
    let frames: Vec<_> = (0..PAGES)
        .map(|i| m.map_new(&mm, va(i), true).expect("memory"))
        .collect();
    for cpu in m.cpus() {
        cpu.switch_to(&mm);
        for i in 0..PAGES {
            cpu.write(va(i), i as u64).expect("mapped");
        }
    }

    let cpu0 = m.cpu(0).expect("CPU 0 exists");
    let before = (m.stats(), m.costs());
    let interrupts_before: u64 = m
        .cpus()
        .map(|c| m.interrupts_taken(c.id()).expect("a CPU of this machine"))
        .sum();
    let mut batch = TlbFlushUnmapBatch::new();
    for (i, _) in frames.iter().enumerate() {
        let old = m.clear_pte(&mm, va(i)).expect("mapped");
        if policy == Policy::Batched && TlbFlushUnmapBatch::should_defer(&cpu0, &mm, TtuFlags::BATCH_FLUSH) {
            batch.add_pending(&cpu0, &mm, va(i), old).expect("aligned");
        } else {
            flush_tlb_page(&cpu0, &mm, va(i)).expect("aligned");
        }
    }
    // The flush point: before any frame goes back to the allocator.
    batch.flush(&cpu0).expect("not re-entered");
    let stale = m.stale_entries().len();
    for f in frames {
        m.free_frame(f).expect("in use");
    }
    let interrupts: u64 = m
        .cpus()
        .map(|c| m.interrupts_taken(c.id()).expect("a CPU of this machine"))
        .sum();
    Figures {
        ipis: m.stats().since(&before.0).ipis_sent,
        interrupts: interrupts - interrupts_before,
        cycles: m.costs().total() - before.1.total(),
        violations: m.violations().len(),
        stale,
    }
}

fn main() -> ExitCode {
    println!("Unmapping {PAGES} pages of an address space that runs on every CPU (simulated machine)\n");
    println!(
        "{:>5}  {:<22} {:>10} {:>12} {:>14} {:>9} {:>11}",
        "CPUs", "policy", "IPIs", "IPIs/page", "cycles/page", "vs per-page", "violations"
    );
    let mut clean = true;
    for cpus in [2, 4, 8, 16, 48] {
        let per_page = run::<X86Like>(cpus, Policy::PerPage);
        let rows = [
            ("flush per page", &per_page),
            ("batched (x86, IPIs)", &run::<X86Like>(cpus, Policy::Batched)),
            (
                "batched (broadcast)",
                &run::<BroadcastTlbi>(cpus, Policy::Batched),
            ),
        ];
        for (name, f) in rows {
            println!(
                "{:>5}  {:<22} {:>10} {:>12.4} {:>14.1} {:>8.1}x {:>11}",
                cpus,
                name,
                f.ipis,
                f.ipis as f64 / PAGES as f64,
                f.cycles as f64 / PAGES as f64,
                per_page.cycles as f64 / f.cycles.max(1) as f64,
                f.violations
            );
            // Every IPI sent interrupts exactly one CPU in this model.
            clean &= f.violations == 0 && f.stale == 0 && f.interrupts == f.ipis;
        }
        println!();
    }
    println!("Floor: one IPI per other CPU per flush point; the batched x86 rows sit on it.");
    println!(
        "Cycles cover the unmap and its flushes; refills after a full flush come later, outside this count."
    );
    if clean {
        println!("Oracle: no stale TLB entry survived a flush point, no contract violation.");
        ExitCode::SUCCESS
    } else {
        println!("Oracle: VIOLATIONS FOUND");
        ExitCode::FAILURE
    }
}
