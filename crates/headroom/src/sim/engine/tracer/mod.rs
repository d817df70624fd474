//! A tensor-level simulation of eager PyTorch: tensors with reference counts, the autograd graph
//! with its saved tensors, and the backward engine that frees them.
//!
//! Model code (see `sim::model::transformer`) is written as a line-by-line translation of the HF Python:
//! every op allocates its output, every Python name that goes out of scope is a `drop`, and every
//! tensor autograd saves holds a reference until its node has run in backward. A tensor's memory
//! is freed when its last reference goes, exactly when PyTorch's storage refcount would free it.
//! Backward follows `torch/csrc/autograd/engine.cpp`: a ready queue ordered by sequence number
//! (later nodes first, `AccumulateGrad` before all), input buffers that sum gradients arriving
//! from several uses, `validate_outputs` reductions and casts, then the node's saved tensors are
//! released.

mod state;

use std::collections::BinaryHeap;

use smallvec::SmallVec;

use super::component::Component;
use super::memory::{Allocation, Memory};
use crate::dtype::DType;
use crate::gpu::Workspaces;
pub(crate) use state::{Scope, StoredGrads, TracerState};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct T(u32);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NodeId(u32);

/// Index of a parameter in the model's parameter table.
pub(crate) type ParamId = usize;

#[derive(Clone)]
struct TensorRec {
    numel: u64,
    dtype: DType,
    allocation: Option<Allocation>,
    refs: u32,
    requires_grad: bool,
    grad_fn: Option<(NodeId, u8)>,
    /// Set for parameters: the leaf whose gradient `AccumulateGrad` stores.
    param: Option<ParamId>,
    /// A view of a temporary (a linear layer's weight gradient is `mm(...).t()`): its storage
    /// has another owner, so `InputBuffer` cannot add into it in place.
    view_of_temporary: bool,
    /// For a view of another tensor (a slice): the tensor whose storage it uses.
    base: Option<T>,
    label: &'static str,
}

/// Where the gradient of one forward input goes.
#[derive(Clone, Copy, Debug)]
struct InputEdge {
    target: NodeId,
    slot: u8,
    numel: u64,
    dtype: DType,
}

/// The backward formulas the simulator knows, named after PyTorch's `*Backward0` nodes. Each
/// says which gradients it allocates and which temporaries it needs (see `run_node`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Bwd {
    AccumulateGrad(ParamId),
    /// `x.to(dtype)`: the gradient is cast back.
    ToCopy,
    /// `a * b` (tensors, possibly broadcast).
    Mul,
    /// `a * scalar` or `a / scalar`.
    MulScalar,
    /// `a + b` (tensors, possibly broadcast or of different dtypes).
    Add,
    /// `a + scalar`: the gradient passes through.
    AddScalar,
    Neg,
    /// `x.pow(2)`.
    Pow2,
    /// `x.mean(-1, keepdim=True)`.
    MeanLastDim,
    /// `torch.rsqrt(x)`: saves the result.
    Rsqrt,
    Silu,
    GeluTanh,
    Tanh,
    /// `torch.cat` along the last dim: the gradient is sliced (views).
    Cat,
    /// `x[..., a:b]` (and `chunk`): the gradient is scattered into zeros of the input's size.
    Slice,
    /// `x.split(...)` with several outputs: backward concatenates their gradients.
    Split,
    /// `.contiguous()` of a non-contiguous tensor: a copy.
    Clone,
    /// `x.view(...)` or `x.reshape(...)` of a contiguous tensor (`ViewBackward0`): the
    /// gradient passes through, one node later.
    View,
    /// `x.view(...)` summed over a dimension the view split off (`x.view(tokens, top_k,
    /// hidden).sum(dim=1)`): the sum's gradient arrives expanded (stride 0 over that
    /// dimension), which `grad.reshape(x's sizes)` cannot view, so it copies.
    ViewOfSummed,
    /// `.view(b, s, heads, d).transpose(1, 2)` of a projection's output. Backward reshapes the
    /// gradient back; that copies when the gradient arrives head-major (after rotary
    /// embeddings or eager attention), not when it comes from flash attention.
    HeadSplit {
        copy: bool,
    },
    /// `mm`/`addmm` of a linear layer; `bias` adds its `grad.sum(0)`; `input_grad_first`: the
    /// input's gradient is made before the weight's.
    Linear {
        bias: bool,
        input_grad_first: bool,
    },
    /// `embedding(ids, weight)`.
    Embedding,
    /// A row-parallel embedding's lookup (DTensor, weight `Shard(0)`): its weight gradient
    /// comes out `Replicate`, every rank holding all `tp` shards' rows.
    EmbeddingReplicatedGrad {
        tp: u64,
    },
    /// `F.scaled_dot_product_attention`, flash kernel (bf16/fp16): workspace bytes of its
    /// backward (`dq_accum`, `softmax_d`).
    SdpaFlash {
        workspace: u64,
    },
    /// cuDNN attention (half precision with a mask): like flash.
    SdpaCudnn {
        workspace: u64,
    },
    /// Context parallelism's ring attention over the flash kernel (`ring_attention`).
    RingAttention(Ring),
    /// The memory-efficient kernel: bytes of its backward's workspace, fp32 accumulator and
    /// `delta`.
    SdpaEfficient {
        workspace: u64,
        accumulator: u64,
        delta: u64,
    },
    /// bitsandbytes `MatMul4Bit`: the input's gradient through a freshly dequantised weight
    /// of this many elements.
    MatMul4Bit {
        weights: u64,
    },
    /// `torch.matmul` of 4-D batches (eager attention).
    Bmm,
    /// `_softmax` (a plain softmax, or `_safe_softmax` of the math attention backend): saves
    /// its result; its backward takes CUDA's `grad * output` scratch.
    Softmax,
    /// `log_softmax`: saves the result.
    LogSoftmax,
    /// Tensor parallelism's `loss_parallel` log-softmax: `_log_softmax_backward_data` only
    /// passes the gradient on (the nll backward computed it).
    LogSoftmaxParallel,
    /// `loss_parallel`'s `nll_loss` over a vocabulary shard: the backward of both, from
    /// `zeros_like(x) + exp(x)`.
    NllLossParallel,
    /// A replicated input's `Partial` gradient all-reduced (out of place: a new tensor).
    AllReduce,
    /// A `Shard(-1) -> Replicate` all-gather's backward (`_replicate_to_shard`): this rank's
    /// chunk of the gradient, cloned.
    ChunkOfGathered,
    /// A sequence all-gather's backward: the gradient reduce-scattered over `tp` ranks.
    ReduceScatter {
        tp: u64,
    },
    /// A sequence reduce-scatter's backward: the gradient all-gathered over `tp` ranks (copied
    /// into sequence order when there is more than one sequence).
    AllGather {
        tp: u64,
        sequences: u64,
    },
    /// `nll_loss` (mean): the gradient is a zero-filled tensor with one value per row.
    NllLoss,
    /// An op whose gradient is a reduction back to the input's size: `x.mean()` over all
    /// elements, `repeat_kv`'s expand.
    Reduce,
    /// `native_layer_norm`: saves the input, mean and rstd.
    LayerNorm,
    /// `native_dropout`: saves the mask.
    Dropout,
    /// `x.sum()` to a scalar: the gradient is the incoming one expanded (a view).
    Sum,
    /// `x[mask]` with a boolean mask of `selected` true elements (`IndexBackward0`): zeros of
    /// the input's size, then `index_put_(accumulate=True)` with its temporaries.
    MaskedIndex {
        selected: u64,
    },
    /// `zeros.masked_scatter(mask, x)` of `selected` elements (`masked_scatter_backward`):
    /// `masked_select(grad, mask)`.
    MaskedScatter {
        selected: u64,
    },
    /// TRL's `_ChunkedLogProbFunction`: per-token log-probs through the LM head in tiles.
    ChunkedLogProb(ChunkedLogProb),
    /// liger's `LigerRMSNormFunction` over rows of `width`: the input's gradient is written
    /// into the output's; a trained weight's is summed over `partial_rows` fp32 rows.
    LigerRmsNorm {
        width: u64,
        partial_rows: u64,
    },
    /// An op whose backward writes its two inputs' gradients into the two tensors it saved
    /// (liger's `LigerSiLUMulFunction`).
    InPlacePair,
    /// An op that writes its result into its input's storage, and its gradient likewise
    /// (liger's RoPE).
    InPlace,
    /// liger's `LigerFusedLinearCrossEntropyFunction`: the gradients were computed in the
    /// forward and saved; backward scales them in place.
    LigerFusedLinearCrossEntropy,
    /// `x[index]` with an integer index of `indices` elements (`IndexBackward0`): zeros of the
    /// input's size, the gradient put into them (`index_put_`, accumulating), sorting the index.
    IndexRows {
        indices: u64,
    },
    /// `torch._grouped_mm(x, w, offs)`: the weight's full-size gradient first (every expert,
    /// routed to or not), then the input's.
    GroupedMm,
    /// `masked_fill(mask, value)`: the gradient masked into a new tensor.
    MaskedFill,
    /// `topk`, `max(dim)`, `gather`: the gradient scattered into zeros of the input's size.
    SelectScatter,
    /// `x.sum(dim)`: the gradient expanded back (a view).
    SumDim,
    /// `torch.sigmoid`: saves its result.
    Sigmoid,
    /// `clamp`: saves its input.
    Clamp,
    /// A tensor made by copying its inputs into slices of a `new_empty` (MLA's key states):
    /// backward copies the gradient once, then clones each slice's part.
    SliceCopies,
    /// `out.index_add_(0, index, source)`: `out`'s gradient passes through; the source's is
    /// `grad.index_select(0, index)`.
    IndexAdd,
    /// `baddbmm(W, B, A)` with a frozen `W`: each factor's gradient is a `bmm` scaled by
    /// alpha.
    Baddbmm,
    /// Megatron's `LinearWithGradAccumulationAndAsyncCommunication` with `sequence_parallel`
    /// (saving its sharded input and the weight): backward gathers the input over `tp` ranks
    /// into the persistent "mpu" buffer, makes the whole input gradient, a sharded one it is
    /// reduce-scattered into, then the weight's gradient.
    SequenceParallelLinear {
        tp: u64,
    },
    /// Megatron's `RouterGatingLinearFunction` (`mm(x, w.t())` saving both): the input's
    /// gradient `mm(grad, w)` first, then the weight's `mm(grad.t(), x)`, both fresh tensors;
    /// in an fp32 router each casts its bf16 operand up first and its result back down.
    RouterGating,
    /// Megatron's `MoEAuxLossAutoScaler` (`probs` passed through, the loss saved): the
    /// gradient passes to `probs`, and the loss's is `ones_like(loss) * scale`.
    AuxLossScaler,
    /// An op whose one differentiable input's gradient is gathered or sent back into a new
    /// tensor of that input's size: `scatter`'s and `scatter_add_`'s source (`grad.gather`),
    /// Megatron's `_AllToAll` (the reverse all-to-all).
    GatherBack,
    /// Megatron's `_VocabParallelCrossEntropy` over `tokens` rows: the gradient is the saved
    /// fp32 softmax, updated in place at the targets (`grad_2d[arange, target] -=
    /// 1 - target_mask.float()`) and scaled by the incoming gradient.
    VocabParallelCrossEntropy {
        tokens: u64,
    },
}

