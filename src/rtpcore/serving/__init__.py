"""Serving: text in, text out.

The OpenAI-compatible server (``rtpcore serve``), the tokenizer and chat templates:
:mod:`rtpcore.serving.tokenizer` reads a checkpoint's ``tokenizer.json``,
:mod:`rtpcore.serving.chat_template` renders its chat template as transformers
does, and :mod:`rtpcore.serving.detokenize` turns generated ids into text
incrementally, matching stop strings across token boundaries. This package imports
nothing on import; torch, ``tokenizers`` and ``jinja2`` load with the module that
needs them.
"""
