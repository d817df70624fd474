//! Megatron-core MoE estimates (`parallel.framework: megatron` with a Qwen3-MoE model:
//! `MoELayer` with `TopKRouter`, `MoEAlltoAllTokenDispatcher` and `SequentialMLP`, expert
//! parallelism, balanced routing) against bench/megatron-moe: rank 0 of worlds of 2 to 64 under
//! torch's fake process group on one H100; and what the spec refuses by name.

use headroom::gpu;
use headroom::spec::RunSpec;
use serde_json::{Value, json};

use crate::common;

/// Every load, forward, backward and optimizer peak of every step of every row within 1%, the
/// run's reserved peak within 5%, the global parameter count.
#[test]
fn every_phase_of_every_megatron_moe_row() {
    let mut checked = 0;
    for row in common::jsonl(&[include_str!(
        "../../../../bench/megatron-moe/rows-h100-torch2.11.jsonl"
    )]) {
        let (_, phases) = common::check_every_phase(&row, 0.01, 0.05);
        checked += phases;
    }
    assert_eq!(checked, 10 * 9, "every phase of the ten rows");
}

/// The expert-tensor-parallel rows (bench/megatron-etp, rank 0 of a fake world of 8 on an
/// H200): every phase within 1%, the reserved peak within 5%.
#[test]
fn every_phase_of_every_expert_tensor_parallel_row() {
    let mut checked = 0;
    for row in common::jsonl(&[include_str!(
        "../../../../bench/megatron-etp/rows-h200-torch2.11.jsonl"
    )]) {
        let (_, phases) = common::check_every_phase(&row, 0.01, 0.05);
        checked += phases;
    }
    assert_eq!(checked, 6 * 9, "every phase of the six rows");
}

/// Expert tensor parallelism splits each expert's weights over `etp` ranks and shards the
/// experts' main parameters over `world / (ep × etp)` expert-data-parallel ranks: the load
/// phase's bytes as Megatron's formulas give them.
#[test]
fn expert_tensor_parallelism_splits_each_expert() {
    let (h, v, layers) = (2048u64, 151_936u64, 2u64);
    let attention = (32 + 2 * 4) * 128 * h + h * 32 * 128 + 2 * 128 + 2 * h;
    let dense = 2 * v * h + h + layers * (attention + 128 * h);
    let expert = 3 * 768 * h;
    for (world, ep, etp) in [(8, 1, 2), (8, 2, 4), (16, 4, 2)] {
        let local_experts = layers * (128 / ep) * expert / etp;
        let est = estimate(&spec(
            layers,
            world,
            1,
            json!({"expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp,
                "distributed_optimizer": true}),
        ));
        let sharded = (dense + local_experts) * (2 + 4)
            + 4 * (dense / world + local_experts / (world / (ep * etp)));
        let got = est.weights_loaded_bytes;
        assert!(
            got.abs_diff(sharded) < 64 << 20,
            "world {world}, ep {ep}, etp {etp}: {got} vs {sharded}"
        );
    }
}

/// Qwen3-30B-A3B's widths cut to `layers` layers.
fn spec(layers: u64, world: u64, tp: u64, megatron: Value) -> Value {
    json!({
        "model": "qwen3-30b-a3b",
        "model_config": {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
            "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4,
            "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true,
            "vocab_size": 151936, "num_hidden_layers": layers, "tie_word_embeddings": false},
        "precision": "bf16",
        "optimizer": "adamw",
        "batch_size": 1,
        "seq_len": 2048,
        "parallel": {"strategy": "ddp", "world_size": world, "tp": tp, "framework": "megatron"},
        "megatron": megatron,
    })
}

fn estimate(spec: &Value) -> headroom::estimate::Estimate {
    let spec = RunSpec::from_value(spec).expect("valid spec");
    headroom::estimate::estimate(&spec, None, &gpu::find("h100-80gb").expect("gpu"))
        .expect("estimate")
}

