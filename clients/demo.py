"""`make run`: start the two-service stack on the embedded SmolLM2, stream one chat answer
through the public gRPC API to the terminal, then shut the stack down.

    python -m clients.demo
    python -m clients.demo --prompt "Write a haiku about gRPC" --max-tokens 64
"""

from __future__ import annotations

import argparse
import sys
import time

from clients.client import TandemClient
from clients.errors import TandemError
from clients.local_stack import LocalStack, free_port


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default="What is the capital of France?", help="the user message")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens in the answer")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    print("starting tandem-engine and tandem-frontend on the embedded SmolLM2 ...", flush=True)
    quiet = ["--log-level", "WARNING"]
    stack = LocalStack(frontend_port=free_port(), engine_port=free_port(),
                       engine_args=["--max-model-len", "2048", *quiet], frontend_args=quiet)
    with stack:
        print(f"frontend at {stack.frontend_address}, engine core at {stack.engine_address}\n", flush=True)
        with TandemClient(stack.frontend_address, timeout=300) as client:
            print(f"user> {args.prompt}\nassistant> ", end="", flush=True)
            started, first_token, usage = time.perf_counter(), None, None
            try:
                for chunk in client.chat([{"role": "user", "content": args.prompt}],
                                         temperature=args.temperature, max_tokens=args.max_tokens):
                    if chunk.text and first_token is None:
                        first_token = time.perf_counter() - started
                    print(chunk.text, end="", flush=True)
                    usage = chunk.usage or usage
            except TandemError as e:
                print(f"\nerror: {e}", file=sys.stderr)
                return 1
            elapsed = time.perf_counter() - started
            tokens = usage.completion_tokens if usage else 0
            print(f"\n\n[{tokens} tokens in {elapsed:.2f} s, first token after {first_token or 0:.2f} s, "
                  f"{tokens / elapsed:.1f} tok/s]")
    print("stack stopped.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
