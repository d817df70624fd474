//! What an estimate takes for granted, so that every report can say it: the library versions
//! the simulator translates, the GPU's constants and how each is known (`Gpu::constants`), and
//! a warning for each part of the estimate that was not measured for this run: a library
//! version the spec gives that is not the modelled one, a GPU whose context and kernels are
//! carried over from Hopper, a rollout engine whose share is vLLM's contract.

use crate::arch::{Architecture, Family};
use crate::gpu::{Gpu, GpuArch};
use crate::spec::{
    Attention, ExpertsImpl, Library, Optimizer, PipelineSpec, Quantization, RunSpec, Version,
    Versions,
};

/// An estimate's assumptions beyond the GPU's constants (those are `Gpu::constants`).
#[derive(Clone, Debug, PartialEq)]
pub struct Assumptions {
    /// The versions the spec gives; for a pipeline, each instance's over the pipeline's, the
    /// first instance that gives a library winning.
    pub given: Versions,
    /// One sentence per assumption that does not hold for this run as measured.
    pub warnings: Vec<String>,
}

/// What a run uses, as far as its assumptions go.
#[derive(Default)]
struct Uses {
    /// A TRL trainer runs the step.
    trl: bool,
    /// transformers' `Trainer` runs it.
    trainer_hf: bool,
    /// A trainer (not the harness's loop) runs under DDP.
    trainer_under_ddp: bool,
    /// GRPO generates with vLLM on this GPU.
    vllm_colocated: bool,
    /// FSDP1 over several ranks.
    fsdp1: bool,
    tensor_parallel: bool,
    pipeline_parallel: bool,
    /// FSDP2 within a pipeline's stages.
    pipeline_sharded: bool,
    context_parallel: bool,
    /// Megatron-core's GPTModel, DDP and optimizer (`parallel.framework: megatron`).
    megatron: bool,
    /// Megatron-core's pipeline schedule (framework megatron with pp > 1).
    megatron_pipeline: bool,
    /// Megatron-core's sequence parallelism (framework megatron with `sequence_parallel`).
    megatron_sequence_parallel: bool,
    peft: bool,
    bitsandbytes: bool,
    deepspeed: bool,
    sdpa: bool,
}

impl Uses {
    fn add(&mut self, spec: &RunSpec) {
        self.trl |= spec.trainer.kind.is_trl();
        self.trainer_hf |= spec.trainer.kind == crate::spec::TrainerKind::Hf;
        self.trainer_under_ddp |=
            spec.trainer.kind != crate::spec::TrainerKind::Loop && spec.parallel.is_some();
        self.vllm_colocated |= spec
            .trainer
            .grpo
            .as_ref()
            .and_then(|g| g.vllm.as_ref())
            .is_some_and(|v| v.colocate.is_some());
        self.peft |= spec.lora.is_some();
        self.bitsandbytes |=
            spec.quantization == Some(Quantization::Nf4) || spec.optimizer == Optimizer::AdamW8bit;
        self.deepspeed |= spec
            .parallel
            .as_ref()
            .is_some_and(|p| p.strategy.is_deepspeed());
        self.sdpa |= spec.attention == Attention::Sdpa;
        self.fsdp1 |= spec
            .parallel
            .as_ref()
            .is_some_and(|p| p.strategy == crate::spec::Strategy::Fsdp1);
        let framework = spec.parallel.as_ref().map(|p| p.tensor.framework);
        self.megatron |= framework == Some(crate::spec::Framework::Megatron);
        self.tensor_parallel |= framework == Some(crate::spec::Framework::Torchtitan)
            && spec.parallel.as_ref().is_some_and(|p| p.tensor.tp > 1);
        let pipelined = spec.parallel.as_ref().is_some_and(|p| p.pipeline.pp > 1);
        let megatron = framework == Some(crate::spec::Framework::Megatron);
        self.pipeline_parallel |= pipelined && !megatron;
        self.megatron_pipeline |= pipelined && megatron;
        self.megatron_sequence_parallel |= megatron
            && spec
                .parallel
                .as_ref()
                .is_some_and(|p| p.tensor.sequence_parallel);
        self.pipeline_sharded |= spec.parallel.as_ref().is_some_and(|p| {
            p.pipeline.pp > 1 && p.strategy == crate::spec::Strategy::Fsdp && p.shard_size > 1
        });
        self.context_parallel |= spec.parallel.as_ref().is_some_and(|p| p.tensor.cp > 1);
    }

