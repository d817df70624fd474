//! `headroom fit SPEC --gpu NAME`: the largest micro-batch and longest sequence that fit, and
//! the configurations that fit as a Pareto front of memory against step time.

use std::path::PathBuf;

use comfy_table::{Cell, CellAlignment};
use headroom::diagnose::lint::Severity;
use headroom::gpu;
use headroom::plan::layout::{self, LayoutSearch};
use headroom::plan::{self, FitReport, Launcher, Layouts, Resident, Setup};
use headroom::report::fit::FitJson;
use headroom::report::layouts::LISTED;
use headroom::report::to_json;
use headroom::spec::RunSpec;
use headroom::units::{gib, signed_gib};

use crate::error::{CliError, CliResult};
use crate::plot::{SERIES_COLORS, Series};
use crate::render::table;

#[derive(clap::Args)]
pub struct Args {
    /// A run spec (YAML or JSON).
    pub spec: PathBuf,
    /// The GPU: h200, h100-80gb, a100-80gb, a100-40gb, l40s, a10g, rtx-4090, rtx-3090,
    /// v100-32gb, v100-16gb, mi300x, or a size like 64GiB.
    #[arg(long)]
    pub gpu: String,
    /// Data-parallel ranks, one GPU each (adds ZeRO/FSDP stages to the search); by default
    /// the spec's `parallel.world_size`, else 1.
    #[arg(long)]
    pub gpus: Option<u32>,
    /// A model that stays on the same GPU without being trained, as a `mode: forward` spec.
    /// Repeatable.
    #[arg(long = "resident", alias = "reference", value_name = "SPEC")]
    pub residents: Vec<PathBuf>,
    /// The accelerate config that launches the run: the spec is planned as it launches it,
    /// and changes are said in its keys.
    #[arg(long, value_name = "FILE")]
    pub accelerate_config: Option<PathBuf>,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Draw the configurations that fit (device memory against step time, numbered as the
    /// table numbers them) to FILE.svg or FILE.html.
    #[arg(long, value_name = "FILE.svg|FILE.html")]
    pub plot: Option<PathBuf>,
    /// Where relative model paths resolve, when not the spec's folder (a spec the Python
    /// bindings were given as text).
    #[arg(skip)]
    pub spec_dir: Option<PathBuf>,
}

pub fn run(args: Args) -> CliResult {
    let (setup, report) = plan_fit(&args)?;
    if args.json {
        println!("{}", to_json(&FitJson::new(&setup, &report)));
    } else {
        print!("{}", render(&setup, &report));
    }
    Ok(())
}

/// The JSON `fit --json` prints.
pub fn json(args: &Args) -> CliResult<String> {
    let (setup, report) = plan_fit(args)?;
    Ok(to_json(&FitJson::new(&setup, &report)))
}

fn plan_fit(args: &Args) -> CliResult<(Setup<'_>, FitReport)> {
    if let Some(n) = args.gpus.filter(|n| !(1..=65536).contains(n)) {
        return Err(CliError::input(format!(
            "--gpus: {n} is not allowed; use 1 to 65536"
        )));
    }
    let mut spec = RunSpec::from_file(&args.spec)?;
    let mut launcher = Launcher::Script;
    if let Some(path) = &args.accelerate_config {
        let (launched, words, lints) = headroom::diagnose::launch_with_accelerate(&spec, path)?;
        for l in lints.iter().filter(|l| l.severity != Severity::Info) {
            eprintln!(
                "{} {}: {}: {}",
                l.severity.key(),
                l.rule.id(),
                l.key,
                l.message
            );
        }
        if let (Some(launched), Some(words)) = (launched, words) {
            if !args.json {
                println!("As the accelerate config launches it: {words}.");
            }
            spec = launched;
            launcher = Launcher::Accelerate;
        }
    }
    let gpus = args.gpus.unwrap_or_else(|| spec.world_size());
    let gpu = gpu::find(&args.gpu)?;
    let mut residents = Vec::new();
    for path in &args.residents {
        let r = RunSpec::from_file(path)?;
        residents.push(Resident::from_spec(&r, path.parent(), &gpu)?);
    }
    let setup = Setup {
        spec,
        spec_dir: args.spec_dir.as_deref().or(args.spec.parent()),
        gpu,
        gpus,
        residents,
        launcher,
    };
    let progress = crate::progress::spinner(
        args.json,
        "fit: configurations estimated",
        Some(estimates_made),
    );
    let report = plan::fit(&setup);
    progress.finish_and_clear();
    let report = report?;
    if let Some(path) = &args.plot {
        let title = format!("{} on {}", args.spec.display(), setup.gpu.name);
        crate::plot::write(path, &title, &[front_svg(&title, &setup, &report)])?;
    }
    Ok((setup, report))
}

/// Estimates made so far, by the knob search and the layout search.
fn estimates_made() -> u64 {
    plan::estimates_made() + layout::progress().0 as u64
}

/// The Pareto front: each configuration that fits, device memory against step time, beside
/// the GPU's total.
pub(crate) fn front_svg(title: &str, setup: &Setup, r: &FitReport) -> String {
    let front = Series {
        name: "configurations that fit (numbered as in the table)".into(),
        color: SERIES_COLORS[0],
        points: r
            .front
            .iter()
            .map(|e| (e.slowdown, e.device_bytes))
            .collect(),
        dots: true,
    };
    let total = (
        setup.gpu.total_bytes,
        format!("{}: {}", setup.gpu.name, gib(setup.gpu.total_bytes)),
    );
    crate::plot::lines_svg(
        title,
        "step time relative to the spec (×)",
        &[front],
        Some(total),
    )
}

fn render(setup: &Setup, r: &FitReport) -> String {
    let g = &setup.gpu;
    let b = &r.baseline;
    let mut out = format!(
        "{} on {} ({} usable{}): the spec needs {} — {} ({})\n",
        r.estimate.model,
        g.name,
        gib(g.total_bytes),
        if setup.gpus > 1 {
            format!(", {} GPUs", setup.gpus)
        } else {
            String::new()
        },
        gib(b.device_bytes),
        if b.fits { "fits" } else { "does NOT fit" },
        signed_gib(b.headroom_bytes(g)),
    );
    out += &match r.max_micro_batch {
        Some(n) => format!(
            "Largest micro-batch at seq_len {}: {n}\n",
            setup.spec.seq_len
        ),
        None => format!(
            "Not even a micro-batch of 1 fits at seq_len {}\n",
            setup.spec.seq_len
        ),
    };
    out += &match r.max_seq_len {
        Some(n) if n >= r.max_positions => format!(
            "Longest sequence at micro-batch {}: the model's limit, {n} tokens\n",
            setup.spec.batch_size
        ),
        Some(n) => format!(
            "Longest sequence at micro-batch {}: {n} tokens\n",
            setup.spec.batch_size
        ),
        None => format!(
            "Not even 1 token fits at micro-batch {}\n",
            setup.spec.batch_size
        ),
    };
    if r.knobs_searched {
        out += &knobs(setup, r);
    } else if plan::layout::megatron::applies(&setup.spec) {
        out += "\nThe search of memory knobs is PyTorch's and DeepSpeed's: for a Megatron-core spec \
                the layout search below replaces it.\n";
    } else {
        out += "\nThe search of memory knobs keeps data parallelism: for a pipeline-, tensor- or \
                context-parallel spec the layout search below replaces it.\n";
    }
    if let Layouts::Searched(search) = &r.layouts {
        out += &layouts(setup, search);
    } else if let Layouts::NotSearched(why) = &r.layouts
        && setup.gpus > 1
    {
        out += &format!("\nNo layout search: {why}.\n");
    }
    out + &crate::render::assumptions(&r.estimate.assumptions, g)
}

/// The knob search's Pareto front.
fn knobs(setup: &Setup, r: &FitReport) -> String {
    let g = &setup.gpu;
    let mut out = format!(
        "\nConfigurations that fit, none beaten at once on memory, step time, fidelity and number \
         of changes ({} \
         evaluated):\n",
        r.evaluated
    );
    if r.front.is_empty() {
        out += "none: more GPUs (--gpus) or a larger GPU\n";
        return out;
    }
    let mut t = table();
    t.set_header(vec![
        "#",
        "changes from the spec",
        "device memory",
        "headroom",
        "step time",
        "fidelity",
    ]);
    let right = |s: String| Cell::new(s).set_alignment(CellAlignment::Right);
    for (i, e) in r.front.iter().enumerate() {
        let changes = plan::describe(setup, &e.knobs);
        t.add_row(vec![
            Cell::new(i + 1),
            Cell::new(if changes.is_empty() {
                "(the spec as it is)".to_string()
            } else {
                changes.join(" + ")
            }),
            right(format!(
                "{}{}",
                gib(e.device_bytes),
                if e.computed { "*" } else { "" }
            )),
            right(signed_gib(e.headroom_bytes(g))),
            right(format!("×{:.2}", e.slowdown)),
            Cell::new(e.fidelity.key()),
        ]);
    }
    out += &t.to_string();
    out += "\n";
    if r.front.iter().any(|e| e.computed) {
        out += "* computed from the estimate's breakdown (ZeRO-1/2 and offload other than DeepSpeed's \
                of a bf16 AdamW full fine-tune, sharding with adapters, fused loss, residents), \
                not simulated\n";
    }
    out += "Step time: relative to the spec, same tokens per optimizer step; rough factors \
            (checkpointing ×1.33, LoRA ×0.8, QLoRA ×1.05, ZeRO-3 ×1.15, CPU offload ×1.5, \
            smaller micro-batches by GPU utilisation).\n";
    out
}

/// The layout search: the best layouts, the best one and why, or the closest when none fits.
fn layouts(setup: &Setup, s: &LayoutSearch) -> String {
    let g = &setup.gpu;
    let mut out = format!(
        "\nLayouts over {} GPUs, global batch {} sequences ({} candidates: {} simulated, the \
         others the same rank as one of them; {} refused, {} out of memory, {} fit{}):\n",
        s.gpus,
        s.global_batch,
        s.candidates,
        s.simulated,
        s.refused,
        s.out_of_memory,
        s.ranked.len() + s.needless_recompute,
        match s.needless_recompute {
            0 => String::new(),
            n => format!(
                ", {n} of them left out: the same layout keeps its margin faster with less \
                 recomputation"
            ),
        }
    );
    let Some(best) = s.best() else {
        out += &match &s.closest {
            Some((c, est)) => format!(
                "none fits: the one that needs least, {}, needs {} ({}); use more GPUs \
                 (--gpus) or a larger GPU\n",
                c.name(),
                gib(est.device_bytes()),
                signed_gib(g.total_bytes as i128 - est.device_bytes() as i128)
            ),
            None => "none fits, and none could be estimated without a limit\n".to_string(),
        };
        return out;
    };
    let mut t = table();
    t.set_header(vec![
        "#",
        "layout",
        "device memory",
        "headroom",
        "margin",
        "time per token",
        "global batch",
    ]);
    let right = |s: String| Cell::new(s).set_alignment(CellAlignment::Right);
    for (i, e) in s.ranked.iter().take(LISTED).enumerate() {
        let n = e.numbers().expect("ranked layouts fit");
        t.add_row(vec![
            Cell::new(i + 1),
            Cell::new(e.candidate.name()),
            right(format!(
                "{}{}",
                gib(n.device_bytes),
                if e.simulated { "" } else { "*" }
            )),
            right(signed_gib(e.headroom_bytes(g).unwrap_or(0))),
            right(format!(
                "{} {}",
                gib(e.margin_bytes),
                if e.within_margin(g) {
                    "kept"
                } else {
                    "NOT kept"
                }
            )),
            right(format!(
                "×{:.2}",
                e.time.per_token_s / best.time.per_token_s
            )),
            right(format!(
                "{}{}",
                e.candidate.global_batch(),
                if e.exact { "" } else { " (changed)" }
            )),
        ]);
    }
    out += &t.to_string();
    out += "\n";
    if s.ranked.len() > LISTED {
        out += &format!(
            "({} more fit; --json lists the first {LISTED})\n",
            s.ranked.len() - LISTED
        );
    }
    if s.ranked.iter().take(LISTED).any(|e| !e.simulated) {
        out += "* gradient accumulation: the first micro-batch of the step simulated; the \
                gradients later ones accumulate into are not (ranked after whole steps)\n";
    }
    out += &format!("Best: {}, because\n", best.candidate.name());
    for why in layout::reasons(setup, s) {
        out += &format!("  - {why}\n");
    }
    out += &format!("Its spec keys: {}\n", best.candidate.spec_keys());
    if best.candidate.accumulation > 1 {
        // A training loop's spec has no accumulation key.
        out += &format!(
            "  (one micro-batch a step: the loop accumulates {} of them per optimizer step)\n",
            best.candidate.accumulation
        );
    }
    out += &format!("Margin: {}.\n", layout::MARGIN_RULE);
    out += &format!(
        "Step time: {}.\n",
        headroom::report::layouts::cost_model(&setup.spec)
    );
    out
}
