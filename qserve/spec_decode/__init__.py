"""Speculative decoding: proposers of draft tokens and the user-facing configuration.

The verify side lives where the work is done: the scheduler schedules a sequence's draft tokens
after its last known token (``qserve.scheduler``), the runner scores every row in one forward and
the rejection sampler (``qserve.runner.rejection_sampler``) keeps or rejects them. This package
only knows how drafts are proposed (``ngram``: lookup in the sequence's own tokens; ``draft_model``: a
small model driven through a ``ModelRunner`` of its own, its KV in the target's pages; ``eagle``: an
EAGLE / EAGLE-3 head, ``eagle_head``, read from ``eagle_config``, fed the target's hidden states, its KV
in a cache of its own indexed by the target's block ids, ``shadow_kv``) and how ``speculative_config`` is read, when a sequence stops getting
proposals (``backoff``) and how many drafts a step gets with adaptive verification (``adaptive``;
docs/spec_decode.md).
"""

from qserve.spec_decode.config import SpeculativeConfig, parse_speculative_config
from qserve.spec_decode.proposer import ProposalInput, Proposer

__all__ = ["ProposalInput", "Proposer", "SpeculativeConfig", "parse_speculative_config"]
