//! Pipeline-parallel estimates (torch.distributed.pipelining's 1F1B, interleaved 1F1B and GPipe
//! over HF decoders split as torchtitan splits them) against bench/pp: single ranks of pipelines
//! of 2 and 4 under torch's fake process group on one H100; every stage's peak; and the spec's
//! checks of the layout.

use headroom::gpu;
use headroom::spec::RunSpec;
use serde_json::{Value, json};

use crate::common;

fn rows() -> Vec<Value> {
    common::jsonl(&[include_str!(
        "../../../../bench/pp/rows-h100-torch2.11.jsonl"
    )])
}

/// The schedule and optimizer peaks of every step of every row's rank within 0.1%, and its
/// reserved peak within 1%.
#[test]
fn every_phase_of_every_pipeline_rank() {
    let mut checked = 0;
    for row in rows() {
        let (id, est, measured) = common::estimate_measured_rank(&row);
        let rank = measured["rank"].as_u64().expect("rank");
        assert_eq!(est.worst_rank, rank, "{id}: the rank asked for");
        checked += common::check_pipeline_rank(id, &est, measured, 0.001, 0.01);
        assert_eq!(
            est.params,
            row["measured"]["params"].as_u64().expect("params"),
            "{id}: the whole model's parameters"
        );
    }
    assert!(checked >= 78, "{checked} phases checked");
}

fn spec(layers: u64, batch: u64, parallel: Value) -> Value {
    json!({
        "model": "llama-3.1-8b",
        "model_config": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 128256, "num_hidden_layers": layers, "tie_word_embeddings": false},
        "precision": "bf16",
        "optimizer": "adamw",
        "batch_size": batch,
        "seq_len": 4096,
        "parallel": parallel,
    })
}

fn estimate(layers: u64, batch: u64, parallel: Value) -> headroom::estimate::Estimate {
    let spec = RunSpec::from_value(&spec(layers, batch, parallel)).expect("valid spec");
    headroom::estimate::estimate(&spec, None, &gpu::find("h100-80gb").expect("gpu"))
        .expect("estimate")
}

