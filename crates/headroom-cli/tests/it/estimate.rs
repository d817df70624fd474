//! `headroom estimate`, `models`, `validate` and `measure` end to end: the human output
//! (insta snapshots), the JSON contract, and what bad input gets (exit code 2, the field, the
//! value, what is allowed; never a panic).

use std::process::Command;

use serde_json::Value;

use crate::common::{bad_input, headroom, json, repo, stdout};

#[test]
fn estimate_table_on_an_h100() {
    let out = stdout(&headroom(&[
        "estimate",
        "examples/qwen2.5-7b-lora.yaml",
        "--gpu",
        "h100-80gb",
    ]));
    insta::assert_snapshot!(out);
}

#[test]
fn estimate_that_runs_out_says_where_and_with_which_message() {
    let out = stdout(&headroom(&[
        "estimate",
        "examples/llama-3.1-8b-full.yaml",
        "--gpu",
        "h100-80gb",
    ]));
    insta::assert_snapshot!(out);
}

#[test]
fn estimate_json_contract() {
    let v = json(&[
        "estimate",
        "examples/llama-2-7b-qlora.yaml",
        "--json",
        "--gpu",
        "a10g",
    ]);
    for key in [
        "params",
        "trainable_params",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "cuda_context_bytes",
    ] {
        assert!(v[key].is_u64(), "{key}: {}", v[key]);
    }
    let breakdown: u64 = v["breakdown"]
        .as_array()
        .expect("breakdown")
        .iter()
        .map(|c| c["bytes"].as_u64().expect("bytes"))
        .sum();
    assert_eq!(breakdown, v["peak_allocated_bytes"].as_u64().unwrap());
    let phases = v["phases"].as_array().expect("phases");
    assert_eq!(
        phases.len(),
        1 + 3 * 3,
        "load, then forward/backward/optimizer of 3 steps"
    );
    let phase_peak = phases.iter().filter(|p| p["step"].as_u64() > Some(0));
    let max = phase_peak
        .map(|p| p["peak_allocated_bytes"].as_u64().unwrap())
        .max();
    assert_eq!(max, v["peak_allocated_bytes"].as_u64());
    assert_eq!(v["gpu"]["name"], "a10g");
    assert!(v["gpu"]["fits"].is_boolean());
}

/// A pipeline-parallel estimate lists every stage (its layers, its rank, its rank's peak) and
/// names the worst rank and its stage; the top-level numbers are that rank's.
#[test]
fn estimate_json_lists_every_pipeline_stage() {
    let v = json(&[
        "estimate",
        "examples/llama-3.1-70b-pp8-interleaved-8xh200.yaml",
        "--gpu",
        "h200",
        "--json",
    ]);
    let pipeline = &v["per_gpu_of"]["pipeline"];
    assert_eq!(pipeline["pp"], 8);
    assert_eq!(pipeline["schedule"], "interleaved-1f1b");
    let stages = v["stages"].as_array().expect("stages");
    assert_eq!(stages.len(), 16, "pp 8 × vpp 2");
    let mut next_layer = 0;
    for (i, stage) in stages.iter().enumerate() {
        assert_eq!(stage["stage"], i as u64);
        assert_eq!(stage["first_layer"], next_layer, "stage {i}");
        assert_eq!(stage["layers"], 5, "80 layers over 16 stages");
        next_layer += 5;
        assert_eq!(
            stage["worst_rank"],
            (i % 8) as u64,
            "rank r holds stages r and r + 8"
        );
    }
    let worst = &v["worst_rank"];
    let of_worst: Vec<&Value> = stages
        .iter()
        .filter(|s| s["worst_rank"] == worst["rank"])
        .collect();
    assert_eq!(of_worst.len(), 2);
    assert_eq!(of_worst[0]["stage"], worst["stage"]);
    for stage in of_worst {
        assert_eq!(stage["peak_allocated_bytes"], v["peak_allocated_bytes"]);
        assert_eq!(stage["peak_reserved_bytes"], v["peak_reserved_bytes"]);
    }
    let most = stages
        .iter()
        .map(|s| s["peak_reserved_bytes"].as_u64().expect("bytes"))
        .max();
    assert_eq!(v["peak_reserved_bytes"].as_u64(), most);
}

