//! Tensor-parallel estimates (torchtitan's plan, with and without sequence parallelism, alone
//! or under FSDP2 over the data-parallel dimension) against bench/tp: rank 0 of worlds of 2 to
//! 64 under torch's fake process group on one H100; and the spec's checks of the layout.

use headroom::gpu;
use headroom::spec::RunSpec;
use serde_json::{Value, json};

use crate::common;

fn rows() -> Vec<Value> {
    common::jsonl(&[
        include_str!("../../../../bench/tp/rows-h100-torch2.11.jsonl"),
        include_str!("../../../../bench/tp/rows-call2-h100-torch2.11.jsonl"),
    ])
}

/// Every forward, backward and optimizer peak of every step of every row within 0.1%, and the
/// run's reserved peak within 2%.
#[test]
fn every_phase_of_every_tensor_parallel_row() {
    let mut checked = 0;
    for row in rows() {
        let (est, phases) = common::check_every_phase(&row, 0.001, 0.02);
        assert_eq!(
            est.worst_rank, 0,
            "{}: tensor-parallel ranks hold alike",
            row["id"]
        );
        checked += phases;
    }
    assert!(checked >= 140, "{checked} phases checked");
}

fn spec(parallel: Value) -> Value {
    json!({
        "model": "llama-3.1-8b",
        "model_config": common::llama_3_1_8b_widths(2),
        "precision": "bf16",
        "batch_size": 2,
        "seq_len": 4096,
        "parallel": parallel,
    })
}

fn estimate(parallel: Value) -> headroom::estimate::Estimate {
    let spec = RunSpec::from_value(&spec(parallel)).expect("valid spec");
    headroom::estimate::estimate(&spec, None, &gpu::find("h100-80gb").expect("gpu"))
        .expect("estimate")
}

/// Each rank holds `1/tp` of the model, and sequence parallelism shards what the residual
/// stream and the norms keep for backward.
#[test]
fn tensor_parallelism_shares_weights_and_sequence_parallelism_activations() {
    let one =
        estimate(json!({"strategy": "none", "world_size": 2, "tp": 2, "sequence_parallel": true}));
    let four =
        estimate(json!({"strategy": "none", "world_size": 4, "tp": 4, "sequence_parallel": true}));
    let ratio = one.weights_loaded_bytes as f64 / four.weights_loaded_bytes as f64;
    assert!((ratio - 2.0).abs() < 0.01, "weights tp2 / tp4: {ratio}");
    let without = estimate(json!({"strategy": "fsdp", "world_size": 8, "tp": 4}));
    let with =
        estimate(json!({"strategy": "fsdp", "world_size": 8, "tp": 4, "sequence_parallel": true}));
    assert!(
        with.peak_allocated_bytes < without.peak_allocated_bytes,
        "sequence parallelism: {} >= {}",
        with.peak_allocated_bytes,
        without.peak_allocated_bytes
    );
}

/// A bad layout is refused naming the field, the value and what is allowed.
#[test]
fn bad_layouts_name_the_field() {
    let refused = |parallel: Value, field: &str| {
        let err = RunSpec::from_value(&spec(parallel.clone()))
            .and_then(|s| s.architecture(None, "").map(|_| s))
            .expect_err(&parallel.to_string())
            .to_string();
        assert!(err.contains(field), "{parallel}: {err}");
    };
    refused(
        json!({"strategy": "fsdp", "world_size": 6, "tp": 4}),
        "parallel.tp",
    );
    refused(
        json!({"strategy": "ddp", "world_size": 4, "tp": 2}),
        "parallel.strategy",
    );
    refused(
        json!({"strategy": "fsdp", "world_size": 4, "tp": 2, "framework": "nemo"}),
        "parallel.framework",
    );
    refused(
        json!({"strategy": "fsdp", "world_size": 4, "sequence_parallel": true}),
        "parallel.sequence_parallel",
    );
    refused(
        json!({"strategy": "none", "world_size": 4, "tp": 2, "sequence_parallel": true}),
        "parallel.world_size",
    );
    refused(
        json!({"strategy": "none", "world_size": 2, "tp": 2}),
        "parallel.sequence_parallel",
    );
    refused(
        json!({"strategy": "fsdp", "world_size": 8, "tp": 4, "shard_size": 8}),
        "parallel.shard_size",
    );
    refused(
        json!({"strategy": "fsdp", "world_size": 48, "tp": 3}),
        "parallel.tp",
    );
}
