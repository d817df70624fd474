//! Context-parallel estimates (torchtitan's: ring attention over SDPA, FSDP2 over dp × cp,
//! optionally tensor parallelism) against bench/cp: rank 0 of worlds of 4 to 32 under torch's
//! fake process group on one H100, 16k to 128k tokens; both ranks of cp 2 on real NCCL
//! (bench/nccl-x2); and the spec's checks of the layout.

use headroom::gpu;
use headroom::spec::RunSpec;
use serde_json::{Value, json};

use crate::common;

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
    let checked: usize = rows()
        .iter()
        .map(|row| common::check_every_phase(row, 0.002, 0.08).1)
        .sum();
    assert!(checked >= 108, "{checked} phases checked");
}

/// Both ranks of cp 2 under FSDP2 on real NCCL over 2 H200s, each against the estimate of its
/// own rank: every phase of every step within 1e-5 (NCCL's work objects, 66 KB at most) and the
/// reserved peak to the byte. Without checkpointing the ranks differ by one saved head-major
/// copy of the attention output per layer (rank 0's `torch.cat` makes it, rank 1's full steps
/// keep the flash output's layout), so the two estimates must differ too.
#[test]
fn each_rank_of_a_real_ring_as_measured() {
    let rows = common::jsonl(&[include_str!(
        "../../../../bench/nccl-x2/rows-nccl-h200x2-torch2.11.jsonl"
    )]);
    let mut checked = 0;
    for row in rows.iter().filter(|r| r["spec"]["parallel"]["cp"] == 2) {
        let id = row["id"].as_str().expect("id");
        let spec = RunSpec::from_value(&row["spec"]).expect(id);
        let gpu = gpu::from_device_name(row["env"]["gpu"].as_str().expect("gpu")).expect("gpu");
        let mut peaks = Vec::new();
        for measured in row["measured"]["ranks"].as_array().expect("ranks") {
            let rank = measured["rank"].as_u64().expect("rank");
            let est = headroom::estimate::estimate_rank(&spec, None, &gpu, rank).expect(id);
            for (step, record) in measured["steps"]
                .as_array()
                .expect("steps")
                .iter()
                .enumerate()
            {
                for (key, name) in [("fwd_peak", "forward"), ("bwd_peak", "backward")] {
                    let phase = est
                        .phases
                        .iter()
                        .find(|p| p.step == step as u32 + 1 && p.phase == name)
                        .expect("phase");
                    let err = common::rel(phase.peak_allocated, record[key].as_u64().expect(key));
                    assert!(
                        err.abs() < 1e-5,
                        "{id} rank {rank} step {step} {name}: {err:+e}"
                    );
                    checked += 1;
                }
            }
            assert_eq!(
                est.peak_reserved_bytes,
                measured["peak_reserved_bytes"].as_u64().expect("reserved"),
                "{id} rank {rank}"
            );
            peaks.push(est.peak_allocated_bytes);
        }
        if row["spec"]["gradient_checkpointing"] == false {
            assert!(peaks[0] > peaks[1], "{id}: {peaks:?}");
        }
    }
    assert_eq!(checked, 2 * 2 * 3 * 2);
}

/// Every rank of cp 4 (rank R of a fake world of 4 on one H200, predicted before measuring):
/// ranks 1 and 2 run both kinds of ring step and reserve more than either end, rank 3 saves no
/// head-major copy. Each rank's estimate is its measurement to the byte, and the estimate of the
/// run (the worst rank) is the middle ranks' reserved peak: simulating only the ends misses it.
#[test]
fn the_middle_ranks_of_a_ring_of_four_reserve_most() {
    let rows = common::jsonl(&[include_str!(
        "../../../../bench/nccl-x2/rows-cp4-ranks-fake-h200-torch2.11.jsonl"
    )]);
    assert_eq!(rows.len(), 4);
    let mut reserved = Vec::new();
    for row in &rows {
        let (id, est, measured) = common::estimate_measured_rank(row);
        assert_eq!(
            est.peak_allocated_bytes,
            row["measured"]["peak_allocated_bytes"].as_u64().unwrap(),
            "{id}"
        );
        assert_eq!(
            est.peak_reserved_bytes,
            measured["peak_reserved_bytes"].as_u64().unwrap(),
            "{id}"
        );
        reserved.push(est.peak_reserved_bytes);
    }
    assert!(reserved[1] > reserved[0].max(reserved[3]), "{reserved:?}");
    let spec = RunSpec::from_value(&rows[0]["spec"]).expect("spec");
    let run = headroom::estimate::estimate(&spec, None, &gpu::find("h200").expect("gpu"))
        .expect("estimate");
    assert_eq!(run.peak_reserved_bytes, reserved[1]);
}

fn spec(seq_len: u64, parallel: Value) -> Value {
    json!({
        "model": "llama-3.1-8b",
        "model_config": common::llama_3_1_8b_widths(2),
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
        let err = common::refusal(&value);
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

/// A pipeline's instances take their batch whole: context parallelism there is refused by name.
#[test]
fn a_pipeline_instance_with_context_parallelism_is_refused() {
    let mut policy = spec(4096, json!({"strategy": "fsdp", "world_size": 4, "cp": 2}));
    policy["optimizer"] = json!("adamw");
    let pipeline = json!({
        "policy": policy,
        "reference": {"model": "qwen2.5-1.5b", "precision": "bf16", "batch_size": 1, "seq_len": 4096},
        "placement": "resident",
    });
    let err = headroom::spec::PipelineSpec::from_value(&pipeline)
        .expect_err("refused")
        .to_string();
    assert!(err.contains("parallel.cp"), "{err}");
}
