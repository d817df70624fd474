//! Arbitrary spec documents, the real keys among random ones, with extreme numbers (0, 1,
//! `u64::MAX`, negatives, NaN, infinities), huge strings and random nesting: reading and
//! estimating each returns an answer or an error naming a field, never a panic, and quickly.

use std::path::Path;
use std::time::{Duration, Instant};

use headroom::estimate::{self, Limit};
use headroom::gpu;
use headroom::spec::{self, PipelineSpec, RunSpec};
use proptest::prelude::*;

/// Numbers as YAML writes them, the extremes first.
fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0".to_string()),
        Just("1".to_string()),
        Just("2".to_string()),
        Just("18446744073709551615".to_string()),
        Just("18446744073709551616".to_string()),
        Just("-1".to_string()),
        Just("-9223372036854775808".to_string()),
        Just(".nan".to_string()),
        Just(".inf".to_string()),
        Just("-.inf".to_string()),
        Just("0.5".to_string()),
        Just("1e300".to_string()),
        (1u64..=64).prop_map(|n| n.to_string()),
        (1u64..=4096).prop_map(|n| n.to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
    ]
}

/// Scalars: numbers, booleans, null, names the specs use, random and huge strings.
fn scalar() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => number(),
        1 => Just("true".to_string()),
        1 => Just("null".to_string()),
        2 => prop::sample::select(vec![
            "qwen2.5-0.5b", "gpt2", "custom", "llama", "gpt2", "qwen3", "bf16", "fp32",
            "amp-fp16", "adamw", "sgd", "none", "forward", "train", "generate", "fsdp", "ddp",
            "zero2", "zero3", "eager", "nf4", "all-linear", "vllm", "cpu", "a", "b",
            "qwen3_moe", "deepseek_v3", "gpt_oss", "olmoe-1b-7b", "grouped_mm", "batched_mm",
            "mlp.experts.gate_up_proj", "gate_proj",
        ])
        .prop_map(str::to_string),
        1 => "[a-z_]{0,12}".prop_map(|s| format!("\"{s}\"")),
        1 => (1usize..200_000).prop_map(|n| "x".repeat(n)),
    ]
}

/// Keys: the real ones (run spec, pipeline, model config, sections), and random ones.
fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => prop::sample::select(vec![
            "model", "task", "mode", "precision", "optimizer", "batch_size", "seq_len",
            "gradient_checkpointing", "attention", "lora", "quantization", "kbit_prepare",
            "allocator", "parallel", "model_config", "instances", "phases", "iterations",
            "policy", "reference", "placement", "name", "run", "offload", "instance", "pass",
            "repeat", "new_tokens", "shares", "engine", "home", "gpu_memory_utilization",
            "sleep_level", "strategy", "world_size", "shard_size", "reshard_after_forward",
            "offload_params", "offload_optimizer", "r", "alpha", "targets", "dropout",
            "expandable_segments", "model_type", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "head_dim", "max_position_embeddings", "n_embd", "n_inner", "n_layer", "n_head",
            "sliding_window", "tie_word_embeddings", "experts_implementation", "routing",
            "max_tokens_per_expert_factor", "target_parameters", "num_experts",
            "num_local_experts", "n_routed_experts", "num_experts_per_tok",
            "moe_intermediate_size", "kv_lora_rank", "q_lora_rank", "first_k_dense_replace",
        ])
        .prop_map(str::to_string),
        1 => "[a-z]{1,8}",
    ]
}

/// A YAML flow value: a scalar, or a list or mapping of them, nested a few levels.
fn value() -> impl Strategy<Value = String> {
    scalar().prop_recursive(4, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6)
                .prop_map(|items| format!("[{}]", items.join(", "))),
            prop::collection::vec((key(), inner), 0..6).prop_map(|entries| {
                let fields: Vec<String> =
                    entries.iter().map(|(k, v)| format!("{k}: {v}")).collect();
                format!("{{{}}}", fields.join(", "))
            }),
        ]
    })
}

/// A small model the simulator takes milliseconds over, with one field perhaps replaced.
fn small_model() -> impl Strategy<Value = String> {
    (
        prop::sample::select(vec!["llama", "qwen2", "qwen3", "phi3", "gemma2", "gpt2"]),
        prop::option::of((key(), value())),
    )
        .prop_map(|(family, extra)| {
            let mut fields = vec![
                format!("model_type: {family}"),
                "hidden_size: 64".into(),
                "n_embd: 64".into(),
                "intermediate_size: 128".into(),
                "num_hidden_layers: 2".into(),
                "n_layer: 2".into(),
                "num_attention_heads: 4".into(),
                "n_head: 4".into(),
                "vocab_size: 256".into(),
            ];
            if let Some((k, v)) = extra {
                fields.retain(|f| !f.starts_with(&format!("{k}:")));
                fields.push(format!("{k}: {v}"));
            }
            format!("{{{}}}", fields.join(", "))
        })
}

