//! QLoRA's base model: `from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit,
//! nf4, double quantization, bf16 compute))` and peft's `prepare_model_for_kbit_training`.

use super::AttentionImpl;
use super::transformer::{CheckpointTensor, Model};
use crate::arch::{Architecture, Head, Param};
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{ParamId, Tracer};

/// Load a 4-bit model the way the measuring harness does: a random bf16 model is built from the
/// config on the GPU, saved, deleted (`empty_cache`), then loaded back quantised.
pub(crate) fn load_nf4(
    t: &mut Tracer,
    arch: &Architecture,
    head: Head,
    attention: AttentionImpl,
    trainable: &dyn Fn(&Param) -> bool,
) -> Model {
    // The bf16 model `from_config` built, then `del model; torch.cuda.empty_cache()`.
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

    let mut checkpoint = Vec::new();
    let model = Model::register(
        t,
        arch,
        head,
        DType::BF16,
        trainable,
        attention,
        Some(&mut checkpoint),
        false,
    );
    warm_up(t, &checkpoint, arch, head);
    // safetensors stores tensors sorted by key; they are loaded (and quantised) in that order.
    checkpoint.sort_by(|a, b| a.name.cmp(&b.name));
    let mut dynamic_map = false;
    for tensor in &checkpoint {
        match tensor.quantized {
            None => t.materialize(tensor.param),
            Some(n) => quantize(t, tensor, n, &mut dynamic_map),
        }
    }
    model
}

/// `caching_allocator_warmup`: one allocation the size of the model's weights on the device
/// (4-bit weights at half a byte), freed at once, so that loading carves from one segment.
fn warm_up(t: &mut Tracer, checkpoint: &[CheckpointTensor], arch: &Architecture, head: Head) {
    let _ = (arch, head);
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

/// `Params4bit._quantize` → `quantize_4bit(nf4, blocksize 64, compress_statistics)`: the bf16
/// weight arrives, fp32 absmax per block of 64, the packed weight (the parameter), the nf4 code,
/// then the absmax itself quantised to 8 bits in blocks of 256 (double quantisation) with its
/// own fp32 absmax and code.
fn quantize(t: &mut Tracer, tensor: &CheckpointTensor, n: u64, dynamic_map: &mut bool) {
    let outer = std::mem::replace(&mut t.component, Component::Weights);
    let keep = |t: &mut Tracer, numel: u64, dtype: DType, label: &'static str| {
        let x = t.empty(numel, dtype, label);
        t.mark_persistent(x);
    };
    let blocks = n.div_ceil(64);
    let bf16 = t.empty(n, DType::BF16, "checkpoint weight (bf16)");
    let absmax = t.empty(blocks, DType::F32, "absmax (fp32)");
    t.materialize(tensor.param);
    let code = t.empty(16, DType::F32, "nf4 code");
    let code_copy = t.empty(16, DType::F32, "nf4 code (device copy)");
    let scalar = t.empty(1, DType::F32, "nf4 code: scalar");
    t.drop_all(&[code, scalar]);
    t.mark_persistent(code_copy);
    keep(t, 1, DType::F32, "absmax offset");
    let centred = t.empty(blocks, DType::F32, "absmax - offset");
    if !*dynamic_map {
        *dynamic_map = true;
        keep(t, 256, DType::F32, "dynamic quantisation map");
    }
    keep(t, blocks.div_ceil(256), DType::F32, "nested absmax");
    keep(t, blocks, DType::U8, "absmax (uint8)");
    keep(t, 256, DType::F32, "nested code");
    t.drop_all(&[absmax, centred, bf16]);
    t.component = outer;
}

/// `prepare_model_for_kbit_training`: freeze everything, cast every half-precision parameter
/// that is not 4-bit to fp32 (in `model.parameters()` order), then `torch.cuda.empty_cache()`.
pub(crate) fn prepare_kbit(t: &mut Tracer, params: std::ops::Range<ParamId>) {
    for p in params {
        t.set_trainable(p, false);
        let tensor = t.param(p);
        if t.dtype(tensor).is_half() {
            t.cast_parameter(p, DType::F32);
        }
    }
    t.mem.allocator.empty_cache();
}
