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

/// Megatron-LM's optimizer offload (bench/megatron-offload): every phase of every rank without
/// a pipeline within 0.1%, the reserved peak within 0.1%, with and without the copies on side
/// streams.
#[test]
fn every_phase_of_every_offloaded_optimizer_row() {
    let mut checked = 0;
    for row in common::jsonl(&[
        include_str!("../../../../bench/megatron-offload/rows-h200-torch2.11.jsonl"),
        include_str!("../../../../bench/megatron-offload/rows-call2-h200-torch2.11.jsonl"),
    ]) {
        if row["spec"]["parallel"]["pp"].as_u64().unwrap_or(1) > 1 {
            continue;
        }
        checked += common::check_every_phase(&row, 0.001, 0.001).1;
    }
    assert_eq!(
        checked,
        10 * 9,
        "every phase of the ten ranks without a pipeline"
    );
}

/// Where loading peaks above every step (an offloaded optimizer under full recomputation,
/// whose steps hold little), the estimate says so, at the measured load's peak.
#[test]
fn a_load_above_every_step_is_said() {
    let rows = common::jsonl(&[include_str!(
        "../../../../bench/megatron-offload/rows-call2-h200-torch2.11.jsonl"
    )]);
    let mut said = 0;
    for row in &rows {
        let id = row["id"].as_str().expect("id");
        let spec = RunSpec::from_value(&row["spec"]).expect(id);
        let rank = &row["measured"]["ranks"][0];
        let est = headroom::estimate::estimate_rank(
            &spec,
            None,
            &gpu::find("h200").expect("gpu"),
            rank["rank"].as_u64().expect("rank"),
        )
        .expect(id);
        let load = rank["load"]["peak_allocated"].as_u64().expect("load");
        let steps = headroom::validate::ranks_steps_peak(std::slice::from_ref(rank)).expect(id);
        match est.load_peak_above_steps() {
            Some(predicted) => {
                assert!(load > steps, "{id}: the measured load is above the steps");
                assert!(common::rel(predicted, load).abs() < 0.001, "{id}");
                said += 1;
            }
            None => assert!(load <= steps, "{id}: the measured load is not above"),
        }
    }
    assert_eq!(
        said, 2,
        "the two Qwen3-4B pipeline ranks under full recomputation"
    );
}

/// The offload leaves no fp32 main parameters or Adam states on the GPU, only the step's
/// temporaries; overlapping its copies moves their casts to streams of their own, which the
/// allocated peak does not see and the reserved one does.
#[test]
fn the_offloaded_optimizer_keeps_no_states_on_the_gpu() {
    let sharded = estimate(8, 2, json!({"distributed_optimizer": true}));
    let offloaded = estimate(
        8,
        2,
        json!({"distributed_optimizer": true, "optimizer_cpu_offload": true}),
    );
    let overlapped = estimate(
        8,
        2,
        json!({"distributed_optimizer": true, "optimizer_cpu_offload": true,
            "overlap_cpu_optimizer_d2h_h2d": true}),
    );
    assert!(component(&sharded, "optimizer_states") > 0);
    assert_eq!(component(&offloaded, "optimizer_states"), 0);
    // On the host: the fp32 main parameters and Adam's states the GPU no longer holds (12
    // bytes an element), and the pinned fp32 gradients (4 more).
    assert_eq!(sharded.host_bytes, 0);
    assert_eq!(
        offloaded.host_bytes * 3,
        component(&sharded, "optimizer_states") * 4
    );
    assert!(offloaded.peak_allocated_bytes < sharded.peak_allocated_bytes);
    assert_eq!(
        overlapped.peak_allocated_bytes,
        offloaded.peak_allocated_bytes
    );
    assert!(overlapped.peak_reserved_bytes > offloaded.peak_reserved_bytes);
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

/// Tied word embeddings (`share_embeddings_and_output_weights`, Megatron-LM's default unless
/// `--untie-embeddings-and-output-weights`): with one stage the output layer multiplies by the
/// embedding's weight, one vocab × hidden matrix fewer with its gradient and Adam's states; a
/// pipeline's last stage holds a copy of its own, so its stages are the untied model's.
#[test]
fn tied_embeddings_share_one_weight_on_one_stage_and_copy_it_on_the_last() {
    let run = |tied: bool, parallel: Value| {
        let mut value = spec(parallel, json!({}));
        value["model_config"]["tie_word_embeddings"] = json!(tied);
        let spec = RunSpec::from_value(&value).expect("valid spec");
        headroom::estimate::estimate(&spec, None, &gpu::find("h200").expect("gpu"))
            .expect("estimate")
    };
    let one_stage = json!({"strategy": "ddp", "world_size": 4, "tp": 2, "framework": "megatron"});
    let (untied, tied) = (run(false, one_stage.clone()), run(true, one_stage));
    let matrix = 128256 / 2 * 4096;
    assert_eq!(
        component(&untied, "weights") - component(&tied, "weights"),
        2 * matrix,
        "the bf16 output weight"
    );
    assert_eq!(
        component(&untied, "optimizer_states") - component(&tied, "optimizer_states"),
        12 * matrix,
        "its fp32 main parameter and Adam's two states"
    );
    let pipeline = json!({"strategy": "ddp", "world_size": 4, "tp": 2, "framework": "megatron",
        "pp": 2, "microbatches": 1});
    let (untied, tied) = (run(false, pipeline.clone()), run(true, pipeline));
    let peaks = |est: &headroom::estimate::Estimate| {
        est.stages
            .iter()
            .map(|s| (s.peak_allocated, s.peak_reserved))
            .collect::<Vec<_>>()
    };
    assert_eq!(peaks(&untied), peaks(&tied));
    assert_eq!(tied.stages.len(), 2);
}

/// Mixtral's router (top 2 of 8, renormalised) is Megatron's `TopKRouter` without
/// `moe_router_pre_softmax`, as Qwen3-MoE's; a shared expert is not modelled and is refused.
#[test]
fn mixtral_runs_as_megatron_moe_and_shared_experts_are_refused() {
    let moe = |model: &str, ep: u64| {
        RunSpec::from_value(&json!({
            "model": model, "precision": "bf16", "optimizer": "adamw", "batch_size": 1,
            "seq_len": 1024,
            "parallel": {"strategy": "ddp", "world_size": 8, "framework": "megatron"},
            "megatron": {"expert_model_parallel_size": ep, "distributed_optimizer": true},
        }))
        .expect("valid spec")
    };
    let h200 = gpu::find("h200").expect("gpu");
    let est = |ep| headroom::estimate::estimate(&moe("mixtral-8x7b", ep), None, &h200);
    let (ep8, ep2) = (est(8).expect("ep 8"), est(2).expect("ep 2"));
    assert!(
        component(&ep8, "weights") * 3 < component(&ep2, "weights"),
        "one expert of eight a rank against four"
    );
    let err = headroom::estimate::estimate(&moe("qwen2-57b-a14b", 8), None, &h200)
        .expect_err("a shared expert")
        .to_string();
    assert!(err.contains("Qwen3-MoE and Mixtral"), "{err}");
}
