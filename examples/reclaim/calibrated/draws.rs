//! The model's random draws, one stream for each thing they decide.
//!
//! Every policy of a cell runs the same seeds, and the comparison between
//! them is only as good as the sameness of the workload they face. With a
//! single stream, any difference in a run (one more stall, one more
//! readahead) shifts every later draw: from there on the disk's delays and
//! the scheduler's choices are another workload's, and a 48-CPU run of a
//! few hundred ticks moves by several percent from that alone. With one
//! stream per purpose (the order the CPUs act in each tick, the
//! scheduler's choice of an idle CPU, the operations' choices, and each
//! task's own disk delays) the same seed gives every policy the same
//! delays for each task's n-th read and the same order in each tick, and
//! what differs between two policies' runs is what the policies did
//! (common random numbers).

/// What a draw decides.
#[derive(Clone, Copy)]
pub(super) enum Stream {
    /// The order the CPUs act in, once a tick.
    Order,
    /// Which idle CPU a task or kswapd goes to.
    Sched,
    /// The migrations' and compaction's choices.
    Ops,
    /// The disk's delay for a read of this task.
    Io(usize),
}

/// The state of every stream (xorshift64 each: deterministic, so every
/// run prints the same figures).
pub(super) struct Draws {
    order: u64,
    sched: u64,
    ops: u64,
    io: Vec<u64>,
}

/// One step of splitmix64: spreads a seed into well-mixed, distinct
/// stream states.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    // xorshift's state must not be zero.
    (z ^ (z >> 31)).max(1)
}

impl Draws {
    /// The streams of `seed` for `tasks` tasks.
    pub(super) fn new(seed: u64, tasks: usize) -> Self {
        let stream = |k: u64| mix(seed ^ mix(k));
        Draws {
            order: stream(0),
            sched: stream(1),
            ops: stream(2),
            io: (0..tasks as u64).map(|t| stream(3 + t)).collect(),
        }
    }

    /// A draw in `0..n` (`n` > 0) from `stream`.
    pub(super) fn draw(&mut self, stream: Stream, n: usize) -> usize {
        let state = match stream {
            Stream::Order => &mut self.order,
            Stream::Sched => &mut self.sched,
            Stream::Ops => &mut self.ops,
            Stream::Io(t) => &mut self.io[t],
        };
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        (*state % n as u64) as usize
    }
}
