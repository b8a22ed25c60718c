"""kit-patch: a Llama-derived model whose build_model monkeypatches rtpcore.

The defect (``no_patches``): ``build_model`` replaces ``rtpcore.layers.causal_mask`` with an
equivalent wrapper (behaviour unchanged, so every other check passes). Loading the plugin
patches nothing; the patch happens when a model is built, where only the kit's ``no_patches``
check, which builds and runs each model under a watch, sees it.
"""
