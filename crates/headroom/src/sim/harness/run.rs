//! A whole run as the measuring harness performs it (bench/shared/calibration/README.md):
//! build the model on the GPU, wrap it (LoRA, checkpointing), then three steps of forward,
//! backward, `optimizer.step()` and `zero_grad(set_to_none=True)`, each phase's peak read
//! like `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`.

use super::instance::Instance;
use super::simulation::{AfterOom, Options, STEPS, Simulation};
use crate::arch::Architecture;
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::memory::OnOom;
use crate::sim::engine::tracer::{T, Tracer};
use crate::sim::memo::{Memo, Script, measured_phase};
use crate::spec::{Framework, Home, Mode, Optimizer, Parallel, RunSpec, TrainerKind};

/// Simulate the run of `spec` on `arch` as `options` say.
///
/// Where ranks differ (DeepSpeed ZeRO's partitions, see `strategy::zero`; context parallelism's
/// ring steps) the last rank and [`Parallel::other_ranks`] are simulated, and the one that needs
/// most reported (an out-of-memory error first, then the larger reserved and allocated peaks).
/// Without a limit another rank may need more, so such a run that runs out stops there.
pub fn simulate(spec: &RunSpec, arch: &Architecture, options: &Options) -> Simulation {
    let pipelined = spec.parallel.as_ref().is_some_and(|p| p.pipeline.pp > 1);
    if spec
        .parallel
        .as_ref()
        .is_some_and(|p| p.tensor.framework == Framework::Megatron)
    {
        if pipelined {
            return super::megatron_stages::simulate(spec, arch, options);
        }
        return super::megatron::simulate(spec, arch, options);
    }
    if pipelined {
        return super::stages::simulate(spec, arch, options);
    }
    let ranks_differ = spec.parallel.as_ref().is_some_and(Parallel::ranks_differ);
    let run = |rank| {
        let mut t = options.process();
        match options.after_oom {
            AfterOom::GoOn => {}
            AfterOom::StopUnlessUnlimited if ranks_differ => t.mem.on_oom(OnOom::Stop),
            AfterOom::StopUnlessUnlimited => t.mem.on_oom(OnOom::StopUnlessUnlimited),
        }
        if spec.trainer.kind != TrainerKind::Loop {
            return super::trainer::simulate(spec, arch, t, options);
        }
        let repeat_steps = options.repeat_steps && !options.record_timeline;
        simulate_rank(spec, arch, t, repeat_steps, rank)
    };
    if let Some(rank) = options.only_rank.filter(|_| ranks_differ) {
        return Simulation {
            rank,
            ..run(Some(rank))
        };
    }
    let last = run(None);
    if !ranks_differ {
        return last;
    }
    let last = Simulation {
        rank: spec.parallel.as_ref().map_or(0, |p| p.world_size - 1),
        ..last
    };
    let need = |s: &Simulation| {
        (
            s.refused.is_some(),
            s.oom.is_some(),
            s.peak_reserved,
            s.peak.allocated,
        )
    };
    let ran_out = |s: &Simulation| s.oom.is_some() || s.refused.is_some();
    // The run is the one without a limit only where every rank's is.
    let mut unlimited = last.unlimited;
    let mut worst = last;
    for rank in spec.parallel.as_ref().map_or(vec![], Parallel::other_ranks) {
        if options.first_oom_ends_run && ran_out(&worst) {
            break;
        }
        let sim = Simulation {
            rank,
            ..run(Some(rank))
        };
        unlimited &= sim.unlimited;
        if need(&sim) > need(&worst) {
            worst = sim;
        }
    }
    Simulation { unlimited, ..worst }
}

