"""A minimal gRPC client of the router: stream one chat completion.

    python examples/grpc_client.py --router 127.0.0.1:50050 "Tell me a joke"

or, from Python (with examples/ on the path):

    from grpc_client import stream_chat
    for text in stream_chat("127.0.0.1:50050", "Tell me a joke", max_tokens=32):
        print(text, end="", flush=True)
"""
from __future__ import annotations

import argparse
import sys
from typing import Iterator

import grpc

from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc


def stream_chat(address: str, prompt: str, *, model: str = "", max_tokens: int = 64, temperature: float = 0.0,
                api_key: str | None = None, timeout_s: float = 300.0,
                responses: list | None = None) -> Iterator[str]:
    """Yield the reply's text as it streams. `responses`, if given, receives every raw
    GenerateResponse (token ids, routing, transfer verdict, usage)."""
    request = generation_pb2.GenerateRequest(
        model=model,
        chat=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content=prompt)]),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature))
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for response in stub.Generate(request, metadata=metadata, timeout=timeout_s):
            if responses is not None:
                responses.append(response)
            if response.text:
                yield response.text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--router", default="127.0.0.1:50050", help="router gRPC address")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--api-key")
    args = parser.parse_args(argv)
    responses: list = []
    try:
        for text in stream_chat(args.router, args.prompt, max_tokens=args.max_tokens, api_key=args.api_key,
                                responses=responses):
            print(text, end="", flush=True)
    except grpc.RpcError as err:
        print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    last = responses[-1] if responses else None
    if last is not None:
        verdict = common_pb2.TransferOutcome.Name(last.transfer.outcome)
        print(f"\n[{last.usage.completion_tokens} tokens, kv: {verdict} {last.transfer.backend}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
