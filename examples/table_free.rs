//! Seed 004's question, "could we quantify faster?": freeing page-table
//! frames one call per table versus one batched call, with a frame
//! allocator whose free takes a lock (like a zone lock).
//!
//! Both allocators implement the crate's `TeardownBacking::free_tables`,
//! the call `MmuGather` makes once per batch: one frees table by table,
//! taking the lock for each; the other takes the lock once for the batch.
//!
//! `cargo run --release --example table_free` prints the wall-clock ratio
//! for 1, 64 and 512 tables, measured in one run. For instruction counts
//! (repeatable), `scripts/bench-table-free.sh` runs `--mode single|batched
//! --tables N --iters K` under callgrind, counting only inside the two
//! `free_tables` implementations.

use std::hint::black_box;
use std::time::{Duration, Instant};

use tlb_batch::{Frame, FreeFrames, OwnedFrame, TeardownBacking};

const MAX_TABLES: usize = 512;

/// A zone: a free list and its accounting behind one spinlock.
struct Zone {
    inner: spin::Mutex<ZoneInner>,
}

struct ZoneInner {
    free: Vec<u64>,
    free_count: usize,
    freed_total: u64,
}

impl Zone {
    fn new() -> Self {
        Zone {
            inner: spin::Mutex::new(ZoneInner {
                free: Vec::with_capacity(MAX_TABLES),
                free_count: 0,
                freed_total: 0,
            }),
        }
    }

    /// Takes every free frame back out (outside the measured free path).
    fn take_all(&self, out: &mut heapless::Vec<OwnedFrame, MAX_TABLES>) {
        let mut z = self.inner.lock();
        while let Some(f) = z.free.pop() {
            z.free_count -= 1;
            // The vector holds at most MAX_TABLES frames.
            // SAFETY: the zone hands each frame out once; the benchmark frees
            // it only through this handle.
            let _ = out.push(unsafe { OwnedFrame::new(Frame(f)) });
        }
    }
}

/// Frees each table with its own lock round trip (one call per table).
struct Looping<'z>(&'z Zone);

/// Frees the whole batch under one lock round trip.
struct Batched<'z>(&'z Zone);

impl FreeFrames for Looping<'_> {
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
        self.free_tables(frames);
    }
}

impl TeardownBacking for Looping<'_> {
    fn set_dirty(&mut self, _frame: Frame) {}

    #[inline(never)]
    fn free_tables<const N: usize>(&mut self, tables: &mut heapless::Vec<OwnedFrame, N>) {
        while let Some(t) = tables.pop() {
            free_one(self.0, t);
        }
    }
}

#[inline(never)]
fn free_one(zone: &Zone, table: OwnedFrame) {
    let mut z = zone.inner.lock();
    z.free.push(table.into_frame().0);
    z.free_count += 1;
    z.freed_total += 1;
}

impl FreeFrames for Batched<'_> {
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
        self.free_tables(frames);
    }
}

impl TeardownBacking for Batched<'_> {
    fn set_dirty(&mut self, _frame: Frame) {}

    #[inline(never)]
    fn free_tables<const N: usize>(&mut self, tables: &mut heapless::Vec<OwnedFrame, N>) {
        let mut z = self.0.inner.lock();
        let n = tables.len();
        while let Some(t) = tables.pop() {
            z.free.push(t.into_frame().0);
        }
        z.free_count += n;
        z.freed_total += n as u64;
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Single,
    Batched,
}

/// `iters` rounds of: free `n` tables (per `mode`), take them back.
fn rounds(mode: Mode, n: usize, iters: usize) -> Duration {
    let zone = Zone::new();
    let mut tables: heapless::Vec<OwnedFrame, MAX_TABLES> = heapless::Vec::new();
    for i in 0..n {
        // SAFETY: one handle per made-up table frame, freed only through it.
        let _ = tables.push(unsafe { OwnedFrame::new(Frame(i as u64)) });
    }
    let start = Instant::now();
    for _ in 0..iters {
        match mode {
            Mode::Single => Looping(&zone).free_tables(black_box(&mut tables)),
            Mode::Batched => Batched(&zone).free_tables(black_box(&mut tables)),
        }
        zone.take_all(&mut tables);
    }
    let elapsed = start.elapsed();
    black_box(zone.inner.lock().freed_total);
    elapsed
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    let mode = arg("--mode");
    let tables: usize = arg("--tables")
        .and_then(|s| s.parse().ok())
        .unwrap_or(64)
        .clamp(1, MAX_TABLES);
    let iters: usize = arg("--iters").and_then(|s| s.parse().ok()).unwrap_or(10_000);
    match mode.as_deref() {
        Some("single") => drop(rounds(Mode::Single, tables, iters)),
        Some("batched") => drop(rounds(Mode::Batched, tables, iters)),
        _ => {
            println!("Freeing page-table frames: one call per table vs one batched call (zone spinlock)");
            println!("wall clock, both measured in this run, alternating, 5 rounds each\n");
            println!(
                "{:>7} {:>16} {:>16} {:>16}",
                "tables", "single ns/table", "batched ns/table", "batched/single"
            );
            for n in [1, 64, 512] {
                let iters = (2_000_000 / n).max(1000);
                let (mut single, mut batched) = (Duration::ZERO, Duration::ZERO);
                for _ in 0..5 {
                    single += rounds(Mode::Single, n, iters);
                    batched += rounds(Mode::Batched, n, iters);
                }
                let per = |d: Duration| d.as_nanos() as f64 / (5 * iters * n) as f64;
                println!(
                    "{:>7} {:>16.2} {:>16.2} {:>16.3}",
                    n,
                    per(single),
                    per(batched),
                    batched.as_secs_f64() / single.as_secs_f64()
                );
            }
        }
    }
}
