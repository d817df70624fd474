//! Data-parallel estimates against the per-rank measurements of bench/distributed (FSDP2, DDP
//! and DeepSpeed ZeRO 1/2 on 2 x H200; HSDP, FSDP2 and DDP on 4 x H200; DeepSpeed ZeRO 1/2/3
//! with and without `offload_optimizer` on one H200): the peak of every measured phase of every step, and the
//! run's reserved peak; for rank 0 under FSDP2 and DDP (ranks measured equal to the byte), the
//! larger rank under ZeRO.

use headroom::gpu;
use headroom::spec::{RunSpec, Strategy};
use serde_json::Value;

use crate::common::{self, rel};

fn rows() -> Vec<Value> {
    common::jsonl(&[
        include_str!("../../../../bench/distributed/h200x2/h200x2-torch2.11.jsonl"),
        include_str!("../../../../bench/distributed/h200x4/h200x4-torch2.11.jsonl"),
        include_str!("../../../../bench/distributed/h200x1/h200x1-torch2.11.jsonl"),
        include_str!(
            "../../../../bench/distributed/h200x1-param-offload/h200x1-param-offload.jsonl"
        ),
    ])
}

/// Every step's forward, backward and optimizer peaks against `measured(step index, key)`,
/// within 0.5%; returns how many were checked.
fn check_steps(
    id: &str,
    est: &headroom::estimate::Estimate,
    measured: impl Fn(usize, &str) -> u64,
) -> usize {
    let mut checked = 0;
    for i in 0..3 {
        for (key, name) in [
            ("fwd_peak", "forward"),
            ("bwd_peak", "backward"),
            ("opt_peak", "optimizer"),
        ] {
            let e = est
                .phases
                .iter()
                .find(|p| p.step == i as u32 + 1 && p.phase == name)
                .unwrap_or_else(|| panic!("{id}: no {name} {}", i + 1));
            let err = rel(e.peak_allocated, measured(i, key));
            assert!(
                err.abs() < 0.005,
                "{id} step {} {name}: allocated {err:+.4}",
                i + 1
            );
            checked += 1;
        }
    }
    checked
}

/// The DeepSpeed rows whose world size `keep` accepts, each with its spec and estimate.
fn deepspeed_estimates(
    keep: impl Fn(u64) -> bool,
) -> Vec<(Value, RunSpec, headroom::estimate::Estimate)> {
    rows()
        .into_iter()
        .filter_map(|row| {
            let id = row["id"].as_str().expect("id").to_string();
            let spec = RunSpec::from_value(&row["spec"]).expect(&id);
            let parallel = spec.parallel.as_ref().expect("parallel");
            if !parallel.strategy.is_deepspeed() || !keep(parallel.world_size) {
                return None;
            }
            let gpu = gpu::from_device_name(row["env"]["gpu"].as_str().expect("gpu")).expect("gpu");
            let est = headroom::estimate::estimate(&spec, None, &gpu).expect(&id);
            Some((row, spec, est))
        })
        .collect()
}

/// [`check_steps`] against rank 0's phases; returns how many were checked and the reserved
/// peak's error.
fn check_rank0(id: &str, est: &headroom::estimate::Estimate, row: &Value) -> (usize, f64) {
    let rank = &row["measured"]["ranks"][0];
    let checked = check_steps(id, est, |i, key| rank["steps"][i][key].as_u64().expect(key));
    let reserved = rel(
        est.peak_reserved_bytes,
        row["measured"]["peak_reserved_bytes"]
            .as_u64()
            .expect("reserved"),
    );
    (checked, reserved)
}

#[test]
fn every_phase_of_every_fsdp_and_ddp_row() {
    let mut checked = 0;
    for row in rows() {
        let id = row["id"].as_str().expect("id");
        let spec = RunSpec::from_value(&row["spec"]).expect(id);
        let strategy = spec.parallel.as_ref().expect("parallel").strategy;
        if !matches!(strategy, Strategy::Fsdp | Strategy::Ddp) {
            continue;
        }
        let gpu = gpu::from_device_name(row["env"]["gpu"].as_str().expect("gpu")).expect("gpu");
        let est = headroom::estimate::estimate(&spec, None, &gpu).expect(id);
        let (phases, reserved) = check_rank0(id, &est, &row);
        checked += phases;
        let limit = if strategy == Strategy::Fsdp {
            0.005
        } else {
            0.07
        };
        assert!(reserved.abs() < limit, "{id}: reserved {reserved:+.4}");
    }
    assert!(checked >= 90, "{checked} phases checked");
}

