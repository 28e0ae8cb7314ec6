"""Scheduling many adapters: at most max_loras in a step, no request starved, the prefix cache keyed
by adapter; on the real engine, five adapters over four slots with a host LRU and a pinned adapter,
and what unloading an adapter in use does (refused: docs/lora.md)."""

from __future__ import annotations

import json
from array import array
from hashlib import blake2b

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from engine_core.engine_core import EngineCore
from engine_core.lora.admission import LoraAdmission
from engine_core.lora.errors import LoraAdapterError, LoraDisabledError, LoraInUseError, UnknownLoraError
from engine_core.protocol import EngineCoreRequest, SamplingParams, hash_prompt_blocks
from engine_core.request import Request
from tests.engine_core.fake_runner import FakeRunner
from tests.engine_core.scheduler_harness import BLOCK, check_accounting, make_scheduler
from tests.engine_core.test_lora import BLOCK_SIZE, lora_config
from tests.engine_core.tiny_lora import write_tiny_adapter
from tests.engine_core.tiny_models import write_tiny_model

NAMES = ["a", "b", "c", "d", "e"]


def lora_request(request_id, token_ids, lora_name, max_tokens=4):
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   block_size=BLOCK, lora_name=lora_name)


def with_lora(scheduler, max_loras=4, max_wait_steps=8):
    scheduler.lora = LoraAdmission(max_loras, max_wait_steps)
    return scheduler


def step(scheduler, runner):
    """One step; returns the adapters it ran."""
    scheduler_output = scheduler.schedule()
    adapters = {r.lora_name for r in scheduler_output.scheduled_requests if r.lora_name is not None}
    scheduler.update_from_output(scheduler_output, runner.execute(scheduler_output))
    check_accounting(scheduler)
    return adapters


# ---- the scheduler, with the fake runner ---------------------------------------------------------
@given(requests=st.lists(st.tuples(st.sampled_from([None, *NAMES]), st.integers(1, 20), st.integers(1, 12),
                                   st.integers(0, 30)), min_size=1, max_size=40),
       max_loras=st.integers(1, 4), budget=st.integers(4, 64))
@settings(max_examples=60, deadline=None)
def test_no_step_holds_more_than_max_loras_and_every_request_finishes(requests, max_loras, budget):
    scheduler = with_lora(make_scheduler(num_blocks=128, max_model_len=64, budget=budget), max_loras)
    runner = FakeRunner(BLOCK)
    arrivals = sorted(enumerate(requests), key=lambda item: item[1][3])
    finished: set[str] = set()
    for now in range(2000):
        while arrivals and arrivals[0][1][3] <= now:
            i, (name, length, max_tokens, _) = arrivals.pop(0)
            scheduler.add_request(lora_request(f"r{i}", range(i, i + length), name, max_tokens))
        if not arrivals and not scheduler.has_unfinished_requests():
            break
        output_so = scheduler.schedule()
        adapters = {r.lora_name for r in output_so.scheduled_requests if r.lora_name is not None}
        assert len(adapters) <= max_loras
        outputs = scheduler.update_from_output(output_so, runner.execute(output_so))
        finished |= outputs.finished_request_ids
        check_accounting(scheduler)
    assert finished == {f"r{i}" for i in range(len(requests))}


@pytest.mark.parametrize("max_wait_steps, admitted", [(4, True), (10_000, False)])
def test_a_request_passed_over_for_other_adapters_is_not_starved(max_wait_steps, admitted):
    """Four adapters keep arriving; a fifth waits. Passed over up to max_wait_steps times, it then holds the
    queue until a slot frees. Without the bound (10,000 steps) it would still wait when the stream stops."""
    scheduler = with_lora(make_scheduler(num_blocks=256, max_model_len=64, budget=64, max_num_seqs=16), 4,
                          max_wait_steps)
    runner = FakeRunner(BLOCK)
    for i, name in enumerate("abcd"):
        scheduler.add_request(lora_request(f"first-{name}", [i + 1] * 3, name, max_tokens=6))
    scheduler.add_request(lora_request("fifth", [9] * 3, "e", max_tokens=2))
    ran_at = None
    for now in range(60):
        for i, name in enumerate("abcd"):  # the stream: a new request of each running adapter every step
            scheduler.add_request(lora_request(f"{name}-{now}", [i + 1, now % 50 + 2, 3], name, max_tokens=6))
        if "e" in step(scheduler, runner):
            ran_at = now
            break
    assert (ran_at is not None) == admitted
    if admitted:  # passed over 4 times, then the running requests' 6 tokens drain
        assert ran_at <= max_wait_steps + 6 + 2


