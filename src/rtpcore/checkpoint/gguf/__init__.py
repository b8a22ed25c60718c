"""GGUF checkpoints (docs/design.md §20): ``reader`` -> ``config`` / ``vocab`` -> ``weights``.

``reader`` opens a ``.gguf`` file, a split set or a folder holding one model with the
``gguf`` package (memory-mapped, nothing read but the headers); ``config`` turns the
Llama family's ``<arch>.*`` metadata into a ``config.json`` dict and its tensor names into
the Hugging Face names a plugin's weight patterns use; ``vocab`` rebuilds the tokenizer
(``tokenizers``) and ``tokenizer_config.json`` (special tokens, chat template) from
``tokenizer.ggml.*``; ``weights`` loads the tensors a model's patterns select. A model plugin
serves GGUF files by declaring ``gguf_architectures`` (``rtpcore.ModelPlugin``);
:func:`gguf_hf_config` and :func:`gguf_tensor_names` ask the registry which one does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rtpcore.checkpoint.gguf.config import (
    LLAMA_FAMILY,
    GGUFTensorName,
    llama_family_config,
    llama_family_tensor_names,
)
from rtpcore.checkpoint.gguf.reader import (
    GGUFCheckpoint,
    GGUFTensor,
    gguf_files,
    is_gguf,
    open_gguf,
)
from rtpcore.checkpoint.gguf.vocab import gguf_tokenizer, gguf_tokenizer_config

__all__ = [
    "LLAMA_FAMILY",
    "GGUFCheckpoint",
    "GGUFTensor",
    "GGUFTensorName",
    "gguf_files",
    "gguf_hf_config",
    "gguf_tensor_names",
    "gguf_tokenizer",
    "gguf_tokenizer_config",
    "is_gguf",
    "llama_family_config",
    "llama_family_tensor_names",
    "open_gguf",
]


def gguf_hf_config(path: str | os.PathLike[str], registry: Any = None) -> dict[str, Any]:
    """The ``config.json`` dict of the GGUF checkpoint at ``path``: the ``config_from_gguf`` of
    the model plugin that declares its ``general.architecture`` (``registry.gguf_model_type``),
    with ``architectures`` set to the plugin's first one when it leaves it out. Without a
    registry, the built-in Llama family's reading (:func:`llama_family_config`)."""
    checkpoint = open_gguf(path)
    if registry is None:
        return llama_family_config(checkpoint)
    plugin = registry.get(registry.gguf_model_type(checkpoint.architecture, path=checkpoint.path))
    hf = dict(plugin.config_from_gguf(checkpoint))
    hf.setdefault("architectures", [plugin.architectures[0]])
    return hf


def gguf_tensor_names(plugin: Any, path: str | os.PathLike[str], hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """GGUF name -> checkpoint name (or :class:`GGUFTensorName`) of the checkpoint at ``path``
    for the model ``plugin`` builds from ``hf_config`` ({} when the plugin switched the hook
    off: its weight patterns name GGUF tensors)."""
    hook = getattr(plugin, "gguf_tensor_names", None)
    return {} if hook is None else dict(hook(open_gguf(path), hf_config))
