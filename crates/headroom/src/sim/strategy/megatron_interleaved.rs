//! Megatron-core 0.19's `forward_backward_pipelining_with_interleaving` (`pipeline_parallel/
//! schedules.py`, virtual pipeline: `vpp` model chunks per rank) as the steps one pipeline rank
//! takes, with `batch_p2p_comm` (no p2p overlap) or with `overlap_p2p_comm` (without
//! `overlap_p2p_comm_warmup_flush`): its receives, forwards, backwards and
//! `deallocate_output_tensor` calls, with the chunk each receive is appended to, since those decide
//! when a received tensor is made and freed. With the overlap the steady phase posts the next
//! input's receive between the forward and the backward, the gradient's after the backward, and
//! deallocates the sent output only before the next forward (`pp_pre_forward`); the warm-up and
//! cool-down receive as without it, but for the warm-up's last gradient receive, made after the
//! deallocation and held in `bwd_recv_buffer` until the first steady receive replaces it. Rank `r` of `pp` runs
//! `min(2 (pp - r - 1) + (vpp - 1) g, n vpp)` warm-up forwards (`get_pp_rank_microbatches`, `g`
//! the micro-batch group `microbatch_group_size_per_vp_stage`, `pp` by default), then rounds of a
//! forward and a backward, then the cool-down backwards; the virtual micro-batches run in
//! `get_schedule_table`'s order (groups of `g` micro-batches through every chunk in turn; the
//! backwards through the chunks in reverse).

/// What a communication call does to one of the schedule's locals (`input_tensor` or
/// `output_tensor_grad`) and lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Recv {
    /// The call leaves the local alone.
    Keep,
    /// Nothing received: the local becomes `None`.
    Clear,
    /// A new `torch.empty(..., requires_grad=True)` appended to `chunk`'s list, and bound to
    /// the local when `bind`.
    Into { chunk: u64, bind: bool },
}

/// One step of the schedule, in the words of `schedules.py`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// One p2p call: the input receive (`recv_prev`) is made before the gradient's
    /// (`recv_next`), then the locals are rebound.
    Communicate { input: Recv, grad: Recv },
    /// `forward_step_helper`: chunk `chunk`'s forward of `microbatch` on the input
    /// `input_tensors[chunk]` holds for it, the output appended to `output_tensors[chunk]` and
    /// kept as the local `output_tensor`.
    Forward { chunk: u64, microbatch: u64 },
    /// `deallocate_output_tensor(output_tensor)` of the local.
    Deallocate,
    /// `backward_step_helper`: the oldest input, output and output gradient of `chunk` popped and
    /// backpropagated; the local `input_tensor_grad` rebound to the input's gradient.
    Backward { chunk: u64, microbatch: u64 },
}

/// `get_schedule_table`: each virtual micro-batch's (micro-batch, chunk).
fn schedule_table(n: u64, chunks: u64, group: u64) -> Vec<(u64, u64)> {
    let mut table = Vec::new();
    for start in (0..n).step_by(group as usize) {
        let end = if start + group >= n { n } else { start + group };
        for chunk in 0..chunks {
            table.extend((start..end).map(|microbatch| (microbatch, chunk)));
        }
    }
    table
}

