//! `headroom replay`: the snapshot's trace through the allocator simulator, and how much of the
//! recorded device activity it reproduces; with `--alloc-conf`, what another allocator config
//! would have reserved for the same calls. A `headroom trace` file (JSON, where a snapshot is a
//! pickle) is replayed too: it recorded nothing on a device, so there is no fidelity to report.

use std::path::PathBuf;

use headroom::estimate::Limit;
use headroom::gpu::Gpu;
use headroom::report::to_json;
use headroom::report::trace::TraceReplayJson;
use headroom::units::format_size;
use headroom_alloc::{AllocatorConfig, Backend};
use headroom_snapshot::report::ReplayJson;
use headroom_snapshot::{ReplayOptions, ReplayPoint, ReplayReport, SegmentStep, replay};

use crate::error::{CliError, CliResult};
use crate::plot::{SERIES_COLORS, Series};

#[derive(clap::Args)]
pub struct Args {
    /// A torch.cuda.memory._dump_snapshot file (.pickle or .pickle.gz), or a trace file of
    /// `headroom trace --save` (.json or .json.gz).
    pub file: PathBuf,
    /// Print the report as JSON (sizes in bytes).
    #[arg(long)]
    pub json: bool,
    /// Replay under this PYTORCH_CUDA_ALLOC_CONF instead of the recorded one,
    /// e.g. "expandable_segments:True".
    #[arg(long, value_name = "STR")]
    pub alloc_conf: Option<String>,
    /// Draw the recorded and the simulated reserved bytes over the trace (with --alloc-conf,
    /// the what-if beside the recorded config's replay) to FILE.svg or FILE.html.
    #[arg(long, value_name = "FILE.svg|FILE.html")]
    pub plot: Option<PathBuf>,
    /// Place each new segment where headroom's driver model puts it (as in an estimate)
    /// instead of at the recorded `cudaMalloc` address: how much of the reserved memory depends
    /// on where the driver put the segments.
    #[arg(long)]
    pub ignore_addresses: bool,
}

pub fn run(args: Args) -> CliResult {
    if args.json {
        println!("{}", json(&args)?);
        return Ok(());
    }
    match replayed(&args)? {
        Replayed::Snapshot(report) => print_human(&args, &report),
        Replayed::Trace(t) => print_trace(&args, &t),
    }
    Ok(())
}

/// The JSON `replay --json` prints.
pub fn json(args: &Args) -> CliResult<String> {
    let file = args.file.display().to_string();
    Ok(match replayed(args)? {
        Replayed::Snapshot(report) => to_json(&ReplayJson::new(
            file,
            args.alloc_conf.as_deref(),
            args.ignore_addresses,
            &report,
        )),
        Replayed::Trace(t) => to_json(&TraceReplayJson::new(
            file,
            &t.trace,
            t.expandable_segments,
            &t.baseline,
            args.alloc_conf.as_deref(),
            t.what_if.as_ref(),
        )),
    })
}

/// A snapshot's replay, or a trace's.
enum Replayed {
    Snapshot(Box<ReplayReport>),
    Trace(Box<TraceReplay>),
}

/// A trace's calls under the allocator config of its spec, and under `--alloc-conf`.
struct TraceReplay {
    trace: headroom::trace::Trace,
    expandable_segments: bool,
    baseline: headroom::trace::TraceEstimate,
    what_if: Option<headroom::trace::TraceEstimate>,
}