/// One layer's ring attention (`ring_attention`) on context-parallel rank `rank`: its local
/// queries (`batch`, `heads`, `seq`, `head_dim`) and keys and values of `kv_heads`, and what
/// the flash backward allocates beside the gradients for step 0 (all queries, all keys), a
/// partial step (half the queries, all keys) and a full one (all queries, half the keys).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Ring {
    pub cp: u64,
    pub rank: u64,
    pub batch: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub seq: u64,
    pub head_dim: u64,
    pub workspace_full: u64,
    pub workspace_partial: u64,
    pub workspace_half_keys: u64,
}

/// What the backward of TRL's chunked log-prob function needs to know
/// (`trl/kernels/chunked_logprob.py`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ChunkedLogProb {
    /// Scored tokens (rows of the gathered hidden states).
    pub tokens: u64,
    pub hidden: u64,
    pub vocab: u64,
    /// The dtype the logits tiles are computed in (autocast's, else the hidden states').
    pub compute: DType,
    pub hidden_dtype: DType,
    pub weight_dtype: DType,
}

impl ChunkedLogProb {
    /// `TOKEN_CHUNK_SIZE`: rows of one logits tile.
    pub const TOKEN_TILE: u64 = 4096;
    /// `_CHUNKED_LOGPROB_CHUNK_SIZE`: vocabulary columns of one logits tile.
    pub const VOCAB_TILE: u64 = 32_768;

    /// Elements of `mm_buf`, the one logits tile forward and backward reuse.
    pub fn tile_numel(&self) -> u64 {
        self.tokens.min(Self::TOKEN_TILE) * Self::VOCAB_TILE
    }
}

pub(crate) struct Node {
    pub(crate) seq: u64,
    pub(crate) op: Bwd,
    /// Saved tensors; in a checkpointed region they arrive when the region is recomputed.
    pub(crate) saved: SmallVec<[T; 4]>,
    /// Where its forward inputs' gradients go: `edges[inputs.0..inputs.0 + inputs.1]`.
    inputs: (u32, u32),
    /// Gradient of each output as it accumulates (`InputBuffer`).
    buffer: SmallVec<[Option<T>; 2]>,
    region: Option<u32>,
    /// The FSDP unit whose forward recorded it (see [`BackwardHooks`]).
    unit: Option<u32>,
    /// The component the forward was charged to; backward's allocations go there too.
    component: Component,
    /// Its outputs are DTensors: `InputBuffer` never adds into a tensor subclass in place.
    dtensor: bool,
}

/// Parameters as the simulator sees them.
pub(crate) struct ParamRec {
    pub(crate) tensor: T,
    pub(crate) grad: Option<T>,
    /// (rows, cols) of a 2-D parameter; `None` for vectors (Adafactor factors matrices only).
    pub(crate) matrix: Option<(u64, u64)>,
    /// This step's `AccumulateGrad` node.
    node: Option<NodeId>,
    /// The autocast cache's entry for this parameter's tensor: (tensor, its cast).
    autocast: Option<(T, T)>,
    /// Where a second gradient of this parameter is summed out of place (a tied weight whose
    /// uses are views of an FSDP1 flat parameter, on the unshard stream); `None`: in place.
    pub(crate) grad_sum_stream: Option<u32>,
}

/// A checkpointed region (one decoder layer under `gradient_checkpointing_enable()`): its
/// forward saves nothing but its inputs; its first node to run in backward recomputes it.
struct Region {
    inputs: SmallVec<[T; 2]>,
    /// Nodes in creation order, with how many tensors each saves and whether its output is
    /// among them.
    nodes: Vec<RegionNode>,
    recomputed: bool,
    pending: usize,
    /// A reentrant checkpoint (`torch.utils.checkpoint(use_reentrant=True)`, Megatron's
    /// `tensor_parallel.checkpoint`): its recomputation runs the whole region, and the output
    /// it recomputed and the gradients it received live until the region's backward is done.
    reentrant: bool,
    recomputed_output: Option<T>,
    /// A reentrant region's incoming gradients: `CheckpointFunction.backward(ctx, *args)`
    /// holds `args` until its inner `torch.autograd.backward` returns.
    held_grads: SmallVec<[T; 1]>,
    /// A node of the region has run in backward.
    entered: bool,
    /// The [`KeptGraph`] that takes the region's inputs and their gradients when its backward
    /// is done, instead of dropping them.
    kept_by: Option<u32>,
}

/// What a recomputed graph keeps after its backward while something holds an output of it:
/// a reentrant checkpoint detaches its inputs (`detach_variable`) and recomputes from them, so
/// every graph it builds ends in their `AccumulateGrad` nodes, which hold each detached input
/// and the `.grad` the inner `torch.autograd.backward` stored on it. Freed when the last holder
/// lets go (Megatron's MoE dispatcher replacing `self.probs` at the layer's next forward).
#[derive(Default)]
struct KeptGraph {
    holders: u32,
    tensors: SmallVec<[T; 2]>,
}

/// A node recorded inside a checkpointed region.
#[derive(Clone, Copy)]
struct RegionNode {
    id: NodeId,
    saves: usize,
    saves_output: bool,
    /// Autocast's cast of a weight, which a recomputation may find in the cache instead.
    weight_cast: bool,
}

impl Region {
    /// The last node that saves a tensor: the recomputation stops once its saves are made.
    fn last_saving(&self) -> Option<usize> {
        self.nodes.iter().rposition(|n| n.saves > 0)
    }
}

/// Calls back into model code during backward.
pub(crate) trait BackwardHooks {
    /// Recompute a checkpointed region.
    fn recompute(&mut self, tracer: &mut Tracer, region: u32);
    /// A gradient reached unit `unit` (FSDP's pre-backward hook on the unit's outputs): called
    /// before its first node runs, and before that node's region is recomputed.
    fn unit_backward_begins(&mut self, _tracer: &mut Tracer, _unit: u32) {}
    /// Every node of unit `unit` that this backward runs has run, its parameters'
    /// `AccumulateGrad` included (FSDP's post-backward hook on the unit's inputs).
    fn unit_backward_done(&mut self, _tracer: &mut Tracer, _unit: u32) {}
    /// `AccumulateGrad` stored `param`'s gradient (a post-accumulate-grad hook, DeepSpeed's
    /// gradient hook).
    fn grad_accumulated(&mut self, _tracer: &mut Tracer, _param: ParamId) {}
}

