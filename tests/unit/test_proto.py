"""The pdserve.v1 protocol: stubs regenerate byte for byte, every field is documented, and
the one error table maps typed errors onto gRPC / HTTP / OpenAI consistently."""
from __future__ import annotations

import re
from importlib.metadata import version

import grpc
import pytest

from pdserve.proto import build

FIELD_RE = re.compile(r"^\s+((optional|repeated)\s+)?(map<[\w, ]+>|[\w.]+)\s+\w+\s*=\s*\d+;")
ENUM_VALUE_RE = re.compile(r"^\s+[A-Z][A-Z0-9_]*\s*=\s*\d+;")
RPC_RE = re.compile(r"^\s+rpc\s+\w+")
DECL_RE = re.compile(r"^\s*(message|enum|service)\s+\w+")


def test_committed_stubs_equal_a_fresh_generation(tmp_path):
    if version("grpcio-tools") != build.GRPC_TOOLS_VERSION:
        pytest.fail(f"grpcio-tools {version('grpcio-tools')} is installed but the stubs were generated with "
                    f"{build.GRPC_TOOLS_VERSION}: pin grpcio-tools=={build.GRPC_TOOLS_VERSION} (pyproject test extra)")
    written = build.generate(tmp_path)
    committed_dir = build.PROTO_ROOT / build.PACKAGE_DIR
    names = sorted(p.name for p in written)
    committed = sorted(p.name for p in committed_dir.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))
    assert names == committed, "stale or missing stubs: run python -m pdserve.proto.build"
    for path in written:
        assert path.read_bytes() == (committed_dir / path.name).read_bytes(), \
            f"{path.name} differs from a fresh generation: run python -m pdserve.proto.build"


def test_generated_imports_use_the_package_path():
    from pdserve.proto.pdserve.v1 import decode_pb2, decode_pb2_grpc, generation_pb2_grpc, prefill_pb2_grpc, registry_pb2_grpc

    for path in (build.PROTO_ROOT / build.PACKAGE_DIR).glob("*_pb2*.py*"):
        text = path.read_text()
        assert "from pdserve.v1 import" not in text
        assert "import pdserve.v1" not in text
    request = decode_pb2.DecodeRequest(request_id="r", prompt_token_ids=[1, 2])
    assert decode_pb2.DecodeRequest.FromString(request.SerializeToString()) == request
    for module, service in ((generation_pb2_grpc, "Generation"), (decode_pb2_grpc, "Decode"),
                            (prefill_pb2_grpc, "Prefill"), (registry_pb2_grpc, "Registry")):
        assert hasattr(module, f"{service}Stub") and hasattr(module, f"add_{service}Servicer_to_server")


def test_every_declaration_field_and_rpc_has_a_comment():
    missing = []
    for proto in build.proto_sources():
        lines = (build.PROTO_ROOT / proto).read_text().splitlines()
        for i, line in enumerate(lines):
            if any(r.match(line) for r in (FIELD_RE, ENUM_VALUE_RE, RPC_RE, DECL_RE)):
                if not lines[i - 1].strip().startswith("//"):
                    missing.append(f"{proto}:{i + 1}: {line.strip()}")
    assert not missing, "undocumented:\n" + "\n".join(missing)


def test_rpc_names_are_the_documented_ones():
    from pdserve.proto.pdserve.v1 import decode_pb2, generation_pb2, kv_events_pb2, prefill_pb2, registry_pb2

    def rpcs(module, name):
        return sorted(m.name for m in module.DESCRIPTOR.services_by_name[name].methods)

    assert rpcs(generation_pb2, "Generation") == ["Abort", "Generate", "ModelInfo"]
    assert rpcs(decode_pb2, "Decode") == ["Abort", "Decode", "Load", "ModelInfo"]
    assert rpcs(prefill_pb2, "Prefill") == ["Abort", "Load", "ModelInfo", "Prefill"]
    assert rpcs(registry_pb2, "Registry") == ["Deregister", "Heartbeat", "Lookup", "PublishKVEvents", "Register"]
    assert rpcs(kv_events_pb2, "KVEvents") == ["Snapshot"]
    assert decode_pb2.DESCRIPTOR.package == "pdserve.v1"