fn replayed(args: &Args) -> CliResult<Replayed> {
    let config = args
        .alloc_conf
        .as_deref()
        .map(parse_alloc_conf)
        .transpose()?;
    if headroom::trace::is_json(&args.file) {
        if args.plot.is_some() {
            return Err(CliError::input(format!(
                "--plot: {} is a headroom trace, which recorded no device timeline to draw \
                 (allowed: a torch.cuda.memory snapshot; `headroom trace --save` and \
                 `headroom estimate --plot` draw a spec's)",
                args.file.display()
            )));
        }
        if args.ignore_addresses {
            return Err(CliError::input(format!(
                "--ignore-addresses: {} is a headroom trace, which recorded no addresses (its \
                 segments are always placed by the driver model; allowed: a torch.cuda.memory snapshot)",
                args.file.display()
            )));
        }
        return replay_trace(args, config).map(|t| Replayed::Trace(Box::new(t)));
    }
    let snapshot = super::snapshot::load(&args.file)?;
    if snapshot.device_traces.iter().all(Vec::is_empty) {
        return Err(CliError::input(format!(
            "{}: the snapshot has no trace to replay (record with torch.cuda.memory._record_memory_history())",
            args.file.display()
        )));
    }
    let what_if = config.is_some();
    let report = replay(
        &snapshot,
        &ReplayOptions {
            config,
            device: None,
            ignore_addresses: args.ignore_addresses,
        },
    );
    if let Some(path) = &args.plot {
        // The what-if is drawn beside the replay under the recorded config.
        let original = what_if.then(|| {
            replay(
                &snapshot,
                &ReplayOptions {
                    ignore_addresses: args.ignore_addresses,
                    ..ReplayOptions::default()
                },
            )
        });
        let title = format!("{} (device {})", args.file.display(), report.device);
        let svg = replay_svg(
            &title,
            &report,
            args.alloc_conf.as_deref(),
            original.as_ref(),
        );
        crate::plot::write(path, &title, &[svg])?;
    }
    Ok(Replayed::Snapshot(Box::new(report)))
}

/// A trace's calls under the allocator config of its spec, and under `what_if`
/// (`--alloc-conf`), without a device limit; kernel buffers are sized for the H200.
fn replay_trace(args: &Args, what_if: Option<AllocatorConfig>) -> CliResult<TraceReplay> {
    let trace = headroom::trace::read(&args.file)?;
    let recorded = trace.allocator_config()?;
    let gpu = Gpu::default();
    let replay =
        |config: &AllocatorConfig| headroom::trace::estimate(&trace, &gpu, Limit::None, config);
    let baseline = replay(&recorded)?;
    let what_if = what_if.as_ref().map(replay).transpose()?;
    Ok(TraceReplay {
        expandable_segments: recorded.expandable_segments,
        trace,
        baseline,
        what_if,
    })
}

fn print_trace(args: &Args, t: &TraceReplay) {
    println!(
        "{} (a headroom trace, {} events)",
        args.file.display(),
        t.trace.events.len()
    );
    println!(
        "fidelity: none (a trace records no device activity to compare with; `headroom trace` \
         shows its estimate)"
    );
    let line = |under: &str, est: &headroom::trace::TraceEstimate| {
        println!(
            "under {under}: simulated peak allocated {}, peak reserved {}",
            format_size(est.peak_allocated_bytes),
            format_size(est.peak_reserved_bytes)
        );
    };
    line(
        &format!(
            "the spec's allocator setting (expandable_segments: {})",
            t.expandable_segments
        ),
        &t.baseline,
    );
    if let (Some(conf), Some(est)) = (&args.alloc_conf, &t.what_if) {
        line(&format!("--alloc-conf {conf}"), est);
    }
}

