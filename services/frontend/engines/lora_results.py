"""The engines' answers to a LoRA call as one answer: the adapters, or the status of the refusal.

Every engine gets each call. A load must succeed everywhere; unload and pin succeed where the adapter
is and count as done when at least one engine had it (the others answer NOT_FOUND: it was never
loaded there). A refusal keeps the engine's kind: INVALID_ARGUMENT (a rank above --max-lora-rank,
modules the model lacks), NOT_FOUND, FAILED_PRECONDITION (in use, LoRA off).
"""

from __future__ import annotations

from engine_core.protocol import UtilityErrorKind
from services.frontend.engines.client import EngineCallResult
from services.frontend.errors import FailedPrecondition, FrontendError, InvalidRequest, NotFound

_ERRORS: dict[UtilityErrorKind, type[FrontendError]] = {
    UtilityErrorKind.INVALID_ARGUMENT: InvalidRequest, UtilityErrorKind.NOT_FOUND: NotFound,
    UtilityErrorKind.FAILED_PRECONDITION: FailedPrecondition,
}


def lora_results(results: list[EngineCallResult], *, missing_ok: bool = False) -> list[EngineCallResult]:
    """`results` when the call succeeded; else raises the first refusal's error naming its engine.
    `missing_ok`: engines that do not have the adapter are skipped when another had it."""
    failed = [r for r in results if not r.ok]
    if missing_ok and len(failed) < len(results):
        failed = [r for r in failed if r.error_kind is not UtilityErrorKind.NOT_FOUND]
    if not failed:
        return [r for r in results if r.ok]
    detail = "; ".join(f"engine at {r.address}: {r.error}" for r in failed)
    raise _ERRORS.get(failed[0].error_kind, FailedPrecondition)(detail)
