"""The kit's checks on the seams beyond models (docs/design.md §18, §19): ``attention_backend``,
``quantization_method``, ``logits_processor``, ``platform`` (the text parsers' checks are in
``rtpcore.testing._checks_parsers``).

Each takes the name a plugin registered on its seam and tries the class the way the engine uses
it, on the plugin's demo models (the built-in Llama for a plugin without models). The
tolerances, and why:

* ``attention_backend``: engines with ``attention_backend=NAME`` and with the reference
  ``attention_backend="torch"`` (float32, the same KV cache dtype, a few prompts of different
  lengths under ``max_num_batched_tokens=8``: prefill, mixed and decode steps) give the same
  greedy tokens, and log-probabilities (the logits less their log-sum-exp, so differences of
  logits) within ``1e-3`` of ``max(1, |reference log-probability|)`` (:data:`ATTENTION_RTOL`:
  float32 attention in another order differs by ~1e-6; 1e-3 leaves room for a kernel that
  accumulates in another order or form, absorbed MLA for instance, and catches a wrong scale or
  a wrong mask). With an fp8 KV cache ``1e-2`` (:data:`ATTENTION_RTOL_FP8`): the keys written
  differ by float rounding between the runs, and one e4m3 rounding that flips moves that
  element by a step of 2**-3 relative. A token that differs where the reference's two
  candidates lie within that tolerance of each other is a tie, not a failure: the prompt is
  compared up to it (and the note says so). Every kv dtype (``auto``, ``fp8``) on which the
  backend ``supports`` every layer of a demo model is compared; the backend must be counted in
  ``EngineStats.attention_calls``.
* ``quantization_method``: a few projection weights of the demo checkpoint are loaded through
  the method (its ``from_config``, ``select`` and ``process_weights_after_loading``, by
  ``rtpcore.checkpoint.load_checkpoint``) and built as ``rtpcore.layers.Linear`` under it (its
  ``create_weights`` and ``apply``), from the float checkpoint when the method accepts one, else
  from an fp8 block-quantized copy (DeepSeek-V3's format, blocks of 16 x 16). The reference
  ``W`` is what the checkpoint holds: the float weight, or the fp8 one dequantized by the
  format's formula. Probing the layer with the zero row and the unit rows gives its effective
  weight and bias; random rows its products. The bounds, by what built the layer: a layer that
  kept rtpcore's float kernels (``create_weights`` False: ``fp8``, which dequantizes at load)
  float32 rounding, ``2**-22 |w|`` per weight (the checkpoint's values, exactly); an ``int8``
  layer (``Int8Method`` and subclasses) each weight within half a step of its row,
  ``amax(|W_row|) / 254``, so a product within ``sum(|x|) * amax / 254``; a layer any other
  method built the rounding of e4m3 (3 mantissa bits, the coarsest built-in format): each weight
  within ``2**-4 |w|`` plus e4m3's subnormal step, and each activation too, should the method
  quantize them. Plus float32 accumulation, ``4 n 2**-24 sum(|x||w|)``.
* ``logits_processor``: the result keeps the shape, dtype and device; a row alone (after its
  neighbours were removed and it moved, or in a fresh instance) equals the row in the batch of
  three within ``rtol 1e-5, atol 1e-6`` (:data:`ROW_TOLERANCE`: batched float32 kernels may
  round a row differently by batch size); an engine with the processor generates.
* ``platform``: exact types and ranges; an unavailable platform (``is_available()`` False, or
  raising: docs/plugins.md allows that, the exception is shown) is a skip quoting why.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rtpcore.testing.kit import CheckSkipped, KitContext, fail

__all__: list[str] = []

#: Log-probabilities of an attention backend against the reference, relative to max(1, |logprob|).
ATTENTION_RTOL = 1e-3
#: The same with an fp8 KV cache.
ATTENTION_RTOL_FP8 = 1e-2
#: (rtol, atol) of a logits processor's row alone against the row in a batch.
ROW_TOLERANCE = (1e-5, 1e-6)

# Prompts of different lengths: under max_num_batched_tokens=8 the first steps prefill, the middle
# ones mix decodes with prompt chunks, the last ones decode.
_PROMPTS = ([5, 9, 33], list(range(40, 61)), [100], [7] * 13, [3, 1, 4, 1, 5, 9])
_NEW_TOKENS = 10
_TOP = 5
_RUN = {"dtype": "float32", "tokens_per_block": 4, "max_num_batched_tokens": 8, "enable_prefix_caching": False}


def _seam_class(ctx: KitContext, seam: str, name: str) -> Any:
    cls = ctx.registry.seam_class(seam, name)
    assert cls is not None, (seam, name)  # the subjects are the registry's names
    return cls


# -- attention_backend -----------------------------------------------------------------------


def attention_backend(ctx: KitContext, name: str) -> str | None:
    from rtpcore.attention import TorchAttentionBackend
    from rtpcore.errors import KVCacheSpecError

    cls = _seam_class(ctx, "attention_backends", name)
    if name == "torch":
        if cls is TorchAttentionBackend:
            return "the reference backend: the others are compared with it"
        raise CheckSkipped(f"{cls.__qualname__} replaces the reference 'torch', so there is no reference to compare "
                           "it with")
    compared, unserved, ties = [], [], []
    for model_type in ctx.demo_model_types():
        checkpoint = ctx.demo_checkpoint(model_type)
        for kv in ("auto", "fp8"):
            try:
                with ctx.engine(checkpoint, attention_backend="torch", kv_cache_dtype=kv, **_RUN) as ref:
                    why = _unsupported(cls, ref)
                    expected = _greedy(ref) if why is None else []
            except KVCacheSpecError as exc:  # the model has no such cache
                why = str(exc)
            if why is not None:
                unserved.append(f"{model_type} ({kv} KV cache): {why}")
                continue
            with ctx.engine(checkpoint, attention_backend=name, kv_cache_dtype=kv, **_RUN) as engine:
                seen = _greedy(engine)
                calls = engine.stats().attention_calls
                kv_dtype = engine.kv_cache_specs[0].dtype if engine.kv_cache_specs else kv
            where = f"{model_type}, {kv_dtype} KV cache"
            if not calls.get(name):
                raise fail("attention_backend", f"{where}: EngineStats.attention_calls is {calls!r}: backend {name!r} "
                                                "was never called")
            rtol = ATTENTION_RTOL_FP8 if "fp8" in kv_dtype else ATTENTION_RTOL
            ties += _compare(where, expected, seen, rtol)
            compared.append(where)
    if not compared:
        raise CheckSkipped(f"{name!r} serves no demo model's layers on {ctx.device}: " + "; ".join(unserved))
    note = f"equal to torch on {'; '.join(compared)}"
    if ties:
        note += f" ({'; '.join(ties)})"
    if unserved:
        note += f"; not served: {'; '.join(unserved)}"
    return note


def _unsupported(cls: Any, engine: Any) -> str | None:
    """Why ``cls`` cannot serve every layer of ``engine``'s model (None: it can), as the engine asks."""
    for i, spec in enumerate(engine.kv_cache_specs):
        answer = cls.supports(spec, engine.device, engine.config.torch_dtype)
        if answer is not True:
            return f"layer {i} ({spec.kind}, {spec.dtype}): {answer}"
    return None


