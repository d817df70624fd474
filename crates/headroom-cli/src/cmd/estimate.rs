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
    /// Where relative model paths resolve, when not the spec's folder (a spec the Python
    /// bindings were given as text).
    #[arg(skip)]
    pub spec_dir: Option<PathBuf>,
    /// The Python that has torch, for --trace.
    #[arg(long, default_value = crate::DEFAULT_PYTHON, env = crate::PYTHON_ENV)]
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

/// What `estimate` answers: a run's estimate or a pipeline's.
enum Answer {
    Run(Box<estimate::Estimate>),
    Pipeline(Box<spec::PipelineSpec>, Box<estimate::PipelineEstimate>),
}

pub fn run(args: Args) -> CliResult {
    let Some(answer) = answer(&args)? else {
        return Ok(());
    };
    let judged = args.gpu.is_some();
    match (&answer, args.json) {
        (Answer::Run(est), true) => println!("{}", to_json(&EstimateJson::new(est, judged))),
        (Answer::Run(est), false) => print!("{}", crate::render::estimate(est, judged)),
        (Answer::Pipeline(_, est), true) => {
            println!("{}", to_json(&PipelineJson::new(est, judged)))
        }
        (Answer::Pipeline(spec, est), false) => {
            print!("{}", crate::render::pipeline(spec, est, judged))
        }
    }
    Ok(())
}

/// The JSON `estimate --json` prints (`--trace` aside: a model type the simulator does not
/// build is an error here).
pub fn json(args: &Args) -> CliResult<String> {
    let judged = args.gpu.is_some();
    match answer(args)? {
        Some(Answer::Run(est)) => Ok(to_json(&EstimateJson::new(&est, judged))),
        Some(Answer::Pipeline(_, est)) => Ok(to_json(&PipelineJson::new(&est, judged))),
        None => Err(CliError::input(
            "this model type is answered by `headroom trace`, which prints its own report",
        )),
    }
}

/// The estimate of the spec, or `None` where `--trace` answered (and printed) it.
fn answer(args: &Args) -> CliResult<Option<Answer>> {
    let document = spec::load(&args.spec)?;
    let gpu = match &args.gpu {
        Some(name) => gpu::find(name)?,
        None => gpu::Gpu::default(),
    };
    let dir = args.spec_dir.as_deref().or(args.spec.parent());
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
            return Ok(Some(Answer::Pipeline(Box::new(spec), Box::new(est?))));
        }
    };
    let (est, trace) =
        match estimate::estimate_with_trace(&spec, dir, &gpu, limit, args.timeline.is_some()) {
            Err(e) if e.is_unmodelled_model_type() => return unmodelled(args, e).map(|()| None),
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
    Ok(Some(Answer::Run(Box::new(est))))
}
