//! Megatron-core pipeline parallelism (`parallel.framework: megatron` with `pp > 1`:
//! `forward_backward_pipelining_without_interleaving` over stages of GPTModel with Megatron's
//! DDP, distributed optimizer, tensor parallelism and recomputation) against bench/megatron-pp:
//! first, middle and last ranks of pipelines of 2 and 4 under torch's fake process group on
//! one H100; how the schedule bounds what a stage holds; and what the spec refuses by name.

use headroom::gpu;
use headroom::spec::RunSpec;
use serde_json::{Value, json};

use crate::common::{self, rel};

/// The load, schedule and optimizer peaks of every step of every row's rank within 1%, its
/// reserved peak within 8% (the accuracy gate): 1F1B's (bench/megatron-pp) and the interleaved
/// schedule's with and without `overlap_p2p_comm` (bench/megatron-pp-vpp).
#[test]
fn every_phase_of_every_megatron_pipeline_rank() {
    let mut checked = 0;
    for row in common::jsonl(&[
        include_str!("../../../../bench/megatron-pp/rows-h100-torch2.11.jsonl"),
        include_str!("../../../../bench/megatron-pp-vpp/rows-h100-torch2.11.jsonl"),
        include_str!("../../../../bench/megatron-pp-vpp/rows-moe-h100-torch2.11.jsonl"),
        include_str!("../../../../bench/megatron-pp-vpp/rows-overlap-h100-torch2.11.jsonl"),
    ]) {
        let (id, est, measured) = common::estimate_measured_rank(&row);
        let rank = measured["rank"].as_u64().expect("rank");
        assert_eq!(est.worst_rank, rank, "{id}: the rank asked for");
        let load = est.phases.iter().find(|p| p.step == 0).expect("load");
        let measured_load = measured["load"]["peak_allocated"].as_u64().expect("load");
        assert!(
            rel(load.peak_allocated, measured_load).abs() < 0.001,
            "{id} load"
        );
        checked += common::check_pipeline_rank(id, &est, measured, 0.01, 0.08);
    }
    assert_eq!(checked, 26 * 6, "every phase of the 26 rows");
}

fn spec(layers: u64, batch: u64, parallel: Value, megatron: Value) -> Value {
    json!({
        "model": "llama-3.1-8b",
        "model_config": common::llama_3_1_8b_widths(layers),
        "precision": "bf16",
        "optimizer": "adamw",
        "batch_size": batch,
        "seq_len": 2048,
        "parallel": parallel,
        "megatron": megatron,
    })
}

fn pipeline(world: u64, tp: u64, pp: u64, microbatches: u64) -> Value {
    json!({"strategy": "ddp", "world_size": world, "tp": tp, "framework": "megatron", "pp": pp,
        "microbatches": microbatches})
}

fn estimate(layers: u64, batch: u64, parallel: Value) -> headroom::estimate::Estimate {
    let spec = RunSpec::from_value(&spec(layers, batch, parallel, json!({}))).expect("valid");
    headroom::estimate::estimate(&spec, None, &gpu::find("h100-80gb").expect("gpu"))
        .expect("estimate")
}

fn stage_peak(est: &headroom::estimate::Estimate, stage: u64) -> u64 {
    est.stages
        .iter()
        .find(|s| s.stage == stage)
        .expect("stage")
        .peak_allocated
}

/// 1F1B holds at most `pp - r` micro-batches on rank `r`: past `pp` micro-batches the first
/// stage needs no more, below it less; the last stage runs each micro-batch's backward right
/// after its forward, so it needs the same whatever their number.
#[test]
fn one_f_one_b_bounds_the_micro_batches_a_stage_holds() {
    let two = estimate(8, 2, pipeline(4, 1, 4, 2));
    let four = estimate(8, 4, pipeline(4, 1, 4, 4));
    let eight = estimate(8, 8, pipeline(4, 1, 4, 8));
    assert_eq!(stage_peak(&four, 0), stage_peak(&eight, 0), "first stage");
    assert!(
        stage_peak(&two, 0) < stage_peak(&four, 0),
        "2 < pp micro-batches"
    );
    for est in [&two, &four] {
        assert_eq!(stage_peak(est, 3), stage_peak(&eight, 3), "last stage");
    }
    // Each rank's stage, with the worst named by its first global rank.
    assert_eq!(eight.stages.len(), 4);
    assert_eq!(eight.worst_rank, 0, "the first stage holds the most");
}

/// The example's 64 H100s: 4 stages of 20 layers over 16 ranks each (tp 8 × dp 2), the first
/// stage the worst, on its last data-parallel rank: the distributed optimizer's shard there is
/// the buffer's end, the embedding's rows, whose fp32 copy is made in one piece.
#[test]
fn the_70b_example_lists_its_four_stages() {
    let yaml = include_str!("../../../../examples/llama-3.1-70b-megatron-tp8-pp4-64xh100.yaml");
    let spec = RunSpec::from_str_at(yaml, std::path::Path::new("example.yaml")).expect("example");
    let est = headroom::estimate::estimate(&spec, None, &gpu::find("h100-80gb").expect("gpu"))
        .expect("estimate");
    assert_eq!(est.stages.len(), 4);
    let peaks: Vec<u64> = (0..4).map(|s| stage_peak(&est, s)).collect();
    assert!(peaks.windows(2).all(|w| w[0] > w[1]), "{peaks:?}");
    assert_eq!(est.worst_rank, 15);
    let first = headroom::estimate::estimate_rank(&spec, None, &gpu::find("h100-80gb").unwrap(), 0)
        .expect("rank 0");
    assert!(first.peak_reserved_bytes < est.peak_reserved_bytes);
    assert!(est.fits(), "the layout fits an H100");
}

