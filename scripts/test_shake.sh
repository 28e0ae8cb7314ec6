#!/usr/bin/env bash
# make test-shake: the tests that start servers, cancel, pause, kill and route (stack, server states,
# services, clients, frontend, routing, gateway, observability, faults) run SHAKE_ROUNDS times each
# (pytest-repeat), in random order within each module (pytest-random-order), while another process keeps
# every core busy (stress-ng where installed, else one Python spinner per core). A test that races the clock
# fails here rather than at random in CI. Not part of `make test`: see docs/testing.md for when to run it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ROUNDS=${SHAKE_ROUNDS:-3}
TESTS=(tests/test_stack.py tests/test_lora_stack.py tests/server_states tests/services tests/clients
       tests/frontend tests/gateway tests/observability tests/deploy/test_k8s_health.py tests/faults)

if command -v stress-ng >/dev/null 2>&1; then
  stress-ng --cpu 0 --timeout 3h --quiet &
else
  for _ in $(seq "$(nproc)"); do "$PY" -c 'while True: pass' & done
fi
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
SEED=${SHAKE_SEED:-$RANDOM}
echo "test-shake: $ROUNDS rounds, random order (SHAKE_SEED=$SEED replays it), $(nproc) cores kept busy"
# --tb=line: a long traceback's source is not parsed (CPython 3.11's parser can fail there under this load);
# --timeout: a test that hangs fails with its stack instead of stopping the run
"$PY" -m pytest -q -p no:cacheprovider --random-order-bucket=module --random-order-seed="$SEED" --count="$ROUNDS" \
  --timeout=600 --tb=line -rfE -m "not slow and not install and not compose" "${TESTS[@]}" "$@"
