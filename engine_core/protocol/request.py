"""The request the frontend sends the engine core: token ids in, already validated at the frontend's edge
(the engine checks again at its own, `EngineCore.add_request`, since any peer may connect)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine_core.protocol.pooling_params import PoolingParams
from engine_core.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first under the priority policy
    trace_headers: dict[str, str] | None = None  # W3C trace context of the caller's span
    pooling: PoolingParams | None = None  # set: an embedding request, pooled instead of sampled
    lora_name: str | None = None  # the LoRA adapter to run it with (engine_core/lora); None: the base model

    def fan_out(self) -> list[EngineCoreRequest]:
        """The engine requests of an n > 1 request, one per completion: the engine core samples one sequence per
        request, so both the frontend and the offline engine split here (children share the prompt and so its
        prefix-cache blocks; a seeded child gets seed + index, as in vLLM)."""
        n = self.sampling_params.n
        if n == 1:
            return [self]
        return [replace(self, request_id=f"{index}_{self.request_id}",
                        sampling_params=self.sampling_params.for_child(index)) for index in range(n)]
