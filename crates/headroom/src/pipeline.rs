//! Pipelines under one path, for callers that treat a pipeline as one thing: its spec lives in
//! [`crate::spec`], its estimate in [`crate::estimate`].

pub use crate::estimate::{
    EngineSummary, PAGEABLE_COPY_BYTES_PER_S, PipelineEstimate, estimate_pipeline,
};
pub use crate::spec::{EngineSpec, InstanceSpec, PipelineSpec, is_pipeline};
