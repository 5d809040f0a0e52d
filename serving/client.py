"""`jaxpage client`: one call to a running `jaxpage serve`, text to stdout.

    jaxpage client [--target 127.0.0.1:50051] [--stream] [--max-tokens N] [--temperature T] [--chat] PROMPT
"""
from __future__ import annotations

import argparse
import sys

import grpc

from serving import generation_pb2 as pb
from serving import generation_pb2_grpc as pb_grpc


def build_request(ns: argparse.Namespace) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature)
    if ns.seed is not None:
        sampling.seed = ns.seed
    request = pb.GenerateRequest(sampling=sampling)
    if ns.chat:
        request.messages.append(pb.ChatMessage(role="user", content=ns.prompt))
    else:
        request.prompt = ns.prompt
    return request


def run(ns: argparse.Namespace) -> int:
    request = build_request(ns)
    out = sys.stdout
    try:
        with grpc.insecure_channel(ns.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            if ns.info:
                print(stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=ns.timeout), end="")
                return 0
            if ns.stream:
                final = None
                for response in stub.GenerateStream(request, timeout=ns.timeout):
                    for c in response.completions:
                        out.write(c.text)
                    out.flush()
                    final = response
            else:
                final = stub.Generate(request, timeout=ns.timeout)
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