/// Recorded and simulated reserved bytes over the trace; with a what-if, the replay under the
/// recorded config (`original`) too.
fn replay_svg(
    title: &str,
    report: &ReplayReport,
    alloc_conf: Option<&str>,
    original: Option<&ReplayReport>,
) -> String {
    let series = |name: String, color, r: &ReplayReport, bytes: fn(&ReplayPoint) -> u64| Series {
        name,
        color,
        points: r
            .timeline
            .iter()
            .map(|p| (p.event_index as f64, bytes(p)))
            .collect(),
        dots: false,
    };
    let mut lines = vec![series(
        "recorded reserved".into(),
        SERIES_COLORS[0],
        report,
        |p| p.recorded_reserved_bytes,
    )];
    if let Some(original) = original {
        lines.push(series(
            "simulated reserved, recorded config".into(),
            SERIES_COLORS[1],
            original,
            |p| p.simulated_reserved_bytes,
        ));
    }
    let simulated = match alloc_conf {
        Some(conf) => format!("simulated reserved, {conf}"),
        None => "simulated reserved".into(),
    };
    let color = SERIES_COLORS[if original.is_some() { 3 } else { 1 }];
    lines.push(series(simulated, color, report, |p| {
        p.simulated_reserved_bytes
    }));
    lines.push(series(
        "simulated allocated".into(),
        SERIES_COLORS[2],
        report,
        |p| p.simulated_allocated_bytes,
    ));
    crate::plot::lines_svg(title, "trace entry", &lines, None)
}

pub(crate) fn parse_alloc_conf(conf: &str) -> CliResult<AllocatorConfig> {
    let config =
        AllocatorConfig::parse(conf).map_err(|e| CliError::input(format!("--alloc-conf: {e}")))?;
    if config.backend == Backend::CudaMallocAsync {
        return Err(CliError::input(
            "--alloc-conf: backend:cudaMallocAsync is CUDA's own pool allocator, which headroom does not simulate",
        ));
    }
    Ok(config)
}

fn describe(step: Option<SegmentStep>) -> String {
    step.map_or("nothing".to_string(), |s| {
        format!("{} of {}", s.action.name(), format_size(s.size))
    })
}

fn print_human(args: &Args, r: &ReplayReport) {
    println!(
        "{} (device {}, {} trace entries)",
        args.file.display(),
        r.device,
        r.trace_events
    );
    match &args.alloc_conf {
        Some(conf) => println!("replayed under --alloc-conf {conf}"),
        None => println!("replayed under the recorded allocator config"),
    }
    if args.ignore_addresses {
        println!(
            "new segments placed by headroom's driver model (--ignore-addresses), not at the recorded addresses"
        );
    }
    println!(
        "fidelity: {:.2}% ({} of {} recorded segment events reproduced in order{}; {} simulated)",
        r.fidelity * 100.0,
        r.matched_segment_events,
        r.recorded_segment_events,
        if r.fidelity_exact {
            ""
        } else {
            ", lower bound"
        },
        r.simulated_segment_events
    );
    match r.first_divergence {
        None => println!("first divergence: none"),
        Some(d) => println!(
            "first divergence: segment event {}{}: expected {}, simulated {}",
            d.segment_event_index,
            d.trace_index
                .map_or(String::new(), |t| format!(" (trace entry {t})")),
            describe(d.expected),
            describe(d.got)
        ),
    }
    println!(
        "peak reserved: simulated {} vs recorded {}",
        format_size(r.simulated_peak_reserved_bytes),
        format_size(r.recorded_peak_reserved_bytes)
    );
    println!(
        "reserved at the end: simulated {} vs recorded {}",
        format_size(r.simulated_final_reserved_bytes),
        format_size(r.recorded_final_reserved_bytes)
    );
    println!(
        "simulated peak allocated: {}",
        format_size(r.simulated_peak_allocated_bytes)
    );
    println!(
        "state before the trace: {} segments ({} reserved), {} live blocks rebuilt{}",
        r.restored_segments,
        format_size(r.initial_reserved_bytes),
        r.restored_blocks,
        if r.unrestored_segments > 0 {
            format!(", {} segments not rebuilt", r.unrestored_segments)
        } else {
            String::new()
        }
    );
    println!(
        "cache flushes (empty_cache or OOM retry): {}",
        r.cache_flushes
    );
    if r.unmatched_frees > 0 || r.failed_allocs > 0 {
        println!(
            "frees of unknown blocks: {}, refused allocations: {}",
            r.unmatched_frees, r.failed_allocs
        );
    }
}
