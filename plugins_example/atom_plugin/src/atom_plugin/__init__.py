"""atom-plugin: a DeepSeek-V3-style model (MLA attention, MoE) served through rtpcore."""

__all__: list[str] = []
