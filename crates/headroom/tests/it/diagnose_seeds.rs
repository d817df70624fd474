//! The two situations of shared/seeds 002 and 003, diagnosed again: the message, the spec
//! checked against it, the remedies (savings recomputed here from the estimator), and the
//! config lints. The fixtures live with the CLI tests (crates/headroom-cli/tests/fixtures).

use std::path::Path;

use headroom::diagnose::lint::{self, Context, Severity};
use headroom::diagnose::oom_message::{self, Cause};
use headroom::diagnose::{self, remedies};
use headroom::estimate;
use headroom::plan::{self, Resident, Setup, Sharding};
use headroom::sim::Component;
use headroom::spec::{Optimizer, RunSpec};

const SEED003_OOM: &str = include_str!("../../../headroom-cli/tests/fixtures/seed003/oom.log");
const SEED003_TRAIN: &str = include_str!("../../../headroom-cli/tests/fixtures/seed003/train.yaml");
const SEED003_REF: &str =
    include_str!("../../../headroom-cli/tests/fixtures/seed003/reference.yaml");
const SEED002_OOM: &str = include_str!("../../../headroom-cli/tests/fixtures/seed002/oom.log");
const SEED002_AGENT: &str = include_str!("../../../headroom-cli/tests/fixtures/seed002/agent.yaml");
const SEED002_USER: &str = include_str!("../../../headroom-cli/tests/fixtures/seed002/user.yaml");
const SEED002_ACCEL: &str =
    include_str!("../../../headroom-cli/tests/fixtures/seed002/accelerate_config.original.yaml");
const SEED002_ACCEL_FIXED: &str =
    include_str!("../../../headroom-cli/tests/fixtures/seed002/accelerate_config.fixed.yaml");
const SEED002_SCRIPT: &str =
    include_str!("../../../headroom-cli/tests/fixtures/seed002/hf_model_cache.original.py");

const GIB: u64 = 1 << 30;

fn spec(text: &str) -> RunSpec {
    RunSpec::from_str_at(text, Path::new("fixture.yaml")).expect("fixture spec")
}

fn setup_for(oom_text: &str, train: &str, resident: &str, gpus: u32) -> Setup<'static> {
    let m = oom_message::parse(oom_text).expect("the fixture has a message");
    let gpu = diagnose::gpu_from_message(m.total_capacity_bytes.expect("a total"));
    let r = Resident::from_spec(&spec(resident), None, &gpu).expect("resident estimate");
    Setup {
        spec: spec(train),
        spec_dir: None,
        gpu,
        gpus,
        residents: vec![r],
        launcher: Default::default(),
    }
}

/// What the device holds for `s` plus the residents, straight from the estimator.
fn device_of(s: &RunSpec, setup: &Setup) -> u64 {
    let est = estimate::estimate(s, None, &setup.gpu).expect("estimates");
    est.peak_reserved_bytes
        + setup.residents.iter().map(|r| r.weights_bytes).sum::<u64>()
        + est.cuda_context_bytes
}

