"""Demo checkpoints: a small, deterministic, RANDOM-WEIGHT model of any plugin with a ``demo_config()``.

``rtpcore generate --demo llama --prompt "Hello"`` needs no download: on first
use the checkpoint is built into ``$XDG_CACHE_HOME/rtpcore/demo/<model_type>-<hash>``
(``~/.cache`` when unset) from the plugin's ``demo_config()``, its
``weight_patterns``/``placeholder_ranges``/``weight_shapes``, and a seeded
generator; later runs reuse it. The hash covers the config and this module's
format version, so a changed demo config gets a new directory.

The weights are random: the text a demo model writes is meaningless. The
tokenizer is byte level (ids 0..255 are the UTF-8 bytes; ``<bos>`` = 256 and
``<eos>`` = 257 in the built-in demo configs): ``tokenizer.json`` holds it, and
``tokenizer_config.json`` names the special tokens and carries :data:`CHAT_TEMPLATE`,
so ``generate --chat`` and the server's chat endpoint work on a demo. A demo config of
another vocabulary layout gets no ``tokenizer.json``; :class:`ByteTokenizer` gives the
byte ids then.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rtpcore.errors import RtpcoreError
from rtpcore.plugins.model_plugin import call_optional

__all__ = ["ByteTokenizer", "demo_cache_dir", "demo_checkpoint", "ensure_demo_checkpoint"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: tokenizer_config.json with a chat template
SEED = 0
NOTICE = "rtpcore demo checkpoint: RANDOM WEIGHTS, deterministic, for trying the engine; its output is meaningless."
PRINTABLE = slice(32, 127)  # ids the demo lm_head can favour: printable ASCII bytes
#: The demo's chat template: plain-text role headers (the byte tokenizer has no role tokens).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def demo_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/rtpcore/demo`` (``~/.cache/rtpcore/demo`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rtpcore" / "demo"


def demo_checkpoint(
    name: str,
    *,
    plugins: Iterable[str] = (),
    external_model_packages: Iterable[str] = (),
    cache_dir: Path | None = None,
) -> Path:
    """The demo checkpoint of the model type ``name`` served under this allowlist."""
    from rtpcore.plugins.allowlist import Allowlist
    from rtpcore.plugins.loading import load_plugins

    registry = load_plugins(Allowlist.from_cli(plugins, external_model_packages).resolve())
    return ensure_demo_checkpoint(registry.get(name), cache_dir=cache_dir)


def ensure_demo_checkpoint(plugin: Any, *, cache_dir: Path | None = None) -> Path:
    """Build (once) and return the demo checkpoint of ``plugin`` (a ModelPlugin subclass)."""
    config = call_optional(plugin, "demo_config")
    if config is None:
        raise RtpcoreError(f"model type {plugin.model_type!r} ({plugin.__qualname__}) offers no demo_config()")
    config = dict(config)
    blob = json.dumps({"format": FORMAT_VERSION, "seed": SEED, "config": config}, sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
    root = cache_dir or demo_cache_dir()
    path = root / f"{plugin.model_type}-{digest}"
    if (path / "config.json").is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=root))
    try:
        _write_checkpoint(plugin, config, tmp)
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        try:
            os.replace(tmp, path)  # atomic: a concurrent builder may have won, which is fine
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built demo checkpoint %s", path)
    return path


def _write_checkpoint(plugin: Any, config: dict[str, Any], path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    model_config = plugin.config_from_hf(config)
    shapes = dict(call_optional(plugin, "weight_shapes", model_config))
    ranges = {k: list(v) for k, v in call_optional(plugin, "placeholder_ranges", model_config).items()}
    names = _expand(plugin.weight_patterns(model_config), ranges, shapes)
    mtp = call_optional(plugin, "mtp_draft", model_config)
    if mtp is not None:  # the checkpoint's multi-token-prediction layers, for draft_model="mtp"
        mtp_config = mtp.config_from_hf(config)
        mtp_ranges = {k: list(v) for k, v in call_optional(mtp, "placeholder_ranges", mtp_config).items()}
        mtp_shapes = dict(call_optional(mtp, "weight_shapes", mtp_config))
        names.update(_expand(mtp.weight_patterns(mtp_config), mtp_ranges, mtp_shapes))
    generator = torch.Generator().manual_seed(SEED)
    tensors = {}
    for name, shape in sorted(names.items()):
        if len(shape) == 1 and "norm" in name:
            tensors[name] = torch.ones(shape)
        else:
            std = 1.0 / max(shape[-1], 1) ** 0.5
            tensors[name] = torch.randn(shape, generator=generator) * std
    vocab = config.get("vocab_size")
    for name, t in tensors.items():
        if name.endswith(("lm_head.weight", "shared_head.head.weight")) and t.shape[0] == vocab:
            keep = torch.zeros(t.shape[0], dtype=torch.bool)
            keep[PRINTABLE] = True
            t[~keep] = 0.0  # zero logits: greedy output stays printable ASCII, easier on a terminal
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt", "rtpcore_demo": NOTICE})
    (path / "config.json").write_text(json.dumps({**config, "rtpcore_demo": NOTICE}, indent=2, sort_keys=True))
    (path / "README.txt").write_text(NOTICE + "\n")
    _write_tokenizer(path / "tokenizer.json", config)
    _write_tokenizer_config(path / "tokenizer_config.json", config)


def _expand(
    patterns: Sequence[str], ranges: Mapping[str, list[int]], shapes: Mapping[str, Sequence[int]]
) -> dict[str, tuple[int, ...]]:
    """Exact tensor names (and shapes) of the required patterns; optional ones are skipped."""
    from rtpcore.checkpoint.patterns import Pattern

    sets = {name: frozenset(values) for name, values in ranges.items()}
    out: dict[str, tuple[int, ...]] = {}
    for text in patterns:
        pattern = Pattern(text, sets)
        if not pattern.required:
            continue  # a placeholder without a range: optional tensors
        if text not in shapes:
            raise RtpcoreError(f"demo checkpoint: weight_shapes() gives no shape for {text!r}")
        out.update(dict.fromkeys(pattern.expand(), tuple(shapes[text])))
    return out


def _byte_to_unicode() -> dict[int, str]:
    """The reversible byte -> printable character map of byte-level BPE tokenizers."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _write_tokenizer(path: Path, config: Mapping[str, Any]) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = {config.get("bos_token_id"): "<bos>", config.get("eos_token_id"): "<eos>"}
    for token_id in sorted(i for i in specials if isinstance(i, int)):
        if tok.get_vocab_size() != token_id:
            return  # not the byte layout this writer knows; ByteTokenizer serves the demo
        tok.add_special_tokens([AddedToken(specials[token_id], special=True)])
    tok.save(str(path))


def _write_tokenizer_config(path: Path, config: Mapping[str, Any]) -> None:
    """Special tokens (those of the byte layout the demo configs use) and the chat template."""
    names = {"bos_token": ("bos_token_id", "<bos>"), "eos_token": ("eos_token_id", "<eos>")}
    tokens = {name: text for name, (key, text) in names.items() if isinstance(config.get(key), int)}
    record = {"tokenizer_class": "PreTrainedTokenizerFast", **tokens, "chat_template": CHAT_TEMPLATE}
    path.write_text(json.dumps(record, indent=2, sort_keys=True))


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; decoding drops every other id."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
