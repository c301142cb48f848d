//! What one shootdown asks every target CPU to invalidate.

use crate::asid::Asid;
use crate::generation::GenStep;
use crate::page_size::PageSize;
use crate::pte::PAGE_SHIFT;
use crate::range::PageRange;
use crate::Error;

/// The most page ranges a request carries, and so the largest useful
/// [`Arch::FULL_FLUSH_CEILING`](crate::Arch::FULL_FLUSH_CEILING).
#[cfg(not(all(test, loom)))]
pub const MAX_FLUSH_ENTRIES: usize = 64;

/// In the loom harness (`cfg(all(test, loom))`) a request carries few
/// ranges, which keeps the request slots the model checker tracks small
/// (src/loom/).
#[cfg(all(test, loom))]
pub const MAX_FLUSH_ENTRIES: usize = 4;

/// The most distinct ASIDs a request names before it degrades to "flush
/// everything".
#[cfg(not(all(test, loom)))]
pub const MAX_FLUSH_ASIDS: usize = 8;

/// In the loom harness (`cfg(all(test, loom))`) a request names two ASIDs
/// (the models use at most two address spaces), which keeps the request
/// slots small.
#[cfg(all(test, loom))]
pub const MAX_FLUSH_ASIDS: usize = 2;

/// A run of consecutive pages of one address space, all of one size.
///
/// The receiving CPU invalidates once per page: at `start`, `start +
/// stride`, and so on, `pages` times. A page larger than 4 KiB (a huge
/// page, an arm64 block) needs one invalidation of any address inside it,
/// which removes its entry whatever size the TLB cached it at: on x86,
/// `INVLPG` "flushes all TLB entries for that page", every one of them
/// where the processor cached a large page as several smaller entries
/// (Intel SDM vol. 2, INVLPG, and vol. 3, 4.10.2.3); on arm64 a `TLBI` by
/// address removes the entries that translate that address, a block's
/// included (Arm ARM DDI 0487, "TLB maintenance instructions").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlushRange {
    /// The address space.
    pub asid: Asid,
    /// The first page's virtual address (aligned to `stride`).
    pub start: u64,
    /// How many pages of `stride` bytes, at least one.
    pub pages: u32,
    /// The size of each page, and so the distance between invalidations.
    pub stride: PageSize,
}

impl FlushRange {
    /// The addresses the receiving CPU invalidates, one per page.
    pub fn addresses(&self) -> impl Iterator<Item = u64> {
        let (start, stride) = (self.start, self.stride.bytes());
        (0..u64::from(self.pages)).map(move |i| start + i * stride)
    }

    /// The base pages it covers, as a [`PageRange`] (`None` for an empty
    /// range, or one that runs past the top of the address space, which a
    /// request never holds).
    pub(crate) fn covered(&self) -> Option<PageRange> {
        let base = u64::from(self.pages).checked_mul(self.stride.base_pages())?;
        PageRange::new(self.start, base).ok()
    }
}

/// Pages of one size that one change made stale: the 4 KiB units of
/// `range`, flushed at a stride of `size` (one invalidation per page of
/// that size), and whether `size` is the size of the leaf entries that
/// mapped them, as the page table reported it (what a level hint may say,
/// [`Arch::flush_local_page_sized`](crate::Arch::flush_local_page_sized)).
/// Built aligned, so adding it never fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pages {
    range: PageRange,
    size: PageSize,
    leaf: bool,
}

impl Pages {
    /// The pages of `size` that `range` covers, of entries of unknown
    /// size. Errors: [`Error::StrideUnaligned`] when `range` does not
    /// start and end on a `size` boundary.
    pub(crate) fn new(range: PageRange, size: PageSize) -> Result<Self, Error> {
        let aligned = size.align_down(range.start()) == range.start()
            && range.pages().is_multiple_of(size.base_pages());
        if !aligned {
            return Err(Error::StrideUnaligned {
                start: range.start(),
                pages: range.pages(),
                stride: size.bytes(),
            });
        }
        Ok(Pages {
            range,
            size,
            leaf: false,
        })
    }

    /// The page of `size` whose first address is `va`. Errors: those of
    /// [`new`](Self::new), and of [`PageRange::new`] for a page that runs
    /// past the top.
    pub(crate) fn one(va: u64, size: PageSize) -> Result<Self, Error> {
        Pages::new(PageRange::new(va, size.base_pages())?, size)
    }

