//! The built-in model catalog (`data/models.json`: HF `config.json` fields per model) and how a
//! spec's `model:` resolves: a catalog name, a hub-style id, a `config.json`, or a model folder.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

use serde_json::Value;

use crate::error::{Error, Result};

static CATALOG_JSON: &str = include_str!("../data/models.json");

/// Catalog name → HF config fields.
pub fn catalog() -> &'static BTreeMap<String, Value> {
    static CATALOG: OnceLock<BTreeMap<String, Value>> = OnceLock::new();
    CATALOG.get_or_init(|| {
        let doc: Value =
            serde_json::from_str(CATALOG_JSON).expect("data/models.json is valid JSON (tested)");
        doc["models"]
            .as_object()
            .expect("data/models.json has a `models` object (tested)")
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    })
}

/// A model the spec refers to, with the config fields that describe it.
#[derive(Clone, Debug)]
pub struct ResolvedModel {
    /// The catalog name, or the path the config came from.
    pub name: String,
    pub config: Value,
}

/// The catalog key a user-written name most likely means: case-insensitive, with the hub
/// organisation and common suffixes dropped (`Qwen/Qwen2.5-7B-Instruct` → `qwen2.5-7b`).
fn normalise(name: &str) -> String {
    let base = name.rsplit('/').next().unwrap_or(name).to_ascii_lowercase();
    let mut base = base.replace("meta-llama-", "llama-");
    for suffix in ["-instruct", "-chat", "-hf", "-it", "-base", "-4k", "-128k"] {
        while let Some(stripped) = base.strip_suffix(suffix) {
            base = stripped.to_string();
        }
    }
    base
}

/// Resolve `model:` against the catalog, then the file system.
pub fn resolve(model: &str, base_dir: Option<&Path>) -> Result<ResolvedModel> {
    let cat = catalog();
    if let Some(config) = cat.get(model) {
        return Ok(ResolvedModel {
            name: model.to_string(),
            config: config.clone(),
        });
    }
    let key = normalise(model);
    if let Some(config) = cat.get(&key) {
        return Ok(ResolvedModel {
            name: key,
            config: config.clone(),
        });
    }
    let mut path = Path::new(model).to_path_buf();
    if path.is_relative()
        && let Some(dir) = base_dir
    {
        let candidate = dir.join(&path);
        if candidate.exists() {
            path = candidate;
        }
    }
    if path.is_dir() {
        path = path.join("config.json");
    }
    if path.is_file() {
        let text = crate::limits::read_text(&path)?;
        let config: Value = serde_json::from_str(&text).map_err(|e| Error::Syntax {
            path: path.clone(),
            line: Some(e.line()),
            column: Some(e.column()),
            message: e.to_string(),
        })?;
        if !config.is_object() {
            return Err(Error::Syntax {
                path,
                line: None,
                column: None,
                message: "an HF config.json is a JSON object".to_string(),
            });
        }
        return Ok(ResolvedModel {
            name: model.to_string(),
            config,
        });
    }
    Err(Error::UnknownModel {
        field: "model".to_string(),
        name: model.to_string(),
        suggestions: closest_names(&key, 3),
    })
}

/// The catalog names closest to `name`, best first; none for a name far longer than any
/// (the comparison takes time quadratic in its length).
pub fn closest_names(name: &str, n: usize) -> Vec<String> {
    if name.len() > 4 * crate::error::SHOWN_CHARS {
        return Vec::new();
    }
    let mut scored: Vec<(f64, &String)> = catalog()
        .keys()
        .map(|k| (strsim::jaro_winkler(name, k), k))
        .filter(|(score, _)| *score > 0.7)
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    scored.into_iter().take(n).map(|(_, k)| k.clone()).collect()
}