    /// Whether the estimate depends on `library`'s version. A TRL version given always counts:
    /// without a TRL trainer in the spec, it says the spec does not describe the run.
    fn depends_on(&self, library: Library) -> bool {
        match library {
            Library::Torch | Library::Transformers | Library::Trl => true,
            Library::Peft => self.peft,
            Library::Bitsandbytes => self.bitsandbytes,
            Library::Deepspeed => self.deepspeed,
        }
    }
}

impl Assumptions {
    /// The assumptions of `spec` estimated on `gpu`.
    pub fn run(spec: &RunSpec, gpu: &Gpu) -> Self {
        let mut uses = Uses::default();
        uses.add(spec);
        Self::new(std::slice::from_ref(&spec.versions), &uses, gpu, &[])
    }

    /// The assumptions of a pipeline on `gpu`: each instance's versions over the pipeline's,
    /// and what its rollout engines assume.
    pub fn pipeline(spec: &PipelineSpec, gpu: &Gpu) -> Self {
        let mut uses = Uses::default();
        let mut versions = Vec::new();
        for i in &spec.instances {
            uses.add(&i.spec);
            versions.push(i.spec.versions.or(&spec.versions));
        }
        let engines: Vec<&str> = spec
            .instances
            .iter()
            .filter(|i| i.engine.is_some())
            .map(|i| i.name.as_str())
            .collect();
        Self::new(&versions, &uses, gpu, &engines)
    }

    /// From the versions of each model in the process (one warning per distinct version).
    fn new(versions: &[Versions], uses: &Uses, gpu: &Gpu, engines: &[&str]) -> Self {
        let mut warnings: Vec<String> = Vec::new();
        let given = versions
            .iter()
            .fold(Versions::default(), |given, v| given.or(v));
        let stated = versions.iter().flat_map(|v| {
            Library::ALL
                .into_iter()
                .filter_map(|l| v.given(l).map(|version| (l, version)))
        });
        for (library, version) in stated {
            if !uses.depends_on(library) {
                continue;
            }
            let warning = match library.followed(Some(version)) {
                _ if library == Library::Trl && !uses.trl => format!(
                    "trl {version} is given, but the spec names no TRL trainer: the estimate \
                     runs the {} steps; set `trainer:` to the TRL trainer the run uses \
                     (trl-sft, trl-dpo, trl-grpo, trl-reward)",
                    if uses.trainer_hf {
                        "transformers Trainer's"
                    } else {
                        "measuring harness's"
                    }
                ),
                Some(_) if library.models(version) => continue,
                Some(modelled) => format!(
                    "{} {version} is not modelled; the estimate follows {} {}",
                    library.key(),
                    library.key(),
                    at_precision_of(modelled, version)
                ),
                None => format!("{} {version} is not modelled", library.key()),
            };
            if !warnings.contains(&warning) {
                warnings.push(warning);
            }
        }
        if uses.vllm_colocated {
            warnings.push(
                "the colocated vLLM engine's share is vLLM's contract (gpu_memory_utilization of \
                 the total), not a measurement: vLLM is not on the measuring machines"
                    .to_string(),
            );
        }
        if uses.fsdp1 {
            warnings.push(
                "FSDP1 is measured as rank 0 of a fake process group (bench/fsdp1): its NCCL \
                 communicators are carried over from FSDP2's, measured on real NCCL"
                    .to_string(),
            );
        }
        if uses.tensor_parallel {
            warnings.push(
                "tensor parallelism is measured as rank 0 of a fake process group (bench/tp): \
                 NCCL's communicators, one per mesh dimension, are carried over from FSDP2's \
                 and HSDP's, not measured"
                    .to_string(),
            );
        }
        if uses.pipeline_parallel {
            warnings.push(
                "pipeline parallelism is measured as single ranks of a fake process group \
                 (bench/pp) and on real NCCL at pp 2 over 2 H100s, both ranks within 0.01% \
                 allocated of the fake group's: NCCL's communicators are measured for a rank \
                 with one neighbour, not for a middle rank's second"
                    .to_string(),
            );
        }
        if uses.pipeline_sharded {
            warnings.push(
                "FSDP2 within pipeline stages is measured as single ranks of a fake process \
                 group (bench/pp, pp 2-4 × dp 2-8 × tp 1-2): the data-parallel group's NCCL \
                 communicator beside the pipeline's is not measured"
                    .to_string(),
            );
        }
        if uses.context_parallel {
            warnings.push(
                "context parallelism is measured as rank 0 of a fake process group (bench/cp): \
                 the ring's collectives allocate their outputs, NCCL's communicators are carried \
                 over from HSDP's, not measured"
                    .to_string(),
            );
        }
        if uses.megatron {
            warnings.push(
                "framework megatron follows megatron-core 0.19 with its local layer spec (no \
                 Transformer Engine or apex: their fused norms, attention, cross-entropy and \
                 gradient-accumulation fusion are not modelled), measured as rank 0 of a fake \
                 process group (bench/megatron); NCCL's communicators are counted group by group \
                 (bench/nccl-comms: their structures measured, their connections to peers carried \
                 over from DDP's, within -2% to +9% of 4 H200s' eager groups)"
                    .to_string(),
            );
        }
        if uses.megatron_sequence_parallel {
            warnings.push(
                "Megatron's sequence parallelism is measured on the local layer spec with torch's \
                 RMSNorm marked sequence_parallel as apex's FusedLayerNorm marks its weights \
                 (megatron-core's own WrappedTorchNorm refuses it; bench/megatron-sp), not with \
                 Transformer Engine's norms"
                    .to_string(),
            );
        }
        if uses.megatron_pipeline {
            warnings.push(
                "Megatron's pipeline parallelism is measured for its 1F1B and interleaved \
                 schedules as single ranks (first, middle and last) of a fake process group \
                 (bench/megatron-pp, bench/megatron-pp-vpp), the interleaved one with and \
                 without overlap_p2p_comm: NCCL's point-to-point communicators between stages, \
                 and how long NCCL holds a tensor an isend is still sending, are not measured"
                    .to_string(),
            );
        }
        if uses.trainer_under_ddp {
            warnings.push(
                "a trainer under DDP is not measured: its step is the one measured on one GPU, \
                 with DDP's buckets and NCCL's communicators as measured for the harness's loop"
                    .to_string(),
            );
        }
        warnings.extend(gpu_warnings(gpu, uses.sdpa));
        for name in engines {
            warnings.push(format!(
                "engine {name}: its share of the GPU is vLLM's contract \
                 (gpu_memory_utilization of the total), not a measurement: vLLM is not on the \
                 measuring machines"
            ));
        }
        Assumptions { given, warnings }
    }
}

