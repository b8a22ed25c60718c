"""Stage 2, checkpoint: config.json and the safetensors weights a model needs.

``index`` validates safetensors headers and indexes the checkpoint without reading
tensors;
``patterns`` expands a plugin's weight patterns into the exact tensor names;
``request`` says which tensors a model's plugin asks for and which shards hold them;
``loader`` reads only the shards and tensors those names need (``quantized``
dequantizes fp8 block-quantized weights on the way). It hands the model stage a
name -> tensor mapping. ``hub`` turns a Hugging Face Hub id (``org/name[@revision]``)
into a local snapshot folder holding only the shards the same requests name.
"""

from rtpcore.checkpoint.loader import (
    LoadedWeights,
    LoadStats,
    WeightSelection,
    load_checkpoint,
    read_hf_config,
)
from rtpcore.checkpoint.quantized import quantize_fp8_blocks

__all__ = [
    "LoadStats",
    "LoadedWeights",
    "WeightSelection",
    "load_checkpoint",
    "quantize_fp8_blocks",
    "read_hf_config",
]
