//! `parallel.pp`, `vpp`, `microbatches`, `schedule`, `layers_per_stage`: pipeline parallelism as
//! torchtitan runs it with `torch.distributed.pipelining` (torch 2.11): the decoder's layers
//! split into `pp × vpp` stages, rank `r` of the pipeline holding stages `r, r + pp, ...`, the
//! schedule running `microbatches` micro-batches of `batch_size / microbatches` rows.

use serde_json::{Map, Value};

use super::parse::{choice, positive};
use crate::error::{Error, Result};
use crate::limits;

/// Which of `torch.distributed.pipelining`'s schedules runs the micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PipelineSchedule {
    /// `Schedule1F1B`: one stage per rank; stage `s` runs `pp - s` forwards before its first
    /// backward, then alternates.
    OneFOneB,
    /// `ScheduleInterleaved1F1B`: `vpp` stages per rank, in the order its
    /// `_calculate_single_rank_operations` gives.
    Interleaved1F1B,
    /// `ScheduleGPipe`: every forward, then every backward.
    GPipe,
}

impl PipelineSchedule {
    pub fn name(self) -> &'static str {
        match self {
            PipelineSchedule::OneFOneB => "1f1b",
            PipelineSchedule::Interleaved1F1B => "interleaved-1f1b",
            PipelineSchedule::GPipe => "gpipe",
        }
    }
}

/// The pipeline mesh dimension, outermost (torchtitan's mesh order `pp, dp, tp`): world_size =
/// pp × dp × tp.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineParallel {
    /// Ranks of the pipeline; 1: none.
    pub pp: u64,
    /// Stages per rank.
    pub vpp: u64,
    pub microbatches: u64,
    pub schedule: PipelineSchedule,
    /// Decoder layers of each stage, in stage order; `None`: an even split.
    pub layers_per_stage: Option<Vec<u64>>,
}

impl Default for PipelineParallel {
    fn default() -> Self {
        PipelineParallel {
            pp: 1,
            vpp: 1,
            microbatches: 1,
            schedule: PipelineSchedule::OneFOneB,
            layers_per_stage: None,
        }
    }
}

/// The keys of this section inside `parallel`.
pub(crate) const KEYS: &[&str] = &["pp", "vpp", "microbatches", "schedule", "layers_per_stage"];

impl PipelineParallel {
    pub fn stages(&self) -> u64 {
        self.pp.saturating_mul(self.vpp)
    }

    /// The decoder layers of each stage: `layers_per_stage`, or `layers` split evenly with the
    /// first stages taking one more (torchtitan's `generate_llm_fqn_per_model_part`).
    pub fn stage_layers(&self, layers: u64) -> Vec<u64> {
        if let Some(given) = &self.layers_per_stage {
            return given.clone();
        }
        let stages = self.stages();
        (0..stages)
            .map(|s| layers / stages + u64::from(s < layers % stages))
            .collect()
    }

    /// The pipeline rank of global rank `rank` in a world of `world_size`: the outermost mesh
    /// dimension.
    pub fn pipeline_rank(&self, rank: u64, world_size: u64) -> u64 {
        rank / (world_size / self.pp)
    }

    /// What the spec's model and batch must be for this split: `layers_per_stage` sums to the
    /// model's layers, every stage has one, and the batch splits into whole micro-batches.
    pub(crate) fn check(&self, layers: u64, batch_size: u64) -> Result<()> {
        if self.pp == 1 {
            return Ok(());
        }
        let stages = self.stages();
        match &self.layers_per_stage {
            Some(given) if given.iter().sum::<u64>() != layers => {
                return Err(Error::field(
                    "parallel.layers_per_stage",
                    format!("{given:?}"),
                    format!("the stages must hold the model's {layers} decoder layers in all"),
                ));
            }
            None if layers < stages => {
                return Err(Error::field(
                    "parallel.pp",
                    self.pp,
                    format!(
                        "pp × vpp = {stages} stages need at least as many decoder layers; the \
                         model has {layers}"
                    ),
                ));
            }
            _ => {}
        }
        // Every rank is simulated: 3 steps of a forward and a backward (4 layer-forwards) of
        // every layer for every micro-batch.
        let work = self
            .microbatches
            .saturating_mul(layers)
            .saturating_mul(3 * 4);
        if work > limits::MAX_PIPELINE_WORK {
            return Err(Error::field(
                "parallel.microbatches",
                self.microbatches,
                format!(
                    "3 steps × {layers} layers × 4 × {} micro-batches is {work}, more than the \
                     estimate simulates ({}); use fewer micro-batches",
                    self.microbatches,
                    limits::MAX_PIPELINE_WORK
                ),
            ));
        }
        if !batch_size.is_multiple_of(self.microbatches) {
            return Err(Error::field(
                "batch_size",
                batch_size,
                format!(
                    "the schedule splits it into parallel.microbatches = {} micro-batches: use a \
                     multiple of it",
                    self.microbatches
                ),
            ));
        }
        Ok(())
    }

