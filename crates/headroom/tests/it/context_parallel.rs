//! Context-parallel estimates (torchtitan's: ring attention over SDPA, FSDP2 over dp × cp,
//! optionally tensor parallelism) against bench/cp: rank 0 of worlds of 4 to 32 under torch's
//! fake process group on one H100, 16k to 128k tokens; and the spec's checks of the layout.

use headroom::gpu;
use headroom::spec::RunSpec;
use serde_json::{Value, json};

use crate::common::{self, rel};

fn rows() -> Vec<Value> {
    common::jsonl(&[
        include_str!("../../../../bench/cp/rows-h100-torch2.11.jsonl"),
        include_str!("../../../../bench/cp/rows-call2-h100-torch2.11.jsonl"),
    ])
}

/// Every forward, backward and optimizer peak of every step of every row within 0.2% (the
/// rows with a small vocabulary are those where the ring's own buffers set the peak), and the
/// run's reserved peak within the accuracy gate's 8%.
#[test]
fn every_phase_of_every_context_parallel_row() {
    let mut checked = 0;
    for row in rows() {
        let id = row["id"].as_str().expect("id");
        let spec = RunSpec::from_value(&row["spec"]).expect(id);
        let gpu = gpu::from_device_name(row["env"]["gpu"].as_str().expect("gpu")).expect("gpu");
        let est = headroom::estimate::estimate(&spec, None, &gpu).expect(id);
        let rank = &row["measured"]["ranks"][0];
        for step in 1..=3u32 {
            for (key, name) in [
                ("fwd_peak", "forward"),
                ("bwd_peak", "backward"),
                ("opt_peak", "optimizer"),
            ] {
                let measured = rank["steps"][step as usize - 1][key].as_u64().expect(key);
                let e = est
                    .phases
                    .iter()
                    .find(|p| p.step == step && p.phase == name)
                    .expect("phase");
                let err = rel(e.peak_allocated, measured);
                assert!(err.abs() < 0.002, "{id} step {step} {name}: {err:+.5}");
                checked += 1;
            }
        }
        let reserved = rel(
            est.peak_reserved_bytes,
            row["measured"]["peak_reserved_bytes"]
                .as_u64()
                .expect("reserved"),
        );
        assert!(reserved.abs() < 0.08, "{id}: reserved {reserved:+.4}");
        assert_eq!(
            est.params,
            row["measured"]["params"].as_u64().expect("params"),
            "{id}: the model's parameters, not rank 0's shard"
        );
    }
    assert!(checked >= 108, "{checked} phases checked");
}

fn spec(seq_len: u64, parallel: Value) -> Value {
    json!({
        "model": "llama-3.1-8b",
        "model_config": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 128256, "num_hidden_layers": 2, "tie_word_embeddings": false},
        "precision": "bf16",
        "batch_size": 1,
        "seq_len": seq_len,
        "gradient_checkpointing": true,
        "parallel": parallel,
    })
}

fn estimate(seq_len: u64, parallel: Value) -> headroom::estimate::Estimate {
    let spec = RunSpec::from_value(&spec(seq_len, parallel)).expect("valid spec");
    headroom::estimate::estimate(&spec, None, &gpu::find("h100-80gb").expect("gpu"))
        .expect("estimate")
}

/// A rank holds `seq_len / cp` tokens: twice the ranks for twice the sequence keep the logits
/// and the loss (the peak at 32k tokens) the same, and FSDP2 shards the weights over dp × cp.
#[test]
fn each_rank_holds_its_share_of_the_sequence() {
    let two = estimate(32768, json!({"strategy": "fsdp", "world_size": 4, "cp": 2}));
    let four = estimate(65536, json!({"strategy": "fsdp", "world_size": 4, "cp": 4}));
    let logits = |e: &headroom::estimate::Estimate| {
        e.breakdown
            .iter()
            .find(|(c, _)| c.key() == "logits_and_loss")
            .map(|(_, b)| *b)
            .expect("logits")
    };
    assert_eq!(logits(&two), logits(&four));
    let plain = estimate(32768, json!({"strategy": "fsdp", "world_size": 4}));
    assert_eq!(plain.weights_loaded_bytes, two.weights_loaded_bytes);
    assert!(
        logits(&two) * 3 / 2 < logits(&plain),
        "a rank's logits are its share's"
    );
}

/// A bad layout is refused naming the field, the value and what is allowed; what is not
/// modelled is refused by name.
#[test]
fn bad_layouts_name_the_field() {
    let refused = |seq_len: u64, parallel: Value, edit: &dyn Fn(&mut Value), field: &str| {
        let mut value = spec(seq_len, parallel.clone());
        edit(&mut value);
        let err = RunSpec::from_value(&value)
            .and_then(|s| s.architecture(None, "").map(|_| s))
            .expect_err(&value.to_string())
            .to_string();
        assert!(err.contains(field), "{parallel}: {err}");
    };
    let none = |_: &mut Value| {};
    refused(
        4096,
        json!({"strategy": "fsdp", "world_size": 6, "cp": 4}),
        &none,
        "parallel.cp",
    );
    refused(
        4096,
        json!({"strategy": "fsdp", "world_size": 8, "cp": 4, "tp": 4}),
        &none,
        "parallel.cp",
    );
    refused(
        4096,
        json!({"strategy": "ddp", "world_size": 4, "cp": 2}),
        &none,
        "parallel.strategy",
    );
    refused(
        4100,
        json!({"strategy": "fsdp", "world_size": 4, "cp": 4}),
        &none,
        "seq_len",
    );
    refused(
        4104,
        json!({"strategy": "fsdp", "world_size": 16, "cp": 4, "tp": 4, "sequence_parallel": true}),
        &none,
        "seq_len",
    );
    refused(
        4096,
        json!({"strategy": "fsdp", "world_size": 8, "cp": 2, "shard_size": 2}),
        &none,
        "parallel.shard_size",
    );
    refused(
        4096,
        json!({"strategy": "fsdp", "world_size": 4, "cp": 2}),
        &|v| v["attention"] = json!("eager"),
        "eager attention",
    );
    refused(
        4096,
        json!({"strategy": "fsdp", "world_size": 4, "cp": 2}),
        &|v| v["precision"] = json!("fp32"),
        "precision fp32",
    );
    refused(
        4096,
        json!({"strategy": "fsdp", "world_size": 4, "cp": 2}),
        &|v| v["model_config"]["model_type"] = json!("gemma2"),
        "parallel.cp with a gemma2 model",
    );
}
