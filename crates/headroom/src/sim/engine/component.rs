//! What each byte on the GPU is for: every allocation of the step timeline carries one of these,
//! and the breakdown at the peak sums them.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Component {
    /// Model parameters (LoRA adapters included), quantized weights and their statistics.
    Weights,
    /// `.grad` of trainable parameters.
    Gradients,
    /// Optimizer state (Adam moments, momentum buffers, Adafactor factors, 8-bit states).
    OptimizerStates,
    /// Tensors that live only inside `optimizer.step()`.
    OptimizerTemporaries,
    /// Tensors autograd saves for backward, forward temporaries, and gradients of activations.
    Activations,
    /// Logits, their fp32 copy, log-probabilities, and their gradients.
    LogitsAndLoss,
    /// Low-precision copies of fp32 weights made by autocast.
    AutocastCopies,
    /// LoRA's per-module input copies and dropout masks; dequantized 4-bit weights.
    LoraQuantExtras,
    /// cuBLAS workspaces and other library buffers the caching allocator serves.
    Workspaces,
    /// Input ids and labels.
    Inputs,
    /// Buffers of collectives: FSDP's all-gather and reduce-scatter buffers, DDP's gradient
    /// buckets and broadcast buffers.
    Communication,
    /// Bytes of blocks beyond what was requested: the allocator's 512-byte rounding and the
    /// unsplit remainders of large blocks.
    AllocatorRounding,
}

impl Component {
    pub const ALL: [Component; 12] = [
        Component::Weights,
        Component::Gradients,
        Component::OptimizerStates,
        Component::OptimizerTemporaries,
        Component::Activations,
        Component::LogitsAndLoss,
        Component::AutocastCopies,
        Component::LoraQuantExtras,
        Component::Workspaces,
        Component::Inputs,
        Component::Communication,
        Component::AllocatorRounding,
    ];

    pub const COUNT: usize = Self::ALL.len();

    pub fn index(self) -> usize {
        self as usize
    }

    /// Stable machine name (the `component` of `--json`).
    pub fn key(self) -> &'static str {
        match self {
            Component::Weights => "weights",
            Component::Gradients => "gradients",
            Component::OptimizerStates => "optimizer_states",
            Component::OptimizerTemporaries => "optimizer_step_temporaries",
            Component::Activations => "activations",
            Component::LogitsAndLoss => "logits_and_loss",
            Component::AutocastCopies => "autocast_weight_copies",
            Component::LoraQuantExtras => "lora_quantization_extras",
            Component::Workspaces => "cuda_library_workspaces",
            Component::Inputs => "inputs",
            Component::Communication => "communication_buffers",
            Component::AllocatorRounding => "allocator_rounding",
        }
    }
}

impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Component::Weights => "weights",
            Component::Gradients => "gradients",
            Component::OptimizerStates => "optimizer states",
            Component::OptimizerTemporaries => "optimizer-step temporaries",
            Component::Activations => "activations",
            Component::LogitsAndLoss => "logits and loss",
            Component::AutocastCopies => "autocast weight copies",
            Component::LoraQuantExtras => "LoRA / quantization extras",
            Component::Workspaces => "cuBLAS workspaces",
            Component::Inputs => "input ids",
            Component::Communication => "communication buffers",
            Component::AllocatorRounding => "allocator rounding",
        })
    }
}
