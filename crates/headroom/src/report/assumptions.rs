//! The `assumptions` object of every report an estimate feeds (`estimate`, `fit`,
//! `diagnose --spec`, `measure`): the library versions the estimate follows, the GPU's constants
//! with how each is known and where it comes from, and a warning for each part of the estimate
//! that was not measured for this run.

use serde::Serialize;

use crate::estimate::Assumptions;
use crate::gpu::{Constant, Gpu};
use crate::spec::Library;

#[derive(Debug, Serialize)]
pub struct AssumptionsJson<'a> {
    pub versions: VersionsJson,
    pub gpu: GpuJson<'a>,
    /// Sentences, one per assumption that does not hold for this run as measured; empty on an
    /// H100 or H200 with the modelled versions.
    pub warnings: &'a [String],
}

/// Per library, the release the estimate follows and the one the spec gives.
#[derive(Debug, Serialize)]
pub struct VersionsJson {
    pub torch: VersionJson,
    pub transformers: VersionJson,
    pub peft: VersionJson,
    pub bitsandbytes: VersionJson,
    pub deepspeed: VersionJson,
    pub trl: VersionJson,
}

#[derive(Debug, Serialize)]
pub struct VersionJson {
    /// The release the simulator translates (`2.11.0`).
    pub followed: Option<String>,
    /// What the spec's `versions:` gives (`4.57`); null when it gives none.
    pub given: Option<String>,
}

/// The GPU the estimate ran on and the constants it took from it.
#[derive(Debug, Serialize)]
pub struct GpuJson<'a> {
    pub name: &'a str,
    /// `volta`, `ampere`, `ada`, `hopper` or `cdna3`: it sets the workspaces and the
    /// attention kernels.
    pub architecture: &'static str,
    /// What `cudaMemGetInfo` reports as total.
    pub total: ConstantJson,
    /// What a process holds outside the caching allocator.
    pub cuda_context: ConstantJson,
    /// The cuBLAS workspace, once per thread that runs GEMMs.
    pub cublas_workspace: ConstantJson,
    /// The cuBLASLt workspace, once per thread that runs `addmm` with a bias.
    pub cublaslt_workspace: ConstantJson,
}

#[derive(Debug, Serialize)]
pub struct ConstantJson {
    pub bytes: u64,
    /// `measured`, `oom_message`, `pytorch_source`, `carried_over` or `given`.
    pub basis: &'static str,
    /// Where it comes from, in words (the GPU and versions it was measured on, the report or
    /// the source file).
    pub source: String,
}

impl<'a> AssumptionsJson<'a> {
    /// `gpu`: the GPU the report judges against (its constants are the estimate's).
    pub fn new(a: &'a Assumptions, gpu: &'a Gpu) -> Self {
        let version = |library: Library| VersionJson {
            followed: a.given.followed(library).map(|v| v.to_string()),
            given: a.given.given(library).map(|v| v.to_string()),
        };
        let [total, cuda_context, cublas_workspace, cublaslt_workspace] =
            gpu.constants().map(ConstantJson::new);
        Self {
            versions: VersionsJson {
                torch: version(Library::Torch),
                transformers: version(Library::Transformers),
                peft: version(Library::Peft),
                bitsandbytes: version(Library::Bitsandbytes),
                deepspeed: version(Library::Deepspeed),
                trl: version(Library::Trl),
            },
            gpu: GpuJson {
                name: gpu.name,
                architecture: gpu.arch.key(),
                total,
                cuda_context,
                cublas_workspace,
                cublaslt_workspace,
            },
            warnings: &a.warnings,
        }
    }
}

impl ConstantJson {
    fn new(c: Constant) -> Self {
        Self {
            bytes: c.bytes,
            basis: c.basis.key(),
            source: c.source,
        }
    }
}
