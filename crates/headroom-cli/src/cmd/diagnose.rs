//! `headroom diagnose`: why a run ran out of memory, what in its configs is wrong, and (with
//! its spec) which changes make it fit.

use std::io::Read;
use std::path::{Path, PathBuf};

use comfy_table::{Cell, CellAlignment, ContentArrangement, Table};
use headroom::diagnose::lint::{self, Context, Launch, Lint};
use headroom::diagnose::oom::{self, Explanation, OomMessage};
use headroom::diagnose::{self, SpecCheck};
use headroom::gpu::{self, Gpu};
use headroom::plan::{Resident, Setup};
use headroom::spec::RunSpec;
use headroom::units::{gib, signed_gib};
use serde_json::{Value, json};

use crate::error::{CliError, CliResult};
use crate::render::table;

#[derive(clap::Args)]
pub struct Args {
    /// A log, traceback or message holding PyTorch's out-of-memory error; `-` reads stdin.
    #[arg(long, value_name = "FILE|-")]
    pub oom: Option<String>,
    /// The run spec of the job: checks the message against the estimate and ranks remedies.
    #[arg(long, value_name = "SPEC")]
    pub spec: Option<PathBuf>,
    /// A model that stays on the same GPU without being trained (a DPO reference, an RL
    /// reward or user model), as a `mode: forward` spec; its loaded weights add to the
    /// estimate. Repeatable.
    #[arg(long = "resident", alias = "reference", value_name = "SPEC")]
    pub residents: Vec<PathBuf>,
    /// accelerate config (YAML) the job was launched with.
    #[arg(long, value_name = "FILE")]
    pub accelerate_config: Option<PathBuf>,
    /// DeepSpeed config (JSON); defaults to the accelerate config's deepspeed_config_file.
    #[arg(long, value_name = "FILE")]
    pub deepspeed_config: Option<PathBuf>,
    /// Python scripts or configs to check for device_map="auto". Repeatable.
    #[arg(long, value_name = "FILE")]
    pub script: Vec<PathBuf>,
    /// The GPU (h100-80gb, a100-40gb, ..., or a size like 64GiB); default: the one whose
    /// capacity the message reports.
    #[arg(long)]
    pub gpu: Option<String>,
    /// Data-parallel ranks, one GPU each; default: the accelerate config's num_processes.
    #[arg(long)]
    pub gpus: Option<u32>,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
}

fn read(path: &Path, what: &str) -> CliResult<String> {
    std::fs::read_to_string(path)
        .map_err(|e| CliError::input(format!("{}: cannot read the {what}: {e}", path.display())))
}

fn read_oom(arg: &str) -> CliResult<(String, String)> {
    if arg == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| CliError::input(format!("stdin: cannot read the OOM log: {e}")))?;
        Ok(("stdin".to_string(), text))
    } else {
        let path = PathBuf::from(arg);
        Ok((arg.to_string(), read(&path, "OOM log")?))
    }
}

/// Everything `diagnose` found, before rendering.
struct Report {
    oom_source: Option<String>,
    messages: Vec<OomMessage>,
    explanation: Option<Explanation>,
    lints: Vec<Lint>,
    gpu: Option<Gpu>,
    check: Option<SpecCheck>,
    spec_path: Option<PathBuf>,
}

pub fn run(args: Args) -> CliResult {
    if args.oom.is_none()
        && args.spec.is_none()
        && args.accelerate_config.is_none()
        && args.deepspeed_config.is_none()
        && args.script.is_empty()
    {
        return Err(CliError::input(
            "nothing to diagnose: give --oom FILE|- (the error log), and/or --spec, \
             --accelerate-config, --deepspeed-config, --script",
        ));
    }
    let report = diagnose(&args)?;
    if args.json {
        println!("{}", to_json(&report));
    } else {
        print!("{}", render(&report));
    }
    Ok(())
}

