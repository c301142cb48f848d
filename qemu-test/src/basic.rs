//! The first scenarios: shootdowns of the kernel's own test mapping at
//! 4 GiB (one page, batches, mutual and busy shootdowns), and the `timing`
//! comparison. Each AP checks with [`probe`] that an unmapped page can no
//! longer be read.

use super::*;

/// One page unmapped, flushed on every CPU, acknowledged; afterwards no AP
/// can read it. Several rounds, so that a negative control does not rest on
/// one AP keeping one entry: TCG may drop a cached translation on its own,
/// and once it did so on all three APs in a single round.
pub fn scenario_one_page() -> bool {
    const ROUNDS: u64 = 8;
    let others = (ONLINE.load(Ordering::SeqCst) - 1) as u64;
    let (mut warmed, mut reports_ok) = (true, true);
    let (mut sent, mut taken, mut still_readable) = (0, 0, 0);
    for _ in 0..ROUNDS {
        map_all();
        command(aps(), PROBE, 1);
        warmed &= aps().all(|c| RESULT[c].load(Ordering::SeqCst) == 1);
        let (stats, irqs) = (TLB.stats(), ipis_taken_by_aps());
        TEST_PT.0[0].store(0, Ordering::SeqCst);
        let r = flush_tlb_page(&arch(), mm(), test_va(0));
        reports_ok &= r.is_ok_and(|r| r.remote_cpus as u64 == others);
        sent += TLB.stats().since(&stats).ipis_sent;
        taken += ipis_taken_by_aps() - irqs;
        command(aps(), PROBE, 1);
        still_readable += aps().map(|c| RESULT[c].load(Ordering::SeqCst)).sum::<u64>();
    }
    let ok =
        warmed && reports_ok && sent == ROUNDS * others && taken == ROUNDS * others && still_readable == 0;
    report(
        "one-page shootdown",
        ok,
        format_args!(
            "{ROUNDS} rounds x {others} APs, {sent} IPIs sent, {taken} taken, {still_readable} AP reads still succeeded"
        ),
    )
}

/// `n` pages unmapped into a batch and flushed once: exactly one IPI per
/// other CPU; afterwards no AP can read any of them.
pub fn scenario_batch(n: usize) -> bool {
    map_all();
    command(aps(), PROBE, n as u64);
    let warmed = aps().all(|c| RESULT[c].load(Ordering::SeqCst) == n as u64);
    let (stats, irqs) = (TLB.stats(), ipis_taken_by_aps());
    let a = arch();
    let mut batch = TlbFlushUnmapBatch::new();
    let mut added = true;
    for i in 0..n {
        let old = Pte(TEST_PT.0[i].swap(0, Ordering::SeqCst));
        added &= batch.add_pending(&a, mm(), test_va(i), old).is_ok();
    }
    let flushed = batch.flush(&a);
    let d = TLB.stats().since(&stats);
    let taken = ipis_taken_by_aps() - irqs;
    command(aps(), PROBE, n as u64);
    let still_readable: u64 = aps().map(|c| RESULT[c].load(Ordering::SeqCst)).sum();
    let others = (ONLINE.load(Ordering::SeqCst) - 1) as u64;
    let ok = warmed
        && added
        && flushed.is_ok()
        && d.shootdowns == 1
        && d.ipis_sent == others
        && taken == others
        && still_readable == 0;
    report(
        if n > 33 { "batched shootdown (full flush)" } else { "batched shootdown (page list)" },
        ok,
        format_args!(
            "{n} pages, 1 flush, {} IPIs sent and {taken} taken for {others} APs, {still_readable} stale reads",
            d.ipis_sent
        ),
    )
}

/// The boot CPU and AP 1 shoot at each other at the same time, both with
/// interrupts disabled: each must serve the other's request while waiting.
pub fn scenario_mutual() -> bool {
    const ROUNDS: u64 = 200;
    let target = CpuSet::single(CpuId::new(1).unwrap_or(CpuId::BOOT));
    ARG[1].store(ROUNDS, Ordering::SeqCst);
    RESULT[1].store(0, Ordering::SeqCst);
    COMMAND[1].store(SHOOT_BACK, Ordering::SeqCst);
    hw::cli();
    let mut ok_rounds = 0;
    for r in 0..ROUNDS {
        if shootdown(&arch(), &target, &one_page((r % 8) as usize)).is_ok() {
            ok_rounds += 1;
        }
    }
    hw::sti();
    while COMMAND[1].load(Ordering::SeqCst) != IDLE {
        core::hint::spin_loop();
    }
    let theirs = RESULT[1].load(Ordering::SeqCst);
    report(
        "mutual shootdown, interrupts off",
        ok_rounds == ROUNDS && theirs == ROUNDS,
        format_args!("{ok_rounds} + {theirs} shootdowns of {ROUNDS} each completed"),
    )
}

/// APs busy with interrupts enabled take every IPI: one per shootdown.
pub fn scenario_busy() -> bool {
    const ROUNDS: u64 = 100;
    let before: [u64; MAX_CPUS] = core::array::from_fn(|c| IPIS_TAKEN[c].load(Ordering::SeqCst));
    for c in aps() {
        RESULT[c].store(0, Ordering::SeqCst);
        COMMAND[c].store(BUSY, Ordering::SeqCst);
    }
    let all = arch().online_cpus();
    let mut ok = true;
    for r in 0..ROUNDS {
        ok &= shootdown(&arch(), &all, &one_page((r % 8) as usize)).is_ok();
    }
    let busy_work: u64 = aps().map(|c| RESULT[c].load(Ordering::SeqCst)).sum();
    command(aps(), IDLE, 0);
    let each = aps().all(|c| IPIS_TAKEN[c].load(Ordering::SeqCst) - before[c] == ROUNDS);
    report(
        "busy APs take every IPI",
        ok && each && busy_work > 0,
        format_args!("{ROUNDS} shootdowns, each AP took {ROUNDS} interrupts while working"),
    )
}

/// Wall time (TSC) of `n` single-page shootdowns against one batched
/// shootdown of `n` pages, measured in this run.
pub fn timing(n: usize) {
    let a = arch();
    map_all();
    command(aps(), PROBE, n as u64);
    let t0 = hw::rdtsc();
    for i in 0..n {
        TEST_PT.0[i].store(0, Ordering::SeqCst);
        let _ = flush_tlb_page(&a, mm(), test_va(i));
    }
    let single = hw::rdtsc() - t0;
    map_all();
    command(aps(), PROBE, n as u64);
    let t1 = hw::rdtsc();
    let mut batch = TlbFlushUnmapBatch::new();
    for i in 0..n {
        let old = Pte(TEST_PT.0[i].swap(0, Ordering::SeqCst));
        let _ = batch.add_pending(&a, mm(), test_va(i), old);
    }
    let _ = batch.flush(&a);
    let batched = hw::rdtsc() - t1;
    let tenths = single * 10 / batched.max(1);
    say(format_args!(
        "timing N={n}: {n} single-page shootdowns {single} TSC ticks, one batched {batched}: ratio {}.{}\n",
        tenths / 10,
        tenths % 10
    ));
}
