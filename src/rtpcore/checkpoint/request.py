"""What a model reads from a checkpoint, and which shards hold it.

A :class:`WeightRequest` is what a model's plugin asks of a checkpoint: its weight
patterns, their placeholder ranges and the checkpoint's fp8 block quantization (whose
``_scale_inv`` companions are read with the weights)::

    request = WeightRequest.for_model(Plugin, model_config, hf_config)
    selection, scaled = request.select(index.weight_map)   # exact names, scales included
    files_wanted(index, selection)                          # shard -> the wanted names in it

One rule serves both readers of a checkpoint: :func:`~rtpcore.checkpoint.load_checkpoint`
opens exactly the shards :func:`files_wanted` names, and a pruned Hub download
(:mod:`rtpcore.checkpoint.hub`) fetches exactly the shards :func:`shards_needed` names
for the same requests, so a load never needs a shard the download left out.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from attrs import field, frozen

from rtpcore.checkpoint.index import CheckpointIndex
from rtpcore.checkpoint.patterns import WeightSelection
from rtpcore.checkpoint.quantized import Fp8BlockQuantization
from rtpcore.errors import MissingTensorsError
from rtpcore.plugins.model_plugin import call_optional

__all__ = ["WeightRequest", "files_wanted", "shards_needed"]

_MISSING_SHOWN = 20


@frozen
class WeightRequest:
    """The arguments of one :func:`~rtpcore.checkpoint.load_checkpoint` call that decide
    which tensors it reads (slices, dtypes and shapes change how, not which)."""

    # A string stays one (WeightSelection refuses it, naming the rule); other iterables become tuples.
    patterns: Sequence[str] = field(converter=lambda p: p if isinstance(p, str) else tuple(p))
    ranges: Mapping[str, Iterable[int]] | None = None
    # A quantization method (rtpcore.quantization.QuantizationMethod) or an Fp8BlockQuantization:
    # what its select() adds to the load.
    quantization: Any = None

    @classmethod
    def for_model(cls, plugin: Any, model_config: Any, hf_config: Mapping[str, Any], quantization: Any = None,
                  ) -> WeightRequest:
        """What the model ``plugin`` builds from ``model_config`` reads from a checkpoint with
        this ``config.json``: the plugin's ``weight_patterns`` and ``placeholder_ranges``, and
        what ``quantization`` (the engine's quantization method) reads besides; None: the fp8
        block quantization config.json declares, if any (a bad one is a CheckpointError)."""
        return cls(
            plugin.weight_patterns(model_config),
            call_optional(plugin, "placeholder_ranges", model_config),
            Fp8BlockQuantization.from_hf(hf_config) if quantization is None else quantization,
        )

    def select(
        self, names: Collection[str], slices: Mapping[str, tuple[int, int, int]] | None = None
    ) -> tuple[WeightSelection, Any]:
        """The exact selection in a checkpoint holding ``names`` -- the quantized weights'
        scales included -- and the scaled tensors (None without quantization)."""
        selection = WeightSelection.from_patterns(self.patterns, self.ranges)
        if self.quantization is None:
            return selection, None
        scaled = self.quantization.select(selection, names, slices)
        if scaled is None:  # a method that reads nothing besides the weights
            return selection, None
        return scaled.selection, scaled


def _natural_key(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _missing_error(index: CheckpointIndex, missing: Sequence[str]) -> MissingTensorsError:
    shown = ", ".join(map(repr, missing[:_MISSING_SHOWN]))
    more = f" (and {len(missing) - _MISSING_SHOWN} more)" if len(missing) > _MISSING_SHOWN else ""
    where = index.index_path or index.root
    return MissingTensorsError(
        f"{len(missing)} required tensor(s) are in no file of checkpoint {str(where)!r}: {shown}{more}",
        missing=missing,
        path=where,
    )


def files_wanted(index: CheckpointIndex, selection: WeightSelection) -> dict[Path, list[str]]:
    """Shard -> the names in it ``selection`` wants, in the index's order; raises
    :class:`MissingTensorsError` for required names no shard holds."""
    wanted: dict[Path, list[str]] = {}
    for name, file in index.weight_map.items():
        if selection.wants(name):
            wanted.setdefault(file, []).append(name)
    missing = sorted(selection.required.difference(index.weight_map), key=_natural_key)
    if missing:
        raise _missing_error(index, missing)
    return wanted


def shards_needed(index: CheckpointIndex, requests: Iterable[WeightRequest]) -> list[Path]:
    """The shards of ``index`` that the loads of ``requests`` open, in the index's order."""
    needed: set[Path] = set()
    for request in requests:
        selection, _ = request.select(index.weight_map)
        needed.update(files_wanted(index, selection))
    return [f for f in index.files if f in needed]
