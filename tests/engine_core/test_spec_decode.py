"""Speculative decoding in the whole engine (tiny random Llama, fp32, CPU): outputs equal those without it, token
for token, with fewer target forwards where the output repeats; every stop, limit and feature still holds; aborts
at any point leave no block behind; the prefix cache never indexes a rejected draft's KV."""

from __future__ import annotations

import random

import pytest
import torch

from engine_core.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine_core.engine_core import EngineCore
from engine_core.offline.llm_engine import LLMEngine
from engine_core.protocol import EngineCoreRequest, FinishReason, SamplingParams
from engine_core.spec_decode import Proposer
from tests.engine_core.test_engine import CPP, INTERPRETER
from tests.engine_core.tiny_models import write_tiny_model

BLOCK_SIZE = 4
VOCAB = 256
K = 4


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama-spec"), vocab_size=VOCAB, max_position_embeddings=256)


def config(folder, *, spec=True, backend="torch", num_blocks=512, budget=64, max_num_seqs=32, max_batch=64,
           max_model_len=None, k=K, lora=None) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(folder), dtype="float32", max_model_len=max_model_len),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
        device=DeviceConfig(device="cpu", attention_backend=backend),
        lora=lora or LoraConfig(),
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=k, max_batch=max_batch)
        if spec else SpeculativeConfig(),
    )


def prompts() -> list[list[int]]:
    """Fresh prompts and copy-heavy ones (a passage said three times, or twice); the first and the last set the
    random model's greedy output repeating itself (a token, a pair)."""
    g = torch.Generator().manual_seed(11)
    fresh = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 17, 30)]
    passage = torch.randint(4, VOCAB, (10,), generator=g).tolist()
    return fresh + [passage * 3, passage + [7, 8] + passage, [5, 6, 7, 8] * 5]


class Run:
    """Requests through one EngineCore, step by step; tokens, logprobs, forwards and drafts counted."""

    def __init__(self, cfg: EngineConfig, prompt_list, params) -> None:
        self.core = core = EngineCore(cfg)
        params_list = params if isinstance(params, list) else [params] * len(prompt_list)
        for i, (prompt, p) in enumerate(zip(prompt_list, params_list)):
            core.add_request(EngineCoreRequest(f"r{i}", prompt, p))
        self.tokens = {f"r{i}": [] for i in range(len(prompt_list))}
        self.logprobs = {f"r{i}": [] for i in range(len(prompt_list))}
        self.finish = {}
        self.forwards = self.draft_tokens = self.accepted = self.preemptions = 0
        while core.has_unfinished_requests():
            outputs = core.step()
            stats = outputs.scheduler_stats
            self.forwards += stats.num_scheduled_tokens > 0
            self.preemptions += stats.num_preemptions
            self.draft_tokens += core.scheduler.spec_decode_stats.num_draft_tokens
            self.accepted += core.scheduler.spec_decode_stats.num_accepted_tokens
            for out in outputs.outputs:
                self.tokens[out.request_id] += out.new_token_ids
                self.logprobs[out.request_id] += out.new_logprobs or []
                if out.finish_reason is not None:
                    self.finish[out.request_id] = out.finish_reason
        assert core.scheduler.kv_cache_manager.num_free_blocks == core.info.num_blocks - 1
        self.outputs = list(self.tokens.values())


