//! accelerate configs (`accelerate config` YAML, or its JSON form): the keys `accelerate
//! launch` refuses, the process layout against the GPUs, `mixed_precision` against the spec,
//! and the `deepspeed_config` and `fsdp_config` sections (rules HR101-HR124).

use std::path::Path;

use serde_json::{Map, Value};

use super::{Context, Launch, Lint, Rule, Severity, Sink, as_count};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::spec::{
    self, BackwardPrefetch, Fsdp1Options, FsdpUnits, MixedPrecision, Parallel, Precision, RunSpec,
    Strategy, TensorParallel,
};

/// The keys `ClusterConfig` (accelerate/commands/config/config_args.py) accepts, plus the
/// legacy ones it converts (`fp16`, `dynamo_backend`); anything else makes
/// `accelerate launch` fail with "The config file at … had unknown keys".
const ACCELERATE_KEYS: &[&str] = &[
    "compute_environment",
    "distributed_type",
    "mixed_precision",
    "use_cpu",
    "debug",
    "num_processes",
    "machine_rank",
    "num_machines",
    "gpu_ids",
    "main_process_ip",
    "main_process_port",
    "rdzv_backend",
    "same_network",
    "main_training_function",
    "enable_cpu_affinity",
    "fp8_config",
    "deepspeed_config",
    "fsdp_config",
    "tp_config",
    "megatron_lm_config",
    "ipex_config",
    "mpirun_config",
    "parallelism_config",
    "downcast_bf16",
    "tpu_name",
    "tpu_zone",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "command_file",
    "commands",
    "tpu_vm",
    "tpu_env",
    "dynamo_config",
    "fp16",
    "dynamo_backend",
];

const DISTRIBUTED_TYPES: &[&str] = &[
    "NO",
    "MULTI_GPU",
    "MULTI_CPU",
    "MULTI_XPU",
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_HPU",
    "DEEPSPEED",
    "FSDP",
    "XLA",
    "TPU",
    "MEGATRON_LM",
];

/// Where a key sits in the raw text (1-based line), for an unquoted-scalar check YAML hides.
fn raw_scalar<'t>(text: &'t str, key: &str) -> Option<(usize, &'t str)> {
    text.lines().enumerate().find_map(|(i, line)| {
        let rest = line.trim_start().strip_prefix(key)?.strip_prefix(':')?;
        let value = rest.split('#').next().unwrap_or("").trim();
        Some((i + 1, value))
    })
}

/// Check an accelerate config (`accelerate config` YAML, or its JSON form).
pub fn accelerate(text: &str, path: &Path, cx: Context) -> Result<(Launch, Vec<Lint>)> {
    let doc = spec::parse_document(text, path)?;
    let obj = doc.as_object().ok_or_else(|| Error::Syntax {
        path: path.to_path_buf(),
        line: None,
        column: None,
        message: "an accelerate config is a mapping of keys (distributed_type, num_processes, \
                  ...)"
            .into(),
    })?;
    let source = path.display().to_string();
    let mut s = Sink::new(&source);
    unknown_keys(&mut s, obj);
    let dt = distributed_type(&mut s, obj, text);
    let processes = obj.get("num_processes").and_then(as_count);
    let mut launch = Launch {
        distributed_type: dt.clone(),
        processes: processes.or((dt.as_deref() == Some("NO")).then_some(1)),
        deepspeed_config_file: None,
        layout: None,
    };
    let gpu_count = gpu_ids(&mut s, obj);
    let dt = dt.as_deref().unwrap_or("");
    let multi = matches!(dt, "MULTI_GPU" | "DEEPSPEED" | "FSDP" | "MEGATRON_LM");
    process_count(&mut s, dt, multi, processes);
    if let (Some(n), Some(k)) = (processes, gpu_count)
        && multi
    {
        processes_against_gpus(&mut s, n, k);
    }

    let mp = obj
        .get("mixed_precision")
        .and_then(Value::as_str)
        .unwrap_or("no");
    // Under FSDP the precision comes with the wrapping (see `LaunchLayout::apply`).
    if obj.contains_key("mixed_precision") && dt != "FSDP" {
        mixed_precision(&mut s, mp, cx.spec);
    }

    if dt == "DEEPSPEED" {
        match obj.get("deepspeed_config").and_then(Value::as_object) {
            None => s.push(
                Rule::AccelerateDeepspeedConfigMissing,
                Severity::Error,
                "deepspeed_config",
                "distributed_type DEEPSPEED without a deepspeed_config section".into(),
                "add deepspeed_config: {zero_stage: 2, ...} or deepspeed_config_file",
            ),
            Some(ds) => accelerate_deepspeed(&mut s, ds, processes, &mut launch),
        }
    }
    let world = processes.unwrap_or(1);
    launch.layout = match dt {
        "MULTI_GPU" => Some(LaunchLayout::plain(Strategy::Ddp, world, mp)),
        "DEEPSPEED" if launch.deepspeed_config_file.is_none() => obj
            .get("deepspeed_config")
            .and_then(Value::as_object)
            .map(|ds| LaunchLayout::deepspeed(ds, world, mp)),
        _ => None,
    };
    if dt == "FSDP" {
        match obj.get("fsdp_config").and_then(Value::as_object) {
            None => s.push(
                Rule::AccelerateFsdpConfigMissing,
                Severity::Warning,
                "fsdp_config",
                "distributed_type FSDP without an fsdp_config section: accelerate's defaults \
                 apply"
                    .into(),
                "set fsdp_sharding_strategy (or fsdp_reshard_after_forward with fsdp_version: 2)",
            ),
            Some(f) => {
                let machines = obj.get("num_machines").and_then(as_count).unwrap_or(1);
                launch.layout = accelerate_fsdp(&mut s, f, cx.spec, processes, machines, mp);
            }
        }
    }
    Ok((launch, s.lints))
}

