//! What a process does with its models: [`instance`] builds one model as the harness does
//! (weights, adapters, checkpointing, the parallel strategy, the optimizer) and runs its
//! passes; [`run`] runs the measured steps of a single run, [`trainer`] those of a run under
//! transformers' `Trainer` or a TRL trainer, [`stages`] those of a pipeline-parallel rank,
//! [`megatron`] those of a Megatron-core run; [`pipeline`] runs several instances in one
//! process, phase by phase.

pub mod instance;
pub(crate) mod megatron;
pub(crate) mod megatron_stages;
pub mod pipeline;
pub mod run;
pub mod simulation;
pub(crate) mod stages;
pub(crate) mod trainer;