#[test]
fn the_stage_table_names_the_rank_the_json_and_the_heading_name() {
    let args = [
        "estimate",
        "examples/llama-3.1-70b-megatron-tp8-pp4-64xh100.yaml",
        "--gpu",
        "h100-80gb",
    ];
    let text = stdout(&headroom(&args));
    let v = json(&[args.as_slice(), &["--json"]].concat());
    let rows: Vec<Vec<String>> = text
        .lines()
        .skip_while(|l| !l.contains("stage ┆ layers"))
        .filter(|l| l.starts_with('│') && !l.contains("stage ┆"))
        .map(|l| {
            l.trim_matches('│')
                .split('┆')
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect();
    let stages = v["stages"].as_array().expect("stages");
    assert_eq!(rows.len(), stages.len());
    for (row, stage) in rows.iter().zip(stages) {
        assert_eq!(row[0], stage["stage"].to_string());
        assert_eq!(row[2], stage["worst_rank"].to_string(), "{row:?}");
    }
    assert_eq!(stages[1]["worst_rank"], 16, "tp 8 × dp 2 ranks per stage");
    let worst = v["worst_rank"]["rank"].to_string();
    assert!(
        text.contains(&format!("rank {worst}'s")),
        "the heading names rank {worst}"
    );
}

#[test]
fn estimate_without_gpu_is_the_demand_and_a_gpu_that_fits_changes_nothing() {
    let demand = json(&["estimate", "examples/qwen2.5-7b-lora.yaml", "--json"]);
    let h200 = json(&[
        "estimate",
        "examples/qwen2.5-7b-lora.yaml",
        "--json",
        "--gpu",
        "h200",
    ]);
    assert!(demand.get("gpu").is_none());
    assert_eq!(demand["peak_reserved_bytes"], h200["peak_reserved_bytes"]);
    assert_eq!(h200["gpu"]["oom"], Value::Null);
}

#[test]
fn bad_specs_name_the_field_the_value_and_what_is_allowed() {
    let cases = [
        (
            "unknown-model",
            vec!["qwen2.5-7", "qwen2.5-7b", "headroom models"],
        ),
        ("malformed", vec!["malformed.yaml:3:8"]),
        ("batch-zero", vec!["batch_size", "0", ">= 1"]),
        ("negative-seq", vec!["seq_len", "-5", ">= 1"]),
        ("lora-rank", vec!["lora.r", "8192", "r <= 4864"]),
        ("lora-target", vec!["lora.targets", "nope_proj", "q_proj"]),
        (
            "moe-experts-implementation",
            vec!["experts_implementation", "megablocks", "grouped_mm"],
        ),
        (
            "moe-experts-on-dense",
            vec!["experts_implementation", "eager", "no experts"],
        ),
        (
            "moe-routing",
            vec!["routing.max_tokens_per_expert_factor", "0.5", "from 1"],
        ),
        ("moe-lora-dropout", vec!["lora.dropout", "0.1", "use 0"]),
        (
            "moe-eager-work",
            vec![
                "experts_implementation",
                "4096000 expert calls",
                "grouped_mm",
            ],
        ),
        (
            "moe-batched-overflow",
            vec!["experts_implementation", "batched_mm", "beyond any device"],
        ),
        (
            "moe-lora-half-fused",
            vec!["lora.targets", "gate_proj", "both or neither"],
        ),
        ("bad-enum", vec!["precision", "fp8", "amp-bf16"]),
        (
            "unknown-key",
            vec!["batchsize", "did you mean `batch_size`"],
        ),
        ("not-a-mapping", vec!["mapping"]),
        (
            "parallel-strategy",
            vec!["parallel.strategy", "zero4", "fsdp"],
        ),
        (
            "parallel-shard-size",
            vec!["parallel.shard_size", "3", "divide world_size (8)"],
        ),
        (
            "parallel-forward-zero2",
            vec!["parallel.strategy", "zero2", "leave `parallel` out"],
        ),
        ("versions", vec!["versions.torch", "2.x", "major.minor"]),
        (
            "versions-number",
            vec!["versions.transformers", "4.57", "quote it"],
        ),
        (
            "pipeline-unknown-instance",
            vec!["phases[0].run[0]", "critic", "actor"],
        ),
        (
            "pipeline-generate-tokens",
            vec!["phases[0].run[0].new_tokens", "512", "fewer than 512"],
        ),
        ("trainer-unknown", vec!["trainer", "trl-ppo", "trl-grpo"]),
        (
            "trainer-foreign-key",
            vec![
                "num_generations",
                "trl-dpo has no such setting",
                "precompute_ref_log_probs",
            ],
        ),
        (
            "trainer-loop-key",
            vec![
                "gradient_accumulation_steps",
                "trainer loop",
                "set `trainer:`",
            ],
        ),
        (
            "trainer-grpo-groups",
            vec!["num_generations", "4", "multiple of num_generations"],
        ),
        (
            "trainer-grpo-seq-len",
            vec!["seq_len", "prompt_len + completion_len"],
        ),
        (
            "trainer-dpo-precompute-reference",
            vec!["precompute_ref_log_probs", "choose one"],
        ),
        (
            "parallel-mixed-precision-ddp",
            vec!["parallel.mixed_precision", "apply to fsdp and fsdp1"],
        ),
        (
            "parallel-mixed-precision-autocast",
            vec!["precision", "amp-bf16", "use fp32"],
        ),
        ("autocast-without-policy", vec!["autocast", "amp-bf16"]),
        ("parallel-units-ddp", vec!["parallel.units", "fsdp only"]),
        (
            "parallel-units-unknown",
            vec!["parallel.units", "torchtitan", "layers-embedding"],
        ),
        ("fsdp1-one-rank", vec!["parallel.world_size", "NO_SHARD"]),
        (
            "fsdp1-output-dtype",
            vec!["parallel.mixed_precision.output_dtype", "buffer_dtype"],
        ),
        (
            "fsdp-use-orig-params",
            vec!["parallel.use_orig_params", "fsdp1 only"],
        ),
        (
            "trainer-grpo-work",
            vec!["completion_len", "100000", "shorter completion"],
        ),
        (
            "trainer-liger-gemma",
            vec!["use_liger_kernel", "Gemma2", "Qwen3"],
        ),
        (
            "trainer-vllm-key-without-vllm",
            vec!["vllm_gpu_memory_utilization", "0.5", "use_vllm: true"],
        ),
    ];
    let mut messages = String::new();
    for (name, words) in cases {
        let path = format!("crates/headroom-cli/tests/fixtures/bad/{name}.yaml");
        let err = bad_input(&["estimate", &path]);
        for w in words {
            assert!(err.contains(w), "{name}: `{w}` missing from {err}");
        }
        messages += &format!("{name}: {err}");
    }
    insta::assert_snapshot!(messages);
}

#[test]
fn bad_files_and_flags() {
    let missing = bad_input(&["estimate", "no/such/spec.yaml"]);
    assert!(missing.contains("no/such/spec.yaml"), "{missing}");
    let gpu = bad_input(&["estimate", "examples/qwen2.5-7b-lora.yaml", "--gpu", "h900"]);
    assert!(gpu.contains("h900") && gpu.contains("h100-80gb"), "{gpu}");
    let filter = bad_input(&["models", "no-such-family"]);
    assert!(filter.contains("no-such-family"), "{filter}");
    // clap's own usage errors exit 2 as well.
    bad_input(&["estimate"]);
    bad_input(&["estimate", "examples/qwen2.5-7b-lora.yaml", "--bogus"]);
}

/// `--rank N` answers for one global rank: a Megatron pipeline's first stage differs from its
/// last, the worst rank's numbers are what the plain estimate prints, and a rank outside the
/// world exits 2 naming the flag and the ranks there are.
#[test]
fn rank_answers_for_one_rank_of_the_world() {
    let spec = "examples/llama-3.1-70b-megatron-tp8-pp4-64xh100.yaml";
    let at = |rank: Option<&str>| {
        let mut args = vec!["estimate", spec, "--gpu", "h100-80gb", "--json"];
        args.extend(rank.map(|r| ["--rank", r]).into_iter().flatten());
        json(&args)
    };
    let worst = at(None);
    let rank = worst["worst_rank"]["rank"].as_u64().expect("worst rank");
    let same = at(Some(&rank.to_string()));
    assert_eq!(same["peak_reserved_bytes"], worst["peak_reserved_bytes"]);
    let last = at(Some("63"));
    assert_eq!(last["worst_rank"]["stage"], 3);
    let reserved = |v: &Value| v["peak_reserved_bytes"].as_u64().expect("reserved");
    assert!(reserved(&last) < reserved(&worst));
    let outside = bad_input(&["estimate", spec, "--rank", "64"]);
    assert!(
        outside.contains("--rank") && outside.contains("0 to 63"),
        "{outside}"
    );
}

#[test]
fn models_moe_lists_the_mixture_of_experts_models_with_their_active_parameters() {
    let moe = json(&["models", "moe", "--json"]);
    let moe = moe.as_array().expect("array");
    let names: Vec<&str> = moe.iter().map(|m| m["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "deepseek-v2-lite",
            "deepseek-v3",
            "gpt-oss-120b",
            "gpt-oss-20b",
            "mixtral-8x22b",
            "mixtral-8x7b",
            "olmoe-1b-7b",
            "qwen2-57b-a14b",
            "qwen3-235b-a22b",
            "qwen3-30b-a3b",
        ]
    );
    for m in moe {
        let (total, active) = (
            m["params"].as_u64().unwrap(),
            m["active_params"].as_u64().unwrap(),
        );
        assert!(active < total / 2, "{m}");
        assert!(m["experts"].as_u64().unwrap() > m["experts_per_token"].as_u64().unwrap());
    }
    // Qwen3-30B-A3B activates 3.3B of its 30.5B parameters (its name says A3B).
    let q = moe.iter().find(|m| m["name"] == "qwen3-30b-a3b").unwrap();
    assert_eq!(q["active_params"].as_u64(), Some(3_353_032_704));
    let dense = json(&["models", "dense", "--json"]);
    assert!(
        dense
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["experts"].is_null())
    );
}

#[test]
fn models_lists_the_catalog_with_exact_parameter_counts() {
    insta::assert_snapshot!(stdout(&headroom(&["models", "qwen3"])));
    let all = json(&["models", "--json"]);
    let names: Vec<&str> = all
        .as_array()
        .expect("array")
        .iter()
        .map(|m| m["name"].as_str().expect("name"))
        .collect();
    for name in [
        "llama-3.1-8b",
        "mistral-7b",
        "phi-3-mini",
        "gemma-2-9b",
        "gpt2",
        "qwen2.5-72b",
    ] {
        assert!(names.contains(&name), "{name} missing");
    }
}

#[test]
fn validate_reports_every_row_and_the_gates_fail_when_crossed() {
    let v = json(&["validate", "bench/snapshots/runs.jsonl", "--json"]);
    assert_eq!(v["rows"].as_array().expect("rows").len(), 8);
    assert!(v["allocated"]["max_abs_error"].as_f64().expect("max") < 0.01);
    // An impossible gate: 0% error allowed.
    let out = headroom(&[
        "validate",
        "bench/snapshots/runs.jsonl",
        "--max-reserved-error",
        "0",
        "--max-alloc-error",
        "0",
    ]);
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn measure_without_python_or_torch_says_what_to_install() {
    let err = bad_input(&[
        "measure",
        "examples/qwen2.5-7b-lora.yaml",
        "--python",
        "/nonexistent/python3",
    ]);
    assert!(
        err.contains("/nonexistent/python3") && err.contains("pip install torch"),
        "{err}"
    );
    // The Python of this machine: without torch (CI), or without a GPU.
    let out = headroom(&["measure", "examples/qwen2.5-7b-lora.yaml"]);
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(2) {
        assert!(err.contains("torch"), "{err}");
    }
    // A bad spec is refused before any Python runs.
    let err = bad_input(&[
        "measure",
        "crates/headroom-cli/tests/fixtures/bad/batch-zero.yaml",
        "--python",
        "/nonexistent/python3",
    ]);
    assert!(err.contains("batch_size"), "{err}");
}

/// A trainer spec is measured by the trainer harness (`headroom_measure.trainers`), whose
/// segments are compared phase by phase. The Python here is a stand-in that prints what the
/// harness prints and records how it was called.
#[cfg(unix)]
#[test]
fn measure_runs_the_trainer_harness_for_a_trainer_spec() {
    use std::os::unix::fs::PermissionsExt;

    let dir = tempfile::tempdir().unwrap();
    let calls = dir.path().join("calls.txt");
    let record = serde_json::json!({
        "env": {"gpu": "NVIDIA H100 80GB HBM3"},
        "measured": {
            "peak_allocated_bytes": 16_637_161_984u64,
            "peak_reserved_bytes": 18_167_627_776u64,
            "segments": [
                {"step": 1, "name": "forward:policy", "peak_allocated": 5_000_000_000u64},
                {"step": 1, "name": "forward:reference", "peak_allocated": 5_100_000_000u64},
                {"step": 1, "name": "backward", "peak_allocated": 16_000_000_000u64},
                {"step": 1, "name": "optimizer", "peak_allocated": 9_000_000_000u64}
            ]
        }
    });
    let python = dir.path().join("python3");
    std::fs::write(
        &python,
        format!(
            "#!/bin/sh\necho \"$@\" >> {}\necho '{}'\n",
            calls.display(),
            record
        ),
    )
    .unwrap();
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = headroom(&[
        "measure",
        "examples/trl-dpo.yaml",
        "--python",
        python.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let called = std::fs::read_to_string(&calls).unwrap();
    assert!(
        called.starts_with("-m headroom_measure.trainers run --spec-json"),
        "{called}"
    );
    assert!(called.contains("\"trainer\":\"trl-dpo\""), "{called}");
    let table = stdout(&out);
    for phase in [
        "forward",
        "reference",
        "backward",
        "optimizer",
        "peak allocated",
    ] {
        assert!(table.contains(phase), "{phase} missing from {table}");
    }
}

#[test]
fn pipeline_estimate_per_phase() {
    insta::assert_snapshot!(stdout(&headroom(&[
        "estimate",
        "examples/seed001-ref-manual-offload.yaml",
        "--gpu",
        "h100-80gb",
    ])));
    let v = json(&[
        "estimate",
        "examples/seed003-phi3-dpo.yaml",
        "--json",
        "--gpu",
        "h100-80gb",
    ]);
    for key in [
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "cuda_context_bytes",
        "host_bytes",
    ] {
        assert!(v[key].is_u64(), "{key}");
    }
    let phases = v["phases"].as_array().expect("phases");
    assert_eq!(phases.len(), 1 + 2 * 3);
    for p in phases {
        for key in ["peak_allocated_bytes", "peak_reserved_bytes", "host_bytes"] {
            assert!(p[key].is_u64(), "{key}");
        }
    }
    // Seed 003 ran out in the first policy step on an H100; so does the estimate.
    assert_eq!(v["gpu"]["fits"], false);
    assert_eq!(v["gpu"]["oom"]["phase"], "train");
    assert_eq!(v["gpu"]["oom"]["iteration"], 0);
    let err = bad_input(&[
        "estimate",
        "crates/headroom-cli/tests/fixtures/bad/pipeline-placement.yaml",
    ]);
    assert!(
        err.contains("placement") && err.contains("fsdp2-offload"),
        "{err}"
    );
}

/// Where each instance lives names the offload its strategy does: FSDP1's CPUOffload for verl's
/// reference, and a DDP instance on the GPU over its ranks.
#[test]
fn pipeline_instances_say_how_they_are_offloaded() {
    let text = stdout(&headroom(&[
        "estimate",
        "bench/pipelines/ddp-fsdp1/verl-fsdp1-q7b-w8.yaml",
        "--gpu",
        "h200",
    ]));
    assert!(text.contains("GPU, fsdp1 over 8 ranks"), "{text}");
    assert!(text.contains("host (FSDP1 CPUOffload, 8 ranks)"), "{text}");
    let text = stdout(&headroom(&[
        "estimate",
        "bench/pipelines/ddp-fsdp1/dpo-ddp-q1.5b-w4.yaml",
        "--gpu",
        "h200",
    ]));
    assert!(text.contains("GPU, ddp over 4 ranks"), "{text}");
}

#[cfg(unix)]
#[test]
fn a_reader_that_goes_away_ends_the_output_quietly() {
    use std::process::Stdio;
    // `headroom validate ... | head`: the reader closes the pipe before any line.
    let mut child = Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(["validate", "bench/calibration/h200-torch2.11.jsonl"])
        .current_dir(repo())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("ends");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
}

/// Every built-in example estimates, as a run or a pipeline, with the JSON contract's peaks.
#[test]
fn every_example_estimates() {
    let mut names: Vec<String> = std::fs::read_dir(repo().join("examples"))
        .expect("examples/")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    names.sort();
    assert!(names.len() >= 15, "{names:?}");
    for name in names {
        let v = json(&["estimate", &format!("examples/{name}"), "--json"]);
        let allocated = v["peak_allocated_bytes"].as_u64().unwrap_or(0);
        let reserved = v["peak_reserved_bytes"].as_u64().unwrap_or(0);
        assert!(allocated > 0 && reserved >= allocated, "{name}: {v}");
    }
}

/// Seed 004's reward model: replicated by DDP it does not fit 64 GB; partitioned by ZeRO-2 it
/// does, and with the optimizer on the host it holds less on the GPU and reports the host bytes.
#[test]
fn seed004_zero2_fits_where_ddp_does_not() {
    let device = |name: &str| {
        let v = json(&[
            "estimate",
            &format!("examples/{name}"),
            "--json",
            "--gpu",
            "64GB",
        ]);
        (
            v["gpu"]["fits"].as_bool(),
            v["gpu"]["headroom_bytes"].as_i64().expect("headroom"),
            v["host_bytes"].as_u64().expect("host bytes"),
        )
    };
    let (ddp_fits, ddp, _) = device("seed004-rm-8x64gb.yaml");
    let (zero2_fits, zero2, _) = device("seed004-rm-zero2-8x64gb.yaml");
    let (offload_fits, offload, host) = device("seed004-rm-zero2-offload-8x64gb.yaml");
    assert_eq!(
        (ddp_fits, zero2_fits, offload_fits),
        (Some(false), Some(true), Some(true))
    );
    assert!(offload > zero2 && zero2 > ddp, "{offload} {zero2} {ddp}");
    assert!(host > 10 << 30, "{host}");
}

/// The events `estimate --timeline` writes for the spec `json`.
fn timeline_of(json: &str) -> Vec<Value> {
    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("spec.json");
    std::fs::write(&spec, json).unwrap();
    let timeline = dir.path().join("timeline.jsonl");
    stdout(&headroom(&[
        "estimate",
        spec.to_str().unwrap(),
        "--timeline",
        timeline.to_str().unwrap(),
    ]));
    std::fs::read_to_string(&timeline)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// transformers 4.57 builds its causal mask from positions to mask as the H100 run did: the
/// requests from `cache_position` to the rotary table's first, as
/// bench/transformers-4.57/snapshots/q05-bf16-bs4-s2048-tf4.57.pickle.gz recorded them (its
/// events 307-346: `find_packed_sequence_indices`, then `sdpa_mask_recent_torch`'s vmapped
/// `and_masks(causal, packed)`, then the packed mask freed as `create_causal_mask` returns).
#[test]
fn transformers_4_57_builds_the_causal_mask_as_the_h100_run_did() {
    let events = timeline_of(
        r#"{"model": "qwen2.5-0.5b", "precision": "bf16", "optimizer": "adamw", "batch_size": 4,
            "seq_len": 2048, "attention": "sdpa", "versions": {"transformers": "4.57"}}"#,
    );
    let start = events
        .iter()
        .position(|e| e["label"] == "cache_position")
        .expect("4.57's cache_position");
    let end = events
        .iter()
        .position(|e| e["label"] == "rotary position_ids.float()")
        .expect("the rotary table");
    let simulated: Vec<i64> = events[start..end]
        .iter()
        .map(|e| {
            let bytes = e["bytes"].as_i64().unwrap();
            if e["alloc"] == true { bytes } else { -bytes }
        })
        .collect();
    let (mi, kv) = (4 << 20, 16 << 20);
    let recorded: Vec<i64> = vec![
        16384, 32, 65568, 65536, -65568, 8192, 65536, 65536, -65536, -8192, -32,
        -65536, // packed
        16384, 32, 8, 2048, mi, mi, -mi, -2048, // aranges, and_mask's ones & causal
        65536, 65536, 65536, -65536, -65536, 65536, 65536, 65536, -65536,
        -65536, // two gathers
        kv, -65536, -65536, kv, -kv, -mi, -16384, -32, -8, -65536,
    ];
    assert_eq!(simulated, recorded);
}

/// transformers 4.49 to 4.52 hand SDPA keys and values repeated to every query head and
/// contiguous inputs (`sdpa_attention_forward`: `repeat_kv`, then `.contiguous()`), so the
/// flash kernel writes its output head-major and `.transpose(1, 2).contiguous()` copies it:
/// per layer and forward, two `repeat_kv` copies, the query's copy and the output's, none of
/// which 5.17 makes; 4.46-4.47 repeat too, and shift the logits rather than the labels
/// (bench/transformers-older, qwen2.5-0.5b measured within 0.01% under both).
#[test]
fn transformers_4_46_and_4_51_repeat_keys_and_values_for_sdpa() {
    let count = |release: &str| {
        let events = timeline_of(&format!(
            r#"{{"model": "qwen2.5-0.5b", "precision": "bf16", "optimizer": "adamw",
                "batch_size": 2, "seq_len": 512, "attention": "sdpa",
                "versions": {{"transformers": "{release}"}}}}"#
        ));
        let allocs = |label: &str, bytes: i64| {
            events
                .iter()
                .filter(|e| e["alloc"] == true && e["label"] == label && e["bytes"] == bytes)
                .count()
        };
        // (b, heads, s, head_dim) in bf16: 2 * 14 * 512 * 64 * 2 bytes.
        let per_head_major = 2 * 14 * 512 * 64 * 2;
        let vocab = 151_936;
        (
            allocs("repeat_kv", per_head_major),
            allocs("x.contiguous()", per_head_major),
            allocs("x.contiguous()", 2 * 511 * vocab * 4),
            allocs("grad of slice (zeros + copy)", 2 * 512 * vocab * 4),
        )
    };
    // 24 layers, 3 steps: 2 repeats and 2 copies (query and output) per layer and forward.
    assert_eq!(count("4.51.3"), (2 * 24 * 3, 2 * 24 * 3, 0, 0));
    // 4.46's `Qwen2SdpaAttention` repeats without copying; its loss copies the shifted fp32
    // logits, (b, s - 1, vocab), and backward scatters their gradient into (b, s, vocab).
    let vocab = 151_936;
    assert_eq!(
        count("4.46.3"),
        (2 * 24 * 3, 0, 3, 3),
        "shifted logits of {} bytes",
        2 * 511 * vocab * 4
    );
    assert_eq!(count("5.17"), (0, 0, 0, 0));
}

/// transformers 4.46-4.48 copy the shifted fp32 logits in their loss, modelled on one head; over
/// a vocabulary-parallel head the estimate refuses the release by name (4.51 runs).
#[test]
fn tensor_parallelism_under_transformers_4_46_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let spec = |version: &str| {
        let path = dir.path().join(format!("tp-{version}.yaml"));
        std::fs::write(
            &path,
            format!(
                "model: qwen2.5-7b\nprecision: bf16\nbatch_size: 1\nseq_len: 1024\n\
                 parallel: {{strategy: none, world_size: 2, tp: 2, sequence_parallel: true}}\n\
                 versions: {{transformers: \"{version}\"}}\n"
            ),
        )
        .unwrap();
        path.display().to_string()
    };
    for release in ["4.46.3", "4.48.3"] {
        let err = bad_input(&["estimate", &spec(release)]);
        assert!(
            err.contains("transformers 4.46-4.48 with parallel.tp 2"),
            "{err}"
        );
    }
    stdout(&headroom(&["estimate", &spec("4.51.3")]));
}

/// A run whose loading peaks above every step (an offloaded Megatron optimizer under full
/// recomputation: bench/megatron-offload) says so under its peak; one whose steps peak higher
/// does not.
#[test]
fn a_load_above_every_step_is_a_row_of_its_own() {
    let row = include_str!("../../../../bench/megatron-offload/rows-call2-h200-torch2.11.jsonl")
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("row"))
        .find(|r| {
            r["id"]
                .as_str()
                .is_some_and(|id| id.ends_with("full-uniform1/offload/rank7"))
        })
        .expect("the Qwen3-4B pipeline row");
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = dir.path().join("spec.json");
    std::fs::write(&spec, row["spec"].to_string()).expect("spec written");
    let spec = spec.display().to_string();
    let out = stdout(&headroom(&["estimate", &spec, "--gpu", "h200"]));
    let line = out
        .lines()
        .find(|l| l.contains("loading peaks higher"))
        .unwrap_or_else(|| panic!("no load row:\n{out}"));
    // The measured load: 3,178,219,008 bytes.
    assert!(line.contains("2.96 GiB"), "{line}");
    let plain = stdout(&headroom(&[
        "estimate",
        "examples/qwen2.5-7b-lora.yaml",
        "--gpu",
        "h100-80gb",
    ]));
    assert!(!plain.contains("loading peaks higher"));
}
