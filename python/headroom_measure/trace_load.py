"""`from_pretrained` onto the GPU under the tracer: transformers 5's loader, with a checkpoint of
names and shapes where the GPU run reads bytes.

A checkpoint of fake tensors has no bytes to read, so the model is built on `meta` and loaded as
transformers' loader does it, with its own pieces: `caching_allocator_warmup`'s one allocation of
`get_total_byte_count` bytes (recorded as the `caching_allocator_warmup` event: what it
subtracts depends on what the allocator holds unused then, which only the replay knows), each
checkpoint tensor in `dot_natural_key` order copied to the device (and converted there, where the
caller says how), renamed and fused by the model's conversion mapping (MoE experts saved apart) and
put on its module by `set_param_for_module`, the non-persistent buffers
(rotary frequencies) brought to the device last, and the weights tied, as
`_finalize_model_loading` does.
"""

from __future__ import annotations


def checkpoint_of(model):
    """The names, shapes and dtypes `save_pretrained` writes for `model`: its state dict less the
    tied weights, under the checkpoint's names where transformers converts them on load (each
    expert's weights apart, by `revert_weight_conversion` over the meta tensors)."""
    from transformers.core_model_loading import revert_weight_conversion

    tied = set(model.all_tied_weights_keys)
    state = {name: t for name, t in model.state_dict().items() if name not in tied}
    return {name: (tuple(t.shape), t.dtype) for name, t in revert_weight_conversion(model, state).items()}


def load_on_device(rec, model, checkpoint, quantizer=None, convert=None):
    """Loads `checkpoint` (`checkpoint_of`'s form) into the meta-built `model` on the tracer's
    device, recorded by `rec`; `convert(name, value)` turns a copied tensor into what the module
    holds (a quantized weight), `quantizer` is the loader's `HfQuantizer` where there is one.

    As `convert_and_load_state_dict_in_model` does, each checkpoint name is renamed by the model's
    conversion mapping and collected on its target's `WeightTransform`, and the targets are loaded in
    the order their first source comes. Its worker threads copy every tensor to the device in key
    order while the main thread converts each target once its sources are in (a fused expert
    tensor: `MergeModulelist`'s stack of each source, `Concatenate`'s cat, the copies freed after);
    here the main thread keeps up with the copies: a target is converted as soon as its last source
    is copied and every earlier target is loaded."""
    from concurrent.futures import Future
    from copy import deepcopy

    import torch
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter, WeightRenaming, dot_natural_key, rename_source_key, set_param_for_module,
    )  # fmt: skip
    from transformers.modeling_utils import expand_device_map, get_total_byte_count
    from transformers.utils.loading_report import LoadStateDictInfo

    expanded = expand_device_map({"": 0}, list(model.state_dict().keys()))
    byte_count = get_total_byte_count(model, {k: torch.device("cuda", 0) for k in expanded}, quantizer)
    rec.caching_allocator_warmup(int(sum(byte_count.values())))

    meta_state = model.state_dict()
    info = LoadStateDictInfo(
        missing_keys=set(meta_state), error_msgs=[], unexpected_keys=set(), mismatched_keys=set(),
        conversion_errors={}, skipped_pp_keys=set(),
    )  # fmt: skip
    mapping_list = get_model_conversion_mapping(model, None, quantizer)
    renamings = [t for t in mapping_list if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping_list if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}

    targets = {}  # first target name -> its WeightTransform, in load order
    copies = []  # (checkpoint name, the Future its copy fills, its target's first name), in key order
    for name in sorted(checkpoint, key=dot_natural_key):
        target, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, meta_state)
        if target not in meta_state and name in meta_state:
            target, pattern = rename_source_key(name, [], [], model.base_model_prefix, meta_state)
        if target not in meta_state:
            raise ValueError(f"checkpoint tensor {name} (renamed {target}) is no parameter of the model")
        if pattern is None:
            transform = targets.setdefault(target, WeightRenaming(name, target))
            pattern = name
        else:
            transform = targets.setdefault(target, deepcopy(by_pattern[pattern]))
        future = Future()
        transform.add_tensor(target, name, pattern, future)
        copies.append((name, future, target))

    pending = dict.fromkeys(targets, 0)
    for _, _, target in copies:
        pending[target] += 1
    order = iter(targets.items())
    head = next(order, None)
    for name, future, target in copies:
        shape, dtype = checkpoint[name]
        value = torch.empty(shape, dtype=dtype)  # the device copy of the host tensor
        if convert is not None:
            value = convert(name, value)
        future.set_result(value)
        del value
        pending[target] -= 1
        while head is not None and pending[head[0]] == 0:
            loaded = head[1].convert(head[0], model=model, config=model.config, loading_info=info)
            for param_name, param in loaded.items():
                param = param[0] if isinstance(param, list) else param
                set_param_for_module(model, param_name, param, info, quantizer)
            del loaded, param
            head = next(order, None)
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device.type == "meta":
                module._buffers[name] = torch.empty_like(buffer, device="cpu")
    model.tie_weights()
    return model
