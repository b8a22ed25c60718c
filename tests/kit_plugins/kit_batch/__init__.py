"""kit-batch: a Llama-derived model whose forward depends on the other sequences of its batch.

The defect (``batch_invariance``): when a step holds 3 or more sequences (``batch.num_seqs >=
3``) the model takes a "large-batch path" that adds a multiple of the mean logits row to every
row, as a wrong large-batch kernel would: a prompt's greedy output alone differs from its output
in a batch of several.
"""
