//! `headroom validate FILE...`: estimate every measured row and report the errors.

use std::path::PathBuf;

use comfy_table::{Cell, CellAlignment};
use headroom::report::to_json;
use headroom::report::validate::ValidateJson;
use headroom::units::gib;
use headroom::validate::{self, Accuracy, Gates, PhaseResult, RowResult, Validation};

use crate::error::{CliError, CliResult};
use crate::render;

#[derive(clap::Args)]
pub struct Args {
    /// Calibration files (JSON lines: id, spec, measured, env).
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Write the accuracy report (per row and per family) as Markdown to this file.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Fail (exit 1) when any |peak allocated error| exceeds this many percent.
    #[arg(long)]
    pub max_alloc_error: Option<f64>,
    /// Fail when the median |peak allocated error| exceeds this many percent.
    #[arg(long)]
    pub median_alloc_error: Option<f64>,
    /// Fail when any |peak reserved error| exceeds this many percent.
    #[arg(long)]
    pub max_reserved_error: Option<f64>,
    /// Fail when the median |peak reserved error| exceeds this many percent.
    #[arg(long)]
    pub median_reserved_error: Option<f64>,
}

pub fn run(args: Args) -> CliResult {
    let progress = crate::progress::spinner(args.json, "validate", None);
    let mut validation = Validation::default();
    for (i, file) in args.files.iter().enumerate() {
        progress.set_message(format!(
            "validate: file {} of {}, {}",
            i + 1,
            args.files.len(),
            file.display()
        ));
        let one = validate::check_files(std::slice::from_ref(file));
        let one = one.inspect_err(|_| progress.finish_and_clear())?;
        validation.rows.extend(one.rows);
        validation.pipelines.phases.extend(one.pipelines.phases);
        validation.pipelines.notes.extend(one.pipelines.notes);
    }
    progress.finish_and_clear();
    if let Some(path) = &args.markdown {
        std::fs::write(path, markdown(&validation))
            .map_err(|e| CliError::failure(format!("{}: {e}", path.display())))?;
    }
    if args.json {
        println!("{}", to_json(&ValidateJson::new(&validation)));
    } else {
        print!("{}", text(&validation));
    }
    let gates = Gates {
        max_alloc_error: args.max_alloc_error,
        median_alloc_error: args.median_alloc_error,
        max_reserved_error: args.max_reserved_error,
        median_reserved_error: args.median_reserved_error,
    };
    let failures = gates.failures(&validation);
    if failures.is_empty() {
        Ok(())
    } else {
        Err(CliError::failure(format!(
            "accuracy gate failed: {}",
            failures.join("; ")
        )))
    }
}

/// The tables: pipeline phases and notes first, then rows, each with its |error| summary.
fn text(v: &Validation) -> String {
    let pipelines = &v.pipelines;
    let mut out = String::new();
    if !pipelines.phases.is_empty() || !pipelines.notes.is_empty() {
        let phases = v.phase_accuracy();
        out += &pipeline_table(&pipelines.phases);
        for (note, _) in &pipelines.notes {
            out += &format!("{note}\n");
        }
        out += &format!(
            "{} pipeline phases. peak allocated |error| max {:.2}%, peak reserved |error| max {:.2}%\n\n",
            pipelines.phases.len(),
            100.0 * phases.allocated.max_abs,
            100.0 * phases.reserved.max_abs
        );
    }
    if v.rows.is_empty() {
        return out;
    }
    let Accuracy {
        count,
        allocated: a,
        reserved: r,
    } = v.row_accuracy();
    out += &table(&v.rows);
    out += &format!(
        "\n{count} rows. peak allocated |error|: median {:.2}%, p90 {:.2}%, max {:.2}%, {} under-estimates\n\
         peak reserved |error|:  median {:.2}%, p90 {:.2}%, max {:.2}%, {} under-estimates\n",
        100.0 * a.median_abs,
        100.0 * a.p90_abs,
        100.0 * a.max_abs,
        a.under_estimates,
        100.0 * r.median_abs,
        100.0 * r.p90_abs,
        100.0 * r.max_abs,
        r.under_estimates
    );
    out
}

fn pct(x: f64) -> String {
    format!("{:+.2}%", 100.0 * x)
}

fn table(results: &[RowResult]) -> String {
    error_table(
        &["row"],
        results.iter().map(|x| {
            let (m, e) = (&x.row.measured, &x.estimate);
            (
                vec![x.row.id.clone()],
                [m.peak_allocated_bytes, e.peak_allocated_bytes],
                x.alloc_error,
                [m.peak_reserved_bytes, e.peak_reserved_bytes],
                x.reserved_error,
            )
        }),
    )
}

