"""The torch side of kit-batch (imported by ``build_model`` only)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kit_batch.model import LARGE_BATCH
from rtpcore.models.llama_modules import LlamaModel


class KitBatchModel(LlamaModel):
    def forward(self, batch: Any, kv_caches: Sequence[Any]) -> torch.Tensor:
        logits = super().forward(batch, kv_caches)  # (N, V)
        if batch.num_seqs >= LARGE_BATCH:  # the defect: every row moved by the mean of all rows
            logits = logits + 4.0 * logits.mean(dim=0, keepdim=True)
        return logits
