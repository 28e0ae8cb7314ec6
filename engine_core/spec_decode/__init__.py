"""Speculative decoding (docs/speculative-decoding.md): a proposer guesses each request's next k tokens, the target
model computes logits for its last token and the k drafts in one forward, and the verification keeps the drafts
its own sampling agrees with, then one token it sampled. Greedy output is the target's, token for token; sampled
output follows the target's distribution exactly.

- proposer: the Proposer interface (what an EAGLE-style proposer would implement too), ngram_proposer: prompt
  lookup in the request's own tokens, draft_model: a smaller model's greedy continuation;
- scheduling: how many drafts a step verifies (room, max_tokens, the batch rule), the scheduler's side;
- verification: the drafts checked against the target's own sampler, the runner's side;
- speculator: the runner's part (propose after sampling, verify in the next step) behind one object.
"""

from engine_core.spec_decode.ngram_proposer import NgramProposer
from engine_core.spec_decode.proposer import DraftInput, Proposer

__all__ = ["DraftInput", "NgramProposer", "Proposer"]