pub(crate) struct Tracer {
    pub(crate) mem: Memory,
    /// Tensor records by id. The slot of a tensor whose last reference went is recycled for a
    /// later tensor (`free_tensors`), so the table stays as small as the live set.
    tensors: Vec<TensorRec>,
    free_tensors: Vec<u32>,
    /// Tensors given a `grad_fn` by this graph (ids may since have been recycled): what
    /// `free_graph` has to clear.
    with_grad_fn: Vec<T>,
    /// Scratch of `write_state`: canonical names by tensor slot.
    canonical: Vec<u32>,
    nodes: Vec<Node>,
    /// The input edges of every node, each node's together.
    edges: Vec<Option<InputEdge>>,
    pub(crate) params: Vec<ParamRec>,
    seq: u64,
    grad_enabled: bool,
    regions: Vec<Region>,
    /// The region whose forward is running.
    region: Option<u32>,
    /// The region being recomputed, and the next of its nodes whose saves to fill.
    recompute: Option<(u32, usize)>,
    /// The FSDP unit whose forward is running: nodes recorded now belong to it.
    pub(crate) unit: Option<u32>,
    /// Per unit, its nodes that the running backward has still to run, and whether a gradient
    /// has reached it.
    unit_pending: Vec<u32>,
    unit_entered: Vec<bool>,
    /// Component new tensors are charged to (set by the model code per section).
    pub(crate) component: Component,
    /// Whether the ops recorded now produce DTensors (tensor parallelism's sequence-sharded
    /// residual stream), whose gradients accumulate out of place.
    pub(crate) dtensor: bool,
    /// The dtype of the active `torch.autocast` region, and its cache of weight casts.
    autocast: Option<DType>,
    autocast_cache: Vec<(T, T)>,
    /// Set while autocast casts a weight ([`Tracer::weight_cast`]).
    casting_weight: bool,
    /// Tensors that live as long as the process (buffers, cuBLAS workspaces).
    persistent: Vec<T>,
    /// The names of the process-wide tensors made so far ([`Tracer::process_global`]).
    globals: Vec<&'static str>,
    /// Whether the main thread (0) and autograd's device thread (1) have their cuBLAS and
    /// cuBLASLt workspaces.
    pub(crate) cublas_workspace: [bool; 2],
    pub(crate) cublaslt_workspace: [bool; 2],
    /// Their sizes on the device's architecture.
    pub(crate) workspaces: Workspaces,
    /// The thread running ops: 0 = Python's, 1 = autograd's device thread (backward, and
    /// recomputation inside it).
    pub(crate) thread: usize,
    /// Activations made leaves by `make_grad_leaf` in this step's forward.
    activation_leaves: Vec<ParamId>,
    /// When `Some`, parameters are appended as their gradient is stored (DDP's record of the
    /// order gradients become ready).
    pub(crate) grad_ready: Option<Vec<ParamId>>,
    /// Recomputed graphs kept past their backward, by id; a slot with no holders is free.
    kept_graphs: Vec<KeptGraph>,
}

impl Tracer {
    pub(crate) fn new(mem: Memory, workspaces: Workspaces) -> Self {
        Tracer {
            mem,
            tensors: Vec::with_capacity(1 << 15),
            free_tensors: Vec::new(),
            with_grad_fn: Vec::new(),
            canonical: Vec::new(),
            nodes: Vec::with_capacity(1 << 16),
            edges: Vec::with_capacity(1 << 17),
            params: Vec::new(),
            seq: 0,
            grad_enabled: true,
            regions: Vec::new(),
            region: None,
            recompute: None,
            unit: None,
            unit_pending: Vec::new(),
            unit_entered: Vec::new(),
            component: Component::Activations,
            dtensor: false,
            autocast: None,
            autocast_cache: Vec::new(),
            casting_weight: false,
            persistent: Vec::new(),
            globals: Vec::new(),
            cublas_workspace: [false; 2],
            cublaslt_workspace: [false; 2],
            workspaces,
            thread: 0,
            activation_leaves: Vec::new(),
            grad_ready: None,
            kept_graphs: Vec::new(),
        }
    }

    /// Keep a tensor for the life of the process.
    /// The process-wide tensor `name` (a module-level object's buffer), made by `make` and
    /// kept for the life of the process the first time it is asked for.
    pub(crate) fn process_global(&mut self, name: &'static str, make: impl FnOnce(&mut Self) -> T) {
        if self.globals.contains(&name) {
            return;
        }
        let made = make(self);
        self.mark_persistent(made);
        self.globals.push(name);
    }

    pub(crate) fn mark_persistent(&mut self, t: T) {
        self.persistent.push(t);
    }

    /// Allocate buffers (numel, dtype) for the life of the process.
    pub(crate) fn persistent_buffers(&mut self, shapes: &[(u64, DType)], label: &'static str) {
        for &(numel, dtype) in shapes {
            let buffer = self.empty_as(numel, dtype, Component::Weights, label);
            self.mark_persistent(buffer);
        }
    }

    // ----- autocast --------------------------------------------------------------------------

    pub(crate) fn autocast_dtype(&self) -> Option<DType> {
        self.autocast
    }

    /// Enter a `torch.autocast` region; returns the previous state for `exit_autocast`.
    pub(crate) fn enter_autocast(&mut self, dtype: Option<DType>) -> Option<DType> {
        std::mem::replace(&mut self.autocast, dtype)
    }

    /// Leave it; the outermost exit clears the weight-cast cache (`torch.clear_autocast_cache`).
    pub(crate) fn exit_autocast(&mut self, previous: Option<DType>) {
        self.autocast = previous;
        if previous.is_none() {
            for (weight, cast) in std::mem::take(&mut self.autocast_cache) {
                if let Some(p) = self.rec(weight).param {
                    self.params[p].autocast = None;
                }
                self.drop(cast);
            }
        }
    }

    /// The cached cast of `weight` (a parameter's tensor): its entry in `autocast_cache`,
    /// kept with the parameter for lookup.
    pub(crate) fn autocast_cached(&self, weight: T) -> Option<T> {
        let p = self.rec(weight).param?;
        let found = self.params[p]
            .autocast
            .filter(|(w, _)| *w == weight)
            .map(|(_, c)| c);
        debug_assert_eq!(
            found,
            self.autocast_cache
                .iter()
                .find(|(w, _)| *w == weight)
                .map(|(_, c)| *c)
        );
        found
    }

    pub(crate) fn autocast_cache_insert(&mut self, weight: T, cast: T) {
        self.autocast_cache.push((weight, cast));
        let p = self
            .rec(weight)
            .param
            .expect("autocast caches casts of parameters");
        debug_assert!(self.params[p].autocast.is_none());
        self.params[p].autocast = Some((weight, cast));
    }

    // ----- tensors -------------------------------------------------------------------------

    /// A slot for a new tensor record: a recycled one if any.
    #[inline]
    fn new_tensor(&mut self, rec: TensorRec) -> T {
        match self.free_tensors.pop() {
            Some(id) => {
                self.tensors[id as usize] = rec;
                T(id)
            }
            None => {
                let id = T(u32::try_from(self.tensors.len()).expect("fewer than 2^32 tensors"));
                self.tensors.push(rec);
                id
            }
        }
    }

    /// The record of a live tensor.
    #[inline]
    fn rec(&self, t: T) -> &TensorRec {
        let rec = &self.tensors[t.0 as usize];
        debug_assert!(rec.refs > 0, "use of a dead tensor ({})", rec.label);
        rec
    }

    #[inline]
    fn rec_mut(&mut self, t: T) -> &mut TensorRec {
        let rec = &mut self.tensors[t.0 as usize];
        debug_assert!(rec.refs > 0, "use of a dead tensor ({})", rec.label);
        rec
    }

    /// Allocate a tensor with one reference, charged to the current component.
    pub(crate) fn empty(&mut self, numel: u64, dtype: DType, label: &'static str) -> T {
        self.empty_as(numel, dtype, self.component, label)
    }

    pub(crate) fn empty_as(
        &mut self,
        numel: u64,
        dtype: DType,
        component: Component,
        label: &'static str,
    ) -> T {
        let bytes = numel * dtype.bytes();
        // Once a recomputation has every tensor it needs, PyTorch stops it (early stop):
        // what the rest of the layer would allocate never exists.
        let allocation =
            (bytes > 0 && !self.recompute_done()).then(|| self.mem.malloc(bytes, component, label));
        self.new_tensor(TensorRec {
            numel,
            dtype,
            allocation,
            refs: 1,
            requires_grad: false,
            grad_fn: None,
            param: None,
            view_of_temporary: false,
            base: None,
            label,
        })
    }

    /// A view with its own size (a slice or chunk) of `x`'s storage: it allocates nothing and
    /// keeps `x`'s storage alive.
    pub(crate) fn view(&mut self, x: T, numel: u64, label: &'static str) -> T {
        let base = self.share(x);
        let dtype = self.dtype(x);
        self.without_storage(numel, dtype, Some(base), label)
    }

    /// A tensor record that owns no allocation: a view of `base`, or one whose storage is
    /// resized to 0.
    fn without_storage(
        &mut self,
        numel: u64,
        dtype: DType,
        base: Option<T>,
        label: &'static str,
    ) -> T {
        self.new_tensor(TensorRec {
            numel,
            dtype,
            allocation: None,
            refs: 1,
            requires_grad: false,
            grad_fn: None,
            param: None,
            view_of_temporary: false,
            base,
            label,
        })
    }

    pub(crate) fn mark_view_of_temporary(&mut self, t: T) {
        self.rec_mut(t).view_of_temporary = true;
    }

    /// A new parameter: a leaf tensor that requires grad when trainable.
    pub(crate) fn parameter(
        &mut self,
        numel: u64,
        dtype: DType,
        trainable: bool,
        label: &'static str,
    ) -> ParamId {
        let t = self.empty_as(numel, dtype, Component::Weights, label);
        let id = self.params.len();
        let rec = self.rec_mut(t);
        rec.requires_grad = trainable;
        rec.param = Some(id);
        self.params.push(ParamRec {
            tensor: t,
            grad: None,
            matrix: None,
            node: None,
            autocast: None,
            grad_sum_stream: None,
        });
        id
    }

