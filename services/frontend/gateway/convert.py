"""vLLM's gRPC worker protocol (vllm.grpc.engine, from the pinned smg-grpc-proto) <-> the frontend's dataclasses.

The only module that reads and builds those messages besides their servicer (servicer.py).
What the protocol carries and Tandem cannot do (multimodal inputs, prefill/decode KV transfer, structural
tags) raises `Unimplemented`; malformed input raises `InvalidRequest`, each naming the field.
"""

from __future__ import annotations

from datetime import datetime, timezone

from llguidance.gbnf_to_lark import any_to_lark
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2

from engine_core.protocol import EngineInfo, OutputKind, RequestOutput, SamplingParams, StructuredOutput, TokenLogprobs
from services.frontend.async_llm import EmbedResult
from services.frontend.errors import FrontendError, InvalidRequest
from services.frontend.gateway.kv_event_feed import KVFeedBatch, WorkerLoad
from services.frontend.input_processor import Prompt, TextPrompt, TokensPrompt
from services.frontend.tokenizer import TokenizerBundle

SERVER_TYPE = "tandem-grpc"
_INT64_SIGN, _UINT64 = 1 << 63, 1 << 64


class Unimplemented(FrontendError):
    """The protocol carries it, Tandem does not do it (UNIMPLEMENTED)."""


# ---- Generate ------------------------------------------------------------------------
def prompt_from_generate(request: vllm_engine_pb2.GenerateRequest, max_model_len: int) -> Prompt:
    """The prompt (token ids from a gateway that tokenized, or text), after the checks of what Tandem serves."""
    if request.HasField("mm_inputs") or request.extra_mm_inputs or request.HasField("media_refs"):
        raise Unimplemented("mm_inputs / media_refs: Tandem serves text-only models and takes no multimodal "
                            "inputs; send tokenized text only")
    if request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"):
        raise Unimplemented("kv_transfer_params: Tandem does no prefill/decode disaggregation; route this worker "
                            "as a regular (not a prefill or decode) worker")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidRequest(f"data_parallel_rank {request.data_parallel_rank}: this worker has one rank, 0 "
                             "(the frontend spreads requests over its engines itself)")
    params = request.sampling_params
    kind = request.WhichOneof("input")
    if kind == "text":
        if params.HasField("truncate_prompt_tokens"):
            raise InvalidRequest("sampling_params.truncate_prompt_tokens needs tokenized input, not text")
        return TextPrompt(request.text)
    if kind != "tokenized":
        raise InvalidRequest("input is missing: set tokenized.input_ids (or text)")
    ids = list(request.tokenized.input_ids)
    if params.HasField("truncate_prompt_tokens"):
        keep = params.truncate_prompt_tokens
        if keep == -1 and max_model_len:
            keep = max_model_len - 1  # the model's context, less the one token to generate
        if keep < 1:
            raise InvalidRequest(f"sampling_params.truncate_prompt_tokens must be >= 1 or -1 (the context "
                                 f"length), got {params.truncate_prompt_tokens}")
        ids = ids[-keep:]
    return TokensPrompt(ids)


def sampling_params_from_proto(params: vllm_engine_pb2.SamplingParams, *, stream: bool) -> SamplingParams:
    """vLLM's defaults for unset fields (proto3 zeros: top_p, repetition_penalty and n 0 mean unset, as in vLLM's
    own servicer); the input processor validates the ranges. Streams get token deltas, others one final message."""
    return SamplingParams(
        n=params.n or 1,
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_p=params.top_p or 1.0,
        top_k=params.top_k,
        min_p=params.min_p,
        seed=params.seed if params.HasField("seed") else None,
        max_tokens=params.max_tokens if params.HasField("max_tokens") else None,
        min_tokens=params.min_tokens,
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty or 1.0,
        logit_bias=dict(params.logit_bias),
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        prompt_logprobs=params.prompt_logprobs if params.HasField("prompt_logprobs") else None,
        stop=tuple(params.stop),
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
        output_kind=OutputKind.DELTA if stream else OutputKind.FINAL_ONLY,
        structured=_structured(params),
    )


def _structured(params: vllm_engine_pb2.SamplingParams) -> StructuredOutput | None:
    kind = params.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not params.json_object):
        return None
    if kind == "structural_tag":
        raise Unimplemented("sampling_params.structural_tag: Tandem has no structural tags; use json_schema, "
                            "regex, grammar, choice or json_object")
    if kind == "choice":
        return StructuredOutput(choice=tuple(params.choice.choices))
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "grammar":
        return StructuredOutput(grammar=_lark(params.grammar))
    return StructuredOutput(**{kind: getattr(params, kind)})


def _lark(grammar: str) -> str:
    """vLLM's grammars are GBNF (`root ::= ...`, what smg sends for `ebnf`) or Lark; Tandem's are Lark (llguidance,
    whose converter tells the two apart)."""
    try:
        return any_to_lark(grammar)
    except Exception as e:  # noqa: BLE001 - llguidance's message says what is wrong
        raise InvalidRequest(f"sampling_params.grammar is neither GBNF nor Lark that llguidance reads: {e}") from None


