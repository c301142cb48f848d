//! Host tests of the scenarios' bookkeeping.

use super::*;

/// A passing round count for 3 observers x 4 pages, with the IPI
/// counters given.
fn outcome(broadcast: bool, shootdowns: u64, sent: u64, seen: u64) -> Outcome {
    Outcome {
        rounds: 2,
        pages: 4,
        observers: 3,
        fresh: 2 * 3 * 4,
        broadcast,
        ipis_sent: sent,
        ipis_seen: seen,
        shootdowns,
        ..Outcome::new("t", Change::BatchedUnmap, Flush::AllCpus)
    }
}

#[test]
fn broadcast_platforms_must_send_no_ipi() {
    assert!(outcome(true, 4, 0, 0).passed());
    assert!(!outcome(true, 4, 1, 0).passed());
    assert!(!outcome(true, 4, 0, 1).passed());
}

#[test]
fn ipi_platforms_must_send_one_per_shootdown_and_observer() {
    assert!(outcome(false, 4, 12, 12).passed());
    // No IPI at all: the shootdowns did not reach the observers.
    assert!(!outcome(false, 4, 0, 0).passed());
    // One observer missed per shootdown.
    assert!(!outcome(false, 4, 8, 8).passed());
    // Sent but not all taken.
    assert!(!outcome(false, 4, 12, 11).passed());
    // Fewer shootdowns than rounds: a round's setup flush is missing.
    assert!(!outcome(false, 1, 3, 3).passed());
}

#[test]
fn stale_reads_fail_whatever_the_ipis() {
    let mut o = outcome(false, 4, 12, 12);
    o.fresh -= 1;
    o.stale = 1;
    assert!(!o.passed());
    assert!(format!("{o}").contains("FAIL"));
    assert!(format!("{o}").contains("stale: 1 reads of the old frame, 0 other, 0 timeouts"));
}

#[test]
fn lines_keep_their_format() {
    let o = outcome(true, 4, 0, 0);
    let line = format!("{o}");
    assert!(line.starts_with("scenario t: PASS (2 rounds x 3 observing CPUs x 4 pages, flush on every CPU:"));
    assert!(line.ends_with("IPIs sent: 0, 0 ms)"), "{line}");
    let mut skipped = outcome(true, 0, 0, 0);
    skipped.skipped = Some("why");
    assert!(skipped.passed());
    assert_eq!(format!("{skipped}"), "scenario t: skipped: why");
    let line = format!("{}", outcome(false, 4, 12, 12));
    assert!(line.contains("4 shootdowns, IPIs sent: 12 (1 per shootdown and observer: 12), taken: 12"));
}
