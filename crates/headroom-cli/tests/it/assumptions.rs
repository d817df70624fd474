//! The assumptions every estimate-fed report ends with: the `assumptions` object of `--json`
//! (its shape is a contract) and the text block, with a `warning:` line exactly where something
//! is carried over or not modelled.

use serde_json::Value;

use crate::common::{headroom, json, p, stdout};

/// Its keys, sorted as they print.
fn keys(v: &Value) -> Vec<&str> {
    v.as_object()
        .expect("an object")
        .keys()
        .map(String::as_str)
        .collect()
}

#[test]
fn estimate_json_carries_versions_gpu_constants_and_warnings() {
    let v = json(&[
        "estimate",
        "examples/qwen2.5-7b-lora.yaml",
        "--json",
        "--gpu",
        "a100-80gb",
    ]);
    let a = &v["assumptions"];
    assert_eq!(keys(a), ["gpu", "versions", "warnings"]);
    assert_eq!(
        keys(&a["versions"]),
        [
            "bitsandbytes",
            "deepspeed",
            "peft",
            "torch",
            "transformers",
            "trl"
        ]
    );
    assert_eq!(a["versions"]["torch"]["followed"], "2.11.0");
    assert_eq!(a["versions"]["transformers"]["followed"], "5.17.0");
    assert_eq!(a["versions"]["torch"]["given"], Value::Null);
    assert_eq!(a["versions"]["trl"]["followed"], "1.16.0");
    let g = &a["gpu"];
    assert_eq!(
        keys(g),
        [
            "architecture",
            "cublas_workspace",
            "cublaslt_workspace",
            "cuda_context",
            "name",
            "total"
        ]
    );
    assert_eq!(g["name"], "a100-80gb");
    assert_eq!(g["architecture"], "ampere");
    for c in [
        "total",
        "cuda_context",
        "cublas_workspace",
        "cublaslt_workspace",
    ] {
        assert_eq!(keys(&g[c]), ["basis", "bytes", "source"], "{c}");
    }
    assert_eq!(g["total"]["basis"], "oom_message");
    assert_eq!(g["cuda_context"]["basis"], "carried_over");
    assert_eq!(g["cublas_workspace"]["bytes"], 8_519_680);
    assert_eq!(g["cublas_workspace"]["basis"], "pytorch_source");
    assert_eq!(g["cublaslt_workspace"]["bytes"], 1 << 20);
    assert_eq!(g["total"]["bytes"], v["gpu"]["total_bytes"]);
    let warnings = a["warnings"].as_array().expect("warnings");
    assert_eq!(warnings.len(), 1, "{warnings:?}");

    let h100 = json(&[
        "estimate",
        "examples/qwen2.5-7b-lora.yaml",
        "--json",
        "--gpu",
        "h100-80gb",
    ]);
    assert_eq!(h100["assumptions"]["warnings"], serde_json::json!([]));
    assert_eq!(
        h100["assumptions"]["gpu"]["cublas_workspace"]["bytes"],
        32 << 20
    );
    // Without --gpu the estimate is the H200's, and says so.
    let demand = json(&["estimate", "examples/qwen2.5-7b-lora.yaml", "--json"]);
    assert_eq!(demand["assumptions"]["gpu"]["name"], "h200");
}

#[test]
fn pipelines_fit_and_diagnose_report_assumptions_too() {
    let pipeline = json(&[
        "estimate",
        "examples/grpo-vllm-colocated.yaml",
        "--json",
        "--gpu",
        "h100-80gb",
    ]);
    let warnings = pipeline["assumptions"]["warnings"].as_array().unwrap();
    assert!(
        warnings
            .iter()
            .any(|w| w.as_str().unwrap().contains("vLLM's contract")),
        "{warnings:?}"
    );
    let fit = json(&["fit", &p("seed002/agent.yaml"), "--gpu", "l40s", "--json"]);
    assert_eq!(fit["assumptions"]["gpu"]["architecture"], "ada");
    assert_eq!(
        fit["assumptions"]["gpu"]["total"]["bytes"],
        fit["gpu"]["total_bytes"]
    );
    let diagnose = json(&[
        "diagnose",
        "--oom",
        &p("seed003/oom.log"),
        "--spec",
        &p("seed003/train.yaml"),
        "--json",
    ]);
    assert_eq!(diagnose["assumptions"]["gpu"]["name"], "h100-80gb");
    assert_eq!(diagnose["assumptions"]["warnings"], serde_json::json!([]));
}

#[test]
fn the_text_block_ends_each_report_with_its_warnings() {
    let h100 = stdout(&headroom(&[
        "estimate",
        "examples/qwen2.5-7b-lora.yaml",
        "--gpu",
        "h100-80gb",
    ]));
    let block = &h100[h100.find("\nAssumptions\n").expect("an Assumptions block")..];
    assert!(
        block.contains("follows torch 2.11.0, transformers 5.17.0"),
        "{block}"
    );
    assert!(block.contains("h100-80gb (hopper)"), "{block}");
    assert!(!block.contains("warning:"), "{block}");

    let v100 = stdout(&headroom(&[
        "estimate",
        "examples/qwen2.5-7b-lora.yaml",
        "--gpu",
        "v100-32gb",
    ]));
    let block = &v100[v100.find("\nAssumptions\n").expect("an Assumptions block")..];
    let warnings: Vec<&str> = block
        .lines()
        .filter(|l| l.starts_with("warning: "))
        .collect();
    assert_eq!(warnings.len(), 2, "{block}");
    assert!(warnings[1].contains("no FlashAttention"), "{block}");
    assert!(block.ends_with('\n') && block.trim_end().lines().last() == warnings.last().copied());

    let fit = stdout(&headroom(&[
        "fit",
        &p("seed002/agent.yaml"),
        "--gpu",
        "a10g",
    ]));
    assert!(
        fit.contains("\nAssumptions\n") && fit.contains("warning: a10g is ampere"),
        "{fit}"
    );
}
