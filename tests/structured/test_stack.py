"""Structured output over gRPC end to end: tandem-engine (a tiny random Llama, SmolLM2's tokenizer for
its masks, a KV cache small enough to preempt) and tandem-frontend as two processes on loopback."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from clients.local_stack import free_port
from engine_core.loader import default_model_path
from tests.structured.schemas import CHOICES, SCHEMAS, check_json
from tests.test_stack import Services, wait_for_all_blocks_free

# 40 usable blocks of 16 tokens: a dozen requests of ~200 tokens cannot all fit, so some are preempted
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--block-size", "16", "--num-blocks", "41",
                "--max-num-seqs", "32", "--max-num-batched-tokens", "512", "--attention-backend", "torch"]


@pytest.fixture(scope="module")
def services(tiny_model_dir):
    metrics_port = free_port()
    s = Services(["--model", str(tiny_model_dir), "--tokenizer", str(default_model_path()), *ENGINE_FLAGS,
                  "--metrics-port", str(metrics_port), "--log-level", "WARNING"],
                 ["--tokenizer", str(default_model_path()), "--log-level", "WARNING"])
    s.metrics_port = metrics_port
    yield s
    s.stop()


def engine_metric(services, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{services.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def structured(**constraint) -> common_pb2.StructuredOutput:
    return common_pb2.StructuredOutput(**constraint)


async def completions(address: str, request, method: str = "Generate") -> dict[int, tuple[str, int]]:
    """index -> (text, finish reason) of one streamed request."""
    texts: dict[int, str] = {}
    reasons: dict[int, int] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        async for response in getattr(stub, method)(request):
            for c in response.completions:
                texts[c.index] = texts.get(c.index, "") + c.text
                if c.finish_reason:
                    reasons[c.index] = c.finish_reason
    return {i: (texts.get(i, ""), reasons[i]) for i in reasons}


def test_json_schema_with_n_and_seeded_sampling(services):
    schema = SCHEMAS["person"]
    params = common_pb2.SamplingParams(n=4, temperature=0.9, seed=123, max_tokens=150,
                                       structured=structured(json_schema=json.dumps(schema)))
    request = generation_pb2.GenerateRequest(text="A user as JSON:", sampling_params=params)
    first = asyncio.run(completions(services.frontend_address, request))
    assert sorted(first) == [0, 1, 2, 3]
    finished = [text for text, reason in first.values() if reason == common_pb2.FINISH_REASON_STOP]
    assert len(finished) >= 2
    for text in finished:
        check_json(text, schema)
    assert asyncio.run(completions(services.frontend_address, request)) == first  # seeds: the same texts
    assert engine_metric(services, "tandem:structured_mask_seconds_count") > 0


def test_chat_answers_with_one_of_the_choices(services):
    params = common_pb2.SamplingParams(n=3, temperature=1.0, max_tokens=20,
                                       structured=structured(choice=common_pb2.Choice(options=CHOICES)))
    request = generation_pb2.ChatRequest(messages=[generation_pb2.ChatMessage(role="user", content="Sentiment?")],
                                         sampling_params=params)
    for text, reason in asyncio.run(completions(services.frontend_address, request, "Chat")).values():
        assert reason == common_pb2.FINISH_REASON_STOP and text in CHOICES


def test_preemption_mid_generation_keeps_every_output_valid(services):
    before = engine_metric(services, "tandem:num_preemptions_total")
    names = sorted(SCHEMAS) * 4

    async def run():
        requests = [generation_pb2.GenerateRequest(
            text=f"Record number {i}: " + "data " * 60,
            sampling_params=common_pb2.SamplingParams(temperature=1.0, seed=i, max_tokens=160,
                                                      structured=structured(json_schema=json.dumps(SCHEMAS[name]))))
            for i, name in enumerate(names)]
        return await asyncio.gather(*(completions(services.frontend_address, r) for r in requests))

    results = asyncio.run(run())
    assert engine_metric(services, "tandem:num_preemptions_total") > before
    stopped = 0
    for name, result in zip(names, results):
        text, reason = result[0]
        if reason == common_pb2.FINISH_REASON_STOP:
            check_json(text, SCHEMAS[name])
            stopped += 1
    assert stopped >= len(names) // 2
    wait_for_all_blocks_free(services.engine_address)


@pytest.mark.parametrize("constraint, field", [
    (structured(json_schema='{"type": "object", "properties": {"a": {"type": "nope"}}}'),
     "sampling_params.structured.json_schema does not compile"),
    (structured(regex="(unclosed"), "sampling_params.structured.regex does not compile"),
    (structured(choice=common_pb2.Choice()), "sampling_params.structured.choice.options is empty"),
    (structured(grammar="start: nothing_here"), "sampling_params.structured.grammar does not compile"),
])
def test_bad_constraints_are_invalid_argument(services, constraint, field):
    request = generation_pb2.GenerateRequest(text="hi", sampling_params=common_pb2.SamplingParams(
        max_tokens=5, structured=constraint))
    with pytest.raises(grpc.RpcError) as info:
        asyncio.run(completions(services.frontend_address, request))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field), info.value.details()
    wait_for_all_blocks_free(services.engine_address)
