//! `headroom measure SPEC`: run the spec's steps on this machine's GPU with the measurement
//! harness (python/headroom_measure, built into this binary) and print the measurement beside
//! the estimate.
//!
//! The harness is written to a temporary folder and run with the local Python, so an installed
//! `headroom` needs no checkout; the model's config is resolved here and passed inline, so hub
//! ids and relative paths mean what they mean to `headroom estimate`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use headroom::estimate::{self, Estimate};
use headroom::gpu;
use headroom::report::measure::MeasureJson;
use headroom::report::to_json;
use headroom::spec::{RunSpec, parse_document};
use serde_json::Value;

use crate::error::{CliError, CliResult};
use crate::render;

/// The harness sources, as `python -m headroom_measure` expects them (`headroom trace` runs
/// the same package).
const HARNESS: [(&str, &str); 26] = [
    (
        "__init__.py",
        include_str!("../../../../python/headroom_measure/__init__.py"),
    ),
    (
        "__main__.py",
        include_str!("../../../../python/headroom_measure/__main__.py"),
    ),
    (
        "spec.py",
        include_str!("../../../../python/headroom_measure/spec.py"),
    ),
    (
        "measure.py",
        include_str!("../../../../python/headroom_measure/measure.py"),
    ),
    (
        "trainers.py",
        include_str!("../../../../python/headroom_measure/trainers.py"),
    ),
    (
        "trace.py",
        include_str!("../../../../python/headroom_measure/trace.py"),
    ),
    (
        "cuda_emulation.py",
        include_str!("../../../../python/headroom_measure/cuda_emulation.py"),
    ),
    (
        "liger_emulation.py",
        include_str!("../../../../python/headroom_measure/liger_emulation.py"),
    ),
    (
        "bitsandbytes_emulation.py",
        include_str!("../../../../python/headroom_measure/bitsandbytes_emulation.py"),
    ),
    (
        "dist.py",
        include_str!("../../../../python/headroom_measure/dist.py"),
    ),
    (
        "trace_dist.py",
        include_str!("../../../../python/headroom_measure/trace_dist.py"),
    ),
    (
        "trace_experts.py",
        include_str!("../../../../python/headroom_measure/trace_experts.py"),
    ),
    (
        "trace_ddp.py",
        include_str!("../../../../python/headroom_measure/trace_ddp.py"),
    ),
    (
        "trace_fsdp1.py",
        include_str!("../../../../python/headroom_measure/trace_fsdp1.py"),
    ),
    (
        "trace_zero.py",
        include_str!("../../../../python/headroom_measure/trace_zero.py"),
    ),
    (
        "trace_trl.py",
        include_str!("../../../../python/headroom_measure/trace_trl.py"),
    ),
    (
        "trace_load.py",
        include_str!("../../../../python/headroom_measure/trace_load.py"),
    ),
    (
        "trace_nf4.py",
        include_str!("../../../../python/headroom_measure/trace_nf4.py"),
    ),
    (
        "trace_zero_ranks.py",
        include_str!("../../../../python/headroom_measure/trace_zero_ranks.py"),
    ),
    (
        "trace_megatron.py",
        include_str!("../../../../python/headroom_measure/trace_megatron.py"),
    ),
    (
        "trace_decode.py",
        include_str!("../../../../python/headroom_measure/trace_decode.py"),
    ),
    (
        "trace_pipeline.py",
        include_str!("../../../../python/headroom_measure/trace_pipeline.py"),
    ),
    (
        "pipeline.py",
        include_str!("../../../../python/headroom_measure/pipeline.py"),
    ),
    (
        "pp.py",
        include_str!("../../../../python/headroom_measure/pp.py"),
    ),
    (
        "megatron.py",
        include_str!("../../../../python/headroom_measure/megatron.py"),
    ),
    (
        "megatron_pp.py",
        include_str!("../../../../python/headroom_measure/megatron_pp.py"),
    ),
];

const INSTALL_HINT: &str = "`headroom measure` needs Python 3.9+ with torch (CUDA build), transformers and \
     peft (bitsandbytes for nf4 and adamw-8bit): `pip install torch transformers peft bitsandbytes`; \
     `headroom estimate` needs none of them";

#[derive(clap::Args)]
pub struct Args {
    /// A run spec (YAML or JSON).
    pub spec: PathBuf,
    /// Also save a torch.cuda.memory snapshot of the run here (open it with `headroom snapshot`).
    #[arg(long)]
    pub snapshot: Option<PathBuf>,
    /// Append the measurement to this calibration file (JSON lines, as `headroom validate` reads).
    #[arg(long)]
    pub record: Option<PathBuf>,
    /// The Python that has torch.
    #[arg(long, default_value = crate::DEFAULT_PYTHON, env = crate::PYTHON_ENV)]
    pub python: String,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Where relative model paths resolve, when not the spec's folder (a spec the Python
    /// bindings were given as text).
    #[arg(skip)]
    pub spec_dir: Option<PathBuf>,
}

