"""Reading ``config.json`` fields with named errors: the helpers model plugins share.

Each function reads one key of a parsed JSON object and returns a value of the
promised Python type, or raises :class:`~rtpcore.errors.ConfigFieldError` (a
``CheckpointError``, and a ``ValueError``) naming the file, the field and the
value::

    from rtpcore import config_fields as cf

    layers = cf.require_int(hf, "num_hidden_layers")                  # an int >= 1
    kv_heads = cf.optional_int(hf, "num_key_value_heads", heads, null_ok=True)
    eps = cf.optional_float(hf, "rms_norm_eps", 1e-6, positive=True)
    cf.check_divisible("num_attention_heads", heads, "num_key_value_heads", kv_heads)

The rules, the same for every field:

- ``true``/``false`` is not a number, and a numeric string (``"8"``) is not one either;
- an integer field refuses floats (``8.0`` included); a float field takes integers;
  NaN and infinities are refused;
- a missing key takes the default; ``null`` takes it only with ``null_ok=True``
  (for fields Hugging Face gives a meaning to null, e.g. ``"sliding_window": null``),
  otherwise ``null`` is an error;
- counts default to ``minimum=1``: zero and negative counts are errors.

Nested objects (``rope_scaling``) are read with ``section="rope_scaling"`` so the
error names ``rope_scaling.factor``. ``file`` names another file
(``generation_config.json``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from rtpcore.errors import ConfigFieldError

__all__ = [
    "check_divisible",
    "config_error",
    "optional_bool",
    "optional_float",
    "optional_int",
    "optional_mapping",
    "optional_str",
    "optional_str_list",
    "require_float",
    "require_int",
    "token_ids",
]

CONFIG_JSON = "config.json"
_MISSING: Any = object()
T = TypeVar("T")


def config_error(
    key: str, value: Any, rule: str, *, file: str = CONFIG_JSON, section: str | None = None
) -> ConfigFieldError:
    """The error for ``key`` holding ``value``: ``"config.json: key=value rule"``."""
    field = f"{section}.{key}" if section else key
    if value is _MISSING:
        message = f"{file}: {field} is missing ({rule})"
        value = None
    else:
        message = f"{file}: {field}={value!r} {rule}"
    return ConfigFieldError(message, file=file, field=field, value=value)


def _get(hf: Mapping[str, Any], key: str, default: Any, null_ok: bool) -> Any:
    value = hf.get(key, _MISSING)
    if value is _MISSING or (value is None and null_ok):
        return default
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value: Any, key: str, minimum: int, file: str, section: str | None) -> int:
    if not _is_int(value) or value < minimum:
        raise config_error(key, value, f"must be an integer >= {minimum}", file=file, section=section)
    return int(value)


def _float(
    value: Any, key: str, minimum: float | None, positive: bool, file: str, section: str | None
) -> float:
    if positive:
        rule = "must be a number > 0"
    elif minimum is not None:
        rule = f"must be a number >= {minimum}"
    else:
        rule = "must be a finite number"
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise config_error(key, value, rule, file=file, section=section)
    if (positive and value <= 0) or (minimum is not None and value < minimum):
        raise config_error(key, value, rule, file=file, section=section)
    return float(value)


def require_int(
    hf: Mapping[str, Any], key: str, *, minimum: int = 1, file: str = CONFIG_JSON, section: str | None = None
) -> int:
    """``hf[key]``, an integer >= ``minimum``; missing or null is an error."""
    if key not in hf:
        raise config_error(key, _MISSING, f"required: an integer >= {minimum}", file=file, section=section)
    return _int(hf[key], key, minimum, file, section)


def optional_int(
    hf: Mapping[str, Any],
    key: str,
    default: T,
    *,
    minimum: int = 1,
    null_ok: bool = False,
    file: str = CONFIG_JSON,
    section: str | None = None,
) -> int | T:
    """``hf[key]``, an integer >= ``minimum``, or ``default`` when missing (or null with ``null_ok``)."""
    value = _get(hf, key, _MISSING, null_ok)
    return default if value is _MISSING else _int(value, key, minimum, file, section)


def require_float(
    hf: Mapping[str, Any],
    key: str,
    *,
    minimum: float | None = None,
    positive: bool = False,
    file: str = CONFIG_JSON,
    section: str | None = None,
) -> float:
    """``hf[key]``, a finite number (``> 0`` with ``positive``, ``>= minimum``); missing or null is an error."""
    if key not in hf:
        raise config_error(key, _MISSING, "required: a number", file=file, section=section)
    return _float(hf[key], key, minimum, positive, file, section)


def optional_float(
    hf: Mapping[str, Any],
    key: str,
    default: T,
    *,
    minimum: float | None = None,
    positive: bool = False,
    null_ok: bool = False,
    file: str = CONFIG_JSON,
    section: str | None = None,
) -> float | T:
    """``hf[key]`` as a float (rules of :func:`require_float`), or ``default`` when missing
    (or null with ``null_ok``)."""
    value = _get(hf, key, _MISSING, null_ok)
    return default if value is _MISSING else _float(value, key, minimum, positive, file, section)


def optional_bool(
    hf: Mapping[str, Any],
    key: str,
    default: T,
    *,
    null_ok: bool = False,
    file: str = CONFIG_JSON,
    section: str | None = None,
) -> bool | T:
    """``hf[key]``, a JSON ``true``/``false`` (not ``0``/``1``, not ``"true"``), or ``default``."""
    value = _get(hf, key, _MISSING, null_ok)
    if value is _MISSING:
        return default
    if not isinstance(value, bool):
        raise config_error(key, value, "must be true or false", file=file, section=section)
    return value


def optional_str(
    hf: Mapping[str, Any],
    key: str,
    default: T,
    *,
    choices: Sequence[str] | None = None,
    null_ok: bool = False,
    file: str = CONFIG_JSON,
    section: str | None = None,
) -> str | T:
    """``hf[key]``, a string (one of ``choices`` when given), or ``default``."""
    value = _get(hf, key, _MISSING, null_ok)
    if value is _MISSING:
        return default
    if choices is not None and value not in choices:
        rule = f"is not supported; supported: {', '.join(map(repr, choices))}"
        raise config_error(key, value, rule, file=file, section=section)
    if not isinstance(value, str):
        raise config_error(key, value, "must be a string", file=file, section=section)
    return value


def optional_mapping(
    hf: Mapping[str, Any], key: str, *, file: str = CONFIG_JSON, section: str | None = None
) -> Mapping[str, Any]:
    """``hf[key]``, a JSON object; empty when missing or null (HF's "not configured")."""
    value = _get(hf, key, {}, True)
    if not isinstance(value, Mapping):
        raise config_error(key, value, "must be a JSON object or null", file=file, section=section)
    return value


def optional_str_list(
    hf: Mapping[str, Any],
    key: str,
    *,
    length: int | None = None,
    choices: Sequence[str] | None = None,
    file: str = CONFIG_JSON,
    section: str | None = None,
) -> tuple[str, ...] | None:
    """``hf[key]``, a list of strings (``length`` of them, each one of ``choices`` when
    given); None when missing or null."""
    value = _get(hf, key, None, True)
    if value is None:
        return None
    what = "a list of strings" if length is None else f"a list of {length} strings"
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise config_error(key, value, f"must be {what}", file=file, section=section)
    if length is not None and len(value) != length:
        raise config_error(key, value, f"must be {what}, got {len(value)}", file=file, section=section)
    if choices is not None:
        bad = [v for v in value if v not in choices]
        if bad:
            rule = f"holds {bad[0]!r}; supported: {', '.join(map(repr, choices))}"
            raise config_error(key, value, rule, file=file, section=section)
    return tuple(value)


def token_ids(
    hf: Mapping[str, Any], key: str, *, file: str = CONFIG_JSON, section: str | None = None
) -> tuple[int, ...]:
    """A token-id field such as ``eos_token_id``: an integer >= 0 or a list of them;
    ``()`` when missing or null."""
    value = _get(hf, key, None, True)
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(_is_int(t) and t >= 0 for t in ids):
        rule = "must be a token id (an integer >= 0) or a list of them"
        raise config_error(key, value, rule, file=file, section=section)
    return tuple(ids)


def check_divisible(key: str, value: int, by_key: str, by: int, *, file: str = CONFIG_JSON) -> None:
    """Raise naming both fields unless ``value`` (read from ``key``) is a multiple of
    ``by`` (read from ``by_key``); both already validated as integers >= 1."""
    if value % by:
        raise config_error(key, value, f"must be divisible by {by_key}={by!r}", file=file)
