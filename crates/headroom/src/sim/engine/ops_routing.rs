//! The ops mixture-of-experts layers add: routing (`topk`, `sort`, gathers by index), the
//! grouped GEMM of the experts, masks and the pointwise ops of their gates. Each mirrors the
//! ATen op and its entry in `derivatives.yaml`.

use super::tracer::{Bwd, T, Tracer};
use crate::dtype::DType;

impl Tracer {
    /// `x[index]` of `rows` rows of width `numel(x) / input_rows`: a new tensor. Autograd keeps
    /// the index; backward is `new_zeros(x).index_put(index, grad, accumulate=True)`.
    pub(crate) fn index_rows(&mut self, x: T, index: T, out_numel: u64, label: &'static str) -> T {
        let out = self.empty(out_numel, self.dtype(x), label);
        let indices = self.numel(index);
        self.record(Bwd::IndexRows { indices }, &[Some(x)], &[out], &[index]);
        out
    }

    /// `torch._grouped_mm(x, w, offs)`: `x` (S, in) times each expert's slice of the 3-D
    /// parameter `w`, giving (S, out). Saves `x` and `w` (a view of the parameter).
    pub(crate) fn grouped_mm(&mut self, x: T, w: T, out_numel: u64) -> T {
        let out = self.empty(out_numel, self.dtype(w), "_grouped_mm output");
        let mut saved = smallvec::SmallVec::<[T; 2]>::new();
        if self.requires_grad(w) {
            saved.push(x);
        }
        if self.requires_grad(x) {
            saved.push(w);
        }
        self.record(Bwd::GroupedMm, &[Some(x), Some(w)], &[out], &saved);
        out
    }

    /// `x.masked_fill(mask, 0)`: a copy; backward masks the gradient into a new tensor.
    pub(crate) fn masked_fill(&mut self, x: T, mask: T) -> T {
        let out = self.empty(self.numel(x), self.dtype(x), "masked_fill");
        self.record(Bwd::MaskedFill, &[Some(x)], &[out], &[mask]);
        out
    }

    /// `x.masked_fill_(mask, 0)`: in place (the result shares `x`'s storage).
    pub(crate) fn masked_fill_in_place(&mut self, x: T, mask: T) -> T {
        let out = self.view(x, self.numel(x), "masked_fill_ (in place)");
        self.record(Bwd::MaskedFill, &[Some(x)], &[out], &[mask]);
        out
    }

    /// `torch.topk(x, k)` over the last dimension: values of `x`'s dtype and int64 indices,
    /// `out_numel` each. Backward scatters the values' gradient into zeros of `x`'s size.
    pub(crate) fn topk(&mut self, x: T, out_numel: u64) -> (T, T) {
        let values = self.empty(out_numel, self.dtype(x), "topk values");
        let indices = self.empty(out_numel, DType::I64, "topk indices");
        self.record(Bwd::SelectScatter, &[Some(x)], &[values], &[indices]);
        (values, indices)
    }

    /// `x.max(dim=-1, keepdim=True)`: values and int64 indices, one per row of `x`.
    pub(crate) fn max_last(&mut self, x: T, rows: u64) -> (T, T) {
        let values = self.empty(rows, self.dtype(x), "max values");
        let indices = self.empty(rows, DType::I64, "max indices");
        self.record(Bwd::SelectScatter, &[Some(x)], &[values], &[indices]);
        (values, indices)
    }

    /// `x.gather(dim, index)` of `numel(index)` elements (DeepSeek-V3's chosen scores).
    pub(crate) fn gather(&mut self, x: T, index: T) -> T {
        let out = self.empty(self.numel(index), self.dtype(x), "gather");
        self.record(Bwd::SelectScatter, &[Some(x)], &[out], &[index]);
        out
    }

