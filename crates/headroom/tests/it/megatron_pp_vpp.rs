//! Megatron-core's interleaved 1F1B (`vpp` model chunks per pipeline rank:
//! `forward_backward_pipelining_with_interleaving` over chunks of GPTModel, each with its own
//! DDP buffer and one optimizer over all) against bench/megatron-pp-vpp: first, middle and last
//! ranks of pipelines of 2 and 4 with 2 and 3 chunks, dense and MoE, under torch's fake process
//! group on one H100; and what the interleaving costs the first rank.

use headroom::gpu;
use headroom::spec::RunSpec;
use serde_json::json;

use crate::common;

/// The schedule and optimizer peaks of every step of every row's rank within 1%, its reserved
/// peak within 8%.
#[test]
fn every_phase_of_every_interleaved_megatron_rank() {
    let mut checked = 0;
    for row in common::jsonl(&[
        include_str!("../../../../bench/megatron-pp-vpp/rows-h100-torch2.11.jsonl"),
        include_str!("../../../../bench/megatron-pp-vpp/rows-moe-h100-torch2.11.jsonl"),
    ]) {
        let id = row["id"].as_str().expect("id");
        let spec = RunSpec::from_value(&row["spec"]).expect(id);
        let gpu = gpu::from_device_name(row["env"]["gpu"].as_str().expect("gpu")).expect("gpu");
        let measured = &row["measured"]["ranks"][0];
        let rank = measured["rank"].as_u64().expect("rank");
        let est = headroom::estimate::estimate_rank(&spec, None, &gpu, rank).expect(id);
        assert_eq!(est.worst_rank, rank, "{id}: the rank asked for");
        checked += common::check_pipeline_rank(id, &est, measured, 0.01, 0.08);
    }
    assert_eq!(checked, 13 * 6, "every phase of the thirteen rows");
}

/// The first rank runs `2 (pp - 1) + (vpp - 1) pp` warm-up forwards of chunks of
/// `layers / (pp vpp)` layers: at pp 4 and vpp 2 it holds 10 half-stages where 1F1B holds 4
/// whole ones, so its schedule needs more than 1F1B's; the last rank runs each micro-batch's
/// last chunk right through, as 1F1B does, and holds less than the first.
#[test]
fn interleaving_costs_the_first_rank_activations() {
    let estimate = |vpp: u64, rank: u64| {
        let mut parallel = json!({"strategy": "ddp", "world_size": 4, "framework": "megatron",
            "pp": 4, "microbatches": 8});
        if vpp > 1 {
            parallel["vpp"] = json!(vpp);
            parallel["schedule"] = json!("interleaved-1f1b");
        }
        let spec = json!({"model": "llama-3.1-8b", "model_config": common::llama_3_1_8b_widths(8),
            "precision": "bf16", "optimizer": "adamw", "batch_size": 8, "seq_len": 2048,
            "parallel": parallel, "megatron": {}});
        let spec = RunSpec::from_value(&spec).expect("valid");
        headroom::estimate::estimate_rank(&spec, None, &gpu::find("h100-80gb").expect("gpu"), rank)
            .expect("estimate")
    };
    let schedule_peak = |est: &headroom::estimate::Estimate| {
        est.phases
            .iter()
            .filter(|p| p.phase == "schedule")
            .map(|p| p.peak_allocated)
            .max()
            .expect("schedule phases")
    };
    let (plain, interleaved) = (estimate(1, 0), estimate(2, 0));
    assert!(
        schedule_peak(&interleaved) > schedule_peak(&plain),
        "first rank: interleaved {} vs 1F1B {}",
        schedule_peak(&interleaved),
        schedule_peak(&plain)
    );
    let last = estimate(2, 3);
    assert!(schedule_peak(&last) < schedule_peak(&interleaved));
}
