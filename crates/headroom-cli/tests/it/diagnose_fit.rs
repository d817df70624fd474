//! `headroom diagnose` and `headroom fit` end to end: JSON keys, stdin, exit codes and the
//! messages bad input gets.

use std::io::Write;
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::common::{headroom, json, json_of, p, stderr};

#[test]
fn diagnose_json_for_seed003() {
    let out = headroom(&[
        "diagnose",
        "--oom",
        &p("seed003/oom.log"),
        "--spec",
        &p("seed003/train.yaml"),
        "--resident",
        &p("seed003/reference.yaml"),
        "--json",
    ]);
    let v = json_of(&out);
    for key in [
        "tried_to_allocate_bytes",
        "total_capacity_bytes",
        "free_bytes",
        "allocated_by_pytorch_bytes",
        "reserved_unallocated_bytes",
        "processes",
    ] {
        assert!(v.get(key).is_some(), "no {key}");
    }
    assert_eq!(v["allocated_by_pytorch_bytes"], 82_377_472_737u64);
    assert_eq!(v["processes"][0]["pid"], Value::Null);
    assert_eq!(v["diagnosis"]["cause"], "shortage");
    assert_eq!(v["gpu"]["name"], "h100-80gb");
    assert_eq!(v["estimate"]["fits"], false);
    assert_eq!(v["remedies"][0]["key"], "adamw-fused");
    assert_eq!(v["remedies"][0]["fits"], true);
    assert!(v["cheapest_fit"]["changes"].is_array());
}

#[test]
fn diagnose_reads_stdin_and_keeps_nulls_for_absent_fields() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(["diagnose", "--oom", "-", "--json"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawns");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(
            b"RuntimeError: CUDA out of memory. Tried to allocate 2.26 GiB (GPU 0; 6.00 GiB total \
              capacity; 781.59 MiB already allocated; 3.03 GiB free; 1.24 GiB reserved in total \
              by PyTorch)\n",
        )
        .expect("writes");
    let v = json_of(&child.wait_with_output().expect("exits"));
    assert_eq!(v["oom_source"], "stdin");
    assert_eq!(v["format"], "reserved_in_total");
    assert_eq!(v["allowed_bytes"], Value::Null);
    assert_eq!(v["processes"], serde_json::json!([]));
    assert_eq!(v["diagnosis"]["cause"], "free_exceeds_request");
}