/// The load phase's bytes: every rank's bf16 weights, its fp32 gradient buffers and its fp32
/// main parameters, as Megatron's formulas give them for `ep` expert-parallel ranks: the
/// dense parameters whole, `E / ep` experts of each layer; with the distributed optimizer the
/// main parameters of each buffer split over its data-parallel ranks (`world` for the dense
/// buffer, `world / ep` for the experts').
#[test]
fn each_rank_holds_its_share_of_the_experts() {
    let (h, v, layers) = (2048u64, 151_936u64, 2u64);
    let attention = (32 + 2 * 4) * 128 * h + h * 32 * 128 + 2 * 128 + 2 * h;
    let dense = 2 * v * h + h + layers * (attention + 128 * h);
    let expert = 3 * 768 * h;
    let load = |world: u64, ep: u64, distributed: bool| {
        let est = estimate(&spec(
            layers,
            world,
            1,
            json!({"expert_model_parallel_size": ep, "distributed_optimizer": distributed}),
        ));
        est.weights_loaded_bytes
    };
    for (world, ep) in [(8, 1), (8, 2), (8, 8), (16, 4)] {
        let local = dense + layers * (128 / ep) * expert;
        // bf16 weights, fp32 gradients, fp32 main parameters.
        let plain = local * (2 + 4 + 4);
        let got = load(world, ep, false);
        assert!(
            got.abs_diff(plain) < 64 << 20,
            "world {world}, ep {ep}: {got} vs {plain}"
        );
        let sharded =
            local * (2 + 4) + 4 * (dense / world + layers * (128 / ep) * expert / (world / ep));
        let got = load(world, ep, true);
        assert!(
            got.abs_diff(sharded) < 64 << 20,
            "world {world}, ep {ep}, distributed optimizer: {got} vs {sharded}"
        );
    }
}

/// What is not modelled is refused naming the field, the value and what is allowed.
#[test]
fn bad_expert_layouts_are_refused_by_name() {
    let refused = |spec: Value, needles: &[&str]| {
        let err = RunSpec::from_value(&spec)
            .and_then(|s| s.architecture(None, "").map(|_| s))
            .expect_err(&spec["megatron"].to_string())
            .to_string();
        for needle in needles {
            assert!(err.contains(needle), "{}: {err}", spec["megatron"]);
        }
    };
    refused(
        spec(2, 8, 1, json!({"expert_model_parallel_size": 3})),
        &[
            "megatron.expert_model_parallel_size",
            "3",
            "a divisor of num_experts (128)",
        ],
    );
    refused(
        spec(2, 4, 1, json!({"expert_model_parallel_size": 8})),
        &[
            "megatron.expert_model_parallel_size",
            "8",
            "world_size / (pp * expert_tensor_parallel_size) (4)",
        ],
    );
    refused(
        spec(2, 8, 2, json!({"expert_model_parallel_size": 2})),
        &[
            "parallel.sequence_parallel",
            "false",
            "true with parallel.tp 2",
        ],
    );
    refused(
        spec(2, 8, 1, json!({"expert_tensor_parallel_size": 5})),
        &[
            "megatron.expert_tensor_parallel_size",
            "5",
            "a divisor of moe_intermediate_size (768)",
        ],
    );
    refused(
        spec(2, 8, 1, json!({"expert_tensor_parallel_size": 16})),
        &[
            "megatron.expert_tensor_parallel_size",
            "16",
            "world_size / pp (8)",
        ],
    );
    refused(
        spec(
            2,
            8,
            1,
            json!({"expert_model_parallel_size": 4, "expert_tensor_parallel_size": 4}),
        ),
        &[
            "megatron.expert_model_parallel_size",
            "4",
            "world_size / (pp * expert_tensor_parallel_size) (2)",
        ],
    );
    refused(
        spec(2, 8, 2, json!({"expert_tensor_parallel_size": 2})),
        &["parallel.tp 2", "sequence parallelism"],
    );
    // With sequence parallelism tp 2 runs, the experts split tp ways unless etp says otherwise.
    let mut sequence_parallel = spec(2, 8, 2, json!({"expert_model_parallel_size": 4}));
    sequence_parallel["parallel"]["sequence_parallel"] = json!(true);
    let parsed = RunSpec::from_value(&sequence_parallel).expect("tp with sequence parallelism");
    assert_eq!(parsed.megatron.expect("megatron").etp(2), 2);
    estimate(&sequence_parallel);
    let mut routed = spec(2, 8, 1, json!({}));
    routed["routing"] = json!({"max_tokens_per_expert_factor": 2.0});
    refused(routed, &["routing", "balanced routing"]);
    let mut shared = spec(2, 8, 1, json!({}));
    shared["model_config"]["mlp_only_layers"] = json!([0]);
    refused(shared, &["framework megatron", "every layer routed"]);
}

