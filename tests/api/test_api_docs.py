"""docs/api.md is generated from the proto comments (scripts/gen_api_docs.py) and must be current;
an element without a comment is an error, so the reference cannot silently miss one."""

from __future__ import annotations

import importlib.util
import shutil
import sys

import pytest

from tests.api.conftest import PROTOS, REPO, run

_SPEC = importlib.util.spec_from_file_location("gen_api_docs", REPO / "scripts" / "gen_api_docs.py")
gen_api_docs = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gen_api_docs)


def test_docs_api_md_is_current():
    result = run(sys.executable, REPO / "scripts" / "gen_api_docs.py", "--check")
    assert result.returncode == 0, result.stderr


def test_every_rpc_and_message_is_in_the_reference():
    text = (REPO / "docs" / "api.md").read_text()
    files = gen_api_docs.compile_protos()
    for file in files.file:
        for service in file.service:
            assert f"### {service.name}\n" in text
            for method in service.method:
                assert f"| `{method.name}` |" in text
        for item in (*file.message_type, *file.enum_type):
            assert f"### {item.name}\n" in text


def test_an_undocumented_field_is_an_error(tmp_path):
    protos = tmp_path / "protos"
    shutil.copytree(PROTOS, protos)
    proto = protos / "tandem" / "v1" / "admin.proto"
    comment = "  // How long to wait for requests in flight, in seconds: finite and >= 0 (0 answers at once).\n"
    assert comment in proto.read_text()
    proto.write_text(proto.read_text().replace(comment, ""))
    with pytest.raises(gen_api_docs.Undocumented, match=r"admin.proto: tandem.v1.DrainRequest.timeout_s"):
        gen_api_docs.render(gen_api_docs.compile_protos(protos))
