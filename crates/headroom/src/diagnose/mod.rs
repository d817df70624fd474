//! `headroom diagnose`: read an out-of-memory message and say why it happened, check the
//! launch configs that commonly cause one, and, given the run spec, check the message against
//! the estimate and rank remedies by what the estimator predicts they save.
//!
//! - [`oom`]: the message parser and the message-only explanation;
//! - [`lint`]: accelerate, DeepSpeed and `device_map` checks;
//! - [`remedies`]: single changes to the spec, with savings and costs.

pub mod lint;
pub mod oom;
pub mod remedies;

use crate::error::Result;
use crate::estimate::Estimate;
use crate::gpu::{self, Gpu};
use crate::plan::{self, Evaluation, Setup};
use crate::units::gib;

use oom::OomMessage;
use remedies::Remedy;

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
            ..g
        },
        _ => Gpu {
            name: "custom",
            total_bytes,
            cuda_context_bytes: Gpu::default().cuda_context_bytes,
            source: "total capacity from the OOM message; CUDA context as measured on the H200",
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
        parts += &format!(
            " + DDP gradient buckets and {} of NCCL buffers per rank",
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
