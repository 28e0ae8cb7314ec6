"""smg (the Shepherd Model Gateway, a real `smg launch`) in front of a real Tandem stack, all on loopback ports
the OS picks: a tiny random Llama with SmolLM2's tokenizer, so the frontend renders with SmolLM2's shipped
tools template (hermes-style calls) and smg gets that template from GetTokenizer. Always stopped."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from clients.gateway import Gateway, post_json
from clients.local_stack import free_port, wait_until_serving
from engine_core.loader import default_model_path
from tests.engine_core.tiny_models import write_tiny_model
from tests.test_stack import VOCAB, Services
from tests.waits import STARTUP_TIMEOUT_S

MAX_MODEL_LEN = 2048
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "16",
                "--num-blocks", "600", "--max-num-seqs", "64", "--max-num-batched-tokens", "512"]


class GatewayStack(Services):
    """Engine + frontend subprocesses (tests/test_stack.py) and smg in front; the frontend can be killed and
    started again on its port."""

    def __init__(self, model_dir: Path, tokenizer_dir: Path | str, log_dir: Path) -> None:
        self.frontend_args = ["--tokenizer", str(tokenizer_dir), "--log-level", "WARNING"]
        super().__init__(["--model", str(model_dir), *ENGINE_FLAGS, "--log-level", "WARNING",
                          "--tokenizer", str(tokenizer_dir)], self.frontend_args)
        self.gateway = Gateway([self.frontend_address], port=free_port(), log_file=log_dir / "smg.log",
                               extra_args=["--tool-call-parser", "qwen", "--log-level", "warn"])
        try:
            self.gateway.start()
        except BaseException:
            super().stop()
            raise
        self.model = self.gateway.wait_for_model()

    def url(self, path: str) -> str:
        return self.gateway.url + path

    def kill_frontend(self) -> None:
        self.frontend.send_signal(signal.SIGKILL)
        self.frontend.wait()

    def start_frontend(self) -> None:
        self.frontend = self._spawn("services.frontend", "--engine", self.engine_address, "--port",
                                    str(self.frontend_port), "--host", "127.0.0.1", *self.frontend_args)
        wait_until_serving(self.frontend_address, STARTUP_TIMEOUT_S, self.frontend)

    def stop(self) -> None:
        self.gateway.stop()
        super().stop()


@pytest.fixture(scope="session")
def gateway_stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway")
    model_dir = write_tiny_model(root / "model", vocab_size=VOCAB, max_position_embeddings=MAX_MODEL_LEN)
    stack = GatewayStack(model_dir, default_model_path(), root)
    try:
        yield stack
    finally:
        stack.stop()


def chat(stack: GatewayStack, content: str, **options) -> dict:
    return post_json(stack.url("/v1/chat/completions"),
                     {"model": stack.model, "messages": [{"role": "user", "content": content}], **options})

