"""transformers' per-expert eager loop (`experts_implementation: eager`), traced over an assumed
routing.

The loop's shapes are the numbers of tokens the router sends each expert: values, which fake
tensors do not have (and which the measured runs' random routers did not record). The tracer
answers them as `headroom estimate` models the loop (`sim/model/moe.rs`, `tokens_per_expert`):
the batch's `tokens × top_k` (token, expert) pairs spread evenly over `min(experts, pairs)` hit
experts, the busiest given `routing.max_tokens_per_expert_factor` times its share. The loop asks
three things of the values: which experts were hit (`nonzero` of an `(experts,)` mask), whether a
hit expert's id is `num_experts` (never: the ids come from that `nonzero`), and which pairs each
hit expert received (`torch.where` of its `(top_k, tokens)` mask, in the order the experts are hit).
"""

from __future__ import annotations

import math

from .trace_trl import MaskAnswers


def tokens_per_expert(pairs: int, experts: int, factor: float = 1.0) -> list[int]:
    """The pairs each hit expert receives, the busiest first (as `tokens_per_expert` in Rust)."""
    hits = min(experts, pairs)
    even = pairs // hits
    busiest = min(max(math.floor(even * factor + 0.5), even), pairs)
    left = pairs - busiest
    out = [busiest]
    for j in range(1, hits):
        share = left // (hits - j)
        out.append(share)
        left -= share
    return out


class EvenRouting(MaskAnswers):
    """The eager loop's value-dependent shapes answered over the assumed routing of `tokens`
    tokens, each choosing `top_k` experts."""

    def __init__(self, tokens: int, top_k: int, factor: float = 1.0):
        super().__init__(self._count)
        self.pairs = tokens * top_k
        self.factor = factor
        self.queue: list[int] = []
        self.expert_ids: set[int] = set()  # storage ids of the hit experts' `nonzero`

    @classmethod
    def for_spec(cls, spec, fields: dict) -> EvenRouting:
        factor = (spec.routing or {}).get("max_tokens_per_expert_factor", 1.0)
        return cls(spec.batch_size * spec.seq_len, int(fields["num_experts_per_tok"]), float(factor))

    def _count(self, shape: tuple):
        if len(shape) == 1:  # the experts hit, once a layer: its experts' shares queue up
            self.queue = tokens_per_expert(self.pairs, shape[0], self.factor)
            return len(self.queue)
        if len(shape) == 2 and shape[0] * shape[1] == self.pairs and self.queue:
            return self.queue.pop(0)
        return None

    def dispatch(self, rec, func, args, kwargs):
        import torch

        aten = torch.ops.aten
        if func is aten.eq.Scalar and rec._id_of(args[0]) in self.expert_ids:
            return self._known(func(*args, **(kwargs or {})), False)
        out = super().dispatch(rec, func, args, kwargs)
        if func is aten.nonzero.default and args[0].dim() == 1:
            self.expert_ids.add(rec._id_of(out))
        return out
