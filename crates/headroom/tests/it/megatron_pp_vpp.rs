//! Megatron-core's interleaved 1F1B (`vpp` model chunks per pipeline rank:
//! `forward_backward_pipelining_with_interleaving` over chunks of GPTModel, each with its own
//! DDP buffer and one optimizer over all): what the interleaving costs the first rank and what
//! the p2p overlap costs a middle one (their measured rows, bench/megatron-pp-vpp, are checked phase by phase with 1F1B's in
//! `megatron_pp`).

use headroom::gpu;
use headroom::spec::RunSpec;
use serde_json::{Value, json};

use crate::common;

/// Llama-3.1-8B's widths cut to 8 layers over a pipeline of 4 ranks with `vpp` chunks each
/// (1: Megatron's 1F1B), 8 micro-batches of one 2048-token sequence.
fn spec(vpp: u64, megatron: Value) -> headroom::error::Result<RunSpec> {
    let mut parallel = json!({"strategy": "ddp", "world_size": 4, "framework": "megatron",
        "pp": 4, "microbatches": 8});
    if vpp > 1 {
        parallel["vpp"] = json!(vpp);
        parallel["schedule"] = json!("interleaved-1f1b");
    }
    let spec = json!({"model": "llama-3.1-8b", "model_config": common::llama_3_1_8b_widths(8),
        "precision": "bf16", "optimizer": "adamw", "batch_size": 8, "seq_len": 2048,
        "parallel": parallel, "megatron": megatron});
    RunSpec::from_value(&spec).and_then(|s| s.architecture(None, "").map(|_| s))
}

/// The peak allocated of pipeline rank `rank`'s schedule phases.
fn schedule_peak(spec: &RunSpec, rank: u64) -> u64 {
    let est =
        headroom::estimate::estimate_rank(spec, None, &gpu::find("h100-80gb").expect("gpu"), rank)
            .expect("estimate");
    est.phases
        .iter()
        .filter(|p| p.phase == "schedule")
        .map(|p| p.peak_allocated)
        .max()
        .expect("schedule phases")
}

/// The first rank runs `2 (pp - 1) + (vpp - 1) pp` warm-up forwards of chunks of
/// `layers / (pp vpp)` layers: at pp 4 and vpp 2 it holds 10 half-stages where 1F1B holds 4
/// whole ones, so its schedule needs more than 1F1B's; the last rank runs each micro-batch's
/// last chunk right through, as 1F1B does, and holds less than the first.
#[test]
fn interleaving_costs_the_first_rank_activations() {
    let interleaved = spec(2, json!({})).expect("valid");
    let plain = schedule_peak(&spec(1, json!({})).expect("valid"), 0);
    let first = schedule_peak(&interleaved, 0);
    assert!(
        first > plain,
        "first rank: interleaved {first} vs 1F1B {plain}"
    );
    assert!(schedule_peak(&interleaved, 3) < first);
}

/// `megatron.overlap_p2p_comm` unset is Megatron-LM's default for an interleaved pipeline, the
/// overlap, which holds each round's next input through its backward: a middle rank's schedule
/// needs more with it. It applies to no other schedule, which refuses it naming the field.
#[test]
fn the_interleaved_schedule_overlaps_its_receives_by_default() {
    let peak = |megatron: Value| schedule_peak(&spec(2, megatron).expect("valid"), 2);
    let default = peak(json!({}));
    assert_eq!(default, peak(json!({"overlap_p2p_comm": true})));
    let plain = peak(json!({"overlap_p2p_comm": false}));
    assert!(default > plain, "overlapped {default} vs not {plain}");
    let err = spec(1, json!({"overlap_p2p_comm": true}))
        .expect_err("1F1B does not overlap")
        .to_string();
    assert!(
        err.contains("megatron.overlap_p2p_comm") && err.contains("vpp"),
        "{err}"
    );
    assert!(spec(1, json!({"overlap_p2p_comm": false})).is_ok());
}
