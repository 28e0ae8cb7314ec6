"""Hypothesis strategies for every public and admin RPC: valid, invalid, huge, empty, hostile.

Each strategy draws a `Call(method, request)`; the fuzz tests run them against the real
servers and check only the outcome's status code, never a hard-coded answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st
from tandem.v1 import admin_pb2, common_pb2, generation_pb2

from tests.faults.probes import VOCAB

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
FLOATS = st.floats(width=32, allow_nan=True, allow_infinity=True)
TOKEN_IDS = st.one_of(st.integers(0, VOCAB - 1), st.integers(-2, VOCAB + 2), INT32)
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=64)  # any unicode but lone surrogates
HUGE_TEXT = st.builds(lambda piece, count: piece * count, st.sampled_from(["a", "猫", " ", "\n", "🙂", "<|im_end|>"]),
                      st.integers(500, 200_000))
OVERSIZED_TEXT = st.just("x" * (5 << 20))  # over gRPC's default 4 MiB message limit
REQUEST_IDS = st.one_of(st.just(""), st.sampled_from(["dup-1", "dup-2"]), TEXT)


@dataclass(frozen=True)
class Call:
    service: str  # "GenerationService" | "AdminService"
    method: str
    request: object

    def __repr__(self) -> str:  # hypothesis prints failing examples: keep huge fields short
        text = repr(self.request)
        return f"{self.method}({text[:300]}{'...' if len(text) > 300 else ''})"


def maybe(strategy):
    return st.one_of(st.none(), strategy)


def _set(message, **fields):
    for name, value in fields.items():
        if value is not None:
            setattr(message, name, value)
    return message


@st.composite
def sampling_params(draw) -> common_pb2.SamplingParams:
    params = _set(
        common_pb2.SamplingParams(),
        n=draw(maybe(st.one_of(st.integers(-1, 3), INT32))),
        temperature=draw(maybe(st.one_of(st.floats(0, 2, width=32), FLOATS))),
        top_p=draw(maybe(st.one_of(st.floats(0, 1, width=32), FLOATS))),
        top_k=draw(maybe(st.one_of(st.integers(-2, 50), INT32))),
        min_p=draw(maybe(FLOATS)),
        seed=draw(maybe(INT64)),
        max_tokens=draw(maybe(st.one_of(st.integers(-1, 12), INT32))),
        min_tokens=draw(maybe(st.one_of(st.integers(-1, 12), INT32))),
        ignore_eos=draw(maybe(st.booleans())),
        presence_penalty=draw(maybe(FLOATS)),
        frequency_penalty=draw(maybe(FLOATS)),
        repetition_penalty=draw(maybe(st.one_of(st.floats(0, 2, width=32), FLOATS))),
        logprobs=draw(maybe(st.integers(-2, 25))),
        prompt_logprobs=draw(maybe(st.integers(-2, 25))),
        include_stop_str_in_output=draw(maybe(st.booleans())),
        skip_special_tokens=draw(maybe(st.booleans())),
        output_kind=draw(st.integers(-1, 5)),
    )
    params.stop_token_ids.extend(draw(st.lists(TOKEN_IDS, max_size=4)))
    params.stop.extend(draw(st.one_of(st.lists(TEXT, max_size=4), st.lists(TEXT, min_size=17, max_size=40))))
    params.logit_bias.update(draw(st.dictionaries(TOKEN_IDS, FLOATS, max_size=4)))
    return params


def _with_params(draw, message):
    if draw(st.booleans()):
        message.sampling_params.CopyFrom(draw(sampling_params()))
    return message


@st.composite
def generate(draw) -> Call:
    request = generation_pb2.GenerateRequest(request_id=draw(REQUEST_IDS), priority=draw(INT32))
    prompt = draw(st.sampled_from(["text", "huge", "oversized", "token_ids", "huge_ids", "none"]))
    if prompt in ("text", "huge", "oversized"):
        request.text = draw({"text": TEXT, "huge": HUGE_TEXT, "oversized": OVERSIZED_TEXT}[prompt])
    elif prompt == "token_ids":
        request.token_ids.ids.extend(draw(st.lists(TOKEN_IDS, max_size=300)))
    elif prompt == "huge_ids":
        request.token_ids.ids.extend([draw(st.integers(0, VOCAB - 1))] * draw(st.integers(257, 50_000)))
    _set(request, add_special_tokens=draw(maybe(st.booleans())))
    return Call("GenerationService", "Generate", _with_params(draw, request))


ROLES = st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), TEXT)


@st.composite
def chat_request(draw) -> generation_pb2.ChatRequest:
    request = generation_pb2.ChatRequest(request_id=draw(REQUEST_IDS), priority=draw(INT32))
    for _ in range(draw(st.integers(0, 4))):
        request.messages.add(role=draw(ROLES), content=draw(st.one_of(TEXT, HUGE_TEXT)))
    _set(request, add_generation_prompt=draw(maybe(st.booleans())),
         continue_final_message=draw(maybe(st.booleans())))
    return _with_params(draw, request)


@st.composite
def tokenize(draw) -> Call:
    request = generation_pb2.TokenizeRequest()
    kind = draw(st.sampled_from(["text", "chat", "none"]))
    if kind == "text":
        request.text = draw(st.one_of(TEXT, HUGE_TEXT))
    elif kind == "chat":
        request.chat.CopyFrom(draw(chat_request()))
    _set(request, add_special_tokens=draw(maybe(st.booleans())))
    return Call("GenerationService", "Tokenize", request)


@st.composite
def detokenize(draw) -> Call:
    request = generation_pb2.DetokenizeRequest()
    request.token_ids.extend(draw(st.lists(TOKEN_IDS, max_size=300)))
    _set(request, skip_special_tokens=draw(maybe(st.booleans())))
    return Call("GenerationService", "Detokenize", request)


PUBLIC_CALLS = st.one_of(
    generate(),
    chat_request().map(lambda r: Call("GenerationService", "Chat", r)),
    tokenize(),
    detokenize(),
    st.lists(REQUEST_IDS, max_size=5).map(
        lambda ids: Call("GenerationService", "Abort", generation_pb2.AbortRequest(request_ids=ids))),
    st.just(Call("GenerationService", "GetModelInfo", generation_pb2.GetModelInfoRequest())),
    st.just(Call("GenerationService", "GetServerInfo", generation_pb2.GetServerInfoRequest())),
)


def admin_calls(profile_root: str):
    """Admin calls; profiles only ever go under `profile_root` (any name, however odd)."""
    plain = st.sampled_from(["Resume", "Sleep", "WakeUp", "ResetPrefixCache", "StopProfile"]).map(
        lambda method: Call("AdminService", method, getattr(admin_pb2, f"{method}Request")()))
    name = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="/."), max_size=300)
    profile_dir = st.one_of(st.just(""), name.map(lambda n: f"{profile_root}/{n}"))
    drain_timeout = st.one_of(st.floats(0, 1.0), st.sampled_from([float("nan"), float("-inf"), -1.0, -1e300]))
    return st.one_of(
        plain,
        st.one_of(st.integers(-1, 5), INT32).map(
            lambda mode: Call("AdminService", "Pause", admin_pb2.PauseRequest(mode=mode))),
        profile_dir.map(lambda d: Call("AdminService", "StartProfile", admin_pb2.StartProfileRequest(output_dir=d))),
        drain_timeout.map(lambda t: Call("AdminService", "Drain", admin_pb2.DrainRequest(timeout_s=t))),
    )
