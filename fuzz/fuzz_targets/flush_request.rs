//! Builds a `FlushRequest` from arbitrary additions (pages, ranges, huge
//! pages at their stride, whole ASIDs, clears, any ceiling) and checks that
//! what it asks the CPUs to flush covers every page added, at the stride it
//! was added with, never exceeds the ceiling in invalidations, and that bad
//! input is refused without a change.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tlb_batch::{Asid, FlushRequest, FlushScope, PageRange, PageSize, MAX_FLUSH_ENTRIES, PAGE_SIZE};

#[derive(Arbitrary, Debug)]
enum Add {
    Page {
        asid: u8,
        page: u16,
        offset: u8,
    },
    Range {
        asid: u8,
        first: u16,
        pages: u8,
        backwards: bool,
    },
    /// `pages` pages ending at the last page of the address space.
    AtTop {
        asid: u8,
        pages: u8,
    },
    /// `count` huge pages (2 MiB, or 1 GiB when `gib`) from huge page
    /// `first`, `skew` 4 KiB pages off their boundary (0: aligned).
    Huge {
        asid: u8,
        first: u8,
        count: u8,
        gib: bool,
        skew: u8,
    },
    /// `count` pages of size `size` (4 KiB, 2 MiB or 1 GiB) right after
    /// the end of the last addition, aligned up to the size: ranges of two
    /// strides that touch, which must never be joined.
    Follow {
        asid: u8,
        count: u8,
        size: u8,
    },
    WholeAsid {
        asid: u8,
    },
    Clear,
}

/// The last page of the 64-bit address space.
const TOP: u64 = !(PAGE_SIZE - 1);

fn asid(v: u8) -> Asid {
    // 255 stands for the kernel's address space.
    if v == 255 {
        Asid::KERNEL
    } else {
        // 0 is reserved: it stands for 1.
        Asid::new(u16::from(v).max(1)).unwrap_or(Asid::KERNEL)
    }
}

#[derive(Arbitrary, Debug)]
struct Input {
    ceiling: u8,
    adds: Vec<Add>,
}

/// Whether `req` flushes the page at `va` of `a`, added at `size`: one of
/// its ranges of that stride covers it. A page added at 4 KiB is not
/// covered by a range of a larger stride (its neighbours' invalidations
/// would not reach it), and a huge page not by 4 KiB ranges.
fn covered(req: &FlushRequest, a: Asid, va: u64, size: PageSize) -> bool {
    match req.scope() {
        FlushScope::Ranges(ranges) => ranges.iter().any(|r| {
            // Subtracting: a range at the top of the address space has no end.
            r.asid == a
                && r.stride == size
                && va >= r.start
                && va - r.start < u64::from(r.pages) * r.stride.bytes()
                && r.start % r.stride.bytes() == 0
        }),
        FlushScope::Asids(asids) => asids.contains(&a) || asids.contains(&Asid::KERNEL),
        FlushScope::Everything { include_global } => include_global || !a.is_kernel(),
    }
}

