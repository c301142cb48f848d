//! CPU identifiers and fixed-size CPU sets, plain and atomic.
//!
//! Neither set allocates: both are [`MAX_CPUS`] bits wide, stored inline.

use core::fmt;

use crate::sync::{atomic_array, maybe_const_fn, AtomicU64, Ordering};
use crate::Error;

/// The number of CPUs a [`CpuSet`] can name. CPU indices run from 0 to
/// `MAX_CPUS - 1`.
#[cfg(not(any(miri, all(test, loom))))]
pub const MAX_CPUS: usize = 256;

/// Under Miri, 128 CPUs: the interpreter builds and scans every CPU's
/// shootdown slot, which at 256 takes about twice as long in each test
/// that makes a machine (scripts/miri.sh); two words keep the sets'
/// cross-word paths.
#[cfg(all(miri, not(all(test, loom))))]
pub const MAX_CPUS: usize = 128;

/// In the loom harness (`cfg(all(test, loom))`) one word of CPUs keeps the
/// state the model checker tracks small (src/loom/).
#[cfg(all(test, loom))]
pub const MAX_CPUS: usize = 64;

const WORDS: usize = MAX_CPUS / 64;

static_assertions::const_assert_eq!(MAX_CPUS % 64, 0);
static_assertions::const_assert!(MAX_CPUS <= u16::MAX as usize);

/// The index of one CPU, known to be below [`MAX_CPUS`].
///
/// The only way to build one from an arbitrary number is [`CpuId::new`],
/// which checks the range, so every `CpuId` can index a [`CpuSet`] safely.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CpuId(u16);

impl CpuId {
    /// CPU 0, the boot CPU by convention.
    pub const BOOT: CpuId = CpuId(0);

    /// The CPU with this index, or [`Error::CpuOutOfRange`] when `index` is
    /// `MAX_CPUS` or more.
    pub const fn new(index: usize) -> Result<Self, Error> {
        if index < MAX_CPUS {
            Ok(CpuId(index as u16))
        } else {
            Err(Error::CpuOutOfRange {
                cpu: index,
                limit: MAX_CPUS,
            })
        }
    }

    /// This CPU's index, below [`MAX_CPUS`].
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Debug for CpuId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cpu{}", self.0)
    }
}

impl fmt::Display for CpuId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

const fn split(cpu: CpuId) -> (usize, u64) {
    (cpu.index() / 64, 1u64 << (cpu.index() % 64))
}

/// A set of CPUs: a [`MAX_CPUS`]-bit bitmap, `Copy`, no allocation.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CpuSet {
    words: [u64; WORDS],
}

impl CpuSet {
    /// The empty set.
    pub const fn new() -> Self {
        CpuSet { words: [0; WORDS] }
    }

    /// CPUs `0..count`, or [`Error::CpuOutOfRange`] when `count` exceeds
    /// [`MAX_CPUS`].
    pub fn first(count: usize) -> Result<Self, Error> {
        if count > MAX_CPUS {
            return Err(Error::CpuOutOfRange {
                cpu: count - 1,
                limit: MAX_CPUS,
            });
        }
        let mut set = CpuSet::new();
        for (i, word) in set.words.iter_mut().enumerate() {
            let lo = i * 64;
            if count >= lo + 64 {
                *word = u64::MAX;
            } else if count > lo {
                *word = (1u64 << (count - lo)) - 1;
            }
        }
        Ok(set)
    }

    /// The set holding `cpu` alone.
    pub fn single(cpu: CpuId) -> Self {
        let mut set = CpuSet::new();
        set.insert(cpu);
        set
    }

    /// Adds `cpu`; returns whether it was absent before.
    pub fn insert(&mut self, cpu: CpuId) -> bool {
        let (w, bit) = split(cpu);
        let absent = self.words[w] & bit == 0;
        self.words[w] |= bit;
        absent
    }

    /// Removes `cpu`; returns whether it was present before.
    pub fn remove(&mut self, cpu: CpuId) -> bool {
        let (w, bit) = split(cpu);
        let present = self.words[w] & bit != 0;
        self.words[w] &= !bit;
        present
    }

