//! The atomics the crate's shared state is built from: `core`'s normally,
//! loom's in the crate's own unit-test harness built with `--cfg loom`
//! (`cfg(all(test, loom))`), so that the loom models of `src/loom/`
//! model-check the real shootdown protocol rather than a copy of it
//! (`scripts/loom.sh`).
//!
//! Only that harness: the plain library keeps `core`'s atomics under
//! `--cfg loom` as well (what a dependent crate builds, and what this
//! crate's integration tests and examples get through its dev-dependency
//! on itself), so loom is a dev-dependency and stays out of dependents'
//! lockfiles.
//!
//! loom's atomics have no `const fn new`, so constructors that kernels call
//! in `static`s are written once with `maybe_const_fn!` (a `const fn`
//! normally, a plain `fn` in the loom harness), and atomic arrays with
//! `atomic_array!`.

// The whole set is re-exported whether or not a module uses each one today
// (nothing uses `AtomicUsize` yet), so that new shared state picks its
// atomics from here.
#[cfg(all(test, loom))]
#[allow(unused_imports)]
pub(crate) use loom::sync::atomic::{
    fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering,
};

#[cfg(not(all(test, loom)))]
#[allow(unused_imports)]
pub(crate) use core::sync::atomic::{
    fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering,
};

/// Defines a function that is `const` in the normal build and a plain `fn`
/// in the loom harness (`cfg(all(test, loom))`), from one body.
macro_rules! maybe_const_fn {
    ($(#[$attr:meta])* $vis:vis fn $name:ident($($args:tt)*) -> $ret:ty $body:block) => {
        #[cfg(not(all(test, loom)))]
        $(#[$attr])*
        $vis const fn $name($($args)*) -> $ret $body

        #[cfg(all(test, loom))]
        $(#[$attr])*
        $vis fn $name($($args)*) -> $ret $body
    };
}

/// `[value; N]` for a non-`Copy` value such as an atomic: an inline `const`
/// block normally (usable in a `const fn`), `core::array::from_fn` in the
/// loom harness (`cfg(all(test, loom))`), where each element must be
/// created at run time inside the model.
#[cfg(not(all(test, loom)))]
macro_rules! atomic_array {
    ($value:expr; $len:expr) => {
        [const { $value }; $len]
    };
}

#[cfg(all(test, loom))]
macro_rules! atomic_array {
    ($value:expr; $len:expr) => {
        core::array::from_fn::<_, { $len }, _>(|_| $value)
    };
}

pub(crate) use {atomic_array, maybe_const_fn};
