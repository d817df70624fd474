//! The largest inputs headroom accepts, in one place. Each is far above every real model and
//! run, and together they keep two promises: no size the simulator multiplies out (parameter
//! counts, tokens, bytes) overflows a `u64`, and no accepted estimate takes more than a few
//! seconds or more than a few hundred MiB. A value past a limit is refused by name, with the
//! limit; nothing is clamped.
//!
//! What the simulator's work grows with: layers (every op is per layer), pipeline passes
//! (instances, phases, repeats, iterations) and generated tokens (one cache step per layer per
//! token). Tensor sizes cost nothing to simulate; they only have to stay representable: the
//! largest products are logits (`tokens × vocab`, ≤ 2^48 elements), MLP activations (`tokens ×
//! intermediate`, ≤ 2^43) and eager attention scores (`batch × heads × seq²`, ≤ 2^58 when
//! `heads × seq ≤ 2^34`, which [`MAX_TOKENS`] and [`MAX_HEADS`] do not promise: a run whose
//! tensors pass 1 EiB is refused by the estimator, naming `batch_size`).

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};

/// Bytes of a spec file or an HF `config.json`: real ones are a few KiB (the largest example
/// is 3 KiB). Checked before the file is read.
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// Bytes of an out-of-memory log that `diagnose` reads: its last 64 MiB. PyTorch's message
/// ends the traceback, so the tail holds it; a whole training log can be gigabytes, and the
/// reader keeps about three times what it reads.
pub const MAX_OOM_LOG_BYTES: u64 = 64 << 20;

/// Nesting of YAML/JSON flow collections (`[`, `{`): real specs nest 4 deep. The YAML parser
/// takes time quadratic in flow nesting, so this is checked before it runs (it stops block
/// nesting by indentation itself, at 128 levels).
pub const MAX_NESTING: usize = 64;

/// Decoder layers: the deepest real models have 126 (Llama 3.1 405B); an estimate of 1,000
/// layers takes 0.1 s, `fit` of one about 10 s.
pub const MAX_LAYERS: u64 = 1000;

/// `hidden_size`: the widest real models have 16,384-25,600.
pub const MAX_HIDDEN: u64 = 1 << 17;

/// `intermediate_size` (`n_inner`): real ones reach 73,728.
pub const MAX_INTERMEDIATE: u64 = 1 << 19;

/// Routed experts per MoE layer: real models have up to 384 (Kimi K2).
pub const MAX_EXPERTS: u64 = 4096;

/// Attention heads (query and key/value): real models have up to 128.
pub const MAX_HEADS: u64 = 1024;

/// `head_dim`: real ones are 64-256.
pub const MAX_HEAD_DIM: u64 = 4096;

/// `vocab_size`: real vocabularies reach 262,144.
pub const MAX_VOCAB: u64 = 1 << 24;

/// `max_position_embeddings` and `seq_len`: the longest real contexts are 10M tokens.
pub const MAX_POSITIONS: u64 = 1 << 24;

/// Tokens of one micro-batch (`batch_size × seq_len`): 16M, twice a batch of 64 sequences of
/// 128k tokens.
pub const MAX_TOKENS: u64 = 1 << 24;

/// A pipeline's instances: real ones hold up to five models (actor, reference, critic,
/// reward, rollout engine).
pub const MAX_INSTANCES: usize = 16;

/// A pipeline's phases, and the entries of one phase's `run` and `offload` lists.
pub const MAX_PHASES: usize = 64;

/// `new_tokens` of a generate pass: the longest real rollouts are 128k tokens.
pub const MAX_NEW_TOKENS: u64 = 1 << 17;

/// `gradient_accumulation_steps` of a trainer: micro-batches after the second start where it
/// did, so only the first three are simulated; real runs accumulate a few hundred at most.
pub const MAX_ACCUMULATION_STEPS: u64 = 1 << 16;

/// A pipeline's simulated work, in layer-forwards (a forward pass of one layer, about 8 µs):
/// over its iterations, each pass's repeats × layers × (4 for a training pass, 1 for a
/// forward pass, 1 + new_tokens / 12 for a generation). 2^19 is about 4 s; the
/// examples need under 2,000.
pub const MAX_PIPELINE_WORK: u64 = 1 << 19;

/// Expert calls of transformers' per-expert loop in one forward: routed layers × experts that
/// receive tokens. Real models reach 36,096 (384 experts × 94 layers); each call is a dozen
/// simulated tensors, so 2^16 keeps an estimate within seconds and a few GB.
pub const MAX_EXPERT_LOOP_CALLS: u64 = 1 << 16;

/// Bytes of a trace file's JSON (after gunzip; a larger file is refused unread). A traced
/// step writes about 100 bytes per storage and 12 per event: a 70B model's three steps take a
/// few MiB, a 128-expert MoE's per-expert loop about 50 MiB. Parsed, a trace takes at most a
/// few times its text.
pub const MAX_TRACE_BYTES: u64 = 1 << 28;

/// Events of a trace: 8M, about eight times the per-expert loop of the largest MoE models.
pub const MAX_TRACE_EVENTS: usize = 1 << 23;

/// Storages of a trace: each is allocated once, so at most about half its events.
pub const MAX_TRACE_STORAGES: usize = 1 << 22;

/// Phases of a trace: a load and three per step.
pub const MAX_TRACE_PHASES: usize = 1 << 12;

/// Bytes of one storage of a trace: 1 PiB, thousands of times any GPU. The allocator
/// simulator refuses what exceeds its 64-bit address space before live bytes could overflow.
pub const MAX_TRACE_STORAGE_BYTES: u64 = 1 << 50;

