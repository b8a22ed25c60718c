"""The ``rtpcore.plugins`` entry point ``neox``: registers the model by name, imports nothing heavy."""

from rtpcore import hookimpl


@hookimpl
def rtpcore_register_models(registry):
    registry.register(
        "neox_plugin.plugin:NeoXPlugin",
        model_type="gpt_neox",
        architectures=("GPTNeoXForCausalLM",),
    )
