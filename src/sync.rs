//! The atomics the crate's shared state is built from: `core`'s normally,
//! loom's under `--cfg loom`, so that `tests/loom_*.rs` model-check the real
//! shootdown protocol rather than a copy of it (`scripts/loom.sh`).
//!
//! loom's atomics have no `const fn new`, so constructors that kernels call
//! in `static`s are written once with `maybe_const_fn!` (a `const fn`
//! normally, a plain `fn` under loom), and atomic arrays with
//! `atomic_array!`.

// The whole set is re-exported whether or not a module uses each one today
// (nothing uses `AtomicUsize` yet), so that new shared state picks its
// atomics from here.
#[cfg(loom)]
#[allow(unused_imports)]
pub(crate) use loom::sync::atomic::{
    fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering,
};

#[cfg(not(loom))]
#[allow(unused_imports)]
pub(crate) use core::sync::atomic::{
    fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering,
};

/// Defines a function that is `const` in the normal build and a plain `fn`
/// under `--cfg loom`, from one body.
macro_rules! maybe_const_fn {
    ($(#[$attr:meta])* $vis:vis fn $name:ident($($args:tt)*) -> $ret:ty $body:block) => {
        #[cfg(not(loom))]
        $(#[$attr])*
        $vis const fn $name($($args)*) -> $ret $body

        #[cfg(loom)]
        $(#[$attr])*
        $vis fn $name($($args)*) -> $ret $body
    };
}

/// `[value; N]` for a non-`Copy` value such as an atomic: an inline `const`
/// block normally (usable in a `const fn`), `core::array::from_fn` under
/// `--cfg loom`, where each element must be created at run time inside the
/// model.
#[cfg(not(loom))]
macro_rules! atomic_array {
    ($value:expr; $len:expr) => {
        [const { $value }; $len]
    };
}

#[cfg(loom)]
macro_rules! atomic_array {
    ($value:expr; $len:expr) => {
        core::array::from_fn::<_, { $len }, _>(|_| $value)
    };
}

pub(crate) use {atomic_array, maybe_const_fn};