#[test]
fn seed003_is_a_genuine_shortage_the_estimate_reproduces() {
    let m = oom_message::parse(SEED003_OOM).expect("message");
    // The two numbers the seed quotes.
    assert_eq!(m.allocated_by_pytorch_bytes, Some(82_377_472_737)); // 76.72 GiB
    assert_eq!(m.reserved_unallocated_bytes, Some(1_943_472_701)); // 1.81 GiB
    let e = oom_message::explain(&m);
    assert_eq!(e.cause, Cause::Shortage, "{}", e.summary);

    let setup = setup_for(SEED003_OOM, SEED003_TRAIN, SEED003_REF, 1);
    assert_eq!(setup.gpu.name, "h100-80gb");
    let check = diagnose::check_spec(&setup, Some(&m)).expect("checks");
    // The seed estimated 62.6 GB by hand (bf16 weights and gradients, no AdamW temporaries);
    // the run needs more than the whole H100.
    assert!(!check.baseline.fits);
    assert!(check.baseline.device_bytes > setup.gpu.total_bytes + 4 * GIB);
    let b = &check.estimate.breakdown;
    let get = |c| b.iter().find(|(k, _)| *k == c).map_or(0, |&(_, x)| x);
    // fp32 weights and gradients (Lightning's bf16-mixed keeps fp32 parameters), fp32 Adam
    // moments, and foreach AdamW's parameter-sized temporary: 20 bytes per parameter.
    let params = check.estimate.params;
    let about = |bytes: u64, per_param: u64| bytes.abs_diff(params * per_param) < 1 << 20;
    assert!(about(get(Component::Weights), 4));
    assert!(about(get(Component::Gradients), 4));
    assert!(about(get(Component::OptimizerStates), 8));
    assert!(get(Component::OptimizerTemporaries) >= params * 4);
    // What PyTorch held at the failure is within what the estimate says the step needs.
    let held = m.allocated_by_pytorch_bytes.unwrap() + m.tried_to_allocate_bytes.unwrap();
    assert!(held <= check.baseline.peak_allocated_bytes);
    assert!(
        check
            .agreement
            .as_deref()
            .is_some_and(|a| a.contains("agrees"))
    );
}

#[test]
fn seed003_measured_run_confirms_the_oom() {
    // The calibration corpus measured this exact training step (without the reference
    // model) on an H200: add the reference's weights and the context, and it overflows an
    // 80 GB H100 as the seed's job did.
    let corpus = include_str!("../../../../bench/calibration/h200-torch2.11.jsonl");
    let row: serde_json::Value = corpus
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json"))
        .find(|r| r["id"] == "phi-3-mini/amp_bf16/adamw/bs2/s256/sdpa")
        .expect("the corpus has seed 003's step");
    assert_eq!(
        spec(SEED003_TRAIN),
        RunSpec::from_value(&row["spec"]).unwrap()
    );
    let setup = setup_for(SEED003_OOM, SEED003_TRAIN, SEED003_REF, 1);
    let measured = row["measured"]["peak_reserved_bytes"].as_u64().unwrap()
        + setup.residents[0].weights_bytes
        + setup.gpu.cuda_context_bytes;
    assert!(measured > setup.gpu.total_bytes);
    // And the remedy ranked first would have fitted the measured run too: fused AdamW drops
    // the temporaries (a measured fused row shows them gone on another model).
    let check = diagnose::check_spec(&setup, None).expect("checks");
    assert_eq!(check.remedies[0].key, "adamw-fused");
}

#[test]
fn seed003_remedies_are_ranked_with_savings_from_the_estimator() {
    let setup = setup_for(SEED003_OOM, SEED003_TRAIN, SEED003_REF, 1);
    let base = device_of(&setup.spec, &setup);
    let rems = remedies::remedies(&setup).expect("remedies");
    let by_key = |k: &str| {
        rems.iter()
            .find(|r| r.key == k)
            .unwrap_or_else(|| panic!("no {k} remedy"))
    };

    // Fitting remedies come first, cheapest (by plan::score) first.
    let first_misfit = rems
        .iter()
        .position(|r| !r.evaluation.fits)
        .unwrap_or(rems.len());
    assert!(rems[first_misfit..].iter().all(|r| !r.evaluation.fits));
    let scores: Vec<f64> = rems[..first_misfit]
        .iter()
        .filter(|r| !r.changes_data)
        .map(|r| plan::score(&r.evaluation))
        .collect();
    assert!(scores.windows(2).all(|w| w[0] <= w[1] + 1e-3), "{scores:?}");

    // Simulated savings equal what the estimator says for the changed spec.
    let fused = RunSpec {
        optimizer: Optimizer::AdamWFused,
        ..setup.spec.clone()
    };
    let r = by_key("adamw-fused");
    assert_eq!(r.evaluation.device_bytes, device_of(&fused, &setup));
    assert_eq!(
        r.saving_bytes,
        base as i128 - device_of(&fused, &setup) as i128
    );
    assert!(r.evaluation.fits && r.evaluation.slowdown == 1.0);
    let eight = RunSpec {
        optimizer: Optimizer::AdamW8bit,
        ..setup.spec.clone()
    };
    assert_eq!(
        by_key("adamw-8bit").evaluation.device_bytes,
        device_of(&eight, &setup)
    );

    // Moving the reference saves exactly its weights.
    assert_eq!(
        by_key("residents-off-gpu").saving_bytes,
        setup.residents[0].weights_bytes as i128
    );

    // The seed's own remedies: batch 2 → 1 and more checkpointing do not fit; its best one
    // (8-bit AdamW) fits but ranks below the free, exact fused AdamW.
    assert!(!by_key("micro-batch").evaluation.fits);
    assert!(!by_key("gradient-checkpointing").evaluation.fits);
    assert!(by_key("adamw-8bit").evaluation.fits);
    assert_eq!(rems[0].key, "adamw-fused");
}

