//! `fit` against the estimator and against measurements: the largest micro-batch and
//! sequence it reports fit and one more does not, and the estimate's fits/does-not-fit
//! verdict agrees with what measured runs imply for real GPU capacities.

use std::path::Path;

use headroom::estimate;
use headroom::gpu::{self, Gpu};
use headroom::plan::{self, Setup};
use headroom::spec::RunSpec;
use serde_json::Value;

use crate::common;

fn spec(yaml: &str) -> RunSpec {
    RunSpec::from_str_at(yaml, Path::new("test.yaml")).expect("valid spec")
}

fn custom(gib: u64) -> Gpu {
    gpu::find(&format!("{gib}GiB")).expect("custom size")
}

/// The verdict straight from the estimator, independent of `plan`.
fn fits(spec: &RunSpec, gpu: &Gpu) -> bool {
    estimate::estimate(spec, None, gpu)
        .expect("estimates")
        .fits()
}

fn setup(spec: RunSpec, gpu: Gpu) -> Setup<'static> {
    Setup {
        spec,
        spec_dir: None,
        gpu,
        gpus: 1,
        residents: Vec::new(),
        launcher: Default::default(),
    }
}

#[test]
fn largest_micro_batch_fits_and_one_more_does_not() {
    let base = spec("model: qwen2.5-0.5b\nprecision: bf16\nseq_len: 1024\nbatch_size: 4\n");
    let gpu = custom(24);
    let s = setup(base.clone(), gpu.clone());
    let b = plan::max_micro_batch(&s)
        .expect("searches")
        .expect("batch 1 fits in 24 GiB");
    assert!(
        b > 1,
        "a 0.5B model fits more than one sequence of 1024 in 24 GiB"
    );
    let with = |n| RunSpec {
        batch_size: n,
        ..base.clone()
    };
    assert!(fits(&with(b), &gpu), "batch {b} should fit");
    assert!(!fits(&with(b + 1), &gpu), "batch {} should not fit", b + 1);
}

#[test]
fn longest_sequence_fits_and_a_few_percent_more_does_not() {
    let base =
        spec("model: qwen2.5-0.5b\nprecision: bf16\nbatch_size: 2\ngradient_checkpointing: true\n");
    let gpu = custom(16);
    let s = setup(base.clone(), gpu.clone());
    let n = plan::max_seq_len(&s, 32768)
        .expect("searches")
        .expect("a token fits");
    assert!(n < 32768, "the cap is not what stopped the search");
    let with = |s| RunSpec {
        seq_len: s,
        ..base.clone()
    };
    assert!(fits(&with(n), &gpu));
    // Right at the boundary a token more can still fit: how the allocator packs blocks near
    // the capacity is not monotonic in the size of each (PyTorch's is not either). A few
    // percent more must not.
    assert!(
        !fits(&with(n + n / 20), &gpu),
        "{} tokens should not fit",
        n + n / 20
    );
}

#[test]
fn no_batch_fits_when_the_weights_alone_do_not() {
    let s = setup(spec("model: llama-3.1-8b\nprecision: fp32\n"), custom(16));
    assert_eq!(plan::max_micro_batch(&s).expect("searches"), None);
}

#[test]
fn the_pareto_front_fits_and_is_not_dominated() {
    let s = setup(
        spec("model: qwen2.5-1.5b\nprecision: amp-bf16\nbatch_size: 8\nseq_len: 1024\n"),
        gpu::find("a10g").expect("catalog"),
    );
    let report = plan::fit(&s).expect("fits");
    assert!(
        !report.baseline.fits,
        "the spec itself is too large for an A10G"
    );
    assert!(!report.front.is_empty());
    for e in &report.front {
        assert!(e.fits && e.device_bytes <= s.gpu.total_bytes);
        // Simulated points are reproducible from their spec alone.
        if !e.computed {
            let est = plan::simulate(&s, &e.knobs).expect("estimates");
            assert_eq!(e.device_bytes, est.device_bytes().max(e.device_bytes));
        }
    }
    // Sorted by the score that picks the recommendation.
    let scores: Vec<f64> = report.front.iter().map(plan::score).collect();
    assert!(scores.windows(2).all(|w| w[0] <= w[1] + 1e-9), "{scores:?}");
}

