"""Which local folders an engine reads: a checkpoint path as it is, or a Hugging Face Hub id
fetched into the Hub cache with only the shards the model's plugin declares
(:mod:`rtpcore.checkpoint.hub`); with ``gguf_file``, the path of that GGUF file in the folder
or fetched alone from the Hub id's repository. Runs once, in the process that builds the engine, before any
rank starts: every rank then reads local folders."""

from __future__ import annotations

import os
from typing import Any

from rtpcore.errors import RtpcoreError
from rtpcore.plugins.model_plugin import call_optional

__all__ = ["mtp_plugin", "resolve_checkpoints"]


def mtp_plugin(plugin: Any, model_type: str, model_config: Any, checkpoint: str) -> Any:
    """The target plugin's multi-token-prediction draft (``mtp_draft``), else an RtpcoreError."""
    draft_plugin = call_optional(plugin, "mtp_draft", model_config)
    if draft_plugin is None:
        raise RtpcoreError(
            f"draft_model='mtp': model type {model_type!r} ({plugin.__module__}.{plugin.__qualname__}) "
            f"offers no multi-token-prediction draft for {checkpoint!r}; pass a draft checkpoint instead"
        )
    return draft_plugin


def resolve_checkpoints(
    path: str | os.PathLike[str],
    draft_model: str | None,
    *,
    plan: Any,
    model_type: str | None = None,
    gguf_file: str | None = None,
) -> tuple[str, str | None]:
    """The local folders of an engine's checkpoint and draft (``"mtp"`` and None stay as
    they are). ``gguf_file`` names the checkpoint's GGUF file within the folder or Hub
    repository ``path`` (:func:`~rtpcore.checkpoint.hub.resolve_checkpoint`): its local path
    is returned, and nothing else of the repository is fetched. A Hub id (``org/name[@revision]``, :mod:`rtpcore.checkpoint.hub`) is fetched
    into the Hub cache with only the shards holding what the ranks will read: the plan's
    plugins are loaded, and each model's :class:`~rtpcore.checkpoint.request.WeightRequest` is
    the one each rank passes to the loader in ``rtpcore.engine.worker.rank``: the target's, its
    MTP draft's with ``draft_model="mtp"``, a draft checkpoint's. Anything else loads nothing."""
    from rtpcore.checkpoint.hub import hub_id, resolve_checkpoint
    from rtpcore.checkpoint.request import WeightRequest
    from rtpcore.plugins.loading import load_plugins

    draft_is_id = draft_model not in (None, "mtp") and hub_id(draft_model) is not None
    if hub_id(path) is None and not draft_is_id:
        return resolve_checkpoint(path, gguf_file=gguf_file), draft_model
    registry = load_plugins(plan)  # once per process: the ranks' EngineShard finds it loaded

    def method(hf: dict[str, Any]) -> Any:
        """The quantization method config.json names, as the ranks resolve it (None: the loader's
        own reading of config.json)."""
        q = hf.get("quantization_config")
        name = q.get("quant_method") if isinstance(q, dict) else None
        cls = registry.seam_class("quantization_methods", name) if isinstance(name, str) else None
        return None if cls is None else cls.from_config(q)

    def target(hf: dict[str, Any]) -> list[WeightRequest]:
        kind = model_type or registry.infer_model_type(hf)
        plugin = registry.get(kind)
        model_config = plugin.config_from_hf(hf)
        requests = [WeightRequest.for_model(plugin, model_config, hf, quantization=method(hf))]
        if draft_model == "mtp":
            mtp = mtp_plugin(plugin, kind, model_config, os.fspath(path))
            requests.append(WeightRequest.for_model(mtp, mtp.config_from_hf(hf), hf, quantization=method(hf)))
        return requests

    def draft(hf: dict[str, Any]) -> list[WeightRequest]:
        plugin = registry.get(registry.infer_model_type(hf))
        return [WeightRequest.for_model(plugin, plugin.config_from_hf(hf), hf, quantization=method(hf))]

    local = resolve_checkpoint(path, weights=target, gguf_file=gguf_file)
    if draft_model is None or draft_model == "mtp":
        return local, draft_model
    return local, resolve_checkpoint(draft_model, weights=draft)
