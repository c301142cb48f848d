//! loom model checks of the shootdown protocol, the address spaces' fences
//! and the frame pool, as unit tests of the crate (`scripts/loom.sh`:
//! `RUSTFLAGS="--cfg loom" cargo test --release --lib loom::`).
//!
//! They are compiled only in the crate's own test harness built with
//! `--cfg loom` (`cfg(all(test, loom))`), the one build in which the
//! crate's atomics are loom's (`src/sync.rs`): the models run the real
//! `shootdown`, `switch_mm`, `FramePool` and the rest, not a copy. Every
//! other build, the plain library that dependents and this crate's
//! integration tests link included, keeps `core`'s atomics, which is why
//! loom is only a dev-dependency.
//!
//! - `machine.rs`: the model machine, simulated CPUs with an `Arch` of
//!   their own, and the bounds the models run under;
//! - `run.rs`: a model's CPUs on loom threads, its preemption bound, and
//!   the checks the shootdown models end with;
//! - `shootdown.rs`: models (a) to (d) and (offline), the shootdown
//!   protocol itself;
//! - `mm.rs`: models (e) to (g), (j), (k) and (m) to (o), an address space's
//!   fences;
//! - `pool.rs`: models (h), (h'), (h''), (i) and (l), the frame pool's
//!   epochs and passes;
//! - `tables.rs`: models (p') and (p''), page tables held for lazy CPUs
//!   (`TableHold`).

mod machine;
mod run;

mod mm;
mod pool;
mod shootdown;
mod tables;
