//! torchtitan's PP × FSDP2 (each pipeline stage `fully_shard`ed over the data-parallel ranks,
//! with or without tensor parallelism under it, and driven by torch 2.11's schedules) against
//! bench/pp's rows of it, how the composition behaves as the sharding, the policy and the
//! resharding change, and the layouts still refused.

use headroom::estimate::Estimate;
use headroom::gpu;
use headroom::sim::Component;
use headroom::spec::{Document, RunSpec};
use serde_json::{Value, json};

use crate::common;

/// The schedule and optimizer peaks of every step of every row's rank within 0.2%, its
/// reserved peak within 1%.
#[test]
fn every_phase_of_every_sharded_pipeline_rank() {
    let rows = common::jsonl(&[
        include_str!("../../../../bench/pp/rows-fsdp-h100-torch2.11.jsonl"),
        include_str!("../../../../bench/pp/rows-fsdp-call2-h100-torch2.11.jsonl"),
    ]);
    let mut checked = 0;
    for row in rows {
        let (id, est, measured) = common::estimate_measured_rank(&row);
        checked += common::check_pipeline_rank(id, &est, measured, 0.002, 0.01);
    }
    assert_eq!(checked, 78, "13 rows of 3 steps of 2 phases");
}

/// Llama-3.1-8B's widths cut to 4 layers: stage 0 of 2 holds the embedding and 2 layers.
fn spec(parallel: Value, precision: &str) -> RunSpec {
    RunSpec::from_value(&json!({
        "model": "llama-3.1-8b",
        "model_config": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 128256, "num_hidden_layers": 4, "tie_word_embeddings": false},
        "precision": precision,
        "optimizer": "adamw",
        "batch_size": 4,
        "seq_len": 1024,
        "parallel": parallel,
    }))
    .expect("valid spec")
}

fn estimate_rank(spec: &RunSpec, rank: u64) -> Estimate {
    headroom::estimate::estimate_rank(spec, None, &gpu::find("h100-80gb").expect("gpu"), rank)
        .expect("estimate")
}

/// The parameters of the first stage: the embedding and two decoder layers.
const FIRST_STAGE_PARAMS: u64 =
    128_256 * 4096 + 2 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14_336 * 4096 + 2 * 4096);

fn component(est: &Estimate, component: Component) -> u64 {
    est.breakdown
        .iter()
        .find(|(c, _)| *c == component)
        .map_or(0, |&(_, bytes)| bytes)
}

/// Each stage loads its own parameters as `1 / dp` shards: the first stage's bf16 bytes over
/// the data-parallel ranks (besides the rotary table's block and the caching allocator's
/// unsplit remainders, under 1 MiB a segment).
#[test]
fn each_stage_loads_its_shard_of_its_own_parameters() {
    for dp in [1, 2, 4, 8] {
        let parallel = json!({"strategy": "fsdp", "world_size": 2 * dp, "pp": 2,
                              "microbatches": 4, "reshard_after_forward": false});
        let est = estimate_rank(&spec(parallel, "bf16"), 0);
        let shards = 2 * FIRST_STAGE_PARAMS / dp;
        assert!(
            est.weights_loaded_bytes >= shards && est.weights_loaded_bytes < shards + (2 << 20),
            "dp {dp}: {} loaded for {shards} of shards",
            est.weights_loaded_bytes
        );
    }
}

/// Tensor parallelism under FSDP2 within a stage: the rank shards its tensor-parallel share
/// (heads, MLP width, vocabulary) over dp, as many bytes as FSDP2 alone over dp × tp would
/// keep (the norms, replicated over tp, aside).
#[test]
fn tensor_parallel_stages_shard_their_share_over_dp() {
    let loaded = |dp: u64, tp: u64| {
        let parallel = json!({"strategy": "fsdp", "world_size": 2 * dp * tp, "pp": 2, "tp": tp,
                              "microbatches": 4, "reshard_after_forward": false});
        estimate_rank(&spec(parallel, "bf16"), 0).weights_loaded_bytes
    };
    let (tensor, data) = (loaded(2, 2), loaded(4, 1));
    let norms = 2 * 2 * 4096;
    assert!(
        tensor >= data && tensor <= data + norms + (2 << 20),
        "{tensor} {data}"
    );
    assert!(tensor < loaded(2, 1) * 6 / 10, "half the dp 2 shards");
}

