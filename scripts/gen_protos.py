"""Generate the Python gRPC code for protos/ into build/generated/ (the `tandem.v1` package).

    python scripts/gen_protos.py          # `make protos`; every pip install runs it (scripts/build_backend.py)

The output is never committed and never edited by hand: pyproject.toml maps the
`tandem` package to build/generated/tandem, so `from tandem.v1 import generation_pb2`
works wherever the project is installed.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTOS = ROOT / "protos"
OUT = ROOT / "build" / "generated"


def main() -> int:
    sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    include = str(Path(protoc.__file__).parent / "_proto")  # well-known types
    status = protoc.main([
        "grpc_tools.protoc", f"-I{PROTOS}", f"-I{include}",
        f"--python_out={OUT}", f"--pyi_out={OUT}", f"--grpc_python_out={OUT}", *sources,
    ])
    if status != 0:
        print(f"protoc failed on {sources}", file=sys.stderr)
        return status
    for folder in {OUT / Path(s).parent for s in sources} | {OUT / "tandem"}:
        (folder / "__init__.py").touch()
    print(f"generated {len(sources)} protos into {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