    /// The same pages, whose leaf entries the page table reported to be
    /// of their size.
    pub(crate) fn leaf(self) -> Self {
        Pages { leaf: true, ..self }
    }

    /// The leaf size to tell the hardware, if known.
    pub(crate) fn hint(self) -> Option<PageSize> {
        self.leaf.then_some(self.size)
    }

    /// The address of each page, one per stride.
    pub(crate) fn addresses(self) -> impl Iterator<Item = u64> {
        let stride = self.size.bytes();
        (0..self.range.pages() / self.size.base_pages()).map(move |i| self.range.start() + i * stride)
    }
}

const EMPTY_RANGE: FlushRange = FlushRange {
    asid: Asid::KERNEL,
    start: 0,
    pages: 0,
    stride: PageSize::SIZE_4K,
};

/// What a request covers, as the receiving CPU sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlushScope<'a> {
    /// These pages, one invalidation each.
    Ranges(&'a [FlushRange]),
    /// Every non-global entry of these ASIDs; every entry at all when one of
    /// them is [`Asid::KERNEL`].
    Asids(&'a [Asid]),
    /// Every entry of every ASID; global ones too when `include_global`.
    Everything {
        /// Whether global (kernel) entries are flushed too.
        include_global: bool,
    },
}

/// A set of TLB entries to invalidate: up to a ceiling of single pages, then
/// whole ASIDs, then everything. It never grows: memory is O(1) whatever
/// number of pages is added.
#[derive(Clone, Debug)]
pub struct FlushRequest {
    ranges: [FlushRange; MAX_FLUSH_ENTRIES],
    nr_ranges: usize,
    pages: usize,
    asids: [Asid; MAX_FLUSH_ASIDS],
    /// For each of `asids`, the generation step its pages cover, when
    /// every page of that ASID came from one flush's advance or from
    /// advances that followed each other with nothing between.
    steps: [Option<GenStep>; MAX_FLUSH_ASIDS],
    nr_asids: usize,
    too_many_asids: bool,
    has_kernel: bool,
    full: bool,
    extent: Extent,
    /// Whether some page was added without the size of its leaf entry
    /// known, or the request also covers a page table that is freed: then
    /// no invalidation of it may carry a level hint
    /// ([`leaf_hints`](Self::leaf_hints)).
    unhinted: bool,
}

/// Where the pages ever added to a request lie, kept past its degrading to
/// a full flush so that [`check_request`](crate::check_request) can still
/// refuse addresses a machine does not have: the highest last page of the
/// ranges that start in the lower half (top bit clear), and the lowest
/// start of those in the upper half. A range that starts in the lower half
/// and ends in the upper one crosses the hole of any machine with fewer
/// than 64 address bits, which the first bound then shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Extent {
    pub(crate) lower_last: Option<u64>,
    pub(crate) upper_start: Option<u64>,
}

impl Extent {
    const EMPTY: Extent = Extent {
        lower_last: None,
        upper_start: None,
    };

    fn union(&mut self, other: Extent) {
        if let Some(last) = other.lower_last {
            self.note(0, last);
        }
        if let Some(start) = other.upper_start {
            self.note(start, start);
        }
    }

    fn note(&mut self, start: u64, last: u64) {
        if start >> 63 == 0 {
            self.lower_last = Some(self.lower_last.map_or(last, |l| l.max(last)));
        } else {
            self.upper_start = Some(self.upper_start.map_or(start, |s| s.min(start)));
        }
    }
}

impl Default for FlushRequest {
    fn default() -> Self {
        FlushRequest::new()
    }
}

impl FlushRequest {
    /// An empty request.
    pub const fn new() -> Self {
        FlushRequest {
            ranges: [EMPTY_RANGE; MAX_FLUSH_ENTRIES],
            nr_ranges: 0,
            pages: 0,
            asids: [Asid::KERNEL; MAX_FLUSH_ASIDS],
            steps: [None; MAX_FLUSH_ASIDS],
            nr_asids: 0,
            too_many_asids: false,
            has_kernel: false,
            full: false,
            extent: Extent::EMPTY,
            unhinted: false,
        }
    }

    /// A request to flush every entry of `asid`.
    pub fn for_asid(asid: Asid) -> Self {
        let mut req = FlushRequest::new();
        req.add_asid(asid);
        req
    }

