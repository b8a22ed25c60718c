"""The kit's checks on a model's own parts: ``config_errors``, ``weight_patterns``,
``forward_contract`` and ``kv_layout`` (docs/design.md §19).

Each runs the plugin's classmethods the way the engine does (``rtpcore.engine.worker.rank``),
on the model's demo config and demo checkpoint, and watches what they do:

* ``config_errors`` gives each field that ``config_from_hf`` reads a value of the wrong type, in
  turn (a string for a number, a number for a string, a string for a mapping or a list), and
  runs the stages the engine runs before any weight is read (``config_from_hf``,
  ``weight_patterns``, ``placeholder_ranges``, ``weight_shapes``, ``kv_cache_descs``): one of them
  must raise a ``CheckpointError`` whose message names the field. A field no stage refuses was
  silently accepted (a default, a cast), which is what the check exists to find.
* ``weight_patterns`` loads the tensors the patterns name and hands ``build_model`` a mapping that
  records every name asked for: a name no pattern declares is an undeclared read (a checkpoint
  holding it would be read without the pruned load knowing), a declared tensor never asked for
  is a tensor loaded for nothing.
* ``forward_contract`` runs the model on a batch of two prompts, then on a mixed batch (two
  decodes and a prompt chunk) with and without ``logits_indices``: each output is a finite
  float ``(N, vocab)`` tensor with the rows the contract says, and the selected rows equal the
  same rows of the unselected output.
* ``kv_layout`` packs random keys and values into each layer's KV bytes with the layer's codec
  (a plugin layout's own ``make_codec`` when it has one) and reads them back with rtpcore's
  generic reader of the spec's regions: each region must decode to what was written, within
  the rounding of its dtype: exact for fp32, 2**-8 relative for bf16, 2**-10 for fp16, and for
  fp8 e4m3 ``2**-4 * |x| + 2**-6 * scale`` (three mantissa bits; ``scale`` the group's or the
  layer's scale, for values in e4m3's subnormal range). Bytes no region claims must be zero.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from rtpcore.testing.kit import CheckSkipped, KitContext, fail

__all__: list[str] = []

_BAD_TEXT = "not-a-number"


def _malformed(value: Any) -> Any:
    """A value of the wrong type for a field holding ``value`` (None: no type to break)."""
    if isinstance(value, bool):
        return "yes"
    if isinstance(value, int | float):
        return _BAD_TEXT
    if isinstance(value, str):
        return 12345
    if isinstance(value, Mapping):
        return "not-a-mapping"
    if isinstance(value, list | tuple):
        return "not-a-list"
    return None


class _Recorder(dict[str, Any]):
    """A mapping that records what is asked of it: ``read`` the keys asked for one by one
    (``[]``, ``get``, ``in``, ``pop``), in order; ``whole`` whether it was iterated (every key
    taken: a copy, ``items()``)."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        super().__init__(data)
        self.read: list[str] = []
        self.whole = False
        self.stats = getattr(data, "stats", None)  # a LoadedWeights' load statistics

    def _note(self, key: Any) -> None:
        if isinstance(key, str) and key not in self.read:
            self.read.append(key)

    def __getitem__(self, key: Any) -> Any:
        self._note(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._note(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._note(key)
        return super().__contains__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        self._note(key)
        return super().pop(key, *default)

    def __iter__(self) -> Iterator[Any]:
        self.whole = True
        return super().__iter__()

    def keys(self) -> Any:
        self.whole = True
        return super().keys()

    def items(self) -> Any:
        self.whole = True
        return super().items()

    def values(self) -> Any:
        self.whole = True
        return super().values()


def _pre_load_stages(plugin: Any, hf_config: Mapping[str, Any]) -> None:
    """What the engine runs on a config before it reads a weight."""
    from rtpcore.plugins.model_plugin import call_optional

    config = plugin.config_from_hf(hf_config)
    plugin.weight_patterns(config)
    call_optional(plugin, "placeholder_ranges", config)
    call_optional(plugin, "weight_shapes", config)
    plugin.kv_cache_descs(config, kv_cache_dtype="fp32", kv_layout=None, tokens_per_block=16)


def config_errors(ctx: KitContext, model_type: str) -> str | None:
    from rtpcore.errors import CheckpointError
    from rtpcore.plugins.model_plugin import call_optional

    plugin = ctx.model_class(model_type)
    demo = call_optional(plugin, "demo_config")
    if demo is None:
        raise CheckSkipped(f"model type {model_type!r} offers no demo_config() to break")
    recorder = _Recorder(demo)
    plugin.config_from_hf(recorder)
    fields = [k for k in recorder.read if k in demo and _malformed(demo[k]) is not None]
    if not fields:
        raise CheckSkipped(f"{plugin.__qualname__}.config_from_hf reads no field of its demo config one by one "
                           "(it copies the whole mapping), so the kit cannot tell which fields it uses")
    problems = []
    for key in fields:
        bad = _malformed(demo[key])
        try:
            _pre_load_stages(plugin, {**demo, key: bad})
        except CheckpointError as exc:
            if key not in str(exc):
                problems.append(f"{key}={bad!r}: CheckpointError does not name the field: {exc}")
        except Exception as exc:
            problems.append(f"{key}={bad!r}: raised {type(exc).__name__} instead of a CheckpointError naming it: "
                            f"{exc}")
        else:
            problems.append(f"{key}={bad!r} was accepted (demo value {demo[key]!r}): config_from_hf and the "
                            "stages after it raised nothing")
    if problems:
        raise fail("config_errors", f"model type {model_type!r} ({plugin.__module__}.{plugin.__qualname__}):\n"
                   + "\n".join(f"  {p}" for p in problems))
    return f"{len(fields)} fields refused by name"


def _load_and_build(ctx: KitContext, model_type: str, *, record: bool = False) -> tuple[Any, Any, Any, Any]:
    """(plugin, config, model, recorder) built as ``rtpcore.engine.worker.rank`` builds it, float32 on the CPU."""
    import torch

    from rtpcore.checkpoint import load_checkpoint, read_hf_config
    from rtpcore.checkpoint.request import WeightRequest
    from rtpcore.models.layers import linear_kernels, weight_quantization
    from rtpcore.plugins.model_plugin import call_optional
    from rtpcore.quantization import quantization_method

    path = ctx.demo_checkpoint(model_type)
    plugin = ctx.model_class(model_type)
    hf = read_hf_config(path)
    config = plugin.config_from_hf(hf)
    method = quantization_method(hf, ctx.registry.seam_classes("quantization_methods"))
    request = WeightRequest.for_model(plugin, config, hf, quantization=method)
    weights = load_checkpoint(path, request.patterns, request.ranges, dtype=torch.float32,
                              expected_shapes=call_optional(plugin, "weight_shapes", config),
                              dtypes=call_optional(plugin, "weight_dtypes", config), quantization=request.quantization)
    recorder = _Recorder(weights) if record else weights
    with linear_kernels(batched_fp32=False), weight_quantization(method), torch.inference_mode():
        model = plugin.build_model(config, recorder, dtype=torch.float32, device=torch.device("cpu"))
    return plugin, config, model, recorder


def weight_patterns(ctx: KitContext, model_type: str) -> str | None:
    plugin, _, _, recorder = _load_and_build(ctx, model_type, record=True)
    declared = set(dict.keys(recorder))
    asked = declared | set(recorder.read) if recorder.whole else set(recorder.read)
    undeclared = sorted(asked - declared)
    unread = sorted(declared - asked)
    where = f"{plugin.__module__}.{plugin.__qualname__}"
    seen = []
    if undeclared:
        seen.append(f"build_model read {', '.join(map(repr, undeclared[:5]))}"
                    + (f" and {len(undeclared) - 5} more" if len(undeclared) > 5 else "")
                    + f", which no pattern of {where}.weight_patterns declares")
    if unread:
        seen.append(f"{where}.weight_patterns declares {', '.join(map(repr, unread[:5]))}"
                    + (f" and {len(unread) - 5} more" if len(unread) > 5 else "")
                    + ", which build_model never reads (loaded for nothing)")
    if seen:
        raise fail("weight_patterns", "\n".join(seen))
    return f"{len(declared)} tensors, each declared and read"


def forward_contract(ctx: KitContext, model_type: str) -> str | None:
    import torch

    from rtpcore.kv.pools import allocate_kv_caches
    from rtpcore.kv.specs import kv_cache_specs
    from rtpcore.models.forward_batch import ForwardBatch

    plugin, config, model, _ = _load_and_build(ctx, model_type)
    if isinstance(model, torch.nn.Module):
        model.eval()
    tpb = 16
    specs = kv_cache_specs(plugin, config, kv_cache_dtype="fp32", kv_layout=None, tokens_per_block=tpb,
                           registry=ctx.registry, model_type=model_type)
    caches = allocate_kv_caches(specs, 8, layouts=ctx.registry)
    vocab = ctx.demo_config_value(model_type, "vocab_size")
    tables = torch.arange(6).reshape(3, 2)  # sequence i owns blocks 2i, 2i+1

    def batch(seqs: list[tuple[int, int, int]], logits_indices: list[int] | None = None) -> ForwardBatch:
        """``seqs``: (sequence, first position, new tokens)."""
        ids, positions, slots, lens = [], [], [], []
        for seq, start, n in seqs:
            pos = list(range(start, start + n))
            ids += [(7 * seq + 3 * p + 1) % min(vocab, 97) for p in pos]
            positions += pos
            slots += [int(tables[seq, p // tpb]) * tpb + p % tpb for p in pos]
            lens.append(start + n)
        return ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.tensor(positions), slots=torch.tensor(slots),
            query_lens=tuple(n for _, _, n in seqs), context_lens=torch.tensor(lens),
            block_tables=tables[[s for s, _, _ in seqs]], tokens_per_block=tpb,
            logits_indices=None if logits_indices is None else torch.tensor(logits_indices),
            host_max_context_len=max(lens), host_context_lens=tuple(lens),
        )

    def run(b: ForwardBatch, rows: int, what: str) -> torch.Tensor:
        with torch.inference_mode():
            out = model(b, caches)
        if not isinstance(out, torch.Tensor):
            raise fail("forward_contract", f"{what}: the forward returned {type(out).__name__}, not a tensor")
        if out.dim() != 2 or out.shape[0] != rows or out.shape[1] < vocab:
            raise fail("forward_contract", f"{what}: the forward returned shape {tuple(out.shape)}; the contract "
                       f"is ({rows}, vocab_size={vocab})")
        if not out.dtype.is_floating_point:
            raise fail("forward_contract", f"{what}: the forward returned dtype {out.dtype}, not a float dtype")
        if not torch.isfinite(out[:, :vocab]).all():
            raise fail("forward_contract", f"{what}: the forward returned non-finite logits")
        return out.float()

    run(batch([(0, 0, 9), (1, 0, 5)]), 2, "a prefill of two prompts (9 and 5 tokens)")
    mixed = [(0, 9, 1), (1, 5, 1), (2, 0, 6)]
    full = run(batch(mixed), 3, "a mixed step (two decodes, a 6-token prompt)")
    # Rows by logits_indices: the two decodes and the prompt's last token, as the engine asks for them.
    picked = run(batch(mixed, [0, 1, 7]), 3, "the mixed step with logits_indices [0, 1, 7]")
    if not torch.allclose(full, picked, rtol=1e-4, atol=1e-4):
        raise fail("forward_contract", "the mixed step's rows selected by logits_indices [0, 1, 7] differ from "
                   f"its rows without logits_indices (max difference {(full - picked).abs().max().item():.3g})")
    run(batch(mixed, [2, 3]), 2, "the mixed step with logits_indices [2, 3] (two rows of the prompt)")
    return None


def kv_layout(ctx: KitContext, subject: str) -> str | None:
    """A model's layers (its default KV layout and every registered fp8 layout it takes), or a
    KV layout the plugin registers, on DeepSeek-V3's MLA shape (latent 512, rope 64)."""
    import torch

    from rtpcore.kv.codecs import KVCodec, make_codec
    from rtpcore.kv.specs import build_specs, kv_cache_specs
    from rtpcore_native import BUILTIN_LAYOUTS, KVCacheSpecDesc

    def check(specs: list[Any], where: str) -> int:
        for index, spec in enumerate(specs):
            custom = spec.layout not in ("", *BUILTIN_LAYOUTS)
            policy = ctx.registry.get_layout(spec.layout) if custom else None
            codec = make_codec(spec, policy)
            what = f"{where} layer {index} ({spec.tag}, {spec.dtype}" + (f", layout {spec.layout})" if spec.layout
                                                                           else ")")
            _check_layer(spec, codec, what, torch, KVCodec)
        return len(specs)

    if subject not in ctx.subjects("models"):  # a layout of the plugin's
        desc = KVCacheSpecDesc(tag="mla", kind="mla", dtype="fp8_e4m3", kv_lora_rank=512, rope_head_dim=64,
                               tokens_per_block=64, layout=subject)
        check(build_specs([desc], registry=ctx.registry, model_type="kv_layout check"), f"layout {subject!r}:")
        return "an fp8 MLA layer of latent 512, rope 64"
    from rtpcore.checkpoint import read_hf_config

    plugin = ctx.model_class(subject)
    config = plugin.config_from_hf(read_hf_config(ctx.demo_checkpoint(subject)))
    checked = 0
    for kv_dtype, layout in [("fp32", None), ("bf16", None), ("fp8_e4m3", None),
                             *(("fp8_e4m3", name) for name in ctx.registry.layout_names())]:
        try:
            specs = kv_cache_specs(plugin, config, kv_cache_dtype=kv_dtype, kv_layout=layout, tokens_per_block=16,
                                   registry=ctx.registry, model_type=subject)
        except Exception:
            if layout is None and kv_dtype != "fp8_e4m3":
                raise
            continue  # a KV dtype or layout this model does not take (the engine refuses it at build)
        checked += check(specs, f"kv_cache_dtype={kv_dtype}" + (f", kv_layout={layout}:" if layout else ":"))
    return f"{checked} layer specs"


def _check_layer(spec: Any, codec: Any, what: str, torch: Any, generic_codec: Any) -> None:
    from rtpcore.kv.pools import kv_shapes

    generator = torch.Generator().manual_seed(0)
    k_shape, v_shape = kv_shapes(spec)
    tokens = 3
    k = torch.randn((tokens, *k_shape), generator=generator) * 2.0
    v = torch.randn((tokens, *v_shape), generator=generator) * 2.0
    rows = codec.pack(k, v)
    if rows.dtype != torch.uint8 or tuple(rows.shape) != (tokens, spec.bytes_per_token):
        raise fail("kv_layout", f"{what}: pack returned {rows.dtype} {tuple(rows.shape)}, the spec says uint8 "
                   f"({tokens}, bytes_per_token={spec.bytes_per_token})")
    reader = generic_codec(spec, scale=getattr(codec, "scale", None))
    k_back, v_back = reader.unpack(rows, torch.float32)
    claimed = torch.zeros(spec.bytes_per_token, dtype=torch.bool)
    for name, start, size, dtype in spec.regions:
        claimed[start:start + size] = True
        if name not in ("nope", "rope", "k", "v"):
            continue  # scales (checked through the values they decode) and fillers (zeros, below)
        want = (k if name in ("nope", "k") else v).reshape(tokens, -1)
        got = (k_back if name in ("nope", "k") else v_back).reshape(tokens, -1)
        bad = (got - want).abs() > _tolerance(dtype, want, codec)
        if bad.any():
            token, i = (int(x) for x in bad.nonzero()[0])
            width = size // want.shape[1]
            raise fail("kv_layout", f"{what}: token {token}, region {name!r} ({dtype}, bytes {start}..{start + size - 1}"
                       f"): value {i} at byte offset {start + i * width} decodes to {float(got[token, i]):.6g} where "
                       f"{float(want[token, i]):.6g} was written")
    stray = rows[:, ~claimed] != 0
    if stray.any():
        unclaimed = claimed.logical_not().nonzero().flatten()
        raise fail("kv_layout", f"{what}: byte {int(unclaimed[int(stray.nonzero()[0][1])])} belongs to no region of "
                   "the spec but was written (not zero)")
    k2, v2 = codec.unpack(rows, torch.float32)
    for want, got, part in ((k_back, k2, "keys"), (v_back, v2, "values")):
        if not torch.allclose(want.reshape(got.shape), got, rtol=0, atol=1e-6):
            raise fail("kv_layout", f"{what}: the layout's own unpack disagrees with the spec's regions on the "
                       f"{part} (max difference {(want.reshape(got.shape) - got).abs().max().item():.3g})")


def _tolerance(dtype: str, want: Any, codec: Any) -> Any:
    """How far a value stored as ``dtype`` may decode from ``want`` (see the module docstring)."""
    if dtype == "fp32":
        return want.abs() * 2.0**-23 + 1e-30
    if dtype == "bf16":
        return want.abs() * 2.0**-8 + 1e-30
    if dtype == "fp16":
        return want.abs() * 2.0**-10 + 2.0**-24
    scale = getattr(codec, "scale", None)  # a per-tensor scale, else per group: at most 2 amax / 448
    bound = scale if scale is not None else 2.0 * want.abs().amax(dim=-1, keepdim=True) / 448.0
    return want.abs() * 2.0**-4 + bound * 2.0**-9 + 1e-12