    /// A parameter whose storage comes later (`from_pretrained` fills it from a checkpoint).
    pub(crate) fn parameter_deferred(
        &mut self,
        numel: u64,
        dtype: DType,
        trainable: bool,
        label: &'static str,
    ) -> ParamId {
        let param = Some(self.params.len());
        let id = self.new_tensor(TensorRec {
            numel,
            dtype,
            allocation: None,
            refs: 1,
            requires_grad: trainable,
            grad_fn: None,
            param,
            view_of_temporary: false,
            base: None,
            label,
        });
        self.params.push(ParamRec {
            tensor: id,
            grad: None,
            matrix: None,
            node: None,
            autocast: None,
            grad_sum_stream: None,
        });
        self.params.len() - 1
    }

    /// Allocate a deferred parameter's storage.
    pub(crate) fn materialize(&mut self, p: ParamId) {
        let t = self.params[p].tensor;
        let rec = self.rec(t);
        debug_assert!(rec.allocation.is_none(), "materialised twice");
        let bytes = rec.numel * rec.dtype.bytes();
        let label = rec.label;
        let allocation = self.mem.malloc(bytes, Component::Weights, label);
        self.rec_mut(t).allocation = Some(allocation);
    }

    /// A tensor whose storage is resized to 0 (`_free_storage`): it exists, holds nothing, and
    /// views of it stay valid across [`Tracer::alloc_storage`] and [`Tracer::free_storage`].
    pub(crate) fn storageless(&mut self, numel: u64, dtype: DType, label: &'static str) -> T {
        self.without_storage(numel, dtype, None, label)
    }

    /// `_alloc_storage(t)`: its storage grows back to its size.
    pub(crate) fn alloc_storage(&mut self, t: T) {
        let rec = self.rec(t);
        debug_assert!(rec.allocation.is_none(), "storage allocated twice");
        let (bytes, label) = (rec.numel * rec.dtype.bytes(), rec.label);
        let allocation = self.mem.malloc(bytes, self.component, label);
        self.rec_mut(t).allocation = Some(allocation);
    }

    /// `_free_storage(t)`: its storage is resized to 0, whoever views it.
    pub(crate) fn free_storage(&mut self, t: T) {
        let label = self.rec(t).label;
        if let Some(allocation) = self.rec_mut(t).allocation.take() {
            self.mem.free(allocation, label);
        }
    }

    /// `param.data = base[...]`: the parameter becomes a view of `base`'s storage (a slice of
    /// a flat buffer); its own storage, if it still has one, is freed.
    pub(crate) fn param_into_view(&mut self, p: ParamId, base: T, label: &'static str) {
        let old = self.params[p].tensor;
        let numel = self.numel(old);
        let view = self.view(base, numel, label);
        let rec = self.rec(old);
        let (requires_grad, param) = (rec.requires_grad, rec.param);
        let rec = self.rec_mut(view);
        rec.requires_grad = requires_grad;
        rec.param = param;
        self.params[p].tensor = view;
        self.drop(old);
    }

    /// Whether a parameter's storage is on the GPU (its own, or a flat buffer's it views).
    pub(crate) fn is_materialized(&self, p: ParamId) -> bool {
        let rec = self.rec(self.params[p].tensor);
        rec.allocation.is_some() || rec.base.is_some()
    }

    /// `param.data = param.data.cpu()`: the GPU storage is freed, the parameter lives on.
    pub(crate) fn offload(&mut self, p: ParamId) {
        let t = self.params[p].tensor;
        let label = self.rec(t).label;
        if let Some(allocation) = self.rec_mut(t).allocation.take() {
            self.mem.free(allocation, label);
        }
    }

    /// Forget the parameters from `first` on (a model that was deleted). Their tensors may be
    /// dead already (their slots free, not yet reused): only live ones are touched.
    pub(crate) fn truncate_params(&mut self, first: usize) {
        for p in self.params.drain(first..) {
            let rec = &mut self.tensors[p.tensor.0 as usize];
            if rec.refs > 0 {
                rec.param = None;
            }
        }
    }

    /// `t`, just allocated, is made once in the life of the process (see `Memory::made_once`).
    pub(crate) fn made_once(&mut self, t: T) {
        if let Some(a) = self.rec(t).allocation {
            self.mem.made_once(&a);
        }
    }

    /// `old`, kept for the life of the process, replaced by `new` (just allocated) and freed.
    pub(crate) fn replace_persistent(&mut self, old: T, new: T) {
        let slot = self
            .persistent
            .iter()
            .position(|&t| t == old)
            .expect("the replaced tensor is persistent");
        self.persistent[slot] = new;
        self.drop(old);
    }

    /// How many tensors are kept for the life of the process so far.
    pub(crate) fn persistent_count(&self) -> usize {
        self.persistent.len()
    }

    /// Drop the buffers kept since `persistent_count` was `first` (a deleted model's).
    pub(crate) fn release_persistent_from(&mut self, first: usize) {
        for t in self.persistent.split_off(first) {
            self.drop(t);
        }
    }

    /// `output.requires_grad_(True)` on a tensor no grad flows into (transformers'
    /// `enable_input_require_grads` hook on the embedding): it becomes a leaf whose gradient
    /// is accumulated, held by its `AccumulateGrad` node until the graph is freed.
    pub(crate) fn make_grad_leaf(&mut self, x: T) {
        let id = self.make_input_leaf(x);
        self.activation_leaves.push(id);
    }

    /// `buffer.requires_grad_(True)` on a tensor the process keeps (a pipeline stage's receive
    /// buffer): a leaf each backward through it accumulates a gradient into, taken with
    /// [`Tracer::take_grad`]; unlike an activation leaf it outlives the graph.
    pub(crate) fn make_input_leaf(&mut self, x: T) -> ParamId {
        let id = self.params.len();
        let held = self.share(x);
        self.params.push(ParamRec {
            tensor: held,
            grad: None,
            matrix: None,
            node: None,
            autocast: None,
            grad_sum_stream: None,
        });
        let rec = self.rec_mut(x);
        rec.requires_grad = true;
        rec.param = Some(id);
        id
    }

    /// The last reference to a receive buffer made with [`Tracer::make_input_leaf`] goes (a
    /// tensor received for one micro-batch): the leaf holds it no longer, nor its gradient.
    pub(crate) fn release_input_leaf(&mut self, leaf: ParamId) {
        let rec = &mut self.params[leaf];
        let (tensor, grad) = (rec.tensor, rec.grad.take());
        self.rec_mut(tensor).param = None;
        if let Some(g) = grad {
            self.drop(g);
        }
        self.drop(tensor);
    }

    /// `leaf.grad` taken and set to `None`.
    pub(crate) fn take_grad(&mut self, leaf: ParamId) -> Option<T> {
        self.params[leaf].grad.take()
    }

    /// Declare a parameter 2-D (rows, cols).
    pub(crate) fn set_matrix(&mut self, p: ParamId, rows: u64, cols: u64) {
        self.params[p].matrix = Some((rows, cols));
    }

    /// `param.data = param.data.to(dtype)`: a new tensor replaces the old one.
    pub(crate) fn cast_parameter(&mut self, p: ParamId, dtype: DType) {
        let old = self.params[p].tensor;
        if self.dtype(old) == dtype {
            return;
        }
        let new = self.empty_as(self.numel(old), dtype, Component::Weights, "parameter cast");
        let rec = self.rec(old);
        let (requires_grad, param) = (rec.requires_grad, rec.param);
        let rec = self.rec_mut(new);
        rec.requires_grad = requires_grad;
        rec.param = param;
        self.params[p].tensor = new;
        self.drop(old);
    }

    pub(crate) fn set_trainable(&mut self, p: ParamId, on: bool) {
        let t = self.params[p].tensor;
        self.set_requires_grad(t, on);
    }

    pub(crate) fn param(&self, p: ParamId) -> T {
        self.params[p].tensor
    }

    pub(crate) fn numel(&self, t: T) -> u64 {
        self.rec(t).numel
    }

    pub(crate) fn dtype(&self, t: T) -> DType {
        self.rec(t).dtype
    }

    /// The bytes the allocations of `tensors` asked for, per component (a storage counted
    /// once, a view or a tensor without storage not at all).
    pub(crate) fn live_by_component(
        &self,
        tensors: impl IntoIterator<Item = T>,
    ) -> [u64; Component::COUNT] {
        let mut seen = std::collections::HashSet::new();
        let mut live = [0; Component::COUNT];
        for t in tensors {
            if let Some(a) = self.rec(t).allocation
                && seen.insert(t.0)
            {
                let (component, bytes) = a.charge();
                live[component.index()] += bytes;
            }
        }
        live
    }

    pub(crate) fn bytes(&self, t: T) -> u64 {
        let rec = self.rec(t);
        rec.numel * rec.dtype.bytes()
    }

    pub(crate) fn requires_grad(&self, t: T) -> bool {
        self.rec(t).requires_grad
    }

    /// Whether this is a leaf parameter (casts of it are what autocast caches).
    pub(crate) fn is_param(&self, t: T) -> bool {
        self.rec(t).param.is_some()
    }

    pub(crate) fn set_requires_grad(&mut self, t: T, on: bool) {
        self.rec_mut(t).requires_grad = on;
    }

