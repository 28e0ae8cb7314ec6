"""The PEP 517 build backend: setuptools, with the `tandem.v1` gRPC code generated from protos/ first.

pyproject.toml names this module (`backend-path = ["scripts"]`), so `pip install .` in a fresh
clone builds without `make`: every hook runs scripts/gen_protos.py
(grpc_tools.protoc from the build requirement grpcio-tools, which needs no torch) into
build/generated/, which `package-dir` maps to the `tandem` package. Everything else is
setuptools' own backend, unchanged (the pattern of setuptools' "in-tree build backend" docs).
"""

from __future__ import annotations

import functools

import gen_protos
from setuptools import build_meta as _setuptools


def _after_generating(hook):
    @functools.wraps(hook)
    def wrapped(*args, **kwargs):
        if gen_protos.main() != 0:
            raise RuntimeError("generating the tandem.v1 gRPC code from protos/ failed (see protoc's message above)")
        return hook(*args, **kwargs)

    return wrapped


# every hook: even get_requires_* runs setuptools' egg_info, which checks the package folders exist
get_requires_for_build_wheel = _after_generating(_setuptools.get_requires_for_build_wheel)
get_requires_for_build_editable = _after_generating(_setuptools.get_requires_for_build_editable)
get_requires_for_build_sdist = _after_generating(_setuptools.get_requires_for_build_sdist)
prepare_metadata_for_build_wheel = _after_generating(_setuptools.prepare_metadata_for_build_wheel)
prepare_metadata_for_build_editable = _after_generating(_setuptools.prepare_metadata_for_build_editable)
build_wheel = _after_generating(_setuptools.build_wheel)
build_editable = _after_generating(_setuptools.build_editable)
build_sdist = _after_generating(_setuptools.build_sdist)
