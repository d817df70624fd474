//! The built-in catalog carries every model of the shared calibration set with exactly its
//! config fields, and every entry parses into an architecture headroom models.

use headroom::arch::{Architecture, Head};
use headroom::catalog;
use serde_json::Value;

#[test]
fn shared_calibration_models_are_in_the_catalog_field_for_field() {
    let shared: Value = serde_json::from_str(include_str!(
        "../../../../bench/shared/calibration/models.json"
    ))
    .expect("valid JSON");
    let shared = shared.as_object().expect("name -> config fields");
    assert!(shared.len() >= 10);
    for (name, fields) in shared {
        let ours = catalog::catalog()
            .get(name)
            .unwrap_or_else(|| panic!("{name} is missing from the catalog"));
        for (key, value) in fields.as_object().expect("fields") {
            assert_eq!(&ours[key], value, "{name}.{key}");
        }
    }
}

#[test]
fn every_catalog_entry_parses() {
    assert!(catalog::catalog().len() >= 30);
    for (name, config) in catalog::catalog() {
        let arch = Architecture::from_hf_config(config).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(arch.param_count(Head::CausalLm) > 0, "{name}");
    }
}

#[test]
fn hub_ids_resolve_to_catalog_names() {
    for (id, name) in [
        ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
        ("meta-llama/Llama-3.1-8B", "llama-3.1-8b"),
        ("meta-llama/Llama-2-7b-hf", "llama-2-7b"),
        ("microsoft/Phi-3-mini-4k-instruct", "phi-3-mini"),
    ] {
        assert_eq!(catalog::resolve(id, None).expect(id).name, name);
    }
}

/// A config without `sliding_window` gets its config class's default (transformers 5.17:
/// `MistralConfig` and `Gemma2Config` 4096, `LlamaConfig` none); Qwen's configs keep a given
/// window off unless `use_sliding_window` is set, as their `__init__` does.
#[test]
fn an_absent_or_unused_sliding_window_reads_as_transformers_reads_it() {
    let window = |config: Value| {
        Architecture::from_hf_config(&config)
            .expect("parses")
            .sliding_window
    };
    let dense = |model_type: &str, extra: Value| {
        let mut config = serde_json::json!({
            "model_type": model_type, "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 1024,
        });
        config
            .as_object_mut()
            .expect("object")
            .extend(extra.as_object().expect("object").clone());
        config
    };
    assert_eq!(window(dense("mistral", serde_json::json!({}))), Some(4096));
    assert_eq!(
        window(dense(
            "mistral",
            serde_json::json!({"sliding_window": null})
        )),
        None
    );
    assert_eq!(window(dense("llama", serde_json::json!({}))), None);
    for qwen in ["qwen2", "qwen3"] {
        assert_eq!(
            window(dense(qwen, serde_json::json!({"sliding_window": 131072}))),
            None,
            "{qwen}"
        );
        assert_eq!(
            window(dense(
                qwen,
                serde_json::json!({"sliding_window": 4096, "use_sliding_window": true})
            )),
            Some(4096),
            "{qwen}"
        );
    }
}
