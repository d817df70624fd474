//! `fit --gpus N` of a Megatron-core spec: its layouts (pipeline, interleaved chunks, tensor,
//! expert and expert tensor parallelism, the distributed optimizer, micro-batch, recomputation)
//! keep the spec's
//! global batch, are ranked as the torch-native ones are, refuse by name what the spec refuses
//! for Megatron, and the best one's keys written over the spec are what `estimate` says, to the
//! byte. The specs are 8- and 4-layer slices of the models bench/megatron-pp and
//! bench/megatron-pp-moe measure, at the layouts measured there.

use serde_json::Value;

use crate::common::{headroom, json, stdout};
use crate::fit_layouts::{assert_ranking_rule, temp_spec, with_keys};

/// bench/megatron-pp's Llama-3.1-8B slice over 8 GPUs: a 1F1B pipeline of 4 stages, Megatron's
/// DDP over 2 ranks with the distributed optimizer, selective recomputation, 8 micro-batches.
const DENSE: &str = "model: llama-3.1-8b
model_config: {model_type: llama, hidden_size: 4096, intermediate_size: 14336,
  num_attention_heads: 32, num_key_value_heads: 8, head_dim: 128, vocab_size: 128256,
  rope_theta: 500000.0, tie_word_embeddings: false, num_hidden_layers: 8}
precision: bf16
optimizer: adamw
batch_size: 8
seq_len: 1024
parallel: {strategy: ddp, world_size: 8, tp: 1, framework: megatron, pp: 4, microbatches: 8}
megatron: {distributed_optimizer: true, recompute_granularity: selective}
";

/// bench/megatron-pp-moe's Qwen3-30B-A3B slice over 4 GPUs: a pipeline of 2 stages, experts
/// over 2 expert-parallel ranks.
const MOE: &str = "model: qwen3-30b-a3b
model_config: {model_type: qwen3_moe, hidden_size: 2048, intermediate_size: 6144,
  moe_intermediate_size: 768, num_attention_heads: 32, num_key_value_heads: 4, head_dim: 128,
  num_experts: 128, num_experts_per_tok: 8, norm_topk_prob: true, decoder_sparse_step: 1,
  mlp_only_layers: [], vocab_size: 151936, rope_theta: 1000000.0, rms_norm_eps: 1.0e-06,
  tie_word_embeddings: false, num_hidden_layers: 4}
precision: bf16
optimizer: adamw
batch_size: 2
seq_len: 2048
parallel: {strategy: ddp, world_size: 4, tp: 1, framework: megatron, pp: 2, microbatches: 2}
megatron: {distributed_optimizer: true, expert_model_parallel_size: 2}
";

/// A one-layer Qwen3-MoE of two experts too wide for expert parallelism alone over 8 GPUs:
/// `ep` stops at the 2 experts, whose half of the 19.3B expert parameters a rank cannot hold
/// with their gradients and Adam's states; split further over expert-tensor-parallel ranks they
/// fit. One layer leaves no pipeline to spread them over instead.
const WIDE_EXPERTS: &str = "model: qwen3-two-wide-experts
model_config: {model_type: qwen3_moe, hidden_size: 8192, intermediate_size: 12288,
  moe_intermediate_size: 393216, num_attention_heads: 64, num_key_value_heads: 4, head_dim: 128,
  num_experts: 2, num_experts_per_tok: 1, norm_topk_prob: true, decoder_sparse_step: 1,
  mlp_only_layers: [], vocab_size: 32000, rope_theta: 1000000.0, rms_norm_eps: 1.0e-06,
  tie_word_embeddings: false, num_hidden_layers: 1}
precision: bf16
optimizer: adamw
batch_size: 1
seq_len: 1024
parallel: {strategy: ddp, world_size: 8, tp: 1, framework: megatron}
megatron: {distributed_optimizer: true, expert_model_parallel_size: 2}
";

/// `fit --json` of `text` on H100s, with the spec file (kept for writing layouts over it).
fn fit(text: &str) -> (Value, tempfile::NamedTempFile) {
    let file = temp_spec(text, ".yaml");
    let path = file.path().display().to_string();
    (json(&["fit", &path, "--gpu", "h100-80gb", "--json"]), file)
}