impl Assumptions {
    /// What the estimate assumes about the model itself: how an MoE model's tokens are
    /// routed, and the attention transformers runs where the spec's is not available.
    pub fn with_model(mut self, spec: &RunSpec, arch: &Architecture) -> Self {
        let megatron = spec
            .parallel
            .as_ref()
            .is_some_and(|p| p.tensor.framework == crate::spec::Framework::Megatron);
        let settings = spec.megatron.unwrap_or_default();
        if megatron && settings.transformer_engine {
            self.warnings.push(
                "megatron.transformer_impl transformer_engine is not modelled: the estimate is \
                 the local layer spec's (unfused attention with its score matrix, torch norms, \
                 unfused cross-entropy, SequentialMLP), not Transformer Engine's fused \
                 norm-linears, flash attention, fused cross-entropy and grouped GEMM"
                    .to_string(),
            );
        }
        let transformers = spec.versions.followed(crate::spec::Library::Transformers);
        if let Some(release) = transformers.filter(|v| v.major == 4 && arch.moe.is_some()) {
            self.warnings.push(format!(
                "transformers {release}'s MoE blocks loop over a ModuleList of nn.Linear experts \
                 and `index_add_` their outputs, which autograd keeps; they are not modelled: the \
                 estimate runs transformers 5's fused experts (grouped_mm) and peft 0.21's LoRA \
                 on them, whose activations differ (bench/cross-holdout: allocated -9.8% to \
                 +16.2% under LoRA; full fine-tunes that peak in the optimizer step agree)"
            ));
        }
        if spec.trainer.kind.is_trl() && arch.moe.is_some() && arch.family != Family::GptOss {
            self.warnings.push(
                "TRL loads the model from a checkpoint that stores each expert's projections \
                 apart: the loader's copies of them on the GPU, stacked and concatenated into the \
                 fused experts, are not simulated, and the segments they add can stay reserved \
                 (bench/cross-holdout: reserved 15% above the estimate for SFT on Mixtral and \
                 GRPO on Qwen3-MoE; allocated within 1.8%)"
                    .to_string(),
            );
        }
        // grouped_mm and batched_mm allocate by tokens x top_k alone; only the per-expert loop
        // depends on how the router spreads tokens.
        if let Some(moe) = arch.moe.as_ref().filter(|_| megatron) {
            let router = match (settings.router_fp32, settings.aux_loss()) {
                (false, false) => "the router in bf16, no auxiliary or z-loss",
                (true, false) => {
                    "the router in fp32 (bench/megatron-router), no auxiliary or z-loss"
                }
                (false, true) => {
                    "the router in bf16 with the Switch load-balancing loss (bench/megatron-router), \
                     no z-loss"
                }
                (true, true) => {
                    "the router in fp32 with the Switch load-balancing loss \
                     (bench/megatron-router), no z-loss"
                }
            };
            self.warnings.push(format!(
                "Megatron's MoELayer assumes balanced routing: each of the {} experts receives \
                 tokens x {} / {} of every rank's tokens, and every expert-parallel rank \
                 receives as many rows as it sends (the measured rows fix the router's choice \
                 so, bench/megatron-moe); the alltoall token dispatcher and SequentialMLP (the \
                 grouped GEMM needs Transformer Engine), {router}, no capacity factor",
                moe.experts, moe.top_k, moe.experts
            ));
        } else if let Some(moe) = arch
            .moe
            .as_ref()
            .filter(|_| spec.experts == ExpertsImpl::Eager)
        {
            self.warnings.push(if spec.routing_factor > 1.0 {
                format!(
                    "the experts' loop gives the busiest of {} experts {}x an even share of the \
                     (token, expert) pairs (routing.max_tokens_per_expert_factor)",
                    moe.experts, spec.routing_factor
                )
            } else {
                format!(
                    "the experts' loop assumes the router spreads tokens evenly over the {} \
                     experts; set routing.max_tokens_per_expert_factor for a busier expert",
                    moe.experts
                )
            });
        }
        if arch.family == Family::GptOss {
            self.warnings.push(
                "gpt-oss's MXFP4 checkpoint is taken as the bf16 weights transformers \
                 dequantizes it to on load (always for training, and without the `kernels` \
                 package); the transient buffers of that dequantization are not simulated"
                    .to_string(),
            );
        }
        if arch.family == Family::GptOss && spec.attention == Attention::Sdpa {
            self.warnings.push(
                "gpt-oss has no SDPA: transformers runs eager attention with sinks (and raises \
                 if sdpa is requested explicitly); the estimate runs eager"
                    .to_string(),
            );
        }
        self
    }
}

