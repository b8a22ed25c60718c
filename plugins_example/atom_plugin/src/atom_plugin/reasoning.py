"""DeepSeek-R1's reasoning, as the parser ``rtpcore serve --reasoning-parser atom_deepseek_r1``
finds through the ``rtpcore_register_reasoning_parsers`` hook.

DeepSeek-R1 (and DeepSeek-V3.1 in its thinking mode) thinks first: its chat template ends the
prompt with ``<think>``, so the answer is reasoning up to ``</think>`` and content after it. The
parser is rtpcore's built-in ``deepseek_r1`` under atom-plugin's name: a plugin subclasses a
built-in to ship the behaviour its models were validated with, whatever later releases of the
built-in do. It imports ``rtpcore.reasoning`` only, never torch.
"""

from __future__ import annotations

from rtpcore.reasoning import DeepSeekR1ReasoningParser

__all__ = ["AtomDeepseekR1Parser"]


class AtomDeepseekR1Parser(DeepSeekR1ReasoningParser):
    """DeepSeek-R1 and V3.1's thinking mode: the template opened ``<think>``; everything up to
    ``</think>`` is reasoning, an answer that never closes it is all reasoning."""

    name = "atom_deepseek_r1"
