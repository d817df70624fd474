//! Ring attention as torch 2.11's context parallelism runs it
//! (`torch/distributed/tensor/experimental/_context_parallel/_attention.py`,
//! `_templated_ring_attention` and `_templated_ring_attention_backward`) for the flash kernel,
//! causal, with the head-tail load balancer and the all-gather rotation (torchtitan's
//! default), on context-parallel rank `rank`.
//!
//! Each rank holds two of the sequence's `2 × cp` chunks (`seq` rows, the head and the tail).
//! Forward: the local keys and values are made contiguous, concatenated and all-gathered
//! once (`cp` ranks' `[k, v]`); step 0 attends the local chunks causally. Each later step `i`
//! takes another rank's keys and values from the gathered buffer: while `i <= rank` all the
//! queries attend their first half (a *full* step: `_SDPAMerger` replaces its whole output
//! and log-sum-exp), after that only the second half of the queries attends all of them (a
//! *partial* step: the merged half goes back in by a `torch.cat` of the chunks, a new fp32
//! output). So rank 0 runs only partial steps and the last rank only full ones. The merger
//! keeps the output in fp32 and the log-sum-exp, merging each block
//! (`out - sigmoid(lse_b - lse) * (out - out_b)`). The result is cast back: head-major where a
//! `torch.cat` rebuilt it (transformers' `transpose(1, 2).contiguous()` then copies it), else
//! in the flash output's sequence-major strides (on the last rank: the transpose is a view).
//!
//! Backward: fp32 zeros for dq, dk, dv; the keys and values gathered again (their `cat`
//! kept in `next_kv`); each step runs the flash backward on its chunks (a partial step's
//! log-sum-exp half made contiguous), adds dk and dv into the fp32 buffer that came round the
//! ring (a full step adds into its first half by a `torch.cat`: new dk and dv), concatenates
//! them and sends them on (`permute_tensor`, an all-to-all: a new buffer), and adds dq in
//! place (full) or into its second half by another `torch.cat` (partial). At the end dq and
//! the arrived `[dk, dv]` are cast back; dk and dv are views of one buffer.

use super::component::Component;
use super::tracer::{Ring, T, Tracer};
use crate::dtype::DType;

impl Ring {
    fn q_numel(&self) -> u64 {
        self.batch * self.heads * self.seq * self.head_dim
    }

    fn kv_numel(&self) -> u64 {
        self.batch * self.kv_heads * self.seq * self.head_dim
    }

    /// The flash kernel's log-sum-exp: fp32, one per query row and head.
    fn lse_numel(&self) -> u64 {
        self.batch * self.heads * self.seq
    }

    /// Whether step `i` (from 1) is a full step on this rank (all queries, the first half of
    /// the keys), else a partial one (the second half of the queries, all keys).
    fn full_step(&self, i: u64) -> bool {
        i <= self.rank
    }

    /// Whether every step after the first is full (the group's last rank): no `torch.cat`
    /// ever rebuilds the merger's output, which keeps the flash output's sequence-major
    /// strides (`to(float32)` and the elementwise merge preserve them).
    pub(crate) fn only_full_steps(&self) -> bool {
        self.rank + 1 == self.cp
    }
}

/// What one flash forward call returns: output, log-sum-exp, philox seed and offset.
struct FlashOut {
    out: T,
    lse: T,
    seeds: [T; 2],
}

impl Tracer {
    /// `_scaled_dot_product_flash_attention` over `rows` query rows (the seeds, the output,
    /// the log-sum-exp and a scratch buffer, in the kernel's order).
    fn flash_forward(&mut self, ring: Ring, rows: u64, dtype: DType) -> FlashOut {
        let seeds = [
            self.empty(1, DType::I64, "philox seed"),
            self.empty(1, DType::I64, "philox offset"),
        ];
        let q = ring.batch * ring.heads * rows;
        let out = self.empty(q * ring.head_dim, dtype, "ring attention: block output");
        let lse = self.empty(q, DType::F32, "ring attention: block logsumexp");
        let scratch = self.empty(256, DType::U8, "attention forward scratch");
        self.drop(scratch);
        FlashOut { out, lse, seeds }
    }

