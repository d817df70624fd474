//! Config lints: accelerate YAML and DeepSpeed JSON, each case as its tool would read it.

use std::path::Path;

use headroom::arch::Architecture;
use headroom::catalog;
use headroom::diagnose::lint::{self, Context, Lint, Severity};
use headroom::dtype::DType;
use headroom::gpu;
use headroom::spec::{BackwardPrefetch, FsdpUnits, Precision, RunSpec, Strategy};

fn accelerate(yaml: &str, cx: Context) -> Vec<Lint> {
    lint::accelerate(yaml, Path::new("accelerate.yaml"), cx)
        .expect("parses")
        .1
}

fn deepspeed(json: &str, cx: Context) -> Vec<Lint> {
    lint::deepspeed(json, Path::new("ds.json"), cx).expect("parses")
}

fn has(lints: &[Lint], key: &str, severity: Severity) -> bool {
    lints
        .iter()
        .any(|l| l.key.contains(key) && l.severity == severity)
}

#[test]
fn a_clean_accelerate_config_has_nothing_to_say() {
    let spec = RunSpec::from_str_at("model: qwen2.5-0.5b\nprecision: bf16\n", Path::new("s"))
        .expect("spec");
    let cx = Context {
        spec: Some(&spec),
        ..Context::default()
    };
    let lints = accelerate(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 4\n\
         gpu_ids: '0,1,2,3'\nmixed_precision: bf16\n",
        cx,
    );
    assert!(lints.is_empty(), "{lints:?}");
}

#[test]
fn accelerate_ranks_gpus_and_precision() {
    let lints = accelerate(
        "distributed_type: MULTI_GPU\nnum_processes: 4\ngpu_ids: '0,1'\n",
        Context::default(),
    );
    assert!(has(&lints, "num_processes", Severity::Error), "{lints:?}");
    let lints = accelerate("num_processes: 2\n", Context::default());
    assert!(has(&lints, "distributed_type", Severity::Error));
    let lints = accelerate("distributed_type: MULTI_TPU\n", Context::default());
    assert!(has(&lints, "distributed_type", Severity::Error));

    let spec = RunSpec::from_str_at("model: qwen2.5-0.5b\nprecision: amp-bf16\n", Path::new("s"))
        .expect("spec");
    let cx = Context {
        spec: Some(&spec),
        ..Context::default()
    };
    let lints = accelerate("distributed_type: 'NO'\nmixed_precision: 'no'\n", cx);
    assert!(
        has(&lints, "mixed_precision", Severity::Warning),
        "{lints:?}"
    );
}

#[test]
fn accelerate_deepspeed_and_fsdp_sections() {
    let lints = accelerate(
        "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 2\n  \
         offload_param_device: cpu\n",
        Context::default(),
    );
    assert!(
        has(&lints, "offload_param_device", Severity::Warning),
        "{lints:?}"
    );
    let lints = accelerate("distributed_type: DEEPSPEED\n", Context::default());
    assert!(has(&lints, "deepspeed_config", Severity::Error));
    let (launch, lints) = lint::accelerate(
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n  \
         zero_stage: 3\n",
        Path::new("a.yaml"),
        Context::default(),
    )
    .expect("parses");
    assert_eq!(launch.deepspeed_config_file.as_deref(), Some("ds.json"));
    assert!(
        has(&lints, "deepspeed_config", Severity::Warning),
        "{lints:?}"
    );
    let spec = RunSpec::from_str_at(
        "model: qwen2.5-0.5b\ngradient_checkpointing: true\n",
        Path::new("s"),
    )
    .expect("spec");
    let lints = accelerate(
        "distributed_type: FSDP\nnum_processes: 2\nmixed_precision: bf16\nfsdp_config:\n  \
         fsdp_sharding_strategy: NO_SHARD\n  fsdp_activation_checkpointing: true\n",
        Context {
            spec: Some(&spec),
            ..Context::default()
        },
    );
    assert!(
        has(&lints, "fsdp_sharding_strategy", Severity::Info),
        "{lints:?}"
    );
    assert!(has(
        &lints,
        "fsdp_activation_checkpointing",
        Severity::Warning
    ));
}

