"""Guard (``serving.guard``) -> a router, one per endpoint -> protocol, requests, streaming -> AsyncEngine.

``app.build_app`` includes them in this order: ``health`` (``GET /health``), ``prometheus``
(``GET /metrics``), ``models`` (``GET /v1/models``, ``GET /v1/models/{id}``), ``completions``
(``POST /v1/completions``), ``chat`` (``POST /v1/chat/completions``), ``tokens`` (``POST
/tokenize``, ``POST /detokenize``) and ``version`` (``GET /version``). Each handler reaches the app's shared
:class:`~rtpcore.serving.state.Served` through the dependency ``state.ServedDep``.
"""