/// HR101: top-level keys `accelerate launch` refuses (SageMaker configs have their own).
fn unknown_keys(s: &mut Sink, obj: &Map<String, Value>) {
    if obj.get("compute_environment").and_then(Value::as_str) == Some("AMAZON_SAGEMAKER") {
        return;
    }
    let source = s.source;
    for key in obj
        .keys()
        .map(String::as_str)
        .filter(|k| !ACCELERATE_KEYS.contains(k))
    {
        let hint = match key {
            "gradient_accumulation_steps" => {
                "set it in code (Accelerator(gradient_accumulation_steps=N), \
                 TrainingArguments, a TRL config) or, for DeepSpeed, under deepspeed_config"
            }
            "zero_stage" | "offload_optimizer_device" | "offload_param_device" => {
                "move it under deepspeed_config"
            }
            _ => "remove it, or upgrade accelerate if it is a newer key",
        };
        s.push(
            Rule::AccelerateUnknownKey,
            Severity::Error,
            key,
            format!(
                "accelerate does not know `{key}` at the top level: `accelerate launch` stops \
                 with \"The config file at {source} had unknown keys (['{key}'])\""
            ),
            hint,
        );
    }
}

/// HR102-HR104: `distributed_type`, which accelerate requires; `NO` unquoted is YAML 1.1's
/// boolean false to PyYAML. Returns the type as accelerate reads it.
fn distributed_type(s: &mut Sink, obj: &Map<String, Value>, text: &str) -> Option<String> {
    let dt = match obj.get("distributed_type") {
        None => {
            s.push(
                Rule::AccelerateMissingDistributedType,
                Severity::Error,
                "distributed_type",
                "missing: accelerate requires it (\"A `distributed_type` must be specified in the \
                 config file.\")"
                    .into(),
                "distributed_type: 'NO' for one GPU, MULTI_GPU for DDP",
            );
            None
        }
        Some(Value::Bool(false)) => Some("NO".to_string()),
        Some(v) => v.as_str().map(str::to_string),
    };
    if let Some((line, raw)) = raw_scalar(text, "distributed_type")
        && matches!(raw, "NO" | "No" | "no" | "OFF" | "Off" | "off")
    {
        s.push(
            Rule::AccelerateUnquotedNo,
            Severity::Warning,
            "distributed_type",
            format!(
                "line {line}: unquoted `{raw}` is the boolean false to PyYAML (YAML 1.1), which \
                 accelerate uses to read this file, so accelerate gets False, not the string \
                 'NO'; `accelerate config` writes it quoted"
            ),
            "distributed_type: 'NO'",
        );
    }
    if let Some(d) = &dt
        && !DISTRIBUTED_TYPES.contains(&d.as_str())
    {
        s.push(
            Rule::AccelerateUnknownDistributedType,
            Severity::Error,
            "distributed_type",
            format!("`{d}` is not an accelerate DistributedType"),
            format!("use one of {}", DISTRIBUTED_TYPES.join(", ")),
        );
    }
    dt
}

