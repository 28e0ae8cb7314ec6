"""`make ts-stubs`, the documented command, generates TypeScript from protos/ with protoc-gen-es
(buf.gen.yaml), compiles it with tsc together with clients/node/typed_request.ts, and runs the result."""

from __future__ import annotations

import json
import shutil

from tests.api.conftest import REPO, run


def test_generated_typescript_compiles_and_round_trips_a_request(buf):
    if shutil.which("make") is None:
        raise AssertionError("make is not installed: it runs every documented command here")
    result = run("make", "--no-print-directory", "-s", "ts-stubs", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    stubs = sorted(p.name for p in (REPO / "clients" / "node" / "build" / "gen" / "tandem" / "v1").glob("*_pb.ts"))
    assert stubs == ["admin_pb.ts", "common_pb.ts", "engine_core_pb.ts", "generation_pb.ts"]
    request, pause = (json.loads(line) for line in result.stdout.splitlines()[-2:])
    assert request == {"requestId": "ts-1", "text": "The capital of France is", "samplingParams": {
        "temperature": 0, "maxTokens": 16, "stop": ["."], "outputKind": "OUTPUT_KIND_DELTA"}}
    assert pause == {"mode": "PAUSE_MODE_WAIT"}
