//! transformers 5.17's expert parallelism (`parallel.ep`: `base_model_ep_plan` through
//! `maybe_distribute_model`) against bench/ep: rank 0 of worlds of 2 to 8 under torch's fake
//! process group on one H100; and the spec's checks of the layout.

use headroom::gpu;
use headroom::spec::RunSpec;
use serde_json::{Value, json};

use crate::common;

/// Every forward, backward and optimizer peak of every step of every row within 0.1%, the
/// reserved peak within the gate's 8% (segments placed as the driver places them,
/// bench/ep/README.md), and the global parameter count. Call 1's harness counted the
/// LoRA row's adapters in `params`; measure.py's count is the base model's.
#[test]
fn every_phase_of_every_expert_parallel_row() {
    let call1 = common::jsonl(&[include_str!(
        "../../../../bench/ep/rows-h100-torch2.11.jsonl"
    )]);
    let call2 = common::jsonl(&[include_str!(
        "../../../../bench/ep/rows-call2-h100-torch2.11.jsonl"
    )]);
    let mut checked = 0;
    for (call, mut row) in call1
        .into_iter()
        .map(|r| (1, r))
        .chain(call2.into_iter().map(|r| (2, r)))
    {
        if call == 1 && row["spec"].get("lora").is_some() {
            let measured = &mut row["measured"];
            let base = measured["params"].as_u64().unwrap()
                - measured["trainable_params"].as_u64().unwrap();
            measured["params"] = json!(base);
        }
        checked += common::check_every_phase(&row, 0.001, 0.08).1;
    }
    assert!(checked >= 108, "{checked} phases checked");
}

