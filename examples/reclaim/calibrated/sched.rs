//! The model's scheduler: which CPU runs which task, idle CPUs (lazy or
//! on the kernel's space), and waking tasks.

use super::*;

impl<H: Hardware> Model<'_, H> {
    /// CPU `c` stops running a worker (it goes idle, or runs kswapd): it
    /// keeps the user space lazily, or switches to the kernel's, as the
    /// cell says, whatever the policy.
    pub(super) fn go_lazy(&mut self, c: usize, run: Run) {
        self.cpus[c].run = run;
        let cpu = self.cpu(c);
        let Some(mm) = cpu.current_mm().filter(|mm| !mm.is_kernel()) else {
            return;
        };
        match self.cell.idle {
            // The crate's `enter_lazy_tlb` and the mock's mark: flushes of
            // the space skip this CPU until it resumes (`place`).
            Idle::Lazy => cpu.enter_lazy().expect("a user address space loaded"),
            Idle::Kernel => {
                let _ = mm;
                cpu.switch_to(self.m.kernel_mm()).expect("switch");
            }
        }
    }

    /// Task `t` starts running on CPU `c`. A lazy CPU that resumes the
    /// space it is lazy on catches up through the crate (`switch_mm` to
    /// the loaded space leaves lazy mode, flushing the ASID if a flush
    /// skipped it), and the mock's lazy mark ends there; one that loads
    /// another space leaves lazy mode by the switch.
    pub(super) fn place(&mut self, t: usize, c: usize) {
        let cpu = self.cpu(c);
        let next = self.rmap.spaces()[self.tasks[t].space].mm().clone();
        cpu.switch_to(&next).expect("switch");
        if self.tasks[t].last_cpu.is_some_and(|l| l != c) {
            self.fig.moves += 1;
        }
        self.tasks[t].last_cpu = Some(c);
        self.cpus[c].run = Run::Worker(t);
    }

    pub(super) fn idle_cpus(&self) -> Vec<usize> {
        (0..self.cpus.len())
            .filter(|&c| self.cpus[c].run == Run::Idle)
            .collect()
    }

    pub(super) fn wake(&mut self, t: usize) {
        self.tasks[t].asleep_until = None;
        let last = self.tasks[t].last_cpu.unwrap_or(0);
        if self.cpus[last].run == Run::Idle {
            return self.place(t, last);
        }
        let idle = self.idle_cpus();
        if idle.is_empty() {
            self.runq.push_back(t);
        } else {
            let c = idle[self.random(Stream::Sched, idle.len())];
            self.place(t, c);
        }
    }

    pub(super) fn schedule(&mut self) {
        self.collect_flushes();
        for t in 0..self.tasks.len() {
            if self.tasks[t].asleep_until.is_some_and(|u| u <= self.now) {
                self.wake(t);
            }
        }
        if self.kswapd.is_some() && !self.cpus.iter().any(|c| c.run == Run::Kswapd) {
            let idle = self.idle_cpus();
            let c = if idle.is_empty() {
                self.random(Stream::Sched, self.cpus.len())
            } else {
                idle[self.random(Stream::Sched, idle.len())]
            };
            if let Run::Worker(t) = self.cpus[c].run {
                self.runq.push_front(t);
            }
            self.go_lazy(c, Run::Kswapd);
        }
        for c in 0..self.cpus.len() {
            if self.cpus[c].run == Run::Idle {
                if let Some(t) = self.runq.pop_front() {
                    self.place(t, c);
                }
            }
        }
    }
}
