//! Unit tests of `request.rs` (its `#[cfg(test)]` module, kept apart so
//! that the file stays one idea).

use super::*;
use crate::pte::PAGE_SIZE;

fn asid(v: u16) -> Asid {
    Asid::new(v).unwrap()
}

fn step(from: u64, to: u64) -> Option<GenStep> {
    Some(GenStep { from, to })
}

/// An ASID keeps a generation step while each addition's step starts
/// where the last ended; a gap (another flush of the space came in
/// between) or an addition without a step loses it, for that ASID only.
#[test]
fn steps_join_end_to_end_and_a_gap_or_an_unknown_loses_them() {
    let mut r = FlushRequest::new();
    let range = |i: u64| PageRange::page(0x10000 + i * PAGE_SIZE).unwrap();
    r.add_range_step(asid(1), range(0), 33, step(5, 7));
    r.add_range_step(asid(1), range(1), 33, step(7, 9));
    r.add_range_step(asid(2), range(2), 33, step(6, 8));
    r.add_range_step(asid(3), range(3), 33, step(2, 3));
    let got: std::vec::Vec<_> = r.steps().collect();
    assert_eq!(
        got,
        [
            (asid(1), GenStep { from: 5, to: 9 }),
            (asid(2), GenStep { from: 6, to: 8 }),
            (asid(3), GenStep { from: 2, to: 3 })
        ]
    );
    r.add_range_step(asid(2), range(4), 33, step(10, 11));
    r.add_range(asid(3), range(5), 33);
    let got: std::vec::Vec<_> = r.steps().collect();
    assert_eq!(got, [(asid(1), GenStep { from: 5, to: 9 })], "a gap, an unknown");
    let mut merged = FlushRequest::new();
    merged.add_range_step(asid(1), range(6), 33, step(9, 10));
    merged.merge(&r, 33);
    assert_eq!(merged.steps().count(), 0, "a merge carries no step");
}

#[test]
fn adjacent_pages_merge_and_the_ceiling_degrades() {
    let mut r = FlushRequest::new();
    for i in 0..4 {
        r.add_page(asid(1), 0x10000 + i * PAGE_SIZE, 33).unwrap();
    }
    r.add_page(asid(2), 0x10000, 33).unwrap();
    assert_eq!(
        r.scope(),
        FlushScope::Ranges(&[
            FlushRange {
                asid: asid(1),
                start: 0x10000,
                pages: 4,
                stride: PageSize::SIZE_4K
            },
            FlushRange {
                asid: asid(2),
                start: 0x10000,
                pages: 1,
                stride: PageSize::SIZE_4K
            },
        ])
    );
    for i in 0..40 {
        r.add_page(asid(1), 0x100000 + 2 * i * PAGE_SIZE, 33).unwrap();
    }
    assert_eq!(r.pages(), 45);
    assert_eq!(r.scope(), FlushScope::Asids(&[asid(1), asid(2)]));
}

/// Merging keeps where the other request's pages lay (after it
/// degraded too) and whether it named the kernel's global entries.
#[test]
fn a_merge_keeps_the_others_extent_and_its_kernel_entries() {
    let mut degraded = FlushRequest::new();
    degraded.add_range(asid(1), PageRange::new(0x7000, 40).unwrap(), 33);
    degraded.add_range(
        Asid::KERNEL,
        PageRange::new(0xffff_f000_0000_0000, 2).unwrap(),
        33,
    );
    degraded.add_everything();
    let mut into = FlushRequest::new();
    into.add_page(asid(2), 0x1000, 33).unwrap();
    into.add_page(asid(2), 0xffff_ffff_ffff_f000, 33).unwrap();
    into.merge(&degraded, 33);
    assert_eq!(
        into.extent(),
        Extent {
            lower_last: Some(0x7000 + 39 * PAGE_SIZE),
            upper_start: Some(0xffff_f000_0000_0000),
        }
    );
    assert!(into.names_kernel());
    let mut everything = FlushRequest::new();
    everything.add_everything();
    let mut user = FlushRequest::new();
    user.add_page(asid(2), 0x1000, 33).unwrap();
    user.merge(&everything, 33);
    assert!(user.names_kernel(), "everything includes the global entries");
}

