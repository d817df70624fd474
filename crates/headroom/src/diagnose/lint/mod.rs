//! Launch-config checks for the mistakes that end in an OOM (or in a crash that looks like
//! one): accelerate YAML, DeepSpeed JSON, and `device_map="auto"` in a multi-process run.
//! Each lint names the key, what is wrong with it in the tool's own terms, and the fix.
//!
//! Every check is a [`Rule`] with a stable id (`HR1xx` accelerate, `HR2xx` DeepSpeed,
//! `HR3xx` `device_map`), a kebab-case name and a doc; the checks of one config kind live in
//! its module.

mod accelerate;
mod deepspeed;
mod device_map;

pub use accelerate::{LaunchLayout, accelerate};
pub use deepspeed::deepspeed;
pub use device_map::device_map;

use serde_json::Value;

use crate::arch::Architecture;
use crate::gpu::Gpu;
use crate::spec::RunSpec;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// The tool refuses the config, or the run cannot fit as configured.
    Error,
    /// It runs, but not as intended, and costs memory.
    Warning,
    /// Worth knowing; no change needed.
    Info,
}

impl Severity {
    pub fn key(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
            Severity::Info => "info",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lint {
    /// The check that found it; `rule.id()` is what users can search for.
    pub rule: Rule,
    pub severity: Severity,
    /// The file (or log) it is about.
    pub source: String,
    /// The config key, or `line N` for a text match.
    pub key: String,
    pub message: String,
    pub fix: String,
}

/// What the checks may compare a config with.
#[derive(Clone, Copy, Debug, Default)]
pub struct Context<'a> {
    pub spec: Option<&'a RunSpec>,
    pub arch: Option<&'a Architecture>,
    pub gpu: Option<&'a Gpu>,
}

/// HR129: what of an accelerate launch the check of the spec does not follow, or replaces.
pub fn launch_not_applied(source: &str, message: String) -> Lint {
    Lint {
        rule: Rule::AccelerateLaunchNotApplied,
        severity: Severity::Warning,
        source: source.to_string(),
        key: "distributed_type".to_string(),
        message,
        fix: "make the spec's parallel and precision what the launch runs".to_string(),
    }
}

/// What an accelerate config says about the launch, for the other checks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Launch {
    pub distributed_type: Option<String>,
    /// Processes per machine (`num_processes`), when set.
    pub processes: Option<u64>,
    /// A DeepSpeed JSON the accelerate config points to.
    pub deepspeed_config_file: Option<String>,
    /// The data parallelism and precision the config gives a run, where it decides them.
    pub layout: Option<LaunchLayout>,
}

impl Launch {
    /// Whether ranks run as separate processes (each with its own model copy).
    pub fn is_distributed(&self) -> bool {
        self.distributed_type.as_deref().is_some_and(|d| d != "NO")
            || self.processes.is_some_and(|n| n > 1)
    }
}

/// The lints of one file, in the order the checks find them.
struct Sink<'a> {
    source: &'a str,
    lints: Vec<Lint>,
}

impl<'a> Sink<'a> {
    fn new(source: &'a str) -> Self {
        Sink {
            source,
            lints: Vec::new(),
        }
    }

    fn push(
        &mut self,
        rule: Rule,
        severity: Severity,
        key: &str,
        message: String,
        fix: impl Into<String>,
    ) {
        self.lints.push(Lint {
            rule,
            severity,
            source: self.source.to_string(),
            key: key.to_string(),
            message,
            fix: fix.into(),
        });
    }
}

/// A count given as a number or as a string of one (accelerate and DeepSpeed accept both).
fn as_count(v: &Value) -> Option<u64> {
    v.as_u64()
        .or_else(|| v.as_str().and_then(|s| s.trim().parse().ok()))
}

/// What a rule checks, why it matters and how to fix what it finds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuleDoc {
    pub checks: &'static str,
    pub why: &'static str,
    pub fix: &'static str,
}

