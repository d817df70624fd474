//! A Megatron-core pipeline rank as the measuring harness runs one
//! (`python/headroom_measure/megatron_pp.py`): pipeline rank `r` builds its stage of `GPTModel`
//! (`model::megatron`: its `num_layers / pp` layers, or `layers_per_stage`'s, the embedding on
//! the first stage, the final norm, output layer and loss on the last) with its own `Float16Module`,
//! DDP gradient buffer and optimizer over `world_size / (tp × pp)` data-parallel ranks
//! (`strategy::megatron`), makes one micro-batch's inputs, then takes three steps of
//! `forward_backward_pipelining_without_interleaving` (`strategy::megatron_pp`'s steps) and
//! `optimizer.step()`. With `vpp > 1` the rank builds one chunk per virtual stage (chunk `c`
//! holds virtual stage `c · pp + r`'s layers, the embedding on the first rank's chunk 0, the loss
//! on the last rank's last chunk), each with its own DDP buffer and one optimizer over all, and
//! runs `forward_backward_pipelining_with_interleaving` (`strategy::megatron_interleaved`'s
//! steps) with `input_tensors`, `output_tensors` and `output_tensor_grads` per chunk.
//!
//! What the schedule holds, after `schedules.py` and `p2p_communication.py` (Megatron-LM's
//! `deallocate_pipeline_outputs=True`, `batch_p2p_comm=True`):
//! - `total_num_tokens`, a zero-dimensional int tensor, for the whole schedule;
//! - a receive is `torch.empty(shape, requires_grad=True)` made at each call, `[s, b, h]` in
//!   bf16: the input of every micro-batch on all stages but the first (a leaf its backward
//!   accumulates the input gradient into), the output's gradient on all stages but the last;
//! - a forward's input and output stay in `input_tensors` / `output_tensors` until that
//!   micro-batch's backward; `deallocate_output_tensor` swaps the output's storage for a
//!   one-element tensor once sent, its `grad_fn` keeping the graph;
//! - the locals (`input_tensor`, `output_tensor`, `output_tensor_grad`, `input_tensor_grad`)
//!   hold their tensor until rebound, so a received tensor is made before the previous one
//!   goes; the last input gradient goes when the schedule returns;
//! - `set_input_tensor` keeps each forward's input as `TransformerBlock.input_tensor` until
//!   the next forward's: the last micro-batch's input, with the gradient its backward
//!   accumulated into it, lives through `optimizer.step()` into the next step.
//!
//! Parameter gradients go into the fp32 `main_grad` buffer through the DDP hook at every
//! micro-batch's backward; `finalize_model_grads` reduces in place.

use super::megatron::ranks;
use super::megatron::{Hooks, inputs, load, loss_func};
use super::simulation::{Options, STEPS, Simulation, StagePeak};
use super::stages::worst_rank;
use crate::arch::Architecture;
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{ParamId, T, Tracer};
use crate::sim::model::Batch;
use crate::sim::model::megatron::{GptModel, StageInput, StagePart};
use crate::sim::model::megatron_sp::allreduce_norm_grads;
use crate::sim::optim::OptimizerState;
use crate::sim::strategy::megatron_interleaved::{self, Recv, interleaved};
use crate::sim::strategy::megatron_pp::{Step, one_f_one_b};
use crate::spec::{Optimizer, RunSpec};
use std::collections::VecDeque;

/// Simulate every pipeline rank of the Megatron run of `spec` (the first and the last
/// data-parallel rank of each stage where their optimizer shards differ: `ranks`), or
/// `options.only_rank`, and report the one that needs most, with each stage's peak.
pub(crate) fn simulate(spec: &RunSpec, arch: &Architecture, options: &Options) -> Simulation {
    let world = spec.parallel.as_ref().map_or(1, |p| p.world_size);
    worst_rank(
        options,
        &ranks(spec, arch),
        |global| global.min(world - 1),
        |t, global| simulate_rank(spec, arch, t, global),
    )
}

/// The schedule's `output_tensor` local: a forward's output, or a popped one with its
/// one-element stand-in data and the received input its graph reaches. The backward frees the
/// graph's saved tensors, not its nodes: the output's `grad_fn` chain keeps the input's
/// `AccumulateGrad` node, and the node its leaf, until the local is rebound to the next
/// forward's output.
struct Output {
    tensor: T,
    stand_in: Option<T>,
    graph_input: Option<Received>,
}

