//! Human-readable output: byte sizes and tables.

use comfy_table::{Cell, CellAlignment, Table, presets::UTF8_FULL_CONDENSED};
use headroom::estimate::{Assumptions, Estimate};
use headroom::gpu::Gpu;
use headroom::spec::Library;
use headroom::units::{gib, signed_gib};

fn count(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

pub fn table() -> Table {
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
    t
}

pub fn estimate(est: &Estimate, verdict: bool) -> String {
    let mut out = String::new();
    out += &format!(
        "{}: {} parameters, {} trainable\n",
        est.model,
        count(est.params),
        count(est.trainable_params)
    );
    if let Some(p) = &est.parallel {
        let tensor = match p.tensor {
            t if t.tp > 1 => format!(
                " × tensor parallel {}{}",
                t.tp,
                if t.sequence_parallel {
                    " with sequence parallelism"
                } else {
                    ""
                }
            ),
            _ => String::new(),
        };
        let pipeline = match &p.pipeline {
            pipe if pipe.pp > 1 => format!(
                " × pipeline {} of {} stages ({} per rank, {} micro-batches)",
                pipe.schedule.name(),
                pipe.stages(),
                pipe.vpp,
                pipe.microbatches
            ),
            _ => String::new(),
        };
        let context = match p.tensor.cp {
            1 => String::new(),
            cp => format!(" × context parallel {cp} (ring attention)"),
        };
        let strategy = match p.tensor.framework {
            headroom::spec::Framework::Megatron => "megatron-core ddp",
            headroom::spec::Framework::Transformers => "transformers' tp_plan",
            headroom::spec::Framework::Torchtitan => p.strategy.name(),
        };
        out += &format!(
            "{}{tensor}{context}{pipeline} over {} GPUs: every number below is rank {}'s (the one \
             that needs most)\n",
            strategy, p.world_size, est.worst_rank
        );
    }
    out += "\n";
    let mut t = table();
    t.set_header(vec![
        "at the peak (step ".to_string() + &est.peak_step.to_string() + ", " + est.peak_phase + ")",
        "bytes".into(),
        "share".into(),
    ]);
    for (c, b) in &est.breakdown {
        t.add_row(vec![
            Cell::new(c.to_string()),
            Cell::new(gib(*b)).set_alignment(CellAlignment::Right),
            Cell::new(format!(
                "{:.1}%",
                100.0 * *b as f64 / est.peak_allocated_bytes as f64
            ))
            .set_alignment(CellAlignment::Right),
        ]);
    }
    t.add_row(vec![
        Cell::new("peak allocated"),
        Cell::new(gib(est.peak_allocated_bytes)).set_alignment(CellAlignment::Right),
        Cell::new(""),
    ]);
    if let Some(load) = est.load_peak_above_steps() {
        t.add_row(vec![
            Cell::new("loading peaks higher (the run's max_memory_allocated)"),
            Cell::new(gib(load)).set_alignment(CellAlignment::Right),
            Cell::new(""),
        ]);
    }
    t.add_row(vec![
        Cell::new("reserved but unallocated (caching allocator)"),
        Cell::new(gib(est
            .peak_reserved_bytes
            .saturating_sub(est.peak_allocated_bytes)))
        .set_alignment(CellAlignment::Right),
        Cell::new(""),
    ]);
    t.add_row(vec![
        Cell::new("peak reserved"),
        Cell::new(gib(est.peak_reserved_bytes)).set_alignment(CellAlignment::Right),
        Cell::new(""),
    ]);
    t.add_row(vec![
        Cell::new("CUDA context"),
        Cell::new(gib(est.cuda_context_bytes)).set_alignment(CellAlignment::Right),
        Cell::new(""),
    ]);
    if est.nccl_bytes > 0 {
        let communicators = &est.nccl_communicators;
        let label = if communicators.is_empty() {
            "NCCL communicators (outside the allocator)".to_string()
        } else {
            format!(
                "NCCL communicators (outside the allocator): {} made, {} used by a step",
                communicators.len(),
                communicators.iter().filter(|c| c.group.used).count()
            )
        };
        t.add_row(vec![
            Cell::new(label),
            Cell::new(gib(est.nccl_bytes)).set_alignment(CellAlignment::Right),
            Cell::new(""),
        ]);
    }
    if est.engine_bytes > 0 {
        t.add_row(vec![
            Cell::new("colocated vLLM engine (vLLM's gpu_memory_utilization)"),
            Cell::new(gib(est.engine_bytes)).set_alignment(CellAlignment::Right),
            Cell::new(""),
        ]);
    }
    t.add_row(vec![
        Cell::new("device total (nvidia-smi)"),
        Cell::new(gib(est.device_bytes())).set_alignment(CellAlignment::Right),
        Cell::new(""),
    ]);
    if est.host_bytes > 0 {
        t.add_row(vec![
            Cell::new("host memory (offloaded optimizer states, parameters)"),
            Cell::new(gib(est.host_bytes)).set_alignment(CellAlignment::Right),
            Cell::new("not on the GPU"),
        ]);
    }
    out += &t.to_string();
    out += "\n\n";
    let mut p = table();
    p.set_header(vec!["step", "phase", "peak allocated", "peak reserved"]);
    for ph in &est.phases {
        p.add_row(vec![
            Cell::new(ph.step),
            Cell::new(ph.phase),
            Cell::new(gib(ph.peak_allocated)).set_alignment(CellAlignment::Right),
            Cell::new(gib(ph.peak_reserved)).set_alignment(CellAlignment::Right),
        ]);
    }
    out += &p.to_string();
    out += "\n";
    if let Some(pipeline) = est
        .parallel
        .as_ref()
        .map(|p| &p.pipeline)
        .filter(|p| p.pp > 1)
    {
        let layers = pipeline.stage_layers(est.arch.layers);
        let ranks_per_stage = est
            .parallel
            .as_ref()
            .map_or(1, |p| p.world_size / pipeline.pp);
        let mut s = table();
        s.set_header(vec![
            "stage",
            "layers",
            "rank",
            "peak allocated",
            "peak reserved",
        ]);
        for stage in &est.stages {
            let first: u64 = layers[..stage.stage as usize].iter().sum();
            s.add_row(vec![
                Cell::new(stage.stage),
                Cell::new(format!(
                    "{first}-{}",
                    first + layers[stage.stage as usize] - 1
                )),
                Cell::new(stage.pipeline_rank * ranks_per_stage),
                Cell::new(gib(stage.peak_allocated)).set_alignment(CellAlignment::Right),
                Cell::new(gib(stage.peak_reserved)).set_alignment(CellAlignment::Right),
            ]);
        }
        out += "\n";
        out += &s.to_string();
        out += "\n";
    }
    if verdict {
        out += &verdict_text(
            &est.gpu,
            est.fits(),
            est.headroom_bytes(),
            est.oom.as_ref(),
            "step",
        );
    }
    out + &assumptions(&est.assumptions, &est.gpu)
}

/// The block that ends every report an estimate feeds: the versions followed, the GPU's
/// constants and where each comes from, and a `warning:` line for each assumption that does
/// not hold as measured.
pub fn assumptions(a: &Assumptions, gpu: &Gpu) -> String {
    let followed: Vec<String> = Library::ALL
        .iter()
        .filter_map(|l| a.given.followed(*l).map(|v| format!("{} {v}", l.key())))
        .collect();
    let given: Vec<String> = Library::ALL
        .iter()
        .filter_map(|l| a.given.given(*l).map(|v| format!("{} {v}", l.key())))
        .collect();
    let mut out = format!("\nAssumptions\n  follows {}", followed.join(", "));
    if !given.is_empty() {
        out += &format!("; the spec gives {}", given.join(", "));
    }
    let [total, context, cublas, cublaslt] = gpu.constants();
    out += &format!(
        "\n  {} ({})\n    total {}: {}\n    CUDA context {}: {}\n    cuBLAS + cuBLASLt workspaces \
         {:.2} + {:.2} MiB per thread: {}\n",
        gpu.name,
        gpu.arch.key(),
        gib(total.bytes),
        total.source,
        gib(context.bytes),
        context.source,
        cublas.bytes as f64 / (1u64 << 20) as f64,
        cublaslt.bytes as f64 / (1u64 << 20) as f64,
        cublas.source
    );
    for w in &a.warnings {
        out += &format!("warning: {w}\n");
    }
    out
}

/// Fits or not, with the headroom, and where and how PyTorch would run out (`when`: step or
/// iteration).
fn verdict_text(
    gpu: &headroom::gpu::Gpu,
    fits: bool,
    headroom: i128,
    oom: Option<&headroom::sim::SimulatedOom>,
    when: &str,
) -> String {
    let mut out = format!(
        "\n{} ({} usable): {} — headroom {}\n",
        gpu.name,
        gib(gpu.total_bytes),
        if fits { "fits" } else { "does NOT fit" },
        signed_gib(headroom)
    );
    if let Some(oom) = oom {
        out += &format!(
            "PyTorch runs out in {when} {} ({}), allocating {} ({}); the tables show what the run \
             would need. Its message would read:\n  {}\n",
            oom.step,
            oom.phase,
            oom.tensor,
            gib(oom.requested_bytes),
            oom.error
        );
    }
    out
}

pub fn models(rows: &[(&String, headroom::arch::Architecture)]) -> String {
    let mut t = table();
    let moe = rows.iter().any(|(_, a)| a.moe.is_some());
    let mut header = vec!["model", "type", "params"];
    if moe {
        header.extend(["active", "experts"]);
    }
    header.extend(["layers", "hidden", "heads", "kv", "vocab", "context"]);
    t.set_header(header);
    for (name, a) in rows {
        let right = |s: String| Cell::new(s).set_alignment(CellAlignment::Right);
        let mut row = vec![
            Cell::new(name),
            Cell::new(&a.model_type),
            right(count(a.param_count(headroom::arch::Head::CausalLm))),
        ];
        if moe {
            row.push(right(count(
                a.active_param_count(headroom::arch::Head::CausalLm),
            )));
            row.push(right(a.moe.as_ref().map_or("-".to_string(), |m| {
                format!("{} / {}", m.top_k, m.experts)
            })));
        }
        row.extend([
            right(a.layers.to_string()),
            right(a.hidden.to_string()),
            right(a.heads.to_string()),
            right(a.kv_heads.to_string()),
            right(count(a.vocab)),
            right(count(a.max_positions)),
        ]);
        t.add_row(row);
    }
    format!(
        "{t}\n{} models. `model:` also takes a hub id (Qwen/Qwen2.5-7B-Instruct), an HF config.json or a model folder.\n",
        rows.len()
    )
}

/// One line of a measured-against-estimated table; the error is (estimate - measured) / measured.
pub fn comparison_row(step: &str, what: &str, measured: u64, estimated: Option<u64>) -> Vec<Cell> {
    let right = |s: String| Cell::new(s).set_alignment(CellAlignment::Right);
    let (estimated, error) = match estimated {
        Some(e) => (
            gib(e),
            format!(
                "{:+.2}%",
                100.0 * (e as f64 - measured as f64) / measured as f64
            ),
        ),
        None => ("-".into(), "-".into()),
    };
    vec![
        Cell::new(step),
        Cell::new(what),
        right(gib(measured)),
        right(estimated),
        right(error),
    ]
}

pub fn pipeline(
    spec: &headroom::spec::PipelineSpec,
    est: &headroom::estimate::PipelineEstimate,
    verdict: bool,
) -> String {
    use headroom::spec::Home;
    use headroom::spec::Pass;
    use headroom::spec::Strategy;
    let mut out = String::new();
    let sharded = spec.instances.iter().any(|i| i.spec.parallel.is_some());
    let mut it = table();
    it.set_header(vec!["instance", "model", "setup", "lives"]);
    for i in &spec.instances {
        let s = &i.spec;
        let mut setup = format!(
            "{}, {}, {} x {}",
            s.precision.name(),
            match s.mode {
                headroom::spec::Mode::Train => s.optimizer.name(),
                headroom::spec::Mode::Forward => "no grad",
            },
            s.batch_size,
            s.seq_len
        );
        if s.gradient_checkpointing {
            setup += ", checkpointing";
        }
        if let Some(l) = &s.lora {
            setup += &format!(", LoRA r{}", l.r);
        }
        let lives = match (&s.parallel, i.home) {
            _ if i.engine.is_some() => {
                let e = i.engine.as_ref().expect("checked");
                format!(
                    "vLLM-style engine, {:.0}% of the GPU, {}",
                    100.0 * e.gpu_memory_utilization,
                    match e.sleep_level {
                        Some(l) => format!("sleeps at level {l} between rollouts"),
                        None => "never sleeps".into(),
                    }
                )
            }
            (Some(p), _) if p.offload_params => format!(
                "host ({}, {} rank{})",
                match p.strategy {
                    Strategy::Zero3 => "ZeRO-3 offload_param",
                    Strategy::Fsdp1 => "FSDP1 CPUOffload",
                    _ => "FSDP2 CPU offload",
                },
                p.world_size,
                if p.world_size == 1 { "" } else { "s" }
            ),
            (Some(p), _) => format!("GPU, {} over {} ranks", p.strategy.name(), p.world_size),
            (None, Home::Gpu) => "GPU".into(),
            (None, Home::Cpu) => "host, moved in for its passes".into(),
        };
        let mut name = i.name.clone();
        if !i.aliases.is_empty() {
            name += &format!(" (= {})", i.aliases.join(", "));
        }
        it.add_row(vec![name, s.model.clone(), setup, lives]);
    }
    out += &format!(
        "{it}
"
    );
    let phases: Vec<String> = spec
        .phases
        .iter()
        .map(|p| {
            let runs: Vec<String> = p
                .passes
                .iter()
                .map(|x| {
                    let name = &spec.instances[x.instance].name;
                    let pass = match x.pass {
                        Pass::Train => "step".to_string(),
                        Pass::Forward => "forward".to_string(),
                        Pass::Generate { new_tokens } => format!("generates {new_tokens}"),
                    };
                    match x.repeat {
                        1 => format!("{name} {pass}"),
                        n => format!("{name} {pass} x{n}"),
                    }
                })
                .collect();
            let mut text = format!("{} ({}", p.name, runs.join(", "));
            if !p.offload.is_empty() {
                let names: Vec<&str> = p
                    .offload
                    .iter()
                    .map(|&i| spec.instances[i].name.as_str())
                    .collect();
                text += &format!("; {} moved to the host", names.join(", "));
            }
            text + ")"
        })
        .collect();
    out += &format!(
        "{} iterations of: {}{}

",
        spec.iterations,
        phases.join(", "),
        if sharded { "; bytes are per GPU" } else { "" }
    );
    let mut t = table();
    t.set_header(vec![
        "iteration",
        "phase",
        "peak allocated",
        "peak reserved",
        "on the host",
        "copied",
    ]);
    let with_engines = !est.engines.is_empty();
    if with_engines {
        t.set_header(vec![
            "iteration",
            "phase",
            "peak allocated",
            "peak reserved",
            "engines",
            "on the host",
            "copied",
        ]);
    }
    for p in &est.phases {
        let right = |s: String| Cell::new(s).set_alignment(CellAlignment::Right);
        let mut row = vec![
            Cell::new(p.iteration),
            Cell::new(&p.name),
            right(gib(p.peak_allocated)),
            right(gib(p.peak_reserved)),
        ];
        if with_engines {
            row.push(right(gib(p.engine_bytes)));
        }
        row.extend([right(gib(p.host_bytes)), right(gib(p.transfer_bytes))]);
        t.add_row(row);
    }
    out += &format!("{t}\n");
    out += &format!(
        "peak: {} allocated ({}, iteration {}), {} reserved, + {} CUDA context\n",
        gib(est.peak_allocated_bytes),
        est.peak_phase.0,
        est.peak_phase.1,
        gib(est.peak_reserved_bytes),
        gib(est.cuda_context_bytes)
    );
    if est.nccl_bytes > 0 {
        out += &format!("+ {} of NCCL communicators per GPU\n", gib(est.nccl_bytes));
    }
    for e in &est.engines {
        out += &format!(
            "engine {}: {} of the GPU while awake, {} of it weights: room for at most {} tokens of \
             KV cache (its activations and CUDA graphs take part of that; vLLM is not installed on \
             the measuring machines, so this share is vLLM's contract, not a measurement)\n",
            e.name,
            gib(e.bytes),
            gib(e.weight_bytes),
            count(e.kv_tokens)
        );
    }
    let parts: Vec<String> = est
        .breakdown
        .iter()
        .take(4)
        .map(|(c, bytes)| format!("{c} {}", gib(*bytes)))
        .collect();
    out += &format!("at the peak: {}\n", parts.join(", "));
    match est.transfer_seconds_per_iteration {
        Some(seconds) => {
            out += &format!(
                "copied per iteration: {:.1} GB between host and device, about {seconds:.1} s at the \
                 ~{:.0} GB/s of pageable copies measured on an H200\n",
                est.transfer_bytes_per_iteration as f64 / 1e9,
                headroom::estimate::PAGEABLE_COPY_BYTES_PER_S / 1e9
            );
        }
        None if est.transfer_bytes_per_iteration > 0 => {
            out += &format!(
                "copied per iteration: {:.1} GB to the device from pinned memory, overlapped with the \
                 pass (measured: 0.1 s per pass against 0.04 s resident)\n",
                est.transfer_bytes_per_iteration as f64 / 1e9
            );
        }
        None => {}
    }
    if verdict {
        out += &verdict_text(
            &est.gpu,
            est.fits(),
            est.headroom_bytes(),
            est.oom.as_ref(),
            "iteration",
        );
    }
    out + &assumptions(&est.assumptions, &est.gpu)
}

/// `headroom trace`: where the numbers come from, the breakdown at the peak, the phases, and
/// the verdict at `--gpu`.
pub fn trace(
    trace: &headroom::trace::Trace,
    est: &headroom::trace::TraceEstimate,
    file: Option<&str>,
    alloc_conf: Option<&str>,
    verdict: bool,
) -> String {
    let versions: Vec<String> = ["torch", "transformers", "peft", "python"]
        .iter()
        .filter_map(|key| {
            trace.env.get(*key).and_then(|v| v.as_str()).map(|v| {
                format!(
                    "{key} {}",
                    headroom::error::shown(v, headroom::error::SHOWN_CHARS)
                )
            })
        })
        .collect();
    let versions = if versions.is_empty() {
        "versions not recorded".to_string()
    } else {
        versions.join(", ")
    };
    let mut out = format!(
        "{}: traced from the real model code under fake tensors ({versions})\n",
        trace.model().map_or("the run".to_string(), |m| {
            headroom::error::shown(m, headroom::error::SHOWN_CHARS)
        })
    );
    if let Some(world) = trace.spec["parallel"]["world_size"].as_u64() {
        let rank = trace.env.get("rank").and_then(|r| r.as_u64()).unwrap_or(0);
        out += &format!(
            "rank {rank} of a world of {world}, traced under torch's fake process group\n"
        );
    }
    if let Some(file) = file {
        out += &format!("trace file: {file}\n");
    }
    out += &format!(
        "{} trace events; {} allocations and frees replayed with the CUDA kernels' own buffers \
         sized for the {} ({}), under {}\n\n",
        count(trace.events.len() as u64),
        count(est.timeline_events),
        est.gpu.name,
        est.gpu.arch.key(),
        alloc_conf.map_or("the spec's allocator setting".to_string(), |c| {
            format!("--alloc-conf {c}")
        })
    );
    let right = |s: String| Cell::new(s).set_alignment(CellAlignment::Right);
    let mut t = table();
    t.set_header(vec![
        format!(
            "at the peak ({})",
            phase_label(&est.peak_phase, est.peak_iteration)
        ),
        "bytes".into(),
        "share".into(),
    ]);
    for &(component, bytes) in &est.breakdown {
        t.add_row(vec![
            Cell::new(component.replace('_', " ")),
            right(gib(bytes)),
            right(format!(
                "{:.1}%",
                100.0 * bytes as f64 / est.peak_allocated_bytes as f64
            )),
        ]);
    }
    for (what, bytes) in [
        ("peak allocated", est.peak_allocated_bytes),
        (
            "reserved but unallocated at the peak (fragmentation)",
            est.fragmentation_bytes,
        ),
        ("peak reserved", est.peak_reserved_bytes),
        ("CUDA context", est.cuda_context_bytes),
        ("device total (nvidia-smi)", est.device_bytes()),
    ] {
        t.add_row(vec![Cell::new(what), right(gib(bytes)), Cell::new("")]);
    }
    out += &format!("{t}\n\n");
    let mut p = table();
    p.set_header(vec!["phase", "peak allocated", "peak reserved"]);
    for ph in &est.phases {
        p.add_row(vec![
            Cell::new(headroom::error::shown(
                &phase_label(&ph.name, ph.iteration),
                headroom::error::SHOWN_CHARS,
            )),
            right(gib(ph.peak_allocated)),
            right(gib(ph.peak_reserved)),
        ]);
    }
    out += &format!("{p}\n");
    for engine in &trace.engines {
        out += &format!(
            "rollout engine {}: {} of the {} while awake, outside the caching allocator\n",
            headroom::error::shown(&engine.name, headroom::error::SHOWN_CHARS),
            gib(est.gpu.share_bytes(engine.gpu_memory_utilization)),
            est.gpu.name
        );
    }
    if verdict {
        out += &format!(
            "\n{} ({} usable): {} — headroom {}\n",
            est.gpu.name,
            gib(est.gpu.total_bytes),
            if est.fits() { "fits" } else { "does NOT fit" },
            signed_gib(est.headroom_bytes())
        );
        if let Some(oom) = &est.oom {
            out += &format!(
                "PyTorch runs out at trace event {} ({}), allocating {} ({}) with {} allocated \
                 and {} reserved; the tables show what the run would need. Its message would \
                 read:\n  {}\n",
                oom.event,
                phase_label(&oom.phase, oom.iteration),
                oom.tensor,
                gib(oom.requested_bytes),
                gib(oom.allocated_bytes),
                gib(oom.reserved_bytes),
                oom.error
            );
        }
    }
    out
}

/// A trace phase as the tables name it: a pipeline's with its iteration.
fn phase_label(name: &str, iteration: Option<u32>) -> String {
    match iteration {
        Some(i) => format!("{name}, iteration {i}"),
        None => name.to_string(),
    }
}