pub fn run(args: Args) -> CliResult {
    let (record, est, measured) = measured(&args)?;
    if args.json {
        println!("{}", to_json(&json_report(&record, &est, &measured)));
    } else {
        let device = record["env"]["gpu"].as_str().unwrap_or_default();
        print!("{}", comparison(device, &est, &measured));
        if let Some(path) = &args.snapshot {
            println!("snapshot: {} (headroom snapshot {0})", path.display());
        }
    }
    Ok(())
}

/// The JSON `measure --json` prints.
pub fn json(args: &Args) -> CliResult<String> {
    let (record, est, measured) = measured(args)?;
    Ok(to_json(&json_report(&record, &est, &measured)))
}

fn json_report<'a>(record: &'a Value, est: &'a Estimate, measured: &Measured) -> MeasureJson<'a> {
    MeasureJson::new(record, est, measured.peak_allocated, measured.peak_reserved)
}

/// The harness's record of the run, the estimate for the GPU it ran on, and the measurement.
fn measured(args: &Args) -> CliResult<(Value, Estimate, Measured)> {
    let spec_dir = args.spec_dir.as_deref().or(args.spec.parent());
    let (spec, harness_spec) = read_spec(&args.spec, spec_dir)?;
    // Bad input shows before minutes of GPU time are spent.
    estimate::estimate(&spec, spec_dir, &gpu::Gpu::default())?;

    let record = run_harness(args, &harness_spec)?;
    let device = record["env"]["gpu"].as_str().unwrap_or_default();
    let gpu = gpu::from_device_name(device).unwrap_or_default();
    let est = estimate::estimate(&spec, spec_dir, &gpu)?;
    let measured = Measured::from_record(&record)?;

    if let Some(path) = &args.record {
        append_line(path, &record)?;
    }
    Ok((record, est, measured))
}

/// The spec for the estimator, and the same document with the model's config inlined for the
/// harness; relative model paths resolve against `spec_dir`.
pub(crate) fn read_spec(path: &Path, spec_dir: Option<&Path>) -> CliResult<(RunSpec, Value)> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::input(format!("{}: {e}", path.display())))?;
    let mut doc = parse_document(&text, path)?;
    let spec = RunSpec::from_value(&doc).map_err(|e| CliError::in_file(path, e))?;
    let model = spec.resolve_model(spec_dir)?;
    doc["model_config"] = model.config;
    Ok((spec, doc))
}

/// A temporary folder holding the harness package, to put on `PYTHONPATH`.
pub(crate) fn harness_dir() -> CliResult<tempfile::TempDir> {
    let dir =
        tempfile::tempdir().map_err(|e| CliError::failure(format!("temporary folder: {e}")))?;
    let package = dir.path().join("headroom_measure");
    std::fs::create_dir(&package).map_err(|e| CliError::failure(e.to_string()))?;
    for (name, source) in HARNESS {
        std::fs::write(package.join(name), source).map_err(|e| CliError::failure(e.to_string()))?;
    }
    Ok(dir)
}

/// `PYTHONPATH` with the harness first and the user's own entries after it, where their
/// packages (a peft checkout, say) may be.
pub(crate) fn python_path(harness: &Path) -> std::ffi::OsString {
    let mut paths = vec![harness.to_path_buf()];
    if let Some(existing) = std::env::var_os("PYTHONPATH") {
        paths.extend(std::env::split_paths(&existing));
    }
    std::env::join_paths(paths).unwrap_or_else(|_| harness.as_os_str().to_os_string())
}

fn run_harness(args: &Args, harness_spec: &Value) -> CliResult<Value> {
    let dir = harness_dir()?;
    // A spec naming a trainer runs that trainer (transformers, TRL) for three steps.
    let module = match harness_spec.get("trainer").and_then(Value::as_str) {
        Some(kind) if kind != "loop" => "headroom_measure.trainers",
        _ => "headroom_measure",
    };
    let mut spec = harness_spec.clone();
    if let Some(obj) = spec.as_object_mut()
        && module == "headroom_measure"
    {
        obj.remove("trainer");
    }
    let mut command = Command::new(&args.python);
    command
        .args(["-m", module, "run", "--spec-json"])
        .arg(spec.to_string())
        .env("PYTHONPATH", python_path(dir.path()))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(snapshot) = &args.snapshot {
        command.arg("--snapshot").arg(snapshot);
    }
    let child = command.spawn().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            CliError::input(format!("`{}` not found. {INSTALL_HINT}", args.python))
        } else {
            CliError::failure(format!("could not start `{}`: {e}", args.python))
        }
    })?;

    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
            .expect("a valid template"),
    );
    spinner.set_message("measuring three steps on the GPU");
    spinner.enable_steady_tick(Duration::from_millis(120));
    let output = child.wait_with_output();
    spinner.finish_and_clear();
    let output = output.map_err(|e| CliError::failure(format!("harness: {e}")))?;

    let stderr = String::from_utf8_lossy(&output.stderr);
    let last_lines = || {
        let lines: Vec<&str> = stderr.trim().lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    };
    match output.status.code() {
        Some(0) => {}
        // The harness says what is missing (torch, a GPU, a bad field) and exits 2.
        Some(2) => {
            let message = stderr.trim().trim_start_matches("error: ");
            return Err(CliError::input(format!(
                "{message}\n(that is `{}`; pick another with --python or HEADROOM_PYTHON. \
                 `headroom estimate` needs none of this.)",
                args.python
            )));
        }
        _ => {
            return Err(CliError::failure(format!(
                "the measurement failed ({}):\n{}",
                output.status,
                last_lines()
            )));
        }
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.trim().lines().last().unwrap_or_default();
    serde_json::from_str(line).map_err(|e| {
        CliError::failure(format!(
            "the harness printed no measurement ({e}):\n{}",
            last_lines()
        ))
    })
}