/// Gradient sync is off until the stage's last backward: at the peak the rank holds the
/// stage's whole unsharded gradients, in bf16 without a policy and, under
/// `MixedPrecisionPolicy(bf16, fp32)`, upcast to fp32 once and accumulated there.
#[test]
fn gradients_accumulate_unsharded_until_the_last_backward() {
    let parallel = |reduce: &str| {
        json!({"strategy": "fsdp", "world_size": 8, "pp": 2, "microbatches": 4,
               "reshard_after_forward": false,
               "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": reduce}})
    };
    let bf16 = estimate_rank(&spec(parallel("bf16"), "fp32"), 0);
    let fp32 = estimate_rank(&spec(parallel("fp32"), "fp32"), 0);
    let grads = |est: &Estimate| component(est, Component::Gradients);
    // Unsharded: more than the stage's bf16 gradients, not the 1/4 a synced rank would keep.
    assert!(grads(&bf16) >= 2 * FIRST_STAGE_PARAMS, "{}", grads(&bf16));
    assert!(grads(&fp32) >= 4 * FIRST_STAGE_PARAMS, "{}", grads(&fp32));
    assert!(fp32.peak_allocated_bytes > bf16.peak_allocated_bytes + 2 * FIRST_STAGE_PARAMS / 2);
}

/// `reshard_after_forward: true` (torchtitan's `always`): in 1F1B's steady phase each forward
/// frees the units the no-sync backward before it left gathered (on the last stage the root's
/// output head) and its backward gathers them again, so the last stage needs less than with
/// torchtitan's pipeline default (`false`: gathered from the first forward to the reduction),
/// from the same shards.
#[test]
fn resharding_after_forward_frees_between_micro_batches() {
    let run = |reshard: bool| {
        let parallel = json!({"strategy": "fsdp", "world_size": 8, "pp": 2, "microbatches": 4,
                              "reshard_after_forward": reshard});
        estimate_rank(&spec(parallel, "bf16"), 4)
    };
    let (kept, freed) = (run(false), run(true));
    assert_eq!(kept.weights_loaded_bytes, freed.weights_loaded_bytes);
    // More than half the unsharded head (128256 x 4096 in bf16).
    assert!(
        kept.peak_allocated_bytes > freed.peak_allocated_bytes + 128_256 * 4096,
        "{} kept, {} freed",
        kept.peak_allocated_bytes,
        freed.peak_allocated_bytes
    );
}

/// What is still refused inside a pipeline names the field, the value and what is allowed.
#[test]
fn layouts_not_modelled_inside_a_pipeline_are_refused() {
    let refused = |parallel: Value, field: &str, allowed: &str| {
        let err = RunSpec::from_value(&json!({"model": "llama-3.1-8b", "batch_size": 4,
                                               "seq_len": 1024, "parallel": parallel}))
        .expect_err(&parallel.to_string())
        .to_string();
        assert!(err.contains(field), "{parallel}: {err}");
        assert!(err.contains(allowed), "{parallel}: {err}");
    };
    refused(
        json!({"strategy": "fsdp", "world_size": 8, "pp": 2, "tp": 2,
               "sequence_parallel": true}),
        "parallel.sequence_parallel",
        "leave it out",
    );
    refused(
        json!({"strategy": "fsdp", "world_size": 8, "pp": 2, "cp": 2}),
        "parallel.cp 2",
        "cp 1",
    );
    refused(
        json!({"strategy": "ddp", "world_size": 8, "pp": 2}),
        "parallel.strategy ddp",
        "strategy fsdp",
    );
    refused(
        json!({"strategy": "fsdp", "world_size": 8, "pp": 2, "shard_size": 2}),
        "parallel.shard_size",
        "world_size / (pp × tp) (4)",
    );
    refused(
        json!({"strategy": "fsdp", "world_size": 8, "pp": 2, "offload_params": true}),
        "parallel.offload_params",
        "leave it out",
    );
    refused(
        json!({"strategy": "fsdp", "world_size": 8, "pp": 2, "units": "layers-keep-root"}),
        "parallel.units",
        "accelerate",
    );
}

/// The example (Llama-3.1-70B, pp 4 × dp 8): every stage simulated, rank 0 the worst, out of an
/// H200 under torchtitan's fp32 reduction, which the stage's fp32 gradients accumulated
/// unsharded make the difference of: reducing in bf16 it fits.
#[test]
fn the_70b_example_needs_bf16_accumulation_to_fit_an_h200() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/llama-3.1-70b-pp4-fsdp2-32xh200.yaml");
    let Document::Run(spec) = headroom::spec::load(&path).expect("example") else {
        panic!("a run spec");
    };
    let h200 = gpu::find("h200").expect("gpu");
    let fp32 = headroom::estimate::estimate(&spec, None, &h200).expect("estimate");
    assert_eq!(fp32.stages.len(), 4);
    assert_eq!(fp32.worst_rank, 0);
    assert!(!fp32.fits());
    let mut bf16 = (*spec).clone();
    let parallel = bf16.parallel.as_mut().expect("parallel");
    let policy = parallel.mixed_precision.as_mut().expect("policy");
    policy.reduce_dtype = Some(headroom::dtype::DType::BF16);
    let bf16 = headroom::estimate::estimate(&bf16, None, &h200).expect("estimate");
    assert!(bf16.fits());
    // 20 layers of 856M parameters and the embedding: 2 more bytes each.
    assert!(fp32.peak_allocated_bytes > bf16.peak_allocated_bytes + 2 * 17_000_000_000);
}