/// `estimate` of the spec in `file` with a layout's keys written over it gives the layout's
/// numbers to the byte.
fn estimate_agrees(file: &tempfile::NamedTempFile, layout: &Value) {
    let text = std::fs::read_to_string(file.path()).expect("spec");
    let chosen = with_keys(&text, file.path(), &layout["spec"]);
    let path = chosen.path().display().to_string();
    let est = json(&["estimate", &path, "--gpu", "h100-80gb", "--json"]);
    for key in ["peak_allocated_bytes", "peak_reserved_bytes", "nccl_bytes"] {
        assert_eq!(est[key], layout[key], "{key} of {}", layout["name"]);
    }
    assert_eq!(est["gpu"]["headroom_bytes"], layout["headroom_bytes"]);
}

/// Every ranked layout: Megatron's, over the spec's GPUs, keeping the global batch as Megatron
/// counts it (`micro_batch × microbatches × dp`), in the ranking's order.
fn check_ranked(l: &Value, gpus: u64) {
    let global = l["global_batch"].as_u64().expect("global batch");
    let ranked = l["ranked"].as_array().expect("ranked");
    assert!(!ranked.is_empty());
    for e in ranked {
        let n = |k: &str| e[k].as_u64().expect(k);
        assert_eq!(e["framework"], "megatron", "{}", e["name"]);
        assert_eq!(e["strategy"], "ddp");
        assert_eq!(n("pp") * n("tp") * n("dp"), gpus, "{}", e["name"]);
        assert!(
            (n("tp") * n("dp")).is_multiple_of(n("ep") * n("etp")),
            "{}",
            e["name"]
        );
        // Megatron's MoELayer trains under tensor parallelism only with sequence parallelism.
        if n("tp") > 1 && (n("ep") > 1 || n("etp") > 1) {
            assert_eq!(e["sequence_parallel"], true, "{}", e["name"]);
        }
        let keys = &e["spec"]["megatron"];
        for (axis, key) in [
            ("ep", "expert_model_parallel_size"),
            ("etp", "expert_tensor_parallel_size"),
        ] {
            assert_eq!(keys[key].as_u64().unwrap_or(1), n(axis), "{}", e["name"]);
        }
        assert_eq!(
            e["model_expert_tensor_comm_s"].as_f64() > Some(0.0),
            n("etp") > 1,
            "{}",
            e["name"]
        );
        assert_eq!(e["exact"], true, "{}", e["name"]);
        let batch = n("micro_batch") * n("microbatches") * n("gradient_accumulation") * n("dp");
        assert_eq!(batch, global, "{}", e["name"]);
        assert_eq!(e["spec"]["parallel"]["framework"], "megatron");
        assert_eq!(
            e["recompute"],
            e["recompute_granularity"] == "full",
            "{}",
            e["name"]
        );
        assert!(e["distributed_optimizer"].is_boolean());
    }
    assert_ranking_rule(ranked);
}

