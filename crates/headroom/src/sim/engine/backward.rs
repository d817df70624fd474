//! The backward formulas: for each node kind, which gradients it allocates and which
//! temporaries it needs, in PyTorch's order (`tools/autograd/derivatives.yaml` and the kernels
//! behind it). C++ temporaries of one expression live to the end of that expression, so they
//! are freed together, newest first.

use smallvec::SmallVec;

use super::component::Component;
use super::tracer::{Bwd, ChunkedLogProb, NodeId, T, Tracer};
use crate::dtype::DType;

pub(crate) type Grads = SmallVec<[Option<T>; 3]>;

impl Tracer {
    /// Run one node's backward: returns the gradient for each of its forward inputs, already
    /// reduced to the input's shape and cast to its dtype (`validate_outputs`).
    pub(crate) fn run_node(&mut self, node: NodeId) -> Grads {
        let op = self.node_op(node);
        let inputs = self.node_inputs(node);
        let saved = self.node_saved(node);
        let component = self.node_component(node);
        let outer = std::mem::replace(&mut self.component, component);
        let raw = self.raw_grads(node, op, &inputs, &saved);
        // The generated `apply` unpacks its saved tensors into locals, which die as it returns:
        // before `validate_outputs` casts or reduces what it computed.
        self.release_saved(node);
        let mut out = Grads::new();
        for (slot, (grad, meta)) in raw
            .into_iter()
            .zip(inputs.iter().copied().chain(std::iter::repeat(None)))
            .enumerate()
        {
            out.push(match (grad, meta) {
                // A DTensor's gradient is checked against its global shape: the replicated
                // gradient of a sharded weight passes as it is.
                (Some(grad), Some(_)) if matches!(op, Bwd::EmbeddingReplicatedGrad { .. }) => {
                    Some(grad)
                }
                (Some(grad), Some((numel, dtype))) => {
                    let outer = self.input_is_parameter(node, slot);
                    Some(self.validate(grad, numel, dtype, outer))
                }
                (Some(grad), None) => {
                    self.drop(grad);
                    None
                }
                (None, _) => None,
            });
        }
        self.component = outer;
        out
    }

    /// `validate_outputs`: sum a broadcast gradient back to the input's shape (over the outer
    /// dimensions for a parameter, the inner ones for an activation), then cast it to the
    /// input's dtype.
    fn validate(&mut self, grad: T, numel: u64, dtype: DType, outer: bool) -> T {
        let mut grad = grad;
        if self.numel(grad) != numel {
            let reduced = self.empty(
                numel,
                self.dtype(grad),
                "grad reduced to input shape (sum_to)",
            );
            if outer {
                self.reduction_staging(numel, self.numel(grad) / numel.max(1), DType::F32);
            }
            self.drop(grad);
            grad = reduced;
        }
        if self.dtype(grad) != dtype {
            let cast = self.empty(numel, dtype, "grad cast to input dtype");
            self.drop(grad);
            grad = cast;
        }
        grad
    }

    /// A fresh gradient for input `i` at the incoming gradient's dtype and the output's size.
    fn like_grad(&mut self, g: T, label: &'static str) -> T {
        self.empty(self.numel(g), self.dtype(g), label)
    }