#[test]
fn sharding_moves_memory_where_the_measurements_say() {
    let estimate = |strategy: &str, extra: Value| {
        let mut spec = serde_json::json!({"model": "qwen2.5-1.5b", "precision": "amp-bf16",
            "optimizer": "adamw", "batch_size": 4, "seq_len": 1024,
            "gradient_checkpointing": true,
            "parallel": {"strategy": strategy, "world_size": 2}});
        for (k, v) in extra.as_object().expect("object") {
            spec["parallel"][k] = v.clone();
        }
        let spec = RunSpec::from_value(&spec).expect("spec");
        headroom::estimate::estimate(&spec, None, &gpu::find("h200").expect("gpu"))
            .expect("estimate")
    };
    let full = estimate("fsdp", serde_json::json!({}));
    let kept = estimate("fsdp", serde_json::json!({"reshard_after_forward": false}));
    let ddp = estimate("ddp", serde_json::json!({}));
    // Keeping every layer's fp32 parameters from forward to backward costs the unsharded
    // layers (28 x 46.8M x 4 B = 4.9 GiB, measured +4.90 GiB); DDP holds full replicas plus
    // its gradient buckets.
    let gib = (1u64 << 30) as f64;
    let extra = (kept.peak_allocated_bytes - full.peak_allocated_bytes) as f64 / gib;
    assert!((4.8..5.0).contains(&extra), "{extra}");
    assert!(ddp.peak_allocated_bytes > full.peak_allocated_bytes + (10u64 << 30));
}

/// DeepSpeed ZeRO stages 1, 2 and 3 over two ranks (bf16, torch AdamW; ZeRO-3 with and
/// without `offload_optimizer`, its per-module gathers those of `PartitionedParameterCoordinator`):
/// the estimate is the rank that needs most, so every phase is checked against the larger of
/// the two ranks' peaks, the load phase against rank 1 (rank 0's is cut short by DeepSpeed's
/// `see_memory_usage` resetting the peak statistics), and the reserved peak against the larger
/// rank's. Measured errors of the ZeRO-3 rows: allocated within +0.11% (+2.0 MiB, step 1's
/// optimizer), the load exact, reserved within +0.02%; the gate is the (allocated 5%,
/// reserved 10%) tightened to 0.5% and 1%.
#[test]
fn every_phase_of_every_multi_rank_deepspeed_row() {
    let mut checked = 0;
    for (row, _, est) in deepspeed_estimates(|world| world > 1) {
        let id = row["id"].as_str().expect("id");
        let ranks = row["measured"]["ranks"].as_array().expect("ranks");
        let phase = |step: u32, name: &str| {
            est.phases
                .iter()
                .find(|p| p.step == step && p.phase == name)
                .unwrap_or_else(|| panic!("{id}: no {name} {step}"))
                .peak_allocated
        };
        let load = ranks[1]["load"]["peak_allocated"].as_u64().expect("load");
        let err = rel(phase(0, "load"), load);
        assert!(err.abs() < 0.005, "{id} load: allocated {err:+.4}");
        checked += check_steps(id, &est, |i, key| {
            ranks
                .iter()
                .map(|r| r["steps"][i][key].as_u64().expect(key))
                .max()
                .expect("ranks")
        });
        let reserved = rel(
            est.peak_reserved_bytes,
            row["measured"]["peak_reserved_bytes"]
                .as_u64()
                .expect("reserved"),
        );
        assert!(reserved.abs() < 0.01, "{id}: reserved {reserved:+.4}");
    }
    assert_eq!(checked, 63, "{checked} step phases checked");
}