impl Output {
    fn drop(self, t: &mut Tracer) {
        t.drop(self.tensor);
        if let Some(stand_in) = self.stand_in {
            t.drop(stand_in);
        }
        if let Some(input) = self.graph_input {
            let_go(t, input);
        }
    }
}

/// A tensor received from the previous stage, and the leaf its gradient accumulates into.
#[derive(Clone, Copy)]
struct Received {
    tensor: T,
    leaf: ParamId,
}

/// The schedule's lists and locals (see the module doc). Each holds its own reference to a
/// received tensor, let go with [`let_go`].
#[derive(Default)]
struct Schedule {
    /// `input_tensors`, `output_tensors`: per micro-batch in flight, its input (none on the
    /// first stage) and its (deallocated) output with the one-element tensor now its data.
    in_flight: Vec<(Option<Received>, T, T)>,
    /// `input_tensor`.
    input: Option<Received>,
    /// `output_tensor`: this forward's output, or the popped one.
    output: Option<Output>,
    output_grad: Option<T>,
    input_grad: Option<T>,
}

/// Global rank `global`'s process `t` (its pipeline stage, its data-parallel shards): load,
/// then the measured steps.
fn simulate_rank(spec: &RunSpec, arch: &Architecture, mut t: Tracer, global: u64) -> Simulation {
    let parallel = spec.parallel.as_ref().expect("a pipeline-parallel spec");
    let pipeline = &parallel.pipeline;
    let pp_rank = pipeline.pipeline_rank(global, parallel.world_size);
    let (pp, microbatches) = (pipeline.pp, pipeline.microbatches);
    let vpp = pipeline.vpp;
    // Rank r's chunk c is virtual stage c × pp + r (`get_transformer_layer_offset`).
    let stage_layers = pipeline.stage_layers(arch.layers);
    let parts: Vec<StagePart> = (0..vpp)
        .map(|c| StagePart {
            layers: stage_layers[(c * pp + pp_rank) as usize],
            pre_process: pp_rank == 0 && c == 0,
            post_process: pp_rank == pp - 1 && c == vpp - 1,
        })
        .collect();
    let batch = Batch {
        b: spec.batch_size / microbatches,
        s: spec.seq_len,
    };
    let chunks = load(&mut t, spec, arch, &parts, global);
    let weights_loaded = t.mem.allocated();
    let received = t.params.len();
    let mut phases = vec![t.mem.phase_peak()];
    let [ids, positions, loss_mask] = inputs(&mut t, batch, chunks[0].experts);
    // Each chunk's `TransformerBlock.input_tensor`, across steps.
    let mut block_inputs: Vec<Option<Received>> = vec![None; vpp as usize];
    // Megatron's optimizer wraps its own; this one is never stepped.
    let mut unused = OptimizerState::new(Optimizer::None);
    for step in 1..=STEPS {
        if t.mem.stopped() {
            break;
        }
        t.mem.begin_measured_phase("schedule", step);
        if vpp == 1 {
            let schedule = Run {
                model: &chunks[0],
                part: parts[0],
                batch,
                received,
            };
            let steps = one_f_one_b(pp, microbatches, pp_rank);
            schedule.run(&mut t, &steps, (ids, loss_mask), &mut block_inputs[0]);
        } else {
            let schedule = Interleaved {
                chunks: &chunks,
                parts: &parts,
                batch,
                received,
            };
            let overlap = spec.megatron.unwrap_or_default().overlaps_p2p(vpp);
            let steps = interleaved(pp, vpp, microbatches, pp_rank, overlap);
            schedule.run(&mut t, &steps, (ids, loss_mask), &mut block_inputs);
        }
        let summed = chunks.iter().map(|c| c.tp_summed_grad_numel(&t)).sum();
        allreduce_norm_grads(&mut t, summed);
        phases.push(t.mem.phase_peak());
        if t.mem.stopped() {
            break;
        }
        t.mem.begin_measured_phase("optimizer", step);
        chunks[0].strategy.borrow_mut().step(&mut t, &mut unused);
        phases.push(t.mem.phase_peak());
    }
    t.drop_all(&[ids, positions, loss_mask]);
    for r in block_inputs.into_iter().flatten() {
        let_go(&mut t, r);
    }
    let params = super::megatron::global_params(spec, arch);
    let host_bytes = chunks[0].strategy.borrow().host_bytes(&t).unwrap_or(0);
    let mut sim = Simulation::of_process(t, (params, params), weights_loaded, host_bytes, phases);
    sim.stages = vec![StagePeak {
        stage: pp_rank,
        pipeline_rank: pp_rank,
        peak_allocated: sim.peak.allocated,
        peak_reserved: sim.peak_reserved,
    }];
    sim
}

