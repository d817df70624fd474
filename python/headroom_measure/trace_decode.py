"""Generation's decode steps under the tracer, one decoder layer run per token.

A decode step runs every decoder layer on the same shapes: one new token's hidden states, a
KV cache of the same length in each layer (`DynamicLayer`, extended by `torch.cat`). Identical
layers on identical shapes ask the allocator for the same storages in the same order, so the
tracer runs the first layer of each decode step for real and records what it allocated and freed;
each following layer of that step, when it is built the same (its modules, their settings and
parameters), is written from that record instead of run under fake tensors: the same events,
its own storages (module names moved to that layer), its old keys and values freed where the
first layer's were, and its outputs (hidden states, the extended keys and values) made as
fresh tensors of the recorded shapes, freed when the real ones would be. Anything else a
layer's call leaves behind or frees, and any layer that differs, runs for real.

This turns the per-token cost of a generation from every layer to one; the recorded trace is
byte for byte the one the full run writes (`python/tests/test_trace_decode.py`).
"""

from __future__ import annotations

import weakref

# The events a decode layer may leave, besides its allocations and frees.
_MARKERS = {"gemm", "reduce"}


class _Record:
    """What the first decoder layer of one decode step did: its events, its storages, what it
    returned, and the scalar reads it made."""

    def __init__(self, key, prefix, ops, storages, outputs, scalar_reads):
        self.key = key
        self.prefix = prefix
        self.ops = ops  # ("alloc", i) | ("free", i) | ("free_old", "keys"/"values") | ("marker", event)
        self.storages = storages  # the i-th allocation's storage entry
        self.outputs = outputs  # {"hidden"/"keys"/"values": (i, shape, stride, dtype)}
        self.scalar_reads = scalar_reads


