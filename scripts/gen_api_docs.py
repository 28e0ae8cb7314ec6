"""Write docs/api.md, the API reference, from the comments in protos/ (never edited by hand).

    python scripts/gen_api_docs.py           # rewrite docs/api.md (make api-docs)
    python scripts/gen_api_docs.py --check   # exit 1 when docs/api.md is not current (tests/api runs it)

protoc (grpcio-tools) compiles the protos into a FileDescriptorSet with source info; each
service, RPC, message, field, enum and enum value is rendered with its leading comment. An
element without one is an error, so the reference is always complete.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTOS = ROOT / "protos"
DOC = ROOT / "docs" / "api.md"
FILE_ORDER = ("generation.proto", "admin.proto", "common.proto", "engine_core.proto")  # public first
# Go stubs, run from the repository's root (the README gives the same command; tests/api/test_go_stubs.py runs it).
GO_STUBS = ("mkdir -p build/gen/go && protoc -I protos --go_out=build/gen/go --go_opt=paths=source_relative "
            "--go-grpc_out=build/gen/go --go-grpc_opt=paths=source_relative protos/tandem/v1/*.proto")

# Field numbers of the descriptor paths that SourceCodeInfo locations use.
MESSAGES, ENUMS, SERVICES = 4, 5, 6  # in FileDescriptorProto
FIELDS, NESTED, NESTED_ENUMS, ONEOFS = 2, 3, 4, 8  # in DescriptorProto
VALUES, METHODS = 2, 2  # in EnumDescriptorProto, ServiceDescriptorProto
F = descriptor_pb2.FieldDescriptorProto
SCALARS = {value: name[len("TYPE_"):].lower() for name, value in F.Type.items()}


class Undocumented(Exception):
    """Elements without a leading comment."""


def compile_protos(protos: Path = PROTOS) -> descriptor_pb2.FileDescriptorSet:
    """The FileDescriptorSet of every .proto under `protos`, with comments (source info)."""
    sources = sorted(str(p.relative_to(protos)) for p in protos.rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "api.binpb"
        status = protoc.main(["grpc_tools.protoc", f"-I{protos}", f"-I{include}", "--include_source_info",
                              f"--descriptor_set_out={out}", *sources])
        if status != 0:
            raise SystemExit(f"protoc failed on {sources}")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


class FileDoc:
    """One .proto file's descriptors and comments, rendered as Markdown."""

    def __init__(self, file: descriptor_pb2.FileDescriptorProto, missing: list[str]) -> None:
        self.file = file
        self.missing = missing
        self.comments = {tuple(loc.path): loc.leading_comments for loc in file.source_code_info.location}
        self.prefix = f".{file.package}."
        self.maps = {}
        pending = [(f"{self.prefix}{m.name}", m) for m in file.message_type]
        while pending:  # map<K, V> fields point at a nested XEntry message
            name, message = pending.pop()
            for nested in message.nested_type:
                if nested.options.map_entry:
                    self.maps[f"{name}.{nested.name}"] = nested
                pending.append((f"{name}.{nested.name}", nested))

    def comment(self, path: tuple[int, ...], name: str) -> str:
        text = " ".join(line.strip() for line in self.comments.get(path, "").strip().splitlines())
        if not text:
            self.missing.append(f"{self.file.name}: {name}")
        return text.replace("|", "\\|")

    def type_name(self, field: descriptor_pb2.FieldDescriptorProto) -> str:
        if field.type_name in self.maps:
            key, value = self.maps[field.type_name].field
            return f"map&lt;{self.type_name(key)}, {self.type_name(value)}&gt;"
        if field.type in (F.TYPE_MESSAGE, F.TYPE_ENUM):
            return link(field.type_name.removeprefix(self.prefix))
        return f"`{SCALARS[field.type]}`"

    def render(self) -> list[str]:
        lines = [f"## {self.file.name}", ""]
        for i, service in enumerate(self.file.service):
            lines += self.service(service, (SERVICES, i))
        for i, message in enumerate(self.file.message_type):
            lines += self.message(message, (MESSAGES, i))
        for i, enum in enumerate(self.file.enum_type):
            lines += self.enum(enum, (ENUMS, i))
        return lines

    def service(self, service, path) -> list[str]:
        full = f"{self.file.package}.{service.name}"
        lines = [f"### {service.name}", "", f"`{full}`: {self.comment(path, full)}", "",
                 "| RPC | request | response | description |", "|---|---|---|---|"]
        for i, method in enumerate(service.method):
            stream_in = "stream " if method.client_streaming else ""
            stream_out = "stream " if method.server_streaming else ""
            request, response = (link(t.removeprefix(self.prefix)) for t in (method.input_type, method.output_type))
            lines.append(f"| `{method.name}` | {stream_in}{request} | {stream_out}{response} | "
                         f"{self.comment((*path, METHODS, i), f'{full}.{method.name}')} |")
        return [*lines, ""]

    def message(self, message, path, outer: str = "") -> list[str]:
        name = f"{outer}{message.name}"
        full = f"{self.file.package}.{name}"
        lines = [f"### {name}", "", self.comment(path, full), ""]
        nested = [line for i, inner in enumerate(message.nested_type) if not inner.options.map_entry
                  for line in self.message(inner, (*path, NESTED, i), f"{name}.")]
        nested += [line for i, inner in enumerate(message.enum_type)
                   for line in self.enum(inner, (*path, NESTED_ENUMS, i), f"{name}.")]
        if not message.field:
            return [*lines, "No fields.", "", *nested]
        lines += ["| field | number | type | description |", "|---|---|---|---|"]
        for i, field in enumerate(message.field):
            kind = self.type_name(field)
            if field.label == F.LABEL_REPEATED and not kind.startswith("map&lt;"):
                kind = f"repeated {kind}"
            elif field.proto3_optional:
                kind = f"optional {kind}"
            description = self.comment((*path, FIELDS, i), f"{full}.{field.name}")
            if field.HasField("oneof_index") and not field.proto3_optional:
                oneof = message.oneof_decl[field.oneof_index].name
                oneof_doc = self.comment((*path, ONEOFS, field.oneof_index), f"{full}.{oneof}")
                description = f"One of `{oneof}` ({oneof_doc.rstrip('.')}). {description}"
            lines.append(f"| `{field.name}` | {field.number} | {kind} | {description} |")
        return [*lines, "", *nested]

    def enum(self, enum, path, outer: str = "") -> list[str]:
        name = f"{outer}{enum.name}"
        full = f"{self.file.package}.{name}"
        lines = [f"### {name}", "", self.comment(path, full), "",
                 "| value | number | description |", "|---|---|---|"]
        for i, value in enumerate(enum.value):
            lines.append(f"| `{value.name}` | {value.number} | "
                         f"{self.comment((*path, VALUES, i), f'{full}.{value.name}')} |")
        return [*lines, ""]


