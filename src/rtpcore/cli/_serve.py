"""``rtpcore serve``: an OpenAI-compatible HTTP server over one engine (docs/design.md §8).

A thin shell: it resolves the allowlist, builds an :class:`~rtpcore.AsyncEngine` and the app over it
(:func:`rtpcore.serving.app.build_app`, which uses the engine's own tokenizer and chat
template; without a tokenizer, or with ``--skip-tokenizer-init``, it serves token ids only),
and runs it with uvicorn. SIGTERM or SIGINT stops accepting, lets running requests finish
within ``--shutdown-timeout`` seconds (then cuts them: each ends with finish_reason "abort", a
stream with its last chunk and ``[DONE]``), closes the engine and exits 0 (a second SIGINT
quits at once). Connections without complete request headers are closed after
``--header-timeout`` seconds; past ``--max-connections`` open connections every request but
``/health`` is a 503 (``rtpcore.serving.server``). When the engine breaks (a fault that is not a request's: a lost rank, a
device fault) ``/health`` answers 503, the server drains the same way and exits 1, so that a
supervisor restarts it.

The API key comes from ``--api-key``, else the file ``--api-key-file`` names, else the
environment variable ``RTPCORE_API_KEY``; uvicorn logs through the handler
:func:`rtpcore.cli.main` installs, at ``--log-level``, access log included.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rtpcore.cli._args import (
    add_log_level_argument,
    add_model_arguments,
    checkpoint_name,
    model_path,
    parse_bytes,
    positive_int,
)
from rtpcore.reasoning import REASONING_FIELDS

__all__ = ["API_KEY_ENV", "add_parser", "api_key"]

API_KEY_ENV = "RTPCORE_API_KEY"
DEFAULT_HEADER_TIMEOUT = 10.0  # rtpcore.serving.server's (not imported here: --help stays light)
DEFAULT_MAX_CONNECTIONS = 2048
DEFAULT_STREAM_IDLE_TIMEOUT = 300.0
DEFAULT_STREAM_BUFFER_BYTES = 768 << 10  # rtpcore.serving.state's


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a TCP port 1-65535, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _choices(text: str) -> int:
    """``--max-n``: 1 to the engine's own limit of choices (SamplingParams' MAX_N, 256)."""
    value = positive_int(text)
    if value > 256:
        raise argparse.ArgumentTypeError(f"must be at most 256 (the engine's limit of choices), got {text!r}")
    return value


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a checkpoint over an OpenAI-compatible HTTP API",
        description="Serve a checkpoint (or a demo model) with continuous batching over an "
        "OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.",
    )
    add_model_arguments(p, "serve")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port to listen on (default: %(default)s)")
    p.add_argument("--served-model-name", metavar="NAME", help="the model name clients send (default: the "
                   "checkpoint folder's name, or the demo name)")
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1/ endpoints. "
                      "A key on the command line is visible to every user of the machine (ps, /proc): "
                      f"prefer --api-key-file or ${API_KEY_ENV} (default: ${API_KEY_ENV} when set, else "
                      "no key: every client is served)")
    keys.add_argument("--api-key-file", metavar="PATH", type=Path, help="read the API key from this file "
                      "(surrounding whitespace stripped), instead of --api-key")
    p.add_argument("--tool-call-parser", metavar="NAME", default=None,
                   help="how the model writes tool calls, for tool_choice 'auto': hermes, llama3_json, or a "
                   "parser a loaded plugin registers (rtpcore_register_tool_parsers) (default: none; "
                   "tool_choice 'auto' is then answered 400)")
    p.add_argument("--reasoning-parser", metavar="NAME", default=None,
                   help="how the model marks its reasoning: deepseek_r1, qwen3, or a parser a loaded plugin "
                   "registers (rtpcore_register_reasoning_parsers); chat answers then carry it apart from the "
                   "content, in message.reasoning (streamed: delta.reasoning) (default: none; the reasoning "
                   "stays in the content)")
    p.add_argument("--reasoning-field", choices=REASONING_FIELDS, default="reasoning",
                   help="the field the reasoning is returned in: vLLM's current name, or its older one "
                   "(default: %(default)s)")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="serve without loading the checkpoint's tokenizer, as for a checkpoint that has none: "
                   "prompts are token ids on /v1/completions, answers carry token_ids and no text; chat, text "
                   "prompts, stop strings, logprobs and response_format are answered 400")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (prompt tokens found in the prefix "
                   "cache). Off by default: the count tells one client whether another sent the same prompt "
                   "before; clients that share nothing should also send distinct cache_salt values")
    p.add_argument("--max-request-bytes", type=parse_bytes, default=None, metavar="BYTES",
                   help="a request body over this size is answered 413 before it is parsed (default: 32MiB)")
    limits = p.add_argument_group("request caps", "each refused as a 400 naming the field and the cap "
                                  "(docs/serving.md)")
    for flag, default, what, kind in (
        ("--max-logit-bias", 1024, "logit_bias entries of one request", positive_int),
        ("--max-stop-strings", 16, "stop strings of one request (each at most 1024 characters)", positive_int),
        ("--max-stop-token-ids", 1024, "stop_token_ids of one request", positive_int),
        ("--max-n", 16, "choices (n) of one request, at most 256", _choices),
        ("--max-tools", 128, "tools of one chat request", positive_int),
        ("--max-schema-bytes", 4 << 20, "bytes of one response_format or tool schema, as JSON (e.g. 8MiB)",
         parse_bytes),
    ):
        limits.add_argument(flag, type=kind, default=default, metavar="N", help=f"{what} (default: %(default)s)")
    p.add_argument("--max-waiting", type=positive_int, default=256, metavar="N",
                   help="requests that may wait for admission; one more is answered 429 (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="torch compute threads of a one-rank engine (default: torch's). Fewer threads "
                   "than cores leaves the HTTP event loop a core: more tokens/s under many streams, "
                   "slower prefill (docs/benchmarks.md, Serving)")
    p.add_argument("--shutdown-timeout", type=_seconds, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT, seconds running requests may take to finish; then each is cut "
                   "(finish_reason 'abort', streams end with [DONE]) (default: %(default)s)")
    p.add_argument("--header-timeout", type=_positive_seconds, default=DEFAULT_HEADER_TIMEOUT, metavar="S",
                   help="close a connection whose request headers have not all come S seconds after it "
                   "opened or after its previous answer; a request body that stops arriving for S seconds "
                   "is answered 408 (default: %(default)s)")
    p.add_argument("--stream-buffer-bytes", type=parse_bytes, default=DEFAULT_STREAM_BUFFER_BYTES, metavar="BYTES",
                   help="unsent bytes a streamed answer may hold (its client reads slower than the model "
                   "writes) before its requests pause, holding no KV blocks, until the client reads again "
                   "(default: %(default)s, 768KiB)")
    p.add_argument("--stream-idle-timeout", type=_positive_seconds, default=DEFAULT_STREAM_IDLE_TIMEOUT, metavar="S",
                   help="abort a connection whose client has read nothing of its answer for S seconds, and "
                   "its requests with it, freeing their KV blocks (default: %(default)s)")
    p.add_argument("--max-connections", type=positive_int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="with more than N connections open, every request but /health is answered 503 "
                   "(default: %(default)s)")
    add_log_level_argument(p)
    p.set_defaults(func=run, _parser=p)


def api_key(args: argparse.Namespace, parser: argparse.ArgumentParser,
            environ: Mapping[str, str] = os.environ) -> str | None:
    """The key clients must send: ``--api-key``, else ``--api-key-file``'s content, else
    ``$RTPCORE_API_KEY``, each stripped of surrounding whitespace; None when none is given.
    A key that is empty, unreadable, or not sendable in an HTTP header is a usage error
    (exit status 2) naming where it came from: the server never starts with a key no client
    could send, nor silently without the key it was given."""
    if args.api_key is not None:
        source, key = "--api-key", args.api_key
    elif args.api_key_file is not None:
        source = f"--api-key-file {str(args.api_key_file)!r}"
        try:
            key = args.api_key_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            parser.error(f"{source}: cannot read the API key: {reason}")
    elif API_KEY_ENV in environ:
        source, key = f"the environment variable {API_KEY_ENV}", environ[API_KEY_ENV]
    else:
        return None
    key = key.strip()
    if not key:
        parser.error(f"{source}: the API key is empty")
    if not all(33 <= ord(c) < 127 for c in key):  # what an 'Authorization: Bearer' header carries
        parser.error(f"{source}: the API key must be printable ASCII without spaces")
    return key


def run(args: argparse.Namespace) -> int:
    key = api_key(args, args._parser)  # a usage error before anything loads
    path, engine_options = model_path(args, args._parser)  # validates the allowlist first
    import torch
    import uvicorn

    from rtpcore.engine.async_engine import AsyncEngine
    from rtpcore.serving.app import begin_drain, build_app, cut_requests
    from rtpcore.serving.server import Server, protocol_class
    from rtpcore.serving.state import RequestLimits

    if engine_options.get("kv_cache_prefault") is None:  # a server commits its KV pool at start
        engine_options["kv_cache_prefault"] = True
    engine = AsyncEngine.from_pretrained(
        path,
        max_waiting=args.max_waiting,
        **engine_options,
    )
    if args.threads is not None and args.tensor_parallel_size == 1:  # a group sets its ranks' threads
        torch.set_num_threads(args.threads)
    name = args.served_model_name or checkpoint_name(args, path)
    limits: dict[str, Any] = {} if args.max_request_bytes is None else {"max_request_bytes": args.max_request_bytes}
    if args.tool_call_parser is not None:
        from rtpcore.serving.tool_parsers import find_tool_parser, tool_parser_names

        registry = engine.engine.plugin_registry
        parser = find_tool_parser(args.tool_call_parser, registry)
        if parser is None:
            engine.close()
            args._parser.error(
                f"--tool-call-parser {args.tool_call_parser!r} is not a known parser; known: "
                f"{', '.join(tool_parser_names(registry))} (a plugin adds more with rtpcore_register_tool_parsers)"
            )
        limits["tool_call_parser"] = parser
    if args.reasoning_parser is not None:
        registry = engine.engine.plugin_registry
        thinker = registry.seam_class("reasoning_parsers", args.reasoning_parser)
        if thinker is None:
            engine.close()
            args._parser.error(
                f"--reasoning-parser {args.reasoning_parser!r} is not a known parser; known: "
                f"{', '.join(registry.seam_names('reasoning_parsers'))} (a plugin adds more with "
                "rtpcore_register_reasoning_parsers)"
            )
        limits["reasoning_parser"] = thinker
    server: Server | None = None
    try:  # the engine's tokenizer and chat template load here: a broken one ends the start
        app = build_app(engine, model_name=name, api_key=key, on_shutdown=engine.aclose,
                        skip_tokenizer=args.skip_tokenizer_init, limits=RequestLimits(
                            max_logit_bias=args.max_logit_bias, max_stop_strings=args.max_stop_strings,
                            max_stop_token_ids=args.max_stop_token_ids, max_n=args.max_n,
                            max_tools=args.max_tools, max_schema_bytes=args.max_schema_bytes),
                        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                        header_timeout=args.header_timeout, max_connections=args.max_connections,
                        stream_buffer_bytes=args.stream_buffer_bytes, own_process=True,
                        reasoning_field=args.reasoning_field,
                        open_connections=lambda: server.open_connections if server is not None else 0, **limits)
    except BaseException:
        engine.close()
        raise
    # log_config=None: uvicorn's loggers get no handlers of their own and propagate to the one
    # rtpcore.cli installed (one format on stderr); log_level sets theirs, access log included.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, log_level=args.log_level,
                            lifespan="on", http=protocol_class(args.header_timeout, args.stream_idle_timeout))
    # uvicorn handles SIGTERM/SIGINT (drain, then stop) and afterwards re-raises the signal
    # to the handler it found: a no-op one here, so that a drained shutdown exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    core = engine.engine
    details = f"{core.model_type} on {core.device}"
    if core.draft is not None:
        details += f", draft {args.draft_model!r} ({core.draft.model_type}, {core.config.num_speculative_tokens} tokens per step)"
    print(f"rtpcore: serving {name!r} ({details}) on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    server = Server(config, drain_timeout=args.shutdown_timeout, on_drain=lambda: begin_drain(app),
                    on_cut=lambda: cut_requests(app))

    def stop_serving(error: Exception) -> None:  # the engine broke: drain, then exit non-zero
        print(f"rtpcore: error: the engine is broken, stopping: {error}", file=sys.stderr, flush=True)
        server.should_exit = True

    engine.on_broken.append(stop_serving)
    try:
        server.run()
    finally:
        engine.close()
    return 1 if engine.broken is not None else 0
