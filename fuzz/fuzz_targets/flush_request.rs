//! Builds a `FlushRequest` from arbitrary additions (pages, ranges, whole
//! ASIDs, clears, any ceiling) and checks that what it asks the CPUs to
//! flush covers every page added, never exceeds the ceiling in single
//! pages, and that bad input is refused without a change.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tlb_batch::{Asid, FlushRequest, FlushScope, PageRange, MAX_FLUSH_ENTRIES, PAGE_SIZE};

#[derive(Arbitrary, Debug)]
enum Add {
    Page { asid: u8, page: u16, offset: u8 },
    Range { asid: u8, first: u16, pages: u8, backwards: bool },
    /// `pages` pages ending at the last page of the address space.
    AtTop { asid: u8, pages: u8 },
    WholeAsid { asid: u8 },
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

fn covered(req: &FlushRequest, a: Asid, va: u64) -> bool {
    match req.scope() {
        FlushScope::Ranges(ranges) => ranges
            .iter()
            // Subtracting: a range at the top of the address space has no end.
            .any(|r| r.asid == a && va >= r.start && va - r.start < u64::from(r.pages) * PAGE_SIZE),
        FlushScope::Asids(asids) => asids.contains(&a) || asids.contains(&Asid::KERNEL),
        FlushScope::Everything { include_global } => include_global || !a.is_kernel(),
    }
}

fuzz_target!(|input: Input| {
    let ceiling = usize::from(input.ceiling);
    let mut req = FlushRequest::new();
    let mut added: Vec<(Asid, u64)> = Vec::new();
    let mut whole: Vec<Asid> = Vec::new();
    for add in input.adds {
        match add {
            Add::Page { asid: a, page, offset } => {
                let va = u64::from(page) * PAGE_SIZE + u64::from(offset % 2);
                let before = req.pages();
                match req.add_page(asid(a), va, ceiling) {
                    Ok(()) => added.push((asid(a), va)),
                    Err(_) => assert!(va % PAGE_SIZE != 0 && req.pages() == before),
                }
            }
            Add::Range { asid: a, first, pages, backwards } => {
                let start = u64::from(first) * PAGE_SIZE;
                let end = start + u64::from(pages) * PAGE_SIZE;
                let (s, e) = if backwards { (end, start) } else { (start, end) };
                match PageRange::from_bounds(s, e) {
                    Ok(range) => {
                        req.add_range(asid(a), range, ceiling);
                        added.extend(range.iter().map(|va| (asid(a), va)));
                    }
                    Err(_) => assert!(s > e),
                }
            }
            Add::AtTop { asid: a, pages } => {
                let pages = u64::from(pages);
                let range = PageRange::new(TOP - pages.saturating_sub(1) * PAGE_SIZE, pages)
                    .expect("a range that ends at the top page fits");
                req.add_range(asid(a), range, ceiling);
                added.extend(range.iter().map(|va| (asid(a), va)));
            }
            Add::WholeAsid { asid: a } => {
                req.add_asid(asid(a));
                whole.push(asid(a));
            }
            Add::Clear => {
                req.clear();
                added.clear();
                whole.clear();
                assert!(req.is_empty());
            }
        }
        if let FlushScope::Ranges(ranges) = req.scope() {
            let singles: u64 = ranges.iter().map(|r| u64::from(r.pages)).sum();
            assert!(singles as usize <= ceiling.min(MAX_FLUSH_ENTRIES));
            assert!(ranges.iter().all(|r| r.pages > 0 && r.start % PAGE_SIZE == 0));
        }
    }
    assert_eq!(req.pages(), added.len());
    for &(a, va) in &added {
        assert!(covered(&req, a, va), "page {va:#x} of {a:?} is not flushed by {:?}", req.scope());
    }
    for &a in &whole {
        assert!(!matches!(req.scope(), FlushScope::Ranges(_)), "a whole-ASID flush became single pages");
        if let FlushScope::Asids(asids) = req.scope() {
            assert!(asids.contains(&a));
        }
    }
});