def link(name: str) -> str:
    """A Markdown link to the heading of type `name` (relative to the package, e.g. `Outer.Inner`)."""
    return f"[{name}](#{name.lower().replace('.', '')})"


def render(files: descriptor_pb2.FileDescriptorSet) -> str:
    """The whole reference; raises Undocumented listing every element without a comment."""
    ordered = sorted(files.file, key=lambda f: (FILE_ORDER.index(Path(f.name).name)
                                                if Path(f.name).name in FILE_ORDER else len(FILE_ORDER), f.name))
    missing: list[str] = []
    lines = ["# Tandem API reference (tandem.v1)", "",
             "<!-- Generated by scripts/gen_api_docs.py from the comments in protos/; edit those, then run "
             "`make api-docs`. -->", "",
             "The public API is `GenerationService` and `AdminService`, served by the frontend; "
             "`EngineCoreService` is the internal link between a frontend and an engine core. "
             "Every RPC has its own request and response message. "
             "Stubs for other languages: the protos set `go_package`, `java_package` and `csharp_namespace`, so "
             f"from the repository's root `{GO_STUBS}` makes Go stubs in `build/gen/go` (protoc with "
             "protoc-gen-go and protoc-gen-go-grpc on the PATH), and `make ts-stubs` "
             "generates TypeScript (protoc-gen-es, `buf.gen.yaml`) and compiles it with `tsc`.", ""]
    for file in ordered:
        lines += FileDoc(file, missing).render()
    if missing:
        raise Undocumented("these elements have no leading comment in protos/:\n  " + "\n  ".join(missing))
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that docs/api.md is current")
    args = parser.parse_args(argv)
    try:
        text = render(compile_protos())
    except Undocumented as e:
        print(e, file=sys.stderr)
        return 1
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} is not current with protos/: run `make api-docs` and commit it",
                  file=sys.stderr)
            return 1
        print(f"{DOC.relative_to(ROOT)} is current")
        return 0
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