/// What one `forward_backward_pipelining_without_interleaving` call runs on: the stage, its
/// micro-batch, and the first parameter id of the received tensors' leaves.
struct Run<'a> {
    model: &'a GptModel,
    part: StagePart,
    batch: Batch,
    received: ParamId,
}

impl Run<'_> {
    /// One call: `steps` in order over the inputs `(ids, loss_mask)` of every micro-batch;
    /// `block_input` is the stage's `TransformerBlock.input_tensor`.
    fn run(
        &self,
        t: &mut Tracer,
        steps: &[Step],
        (ids, loss_mask): (T, T),
        block_input: &mut Option<Received>,
    ) {
        let Run {
            model,
            part,
            batch,
            received,
        } = *self;
        let activation = model.rows(batch.n()) * model.widths.hidden;
        let total_tokens = t.empty_as(1, DType::I32, Component::Inputs, "total_num_tokens");
        let mut s = Schedule::default();
        for &step in steps {
            if t.mem.stopped() {
                break;
            }
            match step {
                Step::RecvForward => {
                    let next = (!part.pre_process).then(|| {
                        let outer = std::mem::replace(&mut t.component, Component::Communication);
                        let tensor = t.empty(activation, DType::BF16, "recv_forward (torch.empty)");
                        t.component = outer;
                        let leaf = t.make_input_leaf(tensor);
                        Received { tensor, leaf }
                    });
                    if let Some(previous) = std::mem::replace(&mut s.input, next) {
                        let_go(t, previous);
                    }
                }
                Step::Forward(_) => {
                    // `set_input_tensor(input_tensor)`, then the forward.
                    let held = s.input.inspect(|r| {
                        t.share(r.tensor);
                    });
                    if let Some(previous) = std::mem::replace(block_input, held) {
                        let_go(t, previous);
                    }
                    let input = match s.input {
                        Some(r) => StageInput::Hidden(r.tensor),
                        None => StageInput::Ids(ids),
                    };
                    let mut output = model.forward_stage(t, input, batch);
                    if part.post_process {
                        output = loss_func(t, output, loss_mask);
                    }
                    if let Some(previous) = s.output.take() {
                        previous.drop(t);
                    }
                    s.output = Some(Output {
                        tensor: output,
                        stand_in: None,
                        graph_input: None,
                    });
                }
                Step::RecvBackward => {
                    let next = (!part.post_process).then(|| {
                        let outer = std::mem::replace(&mut t.component, Component::Communication);
                        let grad = t.empty(activation, DType::BF16, "recv_backward (torch.empty)");
                        t.component = outer;
                        grad
                    });
                    if let Some(previous) = std::mem::replace(&mut s.output_grad, next) {
                        t.drop(previous);
                    }
                }
                Step::Deallocate => {
                    let output = s.output.as_ref().expect("a forward ran").tensor;
                    let input = s.input.inspect(|r| {
                        t.share(r.tensor);
                    });
                    // `out.data = torch.empty((1,))`: the storage goes unless something else
                    // holds it.
                    let stand_in =
                        t.empty(1, t.dtype(output), "deallocated output (torch.empty(1))");
                    if t.tensor_refs(output) == 1 {
                        t.free_storage(output);
                    }
                    let kept = t.share(output);
                    s.in_flight.push((input, kept, stand_in));
                }
                Step::Pop => {
                    let (input, output, stand_in) = s.in_flight.remove(0);
                    // The list's reference becomes the local's.
                    if let Some(previous) = std::mem::replace(&mut s.input, input) {
                        let_go(t, previous);
                    }
                    let graph_input = input.inspect(|r| {
                        t.share(r.tensor);
                    });
                    let popped = Output {
                        tensor: output,
                        stand_in: Some(stand_in),
                        graph_input,
                    };
                    if let Some(previous) = s.output.replace(popped) {
                        previous.drop(t);
                    }
                }
                Step::Backward(_) => {
                    let output = s.output.as_ref().expect("popped").tensor;
                    let mut hooks = Hooks {
                        model,
                        batch,
                        received,
                    };
                    t.backward_graph(output, s.output_grad, &mut hooks);
                    // `input_tensor.grad`, which the input keeps too.
                    let grad = s
                        .input
                        .and_then(|r| t.params[r.leaf].grad)
                        .map(|g| t.share(g));
                    if let Some(previous) = std::mem::replace(&mut s.input_grad, grad) {
                        t.drop(previous);
                    }
                }
                Step::DropInput => {
                    if let Some(previous) = s.input.take() {
                        let_go(t, previous);
                    }
                }
            }
        }
        if let Some(output) = s.output.take() {
            output.drop(t);
        }
        schedule_returns(t, (s.input, s.output_grad, s.input_grad, total_tokens));
    }
}

