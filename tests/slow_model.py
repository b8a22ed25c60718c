"""A checkpoint served by a slow model, for server tests that need requests to keep running for
as long as the test needs them, on any machine: ``SlowLlama``, an external model package whose
every forward takes ``step_seconds`` more than the built-in Llama's. The tests wait for events,
never for time to pass; the model's pace only keeps a request from finishing first."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

PLUGIN = """
import time
from rtpcore import hookimpl
from rtpcore.models.llama import LlamaPlugin

class SlowLlama(LlamaPlugin):
    model_type = "slow_llama"
    architectures = ("SlowLlamaForCausalLM",)

    @classmethod
    def build_model(cls, config, weights, **options):
        model = super().build_model(config, weights, **options)
        forward = model.forward

        def slow(batch, kv_caches):
            time.sleep({step_seconds!r})
            return forward(batch, kv_caches)

        model.forward = slow
        return model

@hookimpl
def rtpcore_register_models(registry):
    registry.register(SlowLlama)
"""


def slow_checkpoint(checkpoint: Path, root: Path, *, step_seconds: float,
                    max_position_embeddings: int | None = None) -> tuple[Path, dict[str, str]]:
    """A copy of ``checkpoint`` under ``root`` served by SlowLlama, and the environment whose
    PYTHONPATH finds the plugin's module (serve it with ``--external-model-packages slow_llama``)."""
    path = root / "checkpoint"
    path.mkdir()
    for f in checkpoint.iterdir():
        if f.is_file():
            (path / f.name).write_bytes(f.read_bytes())
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["SlowLlamaForCausalLM"]
    if max_position_embeddings is not None:
        config["max_position_embeddings"] = max_position_embeddings
    (path / "config.json").write_text(json.dumps(config))
    (root / "slow_llama.py").write_text(textwrap.dedent(PLUGIN).replace("{step_seconds!r}", repr(step_seconds)))
    env = {k: v for k, v in os.environ.items() if k != "RTPCORE_API_KEY"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    return path, env
