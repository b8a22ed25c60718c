"""Arguments and argument types shared by the subcommands."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from rtpcore.checkpoint.hub import hub_id
from rtpcore.engine.config import CliFlag, EngineOptions
from rtpcore.engine.worker.devices import check_device_form, resolve_platform
from rtpcore.errors import DeviceError
from rtpcore.models.cpu_isa import apply_cpu_isa
from rtpcore.plugins.allowlist import Allowlist, add_allowlist_arguments

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_log_level_argument(p: argparse.ArgumentParser) -> None:
    """``--log-level``, which every subcommand takes: :func:`rtpcore.cli.main` configures logging
    with it before the command runs."""
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", type=str.lower,
                   help="the least severe of rtpcore's log records shown on stderr (default: %(default)s)")


def positive_int(text: str) -> int:
    """argparse type: a positive integer, else a usage error (exit status 2) naming the text."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip
_BYTES_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """argparse ``type=`` for ``--memory``: ``1073741824``, ``8GiB``, ``512MB``, ``1.5G``."""
    match = _BYTES_RE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid byte count {text!r}: use an integer with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    number = match.group(1)
    value = int(number) * _UNITS[unit] if "." not in number else int(float(number) * _UNITS[unit])
    return value


def _fraction(text: str) -> float:
    """argparse type: a number in (0, 1], else a usage error naming the text."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def names_arg(text: str) -> tuple[str, ...]:
    """argparse type: ``NAME[,NAME]`` as a tuple of names, else a usage error naming the text."""
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated names like a,b, got {text!r}")
    return names


def device_arg(text: str) -> str:
    """argparse ``type=`` for ``--device``: the form rule of :func:`rtpcore.engine.worker.devices.check_device_form`
    (imports no torch); a malformed value is a usage error (exit status 2) naming it."""
    try:
        return check_device_form(text)
    except DeviceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_model_arguments(p: argparse.ArgumentParser, command: str) -> None:
    """CHECKPOINT or ``--demo NAME``, the allowlist flags, and the engine options ``command``
    takes (:func:`add_engine_arguments`)."""
    p.add_argument("checkpoint", nargs="?", help="checkpoint directory (config.json, safetensors, tokenizer.json), "
                   "a .gguf file (or a folder holding one, or a split set's part), or a Hugging Face Hub id "
                   "org/name[@revision]; give it or --demo")
    p.add_argument("--demo", metavar="NAME", help="use the demo model of this model type (random weights, "
                   "built on first use under $XDG_CACHE_HOME/rtpcore/demo)")
    add_allowlist_arguments(p)
    add_engine_arguments(p, command)


_KINDS: dict[str, Callable[[str], Any]] = {
    "positive_int": positive_int, "bytes": parse_bytes, "fraction": _fraction, "device": device_arg, "names": names_arg,
}


def add_engine_arguments(p: argparse.ArgumentParser, command: str) -> None:
    """A flag for every engine option that ``command`` takes, generated from the options'
    declarations (``rtpcore.engine.config.EngineOptions``: one field each, with its default and
    its :class:`~rtpcore.engine.config.CliFlag`); :func:`engine_options` reads them back."""
    for field in attrs.fields(EngineOptions):
        flag: CliFlag | None = field.metadata["cli"]
        if flag is None or (flag.commands is not None and command not in flag.commands):
            continue
        if flag.negative:  # --no-NAME: False; unset: the option's default (True, or None = automatic)
            if field.default is True:
                p.add_argument(flag.flag(field.name), dest=field.name, action="store_false", help=flag.help)
            else:
                p.add_argument(flag.flag(field.name), dest=field.name, action="store_const", const=False,
                               default=field.default, help=flag.help)
            continue
        kwargs: dict[str, Any] = {"dest": field.name, "default": field.default, "help": flag.help}
        if flag.kind is not None:
            kwargs["type"] = _KINDS[flag.kind]
        if flag.choices is not None:
            kwargs["choices"] = list(flag.choices)
        if flag.metavar is not None:
            kwargs["metavar"] = flag.metavar
        p.add_argument(flag.flag(field.name), **kwargs)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options the command line gave (every flag :func:`add_engine_arguments` added,
    its default when not given), as ``Engine.from_pretrained`` keywords."""
    return {name: getattr(args, name) for name in EngineOptions.names() if hasattr(args, name)}