/// DeepSpeed on one rank (bench/distributed/h200x1/h200x1-torch2.11.jsonl,
/// bench/distributed/h200x1-param-offload/h200x1-param-offload.jsonl):
/// ZeRO-3 with and without checkpointing, `offload_optimizer` and `offload_param` (with and
/// without `offload_optimizer`), and ZeRO 1/2 with
/// `offload_optimizer`, every phase of every step, the load phase and the reserved peak. (The
/// rows were measured with DeepSpeed's own `reset_peak_memory_stats()` calls silenced while
/// the engine is built: rank 0's load peak is whole.) Measured errors: allocated within 0.14%
/// (+2.0 MiB, step 1's optimizer), the load exact, reserved within 0.02% but the full-size
/// `offload_param` row's -2.8%; the gate is the (allocated 5%, reserved 10%)
/// tightened to 0.5% and 1% (3% for `offload_param`).
#[test]
fn every_phase_of_every_one_rank_deepspeed_row() {
    let mut checked = 0;
    for (row, spec, est) in deepspeed_estimates(|world| world == 1) {
        let id = row["id"].as_str().expect("id");
        let parallel = spec.parallel.as_ref().expect("parallel");
        let (phases, reserved) = check_rank0(id, &est, &row);
        checked += phases;
        // The full-size Qwen `offload_param` rows' step 3 reserves one more 446 MiB segment
        // than its step 2 (an embedding-sized block), which the simulation does not: -2.8%
        // and -1.1% (bench/distributed/ZERO3.md).
        let limit = if parallel.offload_params { 0.03 } else { 0.01 };
        assert!(reserved.abs() < limit, "{id}: reserved {reserved:+.4}");
        let load = &row["measured"]["ranks"][0]["load"];
        let e = est.phases.iter().find(|p| p.phase == "load").expect("load");
        for (estimated, key) in [
            (e.peak_allocated, "peak_allocated"),
            (e.peak_reserved, "peak_reserved"),
        ] {
            let err = rel(estimated, load[key].as_u64().expect(key));
            assert!(err.abs() < 0.005, "{id} load: {key} {err:+.4}");
        }
        checked += 1;
        if parallel.offload_optimizer {
            assert!(
                est.host_bytes >= est.trainable_params * 16,
                "{id}: host bytes"
            );
        }
    }
    assert_eq!(checked, 160, "{checked} phases checked");
}

/// What a rank holds on the device at the end (nvidia-smi's reading): reserved, the CUDA
/// context and NCCL's communicators, against `device_used_end_bytes` of every FSDP2, DDP and
/// DeepSpeed row (its reserved bytes at the end are the run's peak).
#[test]
fn device_totals_include_the_communicators() {
    let mut checked = 0;
    for row in rows() {
        let id = row["id"].as_str().expect("id");
        let spec = RunSpec::from_value(&row["spec"]).expect(id);
        let parallel = spec.parallel.as_ref().expect("parallel");
        let gpu = gpu::from_device_name(row["env"]["gpu"].as_str().expect("gpu")).expect("gpu");
        let est = headroom::estimate::estimate(&spec, None, &gpu).expect(id);
        let used = row["measured"]["ranks"]
            .as_array()
            .expect("ranks")
            .iter()
            .map(|r| r["device_used_end_bytes"].as_u64().expect("device used"))
            .max()
            .expect("ranks");
        let err = rel(est.device_bytes(), used);
        // The 28-layer DDP rows carry the reserved gap of the allocator's address ties; the
        // full-size ZeRO-3 `offload_param` row the 446 MiB segment its step 3 adds.
        let limit = if id.starts_with("ddp/qwen2.5-1.5b/") {
            0.065
        } else if parallel.offload_params {
            0.03
        } else {
            0.005
        };
        assert!(err.abs() < limit, "{id}: device {err:+.4}");
        checked += 1;
    }
    assert!(checked >= 16, "{checked} rows");
}

/// DDP's own small device tensors against the traced run of the same spec, where the real
/// `DistributedDataParallel` and its C++ Reducer ran (`bench/trace/ddp`): the constructor's
/// parameter check (the count, its all-gather outputs and NCCL's flat buffer, the shape
/// metadata) and the bucket rebuild's index copies (`sync_bucket_indices`), in the same
/// order and sizes.
#[test]
fn ddp_small_device_tensors_are_the_reducers() {
    use headroom::sim::Component;
    use headroom::trace::{Event, StorageKind};
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let trace = headroom::trace::read(
        &root.join("bench/trace/ddp/ddp__qwen2.5-1.5b-4l__amp_bf16__bs4__s1024__gc.json.gz"),
    )
    .expect("trace");
    let small = 1 << 20;
    let outside_modules = |i: u32| {
        let s = &trace.storages[i as usize];
        (s.bytes < small
            && s.kind == StorageKind::Temporary
            && s.module.is_empty()
            && matches!(
                s.op.as_str(),
                "aten.empty.memory_format" | "aten.empty_like.default"
            ))
        .then_some(s.bytes)
    };
    let traced: Vec<(bool, u64)> = trace
        .events
        .iter()
        .filter_map(|e| match *e {
            Event::Alloc(i) => outside_modules(i).map(|b| (true, b)),
            Event::Free(i) => outside_modules(i).map(|b| (false, b)),
            _ => None,
        })
        .collect();
    let spec = RunSpec::from_value(&trace.spec).expect("spec");
    let events = native_events(&spec);
    let native: Vec<(bool, u64)> = events
        .iter()
        .filter(|e| {
            e.component == Component::Communication
                && e.bytes < small
                && !e.label.starts_with("broadcast_coalesced")
        })
        .map(|e| (e.alloc, e.bytes))
        .collect();
    // The check makes ten requests over two ranks, the rebuild four.
    assert_eq!(traced.len(), 14, "{traced:?}");
    assert_eq!(native, traced);
}

