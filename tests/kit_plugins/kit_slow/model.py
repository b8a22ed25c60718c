"""The built-in Llama under another name."""

from __future__ import annotations

from rtpcore.models.llama import LlamaPlugin


class KitSlowPlugin(LlamaPlugin):
    model_type = "kit_slow"
    architectures = ("KitSlowForCausalLM",)
