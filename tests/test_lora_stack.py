"""LoRA adapters through both services as real processes: an adapter named at start (--lora), loaded,
listed, pinned and unloaded over AdminService, used per request by Generate, Chat and Embed, with the
statuses of docs/lora.md (NOT_FOUND, INVALID_ARGUMENT, FAILED_PRECONDITION); a gateway's KV events name the
adapter of its blocks."""

from __future__ import annotations

import asyncio
import itertools
import json

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc
from tandem.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc

from engine_core.config import CacheConfig, EngineConfig, LoraConfig, ModelConfig, SchedulerConfig
from engine_core.loader import default_model_path
from engine_core.offline.llm_engine import LLMEngine
from engine_core.protocol import SamplingParams
from tests.engine_core.tiny_lora import write_tiny_adapter
from tests.engine_core.tiny_models import write_tiny_model
from tests.test_stack import ENGINE_FLAGS, MAX_MODEL_LEN, VOCAB, Services, greedy, stream_tokens
from tests.waits import STATE_TIMEOUT_S

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-lora-stack"), vocab_size=VOCAB, max_position_embeddings=512)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Two attention adapters (x, y) and one above the engine's --max-lora-rank 8 (wide)."""
    targets = ["q_proj", "v_proj"]
    return {name: write_tiny_adapter(tiny_model_dir, tmp_path_factory.mktemp(f"stack-{name}"), rank=rank, seed=seed,
                                     target_modules=targets)
            for name, rank, seed in (("x", 4, 1), ("y", 8, 2), ("wide", 16, 3))}


@pytest.fixture(scope="module")
def lora_services(tiny_model_dir, adapters):
    s = Services(["--model", str(tiny_model_dir), *ENGINE_FLAGS, "--lora", f"x={adapters['x']}", "--max-loras", "2",
                  "--max-lora-rank", "8"], ["--tokenizer", str(default_model_path())])
    yield s
    s.stop()


def offline_tokens(tiny_model_dir, adapters, lora_name, max_tokens):
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=16, num_blocks=600), scheduler=SchedulerConfig(max_num_seqs=64),
        lora=LoraConfig(adapters={"x": str(adapters["x"]), "y": str(adapters["y"])}, max_loras=2, max_lora_rank=8),
    ))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return engine.generate([PROMPT], params, lora_names=lora_name)[0].completions[0].token_ids


async def back_to_only_x(admin, adapters) -> None:
    """The adapters as the fixture started them (x alone), whatever an earlier run of a test left loaded."""
    listed = await admin.ListLoraAdapters(admin_pb2.ListLoraAdaptersRequest())
    for adapter in listed.adapters:
        if adapter.name != "x":
            await admin.UnloadLoraAdapter(admin_pb2.UnloadLoraAdapterRequest(lora_name=adapter.name))
    if "x" not in {adapter.name for adapter in listed.adapters}:
        await admin.LoadLoraAdapter(admin_pb2.LoadLoraAdapterRequest(lora_name="x", lora_path=str(adapters["x"])))


