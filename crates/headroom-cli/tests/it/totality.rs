//! No input crashes the binary: what a fuzz found panicking (exit 101) or aborting (134) now
//! exits 0 with an answer or 2 with a message naming the field; progress never reaches a pipe.

use std::io::Write;

use crate::common::{bad_input, headroom, stderr, stdout};

/// A spec file in a fresh temporary folder (kept until the handle drops).
fn spec(yaml: &str) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let path = dir.path().join("spec.yaml");
    std::fs::File::create(&path)
        .and_then(|mut f| f.write_all(yaml.as_bytes()))
        .expect("written");
    (dir, path.display().to_string())
}

#[test]
fn fit_of_an_fsdp_spec_on_one_gpu_answers() {
    // The search tried LoRA beside the spec's own FSDP, which the simulator does not model:
    // "unreachable: zero_grad(set_to_none=True) runs before every backward".
    let (_dir, path) = spec(
        "model: qwen2.5-0.5b\nprecision: bf16\noptimizer: adamw\nbatch_size: 1\nseq_len: 512\n\
         parallel: {strategy: fsdp, world_size: 2}\n",
    );
    let out = headroom(&["fit", &path, "--gpu", "h100-80gb"]);
    let text = stdout(&out);
    assert!(text.contains("qwen2.5-0.5b on h100-80gb"), "{text}");
    // Not a terminal: no progress on stderr.
    assert_eq!(stderr(&out), "");
}

#[test]
fn fit_skips_what_the_estimator_does_not_model_instead_of_failing() {
    // Its search proposes a fused AdamW, which DeepSpeed's ZeRO does not run.
    let out = headroom(&[
        "fit",
        "examples/seed004-rm-zero2-8x64gb.yaml",
        "--gpu",
        "h100-80gb",
        "--json",
    ]);
    let text = stdout(&out);
    let report: serde_json::Value = serde_json::from_str(&text).expect("one JSON object");
    assert!(
        report["evaluated"].as_u64().is_some_and(|n| n > 0),
        "{text}"
    );
    assert_eq!(stderr(&out), "");
}

#[test]
fn refusals_exit_2_naming_the_field() {
    for (yaml, field) in [
        (
            "model: custom\nmodel_config: {model_type: llama, hidden_size: 64, \
             intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, \
             num_key_value_heads: 0, vocab_size: 100}\n",
            "`model_config.num_key_value_heads`: 0",
        ),
        (
            "model: custom\nmodel_config: {model_type: llama, hidden_size: 64, \
             intermediate_size: 128, num_hidden_layers: 1099511627776, \
             num_attention_heads: 4, vocab_size: 100}\n",
            "`model_config.num_hidden_layers`: 1099511627776",
        ),
        (
            "model: qwen2.5-0.5b\nbatch_size: 1000000\n",
            "`batch_size`: 1000000",
        ),
        (
            "model: qwen2.5-0.5b\nseq_len: .inf\n",
            "`seq_len`: infinity",
        ),
    ] {
        let (_dir, path) = spec(yaml);
        for command in ["estimate", "fit"] {
            let err = bad_input(&[command, &path, "--gpu", "h100-80gb"]);
            assert!(
                err.starts_with(&format!("error: {field} is not allowed")),
                "{err}"
            );
        }
    }
}

#[test]
fn fit_of_a_qlora_example_at_a_huge_batch_is_refused() {
    // It tripped an allocator invariant: segments summed past 2^64 and overlapped.
    let example =
        std::fs::read_to_string(crate::common::repo().join("examples/llama-2-7b-qlora.yaml"))
            .expect("the example");
    let (_dir, path) = spec(&example.replace("batch_size: 4", "batch_size: 1073741825"));
    let err = bad_input(&["fit", &path, "--gpu", "h100-80gb"]);
    assert!(
        err.starts_with("error: `batch_size`: 1073741825 is not allowed"),
        "{err}"
    );
}