    /// The flash backward over `rows` query rows against `key_numel` elements of keys (and as
    /// many of values): dq, dk, dv, then its workspace.
    fn flash_backward(
        &mut self,
        ring: Ring,
        rows: u64,
        key_numel: u64,
        workspace: u64,
        dtype: DType,
    ) -> [T; 3] {
        let dq = self.empty(
            ring.batch * ring.heads * rows * ring.head_dim,
            dtype,
            "ring attention: block dq",
        );
        let dk = self.empty(key_numel, dtype, "ring attention: block dk");
        let dv = self.empty(key_numel, dtype, "ring attention: block dv");
        let ws = self.empty(workspace, DType::U8, "attention backward workspace");
        self.drop(ws);
        [dq, dk, dv]
    }

    /// `torch.cat([k.flatten(), v.flatten()])` and, when `gather`, its all-gather over the
    /// ring (`_AllGatherRotater`): the buffers charged to communication.
    fn ring_kv_buffer(&mut self, ring: Ring, dtype: DType, label: &'static str) -> T {
        let outer = std::mem::replace(&mut self.component, Component::Communication);
        let out = self.empty(2 * ring.kv_numel(), dtype, label);
        self.component = outer;
        out
    }

    /// The forward of one layer's ring attention (see the module doc) on the local `q`, `k`,
    /// `v`; returns the merged output (head-major, in the inputs' dtype) and records the
    /// autograd node of `_scaled_dot_product_flash_attention`, which saves the local q, k, v,
    /// the output, the merged log-sum-exp and the last block's seeds.
    pub(crate) fn ring_attention(&mut self, ring: Ring, q: T, k: T, v: T) -> T {
        let dtype = self.dtype(q);
        let (kv, half) = (ring.kv_numel(), ring.seq / 2);
        let key = self.empty(kv, dtype, "key.contiguous() (ring attention)");
        let value = self.empty(kv, dtype, "value.contiguous() (ring attention)");
        let send = self.ring_kv_buffer(ring, dtype, "torch.cat([k, v]) (ring send)");
        let outer = std::mem::replace(&mut self.component, Component::Communication);
        let gathered = self.empty(ring.cp * 2 * kv, dtype, "all_gather_tensor (ring k, v)");
        self.component = outer;
        self.drop(send);
        let first = self.flash_forward(ring, ring.seq, dtype);
        let mut out = self.empty(ring.q_numel(), DType::F32, "SDPAMerger out (fp32)");
        let mut lse = first.lse;
        let mut block = first;
        for i in 1..ring.cp {
            if i < ring.cp - 1 {
                // Sent once by the all-gather already: the new `cat` is dropped at once.
                let send = self.ring_kv_buffer(ring, dtype, "torch.cat([k, v]) (ring send)");
                self.drop(send);
            }
            if i == 1 {
                // Step 0's `k, v` held them until this step's chunks replace them.
                self.drop_all(&[key, value]);
            }
            let full = ring.full_step(i);
            let query_rows = if full { ring.seq } else { half };
            let next = self.flash_forward(ring, query_rows, dtype);
            // `out, logsumexp, *rest = op(...)`: step 0's log-sum-exp is the merger's.
            self.drop(block.out);
            if i > 1 {
                self.drop(block.lse);
            }
            self.drop_all(&block.seeds);
            block = next;
            let rows = ring.batch * ring.heads * query_rows;
            let block_numel = rows * ring.head_dim;
            let block_out = self.empty(block_numel, DType::F32, "block out.to(float32)");
            // out - sigmoid(block_lse - lse) * (out - block_out)
            let diff = self.empty(rows, DType::F32, "block_lse - lse");
            let gate = self.empty(rows, DType::F32, "sigmoid(block_lse - lse)");
            self.drop(diff);
            let delta = self.empty(block_numel, DType::F32, "out - block_out");
            let scaled = self.empty(block_numel, DType::F32, "sigmoid(..) * (out - block_out)");
            self.drop_all(&[gate, delta]);
            let merged_out = self.empty(block_numel, DType::F32, "merged out");
            self.drop(scaled);
            // lse - logsigmoid(lse - block_lse)
            let diff = self.empty(rows, DType::F32, "lse - block_lse");
            let log = self.empty(rows, DType::F32, "logsigmoid(lse - block_lse)");
            self.drop(diff);
            let merged_lse = self.empty(rows, DType::F32, "merged lse");
            self.drop(log);
            if full {
                // `self._lse = lse; self._out = out`: the merged tensors are the merger's.
                self.drop(lse);
                lse = merged_lse;
                self.drop(out);
                out = merged_out;
                self.drop(block_out);
                continue;
            }
            // `_partial_update`: the chunks concatenated again, the second one replaced.
            let new_lse = self.empty(ring.lse_numel(), DType::F32, "SDPAMerger lse (cat)");
            self.drop(lse);
            lse = new_lse;
            let new_out = self.empty(ring.q_numel(), DType::F32, "SDPAMerger out (cat)");
            self.drop(out);
            out = new_out;
            self.drop_all(&[merged_lse, merged_out, block_out]);
        }
        let result = self.empty(ring.q_numel(), dtype, "ring attention output (head-major)");
        self.drop_all(&[out, gathered, block.out]);
        if ring.cp > 1 {
            self.drop(block.lse);
        }
        let [seed, offset] = block.seeds;
        // In the order the node releases them (the DTensors' local tensors).
        let saved = [lse, k, q, v, result, seed, offset];
        self.record(
            super::tracer::Bwd::RingAttention(ring),
            &[Some(q), Some(k), Some(v)],
            &[result, lse],
            &saved,
        );
        self.drop_all(&[lse, seed, offset]);
        result
    }