def _greedy(engine: Any) -> list[tuple[list[int], list[Any]]]:
    """Each prompt's greedy tokens and their log-probabilities (``SampledToken``)."""
    from rtpcore.engine.sample.params import SamplingParams

    params = SamplingParams(max_tokens=_NEW_TOKENS, ignore_eos=True, logprobs=_TOP)
    outputs = engine.generate([{"prompt_token_ids": list(p)} for p in _PROMPTS], params)
    return [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs or ())) for o in outputs]


def _compare(where: str, expected: Sequence[tuple[list[int], list[Any]]],
             seen: Sequence[tuple[list[int], list[Any]]], rtol: float) -> list[str]:
    """Fail unless ``seen`` matches ``expected`` (tokens equal, log-probabilities within
    ``rtol``); a divergence at a tie within the tolerance ends that prompt's comparison."""
    ties = []
    for p, ((ref_ids, ref_lps), (ids, lps)) in enumerate(zip(expected, seen, strict=True)):
        if len(ids) != len(ref_ids) or len(lps) != len(ref_lps):
            raise fail("attention_backend", f"{where}: prompt {p}: {len(ids)} tokens {ids} (log-probabilities for "
                                            f"{len(lps)}), the reference {len(ref_ids)}: {ref_ids}")
        for i, (ref, got) in enumerate(zip(ref_lps, lps, strict=True)):
            ref_top, top = dict(ref.top), dict(got.top)
            values = [(ref.token_id, ref.logprob, got.logprob)] if ref.token_id == got.token_id else []
            values += [(t, ref_top[t], top[t]) for t in ref_top.keys() & top.keys()]
            scale = max([1.0] + [abs(r) for _, r, _ in values if r is not None])
            for token, r, g in values:
                if r is not None and g is not None and abs(r - g) > rtol * scale:
                    raise fail("attention_backend", f"{where}: prompt {p} ({len(_PROMPTS[p])} tokens), new token {i}: "
                                                    f"log-probability of token {token} is {g!r}, the reference's "
                                                    f"{r!r}: off by {abs(r - g):.3g}, over the tolerance "
                                                    f"{rtol:g} x {scale:.3g}")
            if ref.token_id != got.token_id:
                margin = ref_top[ref.token_id] - ref_top[got.token_id] if got.token_id in ref_top else None
                if margin is not None and margin <= rtol * scale:
                    ties.append(f"prompt {p} compared up to a tie at new token {i}")
                    break
                raise fail("attention_backend", f"{where}: prompt {p} ({len(_PROMPTS[p])} tokens): greedy tokens "
                                                f"{ids} differ from the reference's {ref_ids} at new token {i} "
                                                f"(the reference's margin between them: "
                                                f"{'not in its top ' + str(_TOP) if margin is None else f'{margin:.3g}'})")
    return ties