def test_adapters_over_grpc(lora_services, tiny_model_dir, adapters):
    async def run():
        async with grpc.aio.insecure_channel(lora_services.frontend_address) as channel:
            generation = generation_pb2_grpc.GenerationServiceStub(channel)
            admin = admin_pb2_grpc.AdminServiceStub(channel)

            def generate(lora_name="", max_tokens=12):
                return stream_tokens(generation, generation_pb2.GenerateRequest(
                    token_ids=generation_pb2.TokenIds(ids=PROMPT), sampling_params=greedy(max_tokens),
                    lora_name=lora_name))

            await back_to_only_x(admin, adapters)  # the stack lives for the module; make test-shake repeats this
            listed = await admin.ListLoraAdapters(admin_pb2.ListLoraAdaptersRequest())
            assert [(a.name, a.rank, list(a.target_modules)) for a in listed.adapters] == [("x", 4, ["q_proj",
                                                                                                   "v_proj"])]
            assert listed.adapters[0].engine == lora_services.engine_address
            base, with_x = await generate(), await generate("x")
            assert with_x == offline_tokens(tiny_model_dir, adapters, "x", 12) != base
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await generate("nope")
            assert error.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in error.value.details()

            loaded = await admin.LoadLoraAdapter(admin_pb2.LoadLoraAdapterRequest(lora_name="y",
                                                                                  lora_path=str(adapters["y"])))
            assert [(a.name, a.rank, a.location) for a in loaded.adapters] == [("y", 8, "host")]
            assert await generate("y") == offline_tokens(tiny_model_dir, adapters, "y", 12)
            pinned = await admin.PinLoraAdapter(admin_pb2.PinLoraAdapterRequest(lora_name="y"))
            assert pinned.adapters[0].pinned
            chat = await stream_tokens(generation, generation_pb2.ChatRequest(
                messages=[generation_pb2.ChatMessage(role="user", content="Hi")], sampling_params=greedy(4),
                lora_name="y"), method="Chat")
            assert len(chat) == 4
            embedded = await generation.Embed(generation_pb2.EmbedRequest(
                inputs=[generation_pb2.EmbedInput(token_ids=generation_pb2.TokenIds(ids=PROMPT))], lora_name="y"))
            base_embedding = await generation.Embed(generation_pb2.EmbedRequest(
                inputs=[generation_pb2.EmbedInput(token_ids=generation_pb2.TokenIds(ids=PROMPT))]))
            assert embedded.embeddings[0].values != base_embedding.embeddings[0].values

            for request, code, words in [
                (admin_pb2.LoadLoraAdapterRequest(lora_name="wide", lora_path=str(adapters["wide"])),
                 grpc.StatusCode.INVALID_ARGUMENT, "above max_lora_rank 8"),
                (admin_pb2.LoadLoraAdapterRequest(lora_name="gone", lora_path="/no/such/folder"),
                 grpc.StatusCode.INVALID_ARGUMENT, "does not exist"),
                (admin_pb2.LoadLoraAdapterRequest(lora_name="", lora_path="/x"), grpc.StatusCode.INVALID_ARGUMENT,
                 "lora_name and lora_path"),
                (admin_pb2.UnloadLoraAdapterRequest(lora_name="nope"), grpc.StatusCode.NOT_FOUND, "not loaded"),
                (admin_pb2.PinLoraAdapterRequest(lora_name="nope"), grpc.StatusCode.NOT_FOUND, "not loaded"),
            ]:
                call = admin.LoadLoraAdapter if isinstance(request, admin_pb2.LoadLoraAdapterRequest) else (
                    admin.UnloadLoraAdapter if isinstance(request, admin_pb2.UnloadLoraAdapterRequest)
                    else admin.PinLoraAdapter)
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await call(request)
                assert error.value.code() == code and words in error.value.details(), error.value.details()

            # unloading an adapter in use is refused; a paused (KEEP) stream holds it in flight. The stream may
            # run until the pause lands: it asks for all the context there is (make test-shake lost 60 tokens
            # to the pause's round trip once), and the engine is a separate process no test can hold
            stream = generation.Generate(generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=PROMPT), sampling_params=greedy(MAX_MODEL_LEN - len(PROMPT)),
                lora_name="x"))
            await stream.read()
            await admin.Pause(admin_pb2.PauseRequest(mode=common_pb2.PAUSE_MODE_KEEP))
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await admin.UnloadLoraAdapter(admin_pb2.UnloadLoraAdapterRequest(lora_name="x"))
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "requests in flight" in error.value.details()
            await admin.Resume(admin_pb2.ResumeRequest())
            while await stream.read() != grpc.aio.EOF:
                pass
            unloaded = await admin.UnloadLoraAdapter(admin_pb2.UnloadLoraAdapterRequest(lora_name="x"))
            assert list(unloaded.engines) == [lora_services.engine_address]
            listed = await admin.ListLoraAdapters(admin_pb2.ListLoraAdaptersRequest())
            assert [a.name for a in listed.adapters] == ["y"]
            with pytest.raises(grpc.aio.AioRpcError) as error:  # the frontend learned the engine no longer has it
                await generate("x")
            assert error.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(run())


