//! The step timeline: every tensor a training or forward step allocates and frees, in the
//! order PyTorch does it, driven through the caching-allocator simulator and swept for the
//! peak.

mod attention;
mod backward;
pub mod component;
mod ddp;
mod fsdp;
pub mod instance;
pub mod memory;
mod ops;
mod optim;
pub mod pipeline;
mod quant;
pub mod step;
mod tracer;
mod transformer;
mod zero;
mod zero3;

pub use component::Component;
pub use memory::{PeakRecord, SimulatedOom, TraceEvent};
pub use step::{PhasePeak, STEPS, Simulation, simulate, simulate_to_first_oom};