    /// `x.sum(dim)` reducing `numel(x) / out_numel` elements into each output. Autocast runs
    /// `sum` with `dtype=float32` (its `fp32_set_opt_dtype` policy): half inputs give an fp32
    /// result.
    pub(crate) fn sum_dim(&mut self, x: T, out_numel: u64) -> T {
        let out = self.empty(out_numel, self.sum_dtype(x), "x.sum(dim)");
        self.record(Bwd::SumDim, &[Some(x)], &[out], &[]);
        out
    }

    /// The dtype of `x.sum(dim)`.
    fn sum_dtype(&self, x: T) -> DType {
        match self.autocast_dtype() {
            Some(_) if self.dtype(x).is_half() => DType::F32,
            _ => self.dtype(x),
        }
    }

    /// `x.view(tokens, k, rest).sum(dim=1)`, `out_numel` sums of `k` rows each. The sum's
    /// gradient is an expand (stride 0 over `k`); where autocast summed half values in fp32,
    /// `validate_outputs` casts it back into a new contiguous tensor that the view's backward
    /// reshapes as it is, and otherwise the view's backward copies it (`Bwd::ViewOfSummed`, a
    /// node that saves nothing: under checkpointing the copy is made before the region is
    /// recomputed and lives through it).
    pub(crate) fn view_sum(&mut self, x: T, out_numel: u64) -> T {
        let viewed = self.view(x, self.numel(x), "view(tokens, k, rest)");
        let op = if self.sum_dtype(x) == self.dtype(x) {
            Bwd::ViewOfSummed
        } else {
            Bwd::View
        };
        self.record(op, &[Some(x)], &[viewed], &[]);
        let out = self.sum_dim(viewed, out_numel);
        self.drop(viewed);
        out
    }

    /// `torch.sigmoid(x)`: saves its result.
    pub(crate) fn sigmoid(&mut self, x: T) -> T {
        let out = self.empty(self.numel(x), self.dtype(x), "sigmoid(x)");
        self.record(Bwd::Sigmoid, &[Some(x)], &[out], &[out]);
        out
    }

    /// `x.clamp(...)` of a (possibly strided) view: saves `x`, which keeps its base alive.
    pub(crate) fn clamp(&mut self, x: T) -> T {
        let out = self.empty(self.numel(x), self.dtype(x), "clamp");
        self.record(Bwd::Clamp, &[Some(x)], &[out], &[x]);
        out
    }

    /// `softmax(x, dim=-1, dtype=x.dtype)`: saves its result.
    pub(crate) fn softmax(&mut self, x: T) -> T {
        let out = self.empty(self.numel(x), self.dtype(x), "softmax");
        self.record(Bwd::Softmax, &[Some(x)], &[out], &[out]);
        out
    }

    /// `x.chunk(2, dim=-1)` (or the strided halves `x[..., ::2]`, `x[..., 1::2]`): two views;
    /// backward concatenates their gradients into a new tensor of `x`'s size.
    pub(crate) fn chunk2(&mut self, x: T) -> [T; 2] {
        let half = self.numel(x) / 2;
        let parts = [
            self.view(x, half, "chunk[0]"),
            self.view(x, half, "chunk[1]"),
        ];
        self.record(Bwd::Split, &[Some(x)], &parts, &[]);
        parts
    }

    /// `x.split([first, rest], dim=-1)`: two views; backward concatenates their gradients.
    pub(crate) fn split_at(&mut self, x: T, first: u64) -> [T; 2] {
        let rest = self.numel(x) - first;
        let parts = [
            self.view(x, first, "split[0]"),
            self.view(x, rest, "split[1]"),
        ];
        self.record(Bwd::Split, &[Some(x)], &parts, &[]);
        parts
    }

    /// `torch.sort(x)`: sorted values and int64 permutation, with cub's scratch.
    pub(crate) fn sort(&mut self, x: T) -> (T, T) {
        let n = self.numel(x);
        let values = self.empty(n, self.dtype(x), "sort values");
        let perm = self.empty(n, DType::I64, "sort indices");
        let scratch = self.empty(n * 2, DType::I64, "sort: cub scratch");
        self.drop(scratch);
        (values, perm)
    }

