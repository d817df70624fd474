//! The timeline a picture is drawn from: it is the run the estimate reports (recording it
//! changes no number), covers every step the memo would skip, keeps the peak the estimate
//! names, and places an out-of-memory error where the estimate says it happened.

use std::path::{Path, PathBuf};

use headroom::estimate::{
    self, Estimate, Limit, MAX_POINTS, Timeline, estimate_pipeline, estimate_pipeline_timeline,
    estimate_timeline,
};
use headroom::gpu::{self, Gpu};
use headroom::spec::{self, Document, RunSpec};

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples")
        .join(name)
}

fn run_spec(name: &str) -> RunSpec {
    match spec::load(&example(name)).expect(name) {
        Document::Run(spec) => *spec,
        Document::Pipeline(_) => panic!("{name} is a pipeline"),
    }
}

fn h100() -> Gpu {
    gpu::find("h100-80gb").expect("h100")
}

/// What a picture and the tables must agree on.
fn numbers(e: &Estimate) -> (u64, u64, &'static str, u32, usize, bool) {
    (
        e.peak_allocated_bytes,
        e.peak_reserved_bytes,
        e.peak_phase,
        e.peak_step,
        e.phases.len(),
        e.oom.is_some(),
    )
}

fn check_shape(t: &Timeline) {
    assert!(
        t.points.len() <= MAX_POINTS + 1,
        "{} points",
        t.points.len()
    );
    assert!(t.points.windows(2).all(|w| w[0].event < w[1].event));
    assert_eq!(t.phases.first().map(|p| p.events.start), Some(0));
    assert_eq!(t.phases.last().map(|p| p.events.end), Some(t.events));
    assert!(
        t.phases
            .windows(2)
            .all(|w| w[0].events.end == w[1].events.start)
    );
}

#[test]
fn a_run_timeline_is_the_estimated_run_with_every_step() {
    for (name, gpu, limit) in [
        ("qwen2.5-7b-lora.yaml", h100(), Limit::Gpu),
        ("llama-2-7b-qlora.yaml", Gpu::default(), Limit::None),
        ("llama-3.1-8b-full.yaml", h100(), Limit::Gpu),
    ] {
        let spec = run_spec(name);
        let (est, trace) =
            estimate::estimate_with_trace(&spec, None, &gpu, limit, false).expect(name);
        let (drawn, timeline) = estimate_timeline(&spec, None, &gpu, limit).expect(name);
        assert_eq!(numbers(&est), numbers(&drawn), "{name}");
        assert!(trace.is_empty());
        check_shape(&timeline);
        // Every measured step is drawn, those the memo takes from the one before included.
        for step in 1..=headroom::sim::STEPS {
            assert!(
                timeline.phases.iter().any(|p| p.step == step),
                "{name}: step {step} missing"
            );
        }
        let peak = &timeline.points[timeline.peak.expect("a peak")];
        assert_eq!(peak.allocated(), est.peak_allocated_bytes, "{name}");
        let phase = timeline.phase_of(timeline.peak.unwrap()).unwrap();
        assert_eq!(
            (phase.step, phase.name.as_str()),
            (est.peak_step, est.peak_phase)
        );
        let reserved = timeline.points.iter().filter(|p| {
            timeline
                .phase_of_event(p.event)
                .is_some_and(|ph| ph.step > 0)
        });
        assert!(reserved.map(|p| p.reserved).max() <= Some(est.peak_reserved_bytes));
    }
}

