//! Megatron-core with sequence parallelism (`parallel.sequence_parallel` with framework
//! megatron: the local layer spec, its torch norms marked `sequence_parallel`) against
//! bench/megatron-sp: bench/megatron's tensor-parallel rows again with sequence parallelism, rank
//! 0 of fake worlds on one H200; what it saves, and what stays refused by name.

use headroom::estimate::Estimate;
use headroom::gpu;
use headroom::spec::RunSpec;
use serde_json::{Value, json};

use crate::common::{self, rel};

const ROWS: &str = include_str!("../../../../bench/megatron-sp/rows-h200-torch2.11.jsonl");
const WITHOUT: &str = include_str!("../../../../bench/megatron/rows-call2-h100-torch2.11.jsonl");

/// Every load, forward, backward and optimizer peak of every step of every row within 1%, the
/// reserved peak within 5%.
#[test]
fn every_phase_of_every_sequence_parallel_row() {
    let mut checked = 0;
    for row in common::jsonl(&[ROWS]) {
        assert_eq!(row["spec"]["parallel"]["sequence_parallel"], true);
        let (est, phases) = common::check_every_phase(&row, 0.01, 0.05);
        checked += phases;
        let load = est.phases.iter().find(|p| p.step == 0).expect("load");
        let measured = row["measured"]["ranks"][0]["load"]["peak_allocated"]
            .as_u64()
            .expect("load");
        assert!(rel(load.peak_allocated, measured).abs() < 0.001, "load");
    }
    assert_eq!(checked, 10 * 9, "every phase of the ten rows");
}

fn step2(est: &Estimate, phase: &str) -> u64 {
    est.phases
        .iter()
        .find(|p| p.step == 2 && p.phase == phase)
        .expect(phase)
        .peak_allocated
}

/// What sequence parallelism saves on each row's forward and backward peaks, against the same
/// row measured without it (bench/megatron): the estimate's saving within 3% of the measured one
/// (150 to 590 MB).
#[test]
fn sequence_parallelism_saves_what_it_measurably_saves() {
    let without = common::jsonl(&[WITHOUT]);
    for row in common::jsonl(&[ROWS]) {
        let id = row["id"].as_str().expect("id");
        let twin_id = id
            .replacen("megatron-sp/", "megatron/", 1)
            .replace("-sp-", "-");
        let twin = without
            .iter()
            .find(|r| r["id"] == twin_id.as_str())
            .expect(&twin_id);
        let (_, est, measured) = common::estimate_measured_rank(&row);
        let (_, twin_est, twin_measured) = common::estimate_measured_rank(twin);
        for (key, phase) in [("fwd_peak", "forward"), ("bwd_peak", "backward")] {
            let peak = |m: &Value| m["steps"][1][key].as_u64().expect(key);
            let saved = peak(twin_measured) as f64 - peak(measured) as f64;
            let estimated = step2(&twin_est, phase) as f64 - step2(&est, phase) as f64;
            assert!(saved > 1e8, "{id} {phase}: {saved}");
            assert!(
                (estimated / saved - 1.0).abs() < 0.03,
                "{id} {phase}: saves {estimated} estimated, {saved} measured"
            );
        }
    }
}

fn estimate(layers: u64, sequence_parallel: bool, megatron: Value) -> Estimate {
    let spec = json!({
        "model": "llama-3.1-8b",
        "model_config": common::llama_3_1_8b_widths(layers),
        "precision": "bf16",
        "optimizer": "adamw",
        "batch_size": 1,
        "seq_len": 2048,
        "parallel": {"strategy": "ddp", "world_size": 2, "tp": 2,
            "sequence_parallel": sequence_parallel, "framework": "megatron"},
        "megatron": megatron,
    });
    let spec = RunSpec::from_value(&spec).expect("valid spec");
    headroom::estimate::estimate(&spec, None, &gpu::find("h200").expect("gpu")).expect("estimate")
}

/// Under full recomputation a layer keeps only its input, the residual stream `[s, b, h]` bf16;
/// with sequence parallelism over tp 2 it is half the sequence. Four more layers add four
/// such inputs to the forward peak (weights and buffers add the same with or without it), so
/// sequence parallelism saves four half-inputs more: 4 × 2048 × 4096 × 2 / 2 bytes.
#[test]
fn sequence_parallelism_halves_the_saved_residual_stream() {
    let full = json!({"recompute_granularity": "full"});
    let growth = |sp: bool| {
        step2(&estimate(8, sp, full.clone()), "forward")
            - step2(&estimate(4, sp, full.clone()), "forward")
    };
    assert_eq!(growth(false) - growth(true), 4 * 2048 * 4096 * 2 / 2);
}

/// Sequence parallelism runs inside a pipeline (bench/megatron-pp-sp) and with MoE layers
/// (bench/megatron-moe-sp): neither is refused, and a stage sends and receives its `1/tp` of
/// the sequence.
#[test]
fn sequence_parallelism_runs_inside_pipelines_and_with_moe_layers() {
    let mut spec = json!({
        "model": "llama-3.1-8b",
        "model_config": common::llama_3_1_8b_widths(4),
        "precision": "bf16",
        "optimizer": "adamw",
        "batch_size": 2,
        "seq_len": 2048,
        "parallel": {"strategy": "ddp", "world_size": 8, "tp": 2, "pp": 2, "microbatches": 2,
            "framework": "megatron"},
    });
    let without = common::estimate_value(&spec);
    spec["parallel"]["sequence_parallel"] = json!(true);
    let with = common::estimate_value(&spec);
    assert!(with.peak_allocated_bytes < without.peak_allocated_bytes);
    spec["parallel"]["pp"] = json!(1);
    spec["parallel"]
        .as_object_mut()
        .unwrap()
        .remove("microbatches");
    spec["model_config"] = json!({
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
        "num_hidden_layers": 2, "tie_word_embeddings": false,
    });
    spec["model"] = json!("qwen3-30b-a3b");
    common::estimate_value(&spec);
}