# -- quantization_method ---------------------------------------------------------------------

_FP8_BLOCK = (16, 16)
_E4M3_ROUND = 2.0**-4  # half a unit in the last place of e4m3's 3-bit mantissa, relative
_E4M3_STEP = 2.0**-9  # e4m3's subnormal step, relative to its largest value 448 ...
_E4M3_MAX = 448.0  # ... so a value is within scale * 2**-10, scale = amax / 448 (twice that as a power of two)
_LAYERS = 3


def quantization_method(ctx: KitContext, name: str) -> str | None:
    import torch

    from rtpcore.errors import CheckpointError
    from rtpcore.quantization import quantization_method as resolve

    cls = _seam_class(ctx, "quantization_methods", name)
    device = torch.device(ctx.device)
    problem = cls.device_problem(device.type)
    if problem is not None:
        raise CheckSkipped(f"{name!r} does not run on {device.type}: {problem}")
    model_type = ctx.demo_model_types()[0]
    checkpoint = ctx.demo_checkpoint(model_type)
    floats = _projections(checkpoint)
    if not floats:
        raise CheckSkipped(f"the demo checkpoint of {model_type!r} has no 2-D projection weight to build layers from")
    classes = ctx.registry.seam_classes("quantization_methods")
    refused = []
    with tempfile.TemporaryDirectory(prefix="rtpcore-kit-") as tmp:
        for source, (path, reference, hf_config) in _sources(checkpoint, floats, Path(tmp)):
            try:
                method = resolve(hf_config, classes, requested=name, gguf=path.suffix == ".gguf")
            except CheckpointError as exc:
                refused.append(f"{source}: {exc}")
                continue
            return _check_layers(method, path, reference, source, device)
    raise CheckSkipped(f"{name!r} reads neither checkpoint the kit can write from {model_type!r}'s demo: "
                       + "; ".join(refused))


