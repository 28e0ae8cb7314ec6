"""One request's place in its grammar: an llguidance matcher that has consumed its output tokens."""

from __future__ import annotations

from llguidance import LLMatcher


class GrammarMatcher:
    """Follows `Request.output_token_ids` token by token (the request feeds it every appended token).

    Recompute preemption keeps a request's output tokens, so the matcher needs no rebuilding: the
    engine re-runs the forward over prompt + output and samples the next token from where the
    matcher already is.
    """

    def __init__(self, matcher: LLMatcher, kind: str) -> None:
        self.matcher = matcher  # llguidance's; the mask computation reads it
        self.kind = kind  # which constraint (json_schema, regex, ...), for messages
        self.num_consumed = 0
        self.rejected_token: int | None = None  # a token the grammar refused (only a masking bug can cause it)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and the matcher stops for good) if the grammar refuses it."""
        if self.rejected_token is not None:
            return False
        if not self.matcher.consume_token(token_id):
            self.rejected_token = token_id
            return False
        self.num_consumed += 1
        return True

    @property
    def is_terminated(self) -> bool:
        """The constraint is complete and nothing may follow (only EOS would be allowed)."""
        return self.rejected_token is None and self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()
