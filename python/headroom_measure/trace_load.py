"""`from_pretrained` onto the GPU under the tracer: transformers 5's loader, with a checkpoint of
names and shapes where the GPU run reads bytes.

A checkpoint of fake tensors has no bytes to read, so the model is built on `meta` and loaded as
transformers' loader does it, with its own pieces: `caching_allocator_warmup`'s one allocation of
`get_total_byte_count` bytes (recorded as the `caching_allocator_warmup` event: what it
subtracts depends on what the allocator holds unused then, which only the replay knows), each
checkpoint tensor in `dot_natural_key` order copied to the device (and converted there, where the
caller says how) and put on its module by `set_param_for_module`, the non-persistent buffers
(rotary frequencies) brought to the device last, and the weights tied, as
`_finalize_model_loading` does.
"""

from __future__ import annotations


def checkpoint_of(model):
    """The names, shapes and dtypes `save_pretrained` writes for `model`: its state dict less the
    tied weights."""
    tied = set(model.all_tied_weights_keys)
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items() if name not in tied}


def load_on_device(rec, model, checkpoint, quantizer=None, convert=None):
    """Loads `checkpoint` (`checkpoint_of`'s form) into the meta-built `model` on the tracer's
    device, recorded by `rec`; `convert(name, value)` turns a copied tensor into what the module
    holds (a quantized weight), `quantizer` is the loader's `HfQuantizer` where there is one."""
    import torch
    from transformers.core_model_loading import dot_natural_key, set_param_for_module
    from transformers.modeling_utils import expand_device_map, get_total_byte_count
    from transformers.utils.loading_report import LoadStateDictInfo

    expanded = expand_device_map({"": 0}, list(model.state_dict().keys()))
    byte_count = get_total_byte_count(model, {k: torch.device("cuda", 0) for k in expanded}, quantizer)
    rec.caching_allocator_warmup(int(sum(byte_count.values())))

    info = LoadStateDictInfo(
        missing_keys=set(), error_msgs=[], unexpected_keys=set(), mismatched_keys=set(), conversion_errors={},
        skipped_pp_keys=set(),
    )  # fmt: skip
    for name in sorted(checkpoint, key=dot_natural_key):
        shape, dtype = checkpoint[name]
        value = torch.empty(shape, dtype=dtype)  # the device copy of the host tensor
        if convert is not None:
            value = convert(name, value)
        set_param_for_module(model, name, value, info, quantizer)
        del value
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device.type == "meta":
                module._buffers[name] = torch.empty_like(buffer, device="cpu")
    model.tie_weights()
    return model