def test_prefix_cache_is_keyed_by_adapter():
    scheduler = with_lora(make_scheduler(num_blocks=64, budget=64))
    runner = FakeRunner(BLOCK)
    prompt = list(range(10, 10 + 3 * BLOCK + 1))
    cached = {}
    for request_id, name in [("base", None), ("x", "x"), ("y", "y"), ("x-again", "x"), ("base-again", None)]:
        scheduler.add_request(lora_request(request_id, prompt, name, max_tokens=1))
        scheduler_output = scheduler.schedule()
        cached[request_id] = scheduler.requests[request_id].num_cached_tokens
        scheduler.update_from_output(scheduler_output, runner.execute(scheduler_output))
    assert cached == {"base": 0, "x": 0, "y": 0, "x-again": 3 * BLOCK, "base-again": 3 * BLOCK}
    # the router computes the engine's hashes from the prompt and the adapter name
    assert hash_prompt_blocks(prompt, BLOCK, lora_name="x") == lora_request("q", prompt, "x").block_hashes
    assert hash_prompt_blocks(prompt, BLOCK) == lora_request("q", prompt, None).block_hashes
    assert not set(hash_prompt_blocks(prompt, BLOCK, lora_name="x")) & set(hash_prompt_blocks(prompt, BLOCK))
    # the scheme as engine_core.proto's KVCacheEvents states it, for routers written elsewhere
    root = blake2b("x".encode(), digest_size=8, person=b"tandem-kv-v1", salt=b"lora").digest()
    first = blake2b(root + array("i", prompt[:BLOCK]).tobytes(), digest_size=8, person=b"tandem-kv-v1").digest()
    assert hash_prompt_blocks(prompt, BLOCK, lora_name="x")[0] == int.from_bytes(first, "little")


# ---- the engine: five adapters over four slots ------------------------------------------------------
@pytest.fixture(scope="module")
def five_adapters(tmp_path_factory):
    base = write_tiny_model(tmp_path_factory.mktemp("tiny-llama-5"), vocab_size=256)
    folders = {name: write_tiny_adapter(base, tmp_path_factory.mktemp(f"adapter-{name}"), rank=4, alpha=8, seed=i,
                                        target_modules=["q_proj", "v_proj", "down_proj"])
               for i, name in enumerate(NAMES)}
    return base, folders


def run_core(core: EngineCore, requests: list[EngineCoreRequest], max_loras: int):
    """Step to completion, checking every step's adapters; returns tokens per request id."""
    for request in requests:
        core.add_request(request)
    tokens = {r.request_id: [] for r in requests}
    while core.has_unfinished_requests():
        scheduler_output = core.scheduler.schedule()
        adapters = {r.lora_name for r in scheduler_output.scheduled_requests if r.lora_name is not None}
        assert len(adapters) <= max_loras
        outputs = core.scheduler.update_from_output(scheduler_output, core.runner.execute_model(scheduler_output))
        for output in outputs.outputs:
            tokens[output.request_id].extend(output.new_token_ids)
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.info.num_blocks - 1
    return tokens


def greedy(request_id, prompt, name, max_tokens=8):
    return EngineCoreRequest(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                             lora_name=name)


