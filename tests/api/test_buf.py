"""buf over protos/: lint is clean (STANDARD + COMMENTS, protos/buf.yaml) and `buf breaking` against the
committed baseline passes now but fails, with buf's own message, on a copy whose wire format was broken."""

from __future__ import annotations

import shutil

import pytest

from tests.api.conftest import BASELINE, PROTOS, run

PRIORITY = "  int32 priority = 5;\n  // Add the tokenizer's special tokens"  # GenerateRequest.priority
PRIORITY_COMMENT = "  // Scheduling priority under the engine's priority policy: lower runs first (default 0).\n"
CHAT = "rpc Chat(ChatRequest) returns (stream ChatResponse);"
BREAKS = {  # id: (text in generation.proto, its replacement, what buf must say)
    "renumbered": (PRIORITY, PRIORITY.replace("= 5", "= 7"),
                   'Previously present field "5" with name "priority" on message "GenerateRequest" was deleted.'),
    "removed": (PRIORITY_COMMENT + PRIORITY, "  // Add the tokenizer's special tokens",
                'Previously present field "5" with name "priority" on message "GenerateRequest" was deleted.'),
    "retyped": (PRIORITY, PRIORITY.replace("int32", "string"),
                'Field "5" with name "priority" on message "GenerateRequest" changed type from "int32" to "string".'),
    "response-type": (CHAT, CHAT.replace("ChatResponse", "GenerateResponse"),
                      'RPC "Chat" on service "GenerationService" changed response type from '
                      '"tandem.v1.ChatResponse" to "tandem.v1.GenerateResponse".'),
}


def test_lint_is_clean(buf):
    result = run(buf, "lint", PROTOS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_the_protos_match_the_baseline(buf):
    result = run(buf, "breaking", PROTOS, "--against", BASELINE)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("old, new, message", BREAKS.values(), ids=BREAKS.keys())
def test_a_wire_break_fails_with_bufs_message(buf, tmp_path, old, new, message):
    broken = tmp_path / "protos"
    shutil.copytree(PROTOS, broken)
    proto = broken / "tandem" / "v1" / "generation.proto"
    text = proto.read_text()
    assert text.count(old) == 1, f"{old!r} is no longer in generation.proto once: update this test"
    proto.write_text(text.replace(old, new))
    result = run(buf, "breaking", broken, "--against", BASELINE)
    assert result.returncode != 0, "buf breaking accepted a wire-breaking change"
    assert message in result.stdout, result.stdout + result.stderr
