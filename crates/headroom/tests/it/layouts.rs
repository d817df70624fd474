//! `fit`'s layout search: it finds a layout that fits where one exists and says which needs
//! least where none does; its best layout's numbers are `estimate`'s of that layout's spec,
//! to the byte; the axes keep their rules; the memo only joins ranks that simulate alike.

use std::path::Path;

use headroom::estimate;
use headroom::gpu;
use headroom::plan::Setup;
use headroom::plan::layout::{self, Context, RankMemo};
use headroom::spec::RunSpec;
use serde_json::Value;

const LLAMA_70B_TP: &str =
    include_str!("../../../../examples/llama-3.1-70b-tp8-fsdp2-64xh100.yaml");

fn setup(spec: RunSpec, gpu: &str, gpus: u32) -> Setup<'static> {
    Setup {
        spec,
        spec_dir: None,
        gpu: gpu::find(gpu).expect("a catalog GPU"),
        gpus,
        residents: Vec::new(),
        launcher: Default::default(),
    }
}

fn spec(yaml: &str) -> RunSpec {
    RunSpec::from_str_at(yaml, Path::new("test.yaml")).expect("valid spec")
}

/// Llama-3.1-70B, trained as torchtitan does, on 64 H100s: a layout fits, it keeps the
/// spec's global batch and its margin, and `estimate` of the spec its keys describe (written
/// into the spec's own text) gives its numbers to the byte.
#[test]
fn llama_70b_on_64_h100s_gets_a_layout_that_estimate_confirms() {
    let s = setup(spec(LLAMA_70B_TP), "h100-80gb", 64);
    let search = layout::search(&s).expect("searches");
    let best = search.best().expect("a layout fits 64 H100s");
    assert!(best.exact, "{}", best.candidate.name());
    assert!(best.within_margin(&s.gpu), "{}", best.candidate.name());
    assert!(search.closest.is_none());
    assert!(!layout::reasons(&s, &search).is_empty());
    // Every axis is searched: several tensor-parallel degrees, with and without SP.
    let tps: std::collections::BTreeSet<u64> = search
        .ranked
        .iter()
        .map(|e| e.candidate.parallel.tensor.tp)
        .collect();
    assert!(tps.len() > 1, "{tps:?}");

    let mut doc: Value =
        serde_json::to_value(yaml_serde::from_str::<Value>(LLAMA_70B_TP).expect("yaml"))
            .expect("json");
    for (k, v) in best.candidate.spec_keys().as_object().expect("keys") {
        doc[k] = v.clone();
    }
    let chosen = RunSpec::from_value(&doc).expect("the keys make a valid spec");
    assert_eq!(
        chosen,
        best.candidate.spec(&s.spec),
        "the keys say the layout"
    );
    let est = estimate::estimate(&chosen, None, &s.gpu).expect("estimates");
    let n = best.numbers().expect("fits");
    assert!(est.oom.is_none());
    assert_eq!(est.peak_allocated_bytes, n.peak_allocated_bytes);
    assert_eq!(est.peak_reserved_bytes, n.peak_reserved_bytes);
    assert_eq!(est.nccl_bytes, n.nccl_bytes);
    assert_eq!(est.device_bytes(), n.device_bytes);
}

/// On 2 H100s no layout of a 70B full fine-tune fits: nothing is ranked, and the layout that
/// needs least is estimated without a limit, with what it lacks.
#[test]
fn llama_70b_on_2_h100s_fits_no_layout_and_says_the_closest() {
    let s = setup(spec(LLAMA_70B_TP), "h100-80gb", 2);
    let search = layout::search(&s).expect("searches");
    assert!(search.ranked.is_empty());
    assert!(search.out_of_memory > 0);
    let (c, est) = search.closest.as_ref().expect("the closest is estimated");
    assert!(c.recompute && c.micro_batch == 1);
    assert!(est.device_bytes() > s.gpu.total_bytes);
    assert!(layout::reasons(&s, &search).is_empty());
    // The branch and bound finds what estimating every such layout for its demand finds: the
    // first of those that need least, with its unlimited numbers.
    let (_, arch) = s.spec.architecture(None, "").expect("arch");
    let ctx = Context {
        spec: &s.spec,
        arch: &arch,
        world: 2,
    };
    let demands: Vec<(u64, layout::Candidate)> =
        layout::candidates(&ctx, layout::global_batch(&s.spec, 2))
            .into_iter()
            .filter(|c| c.recompute && c.micro_batch == 1)
            .filter_map(|c| {
                let spec = c.spec(&s.spec).rechecked().ok()?;
                let est = estimate::estimate_with_trace(
                    &spec,
                    None,
                    &s.gpu,
                    estimate::Limit::None,
                    false,
                )
                .ok()?
                .0;
                Some((est.device_bytes(), c))
            })
            .collect();
    assert!(demands.len() > 1, "{} layouts", demands.len());
    let least = demands.iter().map(|(d, _)| *d).min().expect("a demand");
    let first = &demands.iter().find(|(d, _)| *d == least).expect("least").1;
    assert_eq!(est.device_bytes(), least);
    assert_eq!(c, first);
}

