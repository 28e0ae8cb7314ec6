"""Sliding windows and logit soft-capping, per layer, through every attention backend.

Each backend (the torch reference, the C++ CPU kernel, Triton on the GPU or in its CPU
interpreter) against the float64 dense answer, on ragged batches whose contexts are longer
than the window: decodes, prefill chunks after cached context, and whole prompts."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import select_backend
from kernels.cpu import extension as cpu_extension
from tests.kernels.paged_batch import DEVICE, dense_attention, make_batch, ragged_batches

BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("cpp", id="cpp", marks=pytest.mark.skipif(
        DEVICE.type != "cpu" or cpu_extension.compiler() is None, reason="the C++ kernel runs on the CPU")),
    pytest.param("triton", id="triton", marks=pytest.mark.skipif(
        DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="needs a GPU or the interpreter")),
]


def _check(backend: str, shape, window, softcap, dtype=torch.float32, seed=0, num_splits=None):
    query_lens, seq_lens = shape
    batch = make_batch(query_lens, seq_lens, 4, 2, 16, 4, dtype, seed, device=DEVICE)
    attention = select_backend(DEVICE.type, backend)
    extra = {"num_splits": num_splits} if num_splits else {}
    out = attention.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.metadata, 0.25,
        sliding_window=window, logit_softcap=softcap, **extra,
    )
    expected = dense_attention(batch, 0.25, window, softcap)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window, softcap", [(5, None), (None, 2.0), (7, 1.5), (1, None)])
def test_window_and_softcap_on_a_mixed_batch(backend, window, softcap):
    # two decodes with long contexts, a chunk after cached context, a whole prompt
    _check(backend, ([1, 1, 9, 23], [40, 3, 30, 23]), window, softcap)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_larger_than_every_context_changes_nothing(backend):
    shape = ([1, 6], [12, 6])
    _check(backend, shape, 100, None)
    _check(backend, shape, None, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16(backend):
    _check(backend, ([1, 1, 17], [70, 33, 40]), 9, 3.0, torch.bfloat16)


@settings(max_examples=15, deadline=None)
@given(shape=ragged_batches(max_context=90), window=st.integers(1, 40), cap=st.sampled_from([None, 0.5, 5.0]),
       seed=st.integers(0, 2**16))
def test_random_batches_all_backends(shape, window, cap, seed):
    for backend in ("torch", "cpp", "triton"):
        if backend == "cpp" and (DEVICE.type != "cpu" or cpu_extension.compiler() is None):
            continue
        if backend == "triton" and DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            continue
        _check(backend, shape, window, cap, seed=seed)


@pytest.mark.skipif(DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton")
def test_triton_split_context_with_window():
    _check("triton", ([1, 1], [300, 120]), 70, 4.0, num_splits=4)


@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_long_decodes_split_across_threads_with_window(backend):
    # long enough that the C++ kernel splits each decode's context over threads
    torch.set_num_threads(max(2, torch.get_num_threads()))
    _check(backend, ([1, 1], [9000, 5000]), 700, 2.0)
