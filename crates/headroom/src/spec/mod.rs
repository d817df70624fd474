//! The specs headroom reads, YAML or JSON, each checked in full before anything is estimated:
//!
//! - `run`: one training or inference run ([`RunSpec`]), the contract with users and the
//!   measuring harness;
//! - `pipeline`: several runs in one process and the phases of an iteration ([`PipelineSpec`]);
//! - `parse`: text into a document, and the field readers both share, so a bad value is
//!   reported alike wherever it sits (within [`crate::limits`]);
//! - `versions`: the library versions a run or a pipeline says it uses.
//!
//! [`load`] reads a file and tells the two apart.

mod expert_parallel;
mod megatron;
mod megatron_pipeline;
mod parallel_keys;
mod parse;
mod pipeline;
mod pipeline_parallel;
mod run;
mod tp_plan;
mod trainer;
mod versions;

use std::path::Path;

pub use megatron::{Megatron, Modules, Recompute, RecomputeMethod};
pub use parse::parse_document;
pub use pipeline::{
    EngineSpec, Home, InstanceSpec, Pass, PassDef, PhaseDef, PipelineSpec, is_pipeline,
};
pub use pipeline_parallel::{PipelineParallel, PipelineSchedule};
pub use run::{
    AllocatorSpec, Attention, BackwardPrefetch, BuiltLora, ExpertsImpl, Framework, Fsdp1Options,
    FsdpUnits, Lora, LoraTargets, MixedPrecision, Mode, Optimizer, Parallel, Precision,
    Quantization, RunSpec, Strategy, Task, TensorParallel, lora_targets_module,
};
pub(crate) use run::{
    check_context_parallel, check_pipeline_layout, check_pipeline_parallel, check_tensor_parallel,
};
pub use trainer::{
    Colocated, DpoSpec, GrpoSpec, ReferencePrecision, TrainerKind, TrainerSpec, Vllm,
};
pub use versions::{
    Library, TRANSFORMERS_4_46, TRANSFORMERS_4_48, TRANSFORMERS_4_51, TRANSFORMERS_4_53,
    TRANSFORMERS_4_55, TRANSFORMERS_4_56, TRANSFORMERS_4_57, Version, Versions,
};

use crate::error::Result;

/// A spec file's content: one run, or a pipeline of several.
#[derive(Clone, Debug, PartialEq)]
pub enum Document {
    Run(Box<RunSpec>),
    Pipeline(PipelineSpec),
}

/// Read, parse and check the spec at `path`, a run or a pipeline (see [`is_pipeline`]).
/// Relative model paths inside it resolve against `path.parent()`: pass that as `spec_dir`.
pub fn load(path: &Path) -> Result<Document> {
    document(&parse::read_document(path)?)
}

/// Parse and check spec text (a pasted spec; `name` stands for its file in syntax errors),
/// within [`crate::limits::MAX_FILE_BYTES`] as a file is.
pub fn from_text(text: &str, name: &Path) -> Result<Document> {
    if text.len() as u64 > crate::limits::MAX_FILE_BYTES {
        return Err(crate::error::Error::Field {
            field: "spec".into(),
            value: format!("{} bytes", text.len()),
            allowed: format!("at most {} bytes", crate::limits::MAX_FILE_BYTES),
        });
    }
    document(&parse_document(text, name)?)
}

fn document(doc: &serde_json::Value) -> Result<Document> {
    if is_pipeline(doc) {
        PipelineSpec::from_value(doc).map(Document::Pipeline)
    } else {
        RunSpec::from_value(doc).map(|s| Document::Run(Box::new(s)))
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::error::Error;

    fn example(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples")
            .join(name)
    }

    #[test]
    fn load_tells_runs_from_pipelines() {
        let run = load(&example("llama-3.1-8b-full.yaml")).expect("run spec");
        assert!(matches!(run, Document::Run(s) if s.model == "meta-llama/Llama-3.1-8B"));
        let pipeline = load(&example("grpo-vllm-colocated.yaml")).expect("pipeline");
        assert!(matches!(pipeline, Document::Pipeline(p) if p.instances.len() > 1));
        let two_model = load(&example("seed001-ref-resident.yaml")).expect("policy form");
        assert!(matches!(two_model, Document::Pipeline(p) if p.instances[0].name == "policy"));
    }

    #[test]
    fn load_names_the_file_it_cannot_read() {
        let missing = example("no-such-spec.yaml");
        match load(&missing) {
            Err(Error::Io { path, .. }) => assert_eq!(path, missing),
            other => panic!("expected an I/O error, got {other:?}"),
        }
    }
}
