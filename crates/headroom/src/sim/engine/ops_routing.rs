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
        let dtype = match self.autocast_dtype() {
            Some(_) if self.dtype(x).is_half() => DType::F32,
            _ => self.dtype(x),
        };
        let out = self.empty(out_numel, dtype, "x.sum(dim)");
        self.record(Bwd::SumDim, &[Some(x)], &[out], &[]);
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