def check_logits_processors(names: tuple[str, ...], allow: Allowlist, parser: argparse.ArgumentParser) -> None:
    """A usage error (exit status 2) for a name of ``--logits-processors`` that no loaded
    plugin registers, listing the known ones; loads the allowlist's plugins (as the engine will)."""
    from rtpcore.engine.sample.logits_processors import resolve_logits_processors
    from rtpcore.errors import LogitsProcessorError
    from rtpcore.plugins.loading import load_plugins

    try:
        resolve_logits_processors(names, load_plugins(allow.resolve()))
    except LogitsProcessorError as exc:
        parser.error(f"--logits-processors {exc.processor!r} is not a known logits processor; known: "
                     f"{', '.join(exc.known) or 'none'} (a plugin adds more with rtpcore_register_logits_processors; "
                     "load it with --plugins)")


def checkpoint_name(args: argparse.Namespace, path: Path) -> str:
    """What the checkpoint is called: the demo's name, a Hub id's repository (``org/name``),
    else the folder's name."""
    if args.demo is not None:
        return str(args.demo)
    hid = hub_id(args.checkpoint)
    return hid.repo_id if hid is not None else path.resolve().name


def model_path(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Path, dict[str, Any]]:
    """The checkpoint folder (a demo's is built on first use) and the engine keywords of the
    arguments :func:`add_model_arguments` added; the allowlist is validated first, importing nothing,
    then the device (a device torch cannot see raises DeviceError before a demo is built).

    A Hub id (``org/name[@revision]``, not an existing path) as CHECKPOINT or ``--draft-model``
    is fetched here (:func:`rtpcore.checkpoint.resolve.resolve_checkpoints`: only the shards the engine
    reads): the folder returned, and the draft among the keywords, are its snapshot folders. With
    ``--gguf-file NAME`` the path returned is that GGUF file's (in the folder, or fetched alone)
    and the keywords' ``gguf_file`` is None: the path names the file."""
    apply_cpu_isa(getattr(args, "cpu_isa", None))  # first: torch reads its caps at its first product
    if (args.checkpoint is None) == (args.demo is None):
        parser.error("give exactly one of CHECKPOINT or --demo NAME")
    if args.num_speculative_tokens and args.draft_model is None:
        parser.error("--num-speculative-tokens needs --draft-model (a draft checkpoint or 'mtp')")
    allow = Allowlist.from_args(args)
    # The engine checks it against tensor_parallel_size too; a plugin platform needs the plan's plugins.
    from rtpcore.plugins.loading import load_plugins

    resolve_platform(args.device, load_plugins(allow.resolve()))  # a device nothing here can run fails now
    device = args.device
    if getattr(args, "logits_processors", None):
        check_logits_processors(args.logits_processors, allow, parser)
    plugins = [str(r) for r in allow.plugins]
    if args.demo is not None:
        from rtpcore.testing import demo_checkpoint

        path = demo_checkpoint(args.demo, plugins=plugins, external_model_packages=allow.external_model_packages)
    else:
        path = Path(args.checkpoint)
    draft, gguf_file = args.draft_model, getattr(args, "gguf_file", None)
    if hub_id(args.checkpoint) is not None or hub_id(draft) is not None or gguf_file is not None:
        from rtpcore.checkpoint.resolve import resolve_checkpoints

        checkpoint = args.checkpoint if args.demo is None else path  # an id stays a str: a Path is a folder
        local, draft = resolve_checkpoints(checkpoint, draft, plan=allow.resolve(), gguf_file=gguf_file)
        path, gguf_file = Path(local), None
    return path, {
        **engine_options(args),
        "plugins": plugins,
        "external_model_packages": allow.external_model_packages,
        "allow_plugin_patches": allow.allow_plugin_patches,
        "device": device,
        "draft_model": draft,
        "gguf_file": gguf_file,
    }
