"""The frontend's own dataclasses; what crosses to the engine is engine_core/protocol/.

EngineOutputs is what an engine client hands AsyncLLM's output handler; EngineStatus and EngineCallResult
describe the engines behind the frontend; EmbedResult is what `AsyncLLM.embed()` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineState,
    FinishReason,
    LoraInfo,
    Usage,
    UtilityErrorKind,
)


@dataclass(frozen=True)
class EngineStatus:
    """One engine address as the engine client sees it."""

    address: str
    connected: bool
    num_in_flight: int
    state: EngineState = EngineState()


@dataclass(frozen=True)
class EngineCallResult:
    """One engine's answer to a utility call (pause, sleep, ...) made on every engine."""

    address: str
    ok: bool
    error: str = ""
    loras: tuple[LoraInfo, ...] = ()  # the LoRA calls' adapters
    error_kind: UtilityErrorKind | None = None  # why it was refused, when the engine said


@dataclass
class EngineOutputs:
    """One engine step's outputs, or requests that failed."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    timestamp: float = 0.0  # the step's time, engine clock
    failed: list[str] = field(default_factory=list)  # engine request ids ended by `error`
    error: Exception | None = None

    @classmethod
    def of_step(cls, step: EngineCoreOutputs) -> EngineOutputs:
        """A step's outputs; ids listed only as finished (ended in the engine without an output) end as ABORT."""
        outputs = list(step.outputs)
        if step.finished_request_ids:
            seen = {o.request_id for o in outputs if o.finish_reason is not None}
            outputs += [EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT)
                        for request_id in step.finished_request_ids if request_id not in seen]
        return cls(outputs=outputs, timestamp=step.timestamp)


@dataclass
class EmbedResult:
    """One vector per input, in input order."""

    request_id: str
    embeddings: list[list[float]]
    num_prompt_tokens: list[int]
    usage: Usage
