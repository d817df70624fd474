//! `headroom snapshot`: what a `torch.cuda.memory._dump_snapshot` file says about memory.

use std::path::{Path, PathBuf};

use comfy_table::Table;
use headroom::report::to_json;
use headroom::units::format_size;
use headroom_snapshot::report::SnapshotJson;
use headroom_snapshot::{Snapshot, SnapshotError, Summary, SummaryOptions, summarize};

use crate::error::{CliError, CliResult};
use crate::plot::{SERIES_COLORS, Series, sparkline};

#[derive(clap::Args)]
pub struct Args {
    /// A torch.cuda.memory._dump_snapshot file (.pickle or .pickle.gz).
    pub file: PathBuf,
    /// Print the summary as JSON (sizes in bytes).
    #[arg(long)]
    pub json: bool,
    /// Also draw active and reserved memory over the trace to FILE.svg or FILE.html.
    #[arg(long, value_name = "FILE.svg|FILE.html")]
    pub plot: Option<PathBuf>,
}

/// Loads a snapshot; a missing file or one that is not a snapshot is the user's to fix.
pub(crate) fn load(path: &Path) -> CliResult<Snapshot> {
    headroom_snapshot::load(path).map_err(|err| match err {
        SnapshotError::Io { .. } | SnapshotError::Decode { .. } => CliError::input(err.to_string()),
    })
}

pub fn run(args: Args) -> CliResult {
    if args.json {
        println!("{}", json(&args)?);
        return Ok(());
    }
    print_human(&args.file, &summarized(&args)?);
    Ok(())
}

/// The JSON `snapshot --json` prints.
pub fn json(args: &Args) -> CliResult<String> {
    let summary = summarized(args)?;
    Ok(to_json(&SnapshotJson::new(
        args.file.display().to_string(),
        &summary,
    )))
}

/// The snapshot's summary, with its timeline plotted where `--plot` asks.
fn summarized(args: &Args) -> CliResult<Summary> {
    let snapshot = load(&args.file)?;
    let summary = summarize(&snapshot, SummaryOptions::default());
    if let Some(out) = &args.plot {
        let trace = summary.trace.as_ref().ok_or_else(|| {
            CliError::input(format!(
                "{}: the snapshot has no trace to plot (record with _record_memory_history)",
                args.file.display()
            ))
        })?;
        let title = format!("{} (device {})", args.file.display(), trace.device);
        crate::plot::write(out, &title, &[trace_svg(&title, &trace.timeline)])?;
    }
    Ok(summary)
}

/// Active and reserved bytes over a recorded trace, as `MemoryViz.js` draws them.
pub(crate) fn trace_svg(title: &str, timeline: &[headroom_snapshot::TimelinePoint]) -> String {
    let series = |name: &str, color, bytes: fn(&headroom_snapshot::TimelinePoint) -> u64| Series {
        name: name.into(),
        color,
        points: timeline
            .iter()
            .map(|p| (p.event_index as f64, bytes(p)))
            .collect(),
        dots: false,
    };
    crate::plot::lines_svg(
        title,
        "trace entry",
        &[
            series("reserved", SERIES_COLORS[1], |p| p.reserved_bytes),
            series("active (requested bytes)", SERIES_COLORS[0], |p| {
                p.active_bytes
            }),
        ],
        None,
    )
}

fn print_human(file: &Path, s: &Summary) {
    let f = &s.fragmentation;
    println!("{}", file.display());
    let mut table = Table::new();
    table.set_header(["", "at the snapshot"]);
    table.add_row(["reserved", &format_size(s.reserved_bytes)]);
    table.add_row(["allocated", &format_size(s.allocated_bytes)]);
    table.add_row(["active", &format_size(s.active_bytes)]);
    table.add_row(["requested (by callers)", &format_size(s.requested_bytes)]);
    table.add_row([
        "segments".to_string(),
        format!(
            "{} ({} large, {} small, {} expandable)",
            s.segments.total, s.segments.large, s.segments.small, s.segments.expandable
        ),
    ]);
    table.add_row([
        "reserved but unallocated",
        &format_size(f.reserved_unallocated_bytes),
    ]);
    table.add_row([
        "largest free block",
        &format_size(f.largest_free_block_bytes),
    ]);
    table.add_row([
        "fragmentation (1 - largest/free)".to_string(),
        format!("{:.1}%", f.ratio * 100.0),
    ]);
    if let Some(t) = &s.trace {
        table.add_row([
            "trace entries".to_string(),
            format!("{} (device {})", t.events, t.device),
        ]);
        table.add_row([
            "peak active over the trace",
            &format_size(t.peak_active_bytes),
        ]);
        table.add_row([
            "peak reserved over the trace",
            &format_size(t.peak_reserved_bytes),
        ]);
    }
    println!("{table}");
    let Some(t) = &s.trace else {
        println!("No trace: record one with torch.cuda.memory._record_memory_history().");
        return;
    };
    match (t.peak_event_index, t.peak_time_us) {
        (Some(i), Some(us)) => {
            println!("\nLive at the peak (trace entry {i}, time_us {us}), by allocation site:")
        }
        _ => println!("\nLive before the trace began, by allocation site:"),
    }
    for (rank, site) in t.top_sites.iter().enumerate() {
        println!(
            "  {:>2}. {:>12}  {:>6} blocks  {}",
            rank + 1,
            format_size(site.bytes),
            site.count,
            site.location
        );
    }
    let max = t
        .timeline
        .iter()
        .map(|p| p.reserved_bytes.max(p.active_bytes))
        .max()
        .unwrap_or(0);
    let active: Vec<u64> = t.timeline.iter().map(|p| p.active_bytes).collect();
    let reserved: Vec<u64> = t.timeline.iter().map(|p| p.reserved_bytes).collect();
    println!("\nOver the trace (scale 0 – {}):", format_size(max));
    println!("  active   {}", sparkline(&active, 72, max));
    println!("  reserved {}", sparkline(&reserved, 72, max));
}