class GenerateResponses:
    """One Generate call's answers: per completion index, token-id chunks (streams), then a final message."""

    def __init__(self, *, stream: bool, num_logprobs: int | None, num_prompt_logprobs: int | None,
                 prompt_token_ids: list[int] | None) -> None:
        self.stream = stream
        self.num_logprobs, self.num_prompt_logprobs = num_logprobs, num_prompt_logprobs
        self.prompt_token_ids = prompt_token_ids or []
        self.prompt_tokens = len(self.prompt_token_ids)
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.cached_tokens = 0
        self.output_ids: dict[int, list[int]] = {}  # every token so far, per completion index
        self._sent_input_logprobs: set[int] = set()

    def of(self, output: RequestOutput) -> list[vllm_engine_pb2.GenerateResponse]:
        self.prompt_tokens = self.prompt_tokens or output.num_prompt_tokens
        self.prompt_logprobs = self.prompt_logprobs or output.prompt_logprobs
        if output.usage is not None:
            self.cached_tokens = output.usage.cached_tokens
        responses = []
        for c in output.completions:
            ids = self.output_ids.setdefault(c.index, [])
            if self.stream:
                ids.extend(c.token_ids)
                if c.token_ids or c.finish_reason is None:
                    responses.append(vllm_engine_pb2.GenerateResponse(chunk=vllm_engine_pb2.GenerateStreamChunk(
                        token_ids=c.token_ids, prompt_tokens=self.prompt_tokens, completion_tokens=len(c.token_ids),
                        cached_tokens=self.cached_tokens, output_logprobs=self._output_logprobs(c.logprobs),
                        input_logprobs=self._input_logprobs(c.index), index=c.index)))
            else:
                ids[:] = c.token_ids
            if c.finish_reason is not None:
                responses.append(self._complete(c))
        return responses

    def _complete(self, c) -> vllm_engine_pb2.GenerateResponse:
        """The final message of one completion: as vLLM's servicer, a stream's carries its last delta (the
        gateway has the rest from the chunks), a non-stream's every token."""
        complete = vllm_engine_pb2.GenerateComplete(
            output_ids=c.token_ids, finish_reason=str(c.finish_reason), prompt_tokens=self.prompt_tokens,
            completion_tokens=len(c.token_ids), cached_tokens=self.cached_tokens,
            output_logprobs=self._output_logprobs(c.logprobs), input_logprobs=self._input_logprobs(c.index),
            index=c.index)
        if c.stop_string is not None:
            complete.matched_stop_str = c.stop_string
        elif c.stop_token_id is not None:
            complete.matched_token_id = c.stop_token_id
        return vllm_engine_pb2.GenerateResponse(complete=complete)

    def _output_logprobs(self, entries: list[TokenLogprobs]) -> vllm_engine_pb2.OutputLogProbs | None:
        if self.num_logprobs is None or not entries:
            return None
        proto = vllm_engine_pb2.OutputLogProbs()
        for entry in entries:
            proto.token_ids.append(entry.token_ids[0])
            proto.token_logprobs.append(entry.logprobs[0])
            if self.num_logprobs:
                proto.top_logprobs.add(token_ids=entry.token_ids[1:], values=entry.logprobs[1:])
        return proto

    def _input_logprobs(self, index: int) -> vllm_engine_pb2.InputLogProbs | None:
        """Once per completion index: the prompt's logprobs (the first prompt token has none)."""
        if self.num_prompt_logprobs is None or not self.prompt_logprobs or index in self._sent_input_logprobs:
            return None
        self._sent_input_logprobs.add(index)
        proto = vllm_engine_pb2.InputLogProbs()
        missing = max(self.prompt_tokens - len(self.prompt_logprobs), 0)
        for position in range(missing):
            proto.token_logprobs.add()
            proto.token_ids.append(self.prompt_token_ids[position] if position < len(self.prompt_token_ids) else 0)
            if self.num_prompt_logprobs:
                proto.top_logprobs.add()
        for entry in self.prompt_logprobs:
            proto.token_logprobs.add(value=entry.logprobs[0])
            proto.token_ids.append(entry.token_ids[0])
            if self.num_prompt_logprobs:
                proto.top_logprobs.add(token_ids=entry.token_ids[1:], values=entry.logprobs[1:])
        return proto


# ---- Embed ---------------------------------------------------------------------------
def embed_prompt(request: vllm_engine_pb2.EmbedRequest) -> TokensPrompt:
    if not request.HasField("tokenized"):
        raise InvalidRequest("tokenized is missing: Embed takes tokenized.input_ids")
    return TokensPrompt(list(request.tokenized.input_ids))


def embed_response(result: EmbedResult) -> vllm_engine_pb2.EmbedResponse:
    vector = result.embeddings[0]
    return vllm_engine_pb2.EmbedResponse(embedding=vector, prompt_tokens=result.usage.prompt_tokens,
                                         embedding_dim=len(vector))


