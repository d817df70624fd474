//! Megatron-core 0.19's `forward_backward_pipelining_without_interleaving` (`pipeline_parallel/
//! schedules.py`) as the steps one pipeline rank takes, its receives and the rebinding of its
//! locals included, since those decide when a received tensor is made and freed. Rank `r` of
//! `pp` runs `w = min(pp - r - 1, n)` warm-up forwards, then `n - w` rounds of a forward and a
//! backward, then `w` cool-down backwards: the forwards and backwards in `strategy::pp`'s 1F1B
//! order (`Schedule1F1B`'s warm-up of `pp - r` forwards ends with the backward Megatron's first
//! steady round runs after its forward).

/// One step of the schedule, in the words of `schedules.py`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// `input_tensor = recv_forward(...)` (or `send_backward_recv_forward`): a new receive
    /// buffer on every stage but the first; the local's previous tensor is let go.
    RecvForward,
    /// `forward_step` of a micro-batch on the local input; the output kept as the local.
    Forward(u64),
    /// `output_tensor_grad = send_forward_recv_backward(...)` (or `recv_backward`): a new
    /// gradient buffer on every stage but the last; the local's previous one is let go.
    RecvBackward,
    /// `input_tensors.append`, `output_tensors.append`, `deallocate_output_tensor(output)`.
    Deallocate,
    /// `input_tensor = input_tensors.pop(0)`, `output_tensor = output_tensors.pop(0)`: the
    /// locals' previous tensors are let go.
    Pop,
    /// `input_tensor_grad = backward_step(...)` of the popped micro-batch.
    Backward(u64),
    /// `input_tensor = None` before the last steady round's `send_backward`.
    DropInput,
}

