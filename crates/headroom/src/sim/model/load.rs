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
/// (4-bit weights at half a byte) less what the allocator holds unused, freed at once, so that
/// loading carves from one segment.
fn warm_up(t: &mut Tracer, checkpoint: &[CheckpointTensor]) {
    let mut bytes: u64 = checkpoint
        .iter()
        .map(|c| match c.quantized {
            Some(n) => n / 2,
            None => t.bytes(t.param(c.param)),
        })
        .sum();
    let stats = t.mem.allocator.stats();
    let unused =
        (stats.reserved_bytes.all.current - stats.allocated_bytes.all.current).max(0) as u64;
    if bytes.saturating_sub(unused) > unused {
        bytes -= unused;
    }
    let warmup = t.empty_as(
        bytes / 2,
        DType::F16,
        Component::Weights,
        "caching_allocator_warmup",
    );
    t.drop(warmup);
}
