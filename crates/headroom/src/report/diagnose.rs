//! `headroom diagnose --json`: the out-of-memory message read, its diagnosis, the config
//! problems, and, with a spec, the estimate and the remedies.
//!
//! The object is flat where it can be: the first message's fields sit at the top level, so
//! that `jq .allocated_by_pytorch_bytes` reads what PyTorch printed.

use serde::Serialize;

use super::ComponentBytes;
use super::assumptions::AssumptionsJson;
use crate::diagnose::oom_message::{Accounting, Explanation, OomMessage, ProcessMemory};
use crate::diagnose::{Diagnosis, SpecCheck};
use crate::gpu::Gpu;

#[derive(Debug, Serialize)]
pub struct DiagnoseJson<'a> {
    /// The first message's fields; absent without `--oom`.
    #[serde(flatten)]
    pub message: Option<MessageJson<'a>>,
    /// Absent without `--oom`.
    #[serde(flatten)]
    pub log: Option<LogJson<'a>>,
    /// What the first message means; absent without `--oom`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diagnosis: Option<DiagnosisJson<'a>>,
    /// Config problems, errors first.
    pub lints: Vec<LintJson<'a>>,
    /// The GPU checked against: `--gpu`, the one whose capacity the message reports, or the
    /// default for a spec; absent when there is none of them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<&'a Gpu>,
    /// How the accelerate config launches the spec, when the estimate follows the launch
    /// (its data parallelism and precision); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub launched_as: Option<&'a str>,
    /// The spec's estimate and remedies; absent without `--spec`.
    #[serde(flatten)]
    pub check: Option<CheckJson<'a>>,
}

/// What one out-of-memory message says. Sizes are what PyTorch printed, in bytes; null where
/// the message's format does not print them.
#[derive(Debug, Serialize)]
pub struct MessageJson<'a> {
    /// `CUDA` or `HIP`.
    pub backend: String,
    /// Which of PyTorch's templates: `cached`, `reserved_in_total`, `sentences`, ...
    pub format: &'static str,
    /// The PyTorch releases that print this template.
    pub torch_versions: &'static str,
    pub device: Option<u32>,
    /// The segment the allocator asked the driver for, not the tensor's size.
    pub tried_to_allocate_bytes: Option<u64>,
    pub total_capacity_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
    pub allocated_by_pytorch_bytes: Option<u64>,
    pub reserved_unallocated_bytes: Option<u64>,
    pub reserved_by_pytorch_bytes: Option<u64>,
    /// `set_per_process_memory_fraction`'s cap.
    pub allowed_bytes: Option<u64>,
    pub private_pools_bytes: Option<u64>,
    /// NVML's per-process usage, in its order.
    pub processes: &'a [ProcessMemory],
}

/// The log the messages came from.
#[derive(Debug, Serialize)]
pub struct LogJson<'a> {
    /// The path given, or `stdin`.
    pub oom_source: &'a str,
    /// Distinct messages in the log.
    pub messages_found: usize,
    /// The messages after the first.
    pub other_messages: Vec<MessageJson<'a>>,
}

#[derive(Debug, Serialize)]
pub struct DiagnosisJson<'a> {
    /// The primary cause: `shortage`, `fragmentation`, `other_processes`, ...
    pub cause: &'static str,
    pub summary: &'a str,
    /// What else the message shows.
    pub findings: Vec<FindingJson<'a>>,
    /// Where the device's memory was; null when the message lacks the numbers.
    pub accounting: Option<AccountingJson>,
}

#[derive(Debug, Serialize)]
pub struct FindingJson<'a> {
    pub cause: &'static str,
    pub text: &'a str,
}

#[derive(Debug, Serialize)]
pub struct AccountingJson {
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub allocated_bytes: u64,
    pub reserved_unallocated_bytes: u64,
    /// This process outside the caching allocator; null without NVML's clause.
    pub this_process_non_pytorch_bytes: Option<u64>,
    /// Null when the message has no NVML clauses.
    pub other_processes_bytes: Option<u64>,
    /// What the message does not attribute.
    pub unattributed_bytes: u64,
    /// A `Process N` clause taken for this process (inside a container's PID namespace).
    pub presumed_self_pid: Option<u64>,
}

#[derive(Debug, Serialize)]
pub struct LintJson<'a> {
    /// The id of the rule that found it (`HR112`); `headroom rules ID` explains it.
    pub rule: &'static str,
    /// `error`, `warning` or `info`.
    pub severity: &'static str,
    /// The file it is in.
    pub source: &'a str,
    /// The key or line it is about.
    pub key: &'a str,
    pub message: &'a str,
    pub fix: &'a str,
}

/// The spec checked against the GPU.
#[derive(Debug, Serialize)]
pub struct CheckJson<'a> {
    pub estimate: SpecEstimateJson<'a>,
    /// Single changes to the spec, those that fit first.
    pub remedies: Vec<RemedyJson<'a>>,
    /// The cheapest configuration of the search that fits; null when none does.
    pub cheapest_fit: Option<CheapestFitJson<'a>>,
    /// The estimate's versions, the GPU's constants and warnings.
    pub assumptions: AssumptionsJson<'a>,
}

#[derive(Debug, Serialize)]
pub struct SpecEstimateJson<'a> {
    pub model: &'a str,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// Reserved, CUDA context and NCCL, residents included.
    pub device_bytes: u64,
    pub fits: bool,
    /// Residents or ranks are added from their own estimates, not simulated together.
    pub computed: bool,
    pub peak_phase: &'a str,
    pub peak_step: u32,
    pub breakdown: Vec<ComponentBytes>,
    /// Whether the spec fits, in a sentence with the numbers.
    pub verdict: &'a str,
    /// How the message's numbers compare with the estimate; null without a message.
    pub agreement: Option<&'a str>,
}