/// accelerate 1.15 reads each FSDP key only under its version; the lints say which one a
/// config's launch ignores or refuses.
#[test]
fn accelerate_fsdp_keys_by_version() {
    let rule = |lints: &[Lint], id: &str| lints.iter().find(|l| l.rule.id() == id).cloned();
    let lints = accelerate(
        "distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n  \
         fsdp_sharding_strategy: SHARD_GRAD_OP\n  fsdp_reshard_after_forward: FULL_SHARD\n",
        Context::default(),
    );
    assert!(rule(&lints, "HR126").is_some(), "{lints:?}");
    let not_bool = rule(&lints, "HR127").expect("a non-boolean reshard");
    assert_eq!(not_bool.severity, Severity::Error);
    let missing_policy = rule(&lints, "HR128").expect("no wrap policy");
    assert_eq!(missing_policy.severity, Severity::Warning);
    // FSDP1 by omission, where fsdp_reshard_after_forward is dead.
    let lints = accelerate(
        "distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_auto_wrap_policy: \
         TRANSFORMER_BASED_WRAP\n  fsdp_reshard_after_forward: false\n",
        Context::default(),
    );
    assert!(rule(&lints, "HR125").is_some(), "{lints:?}");
    assert!(rule(&lints, "HR126").is_some(), "{lints:?}");
    assert!(rule(&lints, "HR128").is_none(), "{lints:?}");
    // FSDP2 activation checkpointing without a policy fails at launch.
    let lints = accelerate(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  \
         fsdp_activation_checkpointing: true\n",
        Context::default(),
    );
    assert_eq!(
        rule(&lints, "HR128").map(|l| l.severity),
        Some(Severity::Error)
    );
}

/// What `accelerate launch` makes of a spec: FSDP2 with accelerate's policy over upcast fp32
/// masters and its units; DDP with autocast; DeepSpeed's stage and offload.
#[test]
fn accelerate_launches_the_spec() {
    let spec = RunSpec::from_str_at(
        "model: qwen2.5-0.5b\nprecision: bf16\nbatch_size: 2\nseq_len: 512\n",
        Path::new("s"),
    )
    .expect("spec");
    let launch = |yaml: &str| {
        lint::accelerate(yaml, Path::new("a.yaml"), Context::default())
            .expect("parses")
            .0
            .layout
            .expect("a layout")
    };
    let fsdp2 = launch(
        "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 8\nfsdp_config:\n  \
         fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  \
         fsdp_reshard_after_forward: false\n  fsdp_activation_checkpointing: true\n",
    );
    let (launched, words) = fsdp2.apply(&spec).expect("modelled");
    let p = launched.parallel.as_ref().expect("parallel");
    assert_eq!(
        (p.strategy, p.world_size, p.reshard_after_forward, p.units),
        (Strategy::Fsdp, 8, false, FsdpUnits::Accelerate)
    );
    let mp = p.mixed_precision.expect("accelerate's policy");
    assert_eq!(
        (mp.param_dtype, mp.reduce_dtype, mp.output_dtype),
        (DType::BF16, Some(DType::BF16), Some(DType::BF16))
    );
    assert_eq!(
        launched.precision,
        Precision::Fp32,
        "trainable parameters upcast"
    );
    assert!(launched.gradient_checkpointing);
    assert!(words.contains("FSDP2 over 8 GPUs"), "{words}");

    let ddp = launch("distributed_type: MULTI_GPU\nmixed_precision: bf16\nnum_processes: 4\n");
    let fp32 = RunSpec::from_str_at("model: qwen2.5-0.5b\nprecision: fp32\n", Path::new("s"))
        .expect("spec");
    let (launched, _) = ddp.apply(&fp32).expect("modelled");
    assert_eq!(launched.precision, Precision::AmpBf16, "native autocast");
    assert_eq!(
        launched.parallel.map(|p| (p.strategy, p.world_size)),
        Some((Strategy::Ddp, 4))
    );

    let zero = launch(
        "distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 8\n\
         deepspeed_config:\n  zero_stage: 3\n  offload_optimizer_device: cpu\n",
    );
    let (launched, _) = zero.apply(&spec).expect("modelled");
    let p = launched.parallel.expect("parallel");
    assert_eq!((p.strategy, p.offload_optimizer), (Strategy::Zero3, true));

    let fp16 =
        launch("distributed_type: FSDP\nmixed_precision: fp16\nfsdp_config:\n  fsdp_version: 2\n");
    assert!(fp16.apply(&spec).unwrap_err().contains("fp16"));
    // FSDP1: MixedPrecision(bf16, bf16) over upcast flat parameters, autocast, and no
    // backward prefetch unless the config asks; HYBRID_SHARD shards within a machine.
    let fsdp1 = launch(
        "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 16\nnum_machines: 2\n\
         fsdp_config:\n  fsdp_version: 1\n  fsdp_sharding_strategy: HYBRID_SHARD\n  \
         fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n",
    );
    let (launched, words) = fsdp1.apply(&spec).expect("modelled");
    let p = launched.parallel.as_ref().expect("parallel");
    assert_eq!(
        (
            p.strategy,
            p.world_size,
            p.shard_size,
            p.fsdp1.backward_prefetch
        ),
        (Strategy::Fsdp1, 16, 8, BackwardPrefetch::None)
    );
    assert_eq!(launched.autocast, Some(DType::BF16));
    assert_eq!(launched.precision, Precision::Fp32);
    assert!(
        words.contains("FSDP1 over 16 GPUs (HYBRID over groups of 8"),
        "{words}"
    );
    let no_shard = launch(
        "distributed_type: FSDP\nnum_processes: 4\nfsdp_config:\n  fsdp_sharding_strategy: \
         NO_SHARD\n",
    );
    assert_eq!(
        no_shard
            .apply(&spec)
            .expect("modelled")
            .0
            .parallel
            .map(|p| p.strategy),
        Some(Strategy::Ddp)
    );
    // A layout no spec could say is not followed (nor simulated): no ranks, more machines
    // than processes, a world past the limits.
    for yaml in [
        "distributed_type: MULTI_GPU\nnum_processes: 0\n",
        "distributed_type: FSDP\nnum_processes: 2\nnum_machines: 4\nfsdp_config:\n  \
         fsdp_sharding_strategy: HYBRID_SHARD\n",
        "distributed_type: FSDP\nnum_processes: 99999999\nfsdp_config:\n  fsdp_version: 2\n",
    ] {
        let why = launch(yaml).apply(&spec).expect_err(yaml);
        assert!(why.contains("parallel."), "{why}");
    }
}

