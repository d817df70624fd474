//! What NCCL holds on a rank outside PyTorch's caching allocator: device memory the verdict
//! counts beside the CUDA context and the allocator's reserve.
//!
//! Torch gives every process group its own NCCL communicator. NCCL 2.28 (torch 2.11's) maps
//! each of a communicator's small device structures into its own 2 MiB cuMem granule: three
//! per channel and two more (bench/nccl-comms, its ALLOC log: 194 granules for a communicator
//! of one rank, which sets up 64 channels). A communicator that first runs a collective over
//! peers then connects its channels to them. Megatron-core makes twenty groups on every rank,
//! most of one rank or duplicating another's membership, and each is such a communicator:
//! made at once when the default group is bound to a device (`init_process_group(device_id=)`),
//! at its first collective otherwise (`MegatronLayout::groups`).

use crate::arch::Architecture;
use crate::spec::{Framework, Megatron, Parallel, RunSpec, Strategy};

const MIB: u64 = 1 << 20;

/// What a rank holds outside the caching allocator beyond the CUDA context once its process
/// groups are up (eager NCCL init), read on 2 and 4 H200s, torch 2.11 (bench/distributed: device
/// used after step 3, less reserved, less the single-GPU context, identical within 14 MiB over
/// every row of a strategy), and read the same way on 2 and 4 H100s (bench/nccl-x4: 998 MiB for
/// one communicator, 1,968-1,970 for three): the default group's communicator for DDP and FSDP2
/// over the world, three for HSDP and for FSDP2 under tensor parallelism (the default group and
/// one per mesh dimension), two for tensor parallelism alone (the default group and the tp
/// group), the default group and a point-to-point communicator per neighbour for pipeline
/// parallelism, DeepSpeed's groups for ZeRO. DeepSpeed sets up its groups on one rank too
/// (bench/distributed/h200x1/h200x1-torch2.11.jsonl: 1094 MiB without offload, up to 42 MiB
/// more with it); a one-rank FSDP2 or DDP group is not measured and counts nothing.
/// Megatron-core's groups are [`run_nccl_bytes`]'s.
pub fn nccl_bytes(parallel: Option<&Parallel>) -> u64 {
    match parallel {
        None => 0,
        Some(p) if p.world_size <= 1 && p.strategy.is_deepspeed() => 1094 * MIB,
        Some(p) if p.world_size <= 1 => 0,
        // A tensor- or context-parallel layout over data parallelism holds one communicator
        // per mesh dimension beside the default group's (measured for dp × tp, carried over to
        // context parallelism).
        Some(p) if (p.tensor.tp > 1 || p.tensor.cp > 1) && p.shard_size > 1 => 1964 * MIB,
        // Tensor parallelism alone: tp 2 over 2 and tp 4 over 4 H100s read the same.
        Some(p) if p.tensor.tp > 1 && p.strategy == Strategy::NoDataParallel => 1386 * MIB,
        // Pipeline parallelism alone: the default group and the point-to-point communicator of
        // each pair of neighbouring stages, read on both ranks of pp 2 over 2 H100s (every
        // schedule alike; a middle rank's second neighbour is not measured).
        Some(p) if p.pipeline.pp > 1 => 1440 * MIB,
        Some(p) => match p.strategy {
            Strategy::Ddp | Strategy::NoDataParallel => 992 * MIB,
            // FSDP1's process groups are FSDP2's (carried over, not measured on their own).
            Strategy::Fsdp | Strategy::Fsdp1 if p.shard_size < p.world_size => 1964 * MIB,
            Strategy::Fsdp | Strategy::Fsdp1 => 992 * MIB,
            Strategy::Zero1 | Strategy::Zero2 | Strategy::Zero3 => 1480 * MIB,
        },
    }
}

/// What NCCL holds on `rank` of the spec's layout (`None`: the most any of its ranks holds):
/// Megatron-core's communicators counted group by group, any other layout's measured whole
/// ([`nccl_bytes`]).
pub fn run_nccl_bytes(spec: &RunSpec, arch: &Architecture, rank: Option<u64>) -> u64 {
    run_nccl(spec, arch, rank).0
}

/// One NCCL communicator a Megatron-core rank makes, and what it holds on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Communicator {
    pub group: MegatronGroup,
    /// Its structures, and its connections to its peers once a step uses it.
    pub bytes: u64,
}