/// `modelled` written as precisely as `given` is (5.17 against 4.46, 5.17.0 against 4.46.3).
fn at_precision_of(modelled: Version, given: Version) -> Version {
    Version {
        patch: given.patch.and(modelled.patch),
        ..modelled
    }
}

/// What an estimate on `gpu` carries over from the Hopper GPUs it was measured on.
fn gpu_warnings(gpu: &Gpu, sdpa: bool) -> Vec<String> {
    if gpu.is_custom() {
        return vec![
            "the GPU is a capacity without a catalog entry: its CUDA context, cuBLAS workspaces \
             and attention kernels are taken as an H200's"
                .to_string(),
        ];
    }
    if gpu.arch == GpuArch::Hopper {
        return Vec::new();
    }
    let ws = gpu.workspaces();
    let mut warnings = vec![format!(
        "{} is {} ({}), not Hopper: its cuBLAS workspaces follow PyTorch's source ({} MiB + {} \
         MiB per thread), but its CUDA context and the attention kernels' memory are carried \
         over from the H100/H200 measurements",
        gpu.name,
        gpu.arch.key(),
        gpu.arch.target(),
        mib(ws.cublas_bytes),
        mib(ws.cublaslt_bytes)
    )];
    if sdpa && !gpu.arch.has_flash_attention() {
        warnings.push(format!(
            "{} has no FlashAttention or cuDNN attention (sm80 and later): SDPA picks the \
             memory-efficient or math kernel there, while the estimate allocates what it picks \
             on Hopper",
            gpu.name
        ));
    }
    if gpu.arch == GpuArch::Cdna3 {
        warnings.push(format!(
            "{} runs PyTorch's ROCm build: HIP's context and hipBLASLt's use of its workspace \
             were not measured; the estimate allocates the workspaces where CUDA's cuBLAS would",
            gpu.name
        ));
    }
    warnings
}