fn diagnose(args: &Args) -> CliResult<Report> {
    let mut oom_text = None;
    let mut messages = Vec::new();
    if let Some(arg) = &args.oom {
        let (source, text) = read_oom(arg)?;
        messages = oom::parse_all(&text);
        if messages.is_empty() {
            let hint = if text.contains("CUDA error: out of memory") {
                "; it has `CUDA error: out of memory`, raised by the driver outside PyTorch's \
                 allocator (context creation, NCCL, cuBLAS handles), which carries no numbers"
            } else {
                ""
            };
            return Err(CliError::input(format!(
                "{source}: no PyTorch out-of-memory message found (expected `CUDA out of memory. \
                 Tried to allocate …` or its HIP form){hint}"
            )));
        }
        oom_text = Some((source, text));
    }
    let message = messages.first();
    let explanation = message.map(oom::explain);

    let spec = args
        .spec
        .as_ref()
        .map(|p| RunSpec::from_file(p))
        .transpose()?;
    let spec_dir = args.spec.as_deref().and_then(Path::parent);

    let gpu = match (&args.gpu, message.and_then(|m| m.total_capacity_bytes)) {
        (Some(name), _) => Some(gpu::find(name)?),
        (None, Some(total)) => Some(diagnose::gpu_from_message(total)),
        (None, None) => spec.as_ref().map(|_| Gpu::default()),
    };

    // accelerate first: it tells how many ranks there are and may name the DeepSpeed JSON.
    let mut lints = Vec::new();
    let mut launch: Option<Launch> = None;
    let lint_cx = |arch| Context {
        spec: spec.as_ref(),
        arch,
        gpu: gpu.as_ref(),
    };
    if let Some(path) = &args.accelerate_config {
        let text = read(path, "accelerate config")?;
        let (l, found) = lint::accelerate(&text, path, lint_cx(None))?;
        lints.extend(found);
        launch = Some(l);
    }
    let ranks = args.gpus.unwrap_or_else(|| {
        launch
            .as_ref()
            .filter(|l| l.is_distributed())
            .and_then(|l| l.processes)
            .and_then(|n| u32::try_from(n).ok())
            .unwrap_or(1)
    });

    let check = match (&spec, &gpu) {
        (Some(spec), Some(gpu)) => {
            let mut residents = Vec::new();
            for path in &args.residents {
                let r = RunSpec::from_file(path)?;
                residents.push(Resident::from_spec(&r, path.parent(), gpu)?);
            }
            let setup = Setup {
                spec: spec.clone(),
                spec_dir,
                gpu: gpu.clone(),
                gpus: ranks.max(1),
                residents,
            };
            Some(diagnose::check_spec(&setup, message)?)
        }
        _ => {
            if !args.residents.is_empty() {
                return Err(CliError::input(
                    "--resident needs --spec: residents add to the run the spec describes",
                ));
            }
            None
        }
    };

    let ds_path = args.deepspeed_config.clone().or_else(|| {
        let file = launch.as_ref()?.deepspeed_config_file.as_ref()?;
        let base = args
            .accelerate_config
            .as_deref()
            .and_then(Path::parent)
            .unwrap_or(Path::new("."));
        Some(base.join(file))
    });
    if let Some(path) = &ds_path {
        let text = read(path, "DeepSpeed config")?;
        let arch = check.as_ref().map(|c| &c.estimate.arch);
        lints.extend(lint::deepspeed(&text, path, lint_cx(arch))?);
    }
    if let Some((source, text)) = &oom_text {
        lints.extend(lint::device_map(source, text, launch.as_ref()));
    }
    for path in &args.script {
        let text = read(path, "script")?;
        lints.extend(lint::device_map(
            &path.display().to_string(),
            &text,
            launch.as_ref(),
        ));
    }
    lints.sort_by_key(|l| l.severity);

    Ok(Report {
        oom_source: oom_text.map(|(s, _)| s),
        messages,
        explanation,
        lints,
        gpu,
        check,
        spec_path: args.spec.clone(),
    })
}

/// A table that wraps long cells to fit a terminal of `width` columns.
fn wrapped(width: u16) -> Table {
    let mut t = table();
    t.set_content_arrangement(ContentArrangement::Dynamic);
    t.set_width(width);
    t
}

fn size(bytes: Option<u64>) -> String {
    bytes.map_or("—".to_string(), gib)
}

fn right(text: String) -> Cell {
    Cell::new(text).set_alignment(CellAlignment::Right)
}