def _projections(checkpoint: Path) -> dict[str, Any]:
    """A few float projection weights (``*proj.weight``) of ``checkpoint``: of different kinds
    and, first, of different shapes."""
    from safetensors import safe_open

    candidates: dict[str, tuple[str, tuple[int, ...], Path]] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in sorted(f.keys()):
                if key.endswith(("proj.weight", "proj_with_mqa.weight")):
                    candidates[key] = (key.rsplit(".", 2)[-2], tuple(f.get_slice(key).get_shape()), file)
    chosen: list[str] = []
    for new_shape in (True, False):
        for key, (kind, shape, _) in candidates.items():
            kinds = {candidates[k][0] for k in chosen}
            shapes = {candidates[k][1] for k in chosen}
            if len(chosen) < _LAYERS and len(shape) == 2 and kind not in kinds and (shape not in shapes or not new_shape):
                chosen.append(key)
    found: dict[str, Any] = {}
    for key in chosen:
        with safe_open(str(candidates[key][2]), "pt") as f:
            tensor = f.get_tensor(key)
        if tensor.is_floating_point() and tensor.element_size() > 1:
            found[key] = tensor.float()
    return found


def _sources(checkpoint: Path, floats: dict[str, Any],
             tmp: Path) -> Iterator[tuple[str, tuple[Path, dict[str, Any], dict[str, Any]]]]:
    """The checkpoints a method may read, with the float weights each holds and its config.json:
    the demo itself, then an fp8 block-quantized copy of its projections, then a GGUF file of
    them in Q8_0 (references: the dequantized values)."""
    import torch
    from safetensors.torch import save_file

    from rtpcore.checkpoint import quantize_fp8_blocks

    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    yield "the float checkpoint", (checkpoint, floats, config)
    tensors, reference = {}, {}
    bo, bi = _FP8_BLOCK
    for key, weight in floats.items():
        q, scale = quantize_fp8_blocks(weight, _FP8_BLOCK)
        tensors[key], tensors[key + "_scale_inv"] = q, scale
        rows, cols = weight.shape
        full = scale.repeat_interleave(bo, dim=0).repeat_interleave(bi, dim=1)[:rows, :cols]
        reference[key] = q.to(torch.float32) * full  # DeepSeek-V3's dequantization, written out
    path = tmp / "fp8"
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    fp8 = {**config, "quantization_config": {"quant_method": "fp8", "weight_block_size": list(_FP8_BLOCK),
                                             "activation_scheme": "dynamic", "fmt": "e4m3"}}
    (path / "config.json").write_text(json.dumps(fp8), encoding="utf-8")
    yield f"an fp8 copy (blocks of {bo} x {bi})", (path, reference, fp8)
    yield from _gguf_source(floats, tmp, config)