    /// Whether `cpu` is in the set.
    pub fn contains(&self, cpu: CpuId) -> bool {
        let (w, bit) = split(cpu);
        self.words[w] & bit != 0
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// The number of CPUs in the set.
    pub fn len(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The CPUs in either set.
    #[must_use]
    pub fn union(&self, other: &CpuSet) -> CpuSet {
        self.zip(other, |a, b| a | b)
    }

    /// The CPUs in both sets.
    #[must_use]
    pub fn intersection(&self, other: &CpuSet) -> CpuSet {
        self.zip(other, |a, b| a & b)
    }

    /// The CPUs in `self` but not in `other`.
    #[must_use]
    pub fn difference(&self, other: &CpuSet) -> CpuSet {
        self.zip(other, |a, b| a & !b)
    }

    fn zip(&self, other: &CpuSet, op: impl Fn(u64, u64) -> u64) -> CpuSet {
        let mut out = CpuSet::new();
        for (i, word) in out.words.iter_mut().enumerate() {
            *word = op(self.words[i], other.words[i]);
        }
        out
    }

    /// The CPUs of the set in ascending order.
    pub fn iter(&self) -> CpuSetIter {
        CpuSetIter {
            words: self.words,
            word: 0,
        }
    }
}

impl fmt::Debug for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl FromIterator<CpuId> for CpuSet {
    fn from_iter<I: IntoIterator<Item = CpuId>>(iter: I) -> Self {
        let mut set = CpuSet::new();
        for cpu in iter {
            set.insert(cpu);
        }
        set
    }
}

impl IntoIterator for &CpuSet {
    type Item = CpuId;
    type IntoIter = CpuSetIter;
    fn into_iter(self) -> CpuSetIter {
        self.iter()
    }
}

/// Iterator over the CPUs of a [`CpuSet`], in ascending order.
#[derive(Clone, Debug)]
pub struct CpuSetIter {
    words: [u64; WORDS],
    word: usize,
}

impl Iterator for CpuSetIter {
    type Item = CpuId;

    fn next(&mut self) -> Option<CpuId> {
        while self.word < WORDS {
            let w = self.words[self.word];
            if w != 0 {
                let bit = w.trailing_zeros() as usize;
                self.words[self.word] &= w - 1;
                // The index is below WORDS * 64 == MAX_CPUS, so it fits.
                return Some(CpuId((self.word * 64 + bit) as u16));
            }
            self.word += 1;
        }
        None
    }
}

/// A [`CpuSet`] that several CPUs update at once.
///
/// Each single-CPU operation is one atomic read-modify-write. A [`load`]
/// or [`take`] of the whole set reads word by word, so it is not a
/// snapshot across words; every user in this crate tolerates that (a bit
/// set concurrently is either seen now or seen by the next reader).
///
/// [`load`]: AtomicCpuSet::load
/// [`take`]: AtomicCpuSet::take
pub struct AtomicCpuSet {
    words: [AtomicU64; WORDS],
}

impl AtomicCpuSet {
    maybe_const_fn! {
        /// The empty set, usable in a `static`.
        pub fn new() -> Self {
            AtomicCpuSet {
                words: atomic_array![AtomicU64::new(0); WORDS],
            }
        }
    }

    /// Adds `cpu`; returns whether it was absent before.
    pub fn insert(&self, cpu: CpuId, order: Ordering) -> bool {
        let (w, bit) = split(cpu);
        self.words[w].fetch_or(bit, order) & bit == 0
    }

    /// Removes `cpu`; returns whether it was present before.
    pub fn remove(&self, cpu: CpuId, order: Ordering) -> bool {
        let (w, bit) = split(cpu);
        self.words[w].fetch_and(!bit, order) & bit != 0
    }

    /// Whether `cpu` is in the set.
    pub fn contains(&self, cpu: CpuId, order: Ordering) -> bool {
        let (w, bit) = split(cpu);
        self.words[w].load(order) & bit != 0
    }

    /// The set's current members (word by word, see the type's docs).
    pub fn load(&self, order: Ordering) -> CpuSet {
        let mut set = CpuSet::new();
        for (out, word) in set.words.iter_mut().zip(&self.words) {
            *out = word.load(order);
        }
        set
    }

    /// Empties the set and returns what it held (each word swapped
    /// atomically, so no member is lost or returned twice).
    pub fn take(&self, order: Ordering) -> CpuSet {
        let mut set = CpuSet::new();
        for (out, word) in set.words.iter_mut().zip(&self.words) {
            *out = word.swap(0, order);
        }
        set
    }

    /// Adds every member of `set`.
    pub fn insert_all(&self, set: &CpuSet, order: Ordering) {
        for (word, &bits) in self.words.iter().zip(&set.words) {
            if bits != 0 {
                word.fetch_or(bits, order);
            }
        }
    }
}

impl Default for AtomicCpuSet {
    fn default() -> Self {
        AtomicCpuSet::new()
    }
}

impl fmt::Debug for AtomicCpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.load(Ordering::Relaxed).fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    fn cpu(i: usize) -> CpuId {
        CpuId::new(i).unwrap()
    }

    #[test]
    fn out_of_range_ids_are_errors() {
        assert_eq!(
            CpuId::new(MAX_CPUS),
            Err(Error::CpuOutOfRange {
                cpu: MAX_CPUS,
                limit: MAX_CPUS
            })
        );
        assert!(CpuSet::first(MAX_CPUS + 1).is_err());
        assert_eq!(CpuId::new(MAX_CPUS - 1).unwrap().index(), MAX_CPUS - 1);
    }

    #[test]
    fn set_operations_cross_word_boundaries() {
        let a: CpuSet = [0, 63, 64, 100].into_iter().map(cpu).collect();
        let b = CpuSet::first(65).unwrap();
        assert_eq!(b.len(), 65);
        assert_eq!(
            a.intersection(&b).iter().map(CpuId::index).collect::<Vec<_>>(),
            [0, 63, 64]
        );
        assert_eq!(
            a.difference(&b).iter().map(CpuId::index).collect::<Vec<_>>(),
            [100]
        );
        assert_eq!(a.union(&b).len(), 66);
        assert_eq!(CpuSet::first(MAX_CPUS).unwrap().len(), MAX_CPUS);
        assert!(CpuSet::first(0).unwrap().is_empty());
    }

    #[test]
    fn atomic_take_empties_and_reports_prior_membership() {
        let s = AtomicCpuSet::new();
        assert!(s.insert(cpu(5), Ordering::SeqCst));
        assert!(!s.insert(cpu(5), Ordering::SeqCst));
        assert!(s.insert(cpu(100), Ordering::SeqCst));
        let got = s.take(Ordering::SeqCst);
        assert_eq!(got.iter().map(CpuId::index).collect::<Vec<_>>(), [5, 100]);
        assert!(s.load(Ordering::SeqCst).is_empty());
        assert!(!s.remove(cpu(5), Ordering::SeqCst));
    }
}
