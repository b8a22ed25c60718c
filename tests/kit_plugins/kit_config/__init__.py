"""kit-config: a Llama-derived model whose config_from_hf silently defaults a malformed field.

The defect (``config_errors``): ``kit_logit_scale`` (1.0 in the demo config) is read as
``x if isinstance(x, float) else 1.0``, so ``"kit_logit_scale": "not-a-number"`` is served with
scale 1.0 instead of being a ``CheckpointError`` naming the field.
"""