#[test]
fn sharding_savings_stay_within_the_sharded_components() {
    let setup = Setup {
        gpus: 4,
        residents: Vec::new(),
        launcher: Default::default(),
        ..setup_for(SEED003_OOM, SEED003_TRAIN, SEED003_REF, 4)
    };
    let est = plan::simulate(&setup, &plan::Knobs::of(&setup.spec)).expect("estimates");
    let get = |c| {
        est.breakdown
            .iter()
            .find(|(k, _)| *k == c)
            .map_or(0, |&(_, x)| x)
    };
    let sharded = get(Component::Weights)
        + get(Component::Gradients)
        + get(Component::OptimizerStates)
        + get(Component::OptimizerTemporaries);
    let base = plan::Knobs::of(&setup.spec);
    let eval = |sharding| {
        plan::evaluate_with(
            &setup,
            &plan::Knobs {
                sharding,
                ..base.clone()
            },
            &est,
        )
    };
    let (z1, z2) = (eval(Sharding::Zero1), eval(Sharding::Zero2));
    // ZeRO-3 of a full fine-tune is FSDP2 full sharding, simulated rather than computed.
    let z3 = plan::evaluate(
        &setup,
        &plan::Knobs {
            sharding: Sharding::Zero3,
            ..base.clone()
        },
    )
    .expect("simulates");
    // Each stage shards more; none saves more than 3/4 of what it shards, plus DDP's buckets
    // (the baseline over 4 GPUs is simulated under DDP).
    assert!(z1.peak_allocated_bytes < est.peak_allocated_bytes);
    assert!(z2.peak_allocated_bytes < z1.peak_allocated_bytes);
    assert!(z3.peak_allocated_bytes < z2.peak_allocated_bytes);
    let buckets = get(Component::Communication);
    assert!(buckets > 0);
    assert!(est.peak_allocated_bytes - z3.peak_allocated_bytes <= sharded * 3 / 4 + buckets);
    assert!(z1.computed && z2.computed && !z3.computed);
}

#[test]
fn seed002_full_fine_tuning_cannot_fit_and_the_seed_remedies_do_not_either() {
    let m = oom_message::parse(SEED002_OOM).expect("message");
    assert_eq!(oom_message::explain(&m).cause, Cause::Shortage);
    let setup = setup_for(SEED002_OOM, SEED002_AGENT, SEED002_USER, 1);
    assert_eq!(setup.gpu.name, "a100-40gb");
    let check = diagnose::check_spec(&setup, Some(&m)).expect("checks");
    // The seed put the whole job at 20-24 GB, without gradients or optimizer states (two
    // AdamW moments in the parameters' dtype) or the rollout batch's activations.
    assert!(check.baseline.device_bytes > 60 * GIB);
    let rems = &check.remedies;
    let get = |k: &str| rems.iter().find(|r| r.key == k).expect("remedy");
    // The seed's options: batch 1, gradient checkpointing, 4-bit: only 4-bit with adapters
    // (QLoRA) fits on its own.
    assert!(!get("micro-batch").evaluation.fits);
    assert!(!get("gradient-checkpointing").evaluation.fits);
    assert!(get("qlora").evaluation.fits);
    assert_eq!(rems[0].key, "qlora");
    // The search finds an exact configuration that fits with the safety margin.
    let (best, changes) = check.cheapest_fit.expect("something fits");
    assert!(!changes.is_empty());
    let safe = (setup.gpu.total_bytes as f64 * (1.0 - plan::SAFETY_MARGIN)) as u64;
    assert!(best.device_bytes <= safe);
}

