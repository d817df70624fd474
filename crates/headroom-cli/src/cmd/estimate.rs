//! `headroom estimate SPEC`: the peak GPU memory of a run, and what it is made of.

use std::io::Write;
use std::path::PathBuf;

use headroom::estimate;
use headroom::gpu;
use headroom::report::estimate::{EstimateJson, PipelineJson, TimelineEventJson};
use headroom::report::to_json;
use headroom::spec::{self, Document};

use crate::error::{CliError, CliResult};

#[derive(clap::Args)]
pub struct Args {
    /// A run spec (YAML or JSON).
    pub spec: PathBuf,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Judge whether the run fits this GPU (h200, h100-80gb, a100-80gb, ... or a size like 64GiB).
    #[arg(long)]
    pub gpu: Option<String>,
    /// Write every simulated allocation and free to this file (JSON lines), for comparing
    /// with a real trace.
    #[arg(long, hide = true)]
    pub timeline: Option<PathBuf>,
    /// For a model type headroom does not model natively, trace the real model code under
    /// fake tensors instead (`headroom trace`; needs torch, transformers and peft).
    #[arg(long)]
    pub trace: bool,
    /// The Python that has torch, for --trace.
    #[arg(long, default_value = "python3", env = "HEADROOM_PYTHON")]
    pub python: String,
}

/// A model type the native simulator does not build: `--trace` traces it, otherwise the error
/// says how to.
fn unmodelled(args: &Args, err: headroom::Error) -> CliResult {
    if args.trace {
        return super::trace::run(super::trace::Args {
            spec: Some(args.spec.clone()),
            from: None,
            python: args.python.clone(),
            gpu: args.gpu.clone(),
            json: args.json,
            save: None,
            alloc_conf: None,
        });
    }
    Err(CliError::input(format!(
        "{err}. `headroom trace {spec}` (or `headroom estimate {spec} --trace`) answers it by \
         running transformers' own code for this model under fake tensors on the CPU (needs \
         torch, transformers and peft)",
        spec = args.spec.display()
    )))
}

pub fn run(args: Args) -> CliResult {
    let document = spec::load(&args.spec)?;
    let gpu = match &args.gpu {
        Some(name) => gpu::find(name)?,
        None => gpu::Gpu::default(),
    };
    let dir = args.spec.parent();
    // With a GPU the run is simulated at its capacity; without one, its demand.
    let limit = if args.gpu.is_some() {
        estimate::Limit::Gpu
    } else {
        estimate::Limit::None
    };
    let spec = match document {
        Document::Run(spec) => *spec,
        Document::Pipeline(spec) => {
            // A pipeline's iterations can take seconds (see `headroom::limits`).
            let progress = crate::progress::spinner(args.json, "estimating the pipeline", None);
            let est = estimate::estimate_pipeline(&spec, dir, &gpu, limit);
            progress.finish_and_clear();
            let est = est?;
            if args.json {
                println!("{}", to_json(&PipelineJson::new(&est, args.gpu.is_some())));
            } else {
                print!(
                    "{}",
                    crate::render::pipeline(&spec, &est, args.gpu.is_some())
                );
            }
            return Ok(());
        }
    };
    let (est, trace) =
        match estimate::estimate_with_trace(&spec, dir, &gpu, limit, args.timeline.is_some()) {
            Err(e) if e.is_unmodelled_model_type() => return unmodelled(&args, e),
            other => other?,
        };
    if let Some(path) = &args.timeline {
        let mut out = std::io::BufWriter::new(
            std::fs::File::create(path)
                .map_err(|e| CliError::input(format!("{}: {e}", path.display())))?,
        );
        for e in &trace {
            writeln!(out, "{}", to_json(&TimelineEventJson::new(e)))
                .map_err(|e| CliError::failure(e.to_string()))?;
        }
    }
    if args.json {
        println!("{}", to_json(&EstimateJson::new(&est, args.gpu.is_some())));
    } else {
        print!("{}", crate::render::estimate(&est, args.gpu.is_some()));
    }
    Ok(())
}
