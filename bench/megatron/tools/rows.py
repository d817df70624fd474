"""What the Megatron spec writers (bench/megatron, bench/megatron-moe, bench/megatron-pp) share: the `megatron:`
block's recomputation keys with their id tag, and a fake-group row line."""


def recompute_keys(mega: dict, recompute) -> str:
    """Sets `recompute` ((granularity, method, layers) or None) in `mega`; returns its id tag."""
    if not recompute:
        return "norc"
    gran, method, n = recompute
    mega["recompute_granularity"] = gran
    if not method:
        return gran
    mega["recompute_method"], mega["recompute_num_layers"] = method, n
    return f"full-{method}{n}"


def line(rid: str, model: str, config: dict, layers: int, b: int, s: int, parallel: dict, mega: dict,
         snapshot: bool, **extra) -> dict:
    """A row of `model` (`config` cut to `layers`) at batch `b` of `s` tokens, run as a fake-group rank."""
    out = {
        "id": rid,
        "spec": {"model": model, "model_config": {**config, "num_hidden_layers": layers}, "precision": "bf16",
                 "optimizer": "adamw", "batch_size": b, "seq_len": s, "parallel": parallel, "megatron": mega},
        "fake": True,
        **extra,
    }
    if snapshot:
        out["snapshot"] = rid.replace("/", "-") + ".pickle"
    return out
