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


def layout_keys(world: int, lay: dict, mega: dict) -> tuple[dict, str]:
    """The `parallel` block of a Megatron row over `world` ranks and the id tag of layout `lay` ({tp, sp, pp, vpp,
    split, mb, overlap, ep, etp}); the pipeline's and the experts' Megatron keys go into `mega`."""
    parallel = {"strategy": "ddp", "world_size": world, "framework": "megatron"}
    tag = f"w{world}"
    if lay.get("tp", 1) > 1:
        parallel["tp"] = lay["tp"]
        tag += f"-tp{lay['tp']}"
        if lay.get("sp"):
            parallel["sequence_parallel"] = True
            tag += "-sp"
    if lay.get("pp", 1) > 1:
        parallel.update(pp=lay["pp"], microbatches=lay["mb"])
        tag += f"-pp{lay['pp']}"
        if lay.get("vpp", 1) > 1:
            parallel.update(vpp=lay["vpp"], schedule="interleaved-1f1b")
            tag += f"-vpp{lay['vpp']}"
        if "split" in lay:
            parallel["layers_per_stage"] = lay["split"]
            tag += "-split" + "-".join(map(str, lay["split"]))
        tag += f"-mb{lay['mb']}"
        if "overlap" in lay:
            mega["overlap_p2p_comm"] = lay["overlap"]
            tag += "-nooverlap" if not lay["overlap"] else "-overlap"
    if "ep" in lay:
        mega["expert_model_parallel_size"] = lay["ep"]
        tag += f"-ep{lay['ep']}"
    if "etp" in lay:
        mega["expert_tensor_parallel_size"] = lay["etp"]
        tag += f"-etp{lay['etp']}"
    return parallel, tag


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


# The dense models' real widths (`config.json`), by the short key the row ids use.
DENSE_MODELS = {
    "l8b": ("llama-3.1-8b", {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
            "rope_theta": 500000.0, "tie_word_embeddings": False}),
    "q7b": ("qwen2.5-7b", {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
            "num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 152064,
            "rope_theta": 1000000.0, "tie_word_embeddings": False}),
    "q3-8b": ("qwen3-8b", {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
              "rope_theta": 1000000.0, "tie_word_embeddings": False}),
}

# The MoE models' real widths, by the short key the row ids use.
MOE_MODELS = {
    "q30": ("qwen3-30b-a3b", {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
            "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
            "tie_word_embeddings": False}),
    "q235": ("qwen3-235b-a22b", {"model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
             "moe_intermediate_size": 1536, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
             "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
             "tie_word_embeddings": False}),
}

# Further models at their real widths, which the holdouts (bench/megatron-holdout, bench/parallel-holdout) use.
MORE_MODELS = {
    # Tied word embeddings (`tie_word_embeddings: true`): Megatron-LM shares them unless
    # `--untie-embeddings-and-output-weights`.
    "q3-4b": ("qwen3-4b", {"model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
              "rope_theta": 1000000.0, "tie_word_embeddings": True}),
    "l3b": ("llama-3.2-3b", {"model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192,
            "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
            "rope_theta": 500000.0, "tie_word_embeddings": True}),
    "l1b": ("llama-3.2-1b", {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
            "rope_theta": 500000.0, "tie_word_embeddings": True}),
    "q1.5b": ("qwen2.5-1.5b", {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
              "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 151936,
              "rope_theta": 1000000.0, "tie_word_embeddings": True}),
    "m7b": ("mistral-7b-v0.3", {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32768,
            "rope_theta": 1000000.0, "tie_word_embeddings": False}),
    "l70b": ("llama-3.1-70b", {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
             "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
             "rope_theta": 500000.0, "tie_word_embeddings": False}),
    "nemo": ("mistral-nemo-12b", {"model_type": "mistral", "hidden_size": 5120, "intermediate_size": 14336,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072,
             "rope_theta": 1000000.0, "tie_word_embeddings": False}),
    "mx7": ("mixtral-8x7b", {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 8,
            "num_experts_per_tok": 2, "vocab_size": 32000, "rope_theta": 1000000.0, "rms_norm_eps": 1e-05,
            "tie_word_embeddings": False}),
}