fn render(r: &Report) -> String {
    let mut out = String::new();
    if let (Some(m), Some(e)) = (r.messages.first(), &r.explanation) {
        let device = m.device.map_or("?".to_string(), |d| d.to_string());
        out += &format!(
            "{} out-of-memory message in {} (torch {}, GPU {device}){}\n\n",
            m.backend,
            r.oom_source.as_deref().unwrap_or("input"),
            m.torch_versions,
            if r.messages.len() > 1 {
                format!("; {} distinct messages, the first shown", r.messages.len())
            } else {
                String::new()
            }
        );
        let mut t = table();
        t.set_header(vec!["from the message", "bytes"]);
        let mut row = |k: &str, v: Option<u64>| {
            if v.is_some() {
                t.add_row(vec![Cell::new(k), right(size(v))]);
            }
        };
        row("tried to allocate", m.tried_to_allocate_bytes);
        row("total capacity", m.total_capacity_bytes);
        row("free on the device", m.free_bytes);
        row("allocated by PyTorch", m.allocated_by_pytorch_bytes);
        row("reserved but unallocated", m.reserved_unallocated_bytes);
        row("private pools (free)", m.private_pools_bytes);
        row("allowed (memory fraction)", m.allowed_bytes);
        for p in &m.processes {
            let who = p.pid.map_or("this process (NVML)".to_string(), |pid| {
                format!("process {pid}")
            });
            t.add_row(vec![Cell::new(who), right(gib(p.bytes))]);
        }
        if let Some(a) = &e.accounting {
            if let Some(np) = a.this_process_non_pytorch {
                t.add_row(vec![
                    Cell::new("this process outside PyTorch"),
                    right(gib(np)),
                ]);
            }
            t.add_row(vec![
                Cell::new("not attributed by the message"),
                right(gib(a.unattributed)),
            ]);
        }
        out += &t.to_string();
        out += &format!(
            "\n\nDiagnosis: {}\n{}\n",
            e.cause.key().replace('_', " "),
            e.summary
        );
        for f in &e.findings {
            out += &format!("  - {}\n", f.text);
        }
        out += "\n";
    }

    if !r.lints.is_empty() {
        let mut t = wrapped(120);
        t.set_header(vec!["", "where", "problem", "fix"]);
        for l in &r.lints {
            t.add_row(vec![
                Cell::new(l.severity.key()),
                Cell::new(format!("{}: {}", l.source, l.key)),
                Cell::new(&l.message),
                Cell::new(&l.fix),
            ]);
        }
        out += "Config checks\n";
        out += &t.to_string();
        out += "\n\n";
    }

    if let (Some(c), Some(gpu)) = (&r.check, &r.gpu) {
        out += &format!(
            "Estimate: {} on {} ({}{})\n{}\n",
            r.spec_path
                .as_ref()
                .map_or(c.estimate.model.clone(), |p| p.display().to_string()),
            gpu.name,
            gib(gpu.total_bytes),
            if c.baseline.computed {
                "; residents and ranks added from their own estimates"
            } else {
                ""
            },
            c.verdict
        );
        let parts: Vec<String> = c
            .estimate
            .breakdown
            .iter()
            .filter(|(_, b)| *b >= 1 << 28)
            .map(|(k, b)| format!("{k} {}", gib(*b)))
            .collect();
        out += &format!("At the peak: {}.\n", parts.join(", "));
        if let Some(a) = &c.agreement {
            out += &format!("{a}\n");
        }
        out += "\nRemedies, cheapest first among those that fit\n";
        let mut t = table();
        t.set_header(vec![
            "#",
            "remedy",
            "device memory",
            "saves",
            "fits",
            "step time",
            "from",
        ]);
        for (i, rem) in c.remedies.iter().enumerate() {
            let e = &rem.evaluation;
            t.add_row(vec![
                Cell::new(i + 1),
                Cell::new(&rem.title),
                right(gib(e.device_bytes)),
                right(signed_gib(rem.saving_bytes)),
                Cell::new(if e.fits { "yes" } else { "no" }),
                right(format!("×{:.2}", e.slowdown)),
                Cell::new(rem.basis.key()),
            ]);
        }
        out += &t.to_string();
        out += "\n";
        for (i, rem) in c.remedies.iter().enumerate() {
            out += &format!(
                "{:>2}. {}: {}\n    cost: {}\n",
                i + 1,
                rem.title,
                rem.how,
                rem.cost
            );
        }
        match &c.cheapest_fit {
            Some((e, changes)) => {
                let gpu_total = r.gpu.as_ref().map_or(0, |g| g.total_bytes);
                out += &format!(
                    "\nCheapest configuration that fits (searched; keeps {:.0}% of the GPU free when \
                     any does): {} — {} on the device ({} free), step time ×{:.2}, {}{}\n",
                    100.0 * headroom::plan::SAFETY_MARGIN,
                    if changes.is_empty() {
                        "the spec as it is".to_string()
                    } else {
                        changes.join(" + ")
                    },
                    gib(e.device_bytes),
                    gib(gpu_total.saturating_sub(e.device_bytes)),
                    e.slowdown,
                    e.fidelity.key(),
                    if e.computed {
                        " (partly computed from the breakdown)"
                    } else {
                        ""
                    }
                );
            }
            None => {
                out += "\nNo configuration in the search fits this GPU; see `headroom fit` with \
                        more GPUs.\n"
            }
        }
    }
    out
}