    /// Whether nothing is requested.
    pub fn is_empty(&self) -> bool {
        self.nr_asids == 0 && !self.too_many_asids
    }

    /// Pages added so far, each counted once whatever its size (the
    /// invalidations its ranges ask for; also counted after the request
    /// degraded to a full flush).
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// Whether the request became a full flush of its ASIDs or of
    /// everything.
    pub fn is_full(&self) -> bool {
        self.full
    }

    /// Forgets everything requested.
    pub fn clear(&mut self) {
        self.nr_ranges = 0;
        self.pages = 0;
        self.nr_asids = 0;
        self.too_many_asids = false;
        self.has_kernel = false;
        self.full = false;
        self.extent = Extent::EMPTY;
        self.unhinted = false;
    }

    /// Whether each page's invalidation may tell the hardware its range's
    /// stride as the size of the leaf entry that mapped it: true when the
    /// crate learned every page's leaf size from the page table
    /// ([`PageTable::entry_size`](crate::PageTable::entry_size)) and no
    /// page table is freed under the request. A range added through the
    /// public [`add_range`](Self::add_range) or
    /// [`add_huge_range`](Self::add_huge_range) turns it off: the crate
    /// cannot tell what those pages were mapped by.
    pub fn leaf_hints(&self) -> bool {
        !self.unhinted
    }

    /// Turns the level hints off for the whole request (a page table goes
    /// with it: a hint would name a leaf level, and walk-cache entries of
    /// the freed table may then stay cached).
    pub(crate) fn forbid_leaf_hints(&mut self) {
        self.unhinted = true;
    }

    /// Turns the level hints back on (a request rebuilt from a request
    /// slot whose sender allowed them).
    pub(crate) fn allow_leaf_hints(&mut self) {
        self.unhinted = false;
    }

    fn note_asid(&mut self, asid: Asid) {
        self.note_asid_step(asid, None);
    }

    /// Names `asid`, whose pages added now come with `step` (`None`: not
    /// known). An ASID keeps a step only while each addition's step starts
    /// where the previous one ended.
    fn note_asid_step(&mut self, asid: Asid, step: Option<GenStep>) {
        self.has_kernel |= asid.is_kernel();
        if self.too_many_asids {
            return;
        }
        if let Some(i) = self.asids[..self.nr_asids].iter().position(|&a| a == asid) {
            self.steps[i] = match (self.steps[i], step) {
                (Some(before), Some(now)) => before.then(now),
                _ => None,
            };
            return;
        }
        if self.nr_asids < MAX_FLUSH_ASIDS {
            self.asids[self.nr_asids] = asid;
            self.steps[self.nr_asids] = step;
            self.nr_asids += 1;
        } else {
            self.too_many_asids = true;
        }
    }

