"""Stage 1, plugins: which third-party code may run, and what it registers.

``allowlist`` parses ``--plugins`` / ``--external-model-packages``; ``resolution``
turns it into a frozen, picklable :class:`~rtpcore.plugins.resolution.Plan` from
distribution ``metadata`` alone (``provenance`` checks where each module would be
imported from, ``discovery`` reads architecture hints), importing nothing;
``loading`` imports exactly the plan through pluggy (``hooks``) and fills the
``registry`` of :class:`~rtpcore.plugins.model_plugin.ModelPlugin` classes and KV
layouts, one ``registration`` transaction per plugin (``config_fields`` gives
plugins checked readers of config.json fields). It hands the next stages a
``ModelRegistry``: model type -> plugin class, layout name -> policy.
"""

from rtpcore.plugins.seams import SEAM_API_VERSIONS

__all__ = ["SEAM_API_VERSIONS"]