    /// Another reference to the same storage: a view, or a second Python name.
    pub(crate) fn share(&mut self, t: T) -> T {
        self.rec_mut(t).refs += 1;
        t
    }

    /// Drop one reference; the storage is freed with the last, and the record's slot becomes
    /// free for a later tensor.
    pub(crate) fn drop(&mut self, t: T) {
        let rec = &mut self.tensors[t.0 as usize];
        debug_assert!(rec.refs > 0, "double drop of {}", rec.label);
        rec.refs -= 1;
        if rec.refs == 0 {
            if let Some(base) = rec.base.take() {
                self.drop(base);
            } else if let Some(a) = rec.allocation.take() {
                let label = rec.label;
                self.mem.free(a, label);
            }
            self.free_tensors.push(t.0);
        }
    }

    pub(crate) fn drop_all(&mut self, ts: &[T]) {
        for &t in ts {
            self.drop(t);
        }
    }

    /// Charge a live tensor to another component (a gradient that becomes `.grad`).
    pub(crate) fn recategorize(&mut self, t: T, component: Component) {
        debug_assert!(self.rec(t).refs > 0);
        if let Some(a) = self.tensors[t.0 as usize].allocation.as_mut() {
            self.mem.recategorize(a, component);
        }
    }

    pub(crate) fn set_grad_enabled(&mut self, on: bool) -> bool {
        std::mem::replace(&mut self.grad_enabled, on)
    }

    pub(crate) fn grad_enabled(&self) -> bool {
        self.grad_enabled
    }

    // ----- graph recording -----------------------------------------------------------------

    /// Record an op's autograd node when grad mode is on and an input requires grad.
    /// `inputs` are the forward inputs (None for non-differentiable ones), `saved` what the
    /// node keeps for backward. The outputs become non-leaf tensors that require grad.
    /// Returns whether a node was recorded (callers decide what to save before calling).
    pub(crate) fn record(
        &mut self,
        op: Bwd,
        inputs: &[Option<T>],
        outputs: &[T],
        saved: &[T],
    ) -> bool {
        let needs = self.grad_enabled && inputs.iter().flatten().any(|&t| self.requires_grad(t));
        if !needs {
            return false;
        }
        if let Some((region, next)) = self.recompute
            && self.casting_weight
        {
            // A weight's cast made afresh (autocast's cache was cleared since the forward): a
            // node of its own, outside the region; the forward's cast node, if it made one
            // here, is passed over (the region's nodes keep their edges to it).
            if self.regions[region as usize]
                .nodes
                .get(next)
                .is_some_and(|n| n.weight_cast)
            {
                self.recompute = Some((region, next + 1));
            }
        } else if let Some((region, next)) = self.recompute {
            // Recomputation: the node exists already; its saves are what this run produces.
            let RegionNode {
                id: node,
                saves: count,
                ..
            } = self.regions[region as usize].nodes[next];
            debug_assert_eq!(
                count,
                saved.len(),
                "recomputation diverged from the forward"
            );
            self.recompute = Some((region, next + 1));
            for &s in saved {
                let s = self.share(s);
                self.nodes[node.0 as usize].saved.push(s);
            }
            for &o in outputs {
                self.set_requires_grad(o, true);
            }
            return true;
        }
        // Edges first: they may create `AccumulateGrad` nodes.
        let edges: SmallVec<[Option<InputEdge>; 3]> = inputs
            .iter()
            .map(|input| input.and_then(|t| self.edge_of(t)))
            .collect();
        let inputs = (self.edges.len() as u32, edges.len() as u32);
        self.edges.extend_from_slice(&edges);
        let id = NodeId(self.nodes.len() as u32);
        let mut kept: SmallVec<[T; 4]> = SmallVec::new();
        if let Some(region) = self.region {
            self.regions[region as usize].nodes.push(RegionNode {
                id,
                saves: saved.len(),
                saves_output: saved.iter().any(|s| outputs.contains(s)),
                weight_cast: self.casting_weight,
            });
            self.regions[region as usize].pending += 1;
        } else {
            for &s in saved {
                kept.push(self.share(s));
            }
        }
        self.seq += 1;
        self.nodes.push(Node {
            seq: self.seq,
            op,
            saved: kept,
            inputs,
            buffer: SmallVec::from_elem(None, outputs.len()),
            region: self.region,
            unit: self.unit,
            component: self.component,
            dtensor: self.dtensor,
        });
        for (i, &o) in outputs.iter().enumerate() {
            let rec = self.rec_mut(o);
            rec.requires_grad = true;
            rec.grad_fn = Some((id, i as u8));
            self.with_grad_fn.push(o);
        }
        true
    }

    /// Where a gradient for `t` goes: its producing node, or its parameter's `AccumulateGrad`.
    fn edge_of(&mut self, t: T) -> Option<InputEdge> {
        let rec = self.rec(t);
        if !rec.requires_grad {
            return None;
        }
        let (numel, dtype) = (rec.numel, rec.dtype);
        if let Some((node, slot)) = rec.grad_fn {
            return Some(InputEdge {
                target: node,
                slot,
                numel,
                dtype,
            });
        }
        let param = rec.param?;
        let node = match self.params[param].node {
            Some(node) => node,
            None => {
                let node = NodeId(self.nodes.len() as u32);
                self.nodes.push(Node {
                    seq: u64::MAX,
                    op: Bwd::AccumulateGrad(param),
                    saved: SmallVec::new(),
                    inputs: (0, 0),
                    buffer: SmallVec::from_elem(None, 1),
                    region: None,
                    unit: self.unit,
                    component: Component::Gradients,
                    dtensor: false,
                });
                self.params[param].node = Some(node);
                node
            }
        };
        Some(InputEdge {
            target: node,
            slot: 0,
            numel,
            dtype,
        })
    }

    // ----- gradient checkpointing ----------------------------------------------------------

    /// Enter the forward of a checkpointed region; it keeps `inputs` alive for recomputation.
    pub(crate) fn begin_region(&mut self, inputs: &[T]) -> u32 {
        let id = self.regions.len() as u32;
        let inputs = inputs.iter().map(|&t| self.share(t)).collect();
        // Regions are layers, which record alike: room for as many nodes as the last one.
        let room = self.regions.last().map_or(0, |r| r.nodes.len());
        self.regions.push(Region {
            inputs,
            nodes: Vec::with_capacity(room),
            recomputed: false,
            pending: 0,
            reentrant: false,
            recomputed_output: None,
            held_grads: SmallVec::new(),
            entered: false,
            kept_by: None,
        });
        self.region = Some(id);
        id
    }

    /// Enter the forward of a reentrant checkpointed region (see [`Region::reentrant`]).
    pub(crate) fn begin_reentrant_region(&mut self, inputs: &[T]) -> u32 {
        let id = self.begin_region(inputs);
        self.regions[id as usize].reentrant = true;
        id
    }

    /// The output a reentrant region's recomputation made: kept until its backward is done.
    pub(crate) fn hold_recomputed_output(&mut self, region: u32, output: T) {
        let kept = self.share(output);
        if let Some(old) = self.regions[region as usize]
            .recomputed_output
            .replace(kept)
        {
            self.drop(old);
        }
    }

    pub(crate) fn end_region(&mut self) {
        self.region = None;
    }

    /// The graph region `region`'s recomputation builds outlives its backward, held by
    /// `holders` outputs of it: the region's inputs and their gradients go to a [`KeptGraph`]
    /// when its backward is done, until [`Tracer::release_kept_graph`] has been called once per
    /// holder.
    pub(crate) fn keep_recomputed_graph(&mut self, region: u32, holders: u32) -> u32 {
        let id = match self.kept_graphs.iter().position(|g| g.holders == 0) {
            Some(free) => free,
            None => {
                self.kept_graphs.push(KeptGraph::default());
                self.kept_graphs.len() - 1
            }
        };
        self.kept_graphs[id].holders = holders;
        self.regions[region as usize].kept_by = Some(id as u32);
        id as u32
    }

    /// One holder of kept graph `id` lets go; the last frees what the graph kept.
    pub(crate) fn release_kept_graph(&mut self, id: u32) {
        let graph = &mut self.kept_graphs[id as usize];
        graph.holders -= 1;
        if graph.holders == 0 {
            let tensors = std::mem::take(&mut graph.tensors);
            self.drop_all(&tensors);
        }
    }

    /// The inputs a region saved, for its recomputation.
    pub(crate) fn region_inputs(&self, region: u32) -> SmallVec<[T; 2]> {
        self.regions[region as usize].inputs.clone()
    }

    /// Autocast's cast of weight `w` to `low`: its node is marked as one, which a recomputation
    /// may make afresh or find in the cache instead.
    pub(crate) fn weight_cast(&mut self, w: T, low: DType) -> T {
        self.casting_weight = true;
        let cast = self.to(w, low);
        self.casting_weight = false;
        cast
    }

    /// A recomputation that finds a weight's cast in autocast's cache (one context around the
    /// forward and the backward, as a pipeline schedule's step runs them) makes no cast: it
    /// passes over the node the forward recorded making it here, if the forward made it here.
    pub(crate) fn pass_cached_cast(&mut self, cast: T) {
        let Some((region, next)) = self.recompute else {
            return;
        };
        let Some((node, _)) = self.rec(cast).grad_fn else {
            return;
        };
        if self.regions[region as usize]
            .nodes
            .get(next)
            .is_some_and(|n| n.weight_cast && n.id == node)
        {
            self.recompute = Some((region, next + 1));
        }
    }

