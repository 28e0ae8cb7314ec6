"""Write a copy of a GGUF file with its metadata (tokenizer, chat template) and no tensors.

The GPU machine takes at most 64 MiB from this one, and SmolLM2's GGUF is 94 MB; the CUDA tests that
tokenize with SmolLM2 (structured output over a tiny random model) need only its vocabulary. The copy is
the file's first bytes up to the end of its key-value section, with the tensor count set to 0.

    python scripts/vocab_only_gguf.py SOURCE.gguf OUT.gguf
"""

from __future__ import annotations

import argparse
import struct
from pathlib import Path

from gguf import GGUFReader


def vocab_only(source: Path, target: Path) -> int:
    reader = GGUFReader(source)
    end = max(field.offset + sum(part.nbytes for part in field.parts) for field in reader.fields.values())
    head = bytearray(source.read_bytes()[:end])
    head[8:16] = struct.pack("<Q", 0)  # magic (4), version (4), then the tensor count
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(bytes(head))
    return len(head)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    args = parser.parse_args()
    print(f"{args.target}: {vocab_only(args.source, args.target):,} bytes")


if __name__ == "__main__":
    main()
