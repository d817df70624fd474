//! headroom: a model of the GPU memory of LLM training and inference steps.
//!
//! The pieces, each in one place:
//! - [`arch`]: architectures and the parameter inventory;
//! - [`catalog`]: built-in models and how `model:` resolves;
//! - [`spec`]: the run spec (the contract the CLI reads);
//! - [`timeline`]: every tensor a step allocates and frees, through the caching-allocator
//!   simulator (`headroom-alloc`), swept for the peak;
//! - [`estimate`]: a run spec on a GPU (at its capacity, or unlimited);
//! - [`pipeline`]: several models in one process (a policy and its reference);
//! - [`validate`]: estimates against measured rows;
//! - [`gpu`]: the GPU catalog;
//! - [`diagnose`] and [`plan`]: out-of-memory messages, config lints, remedies and `fit`.

pub mod arch;
pub mod catalog;
pub mod diagnose;
pub mod dtype;
pub mod error;
pub mod estimate;
pub mod gpu;
pub mod pipeline;
pub mod plan;
pub mod report;
pub mod spec;
pub mod timeline;
pub mod units;
pub mod validate;

pub use error::{Error, Result};