/// A run-spec setting with a value it takes: the combinations the simulator must model or
/// refuse.
fn setting() -> impl Strategy<Value = (String, String)> {
    prop::sample::select(vec![
        ("precision", "fp32"),
        ("precision", "amp-bf16"),
        ("precision", "amp-fp16"),
        ("optimizer", "sgd"),
        ("optimizer", "adafactor"),
        ("optimizer", "adamw-8bit"),
        ("optimizer", "adamw-fused"),
        ("optimizer", "none"),
        ("mode", "forward"),
        ("task", "seq-cls"),
        ("attention", "eager"),
        ("gradient_checkpointing", "true"),
        ("lora", "{r: 4, targets: all-linear}"),
        ("quantization", "nf4"),
        ("kbit_prepare", "true"),
        ("allocator", "{expandable_segments: true}"),
        ("parallel", "{strategy: ddp, world_size: 2}"),
        ("parallel", "{strategy: fsdp, world_size: 4, shard_size: 2}"),
        (
            "parallel",
            "{strategy: fsdp, world_size: 1, offload_params: true}",
        ),
        (
            "parallel",
            "{strategy: zero2, world_size: 2, offload_optimizer: true}",
        ),
        ("parallel", "{strategy: zero3, world_size: 3}"),
        ("batch_size", "18446744073709551615"),
        ("seq_len", "16777216"),
    ])
    .prop_map(|(k, v)| (k.to_string(), v.to_string()))
}

/// A run spec around a small model: mostly values it takes, some arbitrary ones.
fn run_spec() -> impl Strategy<Value = String> {
    (
        small_model(),
        prop::collection::vec(prop_oneof![3 => setting(), 1 => (key(), value())], 0..4),
        prop::sample::select(vec!["1", "2", "4"]),
        prop::sample::select(vec!["16", "64", "128"]),
    )
        .prop_map(|(config, extra, batch, seq)| {
            let mut fields = vec![
                "model: custom".to_string(),
                format!("model_config: {config}"),
                format!("batch_size: {batch}"),
                format!("seq_len: {seq}"),
            ];
            for (k, v) in extra {
                fields.retain(|f| !f.starts_with(&format!("{k}:")));
                fields.push(format!("{k}: {v}"));
            }
            format!("{{{}}}", fields.join(", "))
        })
}

/// Documents: run specs, pipelines of them, and arbitrary mappings.
fn document() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => run_spec(),
        2 => (
            prop::collection::vec(run_spec(), 1..3),
            prop::collection::vec((key(), value()), 0..3),
            prop::sample::select(vec!["forward", "train", "generate"]),
            number(),
        )
            .prop_map(|(specs, extra, pass, n)| {
                let instances: Vec<String> = specs
                    .iter()
                    .enumerate()
                    .map(|(i, s)| format!("{{name: i{i}, {}", &s[1..]))
                    .collect();
                let mut fields = vec![
                    format!("instances: [{}]", instances.join(", ")),
                    format!(
                        "phases: [{{name: p, run: [{{instance: i0, pass: {pass}, \
                         new_tokens: {n}}}]}}]"
                    ),
                    "iterations: 1".to_string(),
                ];
                for (k, v) in extra {
                    fields.retain(|f| !f.starts_with(&format!("{k}:")));
                    fields.push(format!("{k}: {v}"));
                }
                format!("{{{}}}", fields.join(", "))
            }),
        1 => prop::collection::vec((key(), value()), 0..8).prop_map(|entries| {
            entries
                .iter()
                .map(|(k, v)| format!("{k}: {v}\n"))
                .collect::<String>()
        }),
    ]
}

/// An error's message must say where: a field between backticks, the file, or the setting
/// that is not modelled; and briefly.
fn check_message(message: &str) {
    assert!(!message.is_empty());
    assert!(
        message.len() < 4000,
        "{} bytes: {}",
        message.len(),
        &message[..200]
    );
    assert!(
        message.contains('`') || message.starts_with("spec.yaml") || message.contains("modelled"),
        "{message}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 1000,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn any_document_is_answered_or_refused_by_name(text in document()) {
        let gpu = gpu::find("h100-80gb").expect("a catalog GPU");
        let start = Instant::now();
        let outcome = spec::parse_document(&text, Path::new("spec.yaml")).and_then(|doc| {
            if spec::is_pipeline(&doc) {
                let p = PipelineSpec::from_value(&doc)?;
                estimate::estimate_pipeline(&p, None, &gpu, Limit::Gpu).map(|_| ())
            } else {
                let s = RunSpec::from_value(&doc)?;
                // Only small runs are simulated here: the limits keep larger ones to seconds
                // in a release build, not in this debug one.
                let (_, arch) = s.architecture(None, "")?;
                if arch.layers * s.batch_size * s.seq_len <= 4096 {
                    estimate::estimate(&s, None, &gpu).map(|_| ())
                } else {
                    Ok(())
                }
            }
        });
        if let Err(e) = outcome {
            check_message(&e.to_string());
        }
        prop_assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
    }
}

/// An unknown model type is named in the refusal, cut short however long it is (a proptest
/// case once drew a 55 kB one).
#[test]
fn a_long_unknown_model_type_is_named_briefly() {
    let model_type = "m".repeat(60_000);
    let text = format!(
        "{{model: x, model_config: {{model_type: {model_type}, hidden_size: 64, \
         num_hidden_layers: 1, num_attention_heads: 1, vocab_size: 32}}}}"
    );
    let doc = spec::parse_document(&text, Path::new("spec.yaml")).expect("YAML");
    let err = RunSpec::from_value(&doc)
        .and_then(|s| s.architecture(None, "").map(|_| ()))
        .expect_err("an unknown model type");
    let message = err.to_string();
    assert!(message.contains("model_type \"mmmm"), "{message}");
    check_message(&message);
}