/// HR105: `gpu_ids`, a string ("all", "0,1"); a YAML list goes to CUDA_VISIBLE_DEVICES as a
/// list. Returns how many GPUs it lists, when it lists them.
fn gpu_ids(s: &mut Sink, obj: &Map<String, Value>) -> Option<u64> {
    match obj.get("gpu_ids") {
        Some(Value::Array(items)) => {
            let ids: Vec<String> = items.iter().map(|v| v.to_string()).collect();
            s.push(
                Rule::AccelerateGpuIdsList,
                Severity::Warning,
                "gpu_ids",
                "a YAML list; accelerate expects a string and copies it into \
                 CUDA_VISIBLE_DEVICES as given, so the list does not select GPUs as intended"
                    .into(),
                format!("gpu_ids: \"{}\"", ids.join(",")),
            );
            Some(items.len() as u64)
        }
        Some(Value::String(g)) if g.trim() != "all" => {
            Some(g.split(',').filter(|x| !x.trim().is_empty()).count() as u64)
        }
        Some(Value::Number(_)) => Some(1),
        _ => None,
    }
}

/// HR106-HR108: `num_processes` against what the distributed type does with it.
fn process_count(s: &mut Sink, dt: &str, multi: bool, processes: Option<u64>) {
    match (multi, processes) {
        (true, Some(1)) if dt == "MULTI_GPU" => s.push(
            Rule::AccelerateMultiGpuOneProcess,
            Severity::Warning,
            "num_processes",
            "distributed_type: MULTI_GPU with num_processes: 1 starts one process: it does not \
             add processes to the GPU, but that process still initialises torch.distributed \
             (NCCL buffers, about 0.9 GiB measured per rank) and accelerate treats the run as \
             distributed: DistributedDataParallel's buckets hold a second copy of the gradients, \
             and a model loaded with device_map=\"auto\" over several GPUs is refused \
             (\"You can't train a model that has been loaded with `device_map='auto'` in any \
             distributed mode\")"
                .into(),
            "one GPU: distributed_type: 'NO' (or launch with python); several: num_processes = \
             the number of GPUs",
        ),
        (true, Some(1)) => s.push(
            Rule::AccelerateShardingOneProcess,
            Severity::Info,
            "num_processes",
            format!(
                "{dt} over one process shards nothing: every state stays on the one GPU (only \
                 CPU offload saves GPU memory)"
            ),
            "num_processes = the number of GPUs",
        ),
        (false, Some(n)) if dt == "NO" && n > 1 => s.push(
            Rule::AccelerateProcessesIgnored,
            Severity::Warning,
            "num_processes",
            format!("distributed_type 'NO' launches one process; num_processes: {n} is ignored"),
            "MULTI_GPU for data parallelism over the GPUs",
        ),
        _ => {}
    }
}

/// HR109-HR110: `n` processes of a multi-GPU launch against the `k` GPUs in `gpu_ids`.
fn processes_against_gpus(s: &mut Sink, n: u64, k: u64) {
    if n > k {
        s.push(
            Rule::AccelerateMoreProcessesThanGpus,
            Severity::Error,
            "num_processes",
            format!(
                "{n} processes for {k} GPU{} in gpu_ids: local ranks beyond the visible GPUs \
                     fail with \"invalid device ordinal\", or, where the script picks cuda:0, \
                     ranks share a GPU and each puts its full copy of weights, gradients and \
                     optimizer states on it",
                if k == 1 { "" } else { "s" }
            ),
            "num_processes equal to the number of GPUs in gpu_ids",
        );
    } else if n < k {
        s.push(
            Rule::AccelerateIdleGpus,
            Severity::Info,
            "gpu_ids",
            format!("{k} GPUs listed for {n} processes: {} stay idle", k - n),
            "num_processes equal to the number of GPUs in gpu_ids",
        );
    }
}

