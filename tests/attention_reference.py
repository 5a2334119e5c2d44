"""The reference for the attention statistics of the ``attn`` event (docs/trace-format.md), written for
clarity, head by head in float64, to hold every fast implementation to: the engine's torch passes
(``engine/model/attention.py``), its compiled kernel (``engine/kernels/attn_stats.c``) and the transformers
observer's pass (``kvdoctor/integrations/transformers_attention.py``).

For a row's newest query at one layer, over the keys it sees, head by head:
- a score that is not finite is counted; a NaN or +inf also breaks its head's softmax, so every
  probability of that head counts too (``nonfinite``);
- the other statistics are taken over the finite scores: the largest (``max_logit``, 0 for a head
  with none), the Shannon entropy of their softmax in nats, and its mass on the keys at positions
  below ``sink_tokens`` (the sequence's first block);
- ``max_logit`` is the largest over heads; ``entropy`` and ``sink`` are means over heads.
"""

from __future__ import annotations

import math

import torch

__all__ = ["newest_query_stats", "nonfinite_scores"]


def newest_query_stats(scores: torch.Tensor, visible: torch.Tensor | None, sink_tokens: int) -> torch.Tensor:
    """``(L, B, 4)`` float64 [max_logit, entropy, sink, nonfinite] from scaled scores ``(L, B, H, T)``
    and the keys each row's newest query sees, ``visible`` ``(B, T)`` bool (None: all)."""
    L, B, H, T = scores.shape
    out = torch.zeros(L, B, 4, dtype=torch.float64)
    for layer in range(L):
        for b in range(B):
            seen = torch.arange(T) if visible is None else visible[b].nonzero().flatten()
            maxes, entropies, sinks, nonfinite = [], [], [], 0
            for h in range(H):
                s = scores[layer, b, h, seen].double()
                finite = torch.isfinite(s)
                nonfinite += int((~finite).sum())
                if bool((torch.isnan(s) | (s == math.inf)).any()):
                    nonfinite += len(seen)
                if not bool(finite.any()):
                    maxes.append(0.0), entropies.append(0.0), sinks.append(0.0)
                    continue
                p = torch.softmax(s[finite], dim=0)
                maxes.append(float(s[finite].max()))
                entropies.append(float(-(p * p.log()).nan_to_num(0.0).sum()))
                sinks.append(float(p[seen[finite] < sink_tokens].sum()))
            out[layer, b] = torch.tensor([max(maxes), sum(entropies) / H, sum(sinks) / H, nonfinite])
    return out


def nonfinite_scores(scores: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """``(L, B)``: the scores alone that are not finite among the keys each row sees (the observer's count)."""
    bad = ~torch.isfinite(scores)
    if visible is not None:
        bad &= visible[None, :, None, :]
    return bad.sum(dim=(-1, -2))