@pytest.mark.parametrize("backend", [
    pytest.param("torch"),
    pytest.param("cpp", marks=CPP),
])
def test_greedy_output_is_the_targets_with_fewer_forwards(tiny_model_dir, backend):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    off = Run(config(tiny_model_dir, spec=False, backend=backend), prompts(), params)
    on = Run(config(tiny_model_dir, backend=backend), prompts(), params)
    assert on.outputs == off.outputs
    assert on.accepted > 0 and on.draft_tokens >= on.accepted
    # requests alone whose output repeats itself: each accepted draft is a target forward saved
    forwards_on = forwards_off = 0
    for prompt in (prompts()[0], prompts()[6]):
        alone_off = Run(config(tiny_model_dir, spec=False, backend=backend), [prompt], params)
        alone_on = Run(config(tiny_model_dir, backend=backend), [prompt], params)
        assert alone_on.outputs == alone_off.outputs
        assert alone_on.forwards + alone_on.accepted == alone_off.forwards
        forwards_on, forwards_off = forwards_on + alone_on.forwards, forwards_off + alone_off.forwards
    assert forwards_on < 0.8 * forwards_off, (forwards_on, forwards_off)


@INTERPRETER
def test_greedy_output_with_triton_attention_in_the_interpreter(tiny_model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    chosen = [prompts()[i] for i in (1, 4, 6)]
    off = Run(config(tiny_model_dir, spec=False, backend="triton"), chosen, params)
    on = Run(config(tiny_model_dir, backend="triton"), chosen, params)
    assert on.outputs == off.outputs and on.accepted > 0


def test_seeded_sampling_is_the_same_with_speculation(tiny_model_dir):
    """Each verified row draws with the noise its own step would, and the generator is rewound past the rejected
    rows: a seeded request samples the same tokens with speculation on or off."""
    params = [SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=24, ignore_eos=True)
              for t, p, s in ((0.1, 1.0, 1), (1.0, 0.9, 2), (0.05, 1.0, 3), (0.5, 0.8, 4), (0.2, 1.0, 5),
                              (0.6, 1.0, 6), (0.1, 0.9, 7))]
    off = Run(config(tiny_model_dir, spec=False), prompts(), params)
    on = Run(config(tiny_model_dir), prompts(), params)
    assert on.outputs == off.outputs
    assert on.accepted > 0


def test_stops_limits_and_logprobs_hold(tiny_model_dir):
    """max_tokens is never passed, a stop token ends the output where it would, min_tokens holds EOS back, and
    every emitted token has its logprobs; logit_bias and penalties see the drafts before each row."""
    copy = prompts()[4]
    greedy = Run(config(tiny_model_dir, spec=False), [copy], SamplingParams(temperature=0.0, max_tokens=40,
                                                                          ignore_eos=True)).outputs[0]
    stop_at = greedy[13]
    eos = 2  # the tiny model's EOS ids are 2 and 3
    cases = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3, 5, 7, 11)
    ] + [
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_at]),
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=20, logit_bias={eos: 8.0}),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3,
                       frequency_penalty=0.4),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logit_bias={greedy[5]: 3.0}),
    ]
    off = Run(config(tiny_model_dir, spec=False), [copy] * len(cases), cases)
    on = Run(config(tiny_model_dir), [copy] * len(cases), cases)
    assert on.outputs == off.outputs
    assert on.finish == off.finish
    for i, params in enumerate(cases[:6]):
        assert len(on.outputs[i]) == params.max_tokens
    stopped = on.outputs[6]
    assert stopped[-1] == stop_at and stop_at not in stopped[:-1] and on.finish["r6"] == FinishReason.STOP
    assert len(on.outputs[7]) == 21 and on.outputs[7][-1] == eos  # EOS, held back for min_tokens (20)
    assert len(on.logprobs["r8"]) == 30
    for token, (ours, theirs) in zip(on.outputs[8], zip(on.logprobs["r8"], off.logprobs["r8"])):
        assert ours.token_ids[0] == token and ours.token_ids == theirs.token_ids
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)
    assert on.accepted > 0


def test_max_model_len_is_never_passed(tiny_model_dir):
    copy = prompts()[4]  # 30 tokens
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    off = Run(config(tiny_model_dir, spec=False, max_model_len=47), [copy], params)
    on = Run(config(tiny_model_dir, max_model_len=47), [copy], params)
    assert on.outputs == off.outputs and len(on.outputs[0]) == 47 - len(copy)
    assert on.finish["r0"] == FinishReason.LENGTH


