"""Prompt lookup (n-gram) proposals: the request's last n tokens found earlier in its own prompt and output, and the
tokens that followed them there proposed next. Free to compute and right whenever the output copies its input:
editing code, quoting a passage, rewriting, extraction.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine_core.spec_decode.proposer import DraftInput, Proposer


class NgramProposer(Proposer):
    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        """min_n, max_n: the suffix lengths matched; the longest that occurs earlier wins."""
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, inputs: Sequence[DraftInput]) -> list[list[int]]:
        return [self.propose_one(item.token_ids, item.num_drafts) for item in inputs]

    def propose_one(self, token_ids: Sequence[int], num_drafts: int) -> list[int]:
        """`num_drafts` tokens to follow `token_ids`: those that followed the longest suffix (min_n to max_n tokens) at
        its latest earlier occurrence. When fewer follow it than wanted, the copy runs on into its own drafts
        (repeating what lies between that occurrence and the end, as a repeating output would)."""
        if num_drafts <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        last = len(tokens) - 1
        # ends: where an earlier occurrence could end, i.e. the positions holding the last token (not the last one)
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        lengths = np.ones(len(ends), dtype=np.int64)  # of the match ending at each: tokens[end - n + 1:end + 1]
        matching = np.ones(len(ends), dtype=bool)
        for n in range(1, self.max_n):
            if n > last:
                break
            before = ends - n
            matching &= before >= 0
            matching[matching] = tokens[before[matching]] == tokens[last - n]
            lengths += matching
        best = lengths.max(initial=0)
        if best < self.min_n:
            return []
        end = ends[np.flatnonzero(lengths == best)[-1]]  # the latest of the longest
        # what followed it, up to the suffix, then on as a period: past the end, the copy reads its own drafts
        period = tokens[end + 1:]
        return np.resize(period, num_drafts).tolist()