/// The embedding's backward past 3072 indices (`embedding_backward_cuda_kernel`) as the rank-0
/// snapshot of the 4-layer DDP run recorded it (`bench/distributed/h200x2/ddp-q15-4l.pickle.gz`,
/// 4096 indices into 151936 fp32 rows of 1536): after the gradient's zeros, the partial
/// segments' offsets (36,040 bytes) and their fp32 sums (27,678,720 bytes), freed at once.
#[test]
fn embedding_backward_makes_its_partial_segment_buffers() {
    let row = rows()
        .into_iter()
        .find(|r| r["id"] == "ddp/qwen2.5-1.5b-4l/amp_bf16/bs4/s1024/gc")
        .expect("the 4-layer DDP row");
    let spec = RunSpec::from_value(&row["spec"]).expect("spec");
    let events = native_events(&spec);
    let at = events
        .iter()
        .position(|e| e.alloc && e.label == "grad of embedding")
        .expect("the embedding's gradient");
    let after: Vec<(bool, u64)> = events[at + 1..]
        .iter()
        .take(12)
        .map(|e| (e.alloc, e.bytes))
        .collect();
    assert_eq!(after[5], (true, 36_040));
    assert_eq!(after[6], (true, 27_678_720));
    assert_eq!(after[7], (false, 27_678_720));
}

/// The estimate's allocations and frees of `spec` on the default GPU, without a device limit.
fn native_events(spec: &RunSpec) -> Vec<headroom::sim::SimulatedEvent> {
    let (_, events) = headroom::estimate::estimate_with_trace(
        spec,
        None,
        &gpu::Gpu::default(),
        headroom::estimate::Limit::None,
        true,
    )
    .expect("estimate");
    events
}

/// The measured fake-group MoE row `id` of bench/moe, its spec and its GPU.
fn moe_dist_row(id: &str) -> (Value, RunSpec, gpu::Gpu) {
    let rows = common::jsonl(&[include_str!(
        "../../../../bench/moe/dist-rows-h100-torch2.11-fake8.jsonl"
    )]);
    let row = rows.into_iter().find(|r| r["id"] == id).expect(id);
    let spec = RunSpec::from_value(&row["spec"]).expect("spec");
    let gpu = gpu::from_device_name(row["env"]["gpu"].as_str().expect("gpu")).expect("gpu");
    (row, spec, gpu)
}

/// Rank 0's peak allocated of the row against its measured steps' peak.
fn rank0_peak_error(row: &Value, spec: &RunSpec, gpu: &gpu::Gpu) -> f64 {
    let est = headroom::estimate::estimate_rank(spec, None, gpu, 0).expect("estimate");
    let measured =
        headroom::validate::ranks_steps_peak(row["measured"]["ranks"].as_array().expect("ranks"))
            .expect("steps");
    rel(est.peak_allocated_bytes, measured)
}

/// The router's `hidden_states.reshape(-1, hidden_dim)` is a node of its own: the router's
/// input gradient waits in it while the router weight's `AccumulateGrad` runs ZeRO-2's
/// gradient hook, so the hook's bucket flatten (1,498,396,672 bytes in Mixtral's layer 1) finds
/// both halves of the block's input gradient alive, as the trace of
/// `moe-dist/mixtral-8x7b/L2/zero2/bf16/bs2/s2048/w8` (bench/trace/zero) records; rank 0's peak
/// is then the measured one (it was 32 MiB, -0.19%, short).
#[test]
fn zero2_router_input_gradient_waits_for_the_router_weights_hook() {
    let (row, spec, gpu) = moe_dist_row("moe-dist/mixtral-8x7b/L2/zero2/bf16/bs2/s2048/w8");
    let err = rank0_peak_error(&row, &spec, &gpu);
    assert!(err.abs() < 0.0001, "peak allocated {err:+.5}");
}

