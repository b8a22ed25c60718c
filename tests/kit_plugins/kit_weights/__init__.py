"""kit-weights: a Llama-derived model whose build_model reads a tensor no weight pattern declares.

The defect (``weight_patterns``): ``build_model`` asks the loaded weights for
``model.extra_scale`` and falls back to 1.0 when it is absent. A checkpoint holding that tensor
would have it read behind the pruned load's back; the kit's ``weight_patterns`` check names it.
"""
