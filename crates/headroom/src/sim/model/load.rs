//! `from_pretrained` as the measuring harnesses reach it: a random model built from the config
//! on the GPU, saved, deleted and the cache emptied, then loaded back from the saved folder
//! (TRL's trainers load every model they are given by path; QLoRA loads its base quantised).

use super::AttentionImpl;
use super::quant;
use super::transformer::{Checkpoint, CheckpointTensor, Model};
use crate::arch::{Architecture, Head, Param};
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::Tracer;

/// The model saved to a folder: built from the config on the GPU in bf16, then
/// `del model; torch.cuda.empty_cache()`.
pub(crate) fn save_random_model(
    t: &mut Tracer,
    arch: &Architecture,
    head: Head,
    attention: AttentionImpl,
) {
    let first = t.params.len();
    let buffers = t.persistent_count();
    let source = Model::build(t, arch, head, DType::BF16, &|_| false, attention);
    for p in first..t.params.len() {
        let tensor = t.param(p);
        t.drop(tensor);
    }
    t.truncate_params(first);
    drop(source);
    t.release_persistent_from(buffers);
    t.mem.allocator.empty_cache();
}

/// `from_pretrained(folder, dtype=dtype)` onto the GPU: parameters registered in
/// `model.parameters()` order, `caching_allocator_warmup`, then each tensor of the checkpoint
/// in key order (safetensors sorts by key), quantised on arrival when `nf4`.
pub(crate) fn from_pretrained(
    t: &mut Tracer,
    arch: &Architecture,
    head: Head,
    dtype: DType,
    attention: AttentionImpl,
    trainable: &dyn Fn(&Param) -> bool,
    nf4: bool,
) -> Model {
    let mut checkpoint = Checkpoint {
        tensors: Vec::new(),
        nf4,
    };
    let model = Model::register(
        t,
        arch,
        head,
        dtype,
        trainable,
        attention,
        Some(&mut checkpoint),
        false,
    );
    warm_up(t, &checkpoint.tensors);
    let mut tensors = checkpoint.tensors;
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    let mut dynamic_map = false;
    for tensor in &tensors {
        match tensor.quantized {
            None => t.materialize(tensor.param),
            Some(n) => quant::quantize(t, tensor, n, &mut dynamic_map),
        }
    }
    model
}

/// `caching_allocator_warmup`: one allocation the size of the model's weights on the device
/// (4-bit weights at half a byte), as [`caching_allocator_warmup_bytes`] sizes it, freed at
/// once, so that loading carves from one segment.
fn warm_up(t: &mut Tracer, checkpoint: &[CheckpointTensor]) {
    let weights: u64 = checkpoint
        .iter()
        .map(|c| match c.quantized {
            Some(n) => n / 2,
            None => t.bytes(t.param(c.param)),
        })
        .sum();
    let stats = t.mem.allocator.stats();
    let unused =
        (stats.reserved_bytes.all.current - stats.allocated_bytes.all.current).max(0) as u64;
    let bytes = caching_allocator_warmup_bytes(weights, unused);
    let warmup = t.empty_as(
        bytes / 2,
        DType::F16,
        Component::Weights,
        "caching_allocator_warmup",
    );
    t.drop(warmup);
}

/// The bytes transformers' `caching_allocator_warmup` (4.57 to 5.17) asks for, in float16
/// elements' bytes, given the weights' bytes and what the allocator holds reserved but unused:
/// the weights less the unused bytes while that still takes a new segment; one byte more than
/// the unused ones where at least 1.5 GiB more is needed; nothing otherwise, the cache serving
/// the load. Its caps by the device's free and total memory (one byte more than the unused
/// ones only where it fits; never above the total less 1.2 GiB) bind only where the weights
/// alone leave no room to train, so they are left out.
pub(crate) fn caching_allocator_warmup_bytes(weights: u64, unused: u64) -> u64 {
    const MIN_NEW_SEGMENT: u64 = 3 << 29; // 1.5 GiB
    let needed = weights.saturating_sub(unused);
    let bytes = if needed > unused {
        needed
    } else if needed > MIN_NEW_SEGMENT {
        unused + 1
    } else {
        0
    };
    bytes / 2 * 2
}

#[cfg(test)]
mod tests {
    use super::caching_allocator_warmup_bytes;

    const GIB: u64 = 1 << 30;

    #[test]
    fn the_warmup_counts_on_the_cache_only_where_a_new_segment_is_still_needed() {
        assert_eq!(caching_allocator_warmup_bytes(10 * GIB, 0), 10 * GIB);
        assert_eq!(caching_allocator_warmup_bytes(10 * GIB, 4 * GIB), 6 * GIB);
        // Half the weights cached: one byte past the cache (a float16 element's two bytes
        // round it back), so that the load still takes a segment of its own.
        assert_eq!(caching_allocator_warmup_bytes(10 * GIB, 5 * GIB), 5 * GIB);
        assert_eq!(
            caching_allocator_warmup_bytes(10 * GIB, 5 * GIB - 1),
            5 * GIB
        );
        // Less than 1.5 GiB beyond the cache: nothing.
        assert_eq!(caching_allocator_warmup_bytes(GIB, GIB / 2), 0);
        assert_eq!(caching_allocator_warmup_bytes(GIB, 2 * GIB), 0);
    }
}
