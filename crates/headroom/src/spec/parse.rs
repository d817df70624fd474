//! Reading spec text into a document, and the field readers every spec object shares, so that
//! a bad value is reported the same way wherever it sits: the field, the value, what is allowed.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::limits;

/// Parse a YAML (or JSON) document into a JSON value, with line and column on syntax errors.
/// Refused: nesting deeper than [`limits::MAX_NESTING`], a key given twice, NaN and
/// infinities (JSON has no such numbers; a JSON value would silently make them null).
pub fn parse_document(text: &str, path: &Path) -> Result<Value> {
    let syntax = |message: String| Error::Syntax {
        path: path.to_path_buf(),
        line: None,
        column: None,
        message,
    };
    if limits::flow_depth_within(text, limits::MAX_NESTING).is_none() {
        return Err(syntax(format!(
            "collections nested more than {} deep (`[` or `{{`); a spec nests a few levels",
            limits::MAX_NESTING
        )));
    }
    let value = yaml_serde::from_str::<yaml_serde::Value>(text).map_err(|e| {
        let location = e.location();
        Error::Syntax {
            path: path.to_path_buf(),
            line: location.as_ref().map(|l| l.line()),
            column: location.as_ref().map(|l| l.column()),
            message: crate::error::shown(&e.to_string(), 4 * crate::error::SHOWN_CHARS),
        }
    })?;
    limits::to_json(value, "")
}

/// Read and parse a spec file (YAML or JSON: YAML parses both), refusing one larger than
/// [`limits::MAX_FILE_BYTES`] before reading it.
pub(crate) fn read_document(path: &Path) -> Result<Value> {
    parse_document(&limits::read_text(path)?, path)
}

/// What an unknown key in a run spec (or its sections) is not.
pub(crate) const RUN_SPEC_KEY: &str = "a run-spec key";

/// Refuse the first key of `obj` outside `known`, naming it with its `prefix` (`lora.`,
/// `phases[0].`), what kind of key it is not (`a run-spec key`), the nearest known key when
/// one is close enough to be a typo, and every known key.
pub(crate) fn unknown_key(
    obj: &Map<String, Value>,
    prefix: &str,
    known: &[&str],
    kind: &str,
) -> Result<()> {
    let Some(key) = obj.keys().find(|k| !known.contains(&k.as_str())) else {
        return Ok(());
    };
    // No key is long; comparing a long one takes time quadratic in its length.
    let closest = known
        .iter()
        .filter(|_| key.len() <= 4 * crate::error::SHOWN_CHARS)
        .map(|k| (strsim::jaro_winkler(key, k), k))
        .filter(|(score, _)| *score > 0.85)
        .max_by(|a, b| a.0.total_cmp(&b.0));
    let hint = closest.map_or(String::new(), |(_, k)| format!("did you mean `{k}`? "));
    Err(Error::field(
        format!("{prefix}{key}"),
        "this key",
        format!("it is not {kind}; {hint}known keys: {}", known.join(", ")),
    ))
}

/// One of `options` by name, or `default` when `key` is absent.
pub(crate) fn choice<T: Copy>(
    obj: &Map<String, Value>,
    key: &str,
    options: &[(&str, T)],
    default: T,
) -> Result<T> {
    let Some(value) = obj.get(key) else {
        return Ok(default);
    };
    let allowed = || {
        let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
        format!("use one of {}", names.join(", "))
    };
    let name = value
        .as_str()
        .ok_or_else(|| Error::field(key, value, allowed()))?;
    options
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, t)| *t)
        .ok_or_else(|| Error::field(key, format!("{name:?}"), allowed()))
}

/// An integer >= 1, or `default` when `key` is absent.
pub(crate) fn positive(obj: &Map<String, Value>, key: &str, default: u64) -> Result<u64> {
    match obj.get(key) {
        None => Ok(default),
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => Ok(n),
            _ => Err(Error::field(key, v, "use an integer >= 1")),
        },
    }
}

/// A boolean, false when `key` is absent.
pub(crate) fn boolean(obj: &Map<String, Value>, key: &str) -> Result<bool> {
    match obj.get(key) {
        None => Ok(false),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| Error::field(key, v, "use true or false")),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::spec::PipelineSpec;

    #[test]
    fn unknown_keys_name_the_field_the_nearest_key_and_every_known_one() {
        let obj = json!({"offlaod": []});
        let err = unknown_key(
            obj.as_object().unwrap(),
            "phases[0].",
            &["name", "run", "offload"],
            "a phase key",
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "`phases[0].offlaod`: this key is not allowed; it is not a phase key; \
             did you mean `offload`? known keys: name, run, offload"
        );
    }

    #[test]
    fn unknown_keys_far_from_every_known_one_get_no_suggestion() {
        let obj = json!({"zzz": 1});
        let err = unknown_key(obj.as_object().unwrap(), "", &["model"], "a run-spec key");
        assert_eq!(
            err.unwrap_err().to_string(),
            "`zzz`: this key is not allowed; it is not a run-spec key; known keys: model"
        );
    }

    #[test]
    fn pipelines_reject_unknown_keys_like_run_specs() {
        let doc = json!({
            "instances": [{"name": "a", "model": "qwen2.5-0.5b"}],
            "phases": [{"name": "train", "run": ["a"]}],
            "iteration": 2,
        });
        let err = PipelineSpec::from_value(&doc).unwrap_err().to_string();
        assert!(err.contains("`iteration`"), "{err}");
        assert!(err.contains("did you mean `iterations`?"), "{err}");
    }
}