/// Calibration rows measured on the H200 (ours and the shared ones) and on the H100.
fn measured_rows() -> Vec<Value> {
    [
        include_str!("../../../../bench/calibration/h200-torch2.11.jsonl"),
        include_str!("../../../../bench/shared/calibration/h200-torch2.11.jsonl"),
        include_str!("../../../../bench/calibration/h100-torch2.11.jsonl"),
    ]
    .iter()
    .flat_map(|text| text.lines())
    .filter(|l| !l.trim().is_empty())
    .map(|l| serde_json::from_str(l).expect("calibration rows are JSON"))
    .collect()
}

fn measured(row: &Value, key: &str) -> u64 {
    row["measured"][key].as_u64().expect("measured bytes")
}

/// A run is certain to fit a GPU that holds its measured reserved peak (the caching allocator
/// never asked for more) and certain not to fit one smaller than its measured allocated peak
/// (live tensors cannot be freed). In between it depends on whether freeing the cache and
/// retrying is enough, which only a run on that GPU tells.
fn certain_verdict(row: &Value, gpu: &Gpu) -> Option<bool> {
    let context = gpu.cuda_context_bytes;
    if measured(row, "peak_reserved_bytes") + context <= gpu.total_bytes {
        Some(true)
    } else if measured(row, "peak_allocated_bytes") + context > gpu.total_bytes {
        Some(false)
    } else {
        None
    }
}

