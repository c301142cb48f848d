//! Running a simulated machine's CPUs as real threads.

use core::sync::atomic::{AtomicUsize, Ordering};

use super::{MockCpu, MockMachine, Model};

impl<M: Model> MockMachine<M> {
    /// Runs `f` once on every CPU, each CPU a real thread, and returns when
    /// all are done. A thread whose `f` returned keeps taking interrupts
    /// until every other one returned, so late IPIs are still served. Use
    /// with [`Delivery::Threaded`](super::Delivery::Threaded).
    pub fn run_threaded<F>(&self, f: F)
    where
        F: Fn(MockCpu<'_, M>) + Sync,
    {
        let done = AtomicUsize::new(0);
        let n = self.cpus.len();
        std::thread::scope(|s| {
            for cpu in self.cpus() {
                let (f, done) = (&f, &done);
                s.spawn(move || {
                    f(cpu);
                    cpu.enable_interrupts();
                    done.fetch_add(1, Ordering::SeqCst);
                    while done.load(Ordering::SeqCst) < n {
                        cpu.poll_interrupts();
                        std::thread::yield_now();
                    }
                    cpu.poll_interrupts();
                });
            }
        });
    }
}