/// DeepSpeed 0.18.2 makes Qwen3-MoE's sparse MoE block a ZeRO-3 leaf module
/// (`leaf_module_config.py`), as the trace of
/// `moe-dist/qwen3-30b-a3b/L8/zero3/bf16/bs2/s2048/gc/w8`
/// (bench/trace/zero, replayed within 0.001% of the measured peak) records it: step 1 gathers
/// the router and both expert stacks in one flat buffer at the block (1,208,483,840 bytes);
/// from step 2 a prefetch bucket stops at the experts, which come before the router, so the
/// first flat buffer is the attention's and `gate_up_proj` (843,055,104) and every later one
/// the router's with the next layer's (843,579,392); the blocks' gradients are reduced by
/// their backward hook, in the trace's buckets; and the attention weights the forward
/// gathers stay gathered until their backward (a linear's release sees no parameter of a
/// later leaf), which puts rank 0's peak where the measurement has it.
#[test]
fn zero3_moe_blocks_are_leaves_as_deepspeed_makes_them() {
    let (row, spec, gpu) = moe_dist_row("moe-dist/qwen3-30b-a3b/L8/zero3/bf16/bs2/s2048/gc/w8");
    let events = native_events(&spec);
    let allocated = |label: &str| -> Vec<u64> {
        events
            .iter()
            .filter(|e| e.alloc && e.label.starts_with(label))
            .map(|e| e.bytes)
            .collect()
    };
    let gathers = allocated("ZeRO-3 all_gather");
    let (mib, kib) = (1 << 20, 1 << 10);
    let step1_layer0 = [16 * mib, 4 * kib, 1_208_483_840, 4 * kib, 16 * mib];
    assert!(
        gathers.windows(5).any(|w| w == step1_layer0),
        "step 1's block gather: {:?}",
        &gathers[..20]
    );
    let step2 = [
        622_329_856,
        843_055_104,
        402_653_184,
        843_579_392,
        402_653_184,
        843_579_392,
    ];
    assert!(
        gathers.windows(6).any(|w| w == step2),
        "step 2's prefetches: {gathers:?}"
    );
    let mut buckets = vec![622_333_952];
    buckets.extend([440_934_912; 8]);
    assert_eq!(
        allocated("reduce_scatter_coalesced flat")[9..18],
        buckets[..],
        "step 2's reduce-scatter buckets"
    );
    let err = rank0_peak_error(&row, &spec, &gpu);
    assert!(err.abs() < 0.0005, "peak allocated {err:+.5}");
}

/// On one rank too, a leaf MoE block's gradients wait for its backward hook: the layer's
/// `down_proj` gradient (402,653,184 bytes) is still held when `gate_up_proj`'s
/// (805,306,368) is made, where a parameter's own gradient hook would have copied it into
/// the bucket and freed it first.
#[test]
fn zero3_one_rank_holds_a_leaf_blocks_gradients_until_its_hook() {
    let (mut row, _, _) = moe_dist_row("moe-dist/qwen3-30b-a3b/L8/zero3/bf16/bs2/s2048/gc/w8");
    row["spec"]["parallel"]["world_size"] = 1.into();
    row["spec"]["parallel"]["shard_size"] = 1.into();
    row["spec"]["model_config"]["num_hidden_layers"] = 2.into();
    let spec = RunSpec::from_value(&row["spec"]).expect("spec");
    let events = native_events(&spec);
    let grad = "grad of expert weights (_grouped_mm)";
    let down = events
        .iter()
        .position(|e| e.alloc && e.label == grad && e.bytes == 402_653_184)
        .expect("a down_proj gradient");
    let gate_up = down
        + events[down..]
            .iter()
            .position(|e| e.alloc && e.label == grad && e.bytes == 805_306_368)
            .expect("its gate_up_proj gradient");
    let address = events[down].address;
    assert!(
        !events[down..gate_up]
            .iter()
            .any(|e| !e.alloc && e.address == address),
        "down_proj's gradient was freed before gate_up_proj's was made"
    );
}