    /// peft's `baddbmm(W, B, A, alpha)` for LoRA on a 3-D expert parameter: a full copy of
    /// `W` plus the low-rank product. Saves both factors.
    pub(crate) fn baddbmm(&mut self, w: T, lhs: T, rhs: T) -> T {
        let out = self.empty(self.numel(w), self.dtype(w), "baddbmm(W, B, A): W + BA");
        self.record(
            Bwd::Baddbmm,
            &[Some(w), Some(lhs), Some(rhs)],
            &[out],
            &[lhs, rhs],
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use headroom_alloc::{AllocatorConfig, CachingAllocator};

    use super::super::memory::{Keep, Memory};
    use super::super::tracer::{BackwardHooks, T, Tracer};
    use crate::dtype::DType;

    struct NoCheckpoints;

    impl BackwardHooks for NoCheckpoints {
        fn recompute(&mut self, _: &mut Tracer, _: u32) {
            unreachable!("no checkpointed region")
        }
    }

    /// A tracer that records every allocation and free.
    fn tracing() -> Tracer {
        let memory = Memory::new(
            CachingAllocator::new(AllocatorConfig::default(), None),
            Keep {
                trace: true,
                timeline: false,
            },
        );
        Tracer::new(memory, crate::gpu::Gpu::default().workspaces())
    }

    /// The bytes of every gradient-sized allocation the backward of `x.view(tokens, k,
    /// hidden).sum(dim=1)` makes, `x` a (tokens * k, hidden) bf16 leaf, under `autocast`.
    fn backward_allocations(autocast: Option<DType>) -> Vec<u64> {
        let (tokens, k, hidden) = (64, 4, 256);
        let mut t = tracing();
        let p = t.parameter(tokens * k * hidden, DType::BF16, true, "x");
        let x: T = t.param(p);
        let outer = t.enter_autocast(autocast);
        let summed = t.view_sum(x, tokens * hidden);
        let loss = t.sum_dim(summed, 1);
        t.exit_autocast(outer);
        t.drop(summed);
        let start = t.mem.trace_len();
        t.backward(loss, &mut NoCheckpoints);
        let x_bytes = tokens * k * hidden * 2;
        t.mem.take_trace()[start..]
            .iter()
            .filter(|e| e.alloc && e.bytes == x_bytes)
            .map(|e| e.bytes)
            .collect()
    }

    /// `BmmBackward0` makes `mat2`'s gradient before `self`'s, as torch 2.11's profiler shows
    /// (`aten::bmm` of `mat2`'s shape first).
    #[test]
    fn bmm_backward_makes_the_second_operands_gradient_first() {
        let (b, m, k, n) = (4, 64, 32, 16);
        let mut t = tracing();
        let pa = t.parameter(b * m * k, DType::F32, true, "self");
        let pb = t.parameter(b * k * n, DType::F32, true, "mat2");
        let (x, y) = (t.param(pa), t.param(pb));
        let out = t.bmm(x, y, b * m * n);
        let loss = t.sum_dim(out, 1);
        t.drop(out);
        let start = t.mem.trace_len();
        t.backward(loss, &mut NoCheckpoints);
        let grads: Vec<u64> = t.mem.take_trace()[start..]
            .iter()
            .filter(|e| e.alloc && e.label == "grad of matmul")
            .map(|e| e.bytes)
            .collect();
        assert_eq!(grads, vec![b * k * n * 4, b * m * k * 4]);
    }

    /// The sum's gradient is an expand over `k`: the view's backward copies it into the
    /// input's gradient; where autocast summed in fp32, the cast back to bf16 is that copy
    /// and the view passes it on.
    #[test]
    fn a_view_summed_over_k_copies_its_gradient_once() {
        assert_eq!(backward_allocations(None).len(), 1);
        assert_eq!(backward_allocations(Some(DType::BF16)).len(), 1);
    }
}
