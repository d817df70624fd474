//! `fit --gpus N`'s layout search end to end: its best layout is what `estimate` says of the
//! spec its keys write, to the byte; the ranking's rule holds in `--json`; a cluster too small
//! is refused with the layout that needs least; bad `--gpus` and `--gpu` exit 2.

use serde_json::Value;

use crate::common::{bad_input, headroom, json, stdout};

const LLAMA_70B_TP: &str = "examples/llama-3.1-70b-tp8-fsdp2-64xh100.yaml";

/// The spec file with `keys` written over it, as JSON in a temporary file.
fn spec_with(keys: &Value) -> tempfile::NamedTempFile {
    let text = std::fs::read_to_string(crate::common::repo().join(LLAMA_70B_TP)).expect("spec");
    with_keys(&text, LLAMA_70B_TP.as_ref(), keys)
}

/// The spec `text` (read from `path`) with `keys` set, as a layout's spec keys are applied.
pub(crate) fn with_keys(
    text: &str,
    path: &std::path::Path,
    keys: &Value,
) -> tempfile::NamedTempFile {
    let mut doc = headroom::spec::parse_document(text, path).expect("yaml");
    for (k, v) in keys.as_object().expect("keys") {
        doc[k] = v.clone();
    }
    temp_spec(&doc.to_string(), ".json")
}

/// A temporary spec file holding `text`.
pub(crate) fn temp_spec(text: &str, suffix: &str) -> tempfile::NamedTempFile {
    let file = tempfile::Builder::new()
        .suffix(suffix)
        .tempfile()
        .expect("temp file");
    std::fs::write(file.path(), text).expect("written");
    file
}

/// The ranking's rule over `ranked` (`fit --json`'s `layouts.ranked`): the spec's global batch
/// first, whole steps simulated before accumulation, then the margin kept, then faster.
pub(crate) fn assert_ranking_rule(ranked: &[Value]) {
    let key = |e: &Value| {
        (
            (
                e["exact"] == false,
                e["simulated"] == false,
                e["within_margin"] == false,
            ),
            e["time_per_token"].as_f64().expect("time"),
        )
    };
    for pair in ranked.windows(2) {
        let (a, b) = (key(&pair[0]), key(&pair[1]));
        assert!(
            a.0 < b.0 || (a.0 == b.0 && a.1 <= b.1),
            "{} before {}",
            pair[0]["name"],
            pair[1]["name"]
        );
    }
}

#[test]
fn the_best_layout_is_what_estimate_says_of_its_spec() {
    let fit = json(&[
        "fit",
        LLAMA_70B_TP,
        "--gpu",
        "h100-80gb",
        "--gpus",
        "64",
        "--json",
    ]);
    assert_eq!(fit["knobs_searched"], false, "a tensor-parallel spec");
    let l = &fit["layouts"];
    assert_eq!(l["searched"], true);
    assert_eq!(l["gpus"], 64);
    assert_eq!(l["axes"], serde_json::json!(["pp", "tp", "cp", "sp", "dp"]));
    let best = &l["best"];
    assert_eq!(best, &l["ranked"][0]);
    assert_eq!(best["exact"], true);
    assert_eq!(best["within_margin"], true);
    assert_eq!(best["time_per_token"], 1.0);
    assert!(!l["why_best"].as_array().expect("why").is_empty());
    assert!(l["candidates"].as_u64() >= l["simulated"].as_u64());

    let ranked = l["ranked"].as_array().expect("ranked");
    assert_ranking_rule(ranked);
    for e in ranked {
        let margin = e["margin_bytes"].as_i64().expect("margin");
        assert_eq!(
            e["within_margin"],
            e["headroom_bytes"].as_i64().expect("headroom") >= margin
        );
    }

    let file = spec_with(&best["spec"]);
    let path = file.path().display().to_string();
    let est = json(&["estimate", &path, "--gpu", "h100-80gb", "--json"]);
    for key in ["peak_allocated_bytes", "peak_reserved_bytes", "nccl_bytes"] {
        assert_eq!(est[key], best[key], "{key}");
    }
    assert_eq!(est["gpu"]["headroom_bytes"], best["headroom_bytes"]);
    assert_eq!(est["gpu"]["fits"], true);
}

#[test]
fn the_human_output_names_the_best_layout_and_why() {
    let out = stdout(&headroom(&["fit", LLAMA_70B_TP, "--gpu", "h100-80gb"]));
    insta::assert_snapshot!(out);
}

/// On 2 H100s nothing fits a 70B full fine-tune: the search says so and names the layout
/// that needs least, with what it lacks.
#[test]
fn a_cluster_too_small_gets_the_layout_that_needs_least() {
    let file = temp_spec(
        "model: llama-3.1-70b\nprecision: bf16\noptimizer: adamw\nbatch_size: 1\nseq_len: 4096\n",
        ".yaml",
    );
    let spec = file.path().display().to_string();
    let args = ["fit", &spec, "--gpu", "h100-80gb", "--gpus", "2"];
    let out = stdout(&headroom(&args));
    assert!(out.contains("none fits: the one that needs least"), "{out}");
    let fit = json(&[&args[..], &["--json"]].concat());
    let l = &fit["layouts"];
    assert!(l["best"].is_null());
    assert_eq!(l["fitting"], 0);
    assert!(l["closest"]["headroom_bytes"].as_i64().expect("headroom") < 0);
}