#[derive(Debug, Serialize)]
pub struct RemedyJson<'a> {
    /// Stable machine name.
    pub key: &'static str,
    pub title: &'a str,
    /// What to change, in the user's tools.
    pub how: &'a str,
    /// What it costs: compute, speed, or what is trained.
    pub cost: &'a str,
    /// `simulated` or `computed from the breakdown`.
    pub basis: &'static str,
    pub device_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// Device bytes saved against the spec; negative: it needs more.
    pub saving_bytes: i128,
    pub fits: bool,
    /// Step time relative to the spec's.
    pub slowdown: f64,
    pub fidelity: &'static str,
    /// It changes the data the model sees, not only how it is trained.
    pub changes_data: bool,
}

#[derive(Debug, Serialize)]
pub struct CheapestFitJson<'a> {
    /// The changes from the spec, in words.
    pub changes: &'a [String],
    pub device_bytes: u64,
    pub slowdown: f64,
    pub fidelity: &'static str,
    pub computed: bool,
}

impl<'a> DiagnoseJson<'a> {
    pub fn new(d: &'a Diagnosis) -> Self {
        Self {
            message: d.messages.first().map(MessageJson::new),
            log: d.oom_source.as_deref().map(|source| LogJson {
                oom_source: source,
                messages_found: d.messages.len(),
                other_messages: d.messages.iter().skip(1).map(MessageJson::new).collect(),
            }),
            diagnosis: d.explanation.as_ref().map(DiagnosisJson::new),
            lints: d
                .lints
                .iter()
                .map(|l| LintJson {
                    rule: l.rule.id(),
                    severity: l.severity.key(),
                    source: &l.source,
                    key: &l.key,
                    message: &l.message,
                    fix: &l.fix,
                })
                .collect(),
            gpu: d.gpu.as_ref(),
            launched_as: d.launched_as.as_deref(),
            check: d.check.as_ref().map(CheckJson::new),
        }
    }
}

impl<'a> MessageJson<'a> {
    pub fn new(m: &'a OomMessage) -> Self {
        Self {
            backend: m.backend.to_string(),
            format: m.format.key(),
            torch_versions: m.torch_versions,
            device: m.device,
            tried_to_allocate_bytes: m.tried_to_allocate_bytes,
            total_capacity_bytes: m.total_capacity_bytes,
            free_bytes: m.free_bytes,
            allocated_by_pytorch_bytes: m.allocated_by_pytorch_bytes,
            reserved_unallocated_bytes: m.reserved_unallocated_bytes,
            reserved_by_pytorch_bytes: m.reserved_by_pytorch_bytes,
            allowed_bytes: m.allowed_bytes,
            private_pools_bytes: m.private_pools_bytes,
            processes: &m.processes,
        }
    }
}

impl<'a> DiagnosisJson<'a> {
    fn new(e: &'a Explanation) -> Self {
        Self {
            cause: e.cause.key(),
            summary: &e.summary,
            findings: e
                .findings
                .iter()
                .map(|f| FindingJson {
                    cause: f.cause.key(),
                    text: &f.text,
                })
                .collect(),
            accounting: e.accounting.as_ref().map(AccountingJson::new),
        }
    }
}

impl AccountingJson {
    fn new(a: &Accounting) -> Self {
        Self {
            total_bytes: a.total,
            free_bytes: a.free,
            allocated_bytes: a.allocated,
            reserved_unallocated_bytes: a.reserved_unallocated,
            this_process_non_pytorch_bytes: a.this_process_non_pytorch,
            other_processes_bytes: a.other_processes,
            unattributed_bytes: a.unattributed,
            presumed_self_pid: a.presumed_self_pid,
        }
    }
}

impl<'a> CheckJson<'a> {
    fn new(c: &'a SpecCheck) -> Self {
        let b = &c.baseline;
        Self {
            estimate: SpecEstimateJson {
                model: &c.estimate.model,
                peak_allocated_bytes: b.peak_allocated_bytes,
                peak_reserved_bytes: b.peak_reserved_bytes,
                device_bytes: b.device_bytes,
                fits: b.fits,
                computed: b.computed,
                peak_phase: c.estimate.peak_phase,
                peak_step: c.estimate.peak_step,
                breakdown: ComponentBytes::list(&c.estimate.breakdown),
                verdict: &c.verdict,
                agreement: c.agreement.as_deref(),
            },
            remedies: c
                .remedies
                .iter()
                .map(|r| {
                    let e = &r.evaluation;
                    RemedyJson {
                        key: r.key,
                        title: &r.title,
                        how: &r.how,
                        cost: &r.cost,
                        basis: r.basis.key(),
                        device_bytes: e.device_bytes,
                        peak_allocated_bytes: e.peak_allocated_bytes,
                        peak_reserved_bytes: e.peak_reserved_bytes,
                        saving_bytes: r.saving_bytes,
                        fits: e.fits,
                        slowdown: e.slowdown,
                        fidelity: e.fidelity.key(),
                        changes_data: r.changes_data,
                    }
                })
                .collect(),
            cheapest_fit: c.cheapest_fit.as_ref().map(|(e, changes)| CheapestFitJson {
                changes,
                device_bytes: e.device_bytes,
                slowdown: e.slowdown,
                fidelity: e.fidelity.key(),
                computed: e.computed,
            }),
            assumptions: AssumptionsJson::new(&c.estimate.assumptions, &c.estimate.gpu),
        }
    }
}
