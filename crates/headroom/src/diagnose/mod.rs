//! `headroom diagnose`: read an out-of-memory message and say why it happened, check the
//! launch configs that commonly cause one, and, given the run spec, check the message against
//! the estimate and rank remedies by what the estimator predicts they save.
//!
//! [`run`] puts the pieces together from what the user gave:
//! - [`oom_message`]: the message parser and the message-only explanation;
//! - [`lint`]: accelerate, DeepSpeed and `device_map` checks;
//! - [`remedies`]: single changes to the spec, with savings and costs.

pub mod lint;
pub mod oom_message;
pub mod remedies;

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::estimate::Estimate;
use crate::gpu::{self, Gpu};
use crate::plan::{self, Evaluation, Resident, Setup};
use crate::spec::RunSpec;
use crate::units::gib;

use lint::{Context, Launch, Lint};
use oom_message::{Explanation, OomMessage};
use remedies::Remedy;

/// A log, traceback or message that holds PyTorch's out-of-memory error.
#[derive(Clone, Debug)]
pub struct OomLog {
    /// Where it was read from, as the user named it (a path, or `stdin`).
    pub source: String,
    pub text: String,
}

/// What to diagnose; every part is optional.
#[derive(Clone, Debug, Default)]
pub struct Inputs {
    pub oom: Option<OomLog>,
    /// The run spec of the job: checks the message against the estimate and ranks remedies.
    pub spec: Option<PathBuf>,
    /// Where the spec's relative model paths resolve, when not its folder (a spec the Python
    /// bindings were given as text).
    pub spec_dir: Option<PathBuf>,
    /// Models that stay on the same GPU without being trained (`mode: forward` specs); they
    /// count only with `spec`.
    pub residents: Vec<PathBuf>,
    pub accelerate_config: Option<PathBuf>,
    /// The DeepSpeed JSON; by default the one the accelerate config names.
    pub deepspeed_config: Option<PathBuf>,
    /// Scripts or configs to check for `device_map="auto"`.
    pub scripts: Vec<PathBuf>,
    /// A GPU name or size; by default the one whose capacity the message reports.
    pub gpu: Option<String>,
    /// Data-parallel ranks; by default the accelerate config's `num_processes`.
    pub gpus: Option<u32>,
}

/// Everything `diagnose` found.
#[derive(Clone, Debug)]
pub struct Diagnosis {
    pub oom_source: Option<String>,
    /// The distinct messages of the log, in order; the first is the one explained.
    pub messages: Vec<OomMessage>,
    pub explanation: Option<Explanation>,
    /// Config problems, most severe first.
    pub lints: Vec<Lint>,
    /// The GPU the checks are against: named, read off the message, or the default.
    pub gpu: Option<Gpu>,
    pub check: Option<SpecCheck>,
    pub spec_path: Option<PathBuf>,
    /// How the accelerate config launches the spec, when the check follows it.
    pub launched_as: Option<String>,
}

/// A log's bytes as text: UTF-16 when it starts with a byte-order mark (PowerShell's `>`
/// writes UTF-16LE), UTF-8 otherwise, with every byte that is not UTF-8 read as U+FFFD, so a
/// stray byte of another encoding does not hide the message around it.
pub fn decode_log(bytes: &[u8]) -> String {
    let utf16 = |bytes: &[u8], unit: fn([u8; 2]) -> u16| {
        let units = bytes.chunks(2).map(|pair| match pair {
            [a, b] => unit([*a, *b]),
            _ => 0xfffd,
        });
        char::decode_utf16(units)
            .map(|c| c.unwrap_or(char::REPLACEMENT_CHARACTER))
            .collect()
    };
    match bytes {
        [0xff, 0xfe, rest @ ..] => utf16(rest, u16::from_le_bytes),
        [0xfe, 0xff, rest @ ..] => utf16(rest, u16::from_be_bytes),
        [0xef, 0xbb, 0xbf, rest @ ..] => String::from_utf8_lossy(rest).into_owned(),
        _ => String::from_utf8_lossy(bytes).into_owned(),
    }
}

/// `written` as the accelerate config at `path` launches it (`None` where the config leaves
/// the layout to the script, or the estimate cannot follow it), the launch in words, and the
/// lints that say what of it is not followed.
pub fn as_launched(
    written: &RunSpec,
    launch: &Launch,
    path: &Path,
) -> (Option<RunSpec>, Option<String>, Vec<Lint>) {
    let Some(layout) = &launch.layout else {
        return (None, None, Vec::new());
    };
    let source = path.display().to_string();
    match layout.apply(written) {
        Ok((launched, words)) => {
            let mut notes = Vec::new();
            if written.parallel.is_some() && written.parallel != launched.parallel {
                notes.push(lint::launch_not_applied(
                    &source,
                    format!(
                        "the spec's own `parallel` differs from the launch's; the check follows \
                         the launch: {words}"
                    ),
                ));
            }
            (Some(launched), Some(words), notes)
        }
        Err(why) => (
            None,
            None,
            vec![lint::launch_not_applied(
                &source,
                format!("the spec is checked as written, not as launched: {why}"),
            )],
        ),
    }
}

