//! `headroom trace SPEC`: run the spec's steps with the real model code under PyTorch's fake
//! tensors on the CPU (python/headroom_measure/trace.py, built into this binary as `measure`
//! builds its harness in), then replay the trace through the allocator simulator with the CUDA
//! kernels' own buffers added. `--from FILE` replays a saved trace without Python.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use headroom::estimate::Limit;
use headroom::gpu::{self, Gpu};
use headroom::report::to_json;
use headroom::report::trace::TraceJson;
use headroom::spec::{PipelineSpec, is_pipeline, parse_document};
use headroom::trace::{self, Trace};
use serde_json::Value;

use crate::cmd::measure::{harness_dir, read_spec};
use crate::cmd::replay::parse_alloc_conf;
use crate::error::{CliError, CliResult};

const INSTALL_HINT: &str = "`headroom trace` needs Python 3.9+ with torch (a CPU build will do), \
     transformers and peft: `pip install torch transformers peft`, then pass --python PATH (or set \
     HEADROOM_PYTHON) if that Python is not `python3`; `headroom estimate` needs none of them";

#[derive(clap::Args)]
pub struct Args {
    /// A run spec (YAML or JSON) to trace.
    #[arg(required_unless_present = "from")]
    pub spec: Option<PathBuf>,
    /// Replay a saved trace file (.json or .json.gz) instead of tracing a spec; needs no Python.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["spec", "save"])]
    pub from: Option<PathBuf>,
    /// The Python that has torch, transformers and peft.
    #[arg(long, default_value = crate::DEFAULT_PYTHON, env = crate::PYTHON_ENV)]
    pub python: String,
    /// Judge whether the run fits this GPU (h200, h100-80gb, a100-80gb, ... or a size like 64GiB).
    #[arg(long)]
    pub gpu: Option<String>,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Trace this rank of a sharded spec's world (default 0): a pipeline's stages differ by rank.
    #[arg(long, value_name = "N", conflicts_with = "from")]
    pub rank: Option<u64>,
    /// Keep the trace in this file (.json, or .json.gz compressed), for --from or `headroom replay`.
    #[arg(long, value_name = "FILE")]
    pub save: Option<PathBuf>,
    /// Replay under this PYTORCH_CUDA_ALLOC_CONF instead of the spec's allocator setting,
    /// e.g. "expandable_segments:True".
    #[arg(long, value_name = "STR")]
    pub alloc_conf: Option<String>,
}

pub fn run(args: Args) -> CliResult {
    // Bad flags show before the tracer runs.
    let gpu = match &args.gpu {
        Some(name) => gpu::find(name)?,
        None => Gpu::default(),
    };
    let config = args
        .alloc_conf
        .as_deref()
        .map(parse_alloc_conf)
        .transpose()?;
    let (trace, file) = match (&args.from, &args.spec) {
        (Some(path), _) => (trace::read(path)?, Some(path.as_path())),
        (None, Some(spec)) => (traced(spec, &args)?, args.save.as_deref()),
        (None, None) => {
            return Err(CliError::input(
                "give a run spec to trace, or --from a saved trace file",
            ));
        }
    };
    let config = match config {
        Some(config) => config,
        None => trace.allocator_config()?,
    };
    // With a GPU the trace is replayed at its capacity; without one, it is the run's demand.
    let limit = if args.gpu.is_some() {
        Limit::Gpu
    } else {
        Limit::None
    };
    let est = trace::estimate(&trace, &gpu, limit, &config)?;
    let file = file.map(|f| f.display().to_string());
    if args.json {
        let report = TraceJson::new(
            &trace,
            &est,
            file.as_deref(),
            args.alloc_conf.as_deref(),
            args.gpu.is_some(),
        );
        println!("{}", to_json(&report));
    } else {
        print!(
            "{}",
            crate::render::trace(
                &trace,
                &est,
                file.as_deref(),
                args.alloc_conf.as_deref(),
                args.gpu.is_some()
            )
        );
    }
    Ok(())
}