/// Tensor-parallel degrees divide the world, the heads and the KV heads, and stay within a
/// node; sequence parallelism needs tensor parallelism.
#[test]
fn axes_keep_their_rules() {
    let base = spec(LLAMA_70B_TP);
    let (_, arch) = base.architecture(None, "").expect("arch");
    for (world, allowed) in [
        (64u64, vec![1u64, 2, 4, 8]),
        (12, vec![1, 2, 4]),
        (6, vec![1, 2]),
        (3, vec![1]),
    ] {
        let ctx = Context {
            spec: &base,
            arch: &arch,
            world,
        };
        let all = layout::candidates(&ctx, layout::global_batch(&base, world));
        let mut tps: Vec<u64> = all.iter().map(|c| c.parallel.tensor.tp).collect();
        tps.dedup();
        tps.sort();
        tps.dedup();
        assert_eq!(tps, allowed, "world {world}");
        for c in &all {
            let p = &c.parallel;
            assert_eq!(p.world_size, world);
            assert!(!p.tensor.sequence_parallel || p.tensor.tp > 1);
            assert!(arch.heads % p.tensor.tp == 0 && arch.kv_heads % p.tensor.tp == 0);
            // The spec's mixed precision is FSDP2's: only FSDP2 (or nothing) over dp keeps it.
            assert_eq!(p.strategy, headroom::spec::Strategy::Fsdp, "{}", c.name());
        }
    }
}

/// The memo joins DDP ranks of any world and HSDP ranks of any number of replicas: their
/// estimates are the same to the byte, so simulating one stands for the others.
#[test]
fn ranks_the_memo_joins_estimate_alike() {
    let numbers = |strategy: &str, world: u64, shard: u64| {
        let s = spec(&format!(
            "model: qwen2.5-0.5b\nprecision: bf16\nbatch_size: 2\nseq_len: 512\n\
             parallel: {{strategy: {strategy}, world_size: {world}, shard_size: {shard}}}\n"
        ));
        let e = estimate::estimate(&s, None, &gpu::find("h100-80gb").expect("gpu")).expect("est");
        (
            e.peak_allocated_bytes,
            e.peak_reserved_bytes,
            e.device_bytes(),
            e.phases.clone(),
        )
    };
    let ddp = |world: u64| {
        let s = spec(&format!(
            "model: qwen2.5-0.5b\nprecision: bf16\nbatch_size: 2\nseq_len: 512\n\
             parallel: {{strategy: ddp, world_size: {world}}}\n"
        ));
        let e = estimate::estimate(&s, None, &gpu::find("h100-80gb").expect("gpu")).expect("est");
        (
            e.peak_allocated_bytes,
            e.peak_reserved_bytes,
            e.device_bytes(),
            e.phases.clone(),
        )
    };
    assert_eq!(ddp(2), ddp(64));
    assert_eq!(numbers("fsdp", 16, 8), numbers("fsdp", 64, 8));
    // Full sharding over more ranks is another rank: not joined.
    assert_ne!(numbers("fsdp", 16, 16), numbers("fsdp", 64, 64));
}

/// A memo shared by searches over several cluster sizes serves the ranks they share: the
/// second search simulates fewer candidates than it has, and answers as a fresh one does.
#[test]
fn a_shared_memo_serves_repeated_ranks() {
    let base = spec("model: llama-3.1-8b\nprecision: bf16\nbatch_size: 1\nseq_len: 512\n");
    let memo = RankMemo::default();
    let first = layout::search_with(&setup(base.clone(), "h100-80gb", 8), &memo).expect("8");
    assert!(first.best().is_some());
    let again = layout::search_with(&setup(base.clone(), "h100-80gb", 16), &memo).expect("16");
    assert!(
        again.simulated < again.candidates,
        "{} of {}",
        again.simulated,
        again.candidates
    );
    let fresh = layout::search(&setup(base, "h100-80gb", 16)).expect("16 fresh");
    let names = |s: &layout::LayoutSearch| -> Vec<(String, Option<layout::Numbers>)> {
        s.ranked
            .iter()
            .map(|e| (e.candidate.name(), e.numbers().copied()))
            .collect()
    };
    assert_eq!(names(&again), names(&fresh));
}