fn message_json(m: &OomMessage) -> Value {
    json!({
        "backend": m.backend.to_string(),
        "format": m.format.key(),
        "torch_versions": m.torch_versions,
        "device": m.device,
        "tried_to_allocate_bytes": m.tried_to_allocate_bytes,
        "total_capacity_bytes": m.total_capacity_bytes,
        "free_bytes": m.free_bytes,
        "allocated_by_pytorch_bytes": m.allocated_by_pytorch_bytes,
        "reserved_unallocated_bytes": m.reserved_unallocated_bytes,
        "reserved_by_pytorch_bytes": m.reserved_by_pytorch_bytes,
        "allowed_bytes": m.allowed_bytes,
        "private_pools_bytes": m.private_pools_bytes,
        "processes": m.processes.iter().map(|p| json!({"pid": p.pid, "bytes": p.bytes})).collect::<Vec<_>>(),
    })
}

fn to_json(r: &Report) -> Value {
    let mut v = match r.messages.first() {
        Some(m) => message_json(m),
        None => json!({}),
    };
    if r.oom_source.is_some() {
        v["oom_source"] = json!(r.oom_source);
        v["messages_found"] = json!(r.messages.len());
        v["other_messages"] = r.messages.iter().skip(1).map(message_json).collect();
    }
    if let Some(e) = &r.explanation {
        v["diagnosis"] = json!({
            "cause": e.cause.key(),
            "summary": e.summary,
            "findings": e.findings.iter().map(|f| json!({"cause": f.cause.key(), "text": f.text})).collect::<Vec<_>>(),
            "accounting": e.accounting.as_ref().map(|a| json!({
                "total_bytes": a.total,
                "free_bytes": a.free,
                "allocated_bytes": a.allocated,
                "reserved_unallocated_bytes": a.reserved_unallocated,
                "this_process_non_pytorch_bytes": a.this_process_non_pytorch,
                "other_processes_bytes": a.other_processes,
                "unattributed_bytes": a.unattributed,
                "presumed_self_pid": a.presumed_self_pid,
            })),
        });
    }
    v["lints"] = r
        .lints
        .iter()
        .map(|l| {
            json!({"severity": l.severity.key(), "source": l.source, "key": l.key,
                   "message": l.message, "fix": l.fix})
        })
        .collect();
    if let Some(g) = &r.gpu {
        v["gpu"] = json!({"name": g.name, "total_bytes": g.total_bytes,
                          "cuda_context_bytes": g.cuda_context_bytes, "source": g.source});
    }
    if let Some(c) = &r.check {
        let b = &c.baseline;
        v["estimate"] = json!({
            "model": c.estimate.model,
            "peak_allocated_bytes": b.peak_allocated_bytes,
            "peak_reserved_bytes": b.peak_reserved_bytes,
            "device_bytes": b.device_bytes,
            "fits": b.fits,
            "computed": b.computed,
            "peak_phase": c.estimate.peak_phase,
            "peak_step": c.estimate.peak_step,
            "breakdown": c.estimate.breakdown.iter().map(|(k, b)| json!({"component": k.key(), "bytes": b})).collect::<Vec<_>>(),
            "verdict": c.verdict,
            "agreement": c.agreement,
        });
        v["remedies"] = c
            .remedies
            .iter()
            .map(|rem| {
                let e = &rem.evaluation;
                json!({
                    "key": rem.key,
                    "title": rem.title,
                    "how": rem.how,
                    "cost": rem.cost,
                    "basis": rem.basis.key(),
                    "device_bytes": e.device_bytes,
                    "peak_allocated_bytes": e.peak_allocated_bytes,
                    "peak_reserved_bytes": e.peak_reserved_bytes,
                    "saving_bytes": rem.saving_bytes,
                    "fits": e.fits,
                    "slowdown": e.slowdown,
                    "fidelity": e.fidelity.key(),
                    "changes_data": rem.changes_data,
                })
            })
            .collect();
        v["cheapest_fit"] = c.cheapest_fit.as_ref().map_or(Value::Null, |(e, changes)| {
            json!({
                "changes": changes,
                "device_bytes": e.device_bytes,
                "slowdown": e.slowdown,
                "fidelity": e.fidelity.key(),
                "computed": e.computed,
            })
        });
    }
    v
}