#[test]
fn seed003_runs_out_on_the_timeline_where_the_estimate_says() {
    let Document::Pipeline(spec) = spec::load(&example("seed003-phi3-dpo.yaml")).unwrap() else {
        panic!("seed003 is a pipeline")
    };
    let est = estimate_pipeline(&spec, None, &h100(), Limit::Gpu).expect("seed003");
    let (drawn, timeline) =
        estimate_pipeline_timeline(&spec, None, &h100(), Limit::Gpu).expect("seed003");
    assert_eq!(est.peak_allocated_bytes, drawn.peak_allocated_bytes);
    assert_eq!(est.phases, drawn.phases);
    check_shape(&timeline);
    let oom = est.oom.as_ref().expect("seed003 runs out on an H100");
    let marked = timeline.oom.as_ref().expect("the error is on the timeline");
    assert_eq!(
        (marked.step, marked.phase.as_str(), marked.tensor.as_str()),
        (oom.step, oom.phase, oom.tensor)
    );
    assert_eq!(marked.requested_bytes, oom.requested_bytes);
    let phase = timeline.phase_of(marked.point).expect("in a phase");
    assert_eq!((phase.step, phase.name.as_str()), (oom.step, oom.phase));
    // Drawn on the run without a limit, the point is that allocation made: what PyTorch's
    // message says was allocated, plus the request; its reserved bytes pass the capacity.
    let Some(error) = device_error(&oom.error) else {
        panic!("a device out-of-memory error")
    };
    let point = &timeline.points[marked.point];
    assert_eq!(point.allocated(), error.allocated_bytes + error.alloc_size);
    assert!(
        point.reserved
            > est
                .capacity_bytes
                .expect("simulated at the H100's capacity")
    );
    let peak = &timeline.points[timeline.peak.expect("a peak")];
    assert_eq!(peak.allocated(), est.peak_allocated_bytes);
}

fn device_error(e: &headroom_alloc::OutOfMemory) -> Option<&headroom_alloc::DeviceOutOfMemory> {
    match e {
        headroom_alloc::OutOfMemory::Device(d) => Some(d),
        _ => None,
    }
}

/// A pipeline's phases say what the instances they do not run hold: seed001's resident
/// placement keeps the policy (fp32 masters of amp-bf16, then its AdamW states) through the
/// reference's pass, and the bf16 reference through the policy's training. A run has no other
/// models.
#[test]
fn a_pipeline_phase_knows_what_the_models_it_does_not_run_hold() {
    use headroom::sim::Component;

    const QWEN25_15B_PARAMS: u64 = 1_543_714_304; // tests/data/param_counts.json
    let Document::Pipeline(spec) = spec::load(&example("seed001-ref-resident.yaml")).unwrap()
    else {
        panic!("seed001 is a pipeline")
    };
    let (_, timeline) =
        estimate_pipeline_timeline(&spec, None, &h100(), Limit::Gpu).expect("seed001");
    let idle = |p: &headroom::estimate::TimelinePhase, c: Component| p.idle[c.index()];
    let mut seen = (0, 0);
    for (i, phase) in timeline.phases.iter().enumerate() {
        for point in &timeline.points[phase.points.clone()] {
            assert!(
                Component::ALL
                    .iter()
                    .all(|c| idle(phase, *c) <= point.by_component[c.index()])
            );
        }
        let (weights, states) = (
            idle(phase, Component::Weights),
            idle(phase, Component::OptimizerStates),
        );
        match phase.name.as_str() {
            "load" => assert_eq!((weights, states), (0, 0)),
            "ref_logprob" => {
                // AdamW's states exist from the policy's first step on.
                let stepped = timeline.phases[..i].iter().any(|p| p.name == "train");
                let expected_states = if stepped { 8 * QWEN25_15B_PARAMS } else { 0 };
                assert_eq!((weights, states), (4 * QWEN25_15B_PARAMS, expected_states));
                seen.0 += 1;
            }
            "train" => {
                assert_eq!((weights, states), (2 * QWEN25_15B_PARAMS, 0));
                seen.1 += 1;
            }
            other => panic!("an unexpected phase {other}"),
        }
    }
    assert_eq!(seen, (3, 3));
    let (_, run) = estimate_timeline(&run_spec("qwen2.5-7b-lora.yaml"), None, &h100(), Limit::Gpu)
        .expect("a run");
    assert!(run.phases.iter().all(|p| p.idle.iter().all(|&b| b == 0)));
}
