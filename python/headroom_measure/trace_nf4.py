"""`quantization: nf4` under the tracer: `measure._build`'s QLoRA model as it is made on the GPU.

The harness builds the random model in bf16 on the device, saves it, deletes it and empties the
cache, then loads it back with `from_pretrained(quantization_config=nf4, device_map={"": 0})`. A
checkpoint of fake tensors has no bytes to save, so the tracer builds and frees the bf16 model as
the harness does, keeps the names and shapes its checkpoint would hold, and loads them as
transformers 5's loader does, with transformers' own pieces: the meta model with its linears
replaced by `Linear4bit` (`Bnb4BitHfQuantizer.preprocess_model`), `caching_allocator_warmup`'s
one allocation of `get_total_byte_count` bytes (the cache emptied, the warm-up subtracts what is
reserved but unused: on the GPU the 2 MiB segment of the harness's first `torch.zeros(1)`, which
no trace records, so here nothing), then each checkpoint tensor in `dot_natural_key` order copied to the device in bf16 and,
for a 4-bit weight, quantized there by `Bnb4bitQuantize` (bitsandbytes' `Params4bit._quantize`,
`bitsandbytes_emulation.py`) before the copy dies; `set_param_for_module` puts each on its module.
The non-persistent buffers (rotary frequencies) come to the device last, the weights are tied and
`postprocess_model` marks the model loaded in 4 bits, as `_finalize_model_loading` does.

peft's `prepare_model_for_kbit_training` empties the CUDA cache after its fp32 casts where CUDA is
available, which the CPU it runs on is not: the tracer records that `empty_cache` (`prepared`).
"""

from __future__ import annotations

import gc


def nf4_config():
    """The harness's `BitsAndBytesConfig` (`measure._build`)."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def build_nf4(rec, spec, cfg):
    """The nf4 model `measure._build` makes, made on the tracer's fake device and recorded by `rec`."""
    import torch
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import dot_natural_key, set_param_for_module
    from transformers.integrations.bitsandbytes import Bnb4bitQuantize
    from transformers.modeling_utils import expand_device_map, get_total_byte_count
    from transformers.quantizers import AutoHfQuantizer
    from transformers.utils.loading_report import LoadStateDictInfo

    from . import measure as m
    from .trace import TraceError

    if get_checkpoint_conversion_mapping(cfg.model_type) is not None:
        raise TraceError(
            f"`quantization: nf4` of a {cfg.model_type} model: transformers saves its checkpoint under other names "
            "than its parameters' (unfused experts, renamed modules) and converts them while loading, which the "
            "tracer's load does not run; nf4 is traced for model types loaded by name (llama, mistral, qwen2, "
            "qwen3, gemma, phi3, ...), and `headroom estimate` models 4-bit runs natively"
        )
    cls = m._auto_class(spec)
    dtype = m.dtype_kwarg(torch.bfloat16)
    source = cls.from_config(cfg, **dtype, attn_implementation=spec.attention)
    tied = set(source.all_tied_weights_keys)
    checkpoint = {name: tuple(t.shape) for name, t in source.state_dict().items() if name not in tied}
    del source
    gc.collect()
    rec.empty_cache()

    quantizer = AutoHfQuantizer.from_config(nf4_config(), pre_quantized=False)
    with torch.device("meta"):
        model = cls.from_config(cfg, **dtype, attn_implementation=spec.attention, **m._experts_kwargs(spec))
    device_map = {"": 0}
    quantizer.preprocess_model(model, device_map=device_map, dtype=torch.bfloat16)
    expanded = expand_device_map(device_map, list(model.state_dict().keys()))
    byte_count = get_total_byte_count(model, {k: torch.device("cuda", 0) for k in expanded}, quantizer)
    warmup = torch.empty(int(sum(byte_count.values()) // 2), dtype=torch.float16)
    del warmup

    info = LoadStateDictInfo(
        missing_keys=set(), error_msgs=[], unexpected_keys=set(), mismatched_keys=set(), conversion_errors={},
        skipped_pp_keys=set(),
    )  # fmt: skip
    quantize = Bnb4bitQuantize(quantizer)
    for name in sorted(checkpoint, key=dot_natural_key):
        value = torch.empty(checkpoint[name], dtype=torch.bfloat16)  # the device copy of the host tensor
        if quantizer.param_needs_quantization(model, name):
            value = quantize.convert({name: [value]}, full_layer_name=name, model=model)[name]
        set_param_for_module(model, name, value, info, quantizer)
        del value
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device.type == "meta":
                module._buffers[name] = torch.empty_like(buffer, device="cpu")
    model.tie_weights()
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer
    return model


def quant_states(model):
    """The tensors of each 4-bit weight's `QuantState` (absmax, code, offset, and the nested
    absmax and code of double quantization): the weight's own bytes beside its packed data."""
    from bitsandbytes.nn import Params4bit

    for p in model.parameters():
        state = getattr(p, "quant_state", None) if isinstance(p, Params4bit) else None
        while state is not None:
            yield from (t for t in (state.absmax, state.code, state.offset) if t is not None)
            state = state.state2


def prepared(rec, spec, model):
    """`measure._prepare` of the nf4 model, with the `empty_cache` peft's k-bit preparation makes."""
    import peft

    from . import measure as m

    real = peft.prepare_model_for_kbit_training

    def prepare_model_for_kbit_training(model, *args, **kwargs):
        model = real(model, *args, **kwargs)
        rec.empty_cache()
        return model

    peft.prepare_model_for_kbit_training = prepare_model_for_kbit_training
    try:
        return m._prepare(spec, model)
    finally:
        peft.prepare_model_for_kbit_training = real
