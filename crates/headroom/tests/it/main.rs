//! The integration tests of the `headroom` library, one binary (one link, one run) with a
//! module per area. Measured rows are read from bench/ (paths relative to each module's file);
//! what several modules share is in `common`.

mod arbitrary_specs;
mod assumptions;
mod catalog;
mod common;
mod context_parallel;
mod diagnose_seeds;
mod distributed;
mod expert_parallel;
mod fit;
mod layering;
mod layouts;
mod lint;
mod megatron;
mod megatron_moe;
mod megatron_pp;
mod megatron_pp_vpp;
mod megatron_sp;
mod nccl;
mod oom_messages;
mod oom_pastes;
mod params;
mod pipeline;
mod pipeline_fsdp;
mod pipeline_parallel;
mod tensor_parallel;
mod timeline;
mod totality;
mod tp_plan;
