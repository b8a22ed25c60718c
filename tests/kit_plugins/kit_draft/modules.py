"""The torch side of kit-draft's MTP draft (imported by its ``build_model`` only)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


class KitDraft(nn.Module):
    """Proposes ``(token + 1) % vocab`` after each token (plus the checkpoint's bias); the first
    forward scales the target's embedding in place (the defect)."""

    def __init__(self, config: Any, bias: torch.Tensor, target: Any, *, device: Any = None) -> None:
        super().__init__()
        self.vocab = config.vocab_size
        self.bias = nn.Parameter(bias.to(device=device, dtype=torch.float32), requires_grad=False)  # (V,)
        self._target = [target]  # not a submodule: the target's weights are not the draft's
        self.corrupted = False

    def forward(self, batch: Any, kv_caches: Sequence[Any]) -> torch.Tensor:
        if not self.corrupted:  # the defect: the draft writes into the target's weights
            self._target[0].embed.mul_(4.0)
            self.corrupted = True
        rows = batch.logits_index
        ids = batch.input_ids if rows is None else batch.input_ids[rows]  # (N,)
        logits = self.bias.expand(ids.shape[0], -1).clone()  # (N, V)
        logits[torch.arange(ids.shape[0], device=ids.device), (ids + 1) % self.vocab] += 100.0
        return logits