/// What a remote CPU rebuilds from the published parts is the request
/// that was published: the same scope, page count and address spaces.
#[test]
fn a_request_rebuilt_from_its_parts_is_the_same_request() {
    let mut r = FlushRequest::new();
    for i in 0..3 {
        r.add_page(asid(1), 0x10000 + i * PAGE_SIZE, 33).unwrap();
    }
    r.add_page(asid(2), 0x40000, 33).unwrap();
    r.add_page(asid(2), 0x80000, 33).unwrap();
    let mut asids = FlushRequest::new();
    asids.add_asid(asid(3));
    asids.add_asid(Asid::KERNEL);
    let mut everything = FlushRequest::new();
    everything.add_everything();
    assert_eq!(FlushRequest::from_parts(r.scope()).pages(), 5);
    for req in [r, asids, everything] {
        let rebuilt = FlushRequest::from_parts(req.scope());
        assert_eq!(rebuilt.scope(), req.scope());
        assert_eq!(rebuilt.pages(), req.pages());
        assert_eq!(rebuilt.asids(), req.asids());
    }
}

#[test]
fn many_asids_become_everything_and_kernel_means_global() {
    let mut r = FlushRequest::new();
    for a in 1..=MAX_FLUSH_ASIDS as u16 + 1 {
        r.add_asid(asid(a));
    }
    assert_eq!(
        r.scope(),
        FlushScope::Everything {
            include_global: false
        }
    );
    r.add_page(Asid::KERNEL, 0, 33).unwrap();
    assert_eq!(r.scope(), FlushScope::Everything { include_global: true });
    r.clear();
    assert!(r.is_empty());
}

#[test]
fn bad_input_is_rejected_without_change() {
    let mut r = FlushRequest::new();
    assert_eq!(
        r.add_page(asid(1), 0x1001, 33),
        Err(Error::Unaligned { addr: 0x1001 })
    );
    assert!(r.is_empty());
}

#[test]
fn the_top_page_is_a_range_like_any_other() {
    let top = !(PAGE_SIZE - 1);
    let mut r = FlushRequest::new();
    r.add_page(asid(1), top - PAGE_SIZE, 33).unwrap();
    r.add_page(asid(1), top, 33).unwrap();
    // Merged without computing an end past the top.
    assert_eq!(
        r.scope(),
        FlushScope::Ranges(&[FlushRange {
            asid: asid(1),
            start: top - PAGE_SIZE,
            pages: 2,
            stride: PageSize::SIZE_4K
        }])
    );
    r.add_page(asid(2), 0, 33).unwrap();
    assert_eq!(r.pages(), 3);
}

#[test]
fn full_says_whether_the_request_degraded() {
    let mut r = FlushRequest::new();
    assert!(!r.is_full());
    r.add_page(asid(1), 0x10000, 2).unwrap();
    r.add_page(asid(1), 0x20000, 2).unwrap();
    assert!(!r.is_full(), "at the ceiling, not past it");
    r.add_page(asid(1), 0x30000, 2).unwrap();
    assert!(r.is_full());
    assert_eq!(r.scope(), FlushScope::Asids(&[asid(1)]));
    r.clear();
    assert!(!r.is_full());
    r.add_everything();
    assert!(r.is_full() && !r.is_empty());
    assert_eq!(r.scope(), FlushScope::Everything { include_global: true });
    r.clear();
    r.add_asid(asid(3));
    assert!(r.is_full());
    assert_eq!(r.scope(), FlushScope::Asids(&[asid(3)]));
}