    fn raw_grads(
        &mut self,
        node: NodeId,
        op: Bwd,
        inputs: &[Option<(u64, DType)>],
        saved: &[T],
    ) -> Grads {
        let needs = |i: usize| inputs.get(i).copied().flatten();
        let Some(g) = self.node_grad(node, 0).or_else(|| self.node_grad(node, 1)) else {
            return Grads::new();
        };
        let mut out = Grads::new();
        match op {
            Bwd::AccumulateGrad(param) if self.params[param].grad.is_some() => {
                // `accumulate_grad.h`, gradient accumulation: `variable.grad += new_grad` in
                // place; the incoming gradient goes with the node's buffer.
            }
            Bwd::AccumulateGrad(param) => {
                // `accumulate_grad.h`: steal the incoming gradient when nothing else holds it.
                let grad = if self.tensor_refs(g) == 1 {
                    self.take_node_grad(node, 0)
                } else {
                    self.empty(self.numel(g), self.dtype(g), "grad clone (AccumulateGrad)")
                };
                self.recategorize(grad, Component::Gradients);
                self.store_param_grad(param, grad);
            }
            Bwd::ToCopy => {
                if let Some((numel, dtype)) = needs(0) {
                    out.push(Some(self.empty(
                        numel,
                        dtype,
                        "grad of .to() (ToCopyBackward)",
                    )));
                }
            }
            Bwd::Mul => {
                // `MulBackward0` computes `other`'s gradient before `self`'s.
                let other = needs(1).map(|_| self.like_grad(g, "grad of mul"));
                let this = needs(0).map(|_| self.like_grad(g, "grad of mul"));
                out.push(this);
                out.push(other);
            }
            Bwd::MulScalar
            | Bwd::Neg
            | Bwd::Silu
            | Bwd::GeluTanh
            | Bwd::Tanh
            | Bwd::Dropout
            | Bwd::Sigmoid
            | Bwd::Clamp
            | Bwd::MaskedFill => {
                out.push(Some(self.like_grad(g, "grad of pointwise op")));
            }
            Bwd::Add => {
                for i in 0..2 {
                    out.push(needs(i).map(|_| self.share(g)));
                }
            }
            Bwd::AddScalar | Bwd::Clone | Bwd::HeadSplit { copy: false } => {
                out.push(Some(self.share(g)))
            }
            Bwd::View => {
                // `grad.reshape(sizes)` of a contiguous gradient: a differentiable view, whose
                // base stays alive with it, so `InputBuffer` never sums into it in place.
                let view = self.view(g, self.numel(g), "grad of view (reshape)");
                self.mark_view_of_temporary(view);
                out.push(Some(view));
            }
            Bwd::ViewOfSummed => out.push(Some(
                self.like_grad(g, "grad of view (reshape of the sum's expand: copy)"),
            )),
            Bwd::HeadSplit { copy: true } => out.push(Some(
                self.like_grad(g, "grad reshaped to (b, s, heads*d) (copy)"),
            )),
            Bwd::Pow2 => {
                // grad * (2 * self.pow(1)): three results, two temporaries.
                let base = saved[0];
                let t1 = self.empty(
                    self.numel(base),
                    self.dtype(base),
                    "pow backward: self.pow(1)",
                );
                let t2 = self.empty(self.numel(base), self.dtype(base), "pow backward: 2 * self");
                let t3 = self.like_grad(g, "grad of pow");
                self.drop(t2);
                self.drop(t1);
                out.push(Some(t3));
            }
            Bwd::SumDim => {
                // `grad.unsqueeze(dim).expand(sizes)`: a view (cast by validate_outputs when
                // autocast summed in fp32).
                let (numel, _) = needs(0).expect("a sum's input needs grad");
                out.push(Some(self.view(g, numel, "grad of sum(dim) (expand)")));
            }
            Bwd::MeanLastDim | Bwd::Reduce => {
                let (numel, _) = needs(0).expect("a mean's input needs grad");
                out.push(Some(self.empty(
                    numel,
                    self.dtype(g),
                    "grad of mean (expand / n)",
                )));
            }
            Bwd::Rsqrt => {
                // -0.5 * grad * result.pow(3)
                let t1 = self.like_grad(g, "rsqrt backward: -0.5 * grad");
                let t2 = self.like_grad(g, "rsqrt backward: result.pow(3)");
                let t3 = self.like_grad(g, "grad of rsqrt");
                self.drop(t2);
                self.drop(t1);
                out.push(Some(t3));
            }
            Bwd::Cat => {
                // Each input's gradient is a narrow view of the incoming one.
                for i in 0..inputs.len() {
                    out.push(
                        needs(i).map(|(numel, _)| self.view(g, numel, "grad of cat (narrow view)")),
                    );
                }
            }
            Bwd::Split => {
                let (numel, _) = needs(0).expect("a split's input needs grad");
                out.push(Some(self.empty(
                    numel,
                    self.dtype(g),
                    "grad of split (cat)",
                )));
            }
            Bwd::Slice => {
                let (numel, _) = needs(0).expect("a slice's input needs grad");
                out.push(Some(self.empty(
                    numel,
                    self.dtype(g),
                    "grad of slice (zeros + copy)",
                )));
            }
            Bwd::Linear {
                bias,
                input_grad_first,
            } => {
                // The bias gradient is the incoming one, summed over rows by validate_outputs.
                // mm_mat2_backward returns `grad.t().mm(input).t()`: a view of a temporary.
                let weight_grad = |t: &mut Tracer| {
                    needs(1).map(|(numel, _)| {
                        let w = t.empty(numel, t.dtype(g), "grad of weight (mm)");
                        t.mark_view_of_temporary(w);
                        t.ensure_cublas_workspace();
                        w
                    })
                };
                // The input's gradient is the 2-D `mm` result viewed back to 3-D: also a view.
                let input_grad = |t: &mut Tracer| {
                    needs(0).map(|(numel, _)| {
                        let x = t.empty(numel, t.dtype(g), "grad of linear input (mm)");
                        t.mark_view_of_temporary(x);
                        t.ensure_cublas_workspace();
                        x
                    })
                };
                let (grad_x, grad_w) = if input_grad_first {
                    let x = input_grad(self);
                    (x, weight_grad(self))
                } else {
                    let w = weight_grad(self);
                    (input_grad(self), w)
                };
                out.push(grad_x);
                out.push(grad_w);
                if bias {
                    out.push(needs(2).map(|_| self.share(g)));
                }
            }
            Bwd::Embedding => {
                out.push(
                    needs(0).map(|(numel, _)| self.embedding_dense_backward(g, saved[0], numel)),
                );
            }
            Bwd::EmbeddingReplicatedGrad { tp } => out.push(needs(0).map(|(numel, _)| {
                self.empty(numel * tp, self.dtype(g), "grad of embedding (Replicate)")
            })),
            Bwd::SdpaFlash { workspace } | Bwd::SdpaCudnn { workspace } => {
                for i in 0..3 {
                    out.push(needs(i).map(|(numel, _)| {
                        self.empty(numel, self.dtype(g), "grad of q/k/v (attention)")
                    }));
                }
                let ws = self.empty(workspace, DType::U8, "attention backward workspace");
                self.drop(ws);
            }
            Bwd::RingAttention(ring) => {
                let grads = self.ring_attention_backward(ring, self.dtype(g));
                out.extend(grads.map(Some));
            }
            Bwd::SdpaEfficient {
                workspace,
                accumulator,
                delta,
            } => {
                for i in 0..3 {
                    out.push(needs(i).map(|(numel, _)| {
                        self.empty(numel, self.dtype(g), "grad of q/k/v (attention)")
                    }));
                }
                let acc = self.empty(
                    accumulator,
                    DType::U8,
                    "efficient attention: fp32 accumulator",
                );
                let delta_t = self.empty(delta, DType::U8, "efficient attention: delta");
                let lse = self.empty(
                    delta,
                    DType::U8,
                    "efficient attention: logsumexp.contiguous()",
                );
                self.drop_all(&[lse, acc]);
                let ws = self.empty(
                    workspace,
                    DType::U8,
                    "efficient attention backward workspace",
                );
                self.drop_all(&[delta_t, ws]);
            }
            Bwd::MatMul4Bit { weights } => {
                // `matmul(grad, dequantize_4bit(B).to(grad.dtype))`: the absmax of each block of
                // 64 dequantised to fp32, the weight in the compute dtype, then the product.
                let absmax =
                    self.empty(weights.div_ceil(64), DType::F32, "dequantize_4bit: absmax");
                let weight = self.empty(weights, self.dtype(g), "dequantize_4bit: weight");
                self.drop(absmax);
                out.push(needs(0).map(|(numel, _)| {
                    self.empty(numel, self.dtype(g), "grad of 4-bit linear input")
                }));
                self.drop(weight);
            }
            // CUDA's `softmax_backward_cuda_out` computes `grad * output` into a gradient-sized
            // tensor after its result and frees it before returning (log-softmax's does not).
            Bwd::Softmax => {
                let grad =
                    needs(0).map(|(numel, _)| self.empty(numel, self.dtype(g), "grad of softmax"));
                let scratch = self.like_grad(g, "softmax backward scratch");
                self.drop(scratch);
                out.push(grad);
            }
            Bwd::Bmm => {
                // `BmmBackward0` computes `mat2`'s gradient (`self.transpose(1, 2).bmm(grad)`)
                // before `self`'s (`grad.bmm(mat2.transpose(1, 2))`).
                let mat2 =
                    needs(1).map(|(numel, _)| self.empty(numel, self.dtype(g), "grad of matmul"));
                let this =
                    needs(0).map(|(numel, _)| self.empty(numel, self.dtype(g), "grad of matmul"));
                out.push(this);
                out.push(mat2);
            }
            Bwd::LayerNorm => {
                // native_layer_norm_backward: grad_input, then grad_weight and grad_bias.
                out.push(needs(0).map(|(numel, _)| {
                    self.empty(numel, self.dtype(g), "grad of layer_norm input")
                }));
                for i in 1..3 {
                    out.push(needs(i).map(|(numel, _)| {
                        self.empty(numel, self.dtype(g), "grad of layer_norm affine")
                    }));
                }
            }
            Bwd::LogSoftmax => {
                out.push(
                    needs(0).map(|(numel, _)| self.empty(numel, self.dtype(g), "grad of softmax")),
                );
            }
            Bwd::Sum => {
                let (numel, _) = needs(0).expect("a sum's input needs grad");
                out.push(Some(self.view(g, numel, "grad of sum (expand)")));
            }
            Bwd::MaskedIndex { selected } => {
                let (numel, dtype) = needs(0).expect("an index's input needs grad");
                let grad = self.empty(numel, dtype, "grad of x[mask] (new_zeros)");
                self.index_put_temporaries(selected);
                out.push(Some(grad));
            }
            Bwd::MaskedScatter { selected } => {
                let index = self.nonzero(selected);
                let grad = self.empty(selected, self.dtype(g), "masked_select(grad, mask)");
                self.drop(index);
                out.push(needs(0).map(|_| grad));
            }
            Bwd::ChunkedLogProb(head) => {
                let [hidden, weight] = self.chunked_logprob_backward(head, needs(1).is_some());
                out.push(hidden);
                out.push(weight);
            }
            Bwd::LigerRmsNorm {
                width,
                partial_rows,
            } => {
                out.push(needs(0).map(|_| self.share(g)));
                out.push(needs(1).map(|(_, dtype)| {
                    let partial = self.empty(partial_rows * width, DType::F32, "LigerRMSNorm _dW");
                    let sum = self.empty(width, DType::F32, "_dW.sum(0)");
                    self.drop(partial);
                    if dtype == DType::F32 {
                        sum
                    } else {
                        let cast = self.empty(width, dtype, "dW.to(W.dtype)");
                        self.drop(sum);
                        cast
                    }
                }));
            }
            Bwd::InPlacePair => {
                for (i, &x) in saved.iter().enumerate() {
                    out.push(
                        needs(i).map(|(numel, _)| self.view(x, numel, "gradient written in place")),
                    );
                }
            }
            Bwd::InPlace => out.push(Some(self.share(g))),
            Bwd::LigerFusedLinearCrossEntropy => {
                // `torch.equal(grad_output, torch.tensor(1.0, device=...))`.
                let one = self.empty(1, DType::F32, "torch.tensor(1.0)");
                self.drop(one);
                let mut saved = saved.iter();
                let input = saved.next().map(|&x| self.share(x));
                out.push(input);
                out.push(needs(1).and_then(|_| saved.next()).map(|&w| self.share(w)));
            }
            Bwd::IndexRows { indices } => {
                let (numel, dtype) = needs(0).expect("an index's input needs grad");
                let grad = self.empty(numel, dtype, "grad of x[index] (zeros, index_put_)");
                self.index_sort_temporaries(indices);
                out.push(Some(grad));
            }
            Bwd::GroupedMm => {
                let weight = needs(1).map(|(numel, _)| {
                    self.empty(numel, self.dtype(g), "grad of expert weights (_grouped_mm)")
                });
                let input = needs(0).map(|(numel, _)| {
                    self.empty(numel, self.dtype(g), "grad of _grouped_mm input")
                });
                out.push(input);
                out.push(weight);
            }
            Bwd::SelectScatter => {
                out.push(needs(0).map(|(numel, _)| {
                    self.empty(
                        numel,
                        self.dtype(g),
                        "grad scattered into zeros (topk/gather)",
                    )
                }));
            }
            Bwd::SliceCopies => {
                let copy = self.like_grad(g, "CopySlices: grad copy");
                for i in 0..inputs.len() {
                    out.push(needs(i).map(|(numel, _)| {
                        self.empty(numel, self.dtype(g), "CopySlices: slice of grad (clone)")
                    }));
                }
                self.drop(copy);
            }
            Bwd::IndexAdd => {
                out.push(needs(0).map(|_| self.share(g)));
                out.push(needs(1).map(|(numel, _)| {
                    self.empty(
                        numel,
                        self.dtype(g),
                        "grad of index_add_ source (index_select)",
                    )
                }));
            }
            Bwd::Baddbmm => {
                out.push(None);
                for i in 1..3 {
                    out.push(needs(i).map(|(numel, _)| {
                        let product = self.empty(numel, self.dtype(g), "baddbmm backward: bmm");
                        let scaled = self.empty(numel, self.dtype(g), "baddbmm backward: * alpha");
                        self.drop(product);
                        scaled
                    }));
                }
            }
            Bwd::RouterGating => {
                // `RouterGatingLinearFunction.backward` returns the input's gradient as
                // `grad_input.view(*inp_shape)`: a view of the `mm` result (or of its cast).
                let router = self.dtype(g);
                for i in 0..2 {
                    out.push(needs(i).map(|(numel, dtype)| {
                        let other = saved[1 - i];
                        let up = (dtype != router).then(|| {
                            self.empty(self.numel(other), router, "operand.to(router_dtype)")
                        });
                        self.ensure_cublas_workspace();
                        let product = self.empty(numel, router, "grad of router gating (mm)");
                        let grad = match up {
                            Some(up) => {
                                self.drop(up);
                                let down = self.empty(numel, dtype, "grad.to(input dtype)");
                                self.drop(product);
                                down
                            }
                            None => product,
                        };
                        if i == 0 {
                            self.mark_view_of_temporary(grad);
                        }
                        grad
                    }));
                }
            }
            Bwd::AuxLossScaler => {
                let ones = self.empty(1, DType::F32, "ones_like(aux_loss)");
                let scaled = self.empty(1, DType::F32, "ones_like(aux_loss) * scale");
                self.drop(ones);
                out.push(Some(self.share(g)));
                if needs(1).is_some() {
                    out.push(Some(scaled));
                } else {
                    self.drop(scaled);
                    out.push(None);
                }
            }
            Bwd::SequenceParallelLinear { tp } => {
                let (x, w) = (saved[0], saved[1]);
                let dtype = self.dtype(g);
                let whole = self.empty(self.numel(x) * tp, dtype, "grad_output.matmul(weight)");
                self.ensure_cublas_workspace();
                let sharded = self.empty(self.numel(x), dtype, "sub_grad_input (reduce-scatter)");
                let weight =
                    self.empty(self.numel(w), dtype, "grad_output.t().matmul(total_input)");
                self.drop(whole);
                for (i, grad) in [sharded, weight].into_iter().enumerate() {
                    if needs(i).is_some() {
                        out.push(Some(grad));
                    } else {
                        self.drop(grad);
                        out.push(None);
                    }
                }
            }
            Bwd::GatherBack => out.push(needs(0).map(|(numel, _)| {
                self.empty(
                    numel,
                    self.dtype(g),
                    "grad gathered back (gather / all-to-all)",
                )
            })),
            Bwd::VocabParallelCrossEntropy { tokens } => {
                let mask = self.empty(tokens, DType::F32, "target_mask.float()");
                let update = self.empty(tokens, DType::F32, "1.0 - target_mask");
                self.drop(mask);
                let arange = self.empty(tokens, DType::I64, "arange(rows)");
                let picked = self.empty(tokens, DType::F32, "grad_2d[arange, target]");
                let updated = self.empty(tokens, DType::F32, "grad_2d[arange, target] - update");
                self.drop_all(&[picked, updated, arange, update]);
                out.push(needs(0).map(|_| self.share(saved[0])));
            }
            Bwd::LogSoftmaxParallel => out.push(needs(0).map(|_| self.share(g))),
            Bwd::NllLossParallel => {
                out.push(needs(0).map(|(numel, dtype)| {
                    let zeros = self.empty(numel, dtype, "zeros_like(x) (loss_parallel backward)");
                    let exp = self.empty(numel, dtype, "exp(x) (loss_parallel backward)");
                    let sum = self.empty(numel, dtype, "grad_input + exp(x)");
                    self.drop(exp);
                    let grad = self.empty(numel, dtype, "grad of nll_loss and log_softmax");
                    self.drop_all(&[sum, zeros]);
                    grad
                }));
            }
            Bwd::AllReduce => out
                .push(needs(0).map(|(numel, dtype)| self.empty(numel, dtype, "all_reduce(grad)"))),
            Bwd::ChunkOfGathered => out.push(
                needs(0).map(|(numel, dtype)| self.empty(numel, dtype, "grad chunk (clone)")),
            ),
            Bwd::ReduceScatter { tp } => out.push(needs(0).map(|_| {
                let (numel, dtype) = (self.numel(g), self.dtype(g));
                let chunks = self.empty(numel, dtype, "reduce_scatter input (grad chunks cat)");
                let grad = self.empty(numel / tp, dtype, "reduce-scattered grad");
                self.drop(chunks);
                grad
            })),
            Bwd::AllGather { tp, sequences } => out.push(needs(0).map(|_| {
                let (numel, dtype) = (self.numel(g) * tp, self.dtype(g));
                let gathered = self.empty(numel, dtype, "all-gathered grad");
                if sequences == 1 {
                    return gathered;
                }
                let cat = self.empty(numel, dtype, "all-gathered grad in sequence order");
                self.drop(gathered);
                cat
            })),
            Bwd::NllLoss => {
                out.push(needs(0).map(|(numel, dtype)| {
                    self.empty(numel, dtype, "grad of nll_loss (zeros + scatter)")
                }));
            }
        }
        out
    }
}

