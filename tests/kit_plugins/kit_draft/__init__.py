"""kit-draft: a Llama-derived model offering a multi-token-prediction draft that corrupts the target.

The draft (``KitDraftPlugin.mtp_draft``) is minimal: its one tensor, ``mtp.proposal_bias``
(vocab,), is a bias over a fixed proposal table (each token proposes the next id). The defect
(``draft``): the first time it runs, its forward scales the target's embedding in place (a
draft writing into weights it shares with the target), so greedy output with
``draft_model="mtp"`` differs from output without a draft.
"""