def _gguf_source(floats: dict[str, Any], tmp: Path,
                 config: dict[str, Any]) -> Iterator[tuple[str, tuple[Path, dict[str, Any], dict[str, Any]]]]:
    """A GGUF file of the projections in Q8_0 (those whose width is a multiple of 32), under
    their checkpoint names."""
    import gguf
    import torch
    from gguf.quants import dequantize, quantize


    kept = {k: w for k, w in floats.items() if w.shape[1] % 32 == 0}
    if not kept:
        return
    path = tmp / "projections.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    reference = {}
    for key, weight in kept.items():
        blocks = quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(key, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        reference[key] = torch.from_numpy(dequantize(blocks, gguf.GGMLQuantizationType.Q8_0).copy()).reshape(
            weight.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    yield "a GGUF file in Q8_0", (path, reference, config)


def _check_layers(method: Any, path: Path, reference: dict[str, Any], source: str, device: Any) -> str:
    import torch

    from rtpcore.checkpoint import load_checkpoint
    from rtpcore.models.layers import Linear, weight_quantization
    from rtpcore.quantization import Int8Method

    weights = load_checkpoint(path, list(reference), dtype=torch.float32, device=device, quantization=method)
    generator = torch.Generator().manual_seed(0)
    kernels, rules = set(), set()
    for i, (key, w_ref) in enumerate(reference.items()):
        if key not in weights:
            raise fail("quantization_method", f"loading {source} through {method!r} lost {key!r}; it returned "
                                              f"{sorted(weights)}")
        out_f, in_f = w_ref.shape
        bias = torch.randn(out_f, generator=generator) * 0.1 if i % 2 == 0 else None
        with weight_quantization(method):
            layer = Linear(weights[key], None if bias is None else bias.to(device))
        kernels.add(layer.kernel)
        where = f"{key} ({out_f} x {in_f}, from {source}, kernel {layer.kernel})"
        x = torch.randn(2, 4, in_f, generator=generator)
        with torch.inference_mode():
            y = layer(x.to(device))
            if tuple(y.shape) != (2, 4, out_f) or y.dtype != torch.float32 or y.device.type != device.type:
                raise fail("quantization_method", f"{where}: input {tuple(x.shape)} float32 gave "
                                                  f"{tuple(y.shape)} {y.dtype} on {y.device}")
            b_eff = layer(torch.zeros(1, in_f, device=device)).float().cpu()[0]
            w_eff = (layer(torch.eye(in_f, device=device)).float().cpu() - b_eff).T  # (out, in)
        b_ref = torch.zeros(out_f) if bias is None else bias
        rows = x.reshape(-1, in_f)
        own = layer.kernel == (method.kernel or method.name)  # create_weights built it: apply computes it
        family = "float" if not own else "int8" if isinstance(method, Int8Method) else \
            "gguf" if getattr(method, "gguf_types", ()) else "e4m3"
        w_bound, bound, rule = _bounds(family, w_ref, rows)
        rules.add(rule)
        _within(where, "the effective weight (the layer's output for unit rows)", w_eff, w_ref, w_bound, rule)
        _within(where, "the effective bias (the output for the zero row)", b_eff, b_ref,
                1e-6 * (1 + b_ref.abs()), "float32 rounding")
        _within(where, "the output for random rows", y.float().cpu().reshape(-1, out_f), rows @ w_ref.T + b_ref,
                bound, rule)
    return f"{', '.join(reference)} from {source}, kernel {', '.join(sorted(kernels))}, within {'; '.join(rules)}"


def _bounds(family: str, w_ref: Any, rows: Any) -> tuple[Any, Any, str]:
    """``(per weight (out, in), per output (n, out), the rule in words)`` of a method family:
    ``float`` (the layer kept rtpcore's float kernels: the loaded weight is the checkpoint's,
    dequantized), ``int8`` (half a step of the row), ``gguf`` (8-bit activations per block) or
    ``e4m3`` (weights and activations)."""
    amax = w_ref.abs().amax(dim=1, keepdim=True)  # (out, 1)
    magnitude = rows.abs() @ w_ref.abs().T  # (n, out): sum |x||w|
    if family == "float":
        w_bound = 2.0**-22 * w_ref.abs()
        bound = rows.abs() @ w_bound.T
        rule = "float32 rounding (dequantized at load, float kernels)"
    elif family == "gguf":  # the blocks as stored; activations quantized per block of 32 to 8 bits
        w_bound = 2.0**-9 * w_ref.abs()  # a unit row's block scale is stored as float16
        n, k = rows.shape
        x_amax = rows.abs().reshape(n, k // 32, 32).amax(dim=-1)  # (n, blocks)
        w_sums = w_ref.abs().reshape(w_ref.shape[0], k // 32, 32).sum(dim=-1)  # (out, blocks)
        bound = x_amax @ w_sums.T / 254.0 + 2.0**-9 * magnitude
        rule = "8-bit activations per block of 32 (amax / 254 per value), weights as stored"
    elif family == "int8":
        w_bound = (amax / 254.0).expand_as(w_ref) * (1 + 1e-5)
        bound = rows.abs() @ w_bound.T
        rule = "half an int8 step of its row (amax / 254)"
    else:  # each weight and each activation rounded as e4m3
        w_bound = _E4M3_ROUND * w_ref.abs() + amax * _E4M3_STEP / _E4M3_MAX
        x_floor = rows.abs().amax(dim=1, keepdim=True) * _E4M3_STEP / _E4M3_MAX
        bound = ((2 * _E4M3_ROUND + _E4M3_ROUND**2) * magnitude + rows.abs() @ w_bound.T
                 + x_floor * (w_ref.abs() + w_bound).sum(dim=1))
        rule = "e4m3 rounding of weights and activations (2**-4 relative + the subnormal step)"
    floor = 1e-6 * amax
    accumulation = 4 * rows.shape[1] * 2.0**-24 * magnitude + rows.abs() @ floor.expand_as(w_ref).T
    return w_bound + floor, bound + accumulation + 1e-6, rule


def _within(where: str, what: str, seen: Any, expected: Any, bound: Any, rule: str) -> None:
    import torch

    excess = (seen - expected).abs() - bound
    bad = ~(excess <= 0)  # NaN counts as over
    if bool(bad.any()):
        index = tuple(int(i) for i in torch.nonzero(bad)[0])
        worst = int(torch.nan_to_num(excess, nan=float("inf")).argmax())
        flat = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), excess.shape))
        raise fail("quantization_method", f"{where}: {what} is off the float reference by more than {rule} at "
                                          f"{int(bad.sum())} of {bad.numel()} elements; first at {list(index)}: "
                                          f"{float(seen[index])!r} vs {float(expected[index])!r} (bound "
                                          f"{float(bound[index]):.3g}); worst at {list(flat)}: {float(seen[flat])!r} "
                                          f"vs {float(expected[flat])!r}")


# -- logits_processor ------------------------------------------------------------------------


_VOCAB = 256  # the logits' width when the checkpoint does not say (a byte vocabulary)


def logits_processor(ctx: KitContext, name: str) -> str | None:
    import torch

    from rtpcore.engine.sample.params import SamplingParams
    from rtpcore.errors import RtpcoreError
    from rtpcore.logits import BatchUpdate

    cls = _seam_class(ctx, "logits_processors", name)
    checkpoint = ctx.demo_checkpoint(ctx.demo_model_types()[0])
    with ctx.engine(checkpoint, logits_processors=[name], tokens_per_block=4) as engine:
        try:
            generated = engine.generate([list(p) for p in _PROMPTS[:3]], max_new_tokens=4, stop_token_ids=[])
        except RtpcoreError as exc:
            cause = f" (caused by {type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else ""
            raise fail("logits_processor", f"generating with logits_processors=[{name!r}] raised "
                                           f"{type(exc).__name__}: {exc}{cause}") from None
        config, device, vocab = engine.config, engine.device, engine.vocab_size or _VOCAB
    if any(len(ids) != 4 for ids in generated):
        raise fail("logits_processor", f"an engine with {name!r} generated {generated!r}: want 4 tokens per prompt")
    params = [SamplingParams(max_tokens=8, seed=r) for r in range(3)]
    prompts = [list(p) for p in _PROMPTS[:3]]
    outputs: list[list[int]] = [[11, 12], [], [13]]
    for p in params:
        cls.validate_params(p)
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, vocab, generator=generator) * 3).to(device)
    rows = [(r, params[r], prompts[r], outputs[r]) for r in range(3)]

    def apply(processor: Any, x: Any, when: str) -> Any:
        out = processor.apply(x.clone())
        if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
            shown = (f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor)
                     else f"{type(out).__name__}")
            raise fail("logits_processor", f"{when}: apply() of {tuple(x.shape)} {x.dtype} logits on {x.device} "
                                           f"returned {shown}")
        return out

    batch = cls(config, device)
    batch.update_state(BatchUpdate(3, added=rows))
    together = apply(batch, logits, "3 rows added")
    # Rows 0 and 2 leave; row 1's request moves to row 0.
    batch.update_state(BatchUpdate(1, removed=(0, 2), moved=((0, 1),)))
    _same_row(apply(batch, logits[1:2], "rows 0 and 2 removed, row 1 moved to 0")[0], together[1], 1,
              "alone after rows 0 and 2 were removed and it moved to row 0")
    # They come back behind it: the rows are now (1, 0, 2).
    batch.update_state(BatchUpdate(3, added=[(1, *rows[0][1:]), (2, *rows[2][1:])]))
    again = apply(batch, logits[[1, 0, 2]], "rows 0 and 2 added back as rows 1 and 2")
    for row, at in ((0, 1), (1, 0), (2, 2)):
        _same_row(again[at], together[row], row, f"in row {at} after the others left and came back")
    for r in range(3):
        alone = cls(config, device)
        alone.update_state(BatchUpdate(1, added=[(0, *rows[r][1:])]))
        _same_row(apply(alone, logits[r:r + 1], f"row {r} alone")[0], together[r], r, "alone in a fresh instance")
    return f"rows independent; generated {sum(map(len, generated))} tokens"