/// What Megatron's pipeline cannot run, or what is not modelled, is refused naming the field,
/// the value and what is allowed; what it runs and torch's schedule refuses is accepted.
#[test]
fn megatron_pipelines_are_checked_by_name() {
    // Without a `megatron:` block: Megatron's defaults, checked alike.
    let check = |layers: u64, parallel: Value| {
        let mut spec = spec(layers, 4, parallel, json!({}));
        spec.as_object_mut().expect("a mapping").remove("megatron");
        RunSpec::from_value(&spec).and_then(|s| s.architecture(None, "").map(|_| s))
    };
    let refused = |layers: u64, parallel: Value, words: &[&str]| {
        let err = check(layers, parallel.clone())
            .expect_err(&parallel.to_string())
            .to_string();
        for w in words {
            assert!(err.contains(w), "{parallel}: {err}");
        }
    };
    let interleaved = |microbatches: u64| {
        json!({"strategy": "ddp", "world_size": 4, "framework": "megatron", "pp": 2, "vpp": 2,
            "schedule": "interleaved-1f1b", "microbatches": microbatches})
    };
    assert!(check(8, interleaved(4)).is_ok());
    refused(6, interleaved(4), &["parallel.vpp", "pp × vpp = 4"]);
    refused(
        8,
        interleaved(3),
        &["parallel.microbatches", "3", "groups of pp = 2"],
    );
    refused(
        8,
        json!({"strategy": "ddp", "world_size": 4, "framework": "megatron", "pp": 2,
            "schedule": "gpipe", "microbatches": 4}),
        &["gpipe", "interleaved-1f1b"],
    );
    refused(6, pipeline(4, 1, 4, 4), &["parallel.pp", "4", "divides"]);
    refused(
        9,
        json!({"strategy": "ddp", "world_size": 4, "framework": "megatron", "pp": 4,
            "microbatches": 4, "layers_per_stage": [2, 3, 2, 2]}),
        &["parallel.layers_per_stage", "[2, 3, 2, 2]", "middle"],
    );
    refused(
        8,
        json!({"strategy": "fsdp", "world_size": 4, "framework": "megatron", "pp": 2}),
        &["parallel.strategy", "fsdp"],
    );
    // Megatron's 1F1B runs fewer micro-batches than stages; torch's Schedule1F1B does not.
    assert!(check(8, pipeline(4, 1, 4, 2)).is_ok());
    assert!(
        check(
            9,
            json!({"strategy": "ddp", "world_size": 4, "framework": "megatron", "pp": 4,
            "microbatches": 4, "layers_per_stage": [1, 3, 3, 2]})
        )
        .is_ok()
    );
    refused(
        8,
        json!({"strategy": "none", "world_size": 4, "pp": 4, "microbatches": 2}),
        &["parallel.microbatches", "Schedule1F1B"],
    );
}

/// Under the distributed optimizer each data-parallel rank makes its fp32 main parameters of
/// its own parts of the gradient buffer (other sizes, in another order): every rank of the
/// three real-NCCL pipelines with a data-parallel group (bench/nccl-megatron-x4) is simulated
/// as itself, every phase within 0.1% and reserved within 0.5%, and the rank an estimate of
/// the layout names as its worst is the one measured to reserve most, at its reserved peak.
#[test]
fn each_data_parallel_rank_of_the_distributed_optimizer_is_its_own() {
    let rows = common::jsonl(&[include_str!(
        "../../../../bench/nccl-megatron-x4/rows-nccl-h200x4-torch2.11.jsonl"
    )]);
    let gpu = gpu::find("h200").expect("gpu");
    let mut layouts = 0;
    for row in &rows {
        let id = row["id"].as_str().expect("id");
        let spec = RunSpec::from_value(&row["spec"]).expect(id);
        let pipelined = spec.parallel.as_ref().is_some_and(|p| p.pipeline.pp > 1);
        if !pipelined || !spec.megatron.is_some_and(|m| m.distributed_optimizer) {
            continue;
        }
        layouts += 1;
        let ranks = row["measured"]["ranks"].as_array().expect("ranks");
        for measured in ranks {
            let rank = measured["rank"].as_u64().expect("rank");
            let est = headroom::estimate::estimate_rank(&spec, None, &gpu, rank).expect(id);
            common::check_pipeline_rank(&format!("{id} rank {rank}"), &est, measured, 0.001, 0.005);
        }
        let reserved = |m: &Value| m["peak_reserved_bytes"].as_u64().expect("reserved");
        let worst = ranks.iter().max_by_key(|m| reserved(m)).expect("ranks");
        let est = headroom::estimate::estimate(&spec, None, &gpu).expect(id);
        assert_eq!(Some(est.worst_rank), worst["rank"].as_u64(), "{id}");
        assert!(
            rel(est.peak_reserved_bytes, reserved(worst)).abs() < 0.005,
            "{id}"
        );
    }
    assert_eq!(layouts, 3);
}
