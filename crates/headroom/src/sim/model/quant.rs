//! QLoRA's base model: what `from_pretrained(..., quantization_config=BitsAndBytesConfig(
//! load_in_4bit, nf4, double quantization, bf16 compute))` does to each linear weight as it
//! arrives, and peft's `prepare_model_for_kbit_training`.

use super::transformer::CheckpointTensor;
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{ParamId, Tracer};

/// `Params4bit._quantize` → `quantize_4bit(nf4, blocksize 64, compress_statistics)`: the bf16
/// weight arrives, fp32 absmax per block of 64, the packed weight (the parameter), the nf4 code,
/// then the absmax itself quantised to 8 bits in blocks of 256 (double quantisation) with its
/// own fp32 absmax and code.
pub(crate) fn quantize(t: &mut Tracer, tensor: &CheckpointTensor, n: u64, dynamic_map: &mut bool) {
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
