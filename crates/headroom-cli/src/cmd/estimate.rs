//! `headroom estimate SPEC`: the peak GPU memory of a run, and what it is made of.

use std::io::Write;
use std::path::PathBuf;

use headroom::estimate::{self, Estimate, PipelineEstimate, Timeline};
use headroom::gpu;
use headroom::report::estimate::{EstimateJson, PipelineJson, TimelineEventJson};
use headroom::report::to_json;
use headroom::sim::Component;
use headroom::spec::{self, Document};
use headroom::units::gib;

use crate::error::{CliError, CliResult};
use crate::plot::TimelinePlot;

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
    /// Draw the simulated timeline (allocated by component, reserved, the GPU's capacity, the
    /// peak and where it runs out) to FILE.svg, or FILE.html (a page, no network needed).
    #[arg(long, value_name = "FILE.svg|FILE.html")]
    pub plot: Option<PathBuf>,
    /// Estimate this global rank of the spec's world rather than the one that needs most
    /// (ranks differ by pipeline stage, by their share under DeepSpeed ZeRO or Megatron's
    /// distributed optimizer, by their place in a context-parallel ring).
    #[arg(long, conflicts_with_all = ["plot", "timeline", "trace"])]
    pub rank: Option<u64>,
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
            rank: None,
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
    let Some(answer) = estimate_of(&args)? else {
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
    match estimate_of(args)? {
        Some(Answer::Run(est)) => Ok(to_json(&EstimateJson::new(&est, judged))),
        Some(Answer::Pipeline(_, est)) => Ok(to_json(&PipelineJson::new(&est, judged))),
        None => Err(CliError::input(
            "this model type is answered by `headroom trace`, which prints its own report",
        )),
    }
}

/// The estimate of the spec (its timeline drawn where `--plot` asks), or `None` where
/// `--trace` answered (and printed) it.
fn estimate_of(args: &Args) -> CliResult<Option<Answer>> {
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
    let title = args.spec.display().to_string();
    let spec = match document {
        Document::Run(spec) => *spec,
        Document::Pipeline(spec) => {
            // A pipeline's iterations can take seconds (see `headroom::limits`).
            let progress = crate::progress::spinner(args.json, "estimating the pipeline", None);
            let est = match &args.plot {
                None => estimate::estimate_pipeline(&spec, dir, &gpu, limit).map(|e| (e, None)),
                Some(_) => estimate::estimate_pipeline_timeline(&spec, dir, &gpu, limit)
                    .map(|(e, t)| (e, Some(t))),
            };
            progress.finish_and_clear();
            let (est, timeline) = est?;
            if let (Some(path), Some(timeline)) = (&args.plot, &timeline) {
                let svg = pipeline_svg(&title, &est, timeline, args.gpu.is_some());
                crate::plot::write(path, &title, &[svg])?;
            }
            return Ok(Some(Answer::Pipeline(Box::new(spec), Box::new(est))));
        }
    };
    if let Some(rank) = args.rank {
        let est = estimate::estimate_rank_with_limit(&spec, dir, &gpu, limit, rank)?;
        return Ok(Some(Answer::Run(Box::new(est))));
    }
    if let Some(path) = &args.plot {
        let (est, timeline) = match estimate::estimate_timeline(&spec, dir, &gpu, limit) {
            Err(e) if e.is_unmodelled_model_type() => return unmodelled(args, e).map(|()| None),
            other => other?,
        };
        let svg = run_svg(&title, &est, &timeline, args.gpu.is_some());
        crate::plot::write(path, &title, &[svg])?;
        return Ok(Some(Answer::Run(Box::new(est))));
    }
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

/// The capacity line: what the caching allocator may hold on the GPU (with `--gpu`).
fn capacity(gpu: &gpu::Gpu, capacity: Option<u64>) -> Option<(u64, String)> {
    capacity.map(|bytes| {
        (
            bytes,
            format!(
                "{}: {} for PyTorch's allocator ({} total)",
                gpu.name,
                gib(bytes),
                gib(gpu.total_bytes)
            ),
        )
    })
}

/// `peak 41.20 GiB (step 1 backward): activations 20.10 GiB, weights 14.00 GiB, ...`.
fn peak_label(peak: u64, when: String, breakdown: &[(Component, u64)]) -> String {
    let mut parts = breakdown.to_vec();
    parts.sort_by_key(|&(_, b)| std::cmp::Reverse(b));
    let held: Vec<String> = parts
        .iter()
        .take(3)
        .map(|(c, b)| format!("{c} {}", gib(*b)))
        .collect();
    format!("peak {} ({when}): {}", gib(peak), held.join(", "))
}

/// The picture of a run's estimate (`gpu_given`: simulated at the GPU's capacity).
pub(crate) fn run_svg(title: &str, est: &Estimate, timeline: &Timeline, gpu_given: bool) -> String {
    crate::plot::timeline_svg(&TimelinePlot {
        title: format!("{title}: {} per GPU", est.model),
        timeline,
        capacity: capacity(&est.gpu, est.capacity_bytes.filter(|_| gpu_given)),
        peak_label: peak_label(
            est.peak_allocated_bytes,
            format!("step {} {}", est.peak_step, est.peak_phase),
            &est.breakdown,
        ),
        when: "step",
        outside: Vec::new(),
    })
}

/// The picture of a pipeline's estimate, each phase of each iteration a band.
pub(crate) fn pipeline_svg(
    title: &str,
    est: &PipelineEstimate,
    timeline: &Timeline,
    gpu_given: bool,
) -> String {
    crate::plot::timeline_svg(&TimelinePlot {
        title: title.to_string(),
        timeline,
        capacity: capacity(&est.gpu, est.capacity_bytes.filter(|_| gpu_given)),
        peak_label: peak_label(
            est.peak_allocated_bytes,
            format!("iteration {} {}", est.peak_phase.1, est.peak_phase.0),
            &est.breakdown,
        ),
        when: "iteration",
        // A phase's rollout engines, as the pipeline's table reports them.
        outside: timeline
            .phases
            .iter()
            .map(|tp| {
                est.phases
                    .iter()
                    .find(|p| p.iteration == tp.step && p.name == tp.name)
                    .map_or(0, |p| p.engine_bytes)
            })
            .collect(),
    })
}

/// What `estimate --json` prints for `document` on `gpu` (`gpu_given`: simulated at its
/// capacity), or, with a `title`, the SVG of its timeline: `headroom serve`'s answer.
pub(crate) fn answer(
    document: &Document,
    gpu: &gpu::Gpu,
    gpu_given: bool,
    title: Option<&str>,
) -> headroom::Result<String> {
    let limit = if gpu_given {
        estimate::Limit::Gpu
    } else {
        estimate::Limit::None
    };
    Ok(match (document, title) {
        (Document::Run(spec), None) => {
            let est = estimate::estimate_with_trace(spec, None, gpu, limit, false)?.0;
            to_json(&EstimateJson::new(&est, gpu_given))
        }
        (Document::Run(spec), Some(title)) => {
            let (est, timeline) = estimate::estimate_timeline(spec, None, gpu, limit)?;
            run_svg(title, &est, &timeline, gpu_given)
        }
        (Document::Pipeline(spec), None) => {
            let est = estimate::estimate_pipeline(spec, None, gpu, limit)?;
            to_json(&PipelineJson::new(&est, gpu_given))
        }
        (Document::Pipeline(spec), Some(title)) => {
            let (est, timeline) = estimate::estimate_pipeline_timeline(spec, None, gpu, limit)?;
            pipeline_svg(title, &est, &timeline, gpu_given)
        }
    })
}
