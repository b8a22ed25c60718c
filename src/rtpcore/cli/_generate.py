"""``rtpcore generate``: run a checkpoint (or a demo model) on one prompt.

``--prompt`` text is encoded with the checkpoint's ``tokenizer.json``
(:mod:`rtpcore.engine.text.tokenizer`); with ``--chat`` it is first rendered as one user
message by the checkpoint's chat template (:mod:`rtpcore.engine.text.chat_template`).

A thin shell over :meth:`rtpcore.Engine.from_pretrained` and
:func:`rtpcore.testing.demo.demo_checkpoint`. torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rtpcore.cli._args import add_log_level_argument, add_model_arguments, model_path, positive_int
from rtpcore.errors import RtpcoreError

__all__ = ["add_parser"]


def _prompt_ids(value: str) -> list[int]:
    try:
        ids = [int(x) for x in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids {value!r}: expected comma-separated integers like 1,2,3") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"--prompt-ids {value!r}: token ids must be >= 0")
    return ids


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate tokens from a checkpoint or a demo model",
        description="Generate tokens with the rtpcore engine. --demo NAME builds a small random-weight "
        "model of that model type on first use (cached under $XDG_CACHE_HOME/rtpcore/demo).",
    )
    add_model_arguments(p, "generate")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json, or --demo); "
                        "give it or --prompt-ids")
    prompt.add_argument("--prompt-ids", type=_prompt_ids, metavar="1,2,3",
                        help="prompt token ids, comma-separated, used as they are")
    p.add_argument(
        "--chat", action="store_true",
        help="render --prompt as one user message with the checkpoint's chat template (instruct models)",
    )
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                   help="most tokens to generate; the model's end-of-sequence token ends the output "
                   "sooner (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 is greedy (default: %(default)s)")
    p.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                   help="sample only from the K most likely tokens (default: every token)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample only from the most likely tokens whose probabilities add up to P, "
                   "in (0, 1] (default: every token)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the request's own random generator: the same seed samples the same "
                   "tokens (default: none, torch's global generator)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (prompt and output ids, text, model type) instead of the text")
    add_log_level_argument(p)
    p.set_defaults(func=run, _parser=p)


def _load_tokenizer(path: Path, demo: bool) -> Any | None:
    """The checkpoint's tokenizer; a demo without tokenizer.json gets the byte tokenizer."""
    from rtpcore.engine.text.tokenizer import Tokenizer, has_tokenizer

    if has_tokenizer(path):
        return Tokenizer.from_pretrained(path)
    if demo:
        from rtpcore.testing.demo import ByteTokenizer

        return ByteTokenizer()
    return None


def _encode(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    from rtpcore.testing.demo import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _decode(tokenizer: Any, ids: list[int]) -> str:
    from rtpcore.testing.demo import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.decode(ids)
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def _chat_prompt(path: Path, tokenizer: Any, text: str) -> list[int]:
    """``text`` as one user message through the checkpoint's chat template; the rendered
    prompt carries its own special tokens, so none are added (as transformers encodes it)."""
    from rtpcore.engine.text.chat_template import ChatTemplate

    rendered = ChatTemplate.from_pretrained(path).render([{"role": "user", "content": text}])
    return _encode(tokenizer, rendered, add_special_tokens=False)


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args._parser
    if args.chat and args.prompt is None:
        parser.error("--chat renders --prompt text; it cannot take --prompt-ids")
    if args.max_new_tokens < 0:
        parser.error(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    path, engine_options = model_path(args, parser)  # validates the allowlist first
    from rtpcore.engine import Engine
    from rtpcore.testing.demo import NOTICE

    tokenizer = _load_tokenizer(path, demo=args.demo is not None)
    if args.prompt is not None:
        if tokenizer is None:
            raise RtpcoreError(
                f"--prompt needs the checkpoint's tokenizer, {str(path / 'tokenizer.json')!r}, which is "
                "missing; or pass --prompt-ids"
            )
        ids = _chat_prompt(path, tokenizer, args.prompt) if args.chat else _encode(tokenizer, args.prompt)
    else:
        ids = args.prompt_ids
    with Engine.from_pretrained(path, max_batch_size=1, **engine_options) as engine:
        out = engine.generate(
            [ids],
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )[0]
        model_type = engine.model_type
        spec = engine.speculative_stats
    text = _decode(tokenizer, out) if tokenizer is not None else None
    if args.json:
        record = {
            "model_type": model_type,
            "checkpoint": str(path),
            "demo": args.demo is not None,
            "chat": args.chat,
            "prompt_ids": ids,
            "output_ids": out,
            "text": text,
        }
        if args.draft_model is not None:
            record["speculative"] = {
                "draft_model": args.draft_model, "proposed": spec.proposed, "accepted": spec.accepted,
            }
        print(json.dumps(record))
    else:
        print(text if text is not None else " ".join(map(str, out)))
    if args.demo is not None:
        print(f"note: {NOTICE}", file=sys.stderr)
    return 0
