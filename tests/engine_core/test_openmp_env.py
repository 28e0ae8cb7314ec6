"""engine_core/openmp_env.py: GOMP_SPINCOUNT is set before torch loads, and never over the user's choice."""

import os
import subprocess
import sys

import pytest

from engine_core.openmp_env import DEFAULT_SPIN_COUNT, limit_openmp_spinning


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    return monkeypatch


def test_sets_the_spin_count_before_torch_loads(clean_env):
    clean_env.delitem(sys.modules, "torch")  # as in a fresh engine process (restored afterwards)
    assert limit_openmp_spinning() is True
    assert os.environ["GOMP_SPINCOUNT"] == str(DEFAULT_SPIN_COUNT)


@pytest.mark.parametrize("variable, value", [("GOMP_SPINCOUNT", "50000"), ("OMP_WAIT_POLICY", "ACTIVE")])
def test_the_users_choice_wins(clean_env, variable, value):
    clean_env.delitem(sys.modules, "torch")
    clean_env.setenv(variable, value)
    assert limit_openmp_spinning() is False
    assert os.environ[variable] == value
    assert variable == "GOMP_SPINCOUNT" or "GOMP_SPINCOUNT" not in os.environ


def test_too_late_once_torch_is_loaded(clean_env):
    import torch  # noqa: F401 - loaded: libgomp has read its environment already

    assert limit_openmp_spinning() is False
    assert "GOMP_SPINCOUNT" not in os.environ


def test_the_engine_entry_sets_it_before_torch(tmp_path):
    """tandem-engine's main() sets it before its first torch import: run main() with flags that fail
    after that point (a model path that does not exist) and look at the environment it left."""
    script = ("import os, sys\n"
              "from services.engine.__main__ import main\n"
              "assert 'torch' not in sys.modules\n"
              "try:\n    main(['--model', sys.argv[1], '--log-level', 'ERROR'])\nexcept BaseException:\n    pass\n"
              "print(os.environ.get('GOMP_SPINCOUNT'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "missing-model")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == str(DEFAULT_SPIN_COUNT), out.stderr[-2000:]