impl Tracer {
    /// `embedding_dense_backward_cuda` (`Embedding.cu`, `EmbeddingBackwardKernel.cu`) of the
    /// incoming gradient `g` over the saved `ids`, for a weight of `weight_numel` elements:
    /// returns the weight's gradient (`zeros`). Up to 3072 indices one kernel accumulates into
    /// it; past that the indices are sorted (`sorted_indices`, `orig_indices`, an `arange`) and
    /// summed by segments of equal index: each segment's offsets, their partial segments of
    /// `NROWS_PER_THREAD` rows, and a buffer of every partial segment's sums in the
    /// accumulation dtype (fp32 for 16-bit gradients), freed in reverse as their scopes end.
    /// cub's own scratch for the sort and the scans is left out (under 100 KiB here).
    fn embedding_dense_backward(&mut self, g: T, ids: T, weight_numel: u64) -> T {
        const DIRECT_MAX_INDICES: u64 = 3072;
        const NROWS_PER_THREAD: u64 = 10;
        let indices = self.numel(ids);
        let index = self.dtype(ids);
        let width = self.numel(g) / indices.max(1);
        let dtype = self.dtype(g);
        if indices <= DIRECT_MAX_INDICES {
            return self.empty(weight_numel, dtype, "grad of embedding");
        }
        let sorted = self.empty(indices, index, "embedding backward: sorted indices");
        let orig = self.empty(indices, index, "embedding backward: original positions");
        let range = self.empty(indices, index, "embedding backward: arange");
        self.drop(range);
        let grad = self.empty(weight_numel, dtype, "grad of embedding");
        let num_weights = weight_numel / width.max(1);
        let max_segments = indices.min(num_weights);
        let max_partial_segments = indices / NROWS_PER_THREAD + max_segments;
        let segment_offsets = self.empty(indices, index, "embedding backward: segment offsets");
        let segments = self.empty(1, DType::I64, "embedding backward: segment count");
        let partials = self.empty(
            max_segments,
            index,
            "embedding backward: partials per segment",
        );
        let partial_offsets = self.empty(
            max_segments,
            index,
            "embedding backward: partials per segment offset",
        );
        let partial_count = self.empty(1, DType::I64, "embedding backward: partial segment count");
        let partial_segment_offsets = self.empty(
            max_partial_segments,
            index,
            "embedding backward: partial segment offsets",
        );
        let acc = match dtype {
            DType::BF16 | DType::F16 => DType::F32,
            other => other,
        };
        let sums = self.empty(
            max_partial_segments * width,
            acc,
            "embedding backward: partial segment sums",
        );
        self.drop_all(&[
            sums,
            partial_segment_offsets,
            partial_count,
            partial_offsets,
            partials,
            segments,
            segment_offsets,
            orig,
            sorted,
        ]);
        grad
    }