/// Bytes as MiB with at most three decimals, for workspace sizes (8.125, 32, 1).
fn mib(bytes: u64) -> String {
    let mib = bytes as f64 / (1u64 << 20) as f64;
    let text = format!("{mib:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::gpu;

    fn spec(yaml: &str) -> RunSpec {
        RunSpec::from_str_at(yaml, Path::new("test.yaml")).expect("valid spec")
    }

    #[test]
    fn a_measured_gpu_with_the_modelled_versions_assumes_nothing_unmeasured() {
        let run =
            spec("{model: qwen2.5-0.5b, versions: {torch: \"2.11\", transformers: \"5.17.0\"}}");
        for name in ["h200", "h100-80gb"] {
            let a = Assumptions::run(&run, &gpu::find(name).unwrap());
            assert_eq!(a.warnings, Vec::<String>::new(), "{name}");
        }
    }

    #[test]
    fn a_version_not_modelled_is_named_with_the_one_followed() {
        let run =
            spec("{model: qwen2.5-0.5b, versions: {transformers: \"4.45\", torch: \"2.11.1\"}}");
        let a = Assumptions::run(&run, &gpu::find("h200").unwrap());
        assert_eq!(
            a.warnings,
            [
                "torch 2.11.1 is not modelled; the estimate follows torch 2.11.0",
                "transformers 4.45 is not modelled; the estimate follows transformers 5.17",
            ]
        );
        let trl = spec("{model: qwen2.5-0.5b, versions: {trl: \"0.24\", transformers: \"4.57\"}}");
        let warnings = Assumptions::run(&trl, &Gpu::default()).warnings;
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].starts_with("trl 0.24 is given, but the spec names no TRL trainer"),
            "{warnings:?}"
        );
        let sft = spec("{model: qwen2.5-0.5b, trainer: trl-sft, versions: {trl: \"0.24\"}}");
        assert_eq!(
            Assumptions::run(&sft, &Gpu::default()).warnings,
            ["trl 0.24 is not modelled; the estimate follows trl 1.16"]
        );
        let modelled = spec("{model: qwen2.5-0.5b, trainer: trl-dpo, versions: {trl: \"1.16\"}}");
        assert!(
            Assumptions::run(&modelled, &Gpu::default())
                .warnings
                .is_empty()
        );
        // 4.57 is modelled as 4.57.1; another patch of it follows that one, and says so.
        let patch = spec("{model: qwen2.5-0.5b, versions: {transformers: \"4.57.0\"}}");
        assert_eq!(
            Assumptions::run(&patch, &Gpu::default()).warnings,
            ["transformers 4.57.0 is not modelled; the estimate follows transformers 4.57.1"]
        );
    }

    #[test]
    fn a_version_of_a_library_the_run_does_not_use_changes_nothing() {
        let run = spec("{model: qwen2.5-0.5b, versions: {peft: \"0.10\", deepspeed: \"0.14\"}}");
        assert!(Assumptions::run(&run, &Gpu::default()).warnings.is_empty());
        let lora = spec("{model: qwen2.5-0.5b, lora: {r: 8}, versions: {peft: \"0.10\"}}");
        assert_eq!(
            Assumptions::run(&lora, &Gpu::default()).warnings,
            ["peft 0.10 is not modelled; the estimate follows peft 0.21"]
        );
    }

    #[test]
    fn gpus_off_hopper_say_what_is_carried_over() {
        let run = spec("{model: qwen2.5-0.5b}");
        let a100 = Assumptions::run(&run, &gpu::find("a100-80gb").unwrap()).warnings;
        assert_eq!(
            a100,
            [
                "a100-80gb is ampere (sm80/sm86), not Hopper: its cuBLAS workspaces follow \
                 PyTorch's source (8.125 MiB + 1 MiB per thread), but its CUDA context and the \
                 attention kernels' memory are carried over from the H100/H200 measurements"
            ]
        );
        let v100 = Assumptions::run(&run, &gpu::find("v100-32gb").unwrap()).warnings;
        assert_eq!(v100.len(), 2, "{v100:?}");
        assert!(v100[1].starts_with("v100-32gb has no FlashAttention"));
        let eager = spec("{model: qwen2.5-0.5b, attention: eager}");
        let v100 = Assumptions::run(&eager, &gpu::find("v100-32gb").unwrap()).warnings;
        assert_eq!(v100.len(), 1, "{v100:?}");
        let mi300x = Assumptions::run(&run, &gpu::find("mi300x").unwrap()).warnings;
        assert_eq!(mi300x.len(), 2, "{mi300x:?}");
        let custom = Assumptions::run(&run, &gpu::find("64GiB").unwrap()).warnings;
        assert_eq!(
            custom,
            [
                "the GPU is a capacity without a catalog entry: its CUDA context, cuBLAS \
                 workspaces and attention kernels are taken as an H200's"
            ]
        );
    }

    #[test]
    fn workspaces_print_in_mib() {
        assert_eq!(mib(32 << 20), "32");
        assert_eq!(mib(GpuArch::Ampere.workspaces().cublas_bytes), "8.125");
        assert_eq!(mib(76 << 20), "76");
    }
}
