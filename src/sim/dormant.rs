//! Entries of an offline CPU. An offline CPU runs nothing, so a frame
//! freed while only its dormant entries cache it is no violation at the
//! free; but it must drop them before it rejoins
//! ([`prepare_cpu_online`](crate::prepare_cpu_online)). The oracle
//! remembers them at the free and judges them when the CPU joins the
//! online set again: one still in its TLB then is a
//! [`Violation::OnlineWithStale`] (a walk-cache entry, a
//! [`Violation::OnlineWithStaleWalk`]), whatever happened to the frame
//! since, free or handed to a new owner. Judging at use could not see the
//! second case: a write through the old entry into a reused frame looks,
//! to the frame's state, like any other write.

use std::vec::Vec;

use super::{lock, MockMachine, Model, TlbEntry, Violation, WalkEntry};
use crate::cpuset::CpuId;
use crate::pte::{Frame, PAGE_SHIFT};

impl<M: Model> MockMachine<M> {
    /// The free-time record for offline CPUs: remembers every entry (a TLB
    /// entry reaching `frame`, a walk-cache entry pointing at it) that an
    /// offline CPU holds; with `writable_only` (a write-out), only the TLB
    /// entries that allow writes. Called with the judgement held, so that
    /// no CPU comes online between this scan and the other verdicts.
    pub(crate) fn remember_dormant(&self, frame: Frame, writable_only: bool) {
        for cpu in self.cpus() {
            if self.is_online(cpu.id()) {
                continue;
            }
            let (entries, walks): (Vec<TlbEntry>, Vec<WalkEntry>) = {
                let tlb = lock(&cpu.state().tlb);
                let entries = tlb
                    .entries()
                    .filter(|e| e.page_of(frame).is_some() && (e.writable || !writable_only))
                    .copied()
                    .collect();
                let walks = tlb
                    .walks()
                    .filter(|w| w.table == frame && !writable_only)
                    .copied()
                    .collect();
                (entries, walks)
            };
            let mut remembered = lock(&cpu.state().dormant);
            for e in entries {
                if !remembered.contains(&e) {
                    remembered.push(e);
                }
            }
            let mut remembered = lock(&cpu.state().dormant_walks);
            for w in walks {
                if !remembered.contains(&w) {
                    remembered.push(w);
                }
            }
        }
    }

    /// Puts `cpu` in the online set, with the rejoin judgement: every
    /// remembered dormant entry still in its TLB is recorded as a
    /// violation, and the record is emptied.
    pub(crate) fn join_online(&self, cpu: CpuId) {
        // No free scans the online set between the judgement and the
        // insertion: a frame freed in between would be judged neither as
        // dormant nor as live.
        let _transition = self.transition();
        if self.is_online(cpu) {
            return;
        }
        let state = self.state(cpu);
        let entries: Vec<TlbEntry> = core::mem::take(&mut *lock(&state.dormant));
        let walks: Vec<WalkEntry> = core::mem::take(&mut *lock(&state.dormant_walks));
        let (entries, walks): (Vec<TlbEntry>, Vec<WalkEntry>) = {
            let tlb = lock(&state.tlb);
            let entries = entries
                .into_iter()
                .filter(|e| tlb.entries().any(|t| t.same_translation(e)))
                .collect();
            let walks = walks
                .into_iter()
                .filter(|w| tlb.walks().any(|t| t == w))
                .collect();
            (entries, walks)
        };
        for w in &walks {
            self.record(Violation::OnlineWithStaleWalk { cpu, table: w.table });
        }
        for e in &entries {
            self.record(Violation::OnlineWithStale {
                cpu,
                frame: e.frame,
                va: e.vpn << PAGE_SHIFT,
                writable: e.writable,
            });
        }
        self.online.insert(cpu, core::sync::atomic::Ordering::SeqCst);
    }
}