/// [`run_nccl_bytes`], with the communicators Megatron-core makes on that rank (none for any
/// other layout): their bytes and the kernels' and the run's own growth make the total.
pub fn run_nccl(
    spec: &RunSpec,
    arch: &Architecture,
    rank: Option<u64>,
) -> (u64, Vec<Communicator>) {
    let Some(parallel) = spec.parallel.as_ref() else {
        return (0, Vec::new());
    };
    if parallel.tensor.framework != Framework::Megatron {
        return (nccl_bytes(Some(parallel)), Vec::new());
    }
    let layout = MegatronLayout::of(parallel, &spec.megatron.unwrap_or_default(), arch);
    let stages = match rank {
        Some(rank) => vec![layout.stage_of(rank)],
        None => layout.stage_kinds(),
    };
    stages
        .into_iter()
        .map(|stage| {
            let made = layout.communicators(stage);
            let bytes = KERNELS + MODULES + made.iter().map(|c| c.bytes).sum::<u64>();
            (bytes, made)
        })
        .max_by_key(|(bytes, _)| *bytes)
        .unwrap_or_default()
}

/// The 2 MiB granule NCCL's cuMem allocations take each (`NCCL_CUMEM_ENABLE`, NCCL 2.28's
/// default).
const GRANULE: u64 = 2 * MIB;
/// Channels of a communicator of one rank: NCCL's maximum, nothing bounds it
/// (bench/nccl-comms: "Channel 00/64").
const CHANNELS_ALONE: u64 = 64;
/// Channels of a communicator over NVLink-connected H100s or H200s: the default group's 196
/// MiB at init over 2 and 4 of them (the context read after `init_process_group` with a bound
/// device, 987-995 MiB against 621 alone, less the kernels') is 98 granules; carried over to
/// communicators that span nodes.
const CHANNELS_PEERS: u64 = 32;
/// NCCL's kernels, loaded with the first communicator (bench/nccl-comms: the default group of
/// one rank costs 558 MiB, another group of one rank 388).
const KERNELS: u64 = 170 * MIB;
/// A communicator's connections to its peers, made by its first collective: DDP's measured
/// 992 MiB for the default group over 2 or 4 GPUs (read on the H100 and the H200) less that
/// communicator's init, the kernels and the run's own growth ([`MODULES`]).
const CONNECTIONS: u64 = 474 * MIB;
/// What else a run's device reading grows by outside the allocator (CUDA modules loaded as
/// their kernels first run): Megatron-core's runs of one rank, 8,470 MiB beyond the context
/// against 21 communicators of one rank and the kernels (bench/nccl-comms).
const MODULES: u64 = 152 * MIB;

/// A communicator's structures, made at its init.
fn communicator_init_bytes(size: u64) -> u64 {
    let channels = if size == 1 {
        CHANNELS_ALONE
    } else {
        CHANNELS_PEERS
    };
    (3 * channels + 2) * GRANULE
}

/// Where a rank's stage sits in the pipeline: which of the embedding groups it joins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// No pipeline: one stage is both ends.
    Only,
    First,
    Middle,
    Last,
}

/// One of `initialize_model_parallel`'s groups as a rank sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MegatronGroup {
    /// Its `group_desc`; the default group's is `default_pg`.
    pub name: &'static str,
    pub size: u64,
    /// Whether a training step runs a collective over it (bench/nccl-comms: every group's
    /// collectives counted in eight layouts over 4 ranks and two of one).
    pub used: bool,
}

/// The default group and the groups of Megatron-core's `initialize_model_parallel` that `rank`
/// of the spec's layout joins, in the order they are made; empty unless the spec runs under
/// `parallel.framework: megatron`.
pub fn megatron_groups(spec: &RunSpec, arch: &Architecture, rank: u64) -> Vec<MegatronGroup> {
    match spec.parallel.as_ref() {
        Some(p) if p.tensor.framework == Framework::Megatron => {
            let layout = MegatronLayout::of(p, &spec.megatron.unwrap_or_default(), arch);
            let mut groups = layout.groups(layout.stage_of(rank));
            groups.push(layout.default_group());
            groups
        }
        _ => Vec::new(),
    }
}

/// The sizes a rank's groups follow from (context parallelism 1; one distributed-optimizer
/// instance).
#[derive(Clone, Copy, Debug)]
struct MegatronLayout {
    world: u64,
    tp: u64,
    pp: u64,
    ep: u64,
    etp: u64,
    moe: bool,
    tied: bool,
    distributed_optimizer: bool,
    eager: bool,
}

impl MegatronLayout {
    fn of(parallel: &Parallel, megatron: &Megatron, arch: &Architecture) -> Self {
        let tp = parallel.tensor.tp.max(1);
        MegatronLayout {
            world: parallel.world_size.max(1),
            tp,
            pp: parallel.pipeline.pp.max(1),
            ep: megatron.expert_parallel.max(1),
            etp: megatron.etp(tp).max(1),
            moe: arch.moe.is_some(),
            tied: arch.tie_word_embeddings,
            distributed_optimizer: megatron.distributed_optimizer,
            eager: megatron.eager_nccl_init,
        }
    }

