//! Parameter counts must equal what transformers builds, to the parameter.

use headroom::arch::{Architecture, Head};
use headroom::catalog;

fn count(name: &str, head: Head) -> u64 {
    let model = catalog::resolve(name, None).unwrap();
    Architecture::from_hf_config(&model.config)
        .unwrap()
        .param_count(head)
}

/// `params` of every row of shared/calibration/h200-torch2.11.jsonl (measured by transformers 5.17).
#[test]
fn calibration_rows() {
    for (name, expected) in [
        ("qwen2.5-0.5b", 494_032_768),
        ("qwen2.5-1.5b", 1_543_714_304),
        ("qwen2.5-3b", 3_085_938_688),
        ("llama-3.2-1b", 1_235_814_400),
        ("qwen3-4b", 4_022_468_096),
    ] {
        assert_eq!(count(name, Head::CausalLm), expected, "{name}");
    }
}

/// Every catalog model, both heads, against what transformers 5.17 builds (counted on the meta
/// device by bench/device/param_counts.py; tests/data/param_counts.json). A `null` head is one
/// transformers has no class for (OLMoE has no sequence classifier): a spec asking for it is
/// refused.
#[test]
fn every_catalog_model() {
    let truth: serde_json::Value =
        serde_json::from_str(include_str!("../data/param_counts.json")).unwrap();
    let models = truth["models"].as_object().unwrap();
    assert_eq!(
        models.len(),
        catalog::catalog().len(),
        "a catalog model has no measured count"
    );
    for (name, counts) in models {
        for (head, key) in [
            (Head::CausalLm, "causal-lm"),
            (Head::SequenceClassification { labels: 1 }, "seq-cls"),
        ] {
            match counts[key].as_u64() {
                Some(expected) => assert_eq!(count(name, head), expected, "{name} {key}"),
                None => {
                    let spec = headroom::spec::RunSpec::from_value(&serde_json::json!({
                        "model": name, "task": key,
                    }))
                    .unwrap();
                    let err = spec.architecture(None, "").unwrap_err().to_string();
                    assert!(
                        err.contains("OlmoeForSequenceClassification"),
                        "{name}: {err}"
                    );
                }
            }
        }
    }
}
