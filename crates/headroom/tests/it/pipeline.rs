//! Pipeline estimates against the measured policy + reference iterations of seeds 001 and 003
//! (bench/pipelines): every phase's peak allocated and reserved bytes, and the phase where the
//! run that ran out of memory ran out.

use headroom::estimate::{Limit, estimate_pipeline};
use headroom::gpu;
use headroom::spec::PipelineSpec;
use headroom_alloc::OutOfMemory;
use serde_json::Value;

use crate::common::{self, rel};

/// The allocated and reserved errors of the estimate's phase `name` of `iteration` against
/// its measurement `m`.
fn phase_errors(
    id: &str,
    est: &headroom::estimate::PipelineEstimate,
    m: &Value,
    name: &str,
    iteration: u64,
) -> (f64, f64) {
    let e = est
        .phases
        .iter()
        .find(|p| p.name == name && u64::from(p.iteration) == iteration)
        .unwrap_or_else(|| panic!("{id}: no {name} {iteration}"));
    (
        rel(e.peak_allocated, m["peak_allocated"].as_u64().unwrap()),
        rel(e.peak_reserved, m["peak_reserved"].as_u64().unwrap()),
    )
}

fn rows() -> Vec<Value> {
    common::jsonl(&[
        include_str!("../../../../bench/pipelines/h100-torch2.11.jsonl"),
        include_str!("../../../../bench/pipelines/h200-torch2.11.jsonl"),
    ])
}

#[test]
fn every_measured_phase_of_every_modelled_placement() {
    let mut checked = 0;
    for row in rows() {
        let id = row["id"].as_str().expect("id");
        let spec = PipelineSpec::from_value(&row["pipeline"]).expect(id);
        let gpu = gpu::from_device_name(row["env"]["gpu"].as_str().expect("gpu")).expect("gpu");
        let est = estimate_pipeline(&spec, None, &gpu, Limit::Gpu).expect(id);
        for m in row["measured"]["phases"].as_array().expect("phases") {
            let (name, iteration) = (
                m["phase"].as_str().unwrap(),
                m["iteration"].as_u64().unwrap(),
            );
            if let Some(message) = m["oom"].as_str() {
                let oom = est
                    .oom
                    .as_ref()
                    .unwrap_or_else(|| panic!("{id} ran out: {message}"));
                assert_eq!((oom.phase, u64::from(oom.step)), (name, iteration), "{id}");
                let OutOfMemory::Device(d) = &oom.error else {
                    panic!("{id}: {oom:?}")
                };
                let allocated = m["end_allocated"].as_u64().unwrap();
                let at_failure = 77.29 * (1u64 << 30) as f64; // from the message
                assert!(
                    (d.allocated_bytes as f64 - at_failure).abs() / at_failure < 0.03,
                    "{id}: {} allocated at the failure, measured 77.29 GiB ({allocated} after)",
                    d.allocated_bytes
                );
                checked += 1;
                continue;
            }
            let (a, r) = phase_errors(id, &est, m, name, iteration);
            assert!(a.abs() < 0.02, "{id} {name} {iteration}: allocated {a:+.4}");
            assert!(r.abs() < 0.03, "{id} {name} {iteration}: reserved {r:+.4}");
            checked += 1;
        }
    }
    assert!(checked >= 23, "{checked} phases checked");
}

#[test]
fn seed001_manual_offload_costs_transfers_and_saves_reserved_memory() {
    let row = rows()
        .into_iter()
        .find(|r| r["id"] == "seed001-manual-offload")
        .expect("row");
    let spec = PipelineSpec::from_value(&row["pipeline"]).expect("spec");
    let h200 = gpu::find("h200").expect("gpu");
    let manual = estimate_pipeline(&spec, None, &h200, Limit::Gpu).expect("manual");
    let mut as_resident = row["pipeline"].clone();
    as_resident["placement"] = "resident".into();
    let spec = PipelineSpec::from_value(&as_resident).expect("spec");
    let resident = estimate_pipeline(&spec, None, &h200, Limit::Gpu).expect("resident");
    // Resident: nothing moves; manual: the fp32 actor (6.2 GB) and the bf16 reference (3.1 GB)
    // each go out and back every iteration.
    assert_eq!(resident.transfer_bytes_per_iteration, 0);
    let actor = 1_543_714_304u64 * 4;
    let reference = 1_543_714_304u64 * 2;
    assert_eq!(manual.transfer_bytes_per_iteration, 2 * (actor + reference));
    assert!(manual.peak_reserved_bytes + (8u64 << 30) < resident.peak_reserved_bytes);
    assert_eq!(manual.host_bytes, actor + reference);
}