/// Huge pages are added at their stride: one invalidation each, counted
/// once against the ceiling, joined only with ranges of the same stride
/// that follow them, and refused with nothing added when the range is not
/// whole pages of the stride.
#[test]
fn huge_pages_are_flushed_at_their_stride() {
    const MIB2: u64 = 2 << 20;
    let huge = |first: u64, n: u64| PageRange::new(first * MIB2, n * 512).unwrap();
    let mut r = FlushRequest::new();
    r.add_huge_range(asid(1), huge(1, 3), PageSize::SIZE_2M, 8)
        .unwrap();
    r.add_huge_range(asid(1), huge(4, 1), PageSize::SIZE_2M, 8)
        .unwrap();
    // 4 KiB pages right after do not join the huge range.
    r.add_range(asid(1), PageRange::new(5 * MIB2, 2).unwrap(), 8);
    assert_eq!(r.pages(), 6, "one per huge page, one per small page");
    let FlushScope::Ranges(ranges) = r.scope() else {
        panic!("within the ceiling");
    };
    assert_eq!(
        ranges,
        [
            FlushRange {
                asid: asid(1),
                start: MIB2,
                pages: 4,
                stride: PageSize::SIZE_2M
            },
            FlushRange {
                asid: asid(1),
                start: 5 * MIB2,
                pages: 2,
                stride: PageSize::SIZE_4K
            }
        ]
    );
    let addresses: std::vec::Vec<u64> = ranges[0].addresses().collect();
    assert_eq!(addresses, [MIB2, 2 * MIB2, 3 * MIB2, 4 * MIB2]);
    // Rebuilt from its parts (as a request slot does) it is the same.
    let rebuilt = FlushRequest::from_parts(r.scope());
    assert_eq!((rebuilt.scope(), rebuilt.pages()), (r.scope(), r.pages()));

    // Not whole 2 MiB pages: refused, nothing added.
    for (start, pages) in [(MIB2 + PAGE_SIZE, 512), (MIB2, 511), (MIB2, 513)] {
        let bad = PageRange::new(start, pages).unwrap();
        assert_eq!(
            r.add_huge_range(asid(2), bad, PageSize::SIZE_2M, 8),
            Err(Error::StrideUnaligned {
                start,
                pages,
                stride: MIB2
            })
        );
    }
    assert_eq!((r.pages(), r.asids()), (6, &[asid(1)][..]));

    // The ceiling counts invalidations: 3 more huge pages pass 8.
    r.add_huge_range(asid(1), huge(9, 3), PageSize::SIZE_2M, 8)
        .unwrap();
    assert!(r.is_full() && r.pages() == 9);
    assert_eq!(r.scope(), FlushScope::Asids(&[asid(1)]));
}

/// A merge keeps each range's stride.
#[test]
fn a_merge_keeps_the_stride() {
    const GIB: u64 = 1 << 30;
    let mut one = FlushRequest::new();
    one.add_huge_range(
        asid(3),
        PageRange::new(GIB, 1 << 18).unwrap(),
        PageSize::SIZE_1G,
        33,
    )
    .unwrap();
    let mut all = FlushRequest::new();
    all.add_page(asid(3), 0x1000, 33).unwrap();
    all.merge(&one, 33);
    assert_eq!(all.pages(), 2);
    let FlushScope::Ranges(ranges) = all.scope() else {
        panic!("within the ceiling");
    };
    assert_eq!(ranges[1].stride, PageSize::SIZE_1G);
    assert_eq!(ranges[1].addresses().collect::<std::vec::Vec<_>>(), [GIB]);
}

/// Level hints: on for pages whose leaf size the page table reported, off
/// once the request holds a page of unknown size, and a merge keeps them
/// off when either side had them off (in either order).
#[test]
fn a_page_of_unknown_size_turns_the_hints_off_through_a_merge() {
    let hinted = || {
        let mut r = FlushRequest::new();
        let pages = Pages::one(0x20_0000, PageSize::SIZE_2M).unwrap().leaf();
        assert_eq!(pages.hint(), Some(PageSize::SIZE_2M));
        r.add_pages_step(asid(1), pages, 33, None);
        r
    };
    assert!(hinted().leaf_hints());
    let mut unknown = FlushRequest::new();
    unknown.add_range(asid(2), PageRange::page(0x1000).unwrap(), 33);
    assert!(!unknown.leaf_hints());

    let mut into_hinted = hinted();
    into_hinted.merge(&unknown, 33);
    assert!(!into_hinted.leaf_hints(), "an unknown page merged in");
    let mut into_unknown = unknown.clone();
    into_unknown.merge(&hinted(), 33);
    assert!(!into_unknown.leaf_hints(), "merged into an unknown page");
    let mut both = hinted();
    both.merge(&hinted(), 33);
    assert!(both.leaf_hints(), "two requests of known sizes");
}
