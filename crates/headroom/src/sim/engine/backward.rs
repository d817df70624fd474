//! The backward formulas: for each node kind, which gradients it allocates and which
//! temporaries it needs, in PyTorch's order (`tools/autograd/derivatives.yaml` and the kernels
//! behind it). C++ temporaries of one expression live to the end of that expression, so they
//! are freed together, newest first.

use smallvec::SmallVec;

use super::component::Component;
use super::tracer::{Bwd, NodeId, T, Tracer};
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
        let mut out = Grads::new();
        for (grad, meta) in raw
            .into_iter()
            .zip(inputs.iter().copied().chain(std::iter::repeat(None)))
        {
            out.push(match (grad, meta) {
                (Some(grad), Some((numel, dtype))) => Some(self.validate(grad, numel, dtype)),
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

    /// `validate_outputs`: sum a broadcast gradient back to the input's shape, then cast it to
    /// the input's dtype.
    fn validate(&mut self, grad: T, numel: u64, dtype: DType) -> T {
        let mut grad = grad;
        if self.numel(grad) != numel {
            let reduced = self.empty(
                numel,
                self.dtype(grad),
                "grad reduced to input shape (sum_to)",
            );
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
                for i in 0..2 {
                    out.push(needs(i).map(|_| self.like_grad(g, "grad of mul")));
                }
            }
            Bwd::MulScalar | Bwd::Neg | Bwd::Silu | Bwd::GeluTanh | Bwd::Tanh | Bwd::Dropout => {
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
            Bwd::Linear { bias } => {
                // MmBackward0 computes the weight's gradient first, AddmmBackward0 the input's;
                // the bias gradient is the incoming one, summed over rows by validate_outputs.
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
                let (grad_x, grad_w) = if bias {
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
                    needs(0)
                        .map(|(numel, _)| self.empty(numel, self.dtype(g), "grad of embedding")),
                );
            }
            Bwd::SdpaFlash { workspace } | Bwd::SdpaCudnn { workspace } => {
                for i in 0..3 {
                    out.push(needs(i).map(|(numel, _)| {
                        self.empty(numel, self.dtype(g), "grad of q/k/v (attention)")
                    }));
                }
                let ws = self.empty(workspace, DType::U8, "attention backward workspace");
                self.drop(ws);
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
            Bwd::SafeSoftmax => {
                let grad =
                    needs(0).map(|(numel, _)| self.empty(numel, self.dtype(g), "grad of softmax"));
                let scratch = self.like_grad(g, "softmax backward scratch");
                self.drop(scratch);
                out.push(grad);
            }
            Bwd::Bmm => {
                for i in 0..2 {
                    out.push(
                        needs(i)
                            .map(|(numel, _)| self.empty(numel, self.dtype(g), "grad of matmul")),
                    );
                }
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
            Bwd::Softmax | Bwd::LogSoftmax => {
                out.push(
                    needs(0).map(|(numel, _)| self.empty(numel, self.dtype(g), "grad of softmax")),
                );
            }
            Bwd::NllLoss => {
                out.push(needs(0).map(|(numel, dtype)| {
                    self.empty(numel, dtype, "grad of nll_loss (zeros + scatter)")
                }));
            }
        }
        out
    }
}