    /// The pipeline stage of `rank` (Megatron's order tp-cp-ep-dp-pp: pp outermost).
    fn stage_of(&self, rank: u64) -> Stage {
        let per_stage = (self.world / self.pp).max(1);
        match rank / per_stage {
            _ if self.pp == 1 => Stage::Only,
            0 => Stage::First,
            s if s + 1 >= self.pp => Stage::Last,
            _ => Stage::Middle,
        }
    }

    fn stage_kinds(&self) -> Vec<Stage> {
        match self.pp {
            1 => vec![Stage::Only],
            2 => vec![Stage::First, Stage::Last],
            _ => vec![Stage::First, Stage::Middle, Stage::Last],
        }
    }

    /// The groups `initialize_model_parallel` (megatron-core 0.19) puts a rank of `stage` in,
    /// in its order, and whether a step uses each.
    fn groups(&self, stage: Stage) -> Vec<MegatronGroup> {
        let (w, tp, pp, ep, etp) = (self.world, self.tp, self.pp, self.ep, self.etp);
        let dp = (w / (tp * pp)).max(1);
        let experts_apart = self.moe && (ep > 1 || etp > 1);
        let last = matches!(stage, Stage::Only | Stage::Last);
        let group = |name, size, used| MegatronGroup { name, size, used };
        let mut groups = vec![
            group("GTP_WEIGHT_REMAT_GROUP", 1, false),
            // The gradients' reduction and the loss's average.
            group("DATA_PARALLEL_GROUP_WITH_CP", dp, true),
            group("DATA_PARALLEL_GROUP", dp, false),
            group("CONTEXT_PARALLEL_GROUP", 1, false),
            // The gradients' norm, without the distributed optimizer.
            group("MODEL_PARALLEL_GROUP", tp * pp, !self.distributed_optimizer),
            // The parallel linears, and the vocabulary-parallel loss on the last stage.
            group("TENSOR_MODEL_PARALLEL_GROUP", tp, tp > 1 || last),
            group("PIPELINE_MODEL_PARALLEL_GROUP", pp, pp > 1),
        ];
        if stage != Stage::Middle {
            // The tied embedding's gradient, shared by the first and the last stage.
            let size = if pp > 1 { 2 } else { 1 };
            groups.push(group("EMBEDDING_GROUP", size, self.tied && pp > 1));
        }
        if matches!(stage, Stage::Only | Stage::First) {
            groups.push(group("POSITION_EMBEDDING_GROUP", 1, false));
        }
        groups.extend([
            group("TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", tp * dp, false),
            group("TENSOR_AND_DATA_PARALLEL_GROUP", tp * dp, false),
            group("TENSOR_AND_CONTEXT_PARALLEL_GROUP", tp, false),
            group("EXPERT_GTP_WEIGHT_REMAT_GROUP", 1, false),
            // The tokens' all-to-all.
            group("EXPERT_MODEL_PARALLEL_GROUP", ep, self.moe && ep > 1),
            group("EXPERT_TENSOR_PARALLEL_GROUP", etp, self.moe && etp > 1),
            // The tokens' counts, gathered before the dispatch.
            group(
                "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP",
                etp * ep,
                self.moe && etp * ep > 1,
            ),
            group(
                "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
                etp * ep * pp,
                false,
            ),
            // The experts' gradients' norm, without the distributed optimizer.
            group(
                "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP",
                etp * ep * pp,
                experts_apart && !self.distributed_optimizer,
            ),
            // The experts' gradients, reduced apart from the dense ones.
            group(
                "EXPERT_DATA_PARALLEL_GROUP",
                (w / (etp * ep * pp)).max(1),
                experts_apart,
            ),
            // The gradients' norm under the distributed optimizer.
            group(
                "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
                w,
                self.distributed_optimizer,
            ),
        ]);
        groups
    }

    /// The default process group, over the world, used by every run.
    fn default_group(&self) -> MegatronGroup {
        MegatronGroup {
            name: "default_pg",
            size: self.world,
            used: true,
        }
    }

    /// The communicators a rank of `stage` makes: the default group's and every group's (all of
    /// them when eager, the used ones otherwise), each with its structures and, used over peers,
    /// its connections.
    fn communicators(&self, stage: Stage) -> Vec<Communicator> {
        std::iter::once(self.default_group())
            .chain(self.groups(stage))
            .filter(|g| self.eager || g.used)
            .map(|group| Communicator {
                group,
                bytes: communicator_init_bytes(group.size)
                    + if group.used && group.size > 1 {
                        CONNECTIONS
                    } else {
                        0
                    },
            })
            .collect()
    }
}