def test_five_adapters_over_four_slots_with_a_pinned_one(five_adapters):
    base, folders = five_adapters
    core = EngineCore(lora_config(base, folders, max_loras=4, max_cpu_loras=4))
    assert core.list_loras()[0].pinned is False
    core.pin_lora("a")
    prompts = {name: [10 + i, 20, 30, 40 + i, 50] for i, name in enumerate([None, *NAMES])}
    requests = [greedy(f"{name}-{k}", prompts[name], name) for k in range(3) for name in [None, *NAMES]]
    tokens = run_core(core, requests, max_loras=4)
    info = {i.name: i for i in core.list_loras()}
    host = core.lora.manager.host
    assert len(host) == 4 and info["a"].pinned and "a" in host  # pinned: never pushed out of host memory
    assert sum(i.location == "device" for i in info.values()) == 4  # the others: "host", or "disk" if pushed out
    assert {i.location for i in info.values() if i.name not in host} <= {"device", "disk"}
    # every request's tokens are those of its adapter run alone (a re-read adapter included)
    for name in [None, *NAMES]:
        alone = run_core(core, [greedy(f"alone-{name}", prompts[name], name)], max_loras=4)[f"alone-{name}"]
        assert all(tokens[f"{name}-{k}"] == alone for k in range(3)), name
    distinct = {tuple(tokens[f"{name}-0"]) for name in [None, *NAMES]}
    assert len(distinct) == 6, "every adapter changes the output"


def test_kv_events_name_the_adapter_of_each_stored_block(five_adapters):
    """What a router hears: the blocks of two adapters' requests grouped by adapter, the base's in no group."""
    base, folders = five_adapters
    core = EngineCore(lora_config(base, {"a": folders["a"], "b": folders["b"]}, max_loras=2), kv_events=True)
    prompt = list(range(30, 30 + 2 * BLOCK_SIZE + 1))  # two full blocks
    for name in (None, "a", "b"):
        core.add_request(greedy(f"{name}-1", prompt, name, max_tokens=1))
    stored, stored_lora = [], {}
    while core.has_unfinished_requests():
        events = core.step().kv_events
        if events is not None:
            stored += events.stored
            for name, hashes in events.stored_lora.items():
                stored_lora.setdefault(name, []).extend(hashes)
    hashes = {name: hash_prompt_blocks(prompt, BLOCK_SIZE, lora_name=name) for name in (None, "a", "b")}
    assert stored_lora == {"a": hashes["a"], "b": hashes["b"]}
    assert sorted(stored) == sorted(hashes[None] + hashes["a"] + hashes["b"])  # the base's blocks: in no group
    assert core.kv_cache_snapshot().stored_lora == {"a": hashes["a"], "b": hashes["b"]}


def test_unload_and_errors(five_adapters, tmp_path):
    base, folders = five_adapters
    core = EngineCore(lora_config(base, {"a": folders["a"]}, max_loras=2))
    core.add_request(greedy("busy", [5, 6, 7], "a", max_tokens=4))
    core.step()
    with pytest.raises(LoraInUseError, match="1 requests in flight"):
        core.remove_lora("a")
    while core.has_unfinished_requests():
        core.step()
    core.remove_lora("a")
    assert core.list_loras() == []
    with pytest.raises(UnknownLoraError, match="'a' is not loaded"):
        core.add_request(greedy("gone", [5, 6, 7], "a"))
    with pytest.raises(UnknownLoraError):
        core.remove_lora("a")
    info = core.add_lora("b", str(folders["b"]))
    assert (info.rank, info.target_modules, info.location) == (4, ("down_proj", "q_proj", "v_proj"), "host")
    with pytest.raises(LoraAdapterError, match="already loaded from"):
        core.add_lora("b", str(folders["c"]))
    # a rank above max_lora_rank (16)
    high = write_tiny_adapter(base, tmp_path / "high", rank=32, target_modules=["q_proj"])
    with pytest.raises(LoraAdapterError, match="rank 32 .* above max_lora_rank 16"):
        core.add_lora("high", str(high))
    # modules the model does not have: an adapter of a deeper model, and a module kind Tandem has no slot for
    deeper = write_tiny_model(tmp_path / "deeper", num_layers=3, vocab_size=256)
    with pytest.raises(LoraAdapterError, match="model.layers.2"):
        core.add_lora("deeper", str(write_tiny_adapter(deeper, tmp_path / "deeper-adapter", rank=4)))
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "adapter_config.json").write_text((folders["b"] / "adapter_config.json").read_text())
    weights = load_file(folders["b"] / "adapter_model.safetensors")
    weights = {key.replace("q_proj", "rotary_proj"): tensor for key, tensor in weights.items()}
    save_file(weights, odd / "adapter_model.safetensors")
    with pytest.raises(LoraAdapterError, match="does not have: rotary_proj"):
        core.add_lora("odd", str(odd))
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    with pytest.raises(LoraAdapterError, match="use_dora"):
        core.add_lora("dora", str(dora))
    with pytest.raises(LoraAdapterError, match="does not exist"):
        core.add_lora("nowhere", str(tmp_path / "nowhere"))
    assert [i.name for i in core.list_loras()] == ["b"]
    # the engine still serves after every refusal
    assert len(run_core(core, [greedy("after", [5, 6, 7], "b")], max_loras=2)["after"]) == 8