/// HR111-HR112: accelerate's `mixed_precision` against the spec's precision.
fn mixed_precision(s: &mut Sink, mp: &str, spec: Option<&RunSpec>) {
    if mp == "fp8" {
        s.push(
            Rule::AccelerateFp8NotModelled,
            Severity::Info,
            "mixed_precision",
            "fp8 training (Transformer Engine / torchao) is not modelled by headroom; the \
             estimate assumes the spec's precision"
                .into(),
            "",
        );
        return;
    }
    let Some(spec) = spec else { return };
    let expected = match spec.precision {
        Precision::Fp32 => "no",
        Precision::AmpBf16 | Precision::Bf16 => "bf16",
        Precision::AmpFp16 => "fp16",
    };
    if mp == expected {
        return;
    }
    let what = match (spec.precision, mp) {
        (Precision::Bf16, "fp16") => {
            "the spec loads bf16 weights but accelerate autocasts to fp16 with a GradScaler: \
             fp16's range on bf16-trained weights overflows; pick one 16-bit type"
        }
        (Precision::Bf16, "no") => {
            "the spec loads bf16 weights; with mixed_precision 'no' accelerate adds no autocast, \
             so this matches only if the script itself casts the model to bf16"
        }
        (Precision::Fp32, _) => {
            "accelerate autocasts the forward pass, so the run keeps fp32 weights and computes in \
             16 bits: that is precision amp-bf16 / amp-fp16, whose activations are smaller than \
             the spec's fp32 estimate"
        }
        (_, "no") => {
            "the spec autocasts to 16 bits but accelerate adds no autocast: unless the script \
             autocasts itself, activations are fp32 and about twice the estimate"
        }
        _ => "the 16-bit type differs from the spec's; the estimate assumes the spec's",
    };
    s.push(
        Rule::AcceleratePrecisionMismatch,
        Severity::Warning,
        "mixed_precision",
        format!(
            "mixed_precision: {mp} against the spec's precision {}: {what}",
            spec.precision.name()
        ),
        format!("mixed_precision: {expected}, or change the spec to what runs"),
    );
}

/// HR114-HR120: the `deepspeed_config` section of an accelerate config.
fn accelerate_deepspeed(
    s: &mut Sink,
    ds: &Map<String, Value>,
    processes: Option<u64>,
    launch: &mut Launch,
) {
    if let Some(file) = ds.get("deepspeed_config_file").and_then(Value::as_str) {
        launch.deepspeed_config_file = Some(file.to_string());
        let ignored: Vec<&str> = ds
            .keys()
            .map(String::as_str)
            .filter(|k| {
                !matches!(
                    *k,
                    "deepspeed_config_file" | "deepspeed_multinode_launcher" | "zero3_init_flag"
                )
            })
            .collect();
        if !ignored.is_empty() {
            s.push(
                Rule::AccelerateDeepspeedKeysIgnored,
                Severity::Warning,
                "deepspeed_config",
                format!(
                    "with deepspeed_config_file, accelerate takes ZeRO settings from the JSON \
                     and rejects or ignores {} here",
                    ignored.join(", ")
                ),
                "set them in the DeepSpeed JSON only",
            );
        }
        return;
    }
    let stage = ds.get("zero_stage").and_then(as_count);
    match stage {
        Some(0..=3) => {}
        Some(n) => s.push(
            Rule::AccelerateZeroStageInvalid,
            Severity::Error,
            "deepspeed_config.zero_stage",
            format!("ZeRO stage {n} does not exist"),
            "0, 1, 2 or 3",
        ),
        None => s.push(
            Rule::AccelerateZeroStageUnset,
            Severity::Warning,
            "deepspeed_config.zero_stage",
            "not set: accelerate's DeepSpeed plugin defaults to stage 2".into(),
            "set zero_stage explicitly",
        ),
    }
    let device = |k: &str| {
        ds.get(k)
            .and_then(Value::as_str)
            .filter(|d| *d != "none")
            .map(str::to_string)
    };
    let stage = stage.unwrap_or(2);
    if let Some(d) = device("offload_param_device")
        && stage < 3
    {
        s.push(
            Rule::AccelerateParamOffloadBelowStage3,
            Severity::Warning,
            "deepspeed_config.offload_param_device",
            format!(
                "parameters offload to {d} only in ZeRO stage 3; at stage {stage} it is ignored \
                 and the weights stay on the GPU"
            ),
            "zero_stage: 3, or offload the optimizer only",
        );
    }
    if device("offload_optimizer_device").is_some() && stage == 0 {
        s.push(
            Rule::AccelerateOptimizerOffloadWithoutZero,
            Severity::Error,
            "deepspeed_config.offload_optimizer_device",
            "optimizer offload needs ZeRO stage 1, 2 or 3".into(),
            "zero_stage: 2 with offload_optimizer_device: cpu (ZeRO-Offload)",
        );
    }
    if processes == Some(1) && stage >= 1 && device("offload_optimizer_device").is_none() {
        s.push(
            Rule::AccelerateZeroOneProcess,
            Severity::Info,
            "deepspeed_config.zero_stage",
            format!(
                "ZeRO-{stage} over one process shards nothing; only offload saves GPU memory \
                 here"
            ),
            "more processes, or offload_optimizer_device: cpu",
        );
    }
    if stage == 3 && ds.get("zero3_init_flag").and_then(Value::as_bool) != Some(true) {
        s.push(
            Rule::AccelerateZero3WithoutInitFlag,
            Severity::Info,
            "deepspeed_config.zero3_init_flag",
            "ZeRO-3 without zero3_init_flag: every rank builds the whole model before it is \
             sharded (host memory, and GPU memory if the script moves it there first)"
                .into(),
            "zero3_init_flag: true",
        );
    }
}

