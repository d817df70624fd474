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

/// The estimate of a measured sharded row (one rank of its world, rank 0 for most) for the rank
/// it recorded, after checking it: every forward, backward and optimizer peak of every step
/// within `phase_limit`, the run's reserved peak within `reserved_limit` (relative errors), and
/// the model's whole parameter count. Returns it and the phases checked.
pub fn check_every_phase(
    row: &Value,
    phase_limit: f64,
    reserved_limit: f64,
) -> (headroom::estimate::Estimate, usize) {
    let id = row["id"].as_str().expect("id");
    let spec = headroom::spec::RunSpec::from_value(&row["spec"]).expect(id);
    let gpu =
        headroom::gpu::from_device_name(row["env"]["gpu"].as_str().expect("gpu")).expect("gpu");
    let rank = &row["measured"]["ranks"][0];
    let recorded = rank["rank"].as_u64().expect("rank");
    let est = headroom::estimate::estimate_rank(&spec, None, &gpu, recorded).expect(id);
    let checked = check_phases(
        id,
        &est,
        rank,
        &[
            ("fwd_peak", "forward"),
            ("bwd_peak", "backward"),
            ("opt_peak", "optimizer"),
        ],
        phase_limit,
    );
    let reserved = rel(
        est.peak_reserved_bytes,
        row["measured"]["peak_reserved_bytes"]
            .as_u64()
            .expect("reserved"),
    );
    assert!(
        reserved.abs() < reserved_limit,
        "{id}: reserved {reserved:+.4}"
    );
    assert_eq!(
        est.params,
        row["measured"]["params"].as_u64().expect("params"),
        "{id}: a DTensor counts its global size"
    );
    (est, checked)
}

/// A measured per-rank row's id, its estimate for the rank it recorded (on the GPU it ran on),
/// and that rank's record.
pub fn estimate_measured_rank(row: &Value) -> (&str, headroom::estimate::Estimate, &Value) {
    let id = row["id"].as_str().expect("id");
    let spec = headroom::spec::RunSpec::from_value(&row["spec"]).expect(id);
    let gpu =
        headroom::gpu::from_device_name(row["env"]["gpu"].as_str().expect("gpu")).expect("gpu");
    let measured = &row["measured"]["ranks"][0];
    let rank = measured["rank"].as_u64().expect("rank");
    let est = headroom::estimate::estimate_rank(&spec, None, &gpu, rank).expect(id);
    (id, est, measured)
}

/// Checks a pipeline rank's estimate `est` against its measured record `rank`: every
/// schedule and optimizer peak of every step within `phase_limit`, the reserved peak within
/// `reserved_limit` (relative errors). Returns the phases checked.
pub fn check_pipeline_rank(
    id: &str,
    est: &headroom::estimate::Estimate,
    rank: &Value,
    phase_limit: f64,
    reserved_limit: f64,
) -> usize {
    let checked = check_phases(
        id,
        est,
        rank,
        &[("step_peak", "schedule"), ("opt_peak", "optimizer")],
        phase_limit,
    );
    let reserved = rel(
        est.peak_reserved_bytes,
        rank["peak_reserved_bytes"].as_u64().expect("reserved"),
    );
    assert!(
        reserved.abs() < reserved_limit,
        "{id}: reserved {reserved:+.4}"
    );
    checked
}

/// Checks every step's phases of `est` named in `phases` (the measured key, the estimate's
/// phase) against the measured record `rank`, each within `limit`. Returns how many.
fn check_phases(
    id: &str,
    est: &headroom::estimate::Estimate,
    rank: &Value,
    phases: &[(&str, &str)],
    limit: f64,
) -> usize {
    let mut checked = 0;
    for step in 1..=3u32 {
        for &(key, name) in phases {
            let measured = rank["steps"][step as usize - 1][key].as_u64().expect(key);
            let e = est
                .phases
                .iter()
                .find(|p| p.step == step && p.phase == name)
                .expect("phase");
            let err = rel(e.peak_allocated, measured);
            assert!(err.abs() < limit, "{id} step {step} {name}: {err:+.5}");
            checked += 1;
        }
    }
    checked
}

/// Llama-3.1-8B's `config.json` at its real widths, cut to `layers` decoder layers.
pub fn llama_3_1_8b_widths(layers: u64) -> Value {
    serde_json::json!({
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "num_hidden_layers": layers, "tie_word_embeddings": false,
    })
}

/// The estimate of the run spec `value` on an H100 (panics if it is refused).
pub fn estimate_value(value: &Value) -> headroom::estimate::Estimate {
    let spec = headroom::spec::RunSpec::from_value(value).expect("a valid spec");
    let gpu = headroom::gpu::find("h100-80gb").expect("gpu");
    headroom::estimate::estimate(&spec, None, &gpu).expect("estimate")
}

/// The error `value` is refused with, read and checked against its model as `estimate` does;
/// panics if it is accepted.
pub fn refusal(value: &Value) -> String {
    headroom::spec::RunSpec::from_value(value)
        .and_then(|s| s.architecture(None, "").map(|_| s))
        .expect_err(&value.to_string())
        .to_string()
}

/// `fit`'s setup of the run spec `value` over `gpus` H100s, nothing else resident, launched
/// as a script.
pub fn fit_setup(value: &Value, gpus: u32) -> headroom::plan::Setup<'static> {
    headroom::plan::Setup {
        spec: headroom::spec::RunSpec::from_value(value).expect("valid spec"),
        spec_dir: None,
        gpu: headroom::gpu::find("h100-80gb").expect("gpu"),
        gpus,
        residents: Vec::new(),
        launcher: headroom::plan::Launcher::Script,
    }
}