def test_python_client_and_cli(lora_services, tiny_model_dir, adapters):
    from clients.client import TandemClient
    from clients.errors import TandemError
    from tests.clients.conftest import run_cli

    address = lora_services.frontend_address
    with TandemClient(address) as client:
        loaded = client.load_lora("cli-y", str(adapters["y"]))
        assert [(a.name, a.rank, a.engine) for a in loaded] == [("cli-y", 8, lora_services.engine_address)]
        chunks = list(client.generate(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True, lora_name="cli-y"))
        assert [t for c in chunks for t in c.token_ids] == offline_tokens(tiny_model_dir, adapters, "y", 12)
        assert len(client.embed(PROMPT, lora_name="cli-y").embeddings[0]) > 0
        with pytest.raises(TandemError) as error:
            list(client.generate(PROMPT, max_tokens=2, lora_name="nope"))
        assert error.value.code == grpc.StatusCode.NOT_FOUND
    listed = run_cli("admin", "lora", "list", "--json", "--address", address)
    assert listed.returncode == 0, listed.stderr
    assert "cli-y" in {a["name"] for a in json.loads(listed.stdout)}
    pinned = run_cli("admin", "lora", "pin", "cli-y", "--address", address)
    assert pinned.returncode == 0 and "\tpinned\t" in pinned.stdout, pinned.stderr
    unloaded = run_cli("admin", "lora", "unload", "cli-y", "--address", address)
    assert unloaded.returncode == 0 and unloaded.stdout.startswith("unloaded cli-y"), unloaded.stderr
    refused = run_cli("admin", "lora", "load", "wide", str(adapters["wide"]), "--address", address)
    assert refused.returncode != 0 and "max_lora_rank" in refused.stderr


_KV_EVENT_RUNS = itertools.count()


def test_a_gateways_kv_events_name_the_adapter_of_its_blocks(lora_services, adapters):
    """SubscribeKvEvents (the worker protocol smg reads) on the frontend: the blocks of a tandem.v1 request under
    an adapter are announced with its lora_name (smg folds it into its hashes), the same prompt's base blocks
    with none."""
    # two full 16-token blocks, new to the shared stack's cache on every run: blocks an earlier run cached (make
    # test-shake repeats tests) are not stored again, and the wait below would never end
    first_token = 1000 + 40 * next(_KV_EVENT_RUNS)
    prompt = list(range(first_token, first_token + 40))

    async def run():
        async with grpc.aio.insecure_channel(lora_services.frontend_address) as channel:
            admin = admin_pb2_grpc.AdminServiceStub(channel)
            generation = generation_pb2_grpc.GenerationServiceStub(channel)
            await admin.LoadLoraAdapter(admin_pb2.LoadLoraAdapterRequest(lora_name="kv", lora_path=str(adapters["x"])))
            events = vllm_engine_pb2_grpc.VllmEngineStub(channel).SubscribeKvEvents(
                smg_common_pb2.SubscribeKvEventsRequest())
            await events.read()  # the snapshot
            stored = {}  # (lora_name or None, token ids) -> has a parent
            for lora_name in ("kv", ""):
                await stream_tokens(generation, generation_pb2.GenerateRequest(
                    token_ids=generation_pb2.TokenIds(ids=prompt), sampling_params=greedy(2), lora_name=lora_name))
            # load reports keep coming: bound the wait itself
            deadline = asyncio.get_running_loop().time() + STATE_TIMEOUT_S
            while len(stored) < 4:
                assert asyncio.get_running_loop().time() < deadline, f"blocks stored so far: {stored}"
                batch = await asyncio.wait_for(events.read(), STATE_TIMEOUT_S)
                for event in batch.events:
                    if event.WhichOneof("data") == "stored":
                        name = event.stored.lora_name if event.stored.HasField("lora_name") else None
                        for block in event.stored.blocks:
                            stored[name, tuple(block.token_ids)] = event.stored.HasField("parent_block_hash")
            events.cancel()
            await admin.UnloadLoraAdapter(admin_pb2.UnloadLoraAdapterRequest(lora_name="kv"))
            return stored

    first, second = tuple(prompt[:16]), tuple(prompt[16:32])
    assert asyncio.run(run()) == {("kv", first): False, ("kv", second): True, (None, first): False,
                                  (None, second): True}