/// HR122-HR128: the `fsdp_config` section of an accelerate config, as accelerate 1.15's
/// `FullyShardedDataParallelPlugin` reads it; returns the FSDP2 layout it launches.
fn accelerate_fsdp(
    s: &mut Sink,
    f: &Map<String, Value>,
    spec: Option<&RunSpec>,
    processes: Option<u64>,
    machines: u64,
    mp: &str,
) -> Option<LaunchLayout> {
    // `accelerate launch` adds the `fsdp_` prefix a key lacks.
    let get = |key: &str| {
        f.get(key)
            .or_else(|| f.get(key.strip_prefix("fsdp_").unwrap_or(key)))
    };
    let version = get("fsdp_version").map(|v| match v {
        Value::String(x) => x.trim().to_string(),
        other => other.to_string(),
    });
    let v2 = version.as_deref() == Some("2");
    if version.is_none() {
        s.push(
            Rule::AccelerateFsdpVersionUnset,
            Severity::Warning,
            "fsdp_config.fsdp_version",
            "not set: `accelerate launch` runs FSDP1 (FullyShardedDataParallel), whose flat \
             parameters and root that stays gathered after its forward need more memory than \
             FSDP2"
                .into(),
            "fsdp_version: 2 (what `accelerate config` writes), or 1 to say FSDP1 is meant",
        );
    }
    let strategy = get("fsdp_sharding_strategy").map(|v| match v {
        Value::String(x) => x.to_uppercase(),
        other => other.to_string(),
    });
    if v2 {
        if let Some(x) = &strategy {
            s.push(
                Rule::AccelerateFsdpKeyIgnored,
                Severity::Warning,
                "fsdp_config.fsdp_sharding_strategy",
                format!(
                    "{x} is ignored under fsdp_version 2: accelerate reads only \
                     fsdp_reshard_after_forward, so the run shards fully"
                ),
                "fsdp_reshard_after_forward: false for SHARD_GRAD_OP; HSDP through \
                 parallelism_config",
            );
        }
    } else if matches!(strategy.as_deref(), Some("NO_SHARD" | "3")) {
        s.push(
            Rule::AccelerateFsdpNoShard,
            Severity::Info,
            "fsdp_config.fsdp_sharding_strategy",
            "NO_SHARD shards nothing: the same memory per GPU as DDP".into(),
            "FULL_SHARD (ZeRO-3) or SHARD_GRAD_OP (ZeRO-2)",
        );
    } else if strategy.is_none() && get("fsdp_reshard_after_forward").is_some() {
        s.push(
            Rule::AccelerateFsdpKeyIgnored,
            Severity::Warning,
            "fsdp_config.fsdp_reshard_after_forward",
            "ignored under FSDP1: `accelerate launch` always passes fsdp_sharding_strategy \
             (FULL_SHARD by default), which wins"
                .into(),
            "fsdp_sharding_strategy: SHARD_GRAD_OP (or FULL_SHARD)",
        );
    }
    let reshard = match get("fsdp_reshard_after_forward") {
        None => Some(true),
        Some(Value::Bool(b)) => Some(*b),
        Some(Value::String(x)) => match x.to_lowercase().as_str() {
            "y" | "yes" | "t" | "true" | "on" | "1" => Some(true),
            "n" | "no" | "f" | "false" | "off" | "0" => Some(false),
            _ => None,
        },
        Some(Value::Number(n)) => match n.as_u64() {
            Some(1) => Some(true),
            Some(0) => Some(false),
            _ => None,
        },
        Some(_) => None,
    };
    if v2 && reshard.is_none() {
        s.push(
            Rule::AccelerateFsdpReshardNotBool,
            Severity::Error,
            "fsdp_config.fsdp_reshard_after_forward",
            format!(
                "{} is not a boolean: under fsdp_version 2 `Accelerator()` fails with \
                 \"invalid truth value\"",
                get("fsdp_reshard_after_forward").map_or(String::new(), Value::to_string)
            ),
            "true (FULL_SHARD) or false (SHARD_GRAD_OP)",
        );
    }
    let wrap = get("fsdp_auto_wrap_policy")
        .and_then(Value::as_str)
        .map(str::to_uppercase);
    let transformer_wrap = wrap.as_deref() == Some("TRANSFORMER_BASED_WRAP");
    let checkpointing = get("fsdp_activation_checkpointing").and_then(Value::as_bool) == Some(true);
    if !transformer_wrap {
        let what = wrap.as_deref().unwrap_or("no policy (NO_WRAP)");
        s.push(
            Rule::AccelerateFsdpNotTransformerWrap,
            if v2 && checkpointing && wrap.as_deref() != Some("SIZE_BASED_WRAP") {
                Severity::Error
            } else {
                Severity::Warning
            },
            "fsdp_config.fsdp_auto_wrap_policy",
            format!(
                "{what}: {}",
                match wrap.as_deref() {
                    Some("SIZE_BASED_WRAP") =>
                        "units follow fsdp_min_num_params, not the \
                        decoder layers; the estimate assumes one unit per decoder layer",
                    _ if v2 && checkpointing =>
                        "the whole model is one unit, gathered at once, \
                        and fsdp_activation_checkpointing calls the missing policy (TypeError)",
                    _ =>
                        "the whole model is one unit, gathered at once: no less memory than \
                        DDP for the weights in use",
                }
            ),
            "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP",
        );
    }
    if checkpointing && spec.is_some_and(|s| s.gradient_checkpointing) {
        s.push(
            Rule::AccelerateDoubleCheckpointing,
            Severity::Warning,
            "fsdp_config.fsdp_activation_checkpointing",
            "FSDP activation checkpointing and the model's gradient checkpointing both wrap the \
             layers: the forward is recomputed twice for no memory gain (transformers' Trainer \
             refuses the pair with a ValueError)"
                .into(),
            "keep one of them",
        );
    }
    let offload = get("fsdp_offload_params").and_then(Value::as_bool) == Some(true);
    if offload {
        s.push(
            Rule::AccelerateFsdpOffloadParams,
            Severity::Info,
            "fsdp_config.fsdp_offload_params",
            "parameters and gradients live on the CPU between uses: the least GPU memory, the \
             slowest step"
                .into(),
            "",
        );
    }
    let world = processes.unwrap_or(1);
    if !v2 {
        // FSDP1: the sharding strategy alone decides (FULL_SHARD by default); HYBRID shards
        // within a node. accelerate passes no backward prefetch unless it is set.
        let (strategy, reshard, hybrid) = match strategy.as_deref() {
            None | Some("FULL_SHARD" | "1") => (Strategy::Fsdp1, true, false),
            Some("SHARD_GRAD_OP" | "2") => (Strategy::Fsdp1, false, false),
            Some("NO_SHARD" | "3") => (Strategy::Ddp, true, false),
            Some("HYBRID_SHARD" | "4") => (Strategy::Fsdp1, true, true),
            Some("HYBRID_SHARD_ZERO2" | "5") => (Strategy::Fsdp1, false, true),
            Some(_) => return None,
        };
        let prefetch = match get("fsdp_backward_prefetch").and_then(Value::as_str) {
            Some("BACKWARD_PRE" | "1") => BackwardPrefetch::Pre,
            Some("BACKWARD_POST" | "2") => BackwardPrefetch::Post,
            _ => BackwardPrefetch::None,
        };
        return Some(LaunchLayout {
            reshard_after_forward: reshard,
            shard_size: hybrid.then(|| world / machines.max(1)),
            offload_params: offload && strategy == Strategy::Fsdp1,
            activation_checkpointing: checkpointing,
            fsdp1: Fsdp1Options {
                use_orig_params: get("fsdp_use_orig_params").and_then(Value::as_bool)
                    != Some(false),
                backward_prefetch: prefetch,
            },
            ..LaunchLayout::plain(strategy, world, mp)
        });
    }
    Some(LaunchLayout {
        units: FsdpUnits::Accelerate,
        reshard_after_forward: reshard.unwrap_or(true),
        offload_params: offload,
        activation_checkpointing: checkpointing,
        ..LaunchLayout::plain(Strategy::Fsdp, world, mp)
    })
}