    pub(crate) fn begin_recompute(&mut self, region: u32) {
        self.recompute = Some((region, 0));
    }

    pub(crate) fn end_recompute(&mut self) {
        let (region, next) = self.recompute.take().expect("a recomputation is running");
        debug_assert_eq!(
            next,
            self.regions[region as usize].nodes.len(),
            "recomputation stopped early"
        );
        self.regions[region as usize].recomputed = true;
    }

    /// Whether the recomputation has produced every save the region's nodes need: PyTorch's
    /// non-reentrant checkpoint stops recomputing when the last saved tensor is packed
    /// (`_StopRecomputationError`). An op packs what it saves before its kernel runs, so when
    /// the last saving op saves only its inputs, its output is never made either.
    pub(crate) fn recompute_done(&self) -> bool {
        let Some((region, next)) = self.recompute else {
            return false;
        };
        let r = &self.regions[region as usize];
        if r.reentrant {
            return false;
        }
        match r.last_saving() {
            None => true,
            Some(last) => next > last || (next == last && !r.nodes[last].saves_output),
        }
    }

    /// Whether node `id`, of a region not recomputed yet, unpacks a saved tensor when it runs:
    /// only that triggers the recomputation (`_checkpoint_hook.unpack_hook`); a node that saves
    /// nothing runs before it.
    fn unpacks(&self, id: NodeId, region: u32) -> bool {
        self.regions[region as usize]
            .nodes
            .iter()
            .any(|n| n.id == id && n.saves > 0)
    }

    // ----- backward ------------------------------------------------------------------------

    /// `loss.backward()`: run the engine from `root` (a scalar), then free the graph.
    pub(crate) fn backward(&mut self, root: T, hooks: &mut dyn BackwardHooks) {
        let Some((root_node, root_slot)) = self.rec(root).grad_fn else {
            return;
        };
        // `torch.autograd.backward` makes `ones_like(loss)` in Python, which holds it until
        // the call returns.
        let seed = self.empty(1, self.dtype(root), "grad of loss (ones_like)");
        let deps = self.compute_dependencies(root_node);
        self.run_engine(root_node, root_slot, seed, deps, hooks);
        self.free_graph();
        self.drop(seed);
    }

    /// `torch.autograd.backward([root], grad_tensors=[grad])` through one of several graphs
    /// alive at once (a pipeline stage's micro-batches): `grad` seeds the root (`None`: the
    /// `ones_like` of a scalar loss), and only the nodes this backward reaches release what
    /// they hold. The graphs' tables go with [`Tracer::free_graph`] once none is left.
    pub(crate) fn backward_graph(
        &mut self,
        root: T,
        grad: Option<T>,
        hooks: &mut dyn BackwardHooks,
    ) {
        let Some((root_node, root_slot)) = self.rec(root).grad_fn else {
            return;
        };
        let seed = match grad {
            Some(grad) => self.share(grad),
            None => self.empty(1, self.dtype(root), "grad of loss (ones_like)"),
        };
        let deps = self.compute_dependencies(root_node);
        let reached: Vec<bool> = deps
            .iter()
            .enumerate()
            .map(|(i, &d)| d > 0 || i == root_node.0 as usize)
            .collect();
        self.run_engine(root_node, root_slot, seed, deps, hooks);
        self.release_reached(&reached);
        self.drop(seed);
    }

    /// The engine's loop from `root` (its slot `root_slot` seeded with `seed`), `deps` the
    /// count of edges into each node.
    fn run_engine(
        &mut self,
        root_node: NodeId,
        root_slot: u8,
        seed: T,
        mut deps: Vec<u32>,
        hooks: &mut dyn BackwardHooks,
    ) {
        self.nodes[root_node.0 as usize].buffer[root_slot as usize] = Some(self.share(seed));
        self.thread = 1;
        let mut ready = BinaryHeap::new();
        ready.push((self.nodes[root_node.0 as usize].seq, root_node.0));
        while let Some((_, id)) = ready.pop() {
            let node = NodeId(id);
            let unit = self.nodes[id as usize].unit;
            if let Some(u) = unit
                && !self.unit_entered[u as usize]
            {
                self.unit_entered[u as usize] = true;
                hooks.unit_backward_begins(self, u);
            }
            if let Some(region) = self.nodes[id as usize].region {
                self.hold_region_grads(node, region);
                if !self.regions[region as usize].recomputed && self.unpacks(node, region) {
                    hooks.recompute(self, region);
                }
            }
            let outputs = self.run_node(node);
            let finished = self.release_node(node);
            if let Bwd::AccumulateGrad(param) = self.nodes[id as usize].op
                && self.params[param].grad.is_some()
            {
                hooks.grad_accumulated(self, param);
            }
            let (first, count) = self.nodes[id as usize].inputs;
            for (i, grad) in (first as usize..(first + count) as usize).zip(outputs) {
                let edge = self.edges[i];
                let (Some(edge), Some(grad)) = (edge, grad) else {
                    if let Some(grad) = grad {
                        self.drop(grad);
                    }
                    continue;
                };
                self.accumulate_into(edge.target, edge.slot, grad);
                let target = edge.target.0 as usize;
                deps[target] -= 1;
                if deps[target] == 0 {
                    ready.push((self.nodes[target].seq, edge.target.0));
                }
            }
            if let Some(region) = finished {
                self.finish_region(region);
            }
            if let Some(u) = unit {
                // A unit's `AccumulateGrad` nodes run as soon as they are ready (the highest
                // sequence number), so its count reaches zero only once its grads are stored.
                self.unit_pending[u as usize] -= 1;
                if self.unit_pending[u as usize] == 0 {
                    hooks.unit_backward_done(self, u);
                }
            }
        }
        self.thread = 0;
    }

    /// What `node` saved for its backward goes.
    pub(crate) fn release_saved(&mut self, node: NodeId) {
        let saved = std::mem::take(&mut self.nodes[node.0 as usize].saved);
        self.drop_all(&saved);
    }

    /// After a backward through one of several graphs: the nodes it reached that never ran
    /// release what they hold, and so do its checkpointed regions.
    fn release_reached(&mut self, reached: &[bool]) {
        for (i, _) in reached.iter().enumerate().filter(|(_, r)| **r) {
            self.release_buffer(NodeId(i as u32));
            let saved = std::mem::take(&mut self.nodes[i].saved);
            self.drop_all(&saved);
        }
        for r in 0..self.regions.len() {
            let region = &self.regions[r];
            if region.pending > 0 && region.nodes.iter().all(|n| reached[n.id.0 as usize]) {
                self.regions[r].pending = 0;
                self.finish_region(r as u32);
            }
        }
    }

    /// Regions begun so far: a forward's first region is this count before it runs.
    pub(crate) fn region_count(&self) -> u32 {
        self.regions.len() as u32
    }

    /// How many edges of the graph under `root` point at each node (by node id), kept apart
    /// from the nodes (the count is all the engine touches of most nodes, and a node is
    /// large); and per unit, how many of its nodes this backward runs.
    fn compute_dependencies(&mut self, root: NodeId) -> Vec<u32> {
        let mut deps = vec![0u32; self.nodes.len()];
        let mut stack = vec![root];
        self.unit_pending.clear();
        self.unit_entered.clear();
        while let Some(n) = stack.pop() {
            if let Some(u) = self.nodes[n.0 as usize].unit {
                let u = u as usize;
                if self.unit_pending.len() <= u {
                    self.unit_pending.resize(u + 1, 0);
                    self.unit_entered.resize(u + 1, false);
                }
                self.unit_pending[u] += 1;
            }
            let (first, count) = self.nodes[n.0 as usize].inputs;
            for edge in self.edges[first as usize..(first + count) as usize]
                .iter()
                .flatten()
            {
                let t = edge.target.0 as usize;
                // The graph has no cycles: the root is nobody's target.
                if deps[t] == 0 {
                    stack.push(edge.target);
                }
                deps[t] += 1;
            }
        }
        deps
    }

    /// `InputBuffer::add` (`input_buffer.cpp`): the first gradient is stored; a later one is
    /// added in place when the stored tensor is ours alone and not a tensor subclass
    /// (`can_accumulate_inplace`), else summed into a new tensor.
    fn accumulate_into(&mut self, node: NodeId, slot: u8, grad: T) {
        let current = self.nodes[node.0 as usize].buffer[slot as usize];
        let sum_stream = match self.nodes[node.0 as usize].op {
            Bwd::AccumulateGrad(param) => self.params[param].grad_sum_stream,
            _ => None,
        };
        let merged = match current {
            None => grad,
            Some(old) if sum_stream.is_some() => {
                let stream = std::mem::replace(&mut self.mem.stream, sum_stream.unwrap_or(0));
                let sum = self.empty(self.numel(old), self.dtype(old), "grad sum (tied views)");
                self.mem.stream = stream;
                self.drop(old);
                self.drop(grad);
                sum
            }
            Some(old) => {
                let rec = self.rec(old);
                if rec.refs == 1 && !rec.view_of_temporary && !self.nodes[node.0 as usize].dtensor {
                    self.drop(grad);
                    old
                } else {
                    let sum =
                        self.empty(self.numel(old), self.dtype(old), "grad sum (InputBuffer)");
                    self.drop(old);
                    self.drop(grad);
                    sum
                }
            }
        };
        self.nodes[node.0 as usize].buffer[slot as usize] = Some(merged);
    }