    /// The micro-batch counts the schedule's constructor accepts (Megatron's 1F1B also runs
    /// fewer micro-batches than stages, all in its warm-up and cool-down).
    pub(crate) fn check_microbatches(&self, megatron: bool) -> Result<()> {
        let (pp, microbatches) = (self.pp, self.microbatches);
        if self.schedule == PipelineSchedule::OneFOneB && microbatches < pp && !megatron {
            // Schedule1F1B's constructor raises this.
            return Err(Error::field(
                "parallel.microbatches",
                microbatches,
                format!("Schedule1F1B needs at least as many micro-batches as stages (pp = {pp})"),
            ));
        }
        if self.schedule == PipelineSchedule::Interleaved1F1B {
            // ScheduleInterleaved1F1B runs max(1, microbatches // pp) rounds of equal size.
            let rounds = (microbatches / pp).max(1);
            if !microbatches.is_multiple_of(rounds) {
                return Err(Error::field(
                    "parallel.microbatches",
                    microbatches,
                    format!(
                        "ScheduleInterleaved1F1B needs a multiple of its {rounds} rounds \
                         (microbatches // pp): use one"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Read the pipeline keys of `parallel` (`obj`) for a world of `world_size` ranks.
pub(crate) fn parse(obj: &Map<String, Value>, world_size: u64) -> Result<PipelineParallel> {
    let field = |e: Error| e.prefixed("parallel");
    let pp = positive(obj, "pp", 1).map_err(field)?;
    if pp == 1 {
        if let Some(key) = KEYS[1..]
            .iter()
            .find(|k| obj.get(**k).is_some_and(|v| !v.is_null()))
        {
            return Err(Error::field(
                format!("parallel.{key}"),
                &obj[*key],
                "it applies to pipeline parallelism: set pp >= 2 or leave it out",
            ));
        }
        return Ok(PipelineParallel::default());
    }
    if !world_size.is_multiple_of(pp) {
        return Err(Error::field(
            "parallel.pp",
            pp,
            format!("it must divide world_size ({world_size}): world_size = pp × dp × tp"),
        ));
    }
    let schedule = choice(
        obj,
        "schedule",
        &[
            ("1f1b", PipelineSchedule::OneFOneB),
            ("interleaved-1f1b", PipelineSchedule::Interleaved1F1B),
            ("gpipe", PipelineSchedule::GPipe),
        ],
        PipelineSchedule::OneFOneB,
    )
    .map_err(field)?;
    let interleaved = schedule == PipelineSchedule::Interleaved1F1B;
    let vpp = positive(obj, "vpp", if interleaved { 2 } else { 1 }).map_err(field)?;
    if interleaved && vpp < 2 {
        return Err(Error::field(
            "parallel.vpp",
            vpp,
            "interleaved-1f1b runs several stages per rank: use 2 or more",
        ));
    }
    if !interleaved && vpp != 1 {
        return Err(Error::field(
            "parallel.vpp",
            vpp,
            format!(
                "schedule {} runs one stage per rank: use 1, or schedule interleaved-1f1b",
                schedule.name()
            ),
        ));
    }
    let microbatches = positive(obj, "microbatches", pp).map_err(field)?;
    let megatron = obj.get("framework").and_then(Value::as_str) == Some("megatron");
    PipelineParallel {
        pp,
        vpp,
        microbatches,
        schedule,
        layers_per_stage: None,
    }
    .check_microbatches(megatron)?;
    let stages = pp.saturating_mul(vpp);
    let layers_per_stage = match obj.get("layers_per_stage") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let allowed = format!("use a list of {stages} positive layer counts, one per stage");
            let list = v
                .as_array()
                .filter(|a| a.len() as u64 == stages)
                .ok_or_else(|| Error::field("parallel.layers_per_stage", v, &allowed))?;
            let counts: Option<Vec<u64>> = list
                .iter()
                .map(|n| n.as_u64().filter(|&n| n >= 1))
                .collect();
            Some(counts.ok_or_else(|| Error::field("parallel.layers_per_stage", v, &allowed))?)
        }
    };
    Ok(PipelineParallel {
        pp,
        vpp,
        microbatches,
        schedule,
        layers_per_stage,
    })
}
