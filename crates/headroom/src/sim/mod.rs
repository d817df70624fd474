//! The simulator: every tensor a training or forward step allocates and frees, in the order
//! PyTorch does it, driven through the caching-allocator simulator and swept for the peak.
//!
//! - [`engine`]: eager PyTorch as the model code sees it: tensors with reference counts, the
//!   autograd graph and its backward engine, the kernels' allocations, and the device memory
//!   behind them (the caching allocator, what each byte is for, the peak);
//! - [`model`]: the HF models translated line by line into engine ops (decoder, attention,
//!   heads and losses, 4-bit loading);
//! - [`optim`]: the optimizers' states and their step;
//! - [`strategy`]: how the parameters, gradients and optimizer states are spread over ranks
//!   (DDP, FSDP2, DeepSpeed ZeRO), one slot on the model whose hooks the model code calls;
//! - [`harness`]: what a process does with models: build them, run the measured steps or a
//!   pipeline's phases;
//! - [`memo`]: taking a step from the one before it when it provably repeats it;
//! - [`cores`]: independent simulations (layouts, ranks) spread over the cores.

pub(crate) mod cores;
pub(crate) mod engine;
pub mod harness;
mod memo;
pub(crate) mod model;
pub(crate) mod optim;
pub(crate) mod strategy;

pub use engine::component::Component;
pub use engine::memory::{
    PeakRecord, PhasePeak, PhaseStart, RecordedTimeline, Sample, SimulatedEvent, SimulatedOom,
};
pub use harness::run::simulate;
pub use harness::simulation::{AfterOom, Options, STEPS, Simulation, StagePeak};
