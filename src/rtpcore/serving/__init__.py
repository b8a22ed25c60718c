"""Serving: text in, text out, over HTTP. AsyncEngine (``rtpcore.engine``) -> the
OpenAI-compatible app (``app.build_app``; ``routers/``, one per endpoint: validates, renders,
streams) -> uvicorn with the connection rules of ``server`` (``rtpcore serve``). The tokenizer,
chat template, detokenizer and stop handling it uses are the engine's own text side
(``Engine.text``, ``rtpcore.engine.text``). This package imports nothing on import; torch,
``tokenizers`` and ``jinja2`` load with the module that needs them.
"""