#[test]
fn seed002_configs_lint_as_accelerate_would_read_them() {
    let cx = Context::default();
    let (launch, lints) =
        lint::accelerate(SEED002_ACCEL, Path::new("original.yaml"), cx).expect("parses");
    assert_eq!(launch.processes, Some(1));
    assert!(launch.is_distributed());
    assert!(
        lints
            .iter()
            .any(|l| l.key == "num_processes" && l.severity == Severity::Warning),
        "{lints:?}"
    );
    let dm = lint::device_map("script.py", SEED002_SCRIPT, Some(&launch));
    assert_eq!(dm.len(), 1, "{dm:?}");
    assert_eq!(dm[0].severity, Severity::Error);
    assert!(dm[0].message.contains("accelerate refuses"));

    // The seed's "fixed" config does not even launch: an unknown top-level key.
    let (fixed, lints) =
        lint::accelerate(SEED002_ACCEL_FIXED, Path::new("fixed.yaml"), cx).expect("parses");
    let find = |key: &str, sev| lints.iter().any(|l| l.key == key && l.severity == sev);
    assert!(
        find("gradient_accumulation_steps", Severity::Error),
        "{lints:?}"
    );
    assert!(
        find("distributed_type", Severity::Warning),
        "unquoted NO: {lints:?}"
    );
    assert!(find("gpu_ids", Severity::Warning), "a YAML list: {lints:?}");
    assert!(!fixed.is_distributed());
    let dm = lint::device_map("script.py", SEED002_SCRIPT, Some(&fixed));
    assert_eq!(dm[0].severity, Severity::Info);
}

#[test]
fn seed003_reproduced_on_an_h100_is_the_shortage_the_estimate_predicts() {
    // Not a reconstruction: bench/pipelines/seed003-resident.json ran on an H100 80GB HBM3 and
    // PyTorch raised this in the first policy step, as the seed's run did (same 192 MiB request).
    let text = include_str!("../../../headroom-cli/tests/fixtures/seed003/oom-h100-reproduced.log");
    let m = oom_message::parse(text).expect("message");
    let gib = |x: f64| (x * GIB as f64).round() as u64;
    assert_eq!(m.tried_to_allocate_bytes, Some(192 << 20));
    assert_eq!(m.total_capacity_bytes, Some(gib(79.18)));
    assert_eq!(m.allocated_by_pytorch_bytes, Some(gib(77.29)));
    assert_eq!(m.reserved_unallocated_bytes, Some(gib(1.08)));
    assert_eq!(oom_message::explain(&m).cause, Cause::Shortage);

    let setup = setup_for(text, SEED003_TRAIN, SEED003_REF, 1);
    assert_eq!(setup.gpu.name, "h100-80gb");
    let check = diagnose::check_spec(&setup, Some(&m)).expect("checks");
    assert!(!check.baseline.fits, "it ran out on this GPU");
    // Moving the reference off the GPU is enough: the policy step alone measured 76.07 GiB
    // reserved on this H100 (bench/calibration/h100-torch2.11.jsonl) and ran.
    let moved = plan::evaluate(
        &setup,
        &plan::Knobs {
            residents_off_gpu: true,
            ..plan::Knobs::of(&setup.spec)
        },
    )
    .expect("evaluates");
    assert!(moved.fits);
}