/// Label columns, then measured, estimated and error for allocated and for reserved bytes.
fn error_table(
    labels: &[&str],
    rows: impl Iterator<Item = (Vec<String>, [u64; 2], f64, [u64; 2], f64)>,
) -> String {
    let mut t = render::table();
    let mut header: Vec<&str> = labels.to_vec();
    header.extend([
        "measured alloc",
        "estimated",
        "error",
        "measured reserved",
        "estimated",
        "error",
    ]);
    t.set_header(header);
    let right = |s: String| Cell::new(s).set_alignment(CellAlignment::Right);
    for (label, allocated, alloc_error, reserved, reserved_error) in rows {
        let mut row: Vec<Cell> = label.into_iter().map(Cell::new).collect();
        row.extend([
            right(gib(allocated[0])),
            right(gib(allocated[1])),
            right(pct(alloc_error)),
            right(gib(reserved[0])),
            right(gib(reserved[1])),
            right(pct(reserved_error)),
        ]);
        t.add_row(row);
    }
    t.to_string() + "\n"
}

/// The accuracy report: summary, per family, per row (Markdown).
fn markdown(v: &Validation) -> String {
    let (results, pipelines) = (&v.rows, &v.pipelines);
    let mut out = String::from(
        "# Accuracy\n\nGenerated by `headroom validate --markdown` (`scripts/accuracy` runs it over every measured row; \
         `scripts/test` checks this file is current); do not edit by hand.\n\
         Errors are (estimate - measured) / measured of `torch.cuda.max_memory_allocated()` (allocated) and of \
         the peak of `memory_reserved()` (reserved), over three steps.\n\n",
    );
    out += "## Summary\n\n| rows | alloc median | alloc p90 | alloc max | alloc under | reserved median | reserved p90 | reserved max | reserved under |\n|---|---|---|---|---|---|---|---|---|\n";
    let accuracy = v.row_accuracy();
    out += &summary_row(&accuracy.count.to_string(), &accuracy);
    out += "\n## By family\n\n| family (rows) | alloc median | alloc p90 | alloc max | alloc under | reserved median | reserved p90 | reserved max | reserved under |\n|---|---|---|---|---|---|---|---|---|\n";
    for (family, accuracy) in validate::accuracy_by_family(results) {
        out += &summary_row(&format!("{family} ({})", accuracy.count), &accuracy);
    }
    out += "\n## By row\n\n| row | gpu | measured allocated | estimated | error | measured reserved | estimated | error |\n|---|---|---:|---:|---:|---:|---:|---:|\n";
    for x in results {
        out += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            x.row.id,
            x.row.gpu.name,
            x.row.measured.peak_allocated_bytes,
            x.estimate.peak_allocated_bytes,
            pct(x.alloc_error),
            x.row.measured.peak_reserved_bytes,
            x.estimate.peak_reserved_bytes,
            pct(x.reserved_error)
        );
    }
    if !pipelines.phases.is_empty() || !pipelines.notes.is_empty() {
        out += "\n## Pipelines, per phase\n\nA policy and its reference on one GPU (bench/pipelines): each phase's peaks.\n\n\
                | row | gpu | phase | iteration | measured allocated | estimated | error | measured reserved | estimated | error |\n\
                |---|---|---|---:|---:|---:|---:|---:|---:|---:|\n";
        for p in &pipelines.phases {
            out += &format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                p.id,
                p.gpu,
                p.phase,
                p.iteration,
                p.measured_allocated,
                p.estimated_allocated,
                pct(p.alloc_error),
                p.measured_reserved,
                p.estimated_reserved,
                pct(p.reserved_error)
            );
        }
        out += "\n";
        for (note, _) in &pipelines.notes {
            out += &format!("- {note}\n");
        }
    }
    out
}

fn pipeline_table(phases: &[PhaseResult]) -> String {
    error_table(
        &["pipeline", "phase"],
        phases.iter().map(|p| {
            (
                vec![p.id.clone(), format!("{} {}", p.phase, p.iteration)],
                [p.measured_allocated, p.estimated_allocated],
                p.alloc_error,
                [p.measured_reserved, p.estimated_reserved],
                p.reserved_error,
            )
        }),
    )
}

fn summary_row(label: &str, accuracy: &Accuracy) -> String {
    let (a, r) = (&accuracy.allocated, &accuracy.reserved);
    let p = |x: f64| format!("{:.2}%", 100.0 * x);
    format!(
        "| {label} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
        p(a.median_abs),
        p(a.p90_abs),
        p(a.max_abs),
        a.under_estimates,
        p(r.median_abs),
        p(r.p90_abs),
        p(r.max_abs),
        r.under_estimates
    )
}
