//! Megatron-core's pipeline parallelism (`parallel.pp` with `parallel.framework: megatron`): what
//! of `forward_backward_pipelining_without_interleaving` and `get_num_layers_to_build` a spec may
//! ask for. The layers split evenly over the stages (`num_layers % pp == 0`, as
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
    if pipeline.schedule != PipelineSchedule::OneFOneB {
        return Err(Error::Unsupported {
            what: format!(
                "parallel.schedule {} with framework megatron",
                pipeline.schedule.name()
            ),
            supported: "Megatron's non-interleaved 1F1B (schedule 1f1b, vpp 1: \
                        forward_backward_pipelining_without_interleaving); its interleaved \
                        schedule is not modelled yet"
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
    fn schedules_other_than_1f1b_are_refused_by_name() {
        for schedule in [PipelineSchedule::Interleaved1F1B, PipelineSchedule::GPipe] {
            let text = check(&pipeline(2, schedule, None), 8)
                .unwrap_err()
                .to_string();
            assert!(
                text.contains(schedule.name()) && text.contains("1f1b"),
                "{text}"
            );
        }
    }
}