/// The data parallelism and precision an accelerate config gives a run: what `accelerate
/// launch` with it makes of a script that loads the spec's model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchLayout {
    pub strategy: Strategy,
    pub world_size: u64,
    /// `mixed_precision`: no, bf16, fp16 or fp8.
    pub mixed_precision: String,
    pub reshard_after_forward: bool,
    pub offload_params: bool,
    pub offload_optimizer: bool,
    pub activation_checkpointing: bool,
    pub units: FsdpUnits,
    pub fsdp1: Fsdp1Options,
    /// FSDP1's HYBRID_SHARD: the GPUs of a node, which shard one copy.
    pub shard_size: Option<u64>,
}

impl LaunchLayout {
    fn plain(strategy: Strategy, world_size: u64, mixed_precision: &str) -> Self {
        LaunchLayout {
            strategy,
            world_size,
            mixed_precision: mixed_precision.to_string(),
            reshard_after_forward: true,
            offload_params: false,
            offload_optimizer: false,
            activation_checkpointing: false,
            units: FsdpUnits::Layers,
            fsdp1: Fsdp1Options::default(),
            shard_size: None,
        }
    }

    /// An inline `deepspeed_config`: its ZeRO stage (2 by default) and offload devices.
    fn deepspeed(ds: &Map<String, Value>, world_size: u64, mixed_precision: &str) -> Self {
        let on_cpu = |k: &str| ds.get(k).and_then(Value::as_str) == Some("cpu");
        let strategy = match ds.get("zero_stage").and_then(as_count) {
            Some(1) => Strategy::Zero1,
            Some(3) => Strategy::Zero3,
            _ => Strategy::Zero2,
        };
        LaunchLayout {
            offload_optimizer: on_cpu("offload_optimizer_device"),
            offload_params: strategy == Strategy::Zero3 && on_cpu("offload_param_device"),
            ..LaunchLayout::plain(strategy, world_size, mixed_precision)
        }
    }

