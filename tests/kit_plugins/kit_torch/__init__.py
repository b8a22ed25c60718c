"""kit-torch: a Llama-derived model whose hooks module imports torch.

The defect (``import_cost``): ``kit_torch.hooks`` does ``import torch`` at import time, so
listing or loading the plugin costs torch's import even where no model of it is ever built.
"""
