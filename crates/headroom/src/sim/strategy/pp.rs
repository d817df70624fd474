//! Pipeline schedules as torch 2.11's `torch.distributed.pipelining` runs them: the order in
//! which one rank runs the forwards and backwards of its stages' micro-batches. The interface is
//! the pure order ([`rank_order`]), so any framework's pipeline (Megatron's 1F1B has the same
//! shape) can drive a simulation with it:
//! - `Schedule1F1B._step_microbatches`: stage `s` of `pp` runs `min(n, pp - s)` forwards, then
//!   one backward and one forward in turn (backward first), then the remaining backwards;
//! - `ScheduleGPipe._step_microbatches`: every forward, then every backward;
//! - `ScheduleInterleaved1F1B._calculate_single_rank_operations` (with `_get_warmup_ops` and
//!   `_get_1f1b_rank_ops`, idle slots left out): rank `r` holds stages `r, r + pp, ...`; the
//!   forwards take the local stages round by round of `max(1, n / pp)` micro-batches, the
//!   backwards the same from the last local stage, and in the steady phase a forward runs
//!   before its backward.

use crate::spec::PipelineSchedule;

/// One unit of a rank's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    Forward { stage: u64, microbatch: u64 },
    Backward { stage: u64, microbatch: u64 },
}

/// The actions pipeline rank `rank` runs in one `schedule.step()`, in order: `pp` ranks, `vpp`
/// stages each, `microbatches` micro-batches.
pub(crate) fn rank_order(
    schedule: PipelineSchedule,
    pp: u64,
    vpp: u64,
    microbatches: u64,
    rank: u64,
) -> Vec<Action> {
    let n = microbatches;
    let forward = |microbatch| Action::Forward {
        stage: rank,
        microbatch,
    };
    let backward = |microbatch| Action::Backward {
        stage: rank,
        microbatch,
    };
    match schedule {
        PipelineSchedule::GPipe => (0..n).map(forward).chain((0..n).map(backward)).collect(),
        PipelineSchedule::OneFOneB => {
            let warmup = n.min(pp - rank);
            let mut order: Vec<Action> = (0..warmup).map(forward).collect();
            for b in 0..n {
                order.push(backward(b));
                if warmup + b < n {
                    order.push(forward(warmup + b));
                }
            }
            order
        }
        PipelineSchedule::Interleaved1F1B => interleaved(pp, vpp, n, rank),
    }
}

