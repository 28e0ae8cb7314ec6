"""Chat with a model through the in-process engine, streaming the answer to the terminal.

    python scripts/chat_offline.py                       # ask the embedded SmolLM2 one question
    python scripts/chat_offline.py --prompt "Tell me a joke" --temperature 0.7
    python scripts/chat_offline.py --interactive         # keep chatting; history is kept
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenizers.decoders import DecodeStream  # noqa: E402

from engine_core.config import EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from engine_core.loader.registry import default_model_path  # noqa: E402
from engine_core.offline.llm_engine import LLMEngine  # noqa: E402
from engine_core.protocol import OutputKind, SamplingParams  # noqa: E402
from services.frontend.chat.template import render_chat  # noqa: E402
from services.frontend.tokenizer import load_tokenizer  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: the embedded SmolLM2)")
    parser.add_argument("--prompt", default="What is the capital of France?", help="the first user message")
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer (default 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed for reproducible answers")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--interactive", action="store_true", help="keep asking for messages after the first")
    return parser.parse_args()


def stream_answer(engine: LLMEngine, tokenizer, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """Run one request, printing text as tokens arrive; returns the generated ids."""
    engine.add_request("chat", prompt_ids, params)
    decoder = DecodeStream(skip_special_tokens=True)
    token_ids: list[int] = []
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            for token_id in output.completions[0].token_ids:
                token_ids.append(token_id)
                text = decoder.step(tokenizer.tokenizer, token_id)
                if text:
                    print(text, end="", flush=True)
    elapsed = time.perf_counter() - started
    print(f"\n[{len(token_ids)} tokens in {elapsed:.2f} s, {len(token_ids) / elapsed:.1f} tok/s]")
    return token_ids


def main() -> None:
    args = parse_args()
    model_path = args.model or str(default_model_path())
    print(f"loading {model_path} ...", flush=True)
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, max_model_len=2048),
        scheduler=SchedulerConfig(max_num_seqs=8),
    ))
    tokenizer = load_tokenizer(model_path)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            output_kind=OutputKind.DELTA)
    messages = [{"role": "user", "content": args.prompt}]
    print(f"\nuser> {args.prompt}")
    while True:
        print("assistant> ", end="", flush=True)
        prompt = render_chat(tokenizer.chat_template, messages, bos_token=tokenizer.bos_token,
                             eos_token=tokenizer.eos_token)
        answer_ids = stream_answer(engine, tokenizer, tokenizer.encode(prompt, add_special_tokens=False), params)
        messages.append({"role": "assistant", "content": tokenizer.decode(answer_ids)})
        if not args.interactive:
            return
        try:
            messages.append({"role": "user", "content": input("\nuser> ")})
        except EOFError:
            return


if __name__ == "__main__":
    main()
