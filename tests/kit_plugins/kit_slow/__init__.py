"""kit-slow: a Llama-derived model whose hooks module takes 2.5 s to import.

The defect (``import_cost``): importing ``kit_slow.hooks`` sleeps 2.5 s (standing for heavy
work at import time), over the kit's budget of 1.0 s.
"""