fn spec(parallel: Value) -> Value {
    json!({
        "model": "qwen3-30b-a3b",
        "model_config": {"model_type": "qwen3_moe", "hidden_size": 2048, "moe_intermediate_size": 768,
                         "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 4,
                         "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                         "vocab_size": 151936},
        "precision": "bf16",
        "optimizer": "adamw-forloop",
        "batch_size": 1,
        "seq_len": 2048,
        "parallel": parallel,
    })
}

fn estimate(value: &Value) -> headroom::estimate::Estimate {
    let spec = RunSpec::from_value(value).expect("valid spec");
    headroom::estimate::estimate(&spec, None, &gpu::find("h100-80gb").expect("gpu"))
        .expect("estimate")
}

/// A rank holds `experts / ep` of every layer's experts, with their gradients and AdamW's two
/// states: from ep 2 to ep 4 a rank's weights lose the 32 experts it no longer holds, its
/// optimizer peak four times that (within the step's temporaries), and the parameter count
/// stays global.
#[test]
fn a_rank_holds_its_share_of_the_experts() {
    let two = estimate(&spec(json!({"strategy": "none", "world_size": 2, "ep": 2})));
    let four = estimate(&spec(json!({"strategy": "none", "world_size": 4, "ep": 4})));
    // Per layer: 128 experts × 3 × 2048 × 768 bf16 parameters; a rank of ep 2 holds 64, of ep
    // 4 holds 32; two layers.
    let experts_per_rank = |ep: u64| 2 * (128 / ep) * 3 * 2048 * 768 * 2;
    let freed = experts_per_rank(2) - experts_per_rank(4);
    assert_eq!(
        two.weights_loaded_bytes - four.weights_loaded_bytes,
        freed,
        "the weights differ by the experts alone"
    );
    assert_eq!(two.params, four.params, "a DTensor counts its global size");
    // At the optimizer's peak a rank holds weights, gradients and two states of its experts.
    let opt = |e: &headroom::estimate::Estimate| {
        e.phases
            .iter()
            .filter(|p| p.phase == "optimizer")
            .map(|p| p.peak_allocated)
            .max()
            .unwrap()
    };
    let ratio = (opt(&two) - opt(&four)) as f64 / (4 * freed) as f64;
    assert!((ratio - 1.0).abs() < 0.01, "{} {}", opt(&two), opt(&four));
}

/// A bad layout is refused naming the field, the value and what is allowed; what is not
/// modelled is refused by name.
#[test]
fn bad_layouts_name_the_field() {
    let refused = |parallel: Value, edit: &dyn Fn(&mut Value), field: &str| {
        let mut value = spec(parallel.clone());
        edit(&mut value);
        let err = common::refusal(&value);
        assert!(err.contains(field), "{parallel}: {err}");
    };
    let none = |_: &mut Value| {};
    let ep4 = json!({"strategy": "none", "world_size": 4, "ep": 4});
    refused(
        json!({"strategy": "fsdp", "world_size": 4, "ep": 4}),
        &none,
        "parallel.strategy",
    );
    refused(
        json!({"strategy": "none", "world_size": 8, "ep": 4}),
        &none,
        "parallel.world_size",
    );
    refused(
        json!({"strategy": "none", "world_size": 8, "ep": 4, "tp": 2}),
        &none,
        "parallel.ep with parallel.tp",
    );
    refused(
        json!({"strategy": "none", "world_size": 8, "ep": 4, "pp": 2}),
        &none,
        "parallel.ep with parallel.pp",
    );
    refused(
        json!({"strategy": "none", "world_size": 3, "ep": 3}),
        &none,
        "parallel.ep",
    );
    refused(
        ep4.clone(),
        &|v| v["optimizer"] = json!("adamw"),
        "optimizer",
    );
    refused(
        ep4.clone(),
        &|v| v["experts_implementation"] = json!("eager"),
        "experts_implementation",
    );
    refused(ep4.clone(), &|v| v["mode"] = json!("forward"), "mode");
    refused(
        ep4.clone(),
        &|v| {
            v["lora"] = json!({"r": 8, "targets": [],
                               "target_parameters": ["mlp.experts.gate_up_proj"]})
        },
        "lora on the expert weights",
    );
    refused(
        ep4.clone(),
        &|v| v["model_config"]["model_type"] = json!("deepseek_v3"),
        "parallel.ep with a deepseek_v3 model",
    );
    refused(
        json!({"strategy": "none", "world_size": 2, "ep": 2}),
        &|v| {
            v["model"] = json!("llama-3.1-8b");
            v["model_config"] = common::llama_3_1_8b_widths(2);
        },
        "no experts",
    );
}

/// LoRA off the experts trains plain tensors only: any AdamW steps it.
#[test]
fn lora_on_the_attention_is_modelled() {
    let mut value = spec(json!({"strategy": "none", "world_size": 4, "ep": 4}));
    value["optimizer"] = json!("adamw");
    value["lora"] = json!({"r": 16, "targets": ["q_proj", "v_proj"]});
    let est = estimate(&value);
    assert!(est.trainable_params < est.params / 100);
}

/// The shard's parameter inventory: each MoE layer's router keeps a row per expert of the
/// model, the fused expert stacks hold `experts / ep` experts, nothing else changes.
#[test]
fn the_shard_splits_the_experts_alone() {
    use headroom::arch::{Architecture, Head, Module};
    let arch = Architecture::from_hf_config(&spec(json!(null))["model_config"]).expect("config");
    let shard = arch.expert_parallel_shard(8);
    let rows = |a: &Architecture, m: Module| -> Vec<u64> {
        a.parameters(Head::CausalLm)
            .iter()
            .filter(|p| p.module == m)
            .map(|p| p.rows)
            .collect()
    };
    assert_eq!(rows(&shard, Module::Router), vec![128, 128]);
    assert_eq!(rows(&shard, Module::ExpertsGateUp), vec![16 * 2 * 768; 2]);
    assert_eq!(rows(&shard, Module::ExpertsDown), vec![16 * 2048; 2]);
    let others = |a: &Architecture| -> u64 {
        a.parameters(Head::CausalLm)
            .iter()
            .filter(|p| !matches!(p.module, Module::ExpertsGateUp | Module::ExpertsDown))
            .map(|p| p.numel())
            .sum()
    };
    assert_eq!(others(&shard), others(&arch));
}

/// `fit` and the remedies search layouts and knobs that would drop `parallel.ep`: they refuse
/// the spec by name.
#[test]
fn fit_refuses_an_expert_parallel_spec() {
    let setup = common::fit_setup(
        &spec(json!({"strategy": "none", "world_size": 4, "ep": 4})),
        4,
    );
    let Err(err) = headroom::plan::fit(&setup) else {
        panic!("fit accepted an expert-parallel spec")
    };
    assert!(err.to_string().contains("parallel.ep"), "{err}");
    let Err(err) = headroom::plan::baseline(&setup) else {
        panic!("the remedies' baseline accepted an expert-parallel spec")
    };
    assert!(err.to_string().contains("parallel.ep"), "{err}");
}

/// Under `framework: megatron`, `parallel.ep`, `etp`, `distributed_optimizer` and `recompute` are
/// Megatron-LM's names for the `megatron:` block's settings: the same run either way.
#[test]
fn megatron_settings_may_be_written_under_parallel() {
    let layout = json!({"strategy": "ddp", "world_size": 8, "framework": "megatron"});
    let mut blocked = spec(layout.clone());
    blocked["optimizer"] = json!("adamw");
    blocked["model_config"]["norm_topk_prob"] = json!(true);
    blocked["megatron"] = json!({"expert_model_parallel_size": 4, "expert_tensor_parallel_size": 2,
                                 "distributed_optimizer": true, "recompute_granularity": "full"});
    let mut flat = blocked.clone();
    flat.as_object_mut().unwrap().remove("megatron");
    for (key, value) in [
        ("ep", json!(4)),
        ("etp", json!(2)),
        ("distributed_optimizer", json!(true)),
        ("recompute", json!("full")),
        ("dp", json!(8)),
    ] {
        flat["parallel"][key] = value;
    }
    let (a, b) = (estimate(&blocked), estimate(&flat));
    assert_eq!(
        (a.peak_allocated_bytes, a.peak_reserved_bytes),
        (b.peak_allocated_bytes, b.peak_reserved_bytes)
    );
    // Without the `distributed_optimizer` the optimizer states are whole on every rank.
    flat["parallel"]
        .as_object_mut()
        .unwrap()
        .remove("distributed_optimizer");
    assert!(estimate(&flat).peak_allocated_bytes > a.peak_allocated_bytes);
}
