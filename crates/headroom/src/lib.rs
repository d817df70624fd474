//! headroom: a model of the GPU memory of LLM training and inference steps.
//!
//! The pieces, each in one place:
//! - [`arch`]: architectures and the parameter inventory;
//! - [`catalog`]: built-in models and how `model:` resolves;
//! - [`spec`]: the run and pipeline specs (the contract the CLI reads);
//! - [`sim`]: the simulator: every tensor a step allocates and frees, through the
//!   caching-allocator simulator (`headroom-alloc`), swept for the peak;
//! - [`estimate`]: a run spec, or a pipeline of several models in one process, on a GPU (at
//!   its capacity, or unlimited);
//! - [`validate`]: estimates against measured rows;
//! - [`trace`]: trace files of the real model code under fake tensors, replayed through the
//!   allocator simulator with the kernels' own buffers added;
//! - [`gpu`]: the GPU catalog;
//! - [`diagnose`] and [`plan`]: out-of-memory messages, config lint rules, remedies and `fit`;
//! - [`report`]: the typed JSON contract of every command;
//! - [`units`]: byte sizes as people read and write them;
//! - [`limits`]: the largest inputs accepted, and why each is safe.
//!
//! `docs/ARCHITECTURE.md` shows how they fit together.

pub mod arch;
pub mod catalog;
pub mod diagnose;
pub mod dtype;
pub mod error;
pub mod estimate;
pub mod gpu;
pub mod limits;
pub mod plan;
pub mod report;
pub mod sim;
pub mod spec;
pub mod trace;
pub mod units;
pub mod validate;

pub use error::{Error, Result};
