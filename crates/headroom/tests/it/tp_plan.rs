//! transformers 5.17's own tensor parallelism (`parallel.framework: transformers`:
//! `DistributedConfig(tp_size=tp)` through `maybe_distribute_model`) against bench/tp-hf: rank 0
//! of worlds of 2 to 8 under torch's fake process group on one H200; and the spec's checks.

use serde_json::{Value, json};

use crate::common;

/// Every forward, backward and optimizer peak of every step of every row within 0.1%, the
/// reserved peak within 1%, and the global parameter count.
#[test]
fn every_phase_of_every_transformers_tensor_parallel_row() {
    let rows = common::jsonl(&[include_str!(
        "../../../../bench/tp-hf/rows-h200-torch2.11.jsonl"
    )]);
    let checked: usize = rows
        .iter()
        .map(|row| common::check_every_phase(row, 0.001, 0.01).1)
        .sum();
    assert!(checked >= 81, "{checked} phases checked");
}

fn spec(parallel: Value) -> Value {
    json!({
        "model": "llama-3.1-8b",
        "model_config": common::llama_3_1_8b_widths(2),
        "precision": "bf16",
        "optimizer": "adamw-forloop",
        "batch_size": 1,
        "seq_len": 2048,
        "parallel": parallel,
    })
}

fn layout(framework: &str, tp: u64) -> Value {
    let sequence_parallel = framework == "torchtitan";
    json!({"strategy": "none", "world_size": tp, "tp": tp, "framework": framework,
           "sequence_parallel": sequence_parallel})
}

/// transformers' plan leaves the embedding whole on every rank where torchtitan's splits its
/// vocabulary rows: the weights differ by the rows the rank does not hold, and at the
/// optimizer's peak by those rows' gradient and AdamW's two fp32-sized states too.
#[test]
fn the_embedding_stays_whole_on_every_rank() {
    let hf = common::estimate_value(&spec(layout("transformers", 4)));
    let titan = common::estimate_value(&spec(layout("torchtitan", 4)));
    let rows_elsewhere = 128_256 / 4 * 3 * 4096 * 2;
    assert_eq!(
        hf.weights_loaded_bytes - titan.weights_loaded_bytes,
        rows_elsewhere
    );
    assert_eq!(hf.params, titan.params, "a DTensor counts its global size");
}

/// The head's logits are gathered whole before the model's own loss: the forward's peak holds
/// the full-vocabulary fp32 logits and their log-softmax, which grow with the tokens at every
/// tensor-parallel size alike.
#[test]
fn the_loss_runs_on_the_gathered_logits() {
    let forward = |tp: u64, seq: u64| {
        let mut value = spec(layout("transformers", tp));
        value["seq_len"] = json!(seq);
        let est = common::estimate_value(&value);
        est.phases
            .iter()
            .filter(|p| p.phase == "forward")
            .map(|p| p.peak_allocated)
            .max()
            .unwrap()
    };
    // 2,048 more tokens: at least their fp32 logits and log-probabilities over every
    // vocabulary column, whatever tp is.
    let full_vocabulary = 2048 * 128_256 * 4 * 2;
    for tp in [2, 8] {
        let grown = forward(tp, 4096) - forward(tp, 2048);
        assert!(grown > full_vocabulary, "tp {tp}: {grown}");
    }
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
    let tp4 = json!({"strategy": "none", "world_size": 4, "tp": 4, "framework": "transformers"});
    refused(
        json!({"strategy": "fsdp", "world_size": 8, "tp": 4, "framework": "transformers"}),
        &none,
        "parallel.strategy",
    );
    refused(
        json!({"strategy": "none", "world_size": 8, "tp": 4, "framework": "transformers"}),
        &none,
        "parallel.tp",
    );
    refused(
        json!({"strategy": "none", "world_size": 4, "tp": 4, "framework": "transformers",
               "sequence_parallel": true}),
        &none,
        "parallel.sequence_parallel",
    );
    refused(
        json!({"strategy": "none", "world_size": 4, "tp": 4, "framework": "transformers",
               "pp": 2}),
        &none,
        "parallel.pp",
    );
    refused(
        tp4.clone(),
        &|v| v["optimizer"] = json!("adamw"),
        "optimizer",
    );
    refused(tp4.clone(), &|v| v["mode"] = json!("forward"), "mode");
    refused(
        tp4.clone(),
        &|v| v["lora"] = json!({"r": 8, "targets": ["q_proj"]}),
        "lora with framework transformers",
    );
    refused(
        tp4.clone(),
        &|v| v["model_config"]["tie_word_embeddings"] = json!(true),
        "tied word embeddings",
    );
    refused(
        tp4.clone(),
        &|v| v["model_config"]["num_key_value_heads"] = json!(2),
        "parallel.tp",
    );
}

/// `fit` searches torchtitan's and Megatron-core's layouts and the remedies data parallelism,
/// which would drop transformers' plan: both refuse the spec by name.
#[test]
fn fit_refuses_a_transformers_tensor_parallel_spec() {
    let setup = common::fit_setup(&spec(layout("transformers", 4)), 4);
    let Err(err) = headroom::plan::fit(&setup) else {
        panic!("fit accepted a transformers tp spec")
    };
    assert!(err.to_string().contains("framework transformers"), "{err}");
    let Err(err) = headroom::plan::baseline(&setup) else {
        panic!("the remedies' baseline accepted a transformers tp spec")
    };
    assert!(err.to_string().contains("tensor"), "{err}");
}
