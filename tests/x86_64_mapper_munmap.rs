//! The `x86_64-mapper` feature against real four-level tables (built with
//! the `x86_64` crate in host memory, see `x86_64_mapper_space.rs`), the
//! glue a kernel built on the `x86_64` crate no longer writes:
//! `DeallocatorFrees` gets exactly the frames; `MapperError` converts into
//! `Error`.

#![cfg(all(feature = "x86_64-mapper", feature = "mock"))]

mod common;

use common::x86_tables::{map, user_rw, Tables, MIB2};
use tlb_batch::heapless;
use tlb_batch::mapper::{DeallocatorFrees, MapperError, OffsetSpace};
use tlb_batch::{Error, Frame, FreeFrames, OwnedFrame, PageRange, TeardownBacking, PAGE_SIZE};
use x86_64::structures::paging::{FrameDeallocator, PhysFrame, Size2MiB, Size4KiB};

/// Records what it is given, nothing else.
#[derive(Default)]
struct Record(Vec<PhysFrame>);

impl FrameDeallocator<Size4KiB> for Record {
    unsafe fn deallocate_frame(&mut self, frame: PhysFrame) {
        self.0.push(frame);
    }
}

fn owned(frames: &[u64]) -> heapless::Vec<OwnedFrame, 8> {
    // SAFETY: the numbers are the test's; nothing frees them elsewhere.
    frames
        .iter()
        .map(|&f| unsafe { OwnedFrame::new(Frame(f)) })
        .collect()
}

#[test]
fn deallocator_frees_gets_exactly_the_frames_and_hands_back_what_has_no_phys_frame() {
    let mut record = Record::default();
    // SAFETY: the frames are numbers only; `Record` never touches them.
    let mut frees = unsafe { DeallocatorFrees::new(&mut record) };
    let beyond = 1 << 40;
    let mut data = owned(&[0x10, beyond, 0x11, u64::MAX, 0x12]);
    frees.free_batch(&mut data);
    let left: Vec<Frame> = data.iter().map(OwnedFrame::frame).collect();
    assert_eq!(left, [Frame(beyond), Frame(u64::MAX)], "refused, in order");
    let mut tables = owned(&[0x20, 0x21]);
    frees.free_tables(&mut tables);
    assert!(tables.is_empty());
    frees.set_dirty(Frame(0x10));
    assert_eq!((frees.freed(), frees.dirty_pages()), (5, 1));
    assert!(format!("{frees:?}").contains("freed: 5"));
    let got: Vec<Frame> = record.0.iter().map(|&f| Frame::from(f)).collect();
    assert_eq!(got, [0x10, 0x11, 0x12, 0x20, 0x21].map(Frame));
}

#[test]
fn mapper_errors_convert_into_the_crates_error() {
    let huge = MapperError::HugePage {
        va: 0x4000_0000,
        size: MIB2,
    };
    assert_eq!(
        Error::from(huge),
        Error::HugePage {
            va: 0x4000_0000,
            size: MIB2
        }
    );
    assert_eq!(Error::from(huge).to_string(), huge.to_string());
    let out = MapperError::FrameOutOfRange {
        frame: Frame(1 << 40),
    };
    assert_eq!(
        Error::from(out),
        Error::FrameOutOfRange {
            frame: Frame(1 << 40)
        }
    );
    assert_eq!(Error::from(out).to_string(), out.to_string());

    // `?` converts in a function that returns the crate's error.
    let mut t = Tables::new();
    let (mut mapper, mut pool) = t.mapper();
    map::<Size2MiB>(&mut mapper, &mut pool, 0x4000_0000, 0x1_0000_0000, user_rw());
    let tlb = tlb_batch::MmTlbState::new(common::asid(1), 0);
    let space = OffsetSpace::new(&mut mapper, &tlb);
    let check = |range| -> Result<(), Error> {
        space.check_no_huge(range)?;
        Ok(())
    };
    assert_eq!(
        check(PageRange::page(0x4000_0000 + PAGE_SIZE).unwrap()),
        Err(Error::from(huge))
    );
    assert_eq!(check(PageRange::page(0x3fff_f000).unwrap()), Ok(()));
}