def test_preemption_keeps_outputs(tiny_model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    off = Run(config(tiny_model_dir, spec=False), prompts(), params)
    tight = Run(config(tiny_model_dir, num_blocks=40, max_model_len=72), prompts(), params)
    assert tight.preemptions > 0
    assert tight.outputs == off.outputs
    assert tight.accepted > 0


def test_the_prefix_cache_never_holds_a_rejected_drafts_kv(tiny_model_dir):
    """A second request whose prompt is the first's prompt and output reads the first's blocks from the cache: if a
    block held a rejected draft's KV, its continuation would differ from the one computed without speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)
    core = EngineCore(config(tiny_model_dir))
    reference = EngineCore(config(tiny_model_dir, spec=False))
    for i, prompt in enumerate(prompts()):
        first = generate(core, f"a{i}", prompt, params)
        follow = prompt + first[:-1]
        cached = generate(core, f"b{i}", follow, params)
        assert cached == generate(reference, f"b{i}", follow, params), f"prompt {i}"
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.cached_blocks and all(len(block.token_ids) == BLOCK_SIZE for block in pool.cached_blocks.values())
    assert pool.num_free_blocks == pool.num_blocks - 1


def generate(core: EngineCore, request_id: str, prompt: list[int], params: SamplingParams) -> list[int]:
    core.add_request(EngineCoreRequest(request_id, prompt, params))
    tokens = []
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens += out.new_token_ids
    return tokens


def test_aborts_mid_verification_leak_no_block(tiny_model_dir):
    """Two hundred random cuts, each in a step that verifies drafts: its requests aborted after the step was
    scheduled, or after its forward and before its update (the busy loop aborts between steps, where drafts are
    pending; the overlapped engine's step is in flight then)."""
    core = EngineCore(config(tiny_model_dir, num_blocks=64, max_model_len=96))
    manager = core.scheduler.kv_cache_manager
    rng = random.Random(5)
    all_prompts = [prompts()[i] for i in (0, 0, 3, 4, 6, 6)]  # mostly the ones whose drafts are accepted
    cuts = 0
    for cut in range(200):
        ids = [f"c{cut}-{j}" for j in range(rng.randint(1, 4))]
        for request_id in ids:
            params = SamplingParams(temperature=rng.choice([0.0, 0.0, 0.8]), max_tokens=rng.randint(8, 40),
                                    ignore_eos=True)
            core.add_request(EngineCoreRequest(request_id, rng.choice(all_prompts), params))
        for _ in range(rng.randint(0, 8)):
            core.step()
        for _ in range(40):  # on to a step that verifies drafts, and cut it
            scheduler_output = core.scheduler.schedule()
            if scheduler_output.spec_token_ids and rng.random() < 0.5:
                core.abort_requests(ids)
            runner_output = core.runner.execute_model(scheduler_output)
            if scheduler_output.spec_token_ids:
                core.abort_requests(ids)
            core.scheduler.update_from_output(scheduler_output, runner_output)
            if scheduler_output.spec_token_ids or not core.has_unfinished_requests():
                cuts += bool(scheduler_output.spec_token_ids)
                break
        core.abort_requests(ids)
        assert not core.has_unfinished_requests()
        assert manager.num_free_blocks == core.info.num_blocks - 1, f"cut {cut}"
        assert not manager.req_to_blocks and not manager.req_to_block_ids
    assert cuts >= 150, cuts


def test_per_request_switch_batch_rule_and_structured_output(tiny_model_dir):
    """speculative=False turns it off for a request; over max_batch running requests no step verifies drafts."""
    copy = prompts()[4]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    off = Run(config(tiny_model_dir), [copy], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                             speculative=False))
    assert off.draft_tokens == 0
    crowd = Run(config(tiny_model_dir, max_batch=2), [copy] * 3, params)
    assert crowd.draft_tokens == 0
    pair = Run(config(tiny_model_dir, max_batch=2), [copy] * 2, params)
    assert pair.accepted > 0 and pair.outputs == off.outputs * 2


def test_n_greater_than_one_and_lora_rows(tiny_model_dir, tmp_path):
    from tests.engine_core.tiny_lora import write_tiny_adapter

    adapter = write_tiny_adapter(tiny_model_dir, tmp_path / "adapter", rank=4, scale=0.5)
    lora = LoraConfig(enable=True, max_loras=2, max_lora_rank=8, adapters={"a": str(adapter)})
    copy = prompts()[4]
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    results = []
    for spec in (False, True):
        engine = LLMEngine(config(tiny_model_dir, spec=spec, lora=lora))
        fan = engine.generate([copy], params)[0]
        mixed = engine.generate([copy, copy], greedy, lora_names=["a", None])
        results.append(([c.token_ids for c in fan.completions], [m.completions[0].token_ids for m in mixed]))
        core = engine.engine_core
        assert core.scheduler.kv_cache_manager.num_free_blocks == core.info.num_blocks - 1
    assert results[0] == results[1]
    assert results[1][1][0] != results[1][1][1]  # the adapter changed its row's output


class Wrong(Proposer):
    """Proposes tokens the model never picks (greedy on this model and prompt: checked by the test)."""

    def propose(self, inputs):
        return [[1] * item.num_drafts for item in inputs]


def test_a_request_whose_drafts_keep_failing_rests(tiny_model_dir):
    """Verifications that accept nothing make the request go without drafts for 1, 3, 7, 15 then 16 steps."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompt = prompts()[1]
    off = Run(config(tiny_model_dir, spec=False), [prompt], params)
    assert 1 not in off.outputs[0]
    core = EngineCore(config(tiny_model_dir))
    core.runner.spec.proposer = Wrong()
    core.add_request(EngineCoreRequest("r", prompt, params))
    verified_at, tokens, step = [], [], 0
    while core.has_unfinished_requests():
        outputs = core.step()
        step += 1
        if core.scheduler.spec_decode_stats.num_drafts:
            verified_at.append(step)
        tokens += [t for out in outputs.outputs for t in out.new_token_ids]
    assert tokens == off.outputs[0]
    # step 1 is the prompt's (and proposes); after each failed verification 1, 3, 7, 15 plain steps
    assert verified_at == [2, 4, 8, 16, 32]


# ---- a draft model -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def noisy_draft_dir(tiny_model_dir, tmp_path_factory):
    """The target's weights with noise added: a draft that agrees with it often, not always."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("tiny-llama-draft")
    shutil.copy(tiny_model_dir / "config.json", folder / "config.json")
    weights = load_file(tiny_model_dir / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    save_file({name: w + 0.03 * torch.randn(w.shape, generator=g) for name, w in weights.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def draft_config(folder, draft, *, backend="torch", **kwargs) -> EngineConfig:
    cfg = config(folder, backend=backend, **kwargs)
    cfg.speculative = SpeculativeConfig(method="draft", draft_model=str(draft), num_speculative_tokens=K, max_batch=64)
    return cfg


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=INTERPRETER)])
def test_a_draft_model_gives_the_same_greedy_output_with_fewer_forwards(tiny_model_dir, noisy_draft_dir, backend):
    params = SamplingParams(temperature=0.0, max_tokens=16 if backend == "triton" else 32, ignore_eos=True)
    chosen = [prompts()[i] for i in (0, 2)] if backend == "triton" else prompts()
    off = Run(config(tiny_model_dir, spec=False, backend=backend), chosen, params)
    # the model as its own draft: every draft accepted (up to fp32 near-ties), one forward per k + 1 tokens
    same = Run(draft_config(tiny_model_dir, tiny_model_dir, backend=backend), chosen, params)
    assert same.outputs == off.outputs
    assert same.accepted >= 0.9 * same.draft_tokens
    noisy = Run(draft_config(tiny_model_dir, noisy_draft_dir, backend=backend), chosen, params)
    assert noisy.outputs == off.outputs
    assert 0 < noisy.accepted < noisy.draft_tokens
    alone_off = Run(config(tiny_model_dir, spec=False, backend=backend), chosen[:1], params)
    alone = Run(draft_config(tiny_model_dir, noisy_draft_dir, backend=backend), chosen[:1], params)
    assert alone.outputs == alone_off.outputs
    assert alone.forwards + alone.accepted == alone_off.forwards and alone.forwards < alone_off.forwards
    proposer = noisy.core.runner.spec.proposer
    noisy.core.step()  # the runner hears of the last finished requests with the next step, empty or not
    assert not proposer.requests and proposer.kv.num_free_blocks == proposer.runner.num_blocks - 1


def test_a_draft_model_keeps_seeded_output_and_frees_its_cache_on_aborts(tiny_model_dir, noisy_draft_dir):
    params = [SamplingParams(temperature=t, seed=s, max_tokens=24, ignore_eos=True)
              for t, s in ((0.1, 1), (0.8, 2), (0.05, 3), (0.3, 4))]
    chosen = prompts()[:4]
    off = Run(config(tiny_model_dir, spec=False), chosen, params)
    on = Run(draft_config(tiny_model_dir, noisy_draft_dir), chosen, params)
    assert on.outputs == off.outputs and on.accepted > 0
    core = EngineCore(draft_config(tiny_model_dir, noisy_draft_dir, num_blocks=64, max_model_len=96))
    proposer = core.runner.spec.proposer
    rng = random.Random(1)
    for cut in range(20):
        ids = [f"c{cut}-{j}" for j in range(rng.randint(1, 3))]
        for request_id in ids:
            core.add_request(EngineCoreRequest(request_id, rng.choice(chosen), params[0]))
        for _ in range(rng.randint(1, 6)):
            core.step()
        core.abort_requests(ids)
        core.step()  # the runner hears of the aborts with the next step
        assert not proposer.requests and proposer.kv.num_free_blocks == proposer.runner.num_blocks - 1
        assert core.scheduler.kv_cache_manager.num_free_blocks == core.info.num_blocks - 1


@CPP
def test_verification_rows_through_the_one_op_decode_layers(tiny_model_dir, monkeypatch):
    """On a CPU the decoder layers run as one C++ op for small steps of any rows (kernels/cpu/decode_layers.py):
    a verification's 1 + k rows go through it as a prompt chunk's do, and answer as the plain decodes do (the
    same engine, speculative off per request)."""
    from engine_core.spec_decode import NgramProposer
    from engine_core.spec_decode.speculator import Speculator
    from tests.engine_core.test_cpu_decode_layers import make_engine

    engine = make_engine(tiny_model_dir, monkeypatch, costs={"int8_gemv": 1.0})  # its config speculates not
    core = engine.engine_core
    core.runner.spec = Speculator(NgramProposer(), K, max_batch=64)
    core.scheduler.spec_max_batch = 64
    model = core.model.model
    layers_op, rows_seen = model.decode_layers, []
    assert layers_op is not None

    def counting(h, *args):
        rows_seen.append(h.shape[0])
        return layers_op(h, *args)

    model.decode_layers = counting
    model.decode_layers.max_rows = layers_op.max_rows
    chosen = [prompts()[i] for i in (0, 6)]
    answers = {}
    for speculative in (False, True):
        rows_seen.clear()
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, speculative=speculative)
        answers[speculative] = [o.completions[0].token_ids for o in engine.generate(chosen, params)]
    assert answers[True] == answers[False]
    # after the prompts' step, the op ran steps of more rows than requests: verifications
    assert len(rows_seen) < 24 and any(rows > len(chosen) for rows in rows_seen[1:]), rows_seen