    /// Drop a node's incoming gradients, keeping its slots: a parameter's `AccumulateGrad`
    /// node serves every graph alive at once (a pipeline's micro-batches).
    fn release_buffer(&mut self, node: NodeId) {
        let grads: SmallVec<[T; 2]> = self.nodes[node.0 as usize]
            .buffer
            .iter_mut()
            .filter_map(Option::take)
            .collect();
        self.drop_all(&grads);
    }

    /// The first node of a reentrant region to run receives the gradients of the region's
    /// output: they are held until the region's backward is done.
    fn hold_region_grads(&mut self, node: NodeId, region: u32) {
        let r = &self.regions[region as usize];
        if !r.reentrant || r.entered {
            return;
        }
        self.regions[region as usize].entered = true;
        let grads: SmallVec<[T; 1]> = self.nodes[node.0 as usize]
            .buffer
            .iter()
            .flatten()
            .copied()
            .collect();
        for &g in &grads {
            self.share(g);
        }
        self.regions[region as usize].held_grads = grads;
    }

    /// After a node ran: drop its incoming gradients, then release what it saved. Returns the
    /// region whose backward it completed, once its gradients are passed on.
    fn release_node(&mut self, node: NodeId) -> Option<u32> {
        self.release_buffer(node);
        self.release_saved(node);
        let region = self.nodes[node.0 as usize].region?;
        let r = &mut self.regions[region as usize];
        // A node another micro-batch's graph reaches too (a cached autocast cast) runs again
        // after its region's backward is done.
        if r.pending == 0 {
            return None;
        }
        r.pending -= 1;
        (r.pending == 0).then_some(region)
    }

    /// A region's backward is done: what its checkpoint held goes, its inputs and their
    /// gradients to the graph that keeps them, if any.
    fn finish_region(&mut self, region: u32) {
        let r = &mut self.regions[region as usize];
        let inputs = std::mem::take(&mut r.inputs);
        let output = r.recomputed_output.take();
        let held = std::mem::take(&mut r.held_grads);
        match r.kept_by {
            Some(graph) => {
                // Each input's gradient waits in its producer's buffer, or in the
                // `AccumulateGrad` buffer of a leaf (a received tensor), which then finds it
                // held by the detached input and stores a clone.
                let grads: SmallVec<[T; 2]> = inputs
                    .iter()
                    .filter_map(|&input| {
                        let (node, slot) = self.rec(input).grad_fn.or_else(|| {
                            let leaf = self.rec(input).param?;
                            Some((self.params[leaf].node?, 0))
                        })?;
                        self.nodes[node.0 as usize].buffer[slot as usize]
                    })
                    .collect();
                for &g in &grads {
                    self.share(g);
                }
                let kept = &mut self.kept_graphs[graph as usize];
                debug_assert!(kept.holders > 0, "a graph let go before its backward");
                kept.tensors.extend(inputs);
                kept.tensors.extend(grads);
            }
            None => self.drop_all(&inputs),
        }
        if let Some(output) = output {
            self.drop(output);
        }
        self.drop_all(&held);
    }

    /// The graph is freed after backward: nodes that never ran release what they hold.
    pub(crate) fn free_graph(&mut self) {
        for i in 0..self.nodes.len() {
            let buffer = std::mem::take(&mut self.nodes[i].buffer);
            for g in buffer.into_iter().flatten() {
                self.drop(g);
            }
            let saved = std::mem::take(&mut self.nodes[i].saved);
            self.drop_all(&saved);
        }
        for r in std::mem::take(&mut self.regions) {
            self.drop_all(&r.inputs);
            self.drop_all(&r.held_grads);
        }
        self.nodes.clear();
        self.edges.clear();
        for p in &mut self.params {
            p.node = None;
        }
        let leaves = std::mem::take(&mut self.activation_leaves);
        for &leaf in &leaves {
            let rec = &mut self.params[leaf];
            let (tensor, grad) = (rec.tensor, rec.grad.take());
            self.rec_mut(tensor).param = None;
            if let Some(g) = grad {
                self.drop(g);
            }
            self.drop(tensor);
        }
        // The leaves were the last parameters registered (during this forward); they are gone
        // with the graph, so the next forward's leaf gets the same index.
        if let Some(&first) = leaves.iter().min() {
            debug_assert!(
                leaves.len() == self.params.len() - first,
                "activation leaves are the last parameters"
            );
            self.params.truncate(first);
        }
        // Every `grad_fn` points into the graph just freed. A listed slot that was recycled
        // holds a tensor created since, whose `grad_fn` (if any) is of this graph too.
        for t in std::mem::take(&mut self.with_grad_fn) {
            self.tensors[t.0 as usize].grad_fn = None;
        }
    }

    // ----- pieces the backward formulas use --------------------------------------------------

    pub(crate) fn node_saved(&self, node: NodeId) -> SmallVec<[T; 4]> {
        self.nodes[node.0 as usize].saved.clone()
    }

    pub(crate) fn node_op(&self, node: NodeId) -> Bwd {
        self.nodes[node.0 as usize].op
    }

    pub(crate) fn node_component(&self, node: NodeId) -> Component {
        self.nodes[node.0 as usize].component
    }

    pub(crate) fn node_grad(&self, node: NodeId, slot: usize) -> Option<T> {
        self.nodes[node.0 as usize]
            .buffer
            .get(slot)
            .copied()
            .flatten()
    }

    /// Take a gradient out of a node's buffer (its reference moves to the caller).
    pub(crate) fn take_node_grad(&mut self, node: NodeId, slot: usize) -> T {
        self.nodes[node.0 as usize].buffer[slot]
            .take()
            .expect("the node received this gradient")
    }

    /// (numel, dtype) of each forward input that needs a gradient (None otherwise).
    pub(crate) fn node_inputs(&self, node: NodeId) -> SmallVec<[Option<(u64, DType)>; 3]> {
        let (first, count) = self.nodes[node.0 as usize].inputs;
        self.edges[first as usize..(first + count) as usize]
            .iter()
            .map(|e| e.map(|e| (e.numel, e.dtype)))
            .collect()
    }

    /// Whether forward input `slot` of `node` is a parameter (or autocast's cast of one):
    /// broadcasting repeats such a tensor over leading dimensions, so its gradient is summed
    /// over the outer ones; an activation broadcasts along a kept dimension of its own.
    pub(crate) fn input_is_parameter(&self, node: NodeId, slot: usize) -> bool {
        let (first, _) = self.nodes[node.0 as usize].inputs;
        let Some(edge) = self.edges[first as usize + slot] else {
            return false;
        };
        match self.nodes[edge.target.0 as usize].op {
            Bwd::AccumulateGrad(_) => true,
            Bwd::ToCopy => {
                let (first, count) = self.nodes[edge.target.0 as usize].inputs;
                count > 0
                    && self.edges[first as usize].is_some_and(|e| {
                        matches!(self.nodes[e.target.0 as usize].op, Bwd::AccumulateGrad(_))
                    })
            }
            _ => false,
        }
    }

    pub(crate) fn store_param_grad(&mut self, param: ParamId, grad: T) {
        if let Some(order) = &mut self.grad_ready {
            order.push(param);
        }
        let p = &mut self.params[param];
        match p.grad {
            None => p.grad = Some(grad),
            Some(_) => unreachable!("zero_grad(set_to_none=True) runs before every backward"),
        }
    }

    /// Whether `t` is a view of another tensor's storage (a slice, a split).
    pub(crate) fn is_view(&self, t: T) -> bool {
        self.rec(t).base.is_some()
    }

    pub(crate) fn tensor_refs(&self, t: T) -> u32 {
        self.rec(t).refs
    }

    /// The references to `t` other than those of graphs kept past their backward
    /// ([`Tracer::keep_recomputed_graph`]): a kept graph holds a checkpoint's detached input,
    /// which shares the storage of the tensor the checkpoint was given but is another tensor.
    pub(crate) fn refs_outside_kept_graphs(&self, t: T) -> u32 {
        let kept = self
            .kept_graphs
            .iter()
            .filter(|g| g.holders > 0)
            .flat_map(|g| &g.tensors)
            .filter(|&&k| k == t)
            .count() as u32;
        self.rec(t).refs - kept
    }
}

#[cfg(test)]
mod tests {
    use super::super::memory::Request;
    use super::*;
    use headroom_alloc::{AllocatorConfig, CachingAllocator};

    fn tracer() -> Tracer {
        Tracer::new(
            Memory::new(
                CachingAllocator::new(AllocatorConfig::default(), None),
                Default::default(),
            ),
            crate::gpu::Gpu::default().workspaces(),
        )
    }

    /// Two parameters and an input, as a training pass would find them.
    fn model(t: &mut Tracer) -> T {
        t.parameter(1 << 20, DType::F32, true, "w1");
        t.parameter(1 << 10, DType::F32, true, "w2");
        t.empty_as(4096, DType::I64, Component::Inputs, "input_ids")
    }