/// Every stage is simulated and the top-level numbers are the worst rank's: the last stage
/// (the head and the logits) in an even split, the first when it holds most of the layers.
#[test]
fn every_stage_is_simulated_and_the_worst_rank_reported() {
    let even = estimate(
        8,
        8,
        json!({"strategy": "none", "world_size": 4, "pp": 4, "microbatches": 8}),
    );
    assert_eq!(
        even.stages.iter().map(|s| s.stage).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    let worst = even
        .stages
        .iter()
        .max_by_key(|s| (s.peak_reserved, s.peak_allocated))
        .expect("stages");
    assert_eq!(worst.stage, 3, "the head's stage");
    assert_eq!(even.worst_rank, 3);
    assert_eq!(even.peak_allocated_bytes, worst.peak_allocated);
    assert_eq!(even.peak_reserved_bytes, worst.peak_reserved);
    // 1F1B keeps pp - s micro-batches in flight: the first stage holds more than the middle
    // ones of the same layers.
    assert!(even.stages[0].peak_allocated > even.stages[1].peak_allocated);
    assert!(even.stages[1].peak_allocated > even.stages[2].peak_allocated);

    let front = estimate(
        8,
        8,
        json!({"strategy": "none", "world_size": 2, "pp": 2, "microbatches": 8,
               "layers_per_stage": [7, 1]}),
    );
    assert_eq!(front.worst_rank, 0, "seven layers outweigh the head");
    assert!(front.stages[0].peak_allocated > front.stages[1].peak_allocated);

    // Interleaving: rank r holds stages r and r + pp, reported with its peak.
    let interleaved = estimate(
        8,
        4,
        json!({"strategy": "none", "world_size": 2, "pp": 2, "schedule": "interleaved-1f1b",
               "vpp": 2, "microbatches": 4}),
    );
    assert_eq!(interleaved.stages.len(), 4);
    for s in &interleaved.stages {
        assert_eq!(s.pipeline_rank, s.stage % 2, "stage {}", s.stage);
        assert_eq!(
            s.peak_allocated,
            interleaved.stages[s.pipeline_rank as usize].peak_allocated
        );
    }
}

/// The search's limit (`Limit::GpuUntilOom`) stops a pipeline at its first rank out of memory:
/// the estimate says it runs out, as the full one does, with the ranks after it not simulated;
/// a pipeline that fits is simulated whole either way, to the same numbers, and says that the
/// capacity never acted.
#[test]
fn the_search_stops_a_pipeline_at_its_first_rank_out_of_memory() {
    use headroom::estimate::{Limit, estimate_with_trace};
    let gpu = gpu::find("h100-80gb").expect("gpu");
    let run = |layers: u64, limit| {
        let spec = RunSpec::from_value(&spec(
            layers,
            4,
            json!({"strategy": "none", "world_size": 4, "pp": 4, "microbatches": 4}),
        ))
        .expect("valid spec");
        estimate_with_trace(&spec, None, &gpu, limit, false)
            .expect("estimate")
            .0
    };
    let (full, search) = (run(160, Limit::Gpu), run(160, Limit::GpuUntilOom));
    assert!(full.oom.is_some() && search.oom.is_some());
    assert_eq!(full.stages.len(), 4);
    assert!(search.stages.len() < 4, "{} stages", search.stages.len());
    assert!(!search.unlimited);
    let (full, search) = (run(8, Limit::Gpu), run(8, Limit::GpuUntilOom));
    assert!(full.oom.is_none() && search.oom.is_none());
    assert_eq!(full.stages, search.stages);
    assert_eq!(full.peak_reserved_bytes, search.peak_reserved_bytes);
    assert!(search.unlimited);
}

/// GPipe runs every forward before any backward: its ranks hold every micro-batch's
/// activations, more than 1F1B's.
#[test]
fn gpipe_holds_every_micro_batch() {
    let run = |schedule: &str| {
        estimate(
            4,
            8,
            json!({"strategy": "none", "world_size": 2, "pp": 2, "schedule": schedule,
                   "microbatches": 8}),
        )
    };
    let (gpipe, one) = (run("gpipe"), run("1f1b"));
    for stage in 0..2 {
        assert!(
            gpipe.stages[stage].peak_allocated > one.stages[stage].peak_allocated,
            "stage {stage}"
        );
    }
}

/// A bad layout is refused naming the field, the value and what is allowed.
#[test]
fn bad_pipeline_layouts_name_the_field() {
    let refused = |layers: u64, batch: u64, parallel: Value, field: &str| {
        let err = RunSpec::from_value(&spec(layers, batch, parallel.clone()))
            .and_then(|s| s.architecture(None, "").map(|_| s))
            .expect_err(&parallel.to_string())
            .to_string();
        assert!(err.contains(field), "{parallel}: {err}");
    };
    let none = |extra: Value| {
        let mut p = json!({"strategy": "none", "world_size": 2, "pp": 2});
        p.as_object_mut()
            .expect("object")
            .extend(extra.as_object().expect("object").clone());
        p
    };
    refused(
        4,
        4,
        json!({"strategy": "none", "world_size": 3, "pp": 2}),
        "parallel.pp",
    );
    refused(
        4,
        4,
        none(json!({"microbatches": 1})),
        "parallel.microbatches",
    );
    refused(4, 4, none(json!({"vpp": 2})), "parallel.vpp");
    refused(
        4,
        4,
        none(json!({"schedule": "interleaved-1f1b", "vpp": 1})),
        "parallel.vpp",
    );
    refused(
        8,
        10,
        none(json!({"schedule": "interleaved-1f1b", "microbatches": 5})),
        "parallel.microbatches",
    );
    refused(
        4,
        4,
        none(json!({"schedule": "zero-bubble"})),
        "parallel.schedule",
    );
    refused(
        4,
        4,
        none(json!({"layers_per_stage": [4]})),
        "parallel.layers_per_stage",
    );
    refused(
        4,
        4,
        none(json!({"layers_per_stage": [3, 0]})),
        "parallel.layers_per_stage",
    );
    refused(
        4,
        4,
        none(json!({"layers_per_stage": [2, 1]})),
        "parallel.layers_per_stage",
    );
    refused(1, 2, none(json!({})), "parallel.pp");
    refused(4, 3, none(json!({})), "batch_size");
    refused(
        16,
        4096,
        none(json!({"microbatches": 4096})),
        "parallel.microbatches",
    );
    refused(
        4,
        4,
        json!({"strategy": "none", "world_size": 4, "pp": 2}),
        "parallel.world_size",
    );
    refused(
        4,
        4,
        json!({"strategy": "zero3", "world_size": 4, "pp": 2}),
        "parallel.pp",
    );
    refused(
        4,
        4,
        json!({"strategy": "none", "world_size": 4, "pp": 2, "tp": 2,
               "sequence_parallel": true}),
        "parallel.tp",
    );
    refused(
        4,
        4,
        json!({"strategy": "fsdp", "world_size": 2, "microbatches": 4}),
        "parallel.microbatches",
    );
    // A tied embedding would sit on the first and the last stage.
    let tied = json!({"model": "qwen2.5-0.5b", "batch_size": 2, "seq_len": 256,
                      "parallel": {"strategy": "none", "world_size": 2, "pp": 2}});
    let err = RunSpec::from_value(&tied)
        .and_then(|s| s.architecture(None, "").map(|_| s))
        .expect_err("tied embeddings")
        .to_string();
    assert!(err.contains("tied word embeddings"), "{err}");
}