/// Read an accelerate config and apply it to `written` (see [`as_launched`]); its lints come
/// back too.
pub fn launch_with_accelerate(
    written: &RunSpec,
    path: &Path,
) -> Result<(Option<RunSpec>, Option<String>, Vec<Lint>)> {
    let text = read(path, "accelerate config")?;
    let cx = Context {
        spec: Some(written),
        ..Context::default()
    };
    let (launch, mut lints) = lint::accelerate(&text, path, cx)?;
    let (spec, words, notes) = as_launched(written, &launch, path);
    lints.extend(notes);
    Ok((spec, words, lints))
}

fn read(path: &Path, what: &str) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        message: format!("cannot read the {what}: {e}"),
    })
}

/// Diagnose what `inputs` holds. The accelerate config is read first: it says how many ranks
/// there are and may name the DeepSpeed JSON.
pub fn run(inputs: &Inputs) -> Result<Diagnosis> {
    let mut messages = Vec::new();
    if let Some(log) = &inputs.oom {
        messages = oom_message::parse_all(&log.text);
        if messages.is_empty() {
            return Err(Error::NoOomMessage {
                source: log.source.clone(),
                driver_error: log.text.contains("CUDA error: out of memory"),
            });
        }
    }
    let message = messages.first();
    let explanation = message.map(oom_message::explain);

    let spec = inputs
        .spec
        .as_ref()
        .map(|p| RunSpec::from_file(p))
        .transpose()?;
    let spec_dir = inputs
        .spec_dir
        .as_deref()
        .or(inputs.spec.as_deref().and_then(Path::parent));

    let gpu = match (&inputs.gpu, message.and_then(|m| m.total_capacity_bytes)) {
        (Some(name), _) => Some(gpu::find(name)?),
        (None, Some(total)) => Some(gpu_from_message(total)),
        (None, None) => spec.as_ref().map(|_| Gpu::default()),
    };

    let mut lints = Vec::new();
    let mut launch: Option<Launch> = None;
    let lint_cx = |arch| Context {
        spec: spec.as_ref(),
        arch,
        gpu: gpu.as_ref(),
    };
    if let Some(path) = &inputs.accelerate_config {
        let text = read(path, "accelerate config")?;
        let (l, found) = lint::accelerate(&text, path, lint_cx(None))?;
        lints.extend(found);
        launch = Some(l);
    }
    let mut launched_as = None;
    let mut launched_spec = None;
    if let (Some(written), Some(launch), Some(path)) =
        (spec.as_ref(), launch.as_ref(), &inputs.accelerate_config)
    {
        let (launched, words, notes) = as_launched(written, launch, path);
        lints.extend(notes);
        launched_spec = launched;
        launched_as = words;
    }
    let ranks = inputs.gpus.unwrap_or_else(|| {
        launch
            .as_ref()
            .filter(|l| l.is_distributed())
            .and_then(|l| l.processes)
            .and_then(|n| u32::try_from(n).ok())
            .or_else(|| spec.as_ref().map(RunSpec::world_size))
            .unwrap_or(1)
    });

    let checked = launched_spec.as_ref().or(spec.as_ref());
    let check = match (checked, &gpu) {
        (Some(spec), Some(gpu)) => {
            let mut residents = Vec::new();
            for path in &inputs.residents {
                let r = RunSpec::from_file(path)?;
                residents.push(Resident::from_spec(&r, path.parent(), gpu)?);
            }
            let setup = Setup {
                spec: spec.clone(),
                spec_dir,
                gpu: gpu.clone(),
                gpus: ranks.max(1),
                residents,
                launcher: if launched_as.is_some() {
                    plan::Launcher::Accelerate
                } else {
                    plan::Launcher::Script
                },
            };
            Some(check_spec(&setup, message)?)
        }
        _ => None,
    };

    let ds_path = inputs.deepspeed_config.clone().or_else(|| {
        let file = launch.as_ref()?.deepspeed_config_file.as_ref()?;
        let base = inputs
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
    if let Some(log) = &inputs.oom {
        lints.extend(lint::device_map(&log.source, &log.text, launch.as_ref()));
    }
    for path in &inputs.scripts {
        let text = read(path, "script")?;
        lints.extend(lint::device_map(
            &path.display().to_string(),
            &text,
            launch.as_ref(),
        ));
    }
    lints.sort_by_key(|l| l.severity);

    Ok(Diagnosis {
        oom_source: inputs.oom.as_ref().map(|log| log.source.clone()),
        messages,
        explanation,
        lints,
        gpu,
        check,
        spec_path: inputs.spec.clone(),
        launched_as,
    })
}

/// The GPU a message was printed on: the catalog entry whose capacity is nearest, carrying
/// the message's own total (what `cudaMemGetInfo` said on that machine, which varies with
/// the driver by a few hundred MiB).
pub fn gpu_from_message(total_bytes: u64) -> Gpu {
    let nearest = gpu::catalog()
        .into_iter()
        .min_by_key(|g| g.total_bytes.abs_diff(total_bytes));
    match nearest {
        Some(g) if g.total_bytes.abs_diff(total_bytes) * 50 <= g.total_bytes => Gpu {
            total_bytes,
            source: "total capacity from the OOM message; CUDA context as in the catalog",
            total_basis: gpu::Basis::OomMessage,
            ..g
        },
        _ => Gpu {
            name: "custom",
            total_bytes,
            source: "total capacity from the OOM message; CUDA context as measured on the H200",
            total_basis: gpu::Basis::OomMessage,
            context_basis: gpu::Basis::CarriedOver,
            ..Gpu::default()
        },
    }
}

/// The spec checked against a GPU (and against the message, when there is one).
#[derive(Clone, Debug)]
pub struct SpecCheck {
    pub estimate: Estimate,
    /// The spec with its residents, as planned on the GPU.
    pub baseline: Evaluation,
    /// Whether the spec fits, with the numbers.
    pub verdict: String,
    /// How the message's numbers compare with the estimate.
    pub agreement: Option<String>,
    pub remedies: Vec<Remedy>,
    /// The cheapest configuration of the search that fits, and its changes in words.
    pub cheapest_fit: Option<(Evaluation, Vec<String>)>,
}

/// Estimate `setup`, compare it with `message`, and rank remedies.
pub fn check_spec(setup: &Setup, message: Option<&OomMessage>) -> Result<SpecCheck> {
    let (estimate, baseline) = plan::baseline(setup)?;
    let residents: u64 = setup.residents.iter().map(|r| r.weights_bytes).sum();
    let mut parts = format!(
        "{} reserved at the peak (step {}, {}; {} allocated)",
        gib(estimate.peak_reserved_bytes),
        estimate.peak_step,
        estimate.peak_phase,
        gib(estimate.peak_allocated_bytes)
    );
    for r in &setup.residents {
        parts += &format!(
            " + {} of resident {} (its loaded weights, from a forward-mode estimate)",
            gib(r.weights_bytes),
            r.name
        );
    }
    if setup.gpus > 1 {
        let ddp = setup
            .spec
            .parallel
            .as_ref()
            .is_none_or(|p| p.strategy == crate::spec::Strategy::Ddp);
        parts += &format!(
            " + {}{} of NCCL buffers per rank",
            if ddp { "DDP gradient buckets and " } else { "" },
            gib(plan::nccl_bytes(setup, &plan::Knobs::of(&setup.spec)))
        );
    }
    parts += &format!(" + {} CUDA context", gib(estimate.cuda_context_bytes));
    let room = baseline.headroom_bytes(&setup.gpu);
    let verdict = if baseline.fits {
        format!(
            "The spec needs {} on the device ({parts}): it fits the {} GPU ({}) with {} to \
             spare.",
            gib(baseline.device_bytes),
            setup.gpu.name,
            gib(setup.gpu.total_bytes),
            gib(room.unsigned_abs() as u64)
        )
    } else {
        format!(
            "The spec needs {} on the device ({parts}): {} more than the {} GPU has ({}).",
            gib(baseline.device_bytes),
            gib(room.unsigned_abs() as u64),
            setup.gpu.name,
            gib(setup.gpu.total_bytes)
        )
    };
    let agreement = message.and_then(|m| agreement(m, &baseline, residents, setup));
    let all = plan::search(setup)?;
    let cheapest_fit = plan::cheapest_fit(setup, &all).map(|e| {
        let changes = plan::describe(setup, &e.knobs);
        (e.clone(), changes)
    });
    Ok(SpecCheck {
        remedies: remedies::remedies(setup)?,
        estimate,
        baseline,
        verdict,
        agreement,
        cheapest_fit,
    })
}

/// Compare what PyTorch held when it failed with what the estimate says the run needs.
fn agreement(
    m: &OomMessage,
    baseline: &Evaluation,
    residents: u64,
    setup: &Setup,
) -> Option<String> {
    let allocated = m.allocated_by_pytorch_bytes?;
    let request = m.tried_to_allocate_bytes?;
    let needed = allocated + request;
    let peak = baseline.peak_allocated_bytes;
    let with = if residents > 0 {
        " (residents included)"
    } else {
        ""
    };
    Some(if needed <= peak {
        let outcome = if baseline.fits {
            "yet the estimate says the whole step fits: something outside the spec took the \
             rest (see other processes and non-PyTorch memory above)"
        } else {
            "the estimate agrees that the step does not fit"
        };
        format!(
            "At the failure PyTorch held {} and asked for {} more ({} in all), within the {} the \
             estimate allocates at the peak{with}; {outcome}.",
            gib(allocated),
            gib(request),
            gib(needed),
            gib(peak)
        )
    } else {
        format!(
            "At the failure PyTorch held {} and asked for {} more: {} beyond the {} the estimate \
             allocates at the peak{with}. The GPU holds more than the spec describes: another \
             model, a larger batch or longer sequences than the spec's {} × {}, or tensors kept \
             across steps (losses or logits not detached).",
            gib(allocated),
            gib(request),
            gib(needed - peak),
            gib(peak),
            setup.spec.batch_size,
            setup.spec.seq_len
        )
    })
}
