"""`jaxpage client`: one call to a running `jaxpage serve`, text to stdout.

    jaxpage client [--target 127.0.0.1:50051] [--stream] [--max-tokens N] [--temperature T] [--chat] PROMPT

With --tls-ca (and --tls-cert/--tls-key for mutual TLS) it speaks TLS; --api-key (or $JAXPAGE_API_KEY) sends
the bearer token.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc

from serving import generation_pb2 as pb
from serving import generation_pb2_grpc as pb_grpc


def build_request(ns: argparse.Namespace) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature)
    if ns.seed is not None:
        sampling.seed = ns.seed
    request = pb.GenerateRequest(sampling=sampling, lora_name=ns.lora_name)
    if ns.chat:
        request.messages.append(pb.ChatMessage(role="user", content=ns.prompt))
    else:
        request.prompt = ns.prompt
    return request


def channel_for(ns: argparse.Namespace) -> grpc.Channel:
    if not ns.tls_ca:
        return grpc.insecure_channel(ns.target)
    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    return grpc.secure_channel(ns.target, grpc.ssl_channel_credentials(read(ns.tls_ca), read(ns.tls_key),
                                                                       read(ns.tls_cert)))


def run(ns: argparse.Namespace) -> int:
    from serving.security import api_key

    request = build_request(ns)
    out = sys.stdout
    key = api_key(ns.api_key)
    metadata = [("authorization", f"Bearer {key}")] if key else None
    try:
        with channel_for(ns) as channel:
            stub = pb_grpc.GenerationStub(channel)
            if ns.info:
                print(stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=ns.timeout, metadata=metadata), end="")
                return 0
            if ns.stream:
                final = None
                for response in stub.GenerateStream(request, timeout=ns.timeout, metadata=metadata):
                    for c in response.completions:
                        out.write(c.text)
                    out.flush()
                    final = response
            else:
                final = stub.Generate(request, timeout=ns.timeout, metadata=metadata)
                out.write("".join(c.text for c in final.completions))
            out.write("\n")
            if ns.verbose and final is not None:
                reasons = ",".join(c.finish_reason for c in final.completions if c.finish_reason)
                print(f"[{final.request_id}] finish_reason={reasons} prompt_tokens={final.usage.prompt_tokens} "
                      f"completion_tokens={final.usage.completion_tokens}", file=sys.stderr)
    except grpc.RpcError as e:
        print(f"jaxpage: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return 0