fuzz_target!(|input: Input| {
    let ceiling = usize::from(input.ceiling);
    let mut req = FlushRequest::new();
    let mut added: Vec<(Asid, u64, PageSize)> = Vec::new();
    let mut invalidations = 0usize;
    // Where the last addition ended.
    let mut next = 0u64;
    let mut whole: Vec<Asid> = Vec::new();
    for add in input.adds {
        match add {
            Add::Page {
                asid: a,
                page,
                offset,
            } => {
                let va = u64::from(page) * PAGE_SIZE + u64::from(offset % 2);
                let before = req.pages();
                match req.add_page(asid(a), va, ceiling) {
                    Ok(()) => {
                        added.push((asid(a), va, PageSize::SIZE_4K));
                        invalidations += 1;
                        next = va + PAGE_SIZE;
                    }
                    Err(_) => assert!(va % PAGE_SIZE != 0 && req.pages() == before),
                }
            }
            Add::Range {
                asid: a,
                first,
                pages,
                backwards,
            } => {
                let start = u64::from(first) * PAGE_SIZE;
                let end = start + u64::from(pages) * PAGE_SIZE;
                let (s, e) = if backwards { (end, start) } else { (start, end) };
                match PageRange::from_bounds(s, e) {
                    Ok(range) => {
                        req.add_range(asid(a), range, ceiling);
                        added.extend(range.iter().map(|va| (asid(a), va, PageSize::SIZE_4K)));
                        invalidations += range.pages() as usize;
                        next = range.start() + range.pages() * PAGE_SIZE;
                    }
                    Err(_) => assert!(s > e),
                }
            }
            Add::AtTop { asid: a, pages } => {
                let pages = u64::from(pages);
                let range = PageRange::new(TOP - pages.saturating_sub(1) * PAGE_SIZE, pages)
                    .expect("a range that ends at the top page fits");
                req.add_range(asid(a), range, ceiling);
                added.extend(range.iter().map(|va| (asid(a), va, PageSize::SIZE_4K)));
                invalidations += range.pages() as usize;
            }
            Add::Huge {
                asid: a,
                first,
                count,
                gib,
                skew,
            } => {
                let size = if gib { PageSize::SIZE_1G } else { PageSize::SIZE_2M };
                let start = u64::from(first) * size.bytes() + u64::from(skew % 4) * PAGE_SIZE;
                let range = PageRange::new(start, u64::from(count) * size.base_pages()).unwrap();
                let before = (req.pages(), req.is_full());
                match req.add_huge_range(asid(a), range, size, ceiling) {
                    Ok(()) => {
                        let pages = range.pages() / size.base_pages();
                        added.extend((0..pages).map(|i| (asid(a), start + i * size.bytes(), size)));
                        invalidations += pages as usize;
                        next = start + range.pages() * PAGE_SIZE;
                    }
                    Err(_) => assert!(skew % 4 != 0 && (req.pages(), req.is_full()) == before),
                }
            }
            Add::Follow { asid: a, count, size } => {
                let size = [PageSize::SIZE_4K, PageSize::SIZE_2M, PageSize::SIZE_1G][usize::from(size % 3)];
                let start = (next + size.bytes() - 1) & !(size.bytes() - 1);
                let count = u64::from(count % 4) + 1;
                let range = PageRange::new(start, count * size.base_pages()).unwrap();
                req.add_huge_range(asid(a), range, size, ceiling).unwrap();
                added.extend((0..count).map(|i| (asid(a), start + i * size.bytes(), size)));
                invalidations += count as usize;
                next = start + count * size.bytes();
            }
            Add::WholeAsid { asid: a } => {
                req.add_asid(asid(a));
                whole.push(asid(a));
            }
            Add::Clear => {
                req.clear();
                added.clear();
                invalidations = 0;
                whole.clear();
                assert!(req.is_empty());
            }
        }
        if let FlushScope::Ranges(ranges) = req.scope() {
            let singles: u64 = ranges.iter().map(|r| u64::from(r.pages)).sum();
            assert!(singles as usize <= ceiling.min(MAX_FLUSH_ENTRIES));
            assert!(ranges
                .iter()
                .all(|r| r.pages > 0 && r.start % r.stride.bytes() == 0));
        }
    }
    assert_eq!(req.pages(), invalidations);
    for &(a, va, size) in &added {
        assert!(
            covered(&req, a, va, size),
            "page {va:#x} ({size}) of {a:?} is not flushed by {:?}",
            req.scope()
        );
    }
    for &a in &whole {
        assert!(
            !matches!(req.scope(), FlushScope::Ranges(_)),
            "a whole-ASID flush became single pages"
        );
        if let FlushScope::Asids(asids) = req.scope() {
            assert!(asids.contains(&a));
        }
    }
});