    /// `nonzero` of a boolean mask with `selected` true elements: a count, cub's scratch, the
    /// `[selected, 2]` int64 indices (returned) and cub's second scratch.
    pub(crate) fn nonzero(&mut self, selected: u64) -> T {
        let count = self.empty(1, DType::I32, "nonzero: count");
        let scratch = self.empty(1, DType::U8, "nonzero: cub scratch");
        self.drop(scratch);
        let index = self.empty(2 * selected, DType::I64, "nonzero(mask)");
        let scratch = self.empty(1023, DType::U8, "nonzero: cub scratch");
        self.drop_all(&[scratch, count]);
        index
    }

    /// `index_put_(indices, values, accumulate=True)` of `selected` rows: the nonzero of the
    /// mask, the linearised index and its sort (`index_put_with_sort_kernel`), all freed.
    fn index_put_temporaries(&mut self, selected: u64) {
        let index = self.nonzero(selected);
        let linear = self.empty(selected, DType::I64, "index_put: linear index");
        let product = self.empty(selected, DType::I64, "index_put: index * stride");
        self.drop(product);
        self.drop(index);
        let sorted = self.empty(selected, DType::I64, "index_put: sorted index");
        let order = self.empty(selected, DType::I64, "index_put: sort order");
        let arange = self.empty(selected, DType::I64, "index_put: arange");
        let scratch = self.empty(2 * selected, DType::I64, "index_put: cub sort scratch");
        self.drop_all(&[scratch, arange, order, sorted, linear]);
    }