#[test]
fn deepspeed_stages_offload_and_precision() {
    let lints = deepspeed(
        r#"{"bf16": {"enabled": true}, "fp16": {"enabled": true},
            "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}"#,
        Context::default(),
    );
    assert!(has(&lints, "fp16.enabled", Severity::Error), "{lints:?}");
    assert!(has(&lints, "offload_param", Severity::Warning));
    let lints = deepspeed(
        r#"{"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "nvme"}}}"#,
        Context::default(),
    );
    assert!(
        has(&lints, "offload_optimizer", Severity::Error),
        "{lints:?}"
    );
    assert!(has(&lints, "nvme_path", Severity::Error));
    let lints = deepspeed(r#"{"zero_optimization": {"stage": 4}}"#, Context::default());
    assert!(has(&lints, "stage", Severity::Error));
}

#[test]
fn deepspeed_bucket_sizes_in_bytes() {
    // The HF guide's example: 5e8-element buckets with overlap_comm in 16 bits take
    // 5e8 × 2 bytes × 2 × 4.5 = 9 GB.
    let lints = deepspeed(
        r#"{"bf16": {"enabled": true}, "zero_optimization": {"stage": 2, "overlap_comm": true,
            "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}}"#,
        Context::default(),
    );
    let bucket = lints
        .iter()
        .find(|l| l.key.contains("reduce_bucket_size"))
        .expect("a bucket lint");
    assert_eq!(bucket.severity, Severity::Warning);
    assert!(bucket.message.contains("8.38 GiB"), "{}", bucket.message);

    // "auto" takes hidden_size² from the spec's model, as the HF integration fills it in.
    let config = catalog::resolve("qwen2.5-0.5b", None).expect("catalog");
    let arch = Architecture::from_hf_config(&config.config).expect("arch");
    let h = arch.hidden as f64;
    let a10g = gpu::find("a10g").expect("catalog");
    let lints = deepspeed(
        r#"{"bf16": {"enabled": true}, "zero_optimization": {"stage": 2,
            "reduce_bucket_size": "auto", "allgather_bucket_size": 2e8}}"#,
        Context {
            arch: Some(&arch),
            gpu: Some(&a10g),
            ..Context::default()
        },
    );
    let bucket = lints
        .iter()
        .find(|l| l.key.contains("reduce_bucket_size"))
        .expect("a bucket lint");
    let expected = (h * h + 2e8) * 2.0 / (1u64 << 30) as f64;
    assert!(
        bucket.message.contains(&format!("{expected:.2} GiB")),
        "{}",
        bucket.message
    );
    let lints = deepspeed(r#"{"zero_optimization": {"stage": 3}}"#, Context::default());
    assert!(
        lints
            .iter()
            .any(|l| l.key.contains("stage3_max_live_parameters"))
    );
}

#[test]
fn unparsable_configs_name_the_file_and_line() {
    let err = lint::accelerate(
        "distributed_type: [\n",
        Path::new("bad.yaml"),
        Context::default(),
    )
    .expect_err("invalid YAML");
    assert!(err.to_string().starts_with("bad.yaml:"), "{err}");
    let err = lint::deepspeed("[1, 2]", Path::new("ds.json"), Context::default())
        .expect_err("not an object");
    assert!(err.to_string().contains("ds.json"), "{err}");
}
