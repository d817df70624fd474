//! `--plot`: the pictures are valid SVG (or a self-contained HTML page), and say what the
//! command's JSON says: the peak, and where seed003 runs out of memory on an H100.

use headroom::units::gib;

use super::common::{bad_input, headroom, json, stdout};

/// The SVG at `path`, checked to be XML, and its text: every `<text>` trimmed, in order,
/// joined by spaces (wrapped labels read whole again).
fn svg_text(path: &std::path::Path) -> (String, String) {
    let svg = std::fs::read_to_string(path).expect("the picture is written");
    let doc = roxmltree::Document::parse(&svg).expect("valid XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let text = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text())
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ");
    (svg, text)
}

#[test]
fn seed003_marks_the_out_of_memory_point_the_estimate_names() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("seed003.svg");
    let spec = "examples/seed003-phi3-dpo.yaml";
    let out = headroom(&[
        "estimate",
        spec,
        "--gpu",
        "h100-80gb",
        "--json",
        "--plot",
        &path.display().to_string(),
    ]);
    let plotted: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    let est = json(&["estimate", spec, "--gpu", "h100-80gb", "--json"]);
    assert_eq!(plotted, est, "--plot changes no number");
    let (_, text) = svg_text(&path);
    let oom = &est["gpu"]["oom"];
    let label = format!(
        "out of memory in iteration {} ({}), allocating {} ({})",
        oom["iteration"],
        oom["phase"].as_str().unwrap(),
        oom["tensor"].as_str().unwrap(),
        gib(oom["requested_bytes"].as_u64().unwrap())
    );
    assert!(text.contains(&label), "{label} not in {text}");
    // The human verdict words it the same way.
    let human = stdout(&headroom(&["estimate", spec, "--gpu", "h100-80gb"]));
    let said = label.replace("out of memory in", "PyTorch runs out in");
    assert!(human.contains(&said), "{said}");
    let peak = format!(
        "peak {} (iteration {} {})",
        gib(est["peak_allocated_bytes"].as_u64().unwrap()),
        est["peak_phase"]["iteration"],
        est["peak_phase"]["name"].as_str().unwrap()
    );
    assert!(text.contains(&peak), "{peak} not in {text}");
    assert!(text.contains("h100-80gb: 78.57 GiB for PyTorch's allocator (79.18 GiB total)"));
}

#[test]
fn a_run_plot_names_its_phases_components_and_peak() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("lora.svg");
    let spec = "examples/qwen2.5-7b-lora.yaml";
    stdout(&headroom(&[
        "estimate",
        spec,
        "--plot",
        &svg.display().to_string(),
    ]));
    let (_, text) = svg_text(&svg);
    let est = json(&["estimate", spec, "--json"]);
    let peak = format!(
        "peak {} (step {} {})",
        gib(est["peak_allocated_bytes"].as_u64().unwrap()),
        est["peak_step"],
        est["peak_phase"].as_str().unwrap()
    );
    assert!(text.contains(&peak), "{peak} not in {text}");
    for name in [
        "weights",
        "activations",
        "logits and loss",
        "backward",
        "reserved",
    ] {
        assert!(text.contains(name), "{name} not in {text}");
    }
    // Without --gpu there is no capacity to draw; one model has no other models.
    assert!(!text.contains("for PyTorch's allocator"));
    assert!(!text.contains("other models"));

    let html = dir.path().join("lora.html");
    stdout(&headroom(&[
        "estimate",
        spec,
        "--plot",
        &html.display().to_string(),
    ]));
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.starts_with("<!DOCTYPE html>") && page.contains("<svg"));
    // Self-contained: no script, and nothing loaded from elsewhere.
    assert!(!page.contains("<script") && !page.contains("src=") && !page.contains("<link"));

    let err = bad_input(&["estimate", spec, "--plot", "/tmp/x.png"]);
    assert!(err.contains("--plot") && err.contains("FILE.svg"), "{err}");
}

#[test]
fn snapshot_replay_and_fit_draw_what_they_report() {
    let dir = tempfile::tempdir().unwrap();
    let at = |name: &str| dir.path().join(name).display().to_string();
    let snapshot = "bench/snapshots/q05-bf16-adamw.pickle.gz";
    stdout(&headroom(&["snapshot", snapshot, "--plot", &at("s.svg")]));
    let (_, text) = svg_text(&dir.path().join("s.svg"));
    assert!(text.contains("active (requested bytes)") && text.contains("reserved"));

    stdout(&headroom(&[
        "replay",
        snapshot,
        "--alloc-conf",
        "expandable_segments:True",
        "--plot",
        &at("r.svg"),
    ]));
    let (_, text) = svg_text(&dir.path().join("r.svg"));
    for series in [
        "recorded reserved",
        "simulated reserved, recorded config",
        "simulated reserved, expandable_segments:True",
    ] {
        assert!(text.contains(series), "{series} not in {text}");
    }

    let spec = "examples/qwen2.5-7b-lora.yaml";
    let out = headroom(&[
        "fit",
        spec,
        "--gpu",
        "h100-80gb",
        "--json",
        "--plot",
        &at("f.svg"),
    ]);
    let fit: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    let (svg, text) = svg_text(&dir.path().join("f.svg"));
    let front = fit["pareto"].as_array().unwrap().len();
    assert!(front > 1);
    // One numbered dot per configuration of the table.
    assert_eq!(
        svg.matches("<circle").count(),
        front + 1,
        "and the legend's"
    );
    assert!(text.contains(&format!(" {front} ")), "{text}");
}

/// A pipeline's picture draws what the instances a phase does not run hold as its own band.
#[test]
fn a_pipeline_plot_draws_the_models_a_phase_does_not_run() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("seed001.svg");
    stdout(&headroom(&[
        "estimate",
        "examples/seed001-ref-resident.yaml",
        "--gpu",
        "h100-80gb",
        "--plot",
        &svg.display().to_string(),
    ]));
    let (_, text) = svg_text(&svg);
    for name in [
        "other models (not run in the phase)",
        "ref_logprob",
        "train",
        "weights",
    ] {
        assert!(text.contains(name), "{name} not in {text}");
    }
}