/// What one `forward_backward_pipelining_with_interleaving` call runs on: the rank's chunks
/// (each a stage part of the model), the micro-batch, and the first parameter id of the
/// received tensors' leaves.
struct Interleaved<'a> {
    chunks: &'a [GptModel],
    parts: &'a [StagePart],
    batch: Batch,
    received: ParamId,
}

/// The interleaved schedule's per-chunk lists and its locals. The local `output_tensor` is the
/// newest output of the last forward's chunk (the lists' reference keeps it; it is
/// deallocated before any backward pops it).
#[derive(Default)]
struct Chunked {
    /// `input_tensors[c]`: the received inputs not yet backpropagated (none on chunk 0 of the
    /// first rank, which reads the tokens).
    inputs: Vec<VecDeque<Received>>,
    /// `output_tensors[c]`: each output, with its one-element stand-in once deallocated.
    outputs: Vec<VecDeque<(T, Option<T>)>>,
    /// `output_tensor_grads[c]`.
    grads: Vec<VecDeque<T>>,
    /// Backwards run per chunk: the offset of `input_tensors[c]`'s first micro-batch.
    popped: Vec<u64>,
    last_forward: usize,
    input: Option<Received>,
    output_grad: Option<T>,
    input_grad: Option<T>,
}

impl Interleaved<'_> {
    /// One call: `steps` in order over the inputs `(ids, loss_mask)` of every micro-batch;
    /// `block_inputs` are the chunks' `TransformerBlock.input_tensor`.
    fn run(
        &self,
        t: &mut Tracer,
        steps: &[megatron_interleaved::Step],
        (ids, loss_mask): (T, T),
        block_inputs: &mut [Option<Received>],
    ) {
        use megatron_interleaved::Step as S;
        let n = self.chunks.len();
        let activation = self.chunks[0].rows(self.batch.n()) * self.chunks[0].widths.hidden;
        let total_tokens = t.empty_as(1, DType::I32, Component::Inputs, "total_num_tokens");
        let mut s = Chunked {
            inputs: vec![VecDeque::new(); n],
            outputs: vec![VecDeque::new(); n],
            grads: vec![VecDeque::new(); n],
            popped: vec![0; n],
            ..Chunked::default()
        };
        let receive = |t: &mut Tracer, recv: Recv, label: &'static str| match recv {
            Recv::Into { .. } => {
                let outer = std::mem::replace(&mut t.component, Component::Communication);
                let tensor = t.empty(activation, DType::BF16, label);
                t.component = outer;
                Some(tensor)
            }
            _ => None,
        };
        for &step in steps {
            if t.mem.stopped() {
                break;
            }
            match step {
                S::Communicate { input, grad } => {
                    // Both receives are made, then the locals rebound, then the lists appended.
                    let new_input = receive(t, input, "recv_prev (torch.empty)").map(|tensor| {
                        let leaf = t.make_input_leaf(tensor);
                        Received { tensor, leaf }
                    });
                    let new_grad = receive(t, grad, "recv_next (torch.empty)");
                    if let Recv::Into { bind: true, .. } | Recv::Clear = input {
                        let next = new_input.inspect(|r| {
                            t.share(r.tensor);
                        });
                        if let Some(previous) = std::mem::replace(&mut s.input, next) {
                            let_go(t, previous);
                        }
                    }
                    if let Recv::Into { bind: true, .. } | Recv::Clear = grad {
                        let next = new_grad.map(|g| t.share(g));
                        if let Some(previous) = std::mem::replace(&mut s.output_grad, next) {
                            t.drop(previous);
                        }
                    }
                    if let (Recv::Into { chunk, .. }, Some(r)) = (input, new_input) {
                        s.inputs[chunk as usize].push_back(r);
                    }
                    if let (Recv::Into { chunk, .. }, Some(g)) = (grad, new_grad) {
                        s.grads[chunk as usize].push_back(g);
                    }
                }
                S::Forward { chunk, microbatch } => {
                    let c = chunk as usize;
                    let part = self.parts[c];
                    let input = (!part.pre_process)
                        .then(|| s.inputs[c][(microbatch - s.popped[c]) as usize]);
                    // `set_input_tensor(input_tensor)` on the chunk, then its forward.
                    let held = input.inspect(|r| {
                        t.share(r.tensor);
                    });
                    if let Some(previous) = std::mem::replace(&mut block_inputs[c], held) {
                        let_go(t, previous);
                    }
                    let stage_input = match input {
                        Some(r) => StageInput::Hidden(r.tensor),
                        None => StageInput::Ids(ids),
                    };
                    let mut output = self.chunks[c].forward_stage(t, stage_input, self.batch);
                    if part.post_process {
                        output = loss_func(t, output, loss_mask);
                    }
                    s.outputs[c].push_back((output, None));
                    s.last_forward = c;
                }
                S::Deallocate => {
                    let entry = s.outputs[s.last_forward]
                        .back_mut()
                        .expect("the local output is in its chunk's list");
                    // `out.data = torch.empty((1,))`: the storage goes unless something else
                    // holds it; a second call swaps the stand-in.
                    let stand_in =
                        t.empty(1, t.dtype(entry.0), "deallocated output (torch.empty(1))");
                    match entry.1.replace(stand_in) {
                        Some(previous) => t.drop(previous),
                        None => {
                            if t.tensor_refs(entry.0) == 1 {
                                t.free_storage(entry.0);
                            }
                        }
                    }
                }
                S::Backward { chunk, .. } => {
                    let c = chunk as usize;
                    let input = (!self.parts[c].pre_process)
                        .then(|| s.inputs[c].pop_front().expect("a received input"));
                    let (output, stand_in) = s.outputs[c].pop_front().expect("a forward ran");
                    let output_grad = s.grads[c].pop_front();
                    s.popped[c] += 1;
                    let mut hooks = Hooks {
                        model: &self.chunks[c],
                        batch: self.batch,
                        received: self.received,
                    };
                    t.backward_graph(output, output_grad, &mut hooks);
                    let grad = input
                        .and_then(|r| t.params[r.leaf].grad)
                        .map(|g| t.share(g));
                    // The helper's locals go, then `input_tensor_grad` is rebound.
                    if let Some(r) = input {
                        let_go(t, r);
                    }
                    t.drop(output);
                    for held in [stand_in, output_grad].into_iter().flatten() {
                        t.drop(held);
                    }
                    if let Some(previous) = std::mem::replace(&mut s.input_grad, grad) {
                        t.drop(previous);
                    }
                }
            }
        }
        schedule_returns(t, (s.input, s.output_grad, s.input_grad, total_tokens));
    }
}

/// The schedule returns: its locals (`input_tensor`, `output_tensor_grad`,
/// `input_tensor_grad`, `total_num_tokens`) go, and the graphs with them.
fn schedule_returns(
    t: &mut Tracer,
    (input, output_grad, input_grad, total_tokens): (Option<Received>, Option<T>, Option<T>, T),
) {
    if let Some(r) = input {
        let_go(t, r);
    }
    for held in [output_grad, input_grad].into_iter().flatten() {
        t.drop(held);
    }
    t.drop(total_tokens);
    t.free_graph();
}

/// One holder of a received tensor lets it go; with the last, the tensor and the gradient
/// accumulated into it are freed (its storage stays while a kept recomputed graph holds the
/// checkpoint's detached view of it).
fn let_go(t: &mut Tracer, r: Received) {
    t.drop(r.tensor);
    if t.refs_outside_kept_graphs(r.tensor) == 1 {
        t.release_input_leaf(r.leaf);
    }
}