def test_an_engine_without_lora_says_so(five_adapters):
    base, _ = five_adapters
    config = lora_config(base, {})
    config.lora.enable = False
    core = EngineCore(config)
    assert core.lora is None and core.list_loras() == []
    with pytest.raises(LoraDisabledError, match="--enable-lora"):
        core.add_lora("a", "/nowhere")
    with pytest.raises(LoraDisabledError):
        core.validate_request(greedy("x", [1, 2], "a"))
    assert torch.is_grad_enabled()  # nothing above left inference mode on


def test_stats_and_metrics_name_the_running_and_waiting_adapters():
    from services.telemetry.metrics import EngineMetrics

    scheduler = with_lora(make_scheduler(num_blocks=128, budget=64), max_loras=2, max_wait_steps=100)
    runner = FakeRunner(BLOCK)
    for i, name in enumerate(["a", "b", "c", "a", None]):
        scheduler.add_request(lora_request(f"r{i}", [i + 1] * 3, name, max_tokens=8))
    step(scheduler, runner)
    stats = scheduler.make_stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters, stats.max_lora) == ({"a": 2, "b": 1}, {"c": 1},
                                                                                          2)
    metrics = EngineMetrics("tiny")
    metrics.record_step(stats, 0.01)
    labels = {"model_name": "tiny", "max_lora": "2", "running_lora_adapters": "a,b", "waiting_lora_adapters": "c"}
    assert metrics.registry.get_sample_value("tandem:lora_requests_info", labels) > 0
    assert make_scheduler().make_stats().max_lora == 0  # without LoRA: no adapters, no info series


def test_host_memory_full_of_pinned_adapters_still_serves_the_others(five_adapters, tmp_path):
    """max_cpu_loras 2, both pinned: a third adapter cannot be loaded into host memory, but one loaded before
    them and pushed out is read for its requests without being kept; one whose folder vanished is refused when
    its request arrives, not in a step."""
    import shutil

    base, folders = five_adapters
    moved = tmp_path / "c"
    shutil.copytree(folders["c"], moved)
    core = EngineCore(lora_config(base, {"a": folders["a"], "b": folders["b"], "c": moved}, max_loras=2,
                                  max_cpu_loras=2))
    core.pin_lora("a")
    core.pin_lora("b")
    assert set(core.lora.manager.host) == {"a", "b"}
    with pytest.raises(LoraAdapterError, match="all are pinned"):
        core.add_lora("d", str(folders["d"]))
    tokens = run_core(core, [greedy("c-1", [5, 6, 7], "c")], max_loras=2)["c-1"]
    assert len(tokens) == 8 and set(core.lora.manager.host) == {"a", "b"}
    run_core(core, [greedy(f"{n}-1", [5, 6, 7], n) for n in "ab"], max_loras=2)  # c leaves the slots
    shutil.rmtree(moved)
    with pytest.raises(LoraAdapterError, match="does not exist"):
        core.add_request(greedy("c-2", [5, 6, 7], "c"))
    assert not core.has_unfinished_requests()
