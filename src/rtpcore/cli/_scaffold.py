"""``rtpcore plugins init DIR --model-type NAME``: a new plugin package, ready to pip-install.

It writes a complete, working distribution (docs/plugins.md, "Your first plugin"): the
pyproject with both entry points, a hooks module registering the model lazily, a ModelPlugin
subclass stating the running ``FORWARD_CONTRACT``, a small pre-norm decoder over the paged KV
cache (importing only the public plugin modules), its ``demo_config`` and ``weight_shapes`` (so
``rtpcore generate --demo NAME`` runs it at once), and a test of its own. The model is a
starting point, the package layout is the part to keep: replace the model with yours, and its
test with a comparison against your reference implementation.

Nothing is written unless everything can be: DIR must not exist or be empty, and every name
is checked first (a usage error, exit status 2, naming the input and the rule).
"""

from __future__ import annotations

import argparse
import keyword
import re
from pathlib import Path
from typing import Any

from rtpcore.cli._args import add_log_level_argument

__all__ = ["add_init_parser", "scaffold_files"]

_MODEL_TYPE = re.compile(r"[a-z][a-z0-9_]*")
_ARCHITECTURE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DISTRIBUTION = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")


def add_init_parser(actions: Any) -> None:
    init = actions.add_parser(
        "init",
        help="write a new plugin package (pyproject, entry points, a model, its test)",
        description="Write a new rtpcore plugin package into DIR: a pyproject.toml with the "
        "rtpcore.plugins and rtpcore.architectures entry points, a hooks module, a ModelPlugin "
        "subclass with a small working decoder, and a test. `pip install DIR` installs it; "
        "`rtpcore generate --demo NAME --plugins DIST` runs it.",
    )
    init.add_argument("directory", metavar="DIR", type=Path, help="where to write it (must not exist, or be empty)")
    init.add_argument("--model-type", required=True, metavar="NAME",
                      help="the model type it registers: lowercase letters, digits and '_', a letter first")
    init.add_argument("--architecture", metavar="ARCH",
                      help="the config.json architecture it serves (default: NAME in CamelCase + 'ForCausalLM')")
    init.add_argument("--distribution", metavar="DIST",
                      help="the distribution's name (default: NAME with '-' for '_', + '-plugin')")
    add_log_level_argument(init)
    init.set_defaults(func=_init, _parser=init)