/// Elements of a tensor a trace's `reduce` event sums: the native model's largest tensors
/// (logits) reach 2^48.
pub const MAX_TRACE_ELEMENTS: u64 = 1 << 48;

/// Read the text of a spec or config file, refusing one larger than [`MAX_FILE_BYTES`]
/// before reading it.
pub fn read_text(path: &Path) -> Result<String> {
    use std::io::Read;
    let io = |e: std::io::Error| Error::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let too_large = |size: String| Error::Io {
        path: path.to_path_buf(),
        message: format!(
            "{size}: a spec or model config has at most {MAX_FILE_BYTES} bytes; is this the \
             right file?"
        ),
    };
    let len = file.metadata().map_err(io)?.len();
    if len > MAX_FILE_BYTES {
        return Err(too_large(format!("{len} bytes")));
    }
    // A file that grows while it is read, or a device that reports no length, stops here.
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(too_large(format!("more than {MAX_FILE_BYTES} bytes")));
    }
    String::from_utf8(bytes).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        message: format!("not UTF-8 text ({e})"),
    })
}

/// The deepest nesting of flow collections (`[`, `{`) in YAML or JSON text, outside quoted
/// strings and comments: an upper bound, found in one pass. `None` when it passes `limit`.
pub fn flow_depth_within(text: &str, limit: usize) -> Option<usize> {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let mut chars = text.chars().peekable();
    let mut previous = '\n';
    while let Some(c) = chars.next() {
        match c {
            '[' | '{' => {
                depth += 1;
                deepest = deepest.max(depth);
                if deepest > limit {
                    return None;
                }
            }
            ']' | '}' => depth = depth.saturating_sub(1),
            '"' => {
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => {
                            chars.next();
                        }
                        '"' => break,
                        _ => {}
                    }
                }
            }
            // A quote inside a plain scalar (`it's`) starts nothing.
            '\'' if previous.is_whitespace() || matches!(previous, '[' | '{' | ',' | ':') => {
                while let Some(c) = chars.next() {
                    if c == '\'' {
                        // `''` is an escaped quote: the scan resumes inside the string.
                        if chars.peek() == Some(&'\'') {
                            chars.next();
                            continue;
                        }
                        break;
                    }
                }
            }
            '#' if previous.is_whitespace() => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        break;
                    }
                }
            }
            _ => {}
        }
        previous = c;
    }
    Some(deepest)
}

/// An integer field of a model config or spec within `1..=max`; `what` says why the limit.
pub fn within(field: &str, value: u64, max: u64, what: &str) -> Result<u64> {
    if (1..=max).contains(&value) {
        Ok(value)
    } else {
        Err(Error::field(
            field,
            value,
            format!("use an integer from 1 to {max} ({what})"),
        ))
    }
}

/// The JSON value of a YAML document, refusing what JSON cannot say: NaN and infinities, tags
/// and collections as keys. Scalar keys become their text, as a JSON key would be written.
pub fn to_json(value: yaml_serde::Value, at: &str) -> Result<Value> {
    use yaml_serde::Value as Yaml;
    let field = |at: &str| if at.is_empty() { "spec" } else { at }.to_string();
    Ok(match value {
        Yaml::Null => Value::Null,
        Yaml::Bool(b) => Value::Bool(b),
        Yaml::Number(n) => {
            if let Some(u) = n.as_u64() {
                Value::from(u)
            } else if let Some(i) = n.as_i64() {
                Value::from(i)
            } else {
                let x = n.as_f64().unwrap_or(f64::NAN);
                match serde_json::Number::from_f64(x) {
                    Some(n) => Value::Number(n),
                    None => {
                        let name = if x.is_nan() {
                            "NaN"
                        } else if x > 0.0 {
                            "infinity"
                        } else {
                            "-infinity"
                        };
                        return Err(Error::field(field(at), name, "use a finite number"));
                    }
                }
            }
        }
        Yaml::String(s) => Value::String(s),
        Yaml::Sequence(items) => Value::Array(
            items
                .into_iter()
                .enumerate()
                .map(|(i, v)| to_json(v, &format!("{at}[{i}]")))
                .collect::<Result<_>>()?,
        ),
        Yaml::Mapping(map) => {
            let mut out = serde_json::Map::new();
            for (k, v) in map {
                let key = match k {
                    Yaml::String(s) => s,
                    Yaml::Number(n) => n.to_string(),
                    Yaml::Bool(b) => b.to_string(),
                    Yaml::Null => "null".to_string(),
                    _ => {
                        return Err(Error::field(
                            field(at),
                            "a mapping with a list or mapping as a key",
                            "keys are names: use a plain word as the key",
                        ));
                    }
                };
                let inner = if at.is_empty() {
                    key.clone()
                } else {
                    format!("{at}.{key}")
                };
                let v = to_json(v, &inner)?;
                out.insert(key, v);
            }
            Value::Object(out)
        }
        Yaml::Tagged(tagged) => {
            return Err(Error::field(
                field(at),
                format!("a value tagged {}", tagged.tag),
                "specs use no YAML tags: remove the `!` tag",
            ));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flow_depth_counts_brackets_outside_strings_and_comments() {
        assert_eq!(flow_depth_within("a: [1, {b: [2]}]", 64), Some(3));
        assert_eq!(
            flow_depth_within("a: \"[[[[\" # [[[[\nb: 'x[[' ", 64),
            Some(0)
        );
        assert_eq!(flow_depth_within("a: it's [1]", 64), Some(1));
        assert_eq!(flow_depth_within(&"[".repeat(65), 64), None);
    }
}