#[test]
fn verdicts_agree_with_measured_peaks_just_above_and_below() {
    let rows = measured_rows();
    assert!(rows.len() >= 100);
    let context = Gpu::default().cuda_context_bytes;
    let mut wrong = Vec::new();
    for row in &rows {
        let spec = RunSpec::from_value(&row["spec"]).expect("row spec");
        let reserved = measured(row, "peak_reserved_bytes") + context;
        let allocated = measured(row, "peak_allocated_bytes") + context;
        for (total, should_fit) in [
            ((reserved as f64 * 1.05) as u64, true),
            ((allocated as f64 * 0.97) as u64, false),
        ] {
            let gpu = Gpu {
                name: "custom",
                total_bytes: total,
                ..Gpu::default()
            };
            if fits(&spec, &gpu) != should_fit {
                wrong.push(format!("{} on {total} bytes", row["id"]));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn verdicts_agree_with_measured_runs_near_real_gpu_capacities() {
    // Every catalog GPU a measured run nearly fills (or overflows) whose verdict the
    // measurement decides.
    let mut checked = 0;
    let mut wrong = Vec::new();
    for row in measured_rows() {
        let spec = RunSpec::from_value(&row["spec"]).expect("row spec");
        for gpu in gpu::catalog() {
            let near = measured(&row, "peak_allocated_bytes") as f64 / gpu.total_bytes as f64;
            if !(0.85..=1.15).contains(&near) {
                continue;
            }
            let Some(verdict) = certain_verdict(&row, &gpu) else {
                continue;
            };
            checked += 1;
            if fits(&spec, &gpu) != verdict {
                wrong.push(format!("{} on {}: measured {verdict}", row["id"], gpu.name));
            }
        }
    }
    assert!(checked >= 20, "only {checked} runs near a catalog GPU");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn runs_measured_at_the_h100s_capacity_fit_and_reserve_what_they_reserved() {
    // bench/calibration/h100-capacity-specs.jsonl: seven runs chosen to land within a few GiB
    // of the H100's 79.18 GiB, several of which reserve 77-90 GiB on a larger GPU. All ran.
    // They fit because the allocator frees its cache and retries before giving up, which the
    // simulation at the GPU's capacity reproduces, reserved bytes included.
    let h100 = gpu::find("h100-80gb").expect("catalog");
    let capacity_runs = include_str!("../../../../bench/calibration/h100-capacity-specs.jsonl");
    let ids: Vec<String> = capacity_runs
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).expect("json")["id"]
                .as_str()
                .expect("id")
                .to_string()
        })
        .collect();
    let rows: Vec<Value> = include_str!("../../../../bench/calibration/h100-torch2.11.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .filter(|r: &Value| ids.iter().any(|id| r["id"] == id.as_str()))
        .collect();
    assert_eq!(rows.len(), 7);
    for row in rows {
        let spec = RunSpec::from_value(&row["spec"]).expect("row spec");
        let est = estimate::estimate(&spec, None, &h100).expect("estimates");
        assert!(est.fits(), "{} ran on the H100", row["id"]);
        let reserved = measured(&row, "peak_reserved_bytes") as f64;
        let error = (est.peak_reserved_bytes as f64 - reserved) / reserved;
        assert!(
            error.abs() < 0.03,
            "{}: reserved error {error:+.3}",
            row["id"]
        );
    }
}

#[test]
fn zero_stages_of_a_bf16_full_fine_tune_are_simulated_not_computed() {
    let base = spec(
        "model: qwen2.5-1.5b\nprecision: bf16\noptimizer: adamw\nbatch_size: 4\nseq_len: 1024\ngradient_checkpointing: true\n",
    );
    let s = Setup {
        gpus: 2,
        ..setup(base.clone(), gpu::find("h200").expect("gpu"))
    };
    let knobs = plan::Knobs::of(&s.spec);
    for (sharding, strategy) in [
        (plan::Sharding::Zero1, "zero1"),
        (plan::Sharding::Zero2, "zero2"),
        (plan::Sharding::Zero3, "fsdp"),
    ] {
        let e = plan::evaluate(
            &s,
            &plan::Knobs {
                sharding,
                ..knobs.clone()
            },
        )
        .expect("evaluates");
        assert!(!e.computed, "{strategy}");
        let direct = spec(&format!(
            "model: qwen2.5-1.5b\nprecision: bf16\noptimizer: adamw\nbatch_size: 4\nseq_len: 1024\ngradient_checkpointing: true\nparallel: {{strategy: {strategy}, world_size: 2}}\n"
        ));
        let est = estimate::estimate(&direct, None, &gpu::find("h200").expect("gpu")).expect("est");
        assert_eq!(
            e.peak_allocated_bytes, est.peak_allocated_bytes,
            "{strategy}"
        );
    }
    // With fp32 parameters under autocast, ZeRO-1/2 stay computed (DeepSpeed turns autocast off).
    let amp = Setup {
        gpus: 2,
        ..setup(
            spec("model: qwen2.5-1.5b\nprecision: amp-bf16\nbatch_size: 4\nseq_len: 1024\n"),
            gpu::find("h200").expect("gpu"),
        )
    };
    let k = plan::Knobs {
        sharding: plan::Sharding::Zero2,
        ..plan::Knobs::of(&amp.spec)
    };
    assert!(plan::evaluate(&amp, &k).expect("evaluates").computed);
}

/// The search evaluates every configuration as `plan::evaluate` does on its own: a sharding or
/// offload the estimator models is simulated as that run, not read off the unsharded one.
#[test]
fn search_evaluates_each_configuration_as_its_own_simulation() {
    let base = spec(
        "model: qwen2.5-0.5b\nprecision: bf16\noptimizer: adamw\nbatch_size: 2\nseq_len: 512\ngradient_checkpointing: true\n",
    );
    for gpus in [1, 2] {
        let s = Setup {
            gpus,
            ..setup(base.clone(), gpu::find("h100-80gb").expect("gpu"))
        };
        let all = plan::search(&s).expect("search");
        let mut simulated_shardings = 0;
        let sharded = |k: &plan::Knobs| k.sharding != plan::Sharding::None || k.cpu_offload;
        for e in all.iter().filter(|e| !e.computed && sharded(&e.knobs)) {
            let alone = plan::evaluate(&s, &e.knobs).expect("evaluates");
            assert_eq!(
                (alone.peak_allocated_bytes, alone.device_bytes),
                (e.peak_allocated_bytes, e.device_bytes),
                "{gpus} GPUs: {:?}",
                e.knobs
            );
            simulated_shardings += 1;
        }
        assert!(
            simulated_shardings > 0,
            "{gpus} GPUs: no simulated sharding or offload"
        );
    }
}

/// ZeRO-Offload on one GPU (DeepSpeed ZeRO-2 of one rank with `offload_optimizer`) is simulated,
/// and the simulation is the measured one (bench/distributed/h200x1/h200x1-torch2.11.jsonl).
#[test]
fn zero_offload_on_one_gpu_is_the_measured_run() {
    let rows = common::jsonl(&[include_str!(
        "../../../../bench/distributed/h200x1/h200x1-torch2.11.jsonl"
    )]);
    let row = rows
        .iter()
        .find(|r| r["id"] == "zero2-offload-optimizer/qwen2.5-1.5b/bf16/bs4/s1024/gc/w1")
        .expect("row");
    let mut plain = RunSpec::from_value(&row["spec"]).expect("spec");
    plain.parallel = None;
    let h200 = gpu::find("h200").expect("gpu");
    let s = setup(plain, h200.clone());
    let k = plan::Knobs {
        cpu_offload: true,
        ..plan::Knobs::of(&s.spec)
    };
    let e = plan::evaluate(&s, &k).expect("evaluates");
    assert!(!e.computed);
    let measured = row["measured"]["peak_allocated_bytes"]
        .as_u64()
        .expect("peak");
    let err = common::rel(e.peak_allocated_bytes, measured);
    assert!(err.abs() < 0.005, "allocated {err:+.4}");
    assert!(
        plan::describe(&s, &k)
            .iter()
            .any(|d| d.contains("ZeRO-Offload")),
        "{:?}",
        plan::describe(&s, &k)
    );
}

/// On an MoE model whose experts peft would wrap, the LoRA a remedy proposes adapts the
/// attention only: peft's `all-linear` there rebuilds every expert stack as `W + BA` and keeps
/// it for backward, which costs more than the adapters save.
#[test]
fn a_lora_remedy_on_moe_leaves_the_experts_frozen() {
    use headroom::spec::LoraTargets;
    let base = spec(
        "model: qwen3-30b-a3b\nprecision: bf16\noptimizer: adamw\nbatch_size: 2\nseq_len: 2048\n\
         gradient_checkpointing: true\n",
    );
    let lora = plan::remedy_lora(&base, None);
    let LoraTargets::Modules(names) = &lora.targets else {
        panic!("all-linear proposed for an MoE model");
    };
    assert_eq!(names, &["q_proj", "k_proj", "v_proj", "o_proj"]);
    assert!(lora.target_parameters.is_empty());
    // The same adapter on every linear layer, as peft builds it there, needs more.
    let gpu = gpu::find("h100").unwrap();
    let peak = |lora: headroom::spec::Lora| {
        let mut s = base.clone();
        s.lora = Some(lora);
        estimate::estimate(&s, None, &gpu)
            .unwrap()
            .peak_allocated_bytes
    };
    assert!(peak(lora.clone()) < peak(plan::default_lora()));
    // A model given by a config.json beside the spec is read from there too.
    let dir = std::env::temp_dir().join(format!("headroom-remedy-lora-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = headroom::catalog::resolve("qwen3-30b-a3b", None)
        .unwrap()
        .config;
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let relative = RunSpec::from_str_at("model: ./config.json\n", &dir.join("spec.yaml")).unwrap();
    assert_eq!(
        plan::remedy_lora(&relative, Some(&dir)).targets,
        lora.targets
    );
    std::fs::remove_dir_all(&dir).ok();
    // A dense model keeps peft's usual recipe.
    let dense = spec("model: qwen3-8b\nprecision: bf16\n");
    assert_eq!(
        plan::remedy_lora(&dense, None).targets,
        LoraTargets::AllLinear
    );
}