/// The steps of pipeline rank `rank` of `pp` over `microbatches` micro-batches (training).
pub(crate) fn one_f_one_b(pp: u64, microbatches: u64, rank: u64) -> Vec<Step> {
    let n = microbatches;
    let warmup = (pp - rank - 1).min(n);
    let remaining = n - warmup;
    let mut steps = Vec::new();
    for i in 0..warmup {
        steps.extend([Step::RecvForward, Step::Forward(i), Step::Deallocate]);
    }
    if remaining > 0 {
        steps.push(Step::RecvForward);
    }
    for i in 0..remaining {
        steps.extend([
            Step::Forward(warmup + i),
            Step::RecvBackward,
            Step::Deallocate,
            Step::Pop,
            Step::Backward(i),
        ]);
        steps.push(if i + 1 == remaining {
            Step::DropInput
        } else {
            Step::RecvForward
        });
    }
    for i in 0..warmup {
        steps.extend([Step::Pop, Step::RecvBackward, Step::Backward(remaining + i)]);
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::strategy::pp::{Action, rank_order};
    use crate::spec::PipelineSchedule;

    /// What megatron-core 0.19's schedule calls on pipeline rank `rank` of `pp` over `n`
    /// micro-batches, recorded from its code by bench/megatron-pp/tools/schedule_steps.py: R a
    /// forward receive, F a forward, D `deallocate_output_tensor`, G a gradient receive, B a
    /// backward (the forwards and backwards are those the measured rows' `env.order` logged on
    /// the GPU).
    const MEGATRON_STEPS: &[(u64, u64, u64, &str)] = &[
        (2, 1, 0, "R F0 D G B0"),
        (2, 1, 1, "R F0 G D B0"),
        (2, 4, 0, "R F0 D R F1 G D B0 R F2 G D B1 R F3 G D B2 G B3"),
        (2, 4, 1, "R F0 G D B0 R F1 G D B1 R F2 G D B2 R F3 G D B3"),
        (3, 2, 0, "R F0 D R F1 D G B0 G B1"),
        (3, 2, 1, "R F0 D R F1 G D B0 G B1"),
        (3, 2, 2, "R F0 G D B0 R F1 G D B1"),
        (4, 2, 0, "R F0 D R F1 D G B0 G B1"),
        (4, 2, 1, "R F0 D R F1 D G B0 G B1"),
        (4, 2, 2, "R F0 D R F1 G D B0 G B1"),
        (4, 2, 3, "R F0 G D B0 R F1 G D B1"),
        (4, 4, 0, "R F0 D R F1 D R F2 D R F3 G D B0 G B1 G B2 G B3"),
        (4, 4, 1, "R F0 D R F1 D R F2 G D B0 R F3 G D B1 G B2 G B3"),
        (4, 4, 2, "R F0 D R F1 G D B0 R F2 G D B1 R F3 G D B2 G B3"),
        (4, 4, 3, "R F0 G D B0 R F1 G D B1 R F2 G D B2 R F3 G D B3"),
        (
            4,
            8,
            0,
            "R F0 D R F1 D R F2 D R F3 G D B0 R F4 G D B1 R F5 G D B2 R F6 G D B3 R F7 G D B4 G B5 G B6 G B7",
        ),
        (
            4,
            8,
            1,
            "R F0 D R F1 D R F2 G D B0 R F3 G D B1 R F4 G D B2 R F5 G D B3 R F6 G D B4 R F7 G D B5 G B6 G B7",
        ),
        (
            4,
            8,
            2,
            "R F0 D R F1 G D B0 R F2 G D B1 R F3 G D B2 R F4 G D B3 R F5 G D B4 R F6 G D B5 R F7 G D B6 G B7",
        ),
        (
            4,
            8,
            3,
            "R F0 G D B0 R F1 G D B1 R F2 G D B2 R F3 G D B3 R F4 G D B4 R F5 G D B5 R F6 G D B6 R F7 G D B7",
        ),
        (8, 3, 0, "R F0 D R F1 D R F2 D G B0 G B1 G B2"),
        (8, 3, 1, "R F0 D R F1 D R F2 D G B0 G B1 G B2"),
        (8, 3, 2, "R F0 D R F1 D R F2 D G B0 G B1 G B2"),
        (8, 3, 3, "R F0 D R F1 D R F2 D G B0 G B1 G B2"),
        (8, 3, 4, "R F0 D R F1 D R F2 D G B0 G B1 G B2"),
        (8, 3, 5, "R F0 D R F1 D R F2 G D B0 G B1 G B2"),
        (8, 3, 6, "R F0 D R F1 G D B0 R F2 G D B1 G B2"),
        (8, 3, 7, "R F0 G D B0 R F1 G D B1 R F2 G D B2"),
    ];

    fn computes(steps: &[Step], rank: u64) -> Vec<Action> {
        steps
            .iter()
            .filter_map(|s| match *s {
                Step::Forward(microbatch) => Some(Action::Forward {
                    stage: rank,
                    microbatch,
                }),
                Step::Backward(microbatch) => Some(Action::Backward {
                    stage: rank,
                    microbatch,
                }),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_forwards_and_backwards_are_torchs_1f1b_order() {
        for pp in 2..=8 {
            for n in 1..=12 {
                for rank in 0..pp {
                    let steps = one_f_one_b(pp, n, rank);
                    assert_eq!(
                        computes(&steps, rank),
                        rank_order(PipelineSchedule::OneFOneB, pp, 1, n, rank),
                        "pp {pp} n {n} rank {rank}"
                    );
                }
            }
        }
    }

    /// The steps as Megatron's code calls them (the list operations, `Pop` and `DropInput`, are
    /// no calls).
    fn calls(steps: &[Step]) -> String {
        let one = |s: &Step| match *s {
            Step::RecvForward => Some("R".to_string()),
            Step::Forward(microbatch) => Some(format!("F{microbatch}")),
            Step::Deallocate => Some("D".to_string()),
            Step::RecvBackward => Some("G".to_string()),
            Step::Backward(microbatch) => Some(format!("B{microbatch}")),
            Step::Pop | Step::DropInput => None,
        };
        steps.iter().filter_map(one).collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn every_rank_calls_what_megatron_calls() {
        for &(pp, n, rank, expected) in MEGATRON_STEPS {
            assert_eq!(
                calls(&one_f_one_b(pp, n, rank)),
                expected,
                "pp {pp} n {n} rank {rank}"
            );
        }
    }

    /// Each micro-batch's input is received before its forward (but on the first stage, which
    /// receives nothing, the receives still pair with forwards), each gradient before its
    /// backward, and a round's buffers are let go only after the next is made.
    #[test]
    fn receives_precede_what_uses_them() {
        for pp in 2..=6 {
            for n in 1..=10 {
                for rank in 0..pp {
                    let steps = one_f_one_b(pp, n, rank);
                    let count = |s: Step| steps.iter().filter(|&&x| x == s).count() as u64;
                    assert_eq!(count(Step::RecvForward), n, "pp {pp} n {n} rank {rank}");
                    assert_eq!(count(Step::RecvBackward), n);
                    assert_eq!(count(Step::Deallocate), n);
                    assert_eq!(count(Step::Pop), n);
                    let (mut received, mut forwards) = (0, 0);
                    let (mut grads, mut backwards) = (0, 0);
                    for s in &steps {
                        match s {
                            Step::RecvForward => received += 1,
                            Step::Forward(_) => {
                                forwards += 1;
                                assert!(forwards <= received);
                            }
                            Step::RecvBackward => grads += 1,
                            Step::Backward(_) => {
                                backwards += 1;
                                assert!(backwards <= grads);
                            }
                            _ => {}
                        }
                    }
                }
            }
        }
    }
}
