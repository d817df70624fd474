//! What the measurement-backed tests share: reading result rows and comparing with them.

use serde_json::Value;

/// The rows of JSON-lines files (blank lines skipped).
pub fn jsonl(texts: &[&str]) -> Vec<Value> {
    texts
        .iter()
        .flat_map(|t| t.lines())
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect()
}

/// The signed relative error of an estimate: (estimated - measured) / measured.
pub fn rel(estimated: u64, measured: u64) -> f64 {
    (estimated as f64 - measured as f64) / measured as f64
}
