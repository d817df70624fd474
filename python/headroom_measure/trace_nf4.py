"""`quantization: nf4` under the tracer: `measure._build`'s QLoRA model as it is made on the GPU.

The harness builds the random model in bf16 on the device, saves it, deletes it and empties the
cache, then loads it back with `from_pretrained(quantization_config=nf4, device_map={"": 0})`. A
checkpoint of fake tensors has no bytes to save, so the tracer builds and frees the bf16 model as
the harness does, keeps the names and shapes its checkpoint would hold, and loads them as
transformers 5's loader does (`trace_load.py`) into the meta model with its linears replaced by
`Linear4bit` (`Bnb4BitHfQuantizer.preprocess_model`): each checkpoint tensor copied to the device
in bf16 and, for a 4-bit weight, quantized there by `Bnb4bitQuantize` (bitsandbytes'
`Params4bit._quantize`, `bitsandbytes_emulation.py`) before the copy dies; `postprocess_model`
marks the model loaded in 4 bits. The warm-up subtracts what the allocator holds unused: on the
GPU the 2 MiB segment of the harness's first `torch.zeros(1)`, which no trace records.

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
    from transformers.integrations.bitsandbytes import Bnb4bitQuantize
    from transformers.quantizers import AutoHfQuantizer

    from . import measure as m
    from .trace import TraceError
    from .trace_load import checkpoint_of, load_on_device

    if get_checkpoint_conversion_mapping(cfg.model_type) is not None:
        raise TraceError(
            f"`quantization: nf4` of a {cfg.model_type} model: transformers converts its checkpoint while loading "
            "(unfused experts, renamed modules), under on-the-fly quantization without its worker threads, and no "
            "measured 4-bit run of such a model checks that load yet; nf4 is traced for model types loaded by name "
            "(llama, mistral, qwen2, qwen3, gemma, phi3, ...), and `headroom estimate` models 4-bit runs natively"
        )
    cls = m._auto_class(spec)
    dtype = m.dtype_kwarg(torch.bfloat16)
    source = cls.from_config(cfg, **dtype, attn_implementation=spec.attention)
    checkpoint = {name: (shape, torch.bfloat16) for name, (shape, _) in checkpoint_of(source).items()}
    del source
    gc.collect()
    rec.empty_cache()

    quantizer = AutoHfQuantizer.from_config(nf4_config(), pre_quantized=False)
    with torch.device("meta"):
        model = cls.from_config(cfg, **dtype, attn_implementation=spec.attention, **m._experts_kwargs(spec))
    quantizer.preprocess_model(model, device_map={"": 0}, dtype=torch.bfloat16)
    quantize = Bnb4bitQuantize(quantizer)

    def convert(name, value):
        if quantizer.param_needs_quantization(model, name):
            return quantize.convert({name: [value]}, full_layer_name=name, model=model)[name]
        return value

    load_on_device(rec, model, checkpoint, quantizer, convert)
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