    /// `index_put_(indices, values, accumulate=True)` with an integer index of `indices`
    /// elements: the linearised index and its sort (`index_put_with_sort_kernel`), all freed.
    fn index_sort_temporaries(&mut self, indices: u64) {
        let linear = self.empty(indices, DType::I64, "index_put: linear index");
        let sorted = self.empty(indices, DType::I64, "index_put: sorted index");
        let order = self.empty(indices, DType::I64, "index_put: sort order");
        let scratch = self.empty(2 * indices, DType::I64, "index_put: cub sort scratch");
        self.drop_all(&[scratch, order, sorted, linear]);
    }

    /// `_ChunkedLogProbFunction.backward`: fp32 accumulators for the hidden states' and (when
    /// it trains) the weight's gradient, the logits tile, each tile of logits recomputed in
    /// place and turned into its gradient, the casts of hidden and weight tiles to the compute
    /// dtype when they differ (a weight tile is kept across both `addmm`s, so the next is
    /// made before the last goes), then the accumulators cast to the inputs' dtypes.
    fn chunked_logprob_backward(
        &mut self,
        head: ChunkedLogProb,
        weight_grad: bool,
    ) -> [Option<T>; 2] {
        let (n, h, v) = (head.tokens, head.hidden, head.vocab);
        let hidden32 = self.empty(n * h, DType::F32, "chunked log-prob: grad_hidden (fp32)");
        let weight32 = weight_grad
            .then(|| self.empty(v * h, DType::F32, "chunked log-prob: grad_weight (fp32)"));
        let tile = self.empty(head.tile_numel(), head.compute, "chunked log-prob: mm_buf");
        self.ensure_cublas_workspace();
        let mut hidden_chunk: Option<T> = None;
        let mut weight_chunk: Option<T> = None;
        let mut start = 0;
        while start < n {
            let rows = (n - start).min(ChunkedLogProb::TOKEN_TILE);
            if head.hidden_dtype != head.compute {
                let chunk = self.empty(rows * h, head.compute, "hidden[t0:t1].to(compute)");
                if let Some(old) = hidden_chunk.replace(chunk) {
                    self.drop(old);
                }
            }
            if head.weight_dtype != head.compute {
                let mut column = 0;
                while column < v {
                    let width = (v - column).min(ChunkedLogProb::VOCAB_TILE);
                    let chunk = self.empty(width * h, head.compute, "weight[s:e].to(compute)");
                    if let Some(old) = weight_chunk.replace(chunk) {
                        self.drop(old);
                    }
                    column += width;
                }
            }
            start += rows;
        }
        for chunk in [weight_chunk, hidden_chunk].into_iter().flatten() {
            self.drop(chunk);
        }
        let hidden = if head.hidden_dtype == DType::F32 {
            self.share(hidden32)
        } else {
            self.empty(n * h, head.hidden_dtype, "grad_hidden.to(hidden.dtype)")
        };
        let weight = weight32.map(|w32| {
            if head.weight_dtype == DType::F32 {
                self.share(w32)
            } else {
                self.empty(v * h, head.weight_dtype, "grad_weight.to(weight.dtype)")
            }
        });
        self.drop(hidden32);
        if let Some(w32) = weight32 {
            self.drop(w32);
        }
        self.drop(tile);
        [Some(hidden), weight]
    }
}
