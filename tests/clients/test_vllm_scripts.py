"""Scripts written the way vLLM's docs write them (LLM(...).generate; an LLMEngine add_request/step loop with string
prompts) run with only their import line changed, and give the text the gRPC API gives for the same prompts (issue
48, point 2): on the live stack's tiny random Llama here, on the embedded SmolLM2 in the slow test."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from clients.client import TandemClient
from engine_core.loader import default_model_path
from tests.clients.conftest import REPO
from tests.test_stack import MAX_MODEL_LEN

PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is"]

# vLLM's examples/offline_inference/basic.py, import line changed; MODEL_OPTIONS is filled in below
LLM_SCRIPT = """
import json
from engine_core import LLM, SamplingParams

prompts = {prompts!r}
sampling_params = SamplingParams(temperature=0, max_tokens=16, stop={stop!r})
llm = LLM({model_options})
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    print(json.dumps([output.prompt, output.outputs[0].text]))
"""

# vLLM's examples/offline_inference/llm_engine_example.py, import line changed
LLM_ENGINE_SCRIPT = """
import json
from engine_core import EngineArgs, LLMEngine, RequestOutput, SamplingParams

def create_test_prompts():
    return [(prompt, SamplingParams(temperature=0, max_tokens=16, stop={stop!r})) for prompt in {prompts!r}]

def process_requests(engine, test_prompts):
    request_id = 0
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
        request_outputs: list[RequestOutput] = engine.step()
        for request_output in request_outputs:
            if request_output.finished:
                print(json.dumps([request_output.prompt, request_output.outputs[0].text]))

engine = LLMEngine.from_engine_args(EngineArgs({model_options}))
process_requests(engine, create_test_prompts())
"""


def run_script(template: str, model_options: str, stop: list[str], prompts: list[str] = PROMPTS) -> dict[str, str]:
    """prompt -> text, from the script run as a user runs it."""
    script = template.format(prompts=prompts, stop=stop, model_options=model_options)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(json.loads(line) for line in result.stdout.splitlines())


def grpc_texts(address: str, stop: list[str], prompts: list[str] = PROMPTS) -> dict[str, str]:
    with TandemClient(address, timeout=120) as client:
        stops = {"stop": stop} if stop else {}
        return {prompt: "".join(chunk.text for chunk in client.generate(prompt, temperature=0, max_tokens=16, **stops))
                for prompt in prompts}


@pytest.fixture(scope="module")
def tiny_options(live_stack) -> str:
    """The live stack's model and the engine flags that decide its tokens (tests/test_stack.py's ENGINE_FLAGS)."""
    return (f"model={str(live_stack.model_dir)!r}, tokenizer={str(default_model_path())!r}, dtype='float32', "
            f"max_model_len={MAX_MODEL_LEN}, max_num_seqs=64, max_num_batched_tokens=512")


def test_vllm_style_scripts_give_the_grpc_apis_text(live_stack, tiny_options):
    whole = grpc_texts(live_stack.frontend_address, [])
    text = whole[PROMPTS[0]]
    stop = [".", text[len(text) // 2:len(text) // 2 + 2]]  # "." (vLLM's example) and one the random model writes
    expected = grpc_texts(live_stack.frontend_address, stop)
    assert expected[PROMPTS[0]] == text[:text.index(stop[1])]  # the stop string cut the gRPC text
    assert run_script(LLM_SCRIPT, tiny_options, stop) == expected
    assert run_script(LLM_ENGINE_SCRIPT, tiny_options, stop) == expected


@pytest.mark.slow  # loads the embedded SmolLM2 in the script and in a stack of its own (make test-slow)
def test_vllm_style_scripts_give_the_grpc_apis_text_on_smollm2(tmp_path):
    from tests.test_stack import Services

    deterministic = ["--dtype", "float32", "--no-prefix-caching", "--max-model-len", "512"]
    services = Services([*deterministic, "--log-level", "WARNING"], ["--log-level", "WARNING"])
    try:
        expected = grpc_texts(services.frontend_address, ["."])
    finally:
        services.stop()
    options = "dtype='float32', enable_prefix_caching=False, max_model_len=512"
    assert expected[PROMPTS[2]].strip().startswith("Paris"), expected
    assert run_script(LLM_SCRIPT, options, ["."]) == expected
    assert run_script(LLM_ENGINE_SCRIPT, options, ["."]) == expected