fn pipeline(doc: &str) -> PipelineSpec {
    let value: Value = yaml_serde::from_str(doc).expect("yaml");
    PipelineSpec::from_value(&value).expect("pipeline")
}

#[test]
fn reusing_the_fsdp_actor_saves_less_than_the_copy_it_avoids() {
    let read = |path: &str| {
        let text = std::fs::read_to_string(format!("../../{path}")).expect("example");
        pipeline(&text)
    };
    let h200 = gpu::find("h200").expect("gpu");
    let estimate = |path| estimate_pipeline(&read(path), None, &h200, Limit::None).expect(path);
    let (reuse, reload) = (
        estimate("examples/seed000-reuse.yaml"),
        estimate("examples/seed000-reload.yaml"),
    );
    let score = |phases: Vec<(String, u32, u64)>| {
        phases
            .into_iter()
            .find(|(name, iteration, _)| name == "score" && *iteration == 1)
            .expect("score 1")
            .2
    };
    let estimated = |e: &headroom::estimate::PipelineEstimate| {
        score(
            e.phases
                .iter()
                .map(|p| (p.name.clone(), p.iteration, p.peak_allocated))
                .collect(),
        )
    };
    let measured = |id: &str| {
        let row = rows().into_iter().find(|r| r["id"] == id).expect(id);
        score(
            row["measured"]["phases"]
                .as_array()
                .expect("phases")
                .iter()
                .map(|m| {
                    (
                        m["phase"].as_str().unwrap().to_string(),
                        m["iteration"].as_u64().unwrap() as u32,
                        m["peak_allocated"].as_u64().unwrap(),
                    )
                })
                .collect(),
        )
    };
    // A second Qwen2.5-3B in 16-bit is 5.75 GiB on every rank; reusing the fp32 actor under
    // bf16 autocast caches a 16-bit cast of every weight it gathers until the pass leaves
    // autocast, so reuse saves only about 3.2 GiB (measured on 2 x H200).
    let copy = 3_085_938_688u64 * 2;
    let saved = estimated(&reload) - estimated(&reuse);
    let saved_measured = measured("seed000-reload") - measured("seed000-reuse");
    assert!(saved < copy * 6 / 10, "{saved}");
    assert!(
        saved.abs_diff(saved_measured) < saved_measured / 100,
        "{saved} vs {saved_measured}"
    );
}

#[test]
fn an_engine_holds_its_share_awake_and_its_weights_on_the_host_asleep() {
    let doc = |util: f64| {
        format!(
            "instances:
  - {{name: actor, model: qwen2.5-0.5b, precision: bf16, optimizer: adamw, batch_size: 2, seq_len: 512}}
  - {{name: rollout, engine: vllm, model: qwen2.5-0.5b, precision: bf16, mode: forward, batch_size: 2, seq_len: 512, gpu_memory_utilization: {util}, sleep_level: 1}}
phases:
  - {{name: rollout, run: [{{instance: rollout, pass: generate, new_tokens: 256}}]}}
  - {{name: train, run: [actor]}}
iterations: 2"
        )
    };
    let h100 = gpu::find("h100-80gb").expect("gpu");
    let est = estimate_pipeline(&pipeline(&doc(0.5)), None, &h100, Limit::Gpu).expect("est");
    let share = (0.5 * h100.total_bytes as f64) as u64;
    let weights = 494_032_768u64 * 2;
    for p in est.phases.iter().filter(|p| p.name != "load") {
        if p.name == "rollout" {
            assert_eq!(p.engine_bytes, share, "{p:?}");
        } else {
            assert_eq!(p.engine_bytes, 0, "{p:?}");
            assert_eq!(p.host_bytes, weights, "{p:?}");
        }
    }
    assert!(est.oom.is_none() && est.fits());
    // At 97% the engine starts beside the actor's weights, but cannot wake again once the
    // actor also holds gradients' and optimizer states' worth of memory.
    let est = estimate_pipeline(&pipeline(&doc(0.97)), None, &h100, Limit::Gpu).expect("est");
    assert!(!est.fits());
    let oom = est.oom.expect("the engine does not fit");
    assert!(oom.tensor.contains("wake_up"), "{oom:?}");
    assert_eq!((oom.phase, oom.step), ("rollout", 1));
}

