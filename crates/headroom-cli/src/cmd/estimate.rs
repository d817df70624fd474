//! `headroom estimate SPEC`: the peak GPU memory of a run, and what it is made of.

use std::io::Write;
use std::path::PathBuf;

use headroom::estimate::{self, Estimate};
use headroom::gpu::{self, Gpu};
use headroom::pipeline::{self, PipelineEstimate, PipelineSpec};
use headroom::spec::{RunSpec, parse_document};
use headroom::timeline::SimulatedOom;
use serde_json::json;

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
}

pub fn run(args: Args) -> CliResult {
    let text = std::fs::read_to_string(&args.spec)
        .map_err(|e| CliError::input(format!("{}: {e}", args.spec.display())))?;
    let doc = parse_document(&text, &args.spec).map_err(|e| CliError::input(e.to_string()))?;
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
    if pipeline::is_pipeline(&doc) {
        let spec = PipelineSpec::from_value(&doc).map_err(|e| CliError::input(e.to_string()))?;
        let est = pipeline::estimate_pipeline(&spec, dir, &gpu, limit)?;
        if args.json {
            println!("{}", pipeline_json(&est, args.gpu.is_some()));
        } else {
            print!(
                "{}",
                crate::render::pipeline(&spec, &est, args.gpu.is_some())
            );
        }
        return Ok(());
    }
    let spec = RunSpec::from_value(&doc).map_err(|e| CliError::input(e.to_string()))?;
    let (est, trace) =
        estimate::estimate_with_trace(&spec, dir, &gpu, limit, args.timeline.is_some())?;
    if let Some(path) = &args.timeline {
        let mut out = std::io::BufWriter::new(
            std::fs::File::create(path)
                .map_err(|e| CliError::input(format!("{}: {e}", path.display())))?,
        );
        for e in &trace {
            let line = json!({"alloc": e.alloc, "bytes": e.bytes, "component": e.component.key(), "label": e.label});
            writeln!(out, "{line}").map_err(|e| CliError::failure(e.to_string()))?;
        }
    }
    if args.json {
        println!("{}", to_json(&est, args.gpu.is_some()));
    } else {
        print!("{}", crate::render::estimate(&est, args.gpu.is_some()));
    }
    Ok(())
}

pub fn to_json(est: &Estimate, with_verdict: bool) -> serde_json::Value {
    let mut v = json!({
        "model": est.model,
        "params": est.params,
        "trainable_params": est.trainable_params,
        "weights_loaded_bytes": est.weights_loaded_bytes,
        "peak_allocated_bytes": est.peak_allocated_bytes,
        "peak_reserved_bytes": est.peak_reserved_bytes,
        "cuda_context_bytes": est.cuda_context_bytes,
        "nccl_bytes": est.nccl_bytes,
        "host_bytes": est.host_bytes,
        "peak_phase": est.peak_phase,
        "peak_step": est.peak_step,
        "phases": est.phases.iter().map(|p| json!({
            "name": p.phase, "step": p.step,
            "peak_allocated_bytes": p.peak_allocated, "peak_reserved_bytes": p.peak_reserved,
        })).collect::<Vec<_>>(),
        "breakdown": est.breakdown.iter().map(|(c, b)| json!({"component": c.key(), "bytes": b})).collect::<Vec<_>>(),
    });
    if let Some(p) = &est.parallel {
        // Present only for multi-GPU runs: the numbers are per GPU.
        v["per_gpu_of"] = json!({"strategy": p.strategy.name(), "world_size": p.world_size});
    }
    if with_verdict {
        v["gpu"] = verdict_json(
            &est.gpu,
            est.fits(),
            est.headroom_bytes(),
            est.oom.as_ref(),
            "step",
        );
    }
    v
}

/// The `gpu` object: fits or not, and where the run ran out (`when`: step or iteration).
fn verdict_json(
    gpu: &Gpu,
    fits: bool,
    headroom_bytes: i128,
    oom: Option<&SimulatedOom>,
    when: &str,
) -> serde_json::Value {
    json!({
        "name": gpu.name,
        "total_bytes": gpu.total_bytes,
        "fits": fits,
        "headroom_bytes": headroom_bytes,
        "oom": oom.map(|o| json!({
            when: o.step, "phase": o.phase, "tensor": o.tensor,
            "requested_bytes": o.requested_bytes, "message": o.error.to_string(),
        })),
    })
}

fn pipeline_json(est: &PipelineEstimate, with_verdict: bool) -> serde_json::Value {
    let mut v = json!({
        "peak_allocated_bytes": est.peak_allocated_bytes,
        "peak_reserved_bytes": est.peak_reserved_bytes,
        "cuda_context_bytes": est.cuda_context_bytes,
        "peak_phase": {"name": est.peak_phase.0, "iteration": est.peak_phase.1},
        "breakdown": est.breakdown.iter().map(|(c, bytes)| json!({
            "component": c.key(), "bytes": bytes,
        })).collect::<Vec<_>>(),
        "host_bytes": est.host_bytes,
        "transfer_bytes_per_iteration": est.transfer_bytes_per_iteration,
        "transfer_seconds_per_iteration": est.transfer_seconds_per_iteration,
        "phases": est.phases.iter().map(|p| json!({
            "name": p.name, "iteration": p.iteration,
            "peak_allocated_bytes": p.peak_allocated, "peak_reserved_bytes": p.peak_reserved,
            "host_bytes": p.host_bytes, "transfer_bytes": p.transfer_bytes,
            "engine_bytes": p.engine_bytes,
        })).collect::<Vec<_>>(),
        "peak_device_bytes": est.peak_device_bytes,
        "nccl_bytes": est.nccl_bytes,
        "engines": est.engines.iter().map(|e| json!({
            "name": e.name, "bytes": e.bytes, "weight_bytes": e.weight_bytes,
            "kv_cache_tokens_at_most": e.kv_tokens,
        })).collect::<Vec<_>>(),
    });
    if with_verdict {
        v["gpu"] = verdict_json(
            &est.gpu,
            est.fits(),
            est.headroom_bytes(),
            est.oom.as_ref(),
            "iteration",
        );
    }
    v
}