/// `ScheduleInterleaved1F1B`'s order for `rank` (see the module doc).
fn interleaved(pp: u64, vpp: u64, n: u64, rank: u64) -> Vec<Action> {
    let per_round = n / (n / pp).max(1);
    // `_get_warmup_ops(multiply_factor=2)`.
    let warmup = ((vpp - 1) * per_round + 2 * (pp - 1 - rank)).min(n * vpp);
    let total = n * vpp;
    let forward_stage = |op: u64| (op / per_round) % vpp * pp + rank;
    let backward_stage = |op: u64| (vpp - 1 - ((op - warmup) / per_round) % vpp) * pp + rank;
    let mut next_forward = vec![0u64; (pp * vpp) as usize];
    let mut next_backward = vec![0u64; (pp * vpp) as usize];
    let take = |counters: &mut Vec<u64>, stage: u64| {
        let microbatch = counters[stage as usize];
        counters[stage as usize] += 1;
        microbatch
    };
    let mut order = Vec::with_capacity(2 * total as usize);
    // Warmup forwards, then (forward, backward) pairs, then the cooldown backwards: `total`
    // forwards and as many backwards.
    for op in 0..total + warmup {
        if op < total {
            let stage = forward_stage(op);
            let microbatch = take(&mut next_forward, stage);
            order.push(Action::Forward { stage, microbatch });
        }
        if op >= warmup {
            let stage = backward_stage(op);
            let microbatch = take(&mut next_backward, stage);
            order.push(Action::Backward { stage, microbatch });
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each rank's order as torch 2.11 runs it, recorded by bench/pp/tools/schedule_orders.py
    /// (the schedules over one-linear stages under the fake process group, their stages'
    /// `forward_one_chunk` and `backward_one_chunk` logged).
    const TORCH_ORDERS: &[(&str, u64, u64, u64, u64, &str)] = &[
        (
            "1f1b",
            2,
            1,
            4,
            0,
            "F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3",
        ),
        (
            "gpipe",
            2,
            1,
            4,
            0,
            "F0.0 F0.1 F0.2 F0.3 B0.0 B0.1 B0.2 B0.3",
        ),
        (
            "1f1b",
            2,
            1,
            4,
            1,
            "F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3",
        ),
        (
            "gpipe",
            2,
            1,
            4,
            1,
            "F1.0 F1.1 F1.2 F1.3 B1.0 B1.1 B1.2 B1.3",
        ),
        (
            "1f1b",
            4,
            1,
            4,
            0,
            "F0.0 F0.1 F0.2 F0.3 B0.0 B0.1 B0.2 B0.3",
        ),
        (
            "gpipe",
            4,
            1,
            4,
            0,
            "F0.0 F0.1 F0.2 F0.3 B0.0 B0.1 B0.2 B0.3",
        ),
        (
            "1f1b",
            4,
            1,
            4,
            1,
            "F1.0 F1.1 F1.2 B1.0 F1.3 B1.1 B1.2 B1.3",
        ),
        (
            "gpipe",
            4,
            1,
            4,
            1,
            "F1.0 F1.1 F1.2 F1.3 B1.0 B1.1 B1.2 B1.3",
        ),
        (
            "1f1b",
            4,
            1,
            4,
            2,
            "F2.0 F2.1 B2.0 F2.2 B2.1 F2.3 B2.2 B2.3",
        ),
        (
            "gpipe",
            4,
            1,
            4,
            2,
            "F2.0 F2.1 F2.2 F2.3 B2.0 B2.1 B2.2 B2.3",
        ),
        (
            "1f1b",
            4,
            1,
            4,
            3,
            "F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F3.3 B3.3",
        ),
        (
            "gpipe",
            4,
            1,
            4,
            3,
            "F3.0 F3.1 F3.2 F3.3 B3.0 B3.1 B3.2 B3.3",
        ),
        (
            "1f1b",
            4,
            1,
            8,
            0,
            "F0.0 F0.1 F0.2 F0.3 B0.0 F0.4 B0.1 F0.5 B0.2 F0.6 B0.3 F0.7 B0.4 B0.5 B0.6 B0.7",
        ),
        (
            "gpipe",
            4,
            1,
            8,
            0,
            "F0.0 F0.1 F0.2 F0.3 F0.4 F0.5 F0.6 F0.7 B0.0 B0.1 B0.2 B0.3 B0.4 B0.5 B0.6 B0.7",
        ),
        (
            "1f1b",
            4,
            1,
            8,
            1,
            "F1.0 F1.1 F1.2 B1.0 F1.3 B1.1 F1.4 B1.2 F1.5 B1.3 F1.6 B1.4 F1.7 B1.5 B1.6 B1.7",
        ),
        (
            "gpipe",
            4,
            1,
            8,
            1,
            "F1.0 F1.1 F1.2 F1.3 F1.4 F1.5 F1.6 F1.7 B1.0 B1.1 B1.2 B1.3 B1.4 B1.5 B1.6 B1.7",
        ),
        (
            "1f1b",
            4,
            1,
            8,
            2,
            "F2.0 F2.1 B2.0 F2.2 B2.1 F2.3 B2.2 F2.4 B2.3 F2.5 B2.4 F2.6 B2.5 F2.7 B2.6 B2.7",
        ),
        (
            "gpipe",
            4,
            1,
            8,
            2,
            "F2.0 F2.1 F2.2 F2.3 F2.4 F2.5 F2.6 F2.7 B2.0 B2.1 B2.2 B2.3 B2.4 B2.5 B2.6 B2.7",
        ),
        (
            "1f1b",
            4,
            1,
            8,
            3,
            "F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F3.3 B3.3 F3.4 B3.4 F3.5 B3.5 F3.6 B3.6 F3.7 B3.7",
        ),
        (
            "gpipe",
            4,
            1,
            8,
            3,
            "F3.0 F3.1 F3.2 F3.3 F3.4 F3.5 F3.6 F3.7 B3.0 B3.1 B3.2 B3.3 B3.4 B3.5 B3.6 B3.7",
        ),
        (
            "interleaved-1f1b",
            2,
            2,
            4,
            0,
            "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3",
        ),
        (
            "interleaved-1f1b",
            2,
            2,
            4,
            1,
            "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3",
        ),
        (
            "interleaved-1f1b",
            4,
            2,
            8,
            0,
            "F0.0 F0.1 F0.2 F0.3 F4.0 F4.1 F4.2 F4.3 F0.4 F0.5 F0.6 B4.0 F0.7 B4.1 F4.4 B4.2 F4.5 B4.3 F4.6 B0.0 F4.7 B0.1 B0.2 B0.3 B4.4 B4.5 B4.6 B4.7 B0.4 B0.5 B0.6 B0.7",
        ),
        (
            "interleaved-1f1b",
            4,
            2,
            8,
            1,
            "F1.0 F1.1 F1.2 F1.3 F5.0 F5.1 F5.2 F5.3 F1.4 B5.0 F1.5 B5.1 F1.6 B5.2 F1.7 B5.3 F5.4 B1.0 F5.5 B1.1 F5.6 B1.2 F5.7 B1.3 B5.4 B5.5 B5.6 B5.7 B1.4 B1.5 B1.6 B1.7",
        ),
        (
            "interleaved-1f1b",
            4,
            2,
            8,
            2,
            "F2.0 F2.1 F2.2 F2.3 F6.0 F6.1 F6.2 B6.0 F6.3 B6.1 F2.4 B6.2 F2.5 B6.3 F2.6 B2.0 F2.7 B2.1 F6.4 B2.2 F6.5 B2.3 F6.6 B6.4 F6.7 B6.5 B6.6 B6.7 B2.4 B2.5 B2.6 B2.7",
        ),
        (
            "interleaved-1f1b",
            4,
            2,
            8,
            3,
            "F3.0 F3.1 F3.2 F3.3 F7.0 B7.0 F7.1 B7.1 F7.2 B7.2 F7.3 B7.3 F3.4 B3.0 F3.5 B3.1 F3.6 B3.2 F3.7 B3.3 F7.4 B7.4 F7.5 B7.5 F7.6 B7.6 F7.7 B7.7 B3.4 B3.5 B3.6 B3.7",
        ),
        (
            "interleaved-1f1b",
            4,
            2,
            4,
            0,
            "F0.0 F0.1 F0.2 F0.3 F4.0 F4.1 F4.2 F4.3 B4.0 B4.1 B4.2 B4.3 B0.0 B0.1 B0.2 B0.3",
        ),
        (
            "interleaved-1f1b",
            4,
            2,
            4,
            1,
            "F1.0 F1.1 F1.2 F1.3 F5.0 F5.1 F5.2 F5.3 B5.0 B5.1 B5.2 B5.3 B1.0 B1.1 B1.2 B1.3",
        ),
        (
            "interleaved-1f1b",
            4,
            2,
            4,
            2,
            "F2.0 F2.1 F2.2 F2.3 F6.0 F6.1 F6.2 B6.0 F6.3 B6.1 B6.2 B6.3 B2.0 B2.1 B2.2 B2.3",
        ),
        (
            "interleaved-1f1b",
            4,
            2,
            4,
            3,
            "F3.0 F3.1 F3.2 F3.3 F7.0 B7.0 F7.1 B7.1 F7.2 B7.2 F7.3 B7.3 B3.0 B3.1 B3.2 B3.3",
        ),
        (
            "interleaved-1f1b",
            2,
            2,
            2,
            0,
            "F0.0 F0.1 F2.0 F2.1 B2.0 B2.1 B0.0 B0.1",
        ),
        (
            "interleaved-1f1b",
            2,
            2,
            2,
            1,
            "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 B1.0 B1.1",
        ),
        (
            "interleaved-1f1b",
            4,
            3,
            8,
            0,
            "F0.0 F0.1 F0.2 F0.3 F4.0 F4.1 F4.2 F4.3 F8.0 F8.1 F8.2 F8.3 F0.4 F0.5 F0.6 B8.0 F0.7 B8.1 F4.4 B8.2 F4.5 B8.3 F4.6 B4.0 F4.7 B4.1 F8.4 B4.2 F8.5 B4.3 F8.6 B0.0 F8.7 B0.1 B0.2 B0.3 B8.4 B8.5 B8.6 B8.7 B4.4 B4.5 B4.6 B4.7 B0.4 B0.5 B0.6 B0.7",
        ),
        (
            "interleaved-1f1b",
            4,
            3,
            8,
            1,
            "F1.0 F1.1 F1.2 F1.3 F5.0 F5.1 F5.2 F5.3 F9.0 F9.1 F9.2 F9.3 F1.4 B9.0 F1.5 B9.1 F1.6 B9.2 F1.7 B9.3 F5.4 B5.0 F5.5 B5.1 F5.6 B5.2 F5.7 B5.3 F9.4 B1.0 F9.5 B1.1 F9.6 B1.2 F9.7 B1.3 B9.4 B9.5 B9.6 B9.7 B5.4 B5.5 B5.6 B5.7 B1.4 B1.5 B1.6 B1.7",
        ),
        (
            "interleaved-1f1b",
            4,
            3,
            8,
            2,
            "F2.0 F2.1 F2.2 F2.3 F6.0 F6.1 F6.2 F6.3 F10.0 F10.1 F10.2 B10.0 F10.3 B10.1 F2.4 B10.2 F2.5 B10.3 F2.6 B6.0 F2.7 B6.1 F6.4 B6.2 F6.5 B6.3 F6.6 B2.0 F6.7 B2.1 F10.4 B2.2 F10.5 B2.3 F10.6 B10.4 F10.7 B10.5 B10.6 B10.7 B6.4 B6.5 B6.6 B6.7 B2.4 B2.5 B2.6 B2.7",
        ),
        (
            "interleaved-1f1b",
            4,
            3,
            8,
            3,
            "F3.0 F3.1 F3.2 F3.3 F7.0 F7.1 F7.2 F7.3 F11.0 B11.0 F11.1 B11.1 F11.2 B11.2 F11.3 B11.3 F3.4 B7.0 F3.5 B7.1 F3.6 B7.2 F3.7 B7.3 F7.4 B3.0 F7.5 B3.1 F7.6 B3.2 F7.7 B3.3 F11.4 B11.4 F11.5 B11.5 F11.6 B11.6 F11.7 B11.7 B7.4 B7.5 B7.6 B7.7 B3.4 B3.5 B3.6 B3.7",
        ),
        (
            "interleaved-1f1b",
            2,
            2,
            6,
            0,
            "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 F0.4 B2.2 F0.5 B2.3 F2.4 B0.2 F2.5 B0.3 B2.4 B2.5 B0.4 B0.5",
        ),
        (
            "interleaved-1f1b",
            2,
            2,
            6,
            1,
            "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 F1.4 B1.2 F1.5 B1.3 F3.4 B3.4 F3.5 B3.5 B1.4 B1.5",
        ),
    ];

    fn show(order: &[Action]) -> String {
        let one = |a: &Action| match *a {
            Action::Forward { stage, microbatch } => format!("F{stage}.{microbatch}"),
            Action::Backward { stage, microbatch } => format!("B{stage}.{microbatch}"),
        };
        order.iter().map(one).collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn every_rank_runs_its_stages_in_torchs_order() {
        for &(name, pp, vpp, n, rank, expected) in TORCH_ORDERS {
            let schedule = match name {
                "1f1b" => PipelineSchedule::OneFOneB,
                "gpipe" => PipelineSchedule::GPipe,
                _ => PipelineSchedule::Interleaved1F1B,
            };
            let order = rank_order(schedule, pp, vpp, n, rank);
            assert_eq!(
                show(&order),
                expected,
                "{name} pp {pp} vpp {vpp} n {n} rank {rank}"
            );
        }
    }
}