/// Expert parallelism divides the experts' weights, gradients and states; the estimate says
/// that routing is assumed balanced.
#[test]
fn expert_parallelism_shrinks_the_rank_and_balanced_routing_is_said() {
    let one = estimate(&spec(2, 8, 1, json!({"distributed_optimizer": true})));
    let eight = estimate(&spec(
        2,
        8,
        1,
        json!({"distributed_optimizer": true, "expert_model_parallel_size": 8}),
    ));
    assert!(eight.weights_loaded_bytes * 2 < one.weights_loaded_bytes);
    assert!(eight.peak_allocated_bytes < one.peak_allocated_bytes);
    assert!(
        eight
            .assumptions
            .warnings
            .iter()
            .any(|w| w.contains("balanced routing")),
        "{:?}",
        eight.assumptions.warnings
    );
}

/// The forward peak of step 2 that each decoder layer adds: one layer's model against three's,
/// halved, with the weights' own difference taken out by the load phase.
fn forward_bytes_per_layer(megatron: Value) -> u64 {
    let forward = |layers: u64| {
        let est = estimate(&spec(layers, 8, 1, megatron.clone()));
        let peak = est
            .phases
            .iter()
            .find(|p| p.step == 2 && p.phase == "forward")
            .expect("a forward phase")
            .peak_allocated;
        peak - est.weights_loaded_bytes
    };
    (forward(3) - forward(1)) / 2
}

/// What each router setting keeps through a layer's forward, on 2,048 tokens and 128 experts:
/// the load-balancing loss its fp32 softmax of every logit (1 MiB, saved by the softmax's
/// backward) with the tokens per expert and the loss; an fp32 router the dispatcher's `probs`
/// in fp32 (2 bytes more of each of the `[n, E]` probabilities at least); recomputing the whole
/// MoE layer keeps its input and the dispatcher's attributes instead of its activations.
#[test]
fn the_router_settings_keep_what_megatron_keeps() {
    let base = json!({"expert_model_parallel_size": 8});
    let with = |extra: Value| {
        let mut m = base.clone();
        m.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        m
    };
    let plain = forward_bytes_per_layer(base.clone());
    let scores = 2048 * 128 * 4;
    let aux = forward_bytes_per_layer(with(json!({"moe_aux_loss_coeff": 1e-3})));
    assert!(
        (scores..scores + (8 << 10)).contains(&(aux - plain)),
        "the loss keeps {} bytes a layer",
        aux - plain
    );
    let fp32 = forward_bytes_per_layer(with(json!({"moe_router_dtype": "fp32"})));
    assert!(fp32 >= plain + 2048 * 128 * 2, "{fp32} vs {plain}");
    let recomputed = forward_bytes_per_layer(with(json!({"moe_layer_recompute": true})));
    assert!(recomputed < plain / 2, "{recomputed} vs {plain}");
    // Under full recomputation the first forward runs without grad: no loss, as Megatron skips it.
    let full = json!({"recompute_granularity": "full"});
    let full_aux = with(json!({"recompute_granularity": "full", "moe_aux_loss_coeff": 1e-3}));
    let mut merged = base.clone();
    merged
        .as_object_mut()
        .unwrap()
        .extend(full.as_object().unwrap().clone());
    assert_eq!(
        forward_bytes_per_layer(merged),
        forward_bytes_per_layer(full_aux)
    );
}

/// A dense model refuses the router's settings by name.
#[test]
fn a_dense_model_refuses_the_routers_settings() {
    let dense = json!({
        "model": "llama-3.1-8b", "precision": "bf16", "optimizer": "adamw", "batch_size": 1,
        "seq_len": 2048,
        "parallel": {"strategy": "ddp", "world_size": 2, "framework": "megatron"},
        "megatron": {"moe_router_dtype": "fp32"},
    });
    let spec = RunSpec::from_value(&dense).expect("a valid document");
    let err = headroom::estimate::estimate(&spec, None, &gpu::find("h100-80gb").expect("gpu"))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains("megatron.moe_router_dtype"), "{err}");
}