/// The DeepSpeed DPO pipelines of bench/pipelines/zero (one H200): a ZeRO-3 or ZeRO-2 policy
/// with a ZeRO-3 inference-engine reference (`deepspeed.initialize` without an optimizer,
/// with and without `offload_param`), and a plain bf16 reference; every phase of every
/// iteration, the load included. Measured errors: allocated within 0.01%, reserved within
/// 0.02% but `dpo-zero2-ref-offload`'s last iteration (-1.2%: it reserves one more 446 MiB
/// segment than the iteration before, which the simulation does not). Gates: allocated 0.5%,
/// reserved 2%.
#[test]
fn every_phase_of_the_deepspeed_pipelines() {
    let rows = common::jsonl(&[include_str!(
        "../../../../bench/pipelines/zero/h200-torch2.11.jsonl"
    )]);
    assert_eq!(every_phase_within(rows, 0.005, 0.02), 35);
}

/// Every phase of every row estimated on its GPU within `alloc` and `reserved` (fractions);
/// returns how many phases were checked.
fn every_phase_within(rows: Vec<Value>, alloc: f64, reserved: f64) -> usize {
    let mut checked = 0;
    for row in rows {
        let id = row["id"].as_str().expect("id");
        let spec = PipelineSpec::from_value(&row["pipeline"]).expect(id);
        let gpu = gpu::from_device_name(row["env"]["gpu"].as_str().expect("gpu")).expect("gpu");
        let est = estimate_pipeline(&spec, None, &gpu, Limit::Gpu).expect(id);
        assert!(est.oom.is_none(), "{id}");
        for m in row["measured"]["phases"].as_array().expect("phases") {
            let (name, iteration) = (
                m["phase"].as_str().unwrap(),
                m["iteration"].as_u64().unwrap(),
            );
            let (a, r) = phase_errors(id, &est, m, name, iteration);
            assert!(
                a.abs() < alloc,
                "{id} {name} {iteration}: allocated {a:+.4}"
            );
            assert!(
                r.abs() < reserved,
                "{id} {name} {iteration}: reserved {r:+.4}"
            );
            checked += 1;
        }
    }
    checked
}

/// `offload:` moves a sharded instance's shards off the GPU for the phase (`model.cpu()` on an
/// FSDP2 model moves its DTensor shards): the phase's peak falls by the shards' bytes.
#[test]
fn offloading_an_fsdp_instance_moves_its_shards() {
    let doc = |offload: &str| {
        format!(
            "instances:\n  - {{name: actor, model: qwen2.5-1.5b, precision: fp32, batch_size: 2, \
             seq_len: 512, gradient_checkpointing: true, parallel: {{strategy: fsdp, world_size: \
             8, mixed_precision: {{param_dtype: bf16, reduce_dtype: fp32}}}}}}\n  - {{name: ref, \
             model: qwen2.5-1.5b, precision: bf16, mode: forward, batch_size: 2, seq_len: \
             512}}\nphases:\n  - {{name: train, run: [actor]}}\n  - {{name: score, run: [ref]{offload}}}\n"
        )
    };
    let h100 = gpu::find("h100-80gb").expect("gpu");
    let score = |text: &str| {
        estimate_pipeline(&pipeline(text), None, &h100, Limit::None)
            .expect("estimate")
            .phases
            .into_iter()
            .find(|p| p.name == "score")
            .expect("score")
            .peak_allocated
    };
    let kept = score(&doc(""));
    let moved = score(&doc(", offload: [actor]"));
    // The fp32 shards of 1,543,714,304 parameters over 8 ranks (dim-0 padded).
    let shards = 1_543_714_304u64 * 4 / 8;
    assert!(kept > moved, "{kept} vs {moved}");
    assert!(
        (kept - moved).abs_diff(shards) < shards / 50,
        "{} moved, {shards} of shards",
        kept - moved
    );
}