    /// `spec` as this launch runs it, and the launch in words; an error says what of it the
    /// estimate cannot follow.
    pub fn apply(&self, spec: &RunSpec) -> std::result::Result<(RunSpec, String), String> {
        let mp = self.mixed_precision.as_str();
        let mut out = spec.clone();
        out.gradient_checkpointing |= self.activation_checkpointing;
        let mut policy = None;
        let mut autocast = None;
        out.precision = match (self.strategy, mp) {
            (_, "fp8") => return Err("fp8 training is not modelled".into()),
            // FSDP2: `MixedPrecisionPolicy(bf16, bf16, bf16)` over trainable parameters upcast
            // to fp32 (`fsdp2_prepare_model`), no autocast.
            (Strategy::Fsdp, "bf16") => {
                policy = Some(MixedPrecision {
                    param_dtype: DType::BF16,
                    reduce_dtype: Some(DType::BF16),
                    output_dtype: Some(DType::BF16),
                    cast_forward_inputs: true,
                });
                Precision::Fp32
            }
            (Strategy::Fsdp, "fp16") => {
                return Err("FSDP2 with an fp16 policy is not modelled".into());
            }
            // FSDP1: `MixedPrecision(bf16, bf16, bf16)` over flat parameters upcast to fp32,
            // and native autocast around the forward.
            (Strategy::Fsdp1, "bf16") => {
                policy = Some(MixedPrecision {
                    param_dtype: DType::BF16,
                    reduce_dtype: Some(DType::BF16),
                    output_dtype: None,
                    cast_forward_inputs: false,
                });
                autocast = Some(DType::BF16);
                Precision::Fp32
            }
            (Strategy::Fsdp1, "fp16") => {
                return Err("FSDP1 with an fp16 policy is not modelled".into());
            }
            // DeepSpeed's bf16 mode: bf16 parameters, fp32 masters of its own.
            (s, "bf16") if s.is_deepspeed() => Precision::Bf16,
            (s, _) if s.is_deepspeed() => {
                return Err(format!(
                    "DeepSpeed with mixed_precision {mp} is not modelled"
                ));
            }
            // DDP: native autocast around the forward.
            (_, "bf16") if spec.precision == Precision::Bf16 => Precision::Bf16,
            (_, "bf16") => Precision::AmpBf16,
            (_, "fp16") => Precision::AmpFp16,
            // No autocast: the parameters train in the dtype the script loads.
            (_, _) if spec.precision == Precision::Bf16 => Precision::Bf16,
            (_, _) => Precision::Fp32,
        };
        out.autocast = autocast;
        out.parallel = Some(Parallel {
            strategy: self.strategy,
            world_size: self.world_size,
            reshard_after_forward: self.reshard_after_forward,
            shard_size: self.shard_size.unwrap_or(self.world_size),
            offload_params: self.offload_params,
            offload_optimizer: self.offload_optimizer,
            mixed_precision: policy,
            units: self.units,
            tensor: TensorParallel::default(),
            pipeline: Default::default(),
            fsdp1: self.fsdp1,
        });
        let words = self.describe(&out);
        out.rechecked()
            .map(|s| (s, words))
            .map_err(|e| e.to_string())
    }

