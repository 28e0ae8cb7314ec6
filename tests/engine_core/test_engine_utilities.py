"""EngineCore's own utilities on a tiny random Llama (fp32, CPU): sleep / wake_up and profiling."""

from __future__ import annotations

import pytest

from engine_core.engine_core import EngineCore
from engine_core.protocol import EngineCoreRequest, SamplingParams
from tests.engine_core.test_engine import VOCAB, engine_config
from tests.engine_core.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def core(tmp_path_factory) -> EngineCore:
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), vocab_size=VOCAB, max_position_embeddings=256)
    return EngineCore(engine_config(folder))


def greedy(core: EngineCore, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    core.add_request(EngineCoreRequest(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for output in core.step().outputs for t in output.new_token_ids]
    return tokens


def test_sleep_frees_the_kv_cache_and_wake_up_gives_identical_output(core):
    prompt = [9, 10, 11, 12, 13, 14, 15, 16, 17]
    before = greedy(core, "before", prompt, 8)

    core.add_request(EngineCoreRequest("running", prompt, SamplingParams(max_tokens=50)))
    core.step()
    with pytest.raises(ValueError, match="1 requests are in flight"):
        core.sleep()
    assert not core.asleep and core.runner.kv_caches
    core.abort_requests(["running"])

    core.sleep()
    core.sleep()  # idempotent
    assert core.asleep and core.runner.kv_caches == []
    core.wake_up()
    assert not core.asleep and core.make_stats().num_free_blocks == core.make_stats().num_total_blocks
    assert greedy(core, "after", prompt, 8) == before


def test_profiling_writes_a_trace_and_refuses_clearly(core, tmp_path):
    with pytest.raises(ValueError, match="no profile is running"):
        core.stop_profile()
    with pytest.raises(ValueError, match="needs a folder"):
        core.start_profile("")
    (tmp_path / "a-file").write_text("in the way")
    with pytest.raises(ValueError, match="cannot write a profile into"):
        core.start_profile(str(tmp_path / "a-file" / "trace"))

    core.start_profile(str(tmp_path / "trace"))
    with pytest.raises(ValueError, match="already running"):
        core.start_profile(str(tmp_path / "other"))
    greedy(core, "profiled", [5, 6], 3)
    trace = core.stop_profile()
    assert trace.parent == tmp_path / "trace" and trace.stat().st_size > 0
    with pytest.raises(ValueError, match="no profile is running"):
        core.stop_profile()