/// One rank's run (`None`: the last), in a fresh process `t`.
fn simulate_rank(
    spec: &RunSpec,
    arch: &Architecture,
    mut t: Tracer,
    repeat_steps: bool,
    rank: Option<u64>,
) -> Simulation {
    // torch.zeros(1, device="cuda"): the context and a first small segment; the tensor dies.
    let zero = t.empty_as(1, DType::F32, Component::Inputs, "torch.zeros(1)");
    t.drop(zero);

    let train = spec.mode == Mode::Train;
    let has_optimizer = spec.optimizer != Optimizer::None;
    let mut instance = Instance::build(&mut t, spec, arch, Home::Gpu, rank);
    let batch = instance.batch;
    // The whole batch, also where context parallelism runs each rank's share of it.
    let ids = t.empty_as(
        batch.b * spec.seq_len,
        DType::I64,
        Component::Inputs,
        "input_ids",
    );
    // Building (or loading) the model is reported as step 0's "load" phase.
    let mut phases = vec![t.mem.phase_peak()];
    // A strategy's own state (FSDP2's units and buffers) is compared only where it is at
    // rest (`Strategy::at_rest`); the other strategies' never is, and their runs simulate
    // every step. Step 2's pass is made from step 1's likewise only where the strategy is at
    // rest where each pass starts and where step 1's ends. Step 1 of training creates
    // the optimizer's states, so step 2 never starts where step 1 did: not worth comparing
    // (not comparing only means simulating).
    let mut memo = Memo::new(
        repeat_steps,
        repeat_steps && train && has_optimizer,
        !train || !has_optimizer,
    );
    for step in 1..=STEPS {
        if t.mem.stopped() {
            break;
        }
        let roots: Vec<T> = instance.optimizer.tensors().chain([ids]).collect();
        let at_rest = instance.model.strategy.borrow().at_rest();
        if memo.take_step(&mut t, step, STEPS, &roots, at_rest, &mut phases) {
            continue;
        }
        let mut script: Script = Vec::new();
        let mut phase = |t: &mut Tracer, name: &'static str, f: &mut dyn FnMut(&mut Tracer)| {
            measured_phase(t, step, name, &mut script, &mut phases, f)
        };
        if !train {
            phase(&mut t, "forward", &mut |t| instance.logprob_pass(t, ids));
            memo.end_step(&mut t, phases.len(), script);
            continue;
        }
        let aside: Vec<T> = instance.optimizer.tensors().collect();
        if let Some(pass) = memo.pass_to_replay(&mut t, &[ids], &aside, at_rest) {
            if memo.replay_pass(&mut t, pass, &mut phase) {
                break;
            }
        } else {
            let start = memo.begin_pass(&mut t, step, &[ids], at_rest);
            let mut loss: Option<T> = None;
            let mut sharded = None;
            phase(&mut t, "forward", &mut |t| {
                sharded = instance.shard_batch(t, ids);
                let inputs = sharded.as_ref().map_or(ids, |s| s.inputs);
                loss = Some(instance.forward_for_loss(t, inputs));
            });
            if t.mem.stopped() {
                break;
            }
            let mut pass_script = vec![(Some("forward"), t.mem.requests_recorded())];
            let loss = loss.expect("the forward phase produced a loss");
            phase(&mut t, "backward", &mut |t| instance.backward(t, loss));
            if t.mem.stopped() {
                break;
            }
            pass_script.push((Some("backward"), t.mem.requests_recorded()));
            if let Some(sharded) = sharded {
                sharded.release(&mut t);
                pass_script.push((None, t.mem.requests_recorded()));
            }
            if let Some(start) = start {
                let at_rest = instance.model.strategy.borrow().at_rest();
                memo.end_pass(&mut t, start, pass_script, &[ids], at_rest);
            }
        }
        if has_optimizer {
            phase(&mut t, "optimizer", &mut |t| instance.optimizer_step(t));
        }
        instance.zero_grad(&mut t);
        memo.end_step(&mut t, phases.len(), script);
    }
    Simulation {
        repeated_steps: memo.repeated_steps,
        replayed_steps: memo.replayed_steps,
        replayed_passes: memo.replayed_passes,
        ..Simulation::of_run(t, &instance, phases)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_alloc::AllocatorConfig;
    use serde_json::json;

    fn spec_and_arch(value: &serde_json::Value) -> (RunSpec, Architecture) {
        let spec = RunSpec::from_value(value).expect("valid spec");
        let model = spec.resolve_model(None).expect("known model");
        let arch = Architecture::from_hf_config(&model.config).expect("valid config");
        (spec, arch)
    }

    /// Two simulations report the same: phases, peaks and what they were made of, trace.
    fn assert_same_numbers(a: &Simulation, b: &Simulation, context: &str) {
        assert_eq!(a.phases, b.phases, "{context}");
        assert_eq!(a.peak_reserved, b.peak_reserved, "{context}");
        assert_eq!(a.peak.allocated, b.peak.allocated, "{context}");
        assert_eq!(a.peak.breakdown, b.peak.breakdown, "{context}");
        let place = |s: &Simulation| (s.peak.phase, s.peak.step);
        assert_eq!(place(a), place(b), "{context}");
        assert_eq!(a.trace, b.trace, "{context}");
    }

    /// A limited run that goes on past its out-of-memory error (the limit had changed nothing)
    /// is the run without a limit, to the byte; one that stops is not used for it.
    #[test]
    fn limited_runs_that_go_on_equal_unlimited_ones() {
        let specs = [
            json!({"model": "qwen2.5-0.5b", "precision": "amp-bf16", "optimizer": "adamw",
                   "batch_size": 1, "seq_len": 512, "gradient_checkpointing": true}),
            json!({"model": "qwen2.5-0.5b", "precision": "bf16", "batch_size": 2, "seq_len": 256,
                   "lora": {"r": 8, "alpha": 16, "targets": "all-linear", "dropout": 0.05}}),
            json!({"model": "qwen2.5-0.5b", "precision": "fp32", "optimizer": "sgd",
                   "batch_size": 1, "seq_len": 128}),
        ];
        let (mut went_on, mut stopped) = (0, 0);
        for value in specs {
            let (spec, arch) = spec_and_arch(&value);
            let run = |capacity, after_oom| {
                let options = Options {
                    capacity,
                    after_oom,
                    record_trace: true,
                    ..Options::new(AllocatorConfig::default())
                };
                simulate(&spec, &arch, &options)
            };
            let unlimited = run(None, AfterOom::GoOn);
            assert!(unlimited.unlimited);
            // From less than the weights to just short of the reserved peak.
            for eighth in 1..8 {
                let capacity = unlimited.peak_reserved * eighth / 8;
                let limited = run(Some(capacity), AfterOom::StopUnlessUnlimited);
                if limited.oom.is_none() {
                    continue;
                }
                if !limited.unlimited {
                    stopped += 1;
                    continue;
                }
                went_on += 1;
                assert_same_numbers(&limited, &unlimited, &format!("{value} {capacity}"));
                // The error is the one a run that goes on after it records.
                assert_eq!(
                    limited.oom,
                    run(Some(capacity), AfterOom::GoOn).oom,
                    "{value}"
                );
            }
        }
        assert!(
            went_on >= 3,
            "{went_on} limited runs went on as unlimited ones"
        );
        assert!(
            stopped >= 3,
            "{stopped} limited runs stopped at their error"
        );
    }

    /// Taking a step from the previous one, or its requests, gives what simulating it gives,
    /// to the byte.
    #[test]
    fn repeated_steps_equal_simulated_ones() {
        let specs = [
            json!({"model": "qwen2.5-0.5b", "precision": "bf16", "optimizer": "adamw",
                   "batch_size": 2, "seq_len": 256}),
            json!({"model": "qwen2.5-0.5b", "precision": "amp-bf16", "optimizer": "adamw",
                   "batch_size": 1, "seq_len": 512, "gradient_checkpointing": true}),
            json!({"model": "qwen2.5-0.5b", "precision": "bf16", "batch_size": 2, "seq_len": 256,
                   "lora": {"r": 8, "alpha": 16, "targets": "all-linear", "dropout": 0.05}}),
            json!({"model": "qwen2.5-0.5b", "precision": "bf16", "quantization": "nf4",
                   "kbit_prepare": true, "batch_size": 1, "seq_len": 256,
                   "gradient_checkpointing": true,
                   "lora": {"r": 8, "alpha": 16, "targets": "all-linear", "dropout": 0.05}}),
            json!({"model": "qwen2.5-0.5b", "precision": "bf16", "mode": "forward",
                   "batch_size": 2, "seq_len": 256}),
            json!({"model": "qwen2.5-0.5b", "precision": "amp-bf16", "mode": "forward",
                   "batch_size": 1, "seq_len": 512}),
            json!({"model": "qwen2.5-0.5b", "precision": "fp32", "mode": "forward",
                   "batch_size": 4, "seq_len": 128}),
            json!({"model": "qwen2.5-0.5b", "precision": "fp32", "optimizer": "sgd",
                   "batch_size": 1, "seq_len": 128}),
        ];
        let (mut repeated, mut ooms, mut limited_repeats) = (0, 0, 0);
        let (mut replayed, mut replayed_ooms) = (0, 0);
        let (mut passes, mut passes_in_ooms, mut both) = (0, 0, 0);
        for value in specs {
            let (spec, arch) = spec_and_arch(&value);
            let run = |capacity, repeat_steps| {
                let options = Options {
                    capacity,
                    record_trace: true,
                    repeat_steps,
                    ..Options::new(AllocatorConfig::default())
                };
                simulate(&spec, &arch, &options)
            };
            let unlimited = run(None, false);
            // Also on a device just large enough, and on the devices around its peaks.
            let capacities = unlimited
                .devices_around()
                .into_iter()
                .chain([Some(unlimited.peak_reserved)]);
            for capacity in capacities {
                let (fast, slow) = (run(capacity, true), run(capacity, false));
                assert_same_numbers(&fast, &slow, &value.to_string());
                assert_eq!(fast.oom, slow.oom, "{value}");
                assert_eq!(
                    (fast.params, fast.trainable_params, fast.weights_loaded),
                    (slow.params, slow.trainable_params, slow.weights_loaded)
                );
                assert_eq!(
                    (
                        slow.repeated_steps,
                        slow.replayed_steps,
                        slow.replayed_passes
                    ),
                    (0, 0, 0)
                );
                // Stopping at the first error finds the same error, and without one the run.
                let options = Options {
                    capacity,
                    after_oom: AfterOom::StopUnlessUnlimited,
                    record_trace: true,
                    ..Options::new(AllocatorConfig::default())
                };
                let stopped = simulate(&spec, &arch, &options);
                assert_eq!(stopped.oom, slow.oom, "{value}");
                if slow.oom.is_none() {
                    assert_eq!(stopped.phases, slow.phases, "{value}");
                    assert_eq!(stopped.trace, slow.trace, "{value}");
                    assert_eq!(stopped.peak_reserved, slow.peak_reserved, "{value}");
                }
                if capacity.is_none() {
                    repeated += fast.repeated_steps;
                }
                replayed += fast.replayed_steps;
                replayed_ooms += fast.replayed_steps * u32::from(slow.oom.is_some());
                passes += fast.replayed_passes;
                passes_in_ooms += fast.replayed_passes * u32::from(slow.oom.is_some());
                both += u32::from(fast.replayed_passes > 0 && fast.replayed_steps > 0);
                ooms += usize::from(slow.oom.is_some());
                limited_repeats += fast.repeated_steps * u32::from(capacity.is_some());
            }
        }
        // The forward runs repeat their last step; the short devices run out, and a device
        // limit does not keep steps from repeating. A training run's step 3 does not repeat
        // step 2: the segments step 2 made lie below the older ones (the driver's placement),
        // so best fit prefers them where step 2 took an older block of the same size.
        assert!(repeated >= 3, "{repeated} steps repeated");
        assert!(ooms >= 3, "{ooms} runs out of memory");
        assert!(
            limited_repeats >= 3,
            "{limited_repeats} steps repeated on limited devices"
        );
        // Others make the last step's requests again (the allocator decides differently),
        // also in runs that flush the cache or run out of memory.
        assert!(replayed >= 6, "{replayed} steps replayed");
        assert!(
            replayed_ooms >= 3,
            "{replayed_ooms} replayed steps in runs out of memory"
        );
        // Step 2's training pass is made from step 1's requests in every training run with
        // an optimizer (five specs, five devices each), also where the run runs out.
        assert!(passes >= 20, "{passes} training passes replayed");
        assert!(
            passes_in_ooms >= 3,
            "{passes_in_ooms} replayed training passes in runs out of memory"
        );
        // Step 3 made from a record that starts with the replayed pass of step 2.
        assert!(both >= 3, "{both} runs replay both a pass and a step");
    }

    /// Sharded runs take a step from the previous one, or its requests, where their strategy
    /// is at rest between steps (FSDP2, HSDP, tensor and context parallelism over it, an MoE),
    /// and report what simulating every step reports, to the byte, also on devices that flush
    /// the cache or run out.
    #[test]
    fn sharded_steps_repeat_as_simulated_ones() {
        let llama = |parallel: serde_json::Value, seq_len: u64| {
            json!({"model": "llama-3.2-1b", "precision": "bf16", "optimizer": "adamw",
                   "batch_size": 2, "seq_len": seq_len, "gradient_checkpointing": true,
                   "parallel": parallel})
        };
        let specs = [
            llama(json!({"strategy": "fsdp", "world_size": 4}), 512),
            llama(
                json!({"strategy": "fsdp", "world_size": 8, "shard_size": 4,
                       "reshard_after_forward": false}),
                512,
            ),
            llama(
                json!({"strategy": "fsdp", "world_size": 8, "tp": 2, "sequence_parallel": true,
                       "framework": "torchtitan"}),
                512,
            ),
            llama(json!({"strategy": "fsdp", "world_size": 4, "cp": 2}), 2048),
            json!({"model": "olmoe-1b-7b", "precision": "bf16", "optimizer": "adamw",
                   "batch_size": 1, "seq_len": 256,
                   "parallel": {"strategy": "fsdp", "world_size": 8}}),
        ];
        let (mut repeated, mut replayed, mut ooms) = (0, 0, 0);
        let (mut passes, mut passes_in_ooms) = (0, 0);
        for value in specs {
            let (spec, arch) = spec_and_arch(&value);
            let run = |capacity, repeat_steps| {
                let options = Options::memo_test(capacity, repeat_steps, AfterOom::GoOn);
                simulate(&spec, &arch, &options)
            };
            for capacity in run(None, false).devices_around() {
                let (fast, slow) = (run(capacity, true), run(capacity, false));
                assert_same_numbers(&fast, &slow, &format!("{value} {capacity:?}"));
                assert_eq!(fast.oom, slow.oom, "{value}");
                repeated += fast.repeated_steps;
                replayed += fast.replayed_steps;
                passes += fast.replayed_passes;
                passes_in_ooms += u32::from(slow.oom.is_some()) * fast.replayed_passes;
                ooms += u32::from(slow.oom.is_some());
            }
            let unlimited = run(None, true);
            assert!(
                unlimited.repeated_steps + unlimited.replayed_steps > 0,
                "{value}: no step taken from the one before"
            );
            // Step 2's pass is made from step 1's requests: FSDP2's sharded gradients, views
            // of the reduce-scatter output, stored again on what they allocate. Not under
            // sequence parallelism: step 1's last row-parallel output leaves the tracer
            // recording DTensors, which step 1's pass did not start with.
            let sequence_parallel = value["parallel"]["sequence_parallel"] == true;
            assert_eq!(
                unlimited.replayed_passes > 0,
                !sequence_parallel,
                "{value}: step 2's pass made from step 1's requests"
            );
        }
        assert!(
            passes >= 15 && passes_in_ooms >= 3,
            "{passes} passes from step 1's requests, {passes_in_ooms} in runs out of memory"
        );
        // Step 3 is taken whole or made from step 2's requests, in every spec and on devices
        // of every size.
        assert!(
            repeated + replayed >= 15,
            "{repeated} + {replayed} steps taken"
        );
        assert!(ooms >= 5, "{ooms} runs out of memory");
    }
}