/// What the harness measured, per phase of each step.
struct Measured {
    peak_allocated: u64,
    peak_reserved: u64,
    context: Option<u64>,
    /// (step, phase, peak allocated) in the order they ran.
    phases: Vec<(u32, &'static str, u64)>,
}

impl Measured {
    fn from_record(record: &Value) -> CliResult<Self> {
        let m = &record["measured"];
        let int = |v: &Value, key: &str| {
            v[key]
                .as_u64()
                .ok_or_else(|| CliError::failure(format!("the harness's record lacks `{key}`")))
        };
        let mut phases: Vec<(u32, &'static str, u64)> = Vec::new();
        for (i, step) in m["steps"].as_array().into_iter().flatten().enumerate() {
            for (key, name) in [
                ("fwd_peak", "forward"),
                ("bwd_peak", "backward"),
                ("opt_peak", "optimizer"),
            ] {
                if let Some(bytes) = step[key].as_u64() {
                    phases.push((i as u32 + 1, name, bytes));
                }
            }
        }
        // The trainer harness's segments, named as the estimate's phases.
        for segment in m["segments"].as_array().into_iter().flatten() {
            let (Some(step), Some(name), Some(bytes)) = (
                segment["step"].as_u64(),
                segment["name"].as_str(),
                segment["peak_allocated"].as_u64(),
            ) else {
                continue;
            };
            let phase = match name {
                "generate" => "generate",
                "forward:reference" => "reference",
                n if n.starts_with("forward:") || n == "loss" => "forward",
                "backward" => "backward",
                "clip_grad" | "optimizer" | "zero_grad" => "optimizer",
                _ => continue,
            };
            let step = step as u32;
            match phases.iter_mut().find(|p| p.0 == step && p.1 == phase) {
                Some(p) => p.2 = p.2.max(bytes),
                None => phases.push((step, phase, bytes)),
            }
        }
        Ok(Measured {
            peak_allocated: int(m, "peak_allocated_bytes")?,
            peak_reserved: int(m, "peak_reserved_bytes")?,
            context: m["cuda_context_bytes"].as_u64(),
            phases,
        })
    }
}

fn comparison(device: &str, est: &Estimate, measured: &Measured) -> String {
    let mut t = render::table();
    t.set_header(vec!["step", "phase", "measured", "estimated", "error"]);
    for &(step, phase, bytes) in &measured.phases {
        let estimated = est
            .phases
            .iter()
            .find(|p| p.step == step && p.phase == phase)
            .map(|p| p.peak_allocated);
        t.add_row(render::comparison_row(
            &step.to_string(),
            phase,
            bytes,
            estimated,
        ));
    }
    t.add_row(render::comparison_row(
        "",
        "peak allocated",
        measured.peak_allocated,
        Some(est.peak_allocated_bytes),
    ));
    t.add_row(render::comparison_row(
        "",
        "peak reserved",
        measured.peak_reserved,
        Some(est.peak_reserved_bytes),
    ));
    if let Some(context) = measured.context {
        t.add_row(render::comparison_row(
            "",
            "CUDA context",
            context,
            Some(est.cuda_context_bytes),
        ));
    }
    format!("{}: measured on {device}\n\n{t}\n", est.model)
}

fn append_line(path: &Path, record: &Value) -> CliResult {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| CliError::input(format!("--record {}: {e}", path.display())))?;
    writeln!(file, "{record}").map_err(|e| CliError::failure(format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::HARNESS;

    /// Every module of the harness package travels with the binary: one left out fails only
    /// when a run reaches its import.
    #[test]
    fn every_harness_module_is_embedded() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python/headroom_measure");
        let mut modules: Vec<String> = std::fs::read_dir(&dir)
            .expect("the harness package")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".py"))
            .collect();
        modules.sort();
        let mut embedded: Vec<String> = HARNESS.iter().map(|(name, _)| name.to_string()).collect();
        embedded.sort();
        assert_eq!(embedded, modules);
    }
}
