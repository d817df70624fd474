//! Megatron-core's pipeline parallelism (`parallel.pp` with `parallel.framework: megatron`): what
//! of `forward_backward_pipelining_without_interleaving`, `..._with_interleaving` (`vpp` >= 2)
//! and `get_num_layers_to_build` a spec may ask for. The layers split evenly over the stages (`num_layers % pp == 0`, as
//! `get_num_layers_to_build` asserts), or as `layers_per_stage` says when Megatron can express
//! it: `num_layers_in_first_pipeline_stage` and `..._last_...` set, the rest split evenly.

use super::pipeline_parallel::{PipelineParallel, PipelineSchedule};
use crate::error::{Error, Result};

/// Refuse what Megatron's pipeline cannot run, or what is not modelled, for a model of
/// `layers` decoder layers.
pub(crate) fn check(pipeline: &PipelineParallel, layers: u64) -> Result<()> {
    if pipeline.pp == 1 {
        return Ok(());
    }
    if pipeline.schedule == PipelineSchedule::Interleaved1F1B {
        return check_interleaved(pipeline, layers);
    }
    if pipeline.schedule != PipelineSchedule::OneFOneB {
        return Err(Error::Unsupported {
            what: format!(
                "parallel.schedule {} with framework megatron",
                pipeline.schedule.name()
            ),
            supported: "Megatron's 1F1B (schedule 1f1b: \
                        forward_backward_pipelining_without_interleaving) and interleaved 1F1B \
                        (schedule interleaved-1f1b with vpp >= 2: \
                        forward_backward_pipelining_with_interleaving)"
                .into(),
        });
    }
    let pp = pipeline.pp;
    match &pipeline.layers_per_stage {
        None if !layers.is_multiple_of(pp) => Err(Error::field(
            "parallel.pp",
            pp,
            format!(
                "Megatron splits the model's {layers} decoder layers evenly over the stages: use \
                 a pp that divides them, or parallel.layers_per_stage"
            ),
        )),
        Some(split)
            if split.len() > 2 && split[1..split.len() - 1].windows(2).any(|w| w[0] != w[1]) =>
        {
            Err(Error::field(
                "parallel.layers_per_stage",
                format!("{split:?}"),
                "Megatron sets the first and the last stage's layers \
                 (num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage) and \
                 splits the rest evenly: give every middle stage the same count",
            ))
        }
        _ => Ok(()),
    }
}

/// Megatron's interleaved schedule (`vpp` chunks per rank, the micro-batch group `pp`): every
/// chunk holds `num_layers / (pp × vpp)` layers (`get_num_layers_to_build` asserts the split),
/// and the micro-batches come in whole groups of `pp` (the schedule refuses a last group
/// smaller than `pp`).
fn check_interleaved(pipeline: &PipelineParallel, layers: u64) -> Result<()> {
    let (pp, vpp) = (pipeline.pp, pipeline.vpp);
    if pipeline.layers_per_stage.is_some() {
        return Err(Error::Unsupported {
            what: "parallel.layers_per_stage with framework megatron and vpp > 1".into(),
            supported: "an even split of the layers over the pp × vpp virtual stages".into(),
        });
    }
    if !layers.is_multiple_of(pp * vpp) {
        return Err(Error::field(
            "parallel.vpp",
            vpp,
            format!(
                "Megatron splits the model's {layers} decoder layers evenly over pp × vpp = {} \
                 model chunks: use a pp and vpp whose product divides them",
                pp * vpp
            ),
        ));
    }
    if !pipeline.microbatches.is_multiple_of(pp) {
        return Err(Error::field(
            "parallel.microbatches",
            pipeline.microbatches,
            format!(
                "Megatron's interleaved schedule runs the micro-batches in groups of pp = {pp}: \
                 use a multiple of {pp}"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pipeline(pp: u64, schedule: PipelineSchedule, split: Option<Vec<u64>>) -> PipelineParallel {
        PipelineParallel {
            pp,
            vpp: if schedule == PipelineSchedule::Interleaved1F1B {
                2
            } else {
                1
            },
            microbatches: pp,
            schedule,
            layers_per_stage: split,
        }
    }

    #[test]
    fn an_even_split_needs_pp_to_divide_the_layers() {
        assert!(check(&pipeline(4, PipelineSchedule::OneFOneB, None), 8).is_ok());
        let err = check(&pipeline(3, PipelineSchedule::OneFOneB, None), 8).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("parallel.pp") && text.contains('3') && text.contains("divides"),
            "{text}"
        );
    }

    #[test]
    fn an_uneven_split_keeps_the_middle_stages_equal() {
        let ok = pipeline(4, PipelineSchedule::OneFOneB, Some(vec![1, 3, 3, 2]));
        assert!(check(&ok, 9).is_ok());
        let two = pipeline(2, PipelineSchedule::OneFOneB, Some(vec![3, 5]));
        assert!(check(&two, 8).is_ok());
        let bad = pipeline(4, PipelineSchedule::OneFOneB, Some(vec![2, 3, 2, 2]));
        let text = check(&bad, 9).unwrap_err().to_string();
        assert!(
            text.contains("parallel.layers_per_stage") && text.contains("[2, 3, 2, 2]"),
            "{text}"
        );
    }

    #[test]
    fn gpipe_is_refused_by_name() {
        let text = check(&pipeline(2, PipelineSchedule::GPipe, None), 8)
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("gpipe") && text.contains("interleaved-1f1b"),
            "{text}"
        );
    }

    #[test]
    fn the_interleaved_schedule_needs_even_chunks_and_whole_groups() {
        let ok = pipeline(2, PipelineSchedule::Interleaved1F1B, None);
        assert!(check(&ok, 8).is_ok());
        let text = check(&ok, 6).unwrap_err().to_string();
        assert!(
            text.contains("parallel.vpp") && text.contains("pp × vpp = 4"),
            "{text}"
        );
        let odd = PipelineParallel {
            microbatches: 3,
            ..pipeline(2, PipelineSchedule::Interleaved1F1B, None)
        };
        let text = check(&odd, 8).unwrap_err().to_string();
        assert!(
            text.contains("parallel.microbatches") && text.contains('3'),
            "{text}"
        );
        let split = pipeline(2, PipelineSchedule::Interleaved1F1B, Some(vec![2, 2, 2, 2]));
        let text = check(&split, 8).unwrap_err().to_string();
        assert!(text.contains("layers_per_stage"), "{text}");
    }
}