/// Declares [`Rule`] from one table, so that a rule's id, name and doc cannot drift apart.
macro_rules! rules {
    ($(
        $rule:ident = $id:literal, $name:literal {
            checks: $checks:literal,
            why: $why:literal,
            fix: $fix:literal $(,)?
        }
    )*) => {
        /// Every check the linter runs. Ids and names are stable, since users and their tools
        /// search for them: a rule that is dropped leaves its id unused.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Rule {
            $(
                #[doc = concat!("`", $id, "` `", $name, "`: ", $checks, "\n\n", $why, "\n\nFix: ", $fix)]
                $rule,
            )*
        }

        impl Rule {
            pub const ALL: &'static [Rule] = &[$(Rule::$rule),*];

            /// The stable id, such as `HR101`.
            pub fn id(self) -> &'static str {
                match self {
                    $(Rule::$rule => $id,)*
                }
            }

            /// The kebab-case name, such as `accelerate-unknown-key`.
            pub fn name(self) -> &'static str {
                match self {
                    $(Rule::$rule => $name,)*
                }
            }

            pub fn doc(self) -> RuleDoc {
                match self {
                    $(Rule::$rule => RuleDoc { checks: $checks, why: $why, fix: $fix },)*
                }
            }
        }
    };
}

rules! {
    AccelerateUnknownKey = "HR101", "accelerate-unknown-key" {
        checks: "A top-level key of an accelerate config that accelerate's ClusterConfig does not \
                 accept (configs written for SageMaker are skipped).",
        why: "`accelerate launch` stops on unknown keys before the script starts; settings such \
              as zero_stage placed at the top level are ignored by the intended section.",
        fix: "Move the key to its section (deepspeed_config, the training code), or remove it.",
    }
    AccelerateMissingDistributedType = "HR102", "accelerate-missing-distributed-type" {
        checks: "An accelerate config without distributed_type.",
        why: "accelerate requires it and refuses the config.",
        fix: "distributed_type: 'NO' for one GPU, MULTI_GPU for DDP.",
    }
    AccelerateUnquotedNo = "HR103", "accelerate-unquoted-no" {
        checks: "distributed_type written as an unquoted NO, No, no, OFF, Off or off.",
        why: "PyYAML reads YAML 1.1, where those are the boolean false, so accelerate gets \
              False instead of the string 'NO'.",
        fix: "Quote it: distributed_type: 'NO'.",
    }
    AccelerateUnknownDistributedType = "HR104", "accelerate-unknown-distributed-type" {
        checks: "A distributed_type that is not one of accelerate's DistributedType values.",
        why: "accelerate refuses the config.",
        fix: "Use one of accelerate's DistributedType names (NO, MULTI_GPU, DEEPSPEED, FSDP, ...).",
    }
    AccelerateGpuIdsList = "HR105", "accelerate-gpu-ids-list" {
        checks: "gpu_ids given as a YAML list.",
        why: "accelerate copies gpu_ids into CUDA_VISIBLE_DEVICES as given, so a list does not \
              select the GPUs intended.",
        fix: "A comma-separated string: gpu_ids: \"0,1\".",
    }
    AccelerateMultiGpuOneProcess = "HR106", "accelerate-multi-gpu-one-process" {
        checks: "distributed_type MULTI_GPU with num_processes: 1.",
        why: "One process still sets up torch.distributed (NCCL buffers) and DDP, whose buckets \
              hold a second copy of the gradients, and device_map=\"auto\" is refused.",
        fix: "distributed_type: 'NO' for one GPU, or one process per GPU.",
    }
    AccelerateShardingOneProcess = "HR107", "accelerate-sharding-one-process" {
        checks: "DEEPSPEED, FSDP or MEGATRON_LM over num_processes: 1.",
        why: "Sharding over one process shards nothing: only CPU offload saves GPU memory.",
        fix: "num_processes equal to the number of GPUs.",
    }
    AccelerateProcessesIgnored = "HR108", "accelerate-processes-ignored" {
        checks: "distributed_type 'NO' with num_processes above 1.",
        why: "accelerate launches one process and ignores num_processes, so the run is not the \
              data-parallel one intended.",
        fix: "distributed_type: MULTI_GPU for data parallelism.",
    }
    AccelerateMoreProcessesThanGpus = "HR109", "accelerate-more-processes-than-gpus" {
        checks: "More processes than GPUs listed in gpu_ids in a multi-GPU launch.",
        why: "Ranks beyond the visible GPUs fail with \"invalid device ordinal\", or share a GPU \
              that then holds several full copies of weights, gradients and optimizer states.",
        fix: "num_processes equal to the number of GPUs in gpu_ids.",
    }
    AccelerateIdleGpus = "HR110", "accelerate-idle-gpus" {
        checks: "Fewer processes than GPUs listed in gpu_ids in a multi-GPU launch.",
        why: "The extra GPUs stay idle.",
        fix: "num_processes equal to the number of GPUs in gpu_ids.",
    }
    AccelerateFp8NotModelled = "HR111", "accelerate-fp8-not-modelled" {
        checks: "mixed_precision: fp8.",
        why: "headroom does not model fp8 training; its estimate assumes the spec's precision.",
        fix: "None needed; read the estimate as one for the spec's precision.",
    }
    AcceleratePrecisionMismatch = "HR112", "accelerate-precision-mismatch" {
        checks: "accelerate's mixed_precision against the run spec's precision.",
        why: "The estimate is for the spec's precision; a different autocast changes the size of \
              activations (or overflows bf16-trained weights in fp16).",
        fix: "Make mixed_precision and the spec's precision agree.",
    }
    AccelerateDeepspeedConfigMissing = "HR113", "accelerate-deepspeed-config-missing" {
        checks: "distributed_type DEEPSPEED without a deepspeed_config section.",
        why: "accelerate has no ZeRO settings to launch DeepSpeed with.",
        fix: "Add deepspeed_config (zero_stage, ...) or deepspeed_config_file.",
    }
    AccelerateDeepspeedKeysIgnored = "HR114", "accelerate-deepspeed-keys-ignored" {
        checks: "ZeRO settings in deepspeed_config beside a deepspeed_config_file.",
        why: "With a DeepSpeed JSON, accelerate takes ZeRO settings from it and rejects or \
              ignores the ones in the YAML.",
        fix: "Set them in the DeepSpeed JSON only.",
    }
    AccelerateZeroStageInvalid = "HR115", "accelerate-zero-stage-invalid" {
        checks: "A deepspeed_config.zero_stage other than 0, 1, 2 or 3.",
        why: "No such ZeRO stage exists; DeepSpeed refuses it.",
        fix: "zero_stage: 0, 1, 2 or 3.",
    }
    AccelerateZeroStageUnset = "HR116", "accelerate-zero-stage-unset" {
        checks: "A deepspeed_config without zero_stage.",
        why: "accelerate's DeepSpeed plugin then uses stage 2, which may not be what was meant.",
        fix: "Set zero_stage explicitly.",
    }
    AccelerateParamOffloadBelowStage3 = "HR117", "accelerate-param-offload-below-stage3" {
        checks: "offload_param_device set in deepspeed_config below ZeRO stage 3.",
        why: "Parameters offload only in stage 3; below it the setting is ignored and the weights \
              stay on the GPU.",
        fix: "zero_stage: 3, or offload the optimizer only.",
    }
    AccelerateOptimizerOffloadWithoutZero = "HR118", "accelerate-optimizer-offload-without-zero" {
        checks: "offload_optimizer_device set in deepspeed_config at ZeRO stage 0.",
        why: "Optimizer offload needs ZeRO stage 1, 2 or 3.",
        fix: "zero_stage: 2 with offload_optimizer_device: cpu (ZeRO-Offload).",
    }
    AccelerateZeroOneProcess = "HR119", "accelerate-zero-one-process" {
        checks: "A ZeRO stage of 1 or more over one process, without optimizer offload.",
        why: "ZeRO over one process shards nothing; only offload saves GPU memory.",
        fix: "More processes, or offload_optimizer_device: cpu.",
    }
    AccelerateZero3WithoutInitFlag = "HR120", "accelerate-zero3-without-init-flag" {
        checks: "ZeRO stage 3 without zero3_init_flag: true.",
        why: "Every rank builds the whole model before it is sharded: host memory, and GPU memory \
              if the script moves it there first.",
        fix: "zero3_init_flag: true.",
    }
    AccelerateFsdpConfigMissing = "HR121", "accelerate-fsdp-config-missing" {
        checks: "distributed_type FSDP without an fsdp_config section.",
        why: "accelerate's defaults apply: FSDP1, FULL_SHARD and no auto-wrap policy (the \
              whole model one unit).",
        fix: "fsdp_version: 2, fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP, and \
              fsdp_reshard_after_forward.",
    }
    AccelerateFsdpNoShard = "HR122", "accelerate-fsdp-no-shard" {
        checks: "fsdp_sharding_strategy NO_SHARD.",
        why: "It shards nothing: the same memory per GPU as DDP.",
        fix: "FULL_SHARD (ZeRO-3) or SHARD_GRAD_OP (ZeRO-2).",
    }
    AccelerateDoubleCheckpointing = "HR123", "accelerate-double-checkpointing" {
        checks: "fsdp_activation_checkpointing with the spec's gradient checkpointing.",
        why: "Both wrap the layers: the forward is recomputed twice for no memory gain.",
        fix: "Keep one of them.",
    }
    AccelerateFsdpOffloadParams = "HR124", "accelerate-fsdp-offload-params" {
        checks: "fsdp_offload_params: true.",
        why: "Parameters and gradients live on the CPU between uses: the least GPU memory, the \
              slowest step.",
        fix: "None needed where the memory matters more than the speed.",
    }
    AccelerateFsdpVersionUnset = "HR125", "accelerate-fsdp-version-unset" {
        checks: "An fsdp_config without fsdp_version.",
        why: "`accelerate launch` then runs FSDP1, whose flat parameters and gathered root need \
              more memory than FSDP2.",
        fix: "fsdp_version: 2 (or 1, to say FSDP1 is meant).",
    }
    AccelerateFsdpKeyIgnored = "HR126", "accelerate-fsdp-key-ignored" {
        checks: "fsdp_sharding_strategy under fsdp_version 2, or fsdp_reshard_after_forward \
                 alone under FSDP1.",
        why: "accelerate 1.15 reads only the key of its version: FSDP2 ignores the sharding \
              strategy (it shards fully), FSDP1 always gets a sharding strategy (FULL_SHARD by \
              default) that wins over fsdp_reshard_after_forward.",
        fix: "fsdp_reshard_after_forward (true or false) for FSDP2, fsdp_sharding_strategy for \
              FSDP1.",
    }
    AccelerateFsdpReshardNotBool = "HR127", "accelerate-fsdp-reshard-not-bool" {
        checks: "A non-boolean fsdp_reshard_after_forward under fsdp_version 2.",
        why: "`Accelerator()` fails with \"invalid truth value\" (FULL_SHARD and integers too).",
        fix: "true or false.",
    }
    AccelerateFsdpNotTransformerWrap = "HR128", "accelerate-fsdp-not-transformer-wrap" {
        checks: "An fsdp_config whose fsdp_auto_wrap_policy is not TRANSFORMER_BASED_WRAP.",
        why: "Without a policy the whole model is one unit, gathered at once; size-based units \
              follow fsdp_min_num_params; FSDP2 activation checkpointing without a policy fails \
              (TypeError). The estimate assumes a unit per decoder layer.",
        fix: "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP.",
    }
    AccelerateLaunchNotApplied = "HR129", "accelerate-launch-not-applied" {
        checks: "A launch the estimate cannot follow, or a spec whose own `parallel` differs \
                 from the launch's.",
        why: "The spec is checked as the accelerate config launches it where headroom models \
              that launch; otherwise as it is written.",
        fix: "Make the spec's parallel and precision what the launch runs.",
    }
    DeepspeedFp16AndBf16 = "HR201", "deepspeed-fp16-and-bf16" {
        checks: "fp16.enabled and bf16.enabled both true in a DeepSpeed config.",
        why: "DeepSpeed refuses fp16 and bf16 at once.",
        fix: "Enable one.",
    }
    DeepspeedZeroStageInvalid = "HR202", "deepspeed-zero-stage-invalid" {
        checks: "A zero_optimization.stage other than 0, 1, 2 or 3.",
        why: "No such ZeRO stage exists; the other DeepSpeed checks stop here.",
        fix: "stage: 0, 1, 2 or 3.",
    }
    DeepspeedNoZero = "HR203", "deepspeed-no-zero" {
        checks: "A DeepSpeed config at ZeRO stage 0 (or without zero_optimization).",
        why: "Every rank holds the full optimizer states, gradients and weights.",
        fix: "Stage 1 shards the optimizer states, 2 adds gradients, 3 adds weights.",
    }
    DeepspeedParamOffloadBelowStage3 = "HR204", "deepspeed-param-offload-below-stage3" {
        checks: "zero_optimization.offload_param below stage 3.",
        why: "Parameter offload works only with stage 3; below it the weights stay on the GPU.",
        fix: "stage: 3, or drop offload_param.",
    }
    DeepspeedOffloadWithoutZero = "HR205", "deepspeed-offload-without-zero" {
        checks: "offload_optimizer or offload_param at ZeRO stage 0.",
        why: "Offload needs ZeRO stage 1, 2 or 3.",
        fix: "stage: 2 (optimizer) or 3 (parameters).",
    }
    DeepspeedNvmeWithoutPath = "HR206", "deepspeed-nvme-without-path" {
        checks: "Offload to NVMe without nvme_path.",
        why: "DeepSpeed has nowhere to write the offloaded tensors.",
        fix: "nvme_path: a local NVMe mount.",
    }
    DeepspeedBucketMemory = "HR207", "deepspeed-bucket-memory" {
        checks: "The memory of ZeRO stage 1 and 2 communication buckets (reduce and allgather), \
                 times 4.5 with overlap_comm.",
        why: "The buckets sit on every GPU on top of the model's memory; a warning from a GiB or \
              5% of the GPU.",
        fix: "Smaller buckets (2e8 is common) or overlap_comm: false.",
    }
    DeepspeedStage3LiveParameters = "HR208", "deepspeed-stage3-live-parameters" {
        checks: "The parameters ZeRO stage 3 keeps gathered and prefetched at once.",
        why: "They sit on every GPU on top of the shards; a warning from a GiB or 5% of the GPU.",
        fix: "Lower stage3_max_live_parameters (e.g. 3e8).",
    }
    DeepspeedMicroBatchMismatch = "HR209", "deepspeed-micro-batch-mismatch" {
        checks: "train_micro_batch_size_per_gpu against the run spec's batch_size.",
        why: "The estimate is for the spec's batch; activations grow with it.",
        fix: "Make them agree.",
    }
    DeviceMapOneProcessDistributed = "HR301", "device-map-one-process-distributed" {
        checks: "device_map=\"auto\" (balanced, sequential) under a distributed launch of one \
                 process.",
        why: "With several GPUs visible the model is spread over them and accelerate refuses to \
              train it in a distributed mode.",
        fix: "One process: distributed_type 'NO' and device_map={\"\": 0}; several GPUs: one \
              process per GPU.",
    }
    DeviceMapDistributed = "HR302", "device-map-distributed" {
        checks: "device_map=\"auto\" (balanced, sequential) in a multi-process launch.",
        why: "Each rank spreads its own copy over every visible GPU, so GPU 0 holds a slice of \
              every copy, and accelerate refuses to train it.",
        fix: "device_map={\"\": PartialState().process_index}, or no device_map.",
    }
    DeviceMapSingleProcess = "HR303", "device-map-single-process" {
        checks: "device_map=\"auto\" (balanced, sequential) in a single-process run.",
        why: "The model is split over every visible GPU and one works at a time: less memory per \
              GPU, no parallelism.",
        fix: "None needed; on one visible GPU it is the same as {\"\": 0}.",
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn rule_ids_and_names_are_unique_and_well_formed() {
        let mut ids = HashSet::new();
        let mut names = HashSet::new();
        for rule in Rule::ALL {
            let id = rule.id();
            assert!(ids.insert(id), "{id} is used twice");
            assert!(names.insert(rule.name()), "{} is used twice", rule.name());
            assert!(
                id.len() == 5
                    && id.starts_with("HR")
                    && id[2..].bytes().all(|b| b.is_ascii_digit()),
                "{id} is not HR and three digits"
            );
            assert!(
                rule.name().split('-').all(|w| !w.is_empty()
                    && w.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())),
                "{} is not kebab-case",
                rule.name()
            );
        }
    }

    #[test]
    fn every_rule_says_what_it_checks_why_and_the_fix() {
        for rule in Rule::ALL {
            let doc = rule.doc();
            for (part, text) in [("checks", doc.checks), ("why", doc.why), ("fix", doc.fix)] {
                assert!(!text.trim().is_empty(), "{} has no `{part}`", rule.id());
            }
        }
    }

    #[test]
    fn lints_carry_the_rule_that_found_them() {
        let path = std::path::Path::new("accelerate.yaml");
        let (_, lints) = accelerate(
            "distributed_type: NO\nzero_stage: 2\n",
            path,
            Context::default(),
        )
        .expect("parses");
        let rules: Vec<Rule> = lints.iter().map(|l| l.rule).collect();
        assert_eq!(
            rules,
            [Rule::AccelerateUnknownKey, Rule::AccelerateUnquotedNo]
        );
        let lints = device_map("train.py", "m = f(device_map=\"auto\")", None);
        assert_eq!(lints[0].rule, Rule::DeviceMapSingleProcess);
    }

    #[test]
    fn rule_ids_group_by_config_kind() {
        for rule in Rule::ALL {
            let kind = match &rule.id()[..3] {
                "HR1" => "accelerate-",
                "HR2" => "deepspeed-",
                "HR3" => "device-map-",
                other => panic!("{other}xx is no config kind"),
            };
            assert!(
                rule.name().starts_with(kind),
                "{} {}",
                rule.id(),
                rule.name()
            );
        }
    }
}