    /// The backward of [`Tracer::ring_attention`]: returns dq, dk and dv (dk and dv views of
    /// one buffer), in the inputs' `dtype`.
    pub(crate) fn ring_attention_backward(&mut self, ring: Ring, dtype: DType) -> [T; 3] {
        let (kv, half) = (ring.kv_numel(), ring.seq / 2);
        let mut grad_q = self.empty(ring.q_numel(), DType::F32, "grad_query (fp32 zeros)");
        let grad_k = self.empty(kv, DType::F32, "grad_key (fp32 zeros)");
        let grad_v = self.empty(kv, DType::F32, "grad_value (fp32 zeros)");
        let key = self.empty(kv, dtype, "key.contiguous() (ring attention)");
        let value = self.empty(kv, dtype, "value.contiguous() (ring attention)");
        let mut send = self.ring_kv_buffer(ring, dtype, "torch.cat([k, v]) (ring send)");
        let outer = std::mem::replace(&mut self.component, Component::Communication);
        let gathered = self.empty(ring.cp * 2 * kv, dtype, "all_gather_tensor (ring k, v)");
        self.component = outer;
        let mut block = self.flash_backward(ring, ring.seq, kv, ring.workspace_full, dtype);
        let grad_kv_cat = |t: &mut Tracer| {
            t.ring_kv_buffer(ring, DType::F32, "torch.cat([dk, dv]) (ring send, fp32)")
        };
        // The zeros are `zeros_like` the saved key and value, strided as the projections'
        // `transpose(1, 2)`: their `flatten()` for the first `cat` copies.
        let flat_k = self.empty(kv, DType::F32, "grad_key.flatten() (copy)");
        let flat_v = self.empty(kv, DType::F32, "grad_value.flatten() (copy)");
        let mut sent = grad_kv_cat(self);
        self.drop_all(&[flat_k, flat_v]);
        let mut arrived = grad_kv_cat(self);
        // What `grad_key` and `grad_value` point into: the zeros, then each arrived buffer.
        let mut grads_kv = vec![grad_k, grad_v];
        let mut lse_half: Option<T> = None;
        for i in 1..ring.cp {
            if i < ring.cp - 1 {
                let next = self.ring_kv_buffer(ring, dtype, "torch.cat([k, v]) (ring send)");
                self.drop(send);
                send = next;
            }
            let full = ring.full_step(i);
            // A partial step's log-sum-exp is the second half, made contiguous (full steps
            // come first: there is none to replace yet).
            let lse = (!full).then(|| {
                self.empty(
                    ring.batch * ring.heads * half,
                    DType::F32,
                    "logsumexp.chunk(2)[1].contiguous()",
                )
            });
            // `q, k, v, out_, dout, lse = (...)`: step 0's `k, v` held the contiguous copies.
            if i == 1 {
                self.drop_all(&[key, value]);
            }
            if let Some(lse) = lse
                && let Some(old) = lse_half.replace(lse)
            {
                self.drop(old);
            }
            let next = if full {
                self.flash_backward(ring, ring.seq, kv / 2, ring.workspace_half_keys, dtype)
            } else {
                self.flash_backward(ring, half, kv, ring.workspace_partial, dtype)
            };
            self.drop_all(&block);
            block = next;
            // grad_key, grad_value = views of what arrived; the previous cat is dropped.
            self.drop(sent);
            self.drop_all(&grads_kv);
            if full {
                // `_partial_update(grad_key, ..., idx=0, add=True)` and the same for the
                // values: new fp32 dk and dv; what arrived dies once the next one does.
                grads_kv = vec![
                    self.empty(kv, DType::F32, "grad_key (cat)"),
                    self.empty(kv, DType::F32, "grad_value (cat)"),
                ];
                sent = grad_kv_cat(self);
                let next = grad_kv_cat(self);
                self.drop(arrived);
                arrived = next;
                // `grad_query += grad_query_`: in place.
                continue;
            }
            grads_kv = vec![arrived];
            sent = grad_kv_cat(self);
            arrived = grad_kv_cat(self);
            // `_partial_update(grad_query, ..., add=True)`: a new fp32 dq.
            let new_q = self.empty(ring.q_numel(), DType::F32, "grad_query (cat)");
            self.drop(grad_q);
            grad_q = new_q;
        }
        let dq = self.empty(ring.q_numel(), dtype, "grad_query.to(dtype)");
        self.drop(grad_q);
        let dkv = self.empty(2 * kv, dtype, "[dk, dv].to(dtype)");
        self.drop(sent);
        self.drop_all(&grads_kv);
        // The frame's locals, in the order Python clears them.
        self.drop(send);
        self.drop_all(&block);
        self.drop_all(&[arrived, gathered]);
        if let Some(lse) = lse_half {
            self.drop(lse);
        }
        let dk = self.view(dkv, kv, "grad_key (view of [dk, dv])");
        let dv = self.view(dkv, kv, "grad_value (view of [dk, dv])");
        self.drop(dkv);
        [dq, dk, dv]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::engine::memory::Memory;
    use headroom_alloc::{AllocatorConfig, CachingAllocator};

    /// One layer of Llama-3-like heads (4 query heads over 2 key/value heads) on `seq` local rows.
    fn ring(cp: u64, seq: u64) -> Ring {
        Ring {
            cp,
            rank: 0,
            batch: 1,
            heads: 4,
            kv_heads: 2,
            seq,
            head_dim: 128,
            workspace_full: 1 << 20,
            workspace_partial: 1 << 19,
            workspace_half_keys: 3 << 18,
        }
    }

    /// A fresh process with this rank's rotary outputs: q, k and v that require grad. Returns
    /// them and the bytes allocated before the ring runs.
    fn inputs(ring: Ring) -> (Tracer, [T; 3], u64) {
        let mut t = Tracer::new(
            Memory::new(
                CachingAllocator::new(AllocatorConfig::default(), None),
                Default::default(),
            ),
            crate::gpu::Gpu::default().workspaces(),
        );
        let q = t.empty(ring.q_numel(), DType::BF16, "q");
        let k = t.empty(ring.kv_numel(), DType::BF16, "k");
        let v = t.empty(ring.kv_numel(), DType::BF16, "v");
        for x in [q, k, v] {
            t.set_requires_grad(x, true);
        }
        let base = t.mem.allocated();
        t.mem.begin_measured_phase("forward", 1);
        (t, [q, k, v], base)
    }

    /// The forward keeps exactly what the flash node saves beside its inputs: the head-major
    /// output, the merged fp32 log-sum-exp of every local row, and the last block's seeds; and
    /// each further rank in the ring adds one more pair of key and value chunks to the
    /// all-gathered buffer at the forward's peak, nothing else.
    #[test]
    fn the_forward_keeps_what_the_node_saves_and_gathers_every_ranks_chunks() {
        let seq = 2048;
        let mut peaks = Vec::new();
        for cp in [4, 8] {
            let r = ring(cp, seq);
            let (mut t, [q, k, v], base) = inputs(r);
            let out = t.ring_attention(r, q, k, v);
            assert_eq!(t.numel(out), r.q_numel());
            let seeds = 2 * 512; // two int64 scalars, one 512-byte block each
            let kept = r.q_numel() * 2 + r.lse_numel() * 4 + seeds;
            assert_eq!(t.mem.allocated() - base, kept, "cp {cp}");
            peaks.push(t.mem.phase_peak().peak_allocated);
        }
        let kv_bytes = ring(4, seq).kv_numel() * 2;
        assert_eq!(peaks[1] - peaks[0], 4 * 2 * kv_bytes);
    }

    /// The forward's peak over its steps, on each rank of a ring of `cp`: what one merge holds
    /// beside the fp32 output it replaces (`out`, `lse`, the gathered keys and values, the block
    /// before). A partial step merges half the queries and concatenates a new output; a full
    /// one merges all of them, so every further full step adds one query-sized merge.
    #[test]
    fn ranks_differ_by_their_full_and_partial_steps() {
        let (cp, seq) = (4, 2048);
        let peaks: Vec<u64> = (0..cp)
            .map(|rank| {
                let r = Ring {
                    rank,
                    ..ring(cp, seq)
                };
                let (mut t, [q, k, v], base) = inputs(r);
                let out = t.ring_attention(r, q, k, v);
                // Every rank keeps what the node saves: the same bytes.
                let kept = r.q_numel() * 2 + r.lse_numel() * 4 + 2 * 512;
                assert_eq!(t.mem.allocated() - base, kept, "rank {rank}");
                t.drop(out);
                t.mem.phase_peak().peak_allocated
            })
            .collect();
        // Rank 0 runs only partial steps, the others 1 to 3 full steps first: a full step's
        // merge holds a whole-query block, its fp32 copy, the difference, the scaled
        // difference and the new output where a partial one holds halves and a concatenation.
        assert!(peaks[1] > peaks[0], "{peaks:?}");
        assert_eq!(peaks[1], peaks[2], "{peaks:?}");
        assert_eq!(peaks[2], peaks[3], "{peaks:?}");
    }

    /// The backward returns gradients of this rank's shapes (dq of the local queries, dk and dv
    /// of the local key/value heads, views of one buffer) and frees every ring buffer, on every
    /// rank.
    #[test]
    fn the_backward_returns_local_gradients_and_frees_the_ring() {
        for (cp, rank) in [
            (2, 0),
            (2, 1),
            (3, 0),
            (3, 1),
            (3, 2),
            (8, 0),
            (8, 5),
            (8, 7),
        ] {
            let r = Ring {
                rank,
                ..ring(cp, 1024)
            };
            let (mut t, _, base) = inputs(r);
            let [dq, dk, dv] = t.ring_attention_backward(r, DType::BF16);
            assert_eq!(t.numel(dq), r.q_numel());
            assert_eq!((t.numel(dk), t.numel(dv)), (r.kv_numel(), r.kv_numel()));
            assert_eq!(
                t.mem.allocated() - base,
                (r.q_numel() + 2 * r.kv_numel()) * 2,
                "cp {cp}: only the gradients are left"
            );
            t.drop_all(&[dq, dk, dv]);
            assert_eq!(t.mem.allocated(), base, "cp {cp}");
        }
    }
}