def _init(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args._parser
    model_type = args.model_type
    if not _MODEL_TYPE.fullmatch(model_type) or keyword.iskeyword(model_type):
        parser.error(f"--model-type {model_type!r}: must be lowercase letters, digits and '_', starting with "
                     "a letter, and not a Python keyword (it names the package too)")
    architecture = args.architecture or "".join(p.capitalize() for p in model_type.split("_") if p) + "ForCausalLM"
    if not _ARCHITECTURE.fullmatch(architecture):
        parser.error(f"--architecture {architecture!r}: must be a Python identifier, as config.json's "
                     "architectures are class names")
    distribution = args.distribution or model_type.replace("_", "-") + "-plugin"
    if not _DISTRIBUTION.fullmatch(distribution):
        parser.error(f"--distribution {distribution!r}: not a valid distribution name (letters, digits, "
                     "'.', '_', '-'; a letter or digit at both ends)")
    directory: Path = args.directory
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        parser.error(f"DIR {str(directory)!r} exists and is not an empty folder: nothing was written")
    files = scaffold_files(model_type, architecture, distribution)
    for rel, text in files.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    package = _package(distribution)
    print(f"wrote {len(files)} files of {distribution} (package {package}, model type {model_type!r}, "
          f"architecture {architecture}) to {directory}")
    print(f"next: pip install {directory} && rtpcore plugins check {distribution} "
          f"&& rtpcore generate --demo {model_type} --plugins {distribution} --prompt Hello")
    return 0


def _package(distribution: str) -> str:
    return re.sub(r"[-.]+", "_", distribution).lower()


def scaffold_files(model_type: str, architecture: str, distribution: str) -> dict[str, str]:
    """The package's files (path relative to DIR -> text)."""
    from importlib.metadata import version

    from rtpcore.plugins.model_plugin import FORWARD_CONTRACT

    package = _package(distribution)
    plugin = package.removesuffix("_plugin") or package
    major_minor = ".".join(version("rtpcore").split(".")[:2])
    cls = "".join(p.capitalize() for p in model_type.split("_") if p) + "Plugin"
    values = {
        "MODEL_TYPE": model_type, "ARCHITECTURE": architecture, "DISTRIBUTION": distribution,
        "PACKAGE": package, "PLUGIN": plugin, "CLASS": cls, "CONTRACT": str(FORWARD_CONTRACT),
        "RTPCORE": major_minor,
    }

    def fill(template: str) -> str:
        return re.sub(r"@(\w+)@", lambda m: values[m.group(1)], template)

    return {
        "pyproject.toml": fill(_PYPROJECT),
        "README.md": fill(_README),
        f"src/{package}/__init__.py": fill('"""@DISTRIBUTION@: the @MODEL_TYPE@ model, served by rtpcore."""\n'),
        f"src/{package}/hooks.py": fill(_HOOKS),
        f"src/{package}/plugin.py": fill(_PLUGIN),
        f"src/{package}/model.py": fill(_MODEL),
        "tests/test_model.py": fill(_TEST),
    }


_PYPROJECT = '''[build-system]
requires = ["setuptools>=69"]
build-backend = "setuptools.build_meta"

[project]
name = "@DISTRIBUTION@"
version = "0.1.0"
description = "The @MODEL_TYPE@ model, served by rtpcore"
requires-python = ">=3.11"
dependencies = ["rtpcore>=@RTPCORE@"]

[project.optional-dependencies]
test = ["pytest>=8"]

# The plugin: its hooks module. Operators allow it with --plugins @DISTRIBUTION@.
[project.entry-points."rtpcore.plugins"]
@PLUGIN@ = "@PACKAGE@.hooks"

# What it serves, read before anything is imported (which plugin to allow for a checkpoint).
[project.entry-points."rtpcore.architectures"]
@ARCHITECTURE@ = "@PLUGIN@"

[tool.pytest.ini_options]
testpaths = ["tests"]
'''

_README = '''# @DISTRIBUTION@

The `@MODEL_TYPE@` model (config.json architecture `@ARCHITECTURE@`) as an rtpcore plugin,
written by `rtpcore plugins init`. Its model is a small pre-norm decoder to start from:
replace `src/@PACKAGE@/model.py` and `plugin.py` with yours (docs/plugins.md in rtpcore is
the guide), and `tests/test_model.py`'s checks with a comparison against your reference
implementation, token for token.

```console
$ pip install .
$ rtpcore plugins check @DISTRIBUTION@
$ rtpcore generate --demo @MODEL_TYPE@ --plugins @DISTRIBUTION@ --prompt Hello
$ python -m pytest
```
'''

_HOOKS = '''"""The rtpcore.plugins entry point: registers the model by name, importing nothing heavy."""

from rtpcore import hookimpl


@hookimpl
def rtpcore_register_models(registry):
    registry.register("@PACKAGE@.plugin:@CLASS@", model_type="@MODEL_TYPE@", architectures=("@ARCHITECTURE@",))
'''

_PLUGIN = '''"""What the engine asks of the @MODEL_TYPE@ model before it builds it: config, tensors, KV caches."""

import dataclasses

from rtpcore import ModelPlugin
from rtpcore import config_fields as cf

LAYER = "model.layers.{layer}."


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float


class @CLASS@(ModelPlugin):
    model_type = "@MODEL_TYPE@"
    architectures = ("@ARCHITECTURE@",)
    forward_contract = @CONTRACT@  # rtpcore.FORWARD_CONTRACT when this was written

    @classmethod
    def config_from_hf(cls, hf_config):
        """config.json, field by field: a missing or bad field is a ConfigFieldError naming it."""
        hidden = cf.require_int(hf_config, "hidden_size")
        heads = cf.require_int(hf_config, "num_attention_heads")
        cf.check_divisible("hidden_size", hidden, "num_attention_heads", heads)
        return Config(
            vocab_size=cf.require_int(hf_config, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=cf.require_int(hf_config, "intermediate_size"),
            num_hidden_layers=cf.require_int(hf_config, "num_hidden_layers"),
            num_attention_heads=heads,
            head_dim=hidden // heads,
            rms_norm_eps=cf.optional_float(hf_config, "rms_norm_eps", 1e-6, positive=True),
            rope_theta=cf.optional_float(hf_config, "rope_theta", 10000.0, positive=True),
        )

    @classmethod
    def weight_patterns(cls, config):
        return list(cls.weight_shapes(config))

    @classmethod
    def weight_shapes(cls, config):
        """Every tensor the model reads, with its shape: the loader reads only these and checks
        each shape from the file header; --demo builds a random checkpoint from them."""
        e, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
        return {
            "model.embed_tokens.weight": (v, e),
            LAYER + "input_layernorm.weight": (e,),
            LAYER + "self_attn.qkv_proj.weight": (3 * e, e),
            LAYER + "self_attn.o_proj.weight": (e, e),
            LAYER + "post_attention_layernorm.weight": (e,),
            LAYER + "mlp.up_proj.weight": (i, e),
            LAYER + "mlp.down_proj.weight": (e, i),
            "model.norm.weight": (e,),
            "lm_head.weight": (v, e),
        }

    @classmethod
    def kv_cache_descs(cls, config, *, kv_cache_dtype="fp32", tokens_per_block=16, **options):
        from rtpcore_native import KVCacheSpecDesc

        return [
            KVCacheSpecDesc(tag=f"layers.{i}", kind="mha", dtype=kv_cache_dtype,
                            num_kv_heads=config.num_attention_heads, head_dim=config.head_dim,
                            tokens_per_block=tokens_per_block)
            for i in range(config.num_hidden_layers)
        ]

    @classmethod
    def build_model(cls, config, weights, *, dtype=None, device=None, **options):
        from @PACKAGE@.model import Model

        return Model(config, weights, dtype=dtype, device=device)

    @classmethod
    def demo_config(cls):
        """A small config.json for `rtpcore generate --demo @MODEL_TYPE@` and the tests (random
        weights; a byte-level vocabulary: ids 0..255 are bytes, <bos> 256, <eos> 257)."""
        return {
            "architectures": ["@ARCHITECTURE@"], "model_type": "@MODEL_TYPE@", "vocab_size": 320,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 1024, "bos_token_id": 256, "eos_token_id": 257, "torch_dtype": "float32",
        }
'''

_MODEL = '''"""The @MODEL_TYPE@ forward over rtpcore's paged KV cache (the forward contract of plugin.py).

T is the step's new tokens (every sequence's, flat), E hidden_size, H heads, D head_dim.
"""

import torch
import torch.nn.functional as F
from torch import nn

from rtpcore.layers import Linear, paged_attention


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x, cos, sin):
    """Rotary embedding (rotate-half) on x (T, H, D); cos/sin (T, 1, D)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Layer(nn.Module):
    def __init__(self, config, w, prefix):
        super().__init__()
        self.heads, self.head_dim, self.eps = config.num_attention_heads, config.head_dim, config.rms_norm_eps
        self.register_buffer("ln1", w[prefix + "input_layernorm.weight"], persistent=False)
        self.register_buffer("ln2", w[prefix + "post_attention_layernorm.weight"], persistent=False)
        self.qkv = Linear(w[prefix + "self_attn.qkv_proj.weight"])  # E -> 3 E: [q | k | v]
        self.o = Linear(w[prefix + "self_attn.o_proj.weight"])
        self.up = Linear(w[prefix + "mlp.up_proj.weight"])
        self.down = Linear(w[prefix + "mlp.down_proj.weight"])

    def forward(self, x, cos, sin, batch, cache, masks):
        t = x.shape[0]
        q, k, v = self.qkv(rms_norm(x, self.ln1, self.eps)).view(t, 3, self.heads, self.head_dim).unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        cache.write(batch.slots, k, v)  # this step's keys first: a prompt chunk attends to itself too
        attn = paged_attention(q, cache, batch, scale=self.head_dim**-0.5, masks=masks)  # (T, H, D)
        x = x + self.o(attn.reshape(t, -1))
        return x + self.down(F.gelu(self.up(rms_norm(x, self.ln2, self.eps))))


class Model(nn.Module):
    """model(batch, kv_caches) -> (N, vocab) logits of the rows batch.logits_index names."""

    def __init__(self, config, weights, *, dtype=None, device=None):
        super().__init__()
        w = {name: t.to(device=device, dtype=dtype or t.dtype) for name, t in weights.items()}
        self.eps = config.rms_norm_eps
        self.register_buffer("embed", w["model.embed_tokens.weight"], persistent=False)  # (V, E)
        self.register_buffer("norm", w["model.norm.weight"], persistent=False)
        self.layers = nn.ModuleList(Layer(config, w, f"model.layers.{i}.") for i in range(config.num_hidden_layers))
        self.head = Linear(w["lm_head.weight"])
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, batch, kv_caches):
        x = F.embedding(batch.input_ids, self.embed)  # (T, E)
        freqs = batch.positions[:, None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # (T, 1, D)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        masks = {}  # the step's attention masks, built once and shared by the layers
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, batch, cache, masks)
        if batch.logits_index is not None:
            x = x[batch.logits_index]  # only the rows that sample: (N, E)
        return self.head(rms_norm(x, self.norm, self.eps))  # (N, V)
'''

_TEST = '''"""The @MODEL_TYPE@ plugin on a random demo checkpoint.

Replace these with a comparison against your reference implementation on the same
checkpoint, token for token (docs/plugins.md in rtpcore: "Testing against transformers").
"""

from rtpcore import Engine
from rtpcore.testing import demo_checkpoint

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [256]]


def test_batched_prompts_get_the_tokens_each_gets_alone(tmp_path):
    """Ragged prompts batched together, the long one prefilled in chunks, decode the tokens each
    decodes alone: the model reads its paged KV cache right."""
    checkpoint = demo_checkpoint("@MODEL_TYPE@", plugins=["@DISTRIBUTION@"], cache_dir=tmp_path)
    with Engine.from_pretrained(checkpoint, plugins=["@DISTRIBUTION@"], max_num_batched_tokens=8) as engine:
        together = engine.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[])
        alone = [engine.generate([p], max_new_tokens=12, stop_token_ids=[])[0] for p in PROMPTS]
    assert together == alone
    assert all(len(tokens) == 12 for tokens in together)
'''
