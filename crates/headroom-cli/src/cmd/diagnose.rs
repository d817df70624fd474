//! `headroom diagnose`: why a run ran out of memory, what in its configs is wrong, and (with
//! its spec) which changes make it fit.

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

use comfy_table::{Cell, CellAlignment, ContentArrangement, Table};
use headroom::diagnose::{self, Diagnosis, Inputs, OomLog};
use headroom::limits::MAX_OOM_LOG_BYTES;
use headroom::report::diagnose::DiagnoseJson;
use headroom::report::to_json;
use headroom::units::{gib, signed_gib};

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

/// The OOM log named by `--oom`: a file, or stdin for `-`, in any encoding a paste comes in
/// ([`diagnose::decode_log`]); only its last [`MAX_OOM_LOG_BYTES`] are read.
fn read_oom(arg: &str) -> CliResult<OomLog> {
    let keep = MAX_OOM_LOG_BYTES as usize;
    let (source, bytes) = if arg == "-" {
        let bytes = read_tail(std::io::stdin(), keep)
            .map_err(|e| CliError::input(format!("stdin: cannot read the OOM log: {e}")))?;
        ("stdin".to_string(), bytes)
    } else {
        let read = || -> std::io::Result<Vec<u8>> {
            let mut file = std::fs::File::open(arg)?;
            let len = file.metadata()?.len();
            if len > MAX_OOM_LOG_BYTES {
                file.seek(SeekFrom::Start(len - MAX_OOM_LOG_BYTES))?;
            }
            read_tail(file, keep)
        };
        let bytes =
            read().map_err(|e| CliError::input(format!("{arg}: cannot read the OOM log: {e}")))?;
        (arg.to_string(), bytes)
    };
    Ok(OomLog {
        source,
        text: diagnose::decode_log(&bytes),
    })
}

/// The last `keep` bytes of `reader`, holding at most twice that at once.
fn read_tail(mut reader: impl Read, keep: usize) -> std::io::Result<Vec<u8>> {
    let mut tail = Vec::new();
    let mut chunk = vec![0; 1 << 20];
    loop {
        let n = match reader.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        tail.extend_from_slice(&chunk[..n]);
        if tail.len() > 2 * keep {
            tail.drain(..tail.len() - keep);
        }
    }
    if tail.len() > keep {
        tail.drain(..tail.len() - keep);
    }
    Ok(tail)
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
    if args.spec.is_none() && !args.residents.is_empty() {
        return Err(CliError::input(
            "--resident needs --spec: residents add to the run the spec describes",
        ));
    }
    let inputs = Inputs {
        oom: args.oom.as_deref().map(read_oom).transpose()?,
        spec: args.spec,
        spec_dir: None,
        residents: args.residents,
        accelerate_config: args.accelerate_config,
        deepspeed_config: args.deepspeed_config,
        scripts: args.script,
        gpu: args.gpu,
        gpus: args.gpus,
    };
    if args.json {
        println!("{}", json(&inputs)?);
    } else {
        print!("{}", render(&diagnose::run(&inputs)?));
    }
    Ok(())
}

/// The JSON `diagnose --json` prints for these inputs.
pub fn json(inputs: &Inputs) -> CliResult<String> {
    Ok(to_json(&DiagnoseJson::new(&diagnose::run(inputs)?)))
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

fn render(r: &Diagnosis) -> String {
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
                Cell::new(format!("{} {}", l.severity.key(), l.rule.id())),
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
        if let Some(words) = &r.launched_as {
            out += &format!("As the accelerate config launches it: {words}.\n");
        }
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
        out += &crate::render::assumptions(&c.estimate.assumptions, &c.estimate.gpu);
    }
    out
}