    /// A pass's state leaves out what a pass does not read (gradients, the optimizer's states,
    /// persistent tensors made since, the workspace flags), and still sees everything else.
    #[test]
    fn a_pass_state_leaves_out_what_a_pass_does_not_read() {
        let mut t = tracer();
        let ids = model(&mut t);
        let persistent = t.persistent_count();
        let pass = |aside| Scope::Pass { persistent, aside };
        let start = t.state(pass(&[]), &[ids]);
        let whole = t.state(Scope::Step, &[ids]);

        // What a first step leaves: a gradient, a workspace, optimizer states.
        let g = t.empty_as(1 << 20, DType::F32, Component::Gradients, "grad");
        t.store_param_grad(0, g);
        let ws = t.empty_as(
            1 << 20,
            DType::U8,
            Component::Workspaces,
            "cuBLAS workspace",
        );
        t.mark_persistent(ws);
        t.cublas_workspace[0] = true;
        let states = [
            t.empty_as(1 << 20, DType::F32, Component::OptimizerStates, "exp_avg"),
            t.empty_as(
                1 << 20,
                DType::F32,
                Component::OptimizerStates,
                "exp_avg_sq",
            ),
        ];
        assert!(t.state_is(pass(&states), &[ids], &start));
        // The whole state sees it.
        assert!(!t.state_is(Scope::Step, &[ids], &whole));

        // A live tensor nothing reaches, another reference to a parameter, or a parameter
        // cast to another dtype is a different state.
        let stray = t.empty(8, DType::F32, "stray");
        assert!(!t.state_is(pass(&states), &[ids], &start));
        t.drop(stray);
        assert!(t.state_is(pass(&states), &[ids], &start));
        let w = t.param(1);
        t.share(w);
        assert!(!t.state_is(pass(&states), &[ids], &start));
        t.drop(w);
        assert!(t.state_is(pass(&states), &[ids], &start));
        t.cast_parameter(1, DType::BF16);
        assert!(!t.state_is(pass(&states), &[ids], &start));
    }

    /// `NllLossBackward0` keeps its input: an fp32 cast of the log-probs that nothing else
    /// saves (autocast's, before `nll_loss`) outlives the forward that drops it.
    #[test]
    fn nll_loss_keeps_its_input_for_backward() {
        let mut t = tracer();
        let ids = model(&mut t);
        let w = t.param(0);
        let log_probs = t.to(w, DType::BF16);
        let before = t.mem.allocated();
        let cast = t.to(log_probs, DType::F32);
        let loss = t.nll_loss(cast, ids);
        t.drop(cast);
        assert!(t.mem.allocated() >= before + 4 * (1 << 20));
        t.drop(loss);
    }

    /// Stored gradients come back on the allocations a replay makes, as the same tensors.
    #[test]
    fn stored_gradients_are_restored_on_replayed_allocations() {
        let mut t = tracer();
        model(&mut t);
        t.mem.record_requests();
        let scratch = t.empty(16, DType::F32, "scratch");
        let g = t.empty_as(1 << 20, DType::F32, Component::Activations, "grad of mm");
        t.recategorize(g, Component::Gradients);
        t.store_param_grad(0, g);
        t.drop(scratch);
        let grads = t.stored_grads().expect("a plain, recorded gradient");
        let requests = t.mem.take_requests().expect("a complete record");
        let stored = t.params[0].grad.take().expect("stored");
        t.drop(stored);
        let live = t.mem.live();

        let mut allocations = Vec::new();
        t.mem.replay(&requests, &mut allocations);
        t.restore_grads(&grads, &allocations);
        let g = t.params[0].grad.expect("restored");
        assert_eq!(
            (t.numel(g), t.dtype(g), t.tensor_refs(g)),
            (1 << 20, DType::F32, 1)
        );
        assert_eq!(
            t.mem.live()[Component::Gradients.index()],
            live[Component::Gradients.index()] + (4 << 20)
        );
        assert!(t.params[1].grad.is_none());

        // A gradient with a second holder is not a plain tensor of its own.
        let held = t.share(g);
        assert!(t.stored_grads().is_none());
        t.drop(held);
    }

    /// Gradients that are views of one recorded allocation (FSDP2's sharded gradients, views of
    /// the reduce-scatter output) come back as views of one tensor on the replayed allocation,
    /// which goes only when the last of them does; an owner held by anything but gradients
    /// is not restorable.
    #[test]
    fn gradient_views_are_restored_on_replayed_allocations() {
        let mut t = tracer();
        model(&mut t);
        t.mem.record_requests();
        let output = t.empty_as(
            (1 << 20) + (1 << 10),
            DType::F32,
            Component::Gradients,
            "reduce-scatter output",
        );
        for (param, numel) in [(0, 1 << 20), (1, 1 << 10)] {
            let view = t.view(output, numel, "sharded grad");
            t.params[param].grad = Some(view);
        }
        let held = t.share(output);
        assert!(t.stored_grads().is_none(), "the output has another holder");
        t.drop(held);
        t.drop(output);
        let grads = t.stored_grads().expect("views of a recorded allocation");
        let requests = t.mem.take_requests().expect("a complete record");
        let live = t.mem.live();
        for param in [0, 1] {
            let g = t.params[param].grad.take().expect("stored");
            t.drop(g);
        }
        assert!(t.mem.live()[Component::Gradients.index()] < live[Component::Gradients.index()]);

        let mut allocations = Vec::new();
        t.mem.replay(&requests, &mut allocations);
        t.restore_grads(&grads, &allocations);
        assert_eq!(t.mem.live(), live);
        let (g0, g1) = (t.params[0].grad.unwrap(), t.params[1].grad.unwrap());
        assert_eq!((t.numel(g0), t.numel(g1)), (1 << 20, 1 << 10));
        let base = t.rec(g0).base.expect("a view");
        assert_eq!(t.rec(g1).base, Some(base));
        assert_eq!(t.tensor_refs(base), 2);
        // The allocation goes with the last view.
        t.params[0].grad = None;
        t.drop(g0);
        assert_eq!(t.mem.live(), live);
        t.params[1].grad = None;
        t.drop(g1);
        assert!(t.mem.live()[Component::Gradients.index()] < live[Component::Gradients.index()]);
    }

    /// Recomputes a region of one `.to()` of its input, as `tensor_parallel.checkpoint` would,
    /// and says its graph is kept when `keep`.
    struct Recompute {
        keep: bool,
        graph: Option<u32>,
    }

    impl BackwardHooks for Recompute {
        fn recompute(&mut self, t: &mut Tracer, region: u32) {
            let input = t.region_inputs(region)[0];
            t.begin_recompute(region);
            let out = t.empty(t.numel(input), DType::F32, "recomputed");
            t.record(Bwd::ToCopy, &[Some(input)], &[out], &[input]);
            t.hold_recomputed_output(region, out);
            t.drop(out);
            if self.keep {
                self.graph = Some(t.keep_recomputed_graph(region, 1));
            }
            t.end_recompute();
        }
    }

    /// A kept recomputed graph holds the checkpoint's input and that input's gradient past the
    /// backward, until its holder lets go; without one both go with the region's backward.
    #[test]
    fn a_kept_recomputed_graph_holds_the_input_and_its_gradient() {
        const NUMEL: u64 = 1 << 20;
        let after_backward = |keep: bool| {
            let mut t = tracer();
            t.parameter(NUMEL, DType::F32, true, "w");
            let w = t.param(0);
            let x = t.to(w, DType::BF16);
            let region = t.begin_reentrant_region(&[x]);
            let y = t.empty(NUMEL, DType::F32, "checkpoint output");
            t.record(Bwd::ToCopy, &[Some(x)], &[y], &[x]);
            t.end_region();
            t.drop_all(&[x, w]);
            let mut hooks = Recompute { keep, graph: None };
            t.backward(y, &mut hooks);
            t.drop(y);
            assert!(t.regions.is_empty() && region == 0);
            let allocated = t.mem.allocated();
            if let Some(graph) = hooks.graph {
                t.release_kept_graph(graph);
            }
            (allocated, t.mem.allocated())
        };
        let (dropped, _) = after_backward(false);
        let (kept, released) = after_backward(true);
        // The bf16 input and its bf16 gradient.
        assert_eq!(kept, dropped + 2 * 2 * NUMEL);
        assert_eq!(released, dropped);
    }

    /// What the process makes once is left out of a record; a free of it is then a request
    /// about an allocation from outside the record, which makes the record unusable.
    #[test]
    fn what_is_made_once_is_left_out_of_a_record() {
        let mut t = tracer();
        t.mem.record_requests();
        let a = t.empty(16, DType::F32, "a");
        let ws = t.empty_as(
            1 << 20,
            DType::U8,
            Component::Workspaces,
            "cuBLAS workspace",
        );
        t.made_once(ws);
        let b = t.empty(16, DType::F32, "b");
        t.drop(a);
        t.drop(b);
        assert_eq!(t.mem.requests_recorded(), 4);
        let requests = t.mem.take_requests().expect("a complete record");
        let labels: Vec<_> = requests
            .iter()
            .map(|r| match r {
                Request::Malloc { label, .. } | Request::Free { label, .. } => *label,
                Request::Recategorize { .. } => "recategorize",
            })
            .collect();
        assert_eq!(labels, ["a", "b", "a", "b"]);

        t.mem.record_requests();
        let ws = t.empty_as(
            1 << 20,
            DType::U8,
            Component::Workspaces,
            "cuBLASLt workspace",
        );
        t.made_once(ws);
        t.drop(ws);
        assert!(t.mem.take_requests().is_none());
    }
}