/// The steps of pipeline rank `rank` of `pp`, with `vpp` chunks, over `n` micro-batches
/// (training, the micro-batch group `pp`), with `overlap_p2p_comm` or without.
pub(crate) fn interleaved(pp: u64, vpp: u64, n: u64, rank: u64, overlap: bool) -> Vec<Step> {
    let group = pp;
    let total = n * vpp;
    let warmup = (2 * (pp - rank - 1) + (vpp - 1) * group).min(total);
    let all_in_warmup = warmup == total;
    let remaining = total - warmup;
    let table = schedule_table(n, vpp, group);
    let (first, last) = (rank == 0, rank == pp - 1);
    let chunk_of = |k: u64, forward: bool| {
        let chunk = table[(k % total) as usize].1;
        if forward { chunk } else { vpp - 1 - chunk }
    };
    let microbatch_of = |k: u64| table[k as usize].0;
    // `recv_tensor_from_previous_stage`: whether iteration `k` receives, and for which chunk.
    let from_previous = |k: u64, forward: bool| -> (bool, u64) {
        let leading = if forward { first } else { last };
        if !leading {
            return (true, chunk_of(k + 1, forward));
        }
        let (mut recv, next) = if k < pp - 1 {
            (false, chunk_of(k + 1, forward))
        } else {
            (true, chunk_of(k - (pp - 1), forward))
        };
        let last_chunk = if forward { vpp - 1 } else { 0 };
        if next == last_chunk {
            recv = false;
        }
        // The chunk after (forward) or before (backward); unused when nothing is received.
        let next = if forward {
            next + 1
        } else {
            next.wrapping_sub(1)
        };
        (recv, next)
    };
    let into = |recv: bool, chunk: u64| {
        if recv {
            Recv::Into { chunk, bind: true }
        } else {
            Recv::Clear
        }
    };
    // The last chunk of the last rank sends nothing: its output (the loss) is not deallocated.
    let sends = |chunk: u64| !(last && chunk == vpp - 1);
    let mut steps = Vec::new();
    if !first {
        steps.push(Step::Communicate {
            input: Recv::Into {
                chunk: 0,
                bind: false,
            },
            grad: Recv::Keep,
        });
    }
    let mut output_sent = false;
    for k in 0..warmup {
        let chunk = chunk_of(k, true);
        let (mut recv_prev, next) = from_previous(k, true);
        if k == total - 1 {
            recv_prev = false;
        }
        steps.push(Step::Forward {
            chunk,
            microbatch: microbatch_of(k),
        });
        // The last warm-up iteration also receives the first gradient: in the same call
        // without the overlap, after the deallocation with it.
        let first_grad = k == warmup - 1 && !all_in_warmup;
        steps.push(Step::Communicate {
            input: into(recv_prev, next),
            grad: if first_grad && !overlap {
                into(!last, vpp - 1)
            } else {
                Recv::Keep
            },
        });
        output_sent = sends(chunk);
        if output_sent {
            steps.push(Step::Deallocate);
        }
        if first_grad && overlap {
            // Into `bwd_recv_buffer[-1]`, which holds it as a local would.
            steps.push(Step::Communicate {
                input: Recv::Keep,
                grad: into(!last, vpp - 1),
            });
        }
    }
    for k in 0..remaining {
        let forward_k = k + warmup;
        let forward_chunk = chunk_of(forward_k, true);
        let (mut recv_prev, next_forward) = from_previous(forward_k, true);
        let (recv_next, next_backward) = from_previous(k, false);
        if k == remaining - 1 {
            recv_prev = false;
        }
        // `pp_pre_forward`: the previous iteration's output is deallocated only now.
        if overlap && output_sent {
            steps.push(Step::Deallocate);
        }
        steps.push(Step::Forward {
            chunk: forward_chunk,
            microbatch: microbatch_of(forward_k),
        });
        if overlap {
            // `pp_post_forward`: the receive goes through `fwd_recv_buffer`, emptied at once,
            // into the list; `pp_post_backward`'s likewise through `bwd_recv_buffer`, which lets
            // the warm-up's gradient go when it is rebound.
            if recv_prev {
                steps.push(Step::Communicate {
                    input: Recv::Into {
                        chunk: next_forward,
                        bind: false,
                    },
                    grad: Recv::Keep,
                });
            }
        }
        steps.push(Step::Backward {
            chunk: chunk_of(k, false),
            microbatch: microbatch_of(k),
        });
        if overlap {
            steps.push(Step::Communicate {
                input: Recv::Keep,
                grad: into(recv_next, next_backward),
            });
            steps.push(Step::Communicate {
                input: Recv::Keep,
                grad: Recv::Clear,
            });
        } else {
            steps.push(Step::Communicate {
                input: into(recv_prev, next_forward),
                grad: into(recv_next, next_backward),
            });
        }
        output_sent = sends(forward_chunk);
        if output_sent && !overlap {
            steps.push(Step::Deallocate);
        }
    }
    // The steady phase's closing `deallocate_output_tensor` of the local, sent or not.
    if output_sent {
        steps.push(Step::Deallocate);
    }
    if all_in_warmup && !last {
        steps.push(Step::Communicate {
            input: Recv::Keep,
            grad: Recv::Into {
                chunk: vpp - 1,
                bind: false,
            },
        });
    }
    for k in remaining..total {
        steps.push(Step::Backward {
            chunk: chunk_of(k, false),
            microbatch: microbatch_of(k),
        });
        let (mut recv_next, next) = from_previous(k, false);
        if k == total - 1 {
            recv_next = false;
        }
        steps.push(Step::Communicate {
            input: Recv::Keep,
            grad: into(recv_next, next),
        });
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What megatron-core 0.19's interleaved schedule calls on pipeline rank `rank` of `pp` with
    /// `vpp` chunks over `n` micro-batches, recorded from its code by
    /// bench/megatron-pp-vpp/tools/schedule_steps.py: R an input receive, G a gradient receive,
    /// F<chunk>.<microbatch> a forward, D `deallocate_output_tensor`, B<chunk>.<microbatch> a
    /// backward (of the output the schedule popped).
    const MEGATRON_STEPS: &[(u64, u64, u64, u64, &str)] = &[
        (
            2,
            2,
            2,
            0,
            "F0.0 D F0.1 R D F1.0 R D F1.1 D D G B1.0 G B1.1 G B0.0 G B0.1",
        ),
        (
            2,
            2,
            2,
            1,
            "R F0.0 R D F0.1 R D F1.0 B1.0 R F1.1 B1.1 G B0.0 G B0.1",
        ),
        (
            2,
            2,
            4,
            0,
            "F0.0 D F0.1 R D F1.0 R D F1.1 G D F0.2 B1.0 G D F0.3 B1.1 R G D F1.2 B0.0 R G D F1.3 B0.1 G D D B1.2 G B1.3 G B0.2 G B0.3",
        ),
        (
            2,
            2,
            4,
            1,
            "R F0.0 R D F0.1 R D F1.0 B1.0 R F1.1 B1.1 R G F0.2 B0.0 R G D F0.3 B0.1 R D F1.2 B1.2 R F1.3 B1.3 G B0.2 G B0.3",
        ),
        (
            2,
            3,
            4,
            0,
            "F0.0 D F0.1 R D F1.0 R D F1.1 R D F2.0 R D F2.1 G D F0.2 B2.0 G D F0.3 B2.1 R G D F1.2 B1.0 R G D F1.3 B1.1 R G D F2.2 B0.0 R G D F2.3 B0.1 G D D B2.2 G B2.3 G B1.2 G B1.3 G B0.2 G B0.3",
        ),
        (
            2,
            3,
            4,
            1,
            "R F0.0 R D F0.1 R D F1.0 R D F1.1 R D F2.0 B2.0 R F2.1 B2.1 R G F0.2 B1.0 R G D F0.3 B1.1 R G D F1.2 B0.0 R G D F1.3 B0.1 R D F2.2 B2.2 R F2.3 B2.3 G B1.2 G B1.3 G B0.2 G B0.3",
        ),
        (
            4,
            2,
            4,
            0,
            "F0.0 D F0.1 D F0.2 D F0.3 R D F1.0 R D F1.1 R D F1.2 R D F1.3 D D G B1.0 G B1.1 G B1.2 G B1.3 G B0.0 G B0.1 G B0.2 G B0.3",
        ),
        (
            4,
            2,
            4,
            1,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D F1.0 R D F1.1 R D F1.2 R D F1.3 D D G B1.0 G B1.1 G B1.2 G B1.3 G B0.0 G B0.1 G B0.2 G B0.3",
        ),
        (
            4,
            2,
            4,
            2,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D F1.0 R D F1.1 R G D F1.2 B1.0 R G D F1.3 B1.1 G D D B1.2 G B1.3 G B0.0 G B0.1 G B0.2 G B0.3",
        ),
        (
            4,
            2,
            4,
            3,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D F1.0 B1.0 R F1.1 B1.1 R F1.2 B1.2 R F1.3 B1.3 G B0.0 G B0.1 G B0.2 G B0.3",
        ),
        (
            4,
            2,
            8,
            0,
            "F0.0 D F0.1 D F0.2 D F0.3 R D F1.0 R D F1.1 R D F1.2 R D F1.3 D F0.4 D F0.5 G D F0.6 B1.0 G D F0.7 B1.1 R G D F1.4 B1.2 R G D F1.5 B1.3 R G D F1.6 B0.0 R G D F1.7 B0.1 G D D B0.2 G B0.3 G B1.4 G B1.5 G B1.6 G B1.7 G B0.4 G B0.5 G B0.6 G B0.7",
        ),
        (
            4,
            2,
            8,
            1,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D F1.0 R D F1.1 R D F1.2 R D F1.3 R G D F0.4 B1.0 R G D F0.5 B1.1 R G D F0.6 B1.2 R G D F0.7 B1.3 R G D F1.4 B0.0 R G D F1.5 B0.1 R G D F1.6 B0.2 R G D F1.7 B0.3 G D D B1.4 G B1.5 G B1.6 G B1.7 G B0.4 G B0.5 G B0.6 G B0.7",
        ),
        (
            4,
            2,
            8,
            2,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D F1.0 R D F1.1 R G D F1.2 B1.0 R G D F1.3 B1.1 R G D F0.4 B1.2 R G D F0.5 B1.3 R G D F0.6 B0.0 R G D F0.7 B0.1 R G D F1.4 B0.2 R G D F1.5 B0.3 R G D F1.6 B1.4 R G D F1.7 B1.5 G D D B1.6 G B1.7 G B0.4 G B0.5 G B0.6 G B0.7",
        ),
        (
            4,
            2,
            8,
            3,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D F1.0 B1.0 R F1.1 B1.1 R F1.2 B1.2 R F1.3 B1.3 R G F0.4 B0.0 R G D F0.5 B0.1 R G D F0.6 B0.2 R G D F0.7 B0.3 R D F1.4 B1.4 R F1.5 B1.5 R F1.6 B1.6 R F1.7 B1.7 G B0.4 G B0.5 G B0.6 G B0.7",
        ),
        (
            2,
            2,
            6,
            0,
            "F0.0 D F0.1 R D F1.0 R D F1.1 G D F0.2 B1.0 G D F0.3 B1.1 R G D F1.2 B0.0 R G D F1.3 B0.1 G D F0.4 B1.2 G D F0.5 B1.3 R G D F1.4 B0.2 R G D F1.5 B0.3 G D D B1.4 G B1.5 G B0.4 G B0.5",
        ),
        (
            2,
            2,
            6,
            1,
            "R F0.0 R D F0.1 R D F1.0 B1.0 R F1.1 B1.1 R G F0.2 B0.0 R G D F0.3 B0.1 R D F1.2 B1.2 R F1.3 B1.3 R G F0.4 B0.2 R G D F0.5 B0.3 R D F1.4 B1.4 R F1.5 B1.5 G B0.4 G B0.5",
        ),
        (
            4,
            4,
            4,
            0,
            "F0.0 D F0.1 D F0.2 D F0.3 R D F1.0 R D F1.1 R D F1.2 R D F1.3 R D F2.0 R D F2.1 R D F2.2 R D F2.3 R D F3.0 R D F3.1 R D F3.2 R D F3.3 D D G B3.0 G B3.1 G B3.2 G B3.3 G B2.0 G B2.1 G B2.2 G B2.3 G B1.0 G B1.1 G B1.2 G B1.3 G B0.0 G B0.1 G B0.2 G B0.3",
        ),
        (
            4,
            4,
            4,
            1,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D F1.0 R D F1.1 R D F1.2 R D F1.3 R D F2.0 R D F2.1 R D F2.2 R D F2.3 R D F3.0 R D F3.1 R D F3.2 R D F3.3 D D G B3.0 G B3.1 G B3.2 G B3.3 G B2.0 G B2.1 G B2.2 G B2.3 G B1.0 G B1.1 G B1.2 G B1.3 G B0.0 G B0.1 G B0.2 G B0.3",
        ),
        (
            4,
            4,
            4,
            2,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D F1.0 R D F1.1 R D F1.2 R D F1.3 R D F2.0 R D F2.1 R D F2.2 R D F2.3 R D F3.0 R D F3.1 R G D F3.2 B3.0 R G D F3.3 B3.1 G D D B3.2 G B3.3 G B2.0 G B2.1 G B2.2 G B2.3 G B1.0 G B1.1 G B1.2 G B1.3 G B0.0 G B0.1 G B0.2 G B0.3",
        ),
        (
            4,
            4,
            4,
            3,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D F1.0 R D F1.1 R D F1.2 R D F1.3 R D F2.0 R D F2.1 R D F2.2 R D F2.3 R D F3.0 B3.0 R F3.1 B3.1 R F3.2 B3.2 R F3.3 B3.3 G B2.0 G B2.1 G B2.2 G B2.3 G B1.0 G B1.1 G B1.2 G B1.3 G B0.0 G B0.1 G B0.2 G B0.3",
        ),
    ];

    /// The same with `overlap_p2p_comm` (`schedule_steps.py --overlap`).
    const MEGATRON_OVERLAP_STEPS: &[(u64, u64, u64, u64, &str)] = &[
        (
            2,
            2,
            2,
            0,
            "F0.0 D F0.1 R D F1.0 R D F1.1 D D G B1.0 G B1.1 G B0.0 G B0.1",
        ),
        (
            2,
            2,
            2,
            1,
            "R F0.0 R D F0.1 R D D F1.0 R B1.0 F1.1 B1.1 G B0.0 G B0.1",
        ),
        (
            2,
            2,
            4,
            0,
            "F0.0 D F0.1 R D F1.0 R D F1.1 D G D F0.2 B1.0 G D F0.3 R B1.1 G D F1.2 R B0.0 G D F1.3 B0.1 G D B1.2 G B1.3 G B0.2 G B0.3",
        ),
        (
            2,
            2,
            4,
            1,
            "R F0.0 R D F0.1 R D D F1.0 R B1.0 F1.1 R B1.1 G F0.2 R B0.0 G D F0.3 R B0.1 D F1.2 R B1.2 F1.3 B1.3 G B0.2 G B0.3",
        ),
        (
            2,
            3,
            4,
            0,
            "F0.0 D F0.1 R D F1.0 R D F1.1 R D F2.0 R D F2.1 D G D F0.2 B2.0 G D F0.3 R B2.1 G D F1.2 R B1.0 G D F1.3 R B1.1 G D F2.2 R B0.0 G D F2.3 B0.1 G D B2.2 G B2.3 G B1.2 G B1.3 G B0.2 G B0.3",
        ),
        (
            2,
            3,
            4,
            1,
            "R F0.0 R D F0.1 R D F1.0 R D F1.1 R D D F2.0 R B2.0 F2.1 R B2.1 G F0.2 R B1.0 G D F0.3 R B1.1 G D F1.2 R B0.0 G D F1.3 R B0.1 D F2.2 R B2.2 F2.3 B2.3 G B1.2 G B1.3 G B0.2 G B0.3",
        ),
        (
            4,
            2,
            4,
            0,
            "F0.0 D F0.1 D F0.2 D F0.3 R D F1.0 R D F1.1 R D F1.2 R D F1.3 D D G B1.0 G B1.1 G B1.2 G B1.3 G B0.0 G B0.1 G B0.2 G B0.3",
        ),
        (
            4,
            2,
            4,
            1,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D F1.0 R D F1.1 R D F1.2 R D F1.3 D D G B1.0 G B1.1 G B1.2 G B1.3 G B0.0 G B0.1 G B0.2 G B0.3",
        ),
        (
            4,
            2,
            4,
            2,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D F1.0 R D F1.1 R D G D F1.2 R B1.0 G D F1.3 B1.1 G D B1.2 G B1.3 G B0.0 G B0.1 G B0.2 G B0.3",
        ),
        (
            4,
            2,
            4,
            3,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D D F1.0 R B1.0 F1.1 R B1.1 F1.2 R B1.2 F1.3 B1.3 G B0.0 G B0.1 G B0.2 G B0.3",
        ),
        (
            4,
            2,
            8,
            0,
            "F0.0 D F0.1 D F0.2 D F0.3 R D F1.0 R D F1.1 R D F1.2 R D F1.3 D F0.4 D F0.5 D G D F0.6 B1.0 G D F0.7 R B1.1 G D F1.4 R B1.2 G D F1.5 R B1.3 G D F1.6 R B0.0 G D F1.7 B0.1 G D B0.2 G B0.3 G B1.4 G B1.5 G B1.6 G B1.7 G B0.4 G B0.5 G B0.6 G B0.7",
        ),
        (
            4,
            2,
            8,
            1,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D F1.0 R D F1.1 R D F1.2 R D F1.3 R D G D F0.4 R B1.0 G D F0.5 R B1.1 G D F0.6 R B1.2 G D F0.7 R B1.3 G D F1.4 R B0.0 G D F1.5 R B0.1 G D F1.6 R B0.2 G D F1.7 B0.3 G D B1.4 G B1.5 G B1.6 G B1.7 G B0.4 G B0.5 G B0.6 G B0.7",
        ),
        (
            4,
            2,
            8,
            2,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D F1.0 R D F1.1 R D G D F1.2 R B1.0 G D F1.3 R B1.1 G D F0.4 R B1.2 G D F0.5 R B1.3 G D F0.6 R B0.0 G D F0.7 R B0.1 G D F1.4 R B0.2 G D F1.5 R B0.3 G D F1.6 R B1.4 G D F1.7 B1.5 G D B1.6 G B1.7 G B0.4 G B0.5 G B0.6 G B0.7",
        ),
        (
            4,
            2,
            8,
            3,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D D F1.0 R B1.0 F1.1 R B1.1 F1.2 R B1.2 F1.3 R B1.3 G F0.4 R B0.0 G D F0.5 R B0.1 G D F0.6 R B0.2 G D F0.7 R B0.3 D F1.4 R B1.4 F1.5 R B1.5 F1.6 R B1.6 F1.7 B1.7 G B0.4 G B0.5 G B0.6 G B0.7",
        ),
        (
            2,
            2,
            6,
            0,
            "F0.0 D F0.1 R D F1.0 R D F1.1 D G D F0.2 B1.0 G D F0.3 R B1.1 G D F1.2 R B0.0 G D F1.3 B0.1 G D F0.4 B1.2 G D F0.5 R B1.3 G D F1.4 R B0.2 G D F1.5 B0.3 G D B1.4 G B1.5 G B0.4 G B0.5",
        ),
        (
            2,
            2,
            6,
            1,
            "R F0.0 R D F0.1 R D D F1.0 R B1.0 F1.1 R B1.1 G F0.2 R B0.0 G D F0.3 R B0.1 D F1.2 R B1.2 F1.3 R B1.3 G F0.4 R B0.2 G D F0.5 R B0.3 D F1.4 R B1.4 F1.5 B1.5 G B0.4 G B0.5",
        ),
        (
            4,
            4,
            4,
            0,
            "F0.0 D F0.1 D F0.2 D F0.3 R D F1.0 R D F1.1 R D F1.2 R D F1.3 R D F2.0 R D F2.1 R D F2.2 R D F2.3 R D F3.0 R D F3.1 R D F3.2 R D F3.3 D D G B3.0 G B3.1 G B3.2 G B3.3 G B2.0 G B2.1 G B2.2 G B2.3 G B1.0 G B1.1 G B1.2 G B1.3 G B0.0 G B0.1 G B0.2 G B0.3",
        ),
        (
            4,
            4,
            4,
            1,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D F1.0 R D F1.1 R D F1.2 R D F1.3 R D F2.0 R D F2.1 R D F2.2 R D F2.3 R D F3.0 R D F3.1 R D F3.2 R D F3.3 D D G B3.0 G B3.1 G B3.2 G B3.3 G B2.0 G B2.1 G B2.2 G B2.3 G B1.0 G B1.1 G B1.2 G B1.3 G B0.0 G B0.1 G B0.2 G B0.3",
        ),
        (
            4,
            4,
            4,
            2,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D F1.0 R D F1.1 R D F1.2 R D F1.3 R D F2.0 R D F2.1 R D F2.2 R D F2.3 R D F3.0 R D F3.1 R D G D F3.2 R B3.0 G D F3.3 B3.1 G D B3.2 G B3.3 G B2.0 G B2.1 G B2.2 G B2.3 G B1.0 G B1.1 G B1.2 G B1.3 G B0.0 G B0.1 G B0.2 G B0.3",
        ),
        (
            4,
            4,
            4,
            3,
            "R F0.0 R D F0.1 R D F0.2 R D F0.3 R D F1.0 R D F1.1 R D F1.2 R D F1.3 R D F2.0 R D F2.1 R D F2.2 R D F2.3 R D D F3.0 R B3.0 F3.1 R B3.1 F3.2 R B3.2 F3.3 B3.3 G B2.0 G B2.1 G B2.2 G B2.3 G B1.0 G B1.1 G B1.2 G B1.3 G B0.0 G B0.1 G B0.2 G B0.3",
        ),
    ];

    fn calls(steps: &[Step]) -> String {
        let mut out = Vec::new();
        for step in steps {
            match *step {
                Step::Communicate { input, grad } => {
                    if matches!(input, Recv::Into { .. }) {
                        out.push("R".to_string());
                    }
                    if matches!(grad, Recv::Into { .. }) {
                        out.push("G".to_string());
                    }
                }
                Step::Forward { chunk, microbatch } => out.push(format!("F{chunk}.{microbatch}")),
                Step::Deallocate => out.push("D".to_string()),
                Step::Backward { chunk, microbatch } => out.push(format!("B{chunk}.{microbatch}")),
            }
        }
        out.join(" ")
    }

    #[test]
    fn every_rank_calls_what_megatron_calls() {
        for (overlap, recorded) in [(false, MEGATRON_STEPS), (true, MEGATRON_OVERLAP_STEPS)] {
            for &(pp, vpp, n, rank, expected) in recorded {
                assert_eq!(
                    calls(&interleaved(pp, vpp, n, rank, overlap)),
                    expected,
                    "pp {pp} vpp {vpp} n {n} rank {rank} overlap {overlap}"
                );
            }
        }
    }

    /// Every received tensor lands in the list of a chunk that uses it: each chunk's forwards
    /// find an input (but chunk 0 of the first rank, which reads the tokens), each backward
    /// pops one forward's output, and the lists are empty at the end.
    #[test]
    fn the_lists_balance() {
        for pp in 2..=6 {
            for vpp in 2..=4 {
                for n in (pp..=3 * pp).step_by(pp as usize) {
                    for (rank, overlap) in (0..pp).flat_map(|r| [(r, false), (r, true)]) {
                        let steps = interleaved(pp, vpp, n, rank, overlap);
                        let mut inputs = vec![0i64; vpp as usize];
                        let mut grads = vec![0i64; vpp as usize];
                        let mut forwards = vec![0i64; vpp as usize];
                        for step in &steps {
                            match *step {
                                Step::Communicate { input, grad } => {
                                    if let Recv::Into { chunk, .. } = input {
                                        inputs[chunk as usize] += 1;
                                    }
                                    if let Recv::Into { chunk, .. } = grad {
                                        grads[chunk as usize] += 1;
                                    }
                                }
                                Step::Forward { chunk, .. } => {
                                    forwards[chunk as usize] += 1;
                                    let c = chunk as usize;
                                    if !(rank == 0 && chunk == 0) {
                                        assert!(
                                            inputs[c] >= forwards[c],
                                            "pp {pp} vpp {vpp} n {n} rank {rank} overlap {overlap}"
                                        );
                                    }
                                }
                                _ => {}
                            }
                        }
                        for c in 0..vpp as usize {
                            assert_eq!(forwards[c], n as i64);
                            let expected_inputs = if rank == 0 && c == 0 { 0 } else { n as i64 };
                            assert_eq!(
                                inputs[c], expected_inputs,
                                "pp {pp} vpp {vpp} n {n} rank {rank} chunk {c}"
                            );
                            let expected_grads = if rank == pp - 1 && c == vpp as usize - 1 {
                                0
                            } else {
                                n as i64
                            };
                            assert_eq!(
                                grads[c], expected_grads,
                                "pp {pp} vpp {vpp} n {n} rank {rank} chunk {c}"
                            );
                        }
                    }
                }
            }
        }
    }
}
