//! What the modeling code of the transformers release an estimate follows does differently
//! from 5.17's, where it changes what a training step allocates (read in each release's source:
//! bench/transformers-older/README.md, bench/transformers-4.57/README.md).

use crate::arch::Family;
use crate::spec::{
    TRANSFORMERS_4_46, TRANSFORMERS_4_48, TRANSFORMERS_4_51, TRANSFORMERS_4_53, TRANSFORMERS_4_55,
    TRANSFORMERS_4_56, TRANSFORMERS_4_57, Version,
};

/// The release-dependent choices of the modeling code; all off is 5.17's code.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ReleaseCode {
    /// `masking_utils.create_causal_mask` (4.53 on, for the families that call it): its
    /// `find_packed_sequence_indices` always returns a tensor, which turns off
    /// `allow_is_causal_skip`, so SDPA gets a (b, 1, s, s) mask even without an
    /// `attention_mask`: K and V are repeated and each layer saves an additive bias (5.x returns
    /// `None` there). `position_ids` are a view of `cache_position`, alive until the forward
    /// returns.
    pub materialises_causal_mask: bool,
    /// `sdpa_attention_forward` (and 4.46-4.47's `*SdpaAttention` classes) call `repeat_kv`
    /// whatever the mask (before 4.54, which asks `use_gqa_in_sdpa` first).
    pub sdpa_repeats_kv: bool,
    /// `sdpa_attention_forward` calls `.contiguous()` on query, key and value (4.48 to 4.55):
    /// the query's copy is head-major, so is a fused kernel's output.
    pub sdpa_contiguous_inputs: bool,
    /// `ForCausalLMLoss` copies the shifted fp32 logits, `logits[..., :-1, :].contiguous()`,
    /// rather than shifting the labels (before 4.49): `heads::shifted_logits_loss`.
    pub shifts_logits: bool,
    /// GPT-2 computes its own loss (before 4.48): the same shifted copy without the upcast.
    pub gpt2_own_loss: bool,
}

impl ReleaseCode {
    /// The code of `followed` (a release `spec::Library::followed` returns) for a model of
    /// `family`; 5.17's for any other release.
    pub(crate) fn of(followed: Option<Version>, family: Family) -> ReleaseCode {
        let Some(release) = followed.filter(|v| v.major == 4) else {
            return ReleaseCode::default();
        };
        let is = |releases: &[Version]| releases.contains(&release);
        // OLMoE and Qwen2-MoE keep `_update_causal_mask` through 4.57; GPT-2 calls
        // `create_causal_mask` from 4.54.
        let calls_create_causal_mask = match family {
            Family::Olmoe | Family::Qwen2Moe => false,
            Family::Gpt2 => is(&[TRANSFORMERS_4_55, TRANSFORMERS_4_56, TRANSFORMERS_4_57]),
            _ => true,
        };
        ReleaseCode {
            materialises_causal_mask: calls_create_causal_mask
                && is(&[
                    TRANSFORMERS_4_53,
                    TRANSFORMERS_4_55,
                    TRANSFORMERS_4_56,
                    TRANSFORMERS_4_57,
                ]),
            sdpa_repeats_kv: is(&[
                TRANSFORMERS_4_46,
                TRANSFORMERS_4_48,
                TRANSFORMERS_4_51,
                TRANSFORMERS_4_53,
            ]),
            sdpa_contiguous_inputs: is(&[
                TRANSFORMERS_4_48,
                TRANSFORMERS_4_51,
                TRANSFORMERS_4_53,
                TRANSFORMERS_4_55,
            ]),
            shifts_logits: is(&[TRANSFORMERS_4_46, TRANSFORMERS_4_48]),
            gpt2_own_loss: family == Family::Gpt2 && release == TRANSFORMERS_4_46,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_release_range_has_the_code_its_source_has() {
        let of = |v| ReleaseCode::of(Some(v), Family::Llama);
        assert_eq!(ReleaseCode::of(None, Family::Llama), ReleaseCode::default());
        let r = of(TRANSFORMERS_4_46);
        assert!(r.shifts_logits && r.sdpa_repeats_kv && !r.sdpa_contiguous_inputs);
        let r = of(TRANSFORMERS_4_48);
        assert!(r.shifts_logits && r.sdpa_repeats_kv && r.sdpa_contiguous_inputs);
        assert!(!r.materialises_causal_mask);
        let r = of(TRANSFORMERS_4_53);
        assert!(r.materialises_causal_mask && r.sdpa_repeats_kv && r.sdpa_contiguous_inputs);
        assert!(!r.shifts_logits);
        let r = of(TRANSFORMERS_4_55);
        assert!(r.materialises_causal_mask && !r.sdpa_repeats_kv && r.sdpa_contiguous_inputs);
        assert_eq!(of(TRANSFORMERS_4_56), of(TRANSFORMERS_4_57));
        assert!(of(TRANSFORMERS_4_56).materialises_causal_mask);
        assert!(!of(TRANSFORMERS_4_56).sdpa_contiguous_inputs);
    }

    #[test]
    fn the_mask_and_the_loss_follow_each_family_s_own_code() {
        let gpt2 = |v| ReleaseCode::of(Some(v), Family::Gpt2);
        assert!(gpt2(TRANSFORMERS_4_46).gpt2_own_loss);
        assert!(!gpt2(TRANSFORMERS_4_48).gpt2_own_loss);
        assert!(gpt2(TRANSFORMERS_4_48).shifts_logits);
        assert!(!gpt2(TRANSFORMERS_4_53).materialises_causal_mask);
        assert!(gpt2(TRANSFORMERS_4_55).materialises_causal_mask);
        for family in [Family::Olmoe, Family::Qwen2Moe] {
            assert!(!ReleaseCode::of(Some(TRANSFORMERS_4_57), family).materialises_causal_mask);
        }
        assert!(!ReleaseCode::of(Some(TRANSFORMERS_4_46), Family::Llama).gpt2_own_loss);
    }
}