    /// The generation steps of the ASIDs whose pages this request covers
    /// (see [`add_range_step`](Self::add_range_step)); only meaningful
    /// while the request flushes single pages.
    pub(crate) fn steps(&self) -> impl Iterator<Item = (Asid, GenStep)> + '_ {
        self.asids[..self.nr_asids]
            .iter()
            .zip(&self.steps)
            .filter_map(|(&a, s)| s.map(|s| (a, s)))
    }

    /// Sets the step of `asid`, already named (rebuilding a request from
    /// a request slot).
    pub(crate) fn set_step(&mut self, asid: Asid, step: GenStep) {
        if let Some(i) = self.asids[..self.nr_asids].iter().position(|&a| a == asid) {
            self.steps[i] = Some(step);
        }
    }

    fn degrade(&mut self) {
        self.full = true;
        self.nr_ranges = 0;
    }

    /// Adds the pages of `range` in `asid`. Past `ceiling` pages in all
    /// (capped at [`MAX_FLUSH_ENTRIES`]) the request degrades to a full flush
    /// of its ASIDs. Cannot fail: a [`PageRange`] is valid by construction.
    /// Whether its addresses exist on a machine is checked when the request
    /// is sent ([`check_request`](crate::check_request)), after a degrade
    /// too: a request that was ever given a range a machine cannot address
    /// is refused by that machine.
    pub fn add_range(&mut self, asid: Asid, range: PageRange, ceiling: usize) {
        self.add_range_step(asid, range, ceiling, None);
    }

    /// [`add_range`](Self::add_range) for pages whose PTEs were cleared
    /// before `step`, the advance of their address space's generation
    /// made for this flush (`None`: not known). A CPU that carries out the
    /// request's page flushes then counts as caught up to the step's end
    /// when it was caught up to its start.
    pub(crate) fn add_range_step(
        &mut self,
        asid: Asid,
        range: PageRange,
        ceiling: usize,
        step: Option<GenStep>,
    ) {
        self.add_pages(asid, range, PageSize::SIZE_4K, ceiling, step);
        self.unhinted = true;
    }

    /// Adds the pages of `range` in `asid` at the stride of `base`, the
    /// architecture's base page ([`Arch::base_page`](crate::Arch::base_page)),
    /// for pages of unknown leaf size; a range that is not whole base
    /// pages (which the entry points refuse before they get here) makes
    /// the request a flush of the whole ASID rather than leave a piece.
    pub(crate) fn add_base_range_step(
        &mut self,
        asid: Asid,
        range: PageRange,
        base: PageSize,
        ceiling: usize,
        step: Option<GenStep>,
    ) {
        match Pages::new(range, base) {
            Ok(pages) => self.add_pages_step(asid, pages, ceiling, step),
            Err(_) => {
                self.unhinted = true;
                self.add_asid(asid);
            }
        }
    }

    /// Adds the pages of `stride` bytes that `range` covers in `asid`: one
    /// invalidation each ([`FlushRange`] says why one is enough for a huge
    /// page), counted once each against `ceiling`, past which the request
    /// degrades to a full flush of its ASIDs as with
    /// [`add_range`](Self::add_range). For the huge pages of a range a
    /// kernel unmapped or changed, whose entries are 2 MiB or 1 GiB
    /// ([`PageTable::entry_size`](crate::PageTable::entry_size)).
    ///
    /// Errors, with nothing added: [`Error::StrideUnaligned`] when `range` does
    /// not start and end on a `stride` boundary. A range of 4 KiB pages
    /// flushed at a larger stride would leave all but one entry of each
    /// stride cached, so it is refused rather than rounded.
    pub fn add_huge_range(
        &mut self,
        asid: Asid,
        range: PageRange,
        stride: PageSize,
        ceiling: usize,
    ) -> Result<(), Error> {
        self.add_huge_range_step(asid, range, stride, ceiling, None)
    }

    /// [`add_huge_range`](Self::add_huge_range) with the generation step of
    /// [`add_range_step`](Self::add_range_step).
    pub(crate) fn add_huge_range_step(
        &mut self,
        asid: Asid,
        range: PageRange,
        stride: PageSize,
        ceiling: usize,
        step: Option<GenStep>,
    ) -> Result<(), Error> {
        self.add_pages_step(asid, Pages::new(range, stride)?, ceiling, step);
        Ok(())
    }

    /// Adds `pages` (see [`add_range_step`](Self::add_range_step) for
    /// `step`); `Pages` is aligned to its size by construction.
    pub(crate) fn add_pages_step(&mut self, asid: Asid, pages: Pages, ceiling: usize, step: Option<GenStep>) {
        self.unhinted |= !pages.leaf;
        self.add_pages(asid, pages.range, pages.size, ceiling, step);
    }

    /// Adds `range` as pages of `stride` bytes; `range` is aligned to it.
    fn add_pages(
        &mut self,
        asid: Asid,
        range: PageRange,
        stride: PageSize,
        ceiling: usize,
        step: Option<GenStep>,
    ) {
        let Some(last) = range.last() else {
            return;
        };
        self.extent.note(range.start(), last);
        self.note_asid_step(asid, step);
        let count = range.pages() >> (stride.shift() - PAGE_SHIFT);
        self.pages = self
            .pages
            .saturating_add(usize::try_from(count).unwrap_or(usize::MAX));
        if self.full {
            return;
        }
        let ceiling = ceiling.min(MAX_FLUSH_ENTRIES);
        if self.pages > ceiling {
            self.degrade();
            return;
        }
        // `count` <= ceiling <= MAX_FLUSH_ENTRIES here, so it fits in u32.
        let count = count as u32;
        let start = range.start();
        if let Some(last) = self.nr_ranges.checked_sub(1).map(|i| &mut self.ranges[i]) {
            // Subtracting, not adding: a range that ends at the top of the
            // address space has no end address.
            let follows = start
                .checked_sub(last.start)
                .is_some_and(|gap| gap == u64::from(last.pages) * last.stride.bytes());
            if last.asid == asid && last.stride == stride && follows {
                last.pages += count;
                return;
            }
        }
        if self.nr_ranges == MAX_FLUSH_ENTRIES {
            self.degrade();
            return;
        }
        self.ranges[self.nr_ranges] = FlushRange {
            asid,
            start,
            pages: count,
            stride,
        };
        self.nr_ranges += 1;
    }

    /// Adds the single page at `va` of `asid` (see [`add_range`](Self::add_range)).
    /// Errors: [`Error::Unaligned`] (nothing changes).
    pub fn add_page(&mut self, asid: Asid, va: u64, ceiling: usize) -> Result<(), Error> {
        self.add_range(asid, PageRange::page(va)?, ceiling);
        Ok(())
    }

    /// Asks for every entry of `asid` to be flushed.
    pub fn add_asid(&mut self, asid: Asid) {
        self.note_asid(asid);
        self.degrade();
    }

    /// Asks for every entry of every ASID, global ones included, to be
    /// flushed.
    pub fn add_everything(&mut self) {
        self.has_kernel = true;
        self.too_many_asids = true;
        self.degrade();
    }

    /// Adds everything `other` asks for (ranges page by page, up to
    /// `ceiling` pages in all, as [`add_range`](Self::add_range) does).
    pub(crate) fn merge(&mut self, other: &FlushRequest, ceiling: usize) {
        self.extent.union(other.extent);
        self.unhinted |= other.unhinted;
        match other.scope() {
            FlushScope::Ranges(ranges) => {
                for r in ranges {
                    // Every range of a request was a valid `PageRange`,
                    // aligned to its stride.
                    if let Some(range) = r.covered() {
                        self.add_pages(r.asid, range, r.stride, ceiling, None);
                    }
                }
            }
            FlushScope::Asids(asids) => asids.iter().for_each(|&a| self.add_asid(a)),
            FlushScope::Everything { include_global } => {
                self.too_many_asids = true;
                self.has_kernel |= include_global;
                self.degrade();
            }
        }
    }

    /// Whether the request names the kernel's address space (whose entries
    /// are global: flushing every ASID's non-global entries misses them).
    pub(crate) fn names_kernel(&self) -> bool {
        self.has_kernel
    }

    /// Whether the request named more ASIDs than it tells apart (then
    /// [`asids`](Self::asids) is incomplete).
    pub(crate) fn has_too_many_asids(&self) -> bool {
        self.too_many_asids
    }

    /// Where the pages ever added lie (see [`Extent`]).
    pub(crate) fn extent(&self) -> Extent {
        self.extent
    }

    /// Every ASID the request names (at most [`MAX_FLUSH_ASIDS`]; a
    /// request that named more became a flush of everything).
    pub fn asids(&self) -> &[Asid] {
        &self.asids[..self.nr_asids]
    }

    /// What the request covers.
    pub fn scope(&self) -> FlushScope<'_> {
        if !self.full {
            FlushScope::Ranges(&self.ranges[..self.nr_ranges])
        } else if self.too_many_asids {
            FlushScope::Everything {
                include_global: self.has_kernel,
            }
        } else {
            FlushScope::Asids(&self.asids[..self.nr_asids])
        }
    }

    /// A request of `scope`, without level hints (see
    /// [`allow_leaf_hints`](Self::allow_leaf_hints)).
    pub(crate) fn from_parts(scope: FlushScope<'_>) -> Self {
        let mut req = FlushRequest::new();
        req.unhinted = true;
        match scope {
            FlushScope::Ranges(ranges) => {
                let n = ranges.len().min(MAX_FLUSH_ENTRIES);
                req.ranges[..n].copy_from_slice(&ranges[..n]);
                req.nr_ranges = n;
                for r in &ranges[..n] {
                    req.note_asid(r.asid);
                    req.pages += r.pages as usize;
                }
            }
            FlushScope::Asids(asids) => {
                for &a in asids {
                    req.add_asid(a);
                }
            }
            FlushScope::Everything { include_global } => {
                req.add_everything();
                req.has_kernel = include_global;
            }
        }
        req
    }
}

#[cfg(test)]
#[path = "request_tests.rs"]
mod tests;