/// verl's and slime's FSDP2 trainer sides (bench/pipelines/frameworks: rank 0 of 8 under the
/// fake process group, one H100): an fp32-master actor under `MixedPrecisionPolicy(bf16, fp32)`
/// with each framework's units and autocast, a reference under `CPUOffloadPolicy`, and the
/// actor's parameters (slime) or parameters and AdamW states (verl's `param_offload` and
/// `optimizer_offload`) moved to the host for the reference pass. Predicted before measuring:
/// every phase within 0.01% allocated and 0.5% reserved. Gates: 0.5% and 2%.
#[test]
fn every_phase_of_the_verl_and_slime_trainer_sides() {
    let rows = common::jsonl(&[include_str!(
        "../../../../bench/pipelines/frameworks/h100-torch2.11-fake8.jsonl"
    )]);
    assert_eq!(every_phase_within(rows, 0.005, 0.02), 14);
}

/// Pipelines with DDP, FSDP1 and bitsandbytes instances (bench/pipelines/ddp-fsdp1, one H200,
/// rank 0 under the fake process group where sharded): verl's FSDP1 actor beside its
/// CPUOffload reference at 8 ranks, DPO under DDP at 4 and with 8-bit AdamW at 2, QLoRA DPO.
/// Predicted before measuring: allocated within 0.01% on all 28 phases, reserved exact but for
/// the FSDP1 pipeline's (up to -2.7% from its reference pass on). Gates: 0.5% and 3%.
#[test]
fn every_phase_of_the_ddp_fsdp1_and_bitsandbytes_pipelines() {
    let rows = common::jsonl(&[include_str!(
        "../../../../bench/pipelines/ddp-fsdp1/h200-torch2.11-fake.jsonl"
    )]);
    assert_eq!(every_phase_within(rows, 0.005, 0.03), 28);
}

/// An offload names what moves: the states of a model that does not train, nothing at all, or
/// a key of its own are refused with the field.
#[test]
fn offload_items_are_checked() {
    let doc = |item: &str| {
        format!(
            "instances:\n  - {{name: actor, model: qwen2.5-0.5b, batch_size: 1, seq_len: 64}}\n  \
             - {{name: ref, model: qwen2.5-0.5b, mode: forward, batch_size: 1, seq_len: 64}}\n\
             phases:\n  - {{name: train, run: [actor], offload: [{item}]}}\n  - {{name: score, \
             run: [ref], offload: [{{instance: actor, optimizer: true}}]}}\n"
        )
    };
    let refused = |item: &str| {
        let value: Value = yaml_serde::from_str(&doc(item)).expect("yaml");
        PipelineSpec::from_value(&value)
            .expect_err(item)
            .to_string()
    };
    let e = refused("{instance: ref, optimizer: true}");
    assert!(
        e.contains("phases[0].offload[0].optimizer") && e.contains("no optimizer states"),
        "{e}"
    );
    let e = refused("{instance: ref, params: false, optimizer: false}");
    assert!(
        e.contains("phases[0].offload[0]") && e.contains("or both"),
        "{e}"
    );
    let e = refused("{instance: ref, grads: true}");
    assert!(e.contains("grads"), "{e}");
    let value: Value = yaml_serde::from_str(&doc("{instance: ref}")).expect("yaml");
    let spec = PipelineSpec::from_value(&value).expect("valid");
    assert_eq!(spec.phases[1].offload_optimizer, vec![0]);
    assert_eq!(spec.phases[0].offload, vec![1]);
}