# ---- model, server, health, load -------------------------------------------------------
def health_response(reason_not_serving: str | None) -> vllm_engine_pb2.HealthCheckResponse:
    return vllm_engine_pb2.HealthCheckResponse(healthy=reason_not_serving is None,
                                               message=reason_not_serving or "serving")


def model_info_response(info: EngineInfo, tokenizer: TokenizerBundle, *,
                        tokenizer_path: str) -> vllm_engine_pb2.GetModelInfoResponse:
    bos = tokenizer.tokenizer.token_to_id(tokenizer.bos_token) if tokenizer.bos_token else None
    return vllm_engine_pb2.GetModelInfoResponse(
        model_path=info.model_path, is_generation=True, max_context_length=info.max_model_len,
        vocab_size=info.vocab_size, served_model_name=info.model_name, tokenizer_path=tokenizer_path,
        eos_token_ids=list(info.eos_token_ids), bos_token_id=bos if bos is not None else 0,
        max_req_input_len=max(info.max_model_len - 1, 0))


def server_info_response(*, active_requests: int, paused: bool, last_receive_timestamp: float, uptime_s: float,
                         block_size: int) -> vllm_engine_pb2.GetServerInfoResponse:
    return vllm_engine_pb2.GetServerInfoResponse(
        active_requests=active_requests, is_paused=paused, last_receive_timestamp=last_receive_timestamp,
        uptime_seconds=uptime_s, server_type=SERVER_TYPE, data_parallel_size=1, block_size=block_size)


def loads_response(load: WorkerLoad, block_size: int, version: str) -> vllm_engine_pb2.GetLoadsResponse:
    return vllm_engine_pb2.GetLoadsResponse(
        timestamp=datetime.now(timezone.utc).isoformat(), version=version, dp_rank_count=1,
        loads=[vllm_engine_pb2.SchedulerLoad(
            dp_rank=0, num_running_reqs=load.running, num_waiting_reqs=load.waiting,
            num_total_reqs=load.running + load.waiting, num_used_tokens=load.num_used_blocks * block_size,
            max_total_num_tokens=load.num_total_blocks * block_size, token_usage=load.kv_usage)])


def engine_load(load: WorkerLoad, block_size: int, sample: int, *, load_only: bool) -> common_pb2.EngineLoad:
    return common_pb2.EngineLoad(
        running_requests=load.running, waiting_requests=load.waiting, token_usage=load.kv_usage,
        sample=sample, load_only=load_only, num_used_tokens=load.num_used_blocks * block_size,
        max_total_num_tokens=load.num_total_blocks * block_size)


# ---- KV events, tokenizer ----------------------------------------------------------------
def kv_event_batch(batch: KVFeedBatch, sequence_number: int, first_event_id: int, timestamp: float,
                   load: common_pb2.EngineLoad) -> common_pb2.KvEventBatch:
    """One batch: cleared, then removed, then one stored event per block (each naming its parent)."""
    proto = common_pb2.KvEventBatch(sequence_number=sequence_number, timestamp=timestamp, load=load)
    event_ids = iter(range(first_event_id, first_event_id + 2 + len(batch.stored)))
    if batch.cleared:
        proto.events.add(event_id=next(event_ids), cleared=common_pb2.KvCacheCleared())
    if batch.removed:
        proto.events.add(event_id=next(event_ids),
                         removed=common_pb2.KvBlocksRemoved(block_hashes=[_int64(h) for h in batch.removed]))
    for block in batch.stored:
        stored = common_pb2.KvBlocksStored(blocks=[common_pb2.KvBlock(
            block_hash=_int64(block.block_hash), token_ids=block.token_ids, block_size=batch.block_size)])
        if block.parent_hash is not None:
            stored.parent_block_hash = _int64(block.parent_hash)
        if block.lora_name is not None:
            stored.lora_name = block.lora_name
        proto.events.add(event_id=next(event_ids), stored=stored)
    return proto


def load_only_batch(sequence_number: int, timestamp: float, load: common_pb2.EngineLoad) -> common_pb2.KvEventBatch:
    return common_pb2.KvEventBatch(sequence_number=sequence_number, timestamp=timestamp, load=load)


def _int64(block_hash: int) -> int:
    """Tandem's hashes are unsigned 64-bit; the protocol's are int64 (the same bits)."""
    return block_hash - _UINT64 if block_hash >= _INT64_SIGN else block_hash


def tokenizer_chunk(data: bytes, sha256: str) -> common_pb2.GetTokenizerChunk:
    return common_pb2.GetTokenizerChunk(data=data, sha256=sha256)


def flush_cache_response(success: bool, message: str) -> common_pb2.FlushCacheResponse:
    return common_pb2.FlushCacheResponse(success=success, message=message)


def profile_response(success: bool, message: str) -> common_pb2.ProfileResponse:
    return common_pb2.ProfileResponse(success=success, message=message)


def abort_response() -> vllm_engine_pb2.AbortResponse:
    return vllm_engine_pb2.AbortResponse()