#[test]
fn diagnose_lints_seed002_configs_in_human_output() {
    let out = headroom(&[
        "diagnose",
        "--accelerate-config",
        &p("seed002/accelerate_config.fixed.yaml"),
        "--script",
        &p("seed002/hf_model_cache.original.py"),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    // Long cells wrap, so look for words, not sentences.
    assert!(text.contains("gradient_accumulation_steps"));
    assert!(text.contains("error"));
    assert!(text.contains("PyYAML"));
}

#[test]
fn fit_json_has_limits_and_a_front() {
    let out = headroom(&[
        "fit",
        &p("seed002/agent.yaml"),
        "--gpu",
        "a100-80gb",
        "--json",
    ]);
    let v = json_of(&out);
    assert_eq!(v["gpu"]["name"], "a100-80gb");
    let b = v["max_micro_batch"]
        .as_u64()
        .expect("a batch fits on 80 GB");
    assert!(b >= 1);
    assert!(v["max_seq_len"].as_u64().is_some());
    let front = v["pareto"].as_array().expect("pareto");
    assert!(!front.is_empty());
    assert!(front.iter().all(|e| e["fits"] == true));
    // More GPUs add sharded configurations.
    let v = json_of(&headroom(&[
        "fit",
        &p("seed002/agent.yaml"),
        "--gpu",
        "a10g",
        "--gpus",
        "4",
        "--json",
    ]));
    assert!(
        v["pareto"]
            .as_array()
            .expect("pareto")
            .iter()
            .any(|e| e["knobs"]["sharding"] != "none"),
        "{}",
        v["pareto"]
    );
}

/// A spec that already shards is planned as it runs: its own strategy, mixed precision and
/// world size are the baseline, and sharding is never offered as a change it already makes.
#[test]
fn fit_plans_a_sharded_spec_on_its_own_layout() {
    let spec = "examples/verl-actor-fsdp2.yaml";
    let est = json(&["estimate", spec, "--gpu", "h100-80gb", "--json"]);
    let fit = json(&["fit", spec, "--gpu", "h100-80gb", "--json"]);
    assert_eq!(fit["gpus"], 8, "the spec's world_size");
    assert_eq!(fit["spec"]["changes"].as_array().map(Vec::len), Some(0));
    assert_eq!(fit["spec"]["knobs"]["sharding"], "zero3");
    assert_eq!(
        fit["spec"]["peak_allocated_bytes"], est["peak_allocated_bytes"],
        "fit's baseline is the estimate"
    );
    assert_eq!(
        fit["spec"]["peak_reserved_bytes"],
        est["peak_reserved_bytes"]
    );
    for e in fit["pareto"].as_array().expect("pareto") {
        let changes = e["changes"].to_string();
        assert!(!changes.contains("ZeRO-3/FSDP"), "{changes}");
        // Computed shares come off an unsharded run only: none here.
        assert!(
            e["knobs"]["sharding"] == "zero3" || e["computed"] == false,
            "{e}"
        );
    }
    // GPUs past the limits are refused by name.
    let refused = crate::common::bad_input(&["fit", spec, "--gpu", "h100", "--gpus", "100000"]);
    assert!(
        refused.contains("--gpus") && refused.contains("65536"),
        "{refused}"
    );
    // Over 16 GPUs the shards halve: less memory than over 8.
    let wider = json(&["fit", spec, "--gpu", "h100-80gb", "--gpus", "16", "--json"]);
    assert!(
        wider["spec"]["peak_allocated_bytes"].as_u64()
            < fit["spec"]["peak_allocated_bytes"].as_u64()
    );
}

/// `diagnose --accelerate-config` checks the spec as the config launches it: the same estimate
/// as the spec with the launch written into it.
#[test]
fn diagnose_follows_an_accelerate_fsdp2_launch() {
    let launched = json(&[
        "diagnose",
        "--accelerate-config",
        &p("accelerate/fsdp2-bf16.yaml"),
        "--spec",
        &p("accelerate/train.yaml"),
        "--gpu",
        "h100-80gb",
        "--json",
    ]);
    let words = launched["launched_as"].as_str().expect("launched_as");
    assert!(words.contains("FSDP2 over 8 GPUs"), "{words}");
    let written = json(&[
        "estimate",
        &p("accelerate/train-as-launched.yaml"),
        "--gpu",
        "h100-80gb",
        "--json",
    ]);
    assert_eq!(
        launched["estimate"]["peak_allocated_bytes"], written["peak_allocated_bytes"],
        "{launched}"
    );
    assert_eq!(
        launched["estimate"]["peak_reserved_bytes"],
        written["peak_reserved_bytes"]
    );
    // fit plans the launched run and says its changes in the config's keys.
    let fit = json(&[
        "fit",
        &p("accelerate/train.yaml"),
        "--accelerate-config",
        &p("accelerate/fsdp2-bf16.yaml"),
        "--gpu",
        "h100-80gb",
        "--json",
    ]);
    assert_eq!(fit["gpus"], 8);
    assert_eq!(
        fit["spec"]["peak_allocated_bytes"],
        written["peak_allocated_bytes"]
    );
    let changes = fit["pareto"].to_string();
    assert!(
        changes.contains("fsdp_activation_checkpointing: false"),
        "{changes}"
    );
    assert!(!changes.contains("no gradient checkpointing"), "{changes}");
    // Without the config the spec is one GPU's bf16 run: another answer.
    let alone = json(&[
        "estimate",
        &p("accelerate/train.yaml"),
        "--gpu",
        "h100-80gb",
        "--json",
    ]);
    assert_ne!(
        alone["peak_allocated_bytes"],
        written["peak_allocated_bytes"]
    );
}

/// An FSDP1 accelerate launch, checked against the run the harness made as accelerate 1.15
/// builds it (bench/fsdp1, `fsdp1/q15/bs4/s2048/gc/w8/accelerate`).
#[test]
fn diagnose_follows_an_accelerate_fsdp1_launch_to_its_measurement() {
    let launched = json(&[
        "diagnose",
        "--accelerate-config",
        &p("accelerate/fsdp1-bf16.yaml"),
        "--spec",
        &p("accelerate/train-q15.yaml"),
        "--gpu",
        "h100-80gb",
        "--json",
    ]);
    let words = launched["launched_as"].as_str().expect("launched_as");
    assert!(words.contains("FSDP1 over 8 GPUs (FULL_SHARD"), "{words}");
    let rows = std::fs::read_to_string(
        crate::common::repo().join("bench/fsdp1/rows-h100-torch2.11.jsonl"),
    )
    .expect("the measured rows");
    let row: Value = rows
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("a row"))
        .find(|r| r["id"] == "fsdp1/q15/bs4/s2048/gc/w8/accelerate")
        .expect("the accelerate row");
    let measured = row["measured"]["peak_allocated_bytes"]
        .as_f64()
        .expect("bytes");
    let estimated = launched["estimate"]["peak_allocated_bytes"]
        .as_f64()
        .expect("bytes");
    assert!(
        (estimated / measured - 1.0).abs() < 0.001,
        "{estimated} against {measured}"
    );
}

/// `fit --json` says whether a configuration precomputes DPO's reference log-probs.
#[test]
fn fit_json_says_whether_reference_log_probs_are_precomputed() {
    let knob = |spec: &str| {
        json(&["fit", &p(spec), "--gpu", "h100", "--json"])["spec"]["knobs"]
            ["precompute_ref_log_probs"]
            .clone()
    };
    assert_eq!(knob("dpo-precompute.yaml"), true);
    assert_eq!(knob("seed003/train.yaml"), false);
}

/// Shorter sequences change the data: a remedy only for a run that does not fit as it is.
#[test]
fn shorter_sequences_are_offered_only_to_a_run_that_does_not_fit() {
    let keys = |spec: &str, gpu: &str| -> Vec<String> {
        json(&["diagnose", "--spec", spec, "--gpu", gpu, "--json"])["remedies"]
            .as_array()
            .expect("remedies")
            .iter()
            .map(|r| r["key"].as_str().expect("key").to_string())
            .collect()
    };
    let fits = keys("examples/qwen2.5-7b-lora.yaml", "h200");
    assert!(!fits.iter().any(|k| k == "shorter-sequences"), "{fits:?}");
    let short = keys("examples/llama-3.1-8b-full.yaml", "h100");
    assert!(short.iter().any(|k| k == "shorter-sequences"), "{short:?}");
}

#[test]
fn bad_input_exits_2_and_names_the_file() {
    let missing = headroom(&["diagnose", "--oom", "/nonexistent/oom.log"]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(stderr(&missing).contains("/nonexistent/oom.log"));

    let no_message = headroom(&["diagnose", "--oom", &p("seed003/train.yaml")]);
    assert_eq!(no_message.status.code(), Some(2));
    assert!(stderr(&no_message).contains("no PyTorch out-of-memory message"));

    let bad = std::env::temp_dir().join(format!("headroom-bad-{}.yaml", std::process::id()));
    std::fs::write(&bad, "distributed_type: [\n").expect("writes");
    let bad_yaml = headroom(&[
        "diagnose",
        "--accelerate-config",
        &bad.display().to_string(),
    ]);
    std::fs::remove_file(&bad).ok();
    assert_eq!(bad_yaml.status.code(), Some(2), "{}", stderr(&bad_yaml));
    assert!(
        stderr(&bad_yaml).contains("headroom-bad-"),
        "{}",
        stderr(&bad_yaml)
    );

    let nothing = headroom(&["diagnose"]);
    assert_eq!(nothing.status.code(), Some(2));

    let gpu = headroom(&["fit", &p("seed002/agent.yaml"), "--gpu", "tpu-v5"]);
    assert_eq!(gpu.status.code(), Some(2));
    assert!(stderr(&gpu).contains("mi300x"), "{}", stderr(&gpu));
}

/// A log longer than diagnose reads (64 MiB) is read from its end, where PyTorch's message is,
/// from a file and from stdin alike.
#[test]
fn diagnose_reads_the_end_of_a_huge_log() {
    let message = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 \
                   has a total capacity of 79.18 GiB of which 1.02 GiB is free. Of the allocated \
                   memory 75.01 GiB is allocated by PyTorch, and 1.50 GiB is reserved by PyTorch \
                   but unallocated.\n";
    let mut log = "step 12: loss 2.31 lr 1e-5\n".repeat(3 << 20).into_bytes();
    assert!(log.len() > 64 << 20);
    log.extend_from_slice(message.as_bytes());
    let path = std::env::temp_dir().join(format!("headroom-huge-{}.log", std::process::id()));
    std::fs::write(&path, &log).expect("writes");
    let from_file = json(&["diagnose", "--oom", &path.display().to_string(), "--json"]);
    std::fs::remove_file(&path).ok();
    assert_eq!(from_file["tried_to_allocate_bytes"], 2u64 << 30);
    let mut child = Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(["diagnose", "--oom", "-", "--json"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("runs");
    let mut stdin = child.stdin.take().expect("stdin");
    let writer = std::thread::spawn(move || stdin.write_all(&log).expect("writes"));
    let from_stdin = json_of(&child.wait_with_output().expect("exits"));
    writer.join().expect("writer");
    assert_eq!(from_stdin["tried_to_allocate_bytes"], 2u64 << 30);
}
