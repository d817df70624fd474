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