class DecodeLayerReplay:
    """Patches `GradientCheckpointingLayer.__call__` (every transformers decoder layer) for the
    length of a trace: a decode-step call of a layer whose twin, the step's first layer, was just
    recorded is replayed from that record (module docstring)."""

    def __init__(self, rec):
        self.rec = rec
        self.record: _Record | None = None
        self._signatures: dict[int, tuple] = {}
        self.replayed = 0

    def __enter__(self):
        from transformers import modeling_layers

        self._real = real = modeling_layers.GradientCheckpointingLayer.__call__
        replay = self

        def call(layer, *args, **kwargs):
            return replay._call(real, layer, args, kwargs)

        modeling_layers.GradientCheckpointingLayer.__call__ = call
        return self

    def __exit__(self, *exc):
        from transformers import modeling_layers

        modeling_layers.GradientCheckpointingLayer.__call__ = self._real
        self.record = None
        return False

    # -- a layer call -------------------------------------------------------------------------

    def _call(self, real, layer, args, kwargs):
        site = self._decode_site(layer, args, kwargs)
        if site is None:
            return real(layer, *args, **kwargs)
        index, cache_layer, key = site
        record = self.record
        if index > 0 and record is not None and record.key == key and self._old_live(cache_layer):
            return self._replay(layer, cache_layer, record)
        self.record = None
        if index != 0:
            return real(layer, *args, **kwargs)
        return self._record(real, layer, args, kwargs, cache_layer, key)

    def _decode_site(self, layer, args, kwargs):
        """(layer index, its cache layer, the call's key) for a layer extending a `DynamicLayer`
        cache without autograd; None for any other call. Two calls with one key run the same code
        on the same shapes and the same other arguments."""
        import torch
        from transformers.cache_utils import DynamicCache, DynamicLayer

        if torch.is_grad_enabled() or (layer.gradient_checkpointing and layer.training):
            return None
        cache = kwargs.get("past_key_values")
        index = getattr(getattr(layer, "self_attn", None), "layer_idx", None)
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(cache, DynamicCache) or not isinstance(index, int) or not isinstance(hidden, torch.Tensor):
            return None
        if index >= len(cache.layers) or type(cache.layers[index]) is not DynamicLayer:
            return None
        cache_layer = cache.layers[index]
        if not cache_layer.is_initialized or cache_layer.keys.numel() == 0 or len(args) > 1:
            return None
        others = tuple(
            (name, tuple(id(v) for v in value) if isinstance(value, tuple) else id(value))
            for name, value in sorted(kwargs.items())
            if name != "hidden_states"
        )
        key = (
            self._signature(layer), id(cache), others,
            _meta(hidden), _meta(cache_layer.keys), _meta(cache_layer.values),
        )  # fmt: skip
        return index, cache_layer, key

    def _old_live(self, cache_layer) -> bool:
        keys, values = self.rec._id_of(cache_layer.keys), self.rec._id_of(cache_layer.values)
        return keys is not None and values is not None and keys != values

    def _signature(self, layer) -> tuple:
        """The layer's build: each module's type and plain settings, each parameter's shape,
        dtype and trainability, each hook; the layer index and names left out."""
        cached = self._signatures.get(id(layer))
        if cached is not None and cached[0]() is layer:
            return cached[1]
        modules = []
        for name, module in layer.named_modules():
            settings = tuple(
                sorted(
                    (k, v)
                    for k, v in vars(module).items()
                    if isinstance(v, (bool, int, float, str, type(None))) and k not in ("layer_idx", "_headroom_name")
                )
            )
            hooks = tuple(
                len(getattr(module, h)) for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks")
            )
            modules.append((name, type(module), settings, hooks))
        params = tuple(
            (name, tuple(p.shape), p.dtype, p.requires_grad, p.device) for name, p in layer.named_parameters()
        )
        signature = (tuple(modules), params)
        self._signatures[id(layer)] = (weakref.ref(layer), signature)
        return signature

    # -- the first layer, recorded ------------------------------------------------------------

    def _record(self, real, layer, args, kwargs, cache_layer, key):
        rec = self.rec
        old = {"keys": rec._id_of(cache_layer.keys), "values": rec._id_of(cache_layer.values)}
        first_event, first_storage, reads = len(rec.events), len(rec.storages), rec.scalar_reads
        out = real(layer, *args, **kwargs)
        prefix = getattr(layer, "_headroom_name", None)
        if None in old.values() or old["keys"] == old["values"] or prefix is None:
            return out
        outputs = {"hidden": out, "keys": cache_layer.keys, "values": cache_layer.values}
        ops, allocated, freed = [], set(), set()
        old_names = {sid: name for name, sid in old.items()}
        for event in rec.events[first_event:]:
            kind = event[0]
            if kind == "alloc":
                ops.append(("alloc", event[1] - first_storage))
                allocated.add(event[1])
            elif kind == "free" and event[1] in allocated:
                ops.append(("free", event[1] - first_storage))
                freed.add(event[1])
            elif kind == "free" and event[1] in old_names:
                ops.append(("free_old", old_names.pop(event[1])))
            elif kind in _MARKERS:
                ops.append(("marker", list(event)))
            else:
                return out
        survivors = allocated - freed
        made = {}
        for name, t in outputs.items():
            sid = rec._id_of(t)
            if (
                type(t) is not type(args[0] if args else kwargs["hidden_states"])
                or sid not in survivors
                or t.storage_offset() != 0
                or t.untyped_storage().nbytes() != rec.storages[sid]["bytes"]
            ):
                return out
            made[name] = (sid - first_storage, tuple(t.shape), tuple(t.stride()), t.dtype)
        if old_names or len({m[0] for m in made.values()}) != 3 or survivors != {m[0] + first_storage for m in made.values()}:
            return out
        storages = []
        for entry in rec.storages[first_storage:]:
            entry = {k: v for k, v in entry.items() if k != "first_event"}
            entry["module"] = _relative(entry["module"], prefix)
            storages.append(entry)
        self.record = _Record(key, prefix, ops, storages, made, rec.scalar_reads - reads)
        return out

    # -- a following layer, replayed ---------------------------------------------------------

    def _replay(self, layer, cache_layer, record: _Record):
        import torch
        from torch.utils._python_dispatch import _disable_current_modes

        rec = self.rec
        prefix = layer._headroom_name
        old = {"keys": cache_layer.keys, "values": cache_layer.values}
        first_storage = len(rec.storages)
        for op in record.ops:
            if op[0] == "alloc":
                entry = dict(record.storages[op[1]])
                entry["module"] = _absolute(entry["module"], prefix)
                entry["first_event"] = len(rec.events)
                rec.storages.append(entry)
                rec.events.append(["alloc", first_storage + op[1]])
            elif op[0] == "free":
                rec.events.append(["free", first_storage + op[1]])
            elif op[0] == "free_old":
                storage_key = old[op[1]].untyped_storage()._cdata
                rec.events.append(["free", rec.live.pop(storage_key)])
            else:
                rec.events.append(list(op[1]))
        rec.scalar_reads += record.scalar_reads
        fake_mode = old["keys"].fake_mode
        made = {}
        with _disable_current_modes(), fake_mode:
            for name, (index, shape, stride, dtype) in record.outputs.items():
                t = torch.empty_strided(shape, stride, dtype=dtype, device=old["keys"].device)
                rec.adopt(t.untyped_storage(), first_storage + index)
                made[name] = t
        cache_layer.keys, cache_layer.values = made["keys"], made["values"]
        self.replayed += 1
        return made["hidden"]


def _meta(t) -> tuple:
    """What a tensor argument's allocations depend on with autograd off (`requires_grad` builds
    no graph then: the first layer's input, the embedding's output, asks for gradients under
    gradient checkpointing, the others do not)."""
    return (type(t), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def _relative(module: str, prefix: str) -> tuple:
    if module == prefix or module.startswith(prefix + "."):
        return (True, module[len(prefix) :])
    return (False, module)


def _absolute(module: tuple, prefix: str) -> str:
    inside, name = module
    return prefix + name if inside else name