/// A run with adapters keeps its knob search and says why it has no layout search.
#[test]
fn adapters_are_not_laid_out() {
    let fit = json(&[
        "fit",
        "examples/qwen2.5-7b-lora.yaml",
        "--gpu",
        "h100-80gb",
        "--gpus",
        "2",
        "--json",
    ]);
    assert_eq!(fit["knobs_searched"], true);
    assert_eq!(fit["layouts"]["searched"], false);
    assert!(
        fit["layouts"]["not_searched"]
            .as_str()
            .expect("why")
            .contains("adapters")
    );
}

#[test]
fn bad_gpus_and_gpu_exit_2_naming_them() {
    for (args, names) in [
        (vec!["--gpu", "h100-80gb", "--gpus", "0"], "--gpus"),
        (vec!["--gpu", "h100-80gb", "--gpus", "70000"], "--gpus"),
        (vec!["--gpu", "h100-80gb", "--gpus", "many"], "--gpus"),
        (
            vec!["--gpu", "h100-80gb", "--gpus", "12"],
            "parallel.pp × cp × tp (8) must divide",
        ),
        (vec!["--gpu", "tpu-v5", "--gpus", "64"], "tpu-v5"),
        (vec!["--gpu", "0GiB", "--gpus", "64"], "gpu"),
    ] {
        let mut all = vec!["fit", LLAMA_70B_TP];
        all.extend(args.iter().copied());
        let err = bad_input(&all);
        assert!(err.contains(names), "{args:?}: {err}");
    }
}

/// Llama-3.1-8B on sequences of 131,072 tokens over 8 H100s: only context parallelism fits
/// (its ring cuts each rank's activations and logits to `seq_len / cp`), and `--json` says each
/// layout's axes. `fit` of the spec its keys write (a context-parallel spec, refused before the
/// search covered it) plans it as given: the same numbers, and the same layout best.
#[test]
fn a_long_sequence_gets_context_parallelism_and_fit_plans_its_spec() {
    let file = temp_spec(
        "model: llama-3.1-8b\nprecision: bf16\noptimizer: adamw\nbatch_size: 1\nseq_len: 131072\n",
        ".yaml",
    );
    let spec = file.path().display().to_string();
    let fit = json(&["fit", &spec, "--gpu", "h100-80gb", "--gpus", "8", "--json"]);
    let l = &fit["layouts"];
    let ranked = l["ranked"].as_array().expect("ranked");
    assert!(!ranked.is_empty());
    for e in ranked {
        assert!(e["cp"].as_u64().expect("cp") > 1, "{}", e["name"]);
        assert_eq!(e["pp"], 1);
        assert!(e["schedule"].is_null());
        assert_eq!(e["microbatches"], 1);
        let ranks = ["pp", "cp", "tp", "dp"]
            .iter()
            .map(|k| e[*k].as_u64().expect("degree"))
            .product::<u64>();
        assert_eq!(ranks, 8, "{}", e["name"]);
        assert_eq!(e["spec"]["parallel"]["cp"], e["cp"]);
    }
    let best = &l["best"];

    let text = std::fs::read_to_string(file.path()).expect("spec");
    let chosen = with_keys(&text, file.path(), &best["spec"]);
    let path = chosen.path().display().to_string();
    let again = json(&["fit", &path, "--gpu", "h100-80gb", "--json"]);
    assert_eq!(again["knobs_searched"], false, "a context-parallel spec");
    assert_eq!(again["gpus"], 8, "the spec's world_size");
    let est = json(&["estimate", &path, "--gpu", "h100-80gb", "--json"]);
    for key in ["peak_allocated_bytes", "peak_reserved_bytes", "nccl_bytes"] {
        assert_eq!(est[key], best[key], "{key}");
    }
    assert_eq!(
        again["spec"]["peak_reserved_bytes"],
        best["peak_reserved_bytes"]
    );
    // The best accumulates one micro-batch per GPU of the spec's data parallelism, which a
    // training loop's spec cannot say: the spec its keys write trains one micro-batch a step,
    // and `fit` plans that global batch, whose best is the same layout taken whole.
    assert_eq!(best["gradient_accumulation"], 8);
    let planned = &again["layouts"];
    assert_eq!(planned["global_batch"], best["micro_batch"]);
    assert_eq!(planned["best"]["spec"], best["spec"]);
    assert_eq!(planned["best"]["gradient_accumulation"], 1);
    assert_eq!(planned["best"]["simulated"], true);
}