/// Runs the tracer on `spec` and reads what it wrote, keeping a copy at `--save`.
fn traced(spec: &Path, args: &Args) -> CliResult<Trace> {
    let harness_spec = harness_spec(spec)?;
    let dir = harness_dir()?;
    // The tracer gzips what it writes to a `.gz` name, so the copy is what `--save` names.
    let compressed = args
        .save
        .as_ref()
        .is_some_and(|s| s.to_string_lossy().ends_with(".gz"));
    let out = dir.path().join(if compressed {
        "trace.json.gz"
    } else {
        "trace.json"
    });
    let child = Command::new(&args.python)
        .args(["-m", "headroom_measure", "trace", "--spec-json"])
        .arg(harness_spec.to_string())
        .arg("--out")
        .arg(&out)
        .args(
            args.rank
                .map(|r| ["--rank".to_string(), r.to_string()])
                .into_iter()
                .flatten(),
        )
        .env("PYTHONPATH", crate::cmd::measure::python_path(dir.path()))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                CliError::input(format!("`{}` not found. {INSTALL_HINT}", args.python))
            } else {
                CliError::failure(format!("could not start `{}`: {e}", args.python))
            }
        })?;
    let progress = crate::progress::spinner(
        args.json,
        "tracing the run's steps under fake tensors on the CPU",
        None,
    );
    let output = child.wait_with_output();
    progress.finish_and_clear();
    let output = output.map_err(|e| CliError::failure(format!("tracer: {e}")))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    match output.status.code() {
        Some(0) => {}
        // The tracer says what is missing (torch, transformers, a bad field) and exits 2.
        // Its progress lines come before the message.
        Some(2) => {
            let message = stderr
                .match_indices("error: ")
                .find(|&(i, _)| i == 0 || stderr[..i].ends_with('\n'))
                .map_or(stderr.trim(), |(i, _)| stderr[i + "error: ".len()..].trim());
            return Err(CliError::input(format!(
                "{message}\n(that is `{}`; pick another with --python or HEADROOM_PYTHON. \
                 `headroom estimate` needs none of this.)",
                args.python
            )));
        }
        _ => {
            let lines: Vec<&str> = stderr.trim().lines().collect();
            return Err(CliError::failure(format!(
                "the trace failed ({}):\n{}",
                output.status,
                lines[lines.len().saturating_sub(15)..].join("\n")
            )));
        }
    }
    if let Some(save) = &args.save {
        std::fs::copy(&out, save)
            .map_err(|e| CliError::input(format!("--save {}: {e}", save.display())))?;
    }
    // What the tracer wrote is not the user's to fix.
    trace::read(&out).map_err(|e| CliError::failure(format!("the tracer wrote a bad trace: {e}")))
}

/// The spec as the tracer reads it, the model's config inline (the tracer has no catalog of
/// its own): a run spec's, or each instance's of a pipeline (a rollout engine's included).
fn harness_spec(spec: &Path) -> CliResult<Value> {
    let text = std::fs::read_to_string(spec)
        .map_err(|e| CliError::input(format!("{}: {e}", spec.display())))?;
    let mut doc = parse_document(&text, spec)?;
    if !is_pipeline(&doc) {
        return Ok(read_spec(spec, spec.parent())?.1);
    }
    let pipeline = PipelineSpec::from_value(&doc).map_err(|e| CliError::in_file(spec, e))?;
    let entries: Vec<&mut Value> = match doc.as_object_mut() {
        Some(obj) if obj.contains_key("policy") => obj
            .iter_mut()
            .filter(|(key, _)| *key == "policy" || *key == "reference")
            .map(|(_, v)| v)
            .collect(),
        _ => doc["instances"]
            .as_array_mut()
            .into_iter()
            .flatten()
            .filter(|entry| entry.get("shares").is_none())
            .collect(),
    };
    for (entry, instance) in entries.into_iter().zip(&pipeline.instances) {
        let model = instance.spec.resolve_model(spec.parent())?;
        entry["model_config"] = model.config;
    }
    Ok(doc)
}