    fn describe(&self, spec: &RunSpec) -> String {
        let mut out = match self.strategy {
            Strategy::Ddp => format!("DDP over {} GPUs", self.world_size),
            Strategy::Fsdp1 => format!(
                "FSDP1 over {} GPUs ({}{}, a flat parameter per decoder layer and the root{})",
                self.world_size,
                match (self.reshard_after_forward, self.shard_size) {
                    (true, None) => "FULL_SHARD".to_string(),
                    (false, None) => "SHARD_GRAD_OP".to_string(),
                    (_, Some(n)) => format!("HYBRID over groups of {n}"),
                },
                if self.fsdp1.use_orig_params {
                    ", use_orig_params"
                } else {
                    ""
                },
                match self.fsdp1.backward_prefetch {
                    BackwardPrefetch::Pre => ", backward prefetch BACKWARD_PRE",
                    BackwardPrefetch::Post => ", backward prefetch BACKWARD_POST",
                    BackwardPrefetch::None => ", no backward prefetch",
                }
            ),
            Strategy::Fsdp => format!(
                "FSDP2 over {} GPUs (each decoder layer, the untied embedding, [norm, head], as \
                 accelerate 1.15 wraps{})",
                self.world_size,
                if self.reshard_after_forward {
                    ""
                } else {
                    "; no reshard after forward"
                }
            ),
            s => format!("DeepSpeed {} over {} GPUs", s.name(), self.world_size),
        };
        if self.offload_params || self.offload_optimizer {
            out += ", CPU offload";
        }
        out += &match spec.parallel.as_ref().and_then(|p| p.mixed_precision) {
            Some(_) if self.strategy == Strategy::Fsdp1 => {
                ", fp32 flat parameters under MixedPrecision(bf16, bf16, bf16) and autocast"
                    .to_string()
            }
            Some(_) => ", fp32 masters under MixedPrecisionPolicy(bf16, bf16, bf16)".to_string(),
            None => format!(", precision {}", spec.precision.name()),
        };
        if self.activation_checkpointing {
            out += ", activation checkpointing";
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_scalars_keep_what_yaml_would_reinterpret() {
        let text = "compute_environment: LOCAL_MACHINE\ndistributed_type: NO  # one GPU\n";
        assert_eq!(raw_scalar(text, "distributed_type"), Some((2, "NO")));
        assert_eq!(
            raw_scalar("distributed_type: 'NO'", "distributed_type"),
            Some((1, "'NO'"))
        );
    }
}