/// A rank that fits on an H100 without its capacity ever acting is the same run on an H200
/// (the same architecture, more memory): a memo shared from the H100's search serves the
/// H200's, which answers as a fresh one does to the byte (its CUDA context its own); the A100,
/// another architecture, is served nothing.
#[test]
fn a_shared_memo_serves_a_larger_gpu_of_the_same_architecture() {
    let base = spec("model: llama-3.1-8b\nprecision: bf16\nbatch_size: 2\nseq_len: 1024\n");
    let memo = RankMemo::default();
    let on = |gpu: &str, memo: &RankMemo| {
        layout::search_with(&setup(base.clone(), gpu, 8), memo).expect("searches")
    };
    let answer = |s: &layout::LayoutSearch| {
        let ranked: Vec<(String, Option<layout::Numbers>)> = s
            .ranked
            .iter()
            .map(|e| (e.candidate.name(), e.numbers().copied()))
            .collect();
        (ranked, s.candidates, s.refused, s.out_of_memory)
    };
    on("h100-80gb", &memo);
    let served = on("h200", &memo);
    let fresh = on("h200", &RankMemo::default());
    assert_eq!(answer(&served), answer(&fresh));
    assert!(
        served.simulated < fresh.simulated,
        "{} of {}",
        served.simulated,
        fresh.simulated
    );
    let a100 = on("a100-80gb", &memo);
    assert_eq!(
        a100.simulated,
        on("a100-80gb", &RankMemo::default()).simulated
    );
}

/// Micro-batches that keep the global batch by accumulating are searched, said as not
/// simulated whole (the loop runs one micro-batch a step), and ranked after whole steps; a
/// trainer's spec is not laid out, and says why.
#[test]
fn accumulation_ranks_after_whole_steps_and_trainers_are_not_laid_out() {
    let base = spec("model: llama-3.1-8b\nprecision: bf16\nbatch_size: 4\nseq_len: 512\n");
    let s = setup(base, "h100-80gb", 8);
    let search = layout::search(&s).expect("searches");
    let accumulating = search
        .ranked
        .iter()
        .position(|e| e.candidate.accumulation > 1)
        .expect("smaller micro-batches fit too");
    for (i, e) in search.ranked.iter().enumerate() {
        assert_eq!(e.simulated, e.candidate.accumulation == 1);
        if e.exact && e.simulated {
            assert!(
                i < accumulating,
                "{} after accumulation",
                e.candidate.name()
            );
        }
    }
    let best = search.best().expect("fits");
    assert!(best.simulated && best.exact);

    let trainer =
        spec("model: llama-3.1-8b\nprecision: bf16\nbatch_size: 4\nseq_len: 512\ntrainer: hf\n");
    let why = layout::applies(&setup(trainer, "h100-80gb", 8)).expect_err("not laid out");
    assert!(why.contains("trainer"), "{why}");
}

/// Llama-3.1-8B with 8 sequences of 4096 tokens per GPU on 2 H100s: no layout without a
/// pipeline runs the step whole (FSDP2, ZeRO and context parallelism must accumulate), a
/// pipeline over both does, with one micro-batch per stage at least; `estimate` of its spec
/// gives its numbers to the byte.
#[test]
fn a_pipeline_runs_the_step_whole_where_nothing_else_does() {
    let s = setup(
        spec(
            "model: llama-3.1-8b\nprecision: bf16\noptimizer: adamw\nbatch_size: 8\nseq_len: 4096\n",
        ),
        "h100-80gb",
        2,
    );
    let search = layout::search(&s).expect("searches");
    let best = search.best().expect("a layout fits");
    let pipeline = &best.candidate.parallel.pipeline;
    assert!(
        pipeline.pp == 2 && best.exact && best.simulated,
        "{}",
        best.candidate.name()
    );
    assert!(pipeline.microbatches >= pipeline.pp);
    assert_eq!(best.candidate.global_batch(), 16);
    assert!(
        search
            .ranked
            .iter()
            .filter(|e| e.exact && e.simulated)
            .all(|e| e.candidate.parallel.pipeline.pp > 1)
    );
    assert!(best.time.bubble_s > 0.0);
    let est = estimate::estimate(&best.candidate.spec(&s.spec), None, &s.gpu).expect("estimates");
    let n = best.numbers().expect("fits");
    assert_eq!(est.peak_reserved_bytes, n.peak_reserved_bytes);
    assert_eq!(est.device_bytes(), n.device_bytes);
}

/// An MoE model gets the data-parallel strategies its simulation models (FSDP2 among them),
/// and no tensor, context or pipeline parallelism, whose plans name dense modules.
#[test]
fn an_moe_model_is_laid_out_over_its_data_parallel_strategies() {
    let s = setup(
        spec(
            "model: qwen3-30b-a3b\nprecision: bf16\noptimizer: adamw\nbatch_size: 1\nseq_len: 4096\n",
        ),
        "h100-80gb",
        8,
    );
    let search = layout::search(&s).expect("searches");
    let best = search.best().expect("a layout fits");
    assert_eq!(
        best.candidate.parallel.strategy,
        headroom::spec::Strategy::Fsdp
    );
    for e in &search.ranked {
        let p = &e.candidate.parallel;
        assert_eq!(
            (p.pipeline.pp, p.tensor.tp, p.tensor.cp),
            (1, 1, 1),
            "{}",
            e.candidate.name()
        );
    }
}
