"""Embed's typed request and result (the client library's proto edge for Embed, beside clients/generation.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tandem.v1 import common_pb2, generation_pb2

from clients.generation import Usage


@dataclass(frozen=True)
class Embeddings:
    """Embed's answer: one vector per input, in input order."""

    request_id: str
    embeddings: tuple[tuple[float, ...], ...]  # as EmbedResponse.embeddings
    num_prompt_tokens: tuple[int, ...]
    usage: Usage


_POOLING = {"last": common_pb2.POOLING_TYPE_LAST, "mean": common_pb2.POOLING_TYPE_MEAN,
            "cls": common_pb2.POOLING_TYPE_CLS}


def embed_request(inputs: str | Sequence[int] | Iterable[str | Sequence[int]], *, pooling: str = "last",
                  normalize: bool | None = None, request_id: str = "", priority: int = 0,
                  add_special_tokens: bool | None = None, lora_name: str = "") -> generation_pb2.EmbedRequest:
    """A text or token-id list, or a list of them; pooling: last | mean | cls; lora_name: a loaded LoRA adapter."""
    if pooling not in _POOLING:
        raise ValueError(f"pooling must be one of {', '.join(_POOLING)}, got {pooling!r}")
    single = isinstance(inputs, str) or (isinstance(inputs, Sequence) and all(isinstance(i, int) for i in inputs))
    items = [inputs] if single and inputs else list(inputs)
    request = generation_pb2.EmbedRequest(request_id=request_id, priority=priority, pooling=_POOLING[pooling],
                                          lora_name=lora_name)
    for item in items:
        if isinstance(item, str):
            request.inputs.add(text=item)
        elif isinstance(item, Sequence) and all(isinstance(i, int) for i in item):
            request.inputs.add(token_ids=generation_pb2.TokenIds(ids=item))
        else:
            raise TypeError(f"each input must be a str or a sequence of token ids, got {type(item).__name__}")
    if normalize is not None:
        request.normalize = normalize
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request


def embeddings_from_proto(response: generation_pb2.EmbedResponse) -> Embeddings:
    u = response.usage
    return Embeddings(response.request_id, tuple(tuple(e.values) for e in response.embeddings),
                      tuple(e.num_prompt_tokens for e in response.embeddings),
                      Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens))
