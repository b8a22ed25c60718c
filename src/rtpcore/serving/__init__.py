"""Serving: text in, text out, over HTTP. AsyncEngine (``rtpcore.engine``) -> the
OpenAI-compatible app (``app.build_app``: validates, renders, streams) -> uvicorn with the
connection rules of ``server`` (``rtpcore serve``). The tokenizer, chat template and
detokenizer it uses are the engine's modules (``rtpcore.engine.text``). This package imports
nothing on import; torch, ``tokenizers`` and ``jinja2`` load with the module that needs them.
"""
