//! Megatron-core estimates (`parallel.framework: megatron`: GPTModel with the local layer spec,
//! Megatron's DDP and its mixed-precision or distributed optimizer) against bench/megatron:
//! rank 0 of worlds of 1 to 64 under torch's fake process group on one H100; and what the spec
//! refuses by name.

use headroom::gpu;
use headroom::spec::RunSpec;
use serde_json::{Value, json};

use crate::common::{self, rel};

/// Every load, forward, backward and optimizer peak of every step of every row within 1%, the
/// run's reserved peak within 5%, the global parameter count.
#[test]
fn every_phase_of_every_megatron_row() {
    let mut checked = 0;
    for row in common::jsonl(&[include_str!(
        "../../../../bench/megatron/rows-call2-h100-torch2.11.jsonl"
    )]) {
        let id = row["id"].as_str().expect("id");
        let (est, phases) = common::check_every_phase(&row, 0.01, 0.05);
        checked += phases;
        let load = est.phases.iter().find(|p| p.step == 0).expect("load");
        let measured_load = row["measured"]["ranks"][0]["load"]["peak_allocated"]
            .as_u64()
            .expect("load");
        assert!(
            rel(load.peak_allocated, measured_load).abs() < 0.001,
            "{id} load"
        );
    }
    assert_eq!(checked, 12 * 9, "every phase of the twelve rows");
}

/// Megatron's `tensor_parallel.checkpoint` (reentrant) keeps the gradient it receives through
/// the whole recomputed backward of its region (`CheckpointFunction.backward`'s `args`): with it,
/// every phase of every row with recomputation, full or selective, is within 0.3% (without it,
/// up to 0.68% under).
#[test]
fn recomputed_regions_hold_their_output_gradient() {
    let rows = common::jsonl(&[include_str!(
        "../../../../bench/megatron/rows-call2-h100-torch2.11.jsonl"
    )]);
    let recomputed: Vec<&Value> = rows
        .iter()
        .filter(|r| r["spec"]["megatron"]["recompute_granularity"].is_string())
        .collect();
    assert!(recomputed.len() >= 4, "rows with recomputation");
    for row in recomputed {
        common::check_every_phase(row, 0.003, 0.05);
    }
}

fn spec(parallel: Value, megatron: Value) -> Value {
    json!({
        "model": "llama-3.1-8b",
        "model_config": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 128256, "num_hidden_layers": 4, "tie_word_embeddings": false},
        "precision": "bf16",
        "optimizer": "adamw",
        "batch_size": 1,
        "seq_len": 2048,
        "parallel": parallel,
        "megatron": megatron,
    })
}

fn estimate(world: u64, tp: u64, megatron: Value) -> headroom::estimate::Estimate {
    let parallel =
        json!({"strategy": "ddp", "world_size": world, "tp": tp, "framework": "megatron"});
    let spec = RunSpec::from_value(&spec(parallel, megatron)).expect("valid spec");
    headroom::estimate::estimate(&spec, None, &gpu::find("h100-80gb").expect("gpu"))
        .expect("estimate")
}

fn component(est: &headroom::estimate::Estimate, name: &str) -> u64 {
    est.breakdown
        .iter()
        .find(|(c, _)| c.key() == name)
        .map_or(0, |&(_, b)| b)
}

/// The distributed optimizer shards the fp32 main parameters and Adam's states over the
/// data-parallel ranks (the fp32 gradient buffer stays whole); recomputation trades the saved
/// activations for a recomputation, full more than selective.
#[test]
fn distributed_optimizer_shards_states_and_recomputation_saves_activations() {
    let plain = estimate(8, 2, json!({}));
    let sharded = estimate(8, 2, json!({"distributed_optimizer": true}));
    let (states, sharded_states) = (
        component(&plain, "optimizer_states"),
        component(&sharded, "optimizer_states"),
    );
    let ratio = states as f64 / sharded_states as f64;
    assert!(
        (ratio - 4.0).abs() < 0.05,
        "states, plain / sharded over dp 4: {ratio}"
    );
    let forward = |est: &headroom::estimate::Estimate| {
        est.phases
            .iter()
            .find(|p| p.step == 2 && p.phase == "forward")
            .expect("forward")
            .peak_allocated
    };
    let selective = estimate(8, 2, json!({"recompute_granularity": "selective"}));
    let full = estimate(8, 2, json!({"recompute_granularity": "full"}));
    assert!(
        forward(&selective) < forward(&plain),
        "selective recomputation"
    );
    assert!(forward(&full) < forward(&selective), "full recomputation");
    let block = estimate(
        8,
        2,
        json!({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}),
    );
    assert!(forward(&full) < forward(&block) && forward(&block) < forward(&plain));
}

/// What is not modelled is refused naming the field, the value and what is allowed.
#[test]
fn unmodelled_megatron_layouts_are_refused_by_name() {
    let refused = |parallel: Value, megatron: Value, field: &str| {
        let err = RunSpec::from_value(&spec(parallel.clone(), megatron.clone()))
            .and_then(|s| s.architecture(None, "").map(|_| s))
            .expect_err(&format!("{parallel} {megatron}"))
            .to_string();
        assert!(err.contains(field), "{parallel} {megatron}: {err}");
    };
    let megatron =
        |tp: u64| json!({"strategy": "ddp", "world_size": 8, "tp": tp, "framework": "megatron"});
    refused(
        json!({"strategy": "fsdp", "world_size": 8, "tp": 2, "framework": "megatron"}),
        json!({}),
        "parallel.strategy",
    );
    refused(
        megatron(2),
        json!({"pipeline_model_parallel_size": 2}),
        "pipeline parallelism",
    );
    refused(
        megatron(2),
        json!({"expert_model_parallel_size": 2}),
        "expert parallelism",
    );
    refused(
        megatron(2),
        json!({"recompute_method": "block"}),
        "megatron.recompute_method",
    );
    refused(
        megatron(2),
        json!({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 5}),
        "megatron.recompute_num_layers",
    );
    // 8 query groups do not split over 16 ranks.
    refused(
        json!({"strategy": "ddp", "world_size": 16, "tp": 16, "framework": "megatron"}),
        json!({}),
        "parallel.tp",
    );
    // The megatron block without the framework.
    refused(
        json!({"strategy": "ddp", "world_size": 8}),
        json!({"distributed_optimizer": true}),
        "megatron",
    );
}