def _same_row(seen: Any, expected: Any, row: int, how: str) -> None:
    import torch

    rtol, atol = ROW_TOLERANCE
    close = torch.isclose(seen, expected, rtol=rtol, atol=atol, equal_nan=True)
    if not bool(close.all()):
        bad = torch.nonzero(~close).flatten().tolist()
        i = bad[0]
        raise fail("logits_processor", f"request of row {row}, {how}: {len(bad)} of {seen.numel()} logits differ from "
                                       f"its row in the batch of 3; first at token {i}: {float(seen[i])!r} vs "
                                       f"{float(expected[i])!r}")


# -- platform --------------------------------------------------------------------------------


def platform(ctx: KitContext, name: str) -> str | None:
    import torch

    from rtpcore.platforms import availability

    cls = _seam_class(ctx, "platforms", name)
    try:
        answer = cls.is_available()
    except Exception:  # allowed (docs/plugins.md "Platforms"): shown to the user, so a skip quoting it
        answer = None
    if answer is not None and not isinstance(answer, bool):
        raise fail("platform", f"{name}.is_available() returned {answer!r} ({type(answer).__name__}): want True or "
                               "False")
    available, why = availability(cls)
    if not available:
        raise CheckSkipped(f"platform {name!r} is unavailable here: {why}")
    info = cls.memory_info()
    if not (isinstance(info, tuple) and len(info) == 2 and all(type(v) is int for v in info)):
        raise fail("platform", f"{name}.memory_info() returned {info!r}: want (free_bytes, total_bytes), two ints")
    free, total = info
    if not 0 <= free <= total or total == 0:
        raise fail("platform", f"{name}.memory_info() returned (free={free}, total={total}): want 0 <= free <= total "
                               "and total > 0")
    dtypes = cls.supported_dtypes
    wrong = [d for d in dtypes if not (isinstance(d, str) and isinstance(getattr(torch, d, None), torch.dtype))]
    if not dtypes or wrong:
        raise fail("platform", f"{name}.supported_dtypes is {dtypes!r}: want names of torch dtypes "
                               f"('float32', 'bfloat16', ...); not one: {wrong!r}")
    if not isinstance(cls.dist_backend, str) or not cls.dist_backend:
        raise fail("platform", f"{name}.dist_backend is {cls.dist_backend!r}: want a torch.distributed backend's name")
    backends = ctx.registry.seam_names("attention_backends")
    default = cls.default_attention_backend
    if default is not None and default not in backends:
        raise fail("platform", f"{name}.default_attention_backend is {default!r}: want None or a registered attention "
                               f"backend ({', '.join(backends)})")
    if not isinstance(cls.supports_graphs, bool):
        raise fail("platform", f"{name}.supports_graphs is {cls.supports_graphs!r}: want True or False")
    try:
        device = torch.device(cls.device_type)
        torch.empty(1, device=device)
    except (RuntimeError, TypeError) as exc:
        raise fail("platform", f"{name}.device_type is {cls.device_type!r}, and torch refuses it as an available "
                               f"device: {type(exc).__name__}: {exc}") from None
    return f"{cls.device_type}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free, {', '.join(dtypes)}"
