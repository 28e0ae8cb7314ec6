"""Every type that crosses the frontend <-> engine boundary, torch-free: the frontend imports this package and
nothing else of engine_core (tests/test_layering.py checks it).

Each side's `convert.py` maps these to and from the tandem.v1 protos exactly once; the enums are numbered
like the protos, so they cross as ints. Validation happens once per trust boundary: the frontend's input
processor, and `EngineCore.add_request` for the engine (any peer may connect).
"""

from engine_core.protocol.block_hash import BlockHash, hash_prompt_blocks
from engine_core.protocol.engine_info import EngineInfo
from engine_core.protocol.engine_state import EngineState, PauseMode
from engine_core.protocol.finish_reason import FinishReason
from engine_core.protocol.kv_events import KVCacheEvents
from engine_core.protocol.logprobs import TokenLogprobs
from engine_core.protocol.outputs import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
from engine_core.protocol.pooling_params import PoolingParams, PoolingType
from engine_core.protocol.request import EngineCoreRequest
from engine_core.protocol.request_error import RequestError, RequestErrorKind
from engine_core.protocol.request_output import CompletionOutput, RequestMetrics, RequestOutput, Usage
from engine_core.protocol.sampling_params import MAX_LOGPROBS, OutputKind, SamplingParams, validate_sampling_params
from engine_core.protocol.scheduler_stats import SchedulerStats
from engine_core.protocol.structured_output import StructuredOutput
from engine_core.protocol.utility import (
    ControlCall,
    GetStatsCall,
    ListLorasCall,
    LoadLoraCall,
    LoraInfo,
    PauseCall,
    PinLoraCall,
    ResetPrefixCacheCall,
    ResumeCall,
    SleepCall,
    StartProfileCall,
    StopProfileCall,
    UnloadLoraCall,
    UtilityCall,
    UtilityErrorKind,
    UtilityMethod,
    UtilityResult,
    WakeUpCall,
)

__all__ = [
    "BlockHash", "CompletionOutput", "ControlCall", "EngineCoreEvent", "EngineCoreEventType", "EngineCoreOutput",
    "EngineCoreOutputs", "EngineCoreRequest", "EngineInfo", "EngineState", "FinishReason", "GetStatsCall",
    "KVCacheEvents", "ListLorasCall", "LoadLoraCall", "LoraInfo", "MAX_LOGPROBS", "OutputKind", "PauseCall",
    "PauseMode", "PinLoraCall", "PoolingParams", "PoolingType", "RequestError", "RequestErrorKind", "RequestMetrics",
    "RequestOutput", "ResetPrefixCacheCall", "ResumeCall", "SamplingParams", "SchedulerStats", "SleepCall",
    "StartProfileCall", "StopProfileCall", "StructuredOutput", "TokenLogprobs", "UnloadLoraCall", "Usage",
    "UtilityCall", "UtilityErrorKind", "UtilityMethod", "UtilityResult", "WakeUpCall", "hash_prompt_blocks",
    "validate_sampling_params",
]
