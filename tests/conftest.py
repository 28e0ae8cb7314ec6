"""Test-wide setup: Triton runs in its CPU interpreter when there is no GPU (before anything imports triton),
and every test, with the servers it starts, uses a fresh cache folder instead of the user's ~/.cache/tandem
(scripts/fresh_cache.py): no plan timed outside this run decides a kernel in it.
"""

import os

from engine_core.openmp_env import limit_openmp_spinning
from scripts.fresh_cache import CACHE_ENV, share_compiled_kernels, use_fresh_cache

use_fresh_cache()

limit_openmp_spinning()  # before torch loads: the suite's engine subprocesses share the cores with it

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """An empty cache folder of the test's own (plans, dtype answers), sharing the run's compiled kernels."""
    monkeypatch.setenv(CACHE_ENV, str(share_compiled_kernels(tmp_path)))
    monkeypatch.delenv("TANDEM_REMEASURE", raising=False)
    return tmp_path


@pytest.fixture(scope="session")
def live_stack(tmp_path_factory):
    """A live two-process stack (tandem-engine + tandem-frontend on a tiny random Llama with SmolLM2's tokenizer)
    shared by the client, CLI, bench and Node tests and the docs' snippets; always stopped at the end."""
    from engine_core.loader import default_model_path
    from tests.engine_core.tiny_models import write_tiny_model
    from tests.test_stack import ENGINE_FLAGS, VOCAB, Services

    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny-clients"), vocab_size=VOCAB,
                                 max_position_embeddings=512)
    services = Services(["--model", str(model_dir), *ENGINE_FLAGS, "--log-level", "WARNING",
                         "--tokenizer", str(default_model_path())],  # the vocabulary for structured-output masks
                        ["--tokenizer", str(default_model_path()), "--log-level", "WARNING"])
    services.model_dir = model_dir  # for tests that compare with transformers on the same weights
    try:
        yield services
    finally:
        services.stop()