/// The refusals name each combination the spec refuses for Megatron.
fn refusals(l: &Value) -> String {
    l["refusals"]
        .as_array()
        .expect("refusals")
        .iter()
        .map(|r| r.as_str().expect("text"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn a_megatron_spec_gets_megatron_layouts_and_estimate_agrees_with_the_best() {
    let (fit, file) = fit(DENSE);
    assert_eq!(
        fit["knobs_searched"], false,
        "Megatron's layout replaces the knobs"
    );
    let l = &fit["layouts"];
    assert_eq!(l["searched"], true);
    assert_eq!(
        l["axes"],
        serde_json::json!(["pp", "tp", "ep", "etp", "dp"])
    );
    assert_eq!(
        l["global_batch"], 16,
        "8 sequences on each of 2 data-parallel ranks"
    );
    check_ranked(l, 8);
    let ranked = l["ranked"].as_array().expect("ranked");
    assert!(
        ranked.iter().all(|e| e["ep"] == 1 && e["etp"] == 1),
        "a dense model"
    );
    let best = &l["best"];
    assert_eq!(best, &ranked[0]);
    assert_eq!(best["within_margin"], true);
    assert!(!l["why_best"].as_array().expect("why").is_empty());
    estimate_agrees(&file, best);
    // A pipeline layout too: every stage simulated, the worst one's numbers.
    let piped = ranked
        .iter()
        .find(|e| e["pp"].as_u64() > Some(1))
        .or(ranked.last())
        .expect("a layout");
    estimate_agrees(&file, piped);
    let why = refusals(l);
    assert!(!why.contains("parallel.sequence_parallel"), "{why}");
    assert!(why.contains("parallel.cp with framework megatron"), "{why}");
    assert!(
        l["cost_model"]
            .as_str()
            .expect("cost model")
            .contains("under Megatron-core")
    );
}

#[test]
fn an_moe_spec_gets_expert_parallelism_and_tensor_parallelism_with_sequence_parallelism() {
    let (fit, file) = fit(MOE);
    let l = &fit["layouts"];
    check_ranked(l, 4);
    let ranked = l["ranked"].as_array().expect("ranked");
    assert!(ranked.iter().any(|e| e["ep"].as_u64() > Some(1)));
    let tensor = ranked
        .iter()
        .find(|e| e["tp"].as_u64() > Some(1))
        .expect("a tensor-parallel layout");
    estimate_agrees(&file, tensor);
    let expert = ranked
        .iter()
        .find(|e| e["ep"].as_u64() > Some(1))
        .expect("expert parallel");
    assert_eq!(
        expert["spec"]["megatron"]["expert_model_parallel_size"],
        expert["ep"]
    );
    assert!(expert["model_expert_comm_s"].as_f64() > Some(0.0));
    estimate_agrees(&file, expert);
}

/// The spec's own layout (ep 2 over the 2 experts) runs out of memory, and so does every layout
/// that keeps the experts whole: the best splits them over expert-tensor-parallel ranks, says
/// so, and `estimate` agrees with it.
#[test]
fn experts_too_wide_for_expert_parallelism_get_expert_tensor_parallelism() {
    let (fit, file) = fit(WIDE_EXPERTS);
    let own = json(&[
        "estimate",
        &file.path().display().to_string(),
        "--gpu",
        "h100-80gb",
        "--json",
    ]);
    assert_eq!(own["gpu"]["fits"], false, "ep 2 alone");
    let l = &fit["layouts"];
    check_ranked(l, 8);
    let ranked = l["ranked"].as_array().expect("ranked");
    assert!(ranked.iter().all(|e| e["etp"].as_u64() > Some(1)));
    let best = &l["best"];
    let why: Vec<&str> = l["why_best"]
        .as_array()
        .expect("why")
        .iter()
        .map(|w| w.as_str().expect("text"))
        .collect();
    let split = format!(
        "no layout that keeps each expert whole on a rank fits: it splits every expert's \
         linear_fc1 and linear_fc2 over etp {} ranks",
        best["etp"]
    );
    assert!(why.iter().any(|w| w.starts_with(&split)), "{why:?}");
    assert!(
        refusals(l).contains(
            "`megatron.expert_model_parallel_size`: 4 is not allowed; a divisor of num_experts (2)"
        ),
        "{}",
        refusals(l)
    );
    estimate_agrees(&file, best);
    // Splitting costs the gather and reduce-scatter the cost model counts, the more the wider.
    let comm = |e: &Value| e["model_expert_tensor_comm_s"].as_f64().expect("comm");
    assert!(comm(best) > 0.0);
    for a in ranked {
        for b in ranked {
            let same = ["tp", "ep", "micro_batch"].iter().all(|k| a[*k] == b[*k]);
            if same && a["etp"].as_u64() < b["etp"].as_u64() {
                assert!(comm(a) < comm(b), "{} against {}", a["name"], b["name"]);
            }
        }
    }
}

#[test]
fn the_human_output_of_a_megatron_fit_names_the_best_layout_and_why() {
    let file = temp_spec(DENSE, ".yaml");
    let path = file.path().display().to_string();
    let out = stdout(&headroom(&["fit", &path, "--gpu", "h100-80gb"]));
    insta::assert_snapshot!(out);
}

#[test]
fn the_human_output_of_an_expert_tensor_parallel_fit_says_why_the_experts_are_split() {
    let file = temp_spec(WIDE_EXPERTS, ".yaml");
    let path = file.path().display().to_string();
    let out = stdout(&headroom(&["fit", &path, "--gpu", "h100-80gb"]));
    insta::assert_snapshot!(out);
}
