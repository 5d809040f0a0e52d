"""ServerArgs, the options of `jaxpage serve` beside the engine's (EngineArgs), and their flags (vLLM's
cli_args): one flag per field, made from the field as EngineArgs makes its own."""
from __future__ import annotations

import dataclasses

from jaxpage.engine.arg_utils import CliArgs
from serving.chat_options import read_chat_template
from serving.reasoning import REASONING_PARSERS
from serving.serving_models import LoRAModulePath, parse_lora_module
from serving.tool_parsers import TOOL_PARSERS


def _flag(default, help_text: str | None = None, **flag):
    """A field with its flag's help and, where its type alone does not say, argparse keywords."""
    return dataclasses.field(default=default, metadata={"help": help_text, **flag})


@dataclasses.dataclass
class ServerArgs(CliArgs):
    """The server's own options: its ports, limits, TLS and token, the chat API's template and parsers. A bad value
    raises ValueError naming the flag."""

    host: str = _flag("127.0.0.1", "address to listen on (0.0.0.0 for all)")
    port: int = _flag(50051)
    http_port: int = _flag(8000, "the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...; "
                                 "0: off)")
    served_model_name: list[str] | None = _flag(
        None, "the model's name(s) in the HTTP API (default: the model's own name)", type=str, nargs="+")
    metrics_port: int = _flag(9090, "Prometheus /metrics over HTTP (0: off)")
    metrics_host: str | None = _flag(None, "address of the metrics endpoint (default: --host)")
    max_queue: int | None = _flag(
        None, "requests in flight (waiting + running) beyond which calls get RESOURCE_EXHAUSTED")
    grace_seconds: float = _flag(30.0, "on SIGTERM/SIGINT, how long calls in flight may take to finish")
    max_engine_restarts: int = _flag(
        3, "fresh engines made when the engine loop dies (device error); then the process exits 1")
    max_message_bytes: int = _flag(4 << 20, "largest request accepted (a gRPC message; an HTTP body, else 413)")
    max_prompt_bytes: int = _flag(1 << 20, "largest prompt (UTF-8 bytes, chat messages summed), refused before "
                                           "tokenizing")
    tls_cert: str | None = _flag(None, "PEM certificate chain: serve gRPC, the HTTP API and metrics over TLS")
    tls_key: str | None = _flag(None, "PEM private key of --tls-cert")
    tls_client_ca: str | None = _flag(
        None, "PEM CA certificates: clients must present a certificate signed by one (mutual TLS)")
    api_key: str | None = _flag(
        None, "bearer token required on every call (gRPC metadata or HTTP header 'authorization: Bearer KEY') and "
              "on /metrics; default $JAXPAGE_API_KEY; health checks stay open")
    reflection: bool = _flag(True, "gRPC server reflection (--no-reflection turns it off)")
    chat_template: str | None = _flag(
        None, "the chat API's Jinja chat template: a file, or the template itself (default: the model's)")
    enable_auto_tool_choice: bool = _flag(
        False, "tool_choice 'auto' in the chat API: the model may call the request's tools, read out of its text "
               "by --tool-call-parser")
    tool_call_parser: str | None = _flag(None, "the format of the model's tool calls", choices=sorted(TOOL_PARSERS))
    reasoning_parser: str | None = _flag(
        None, "reasoning_content apart from content in the chat API (the model's <think> blocks)",
        choices=sorted(REASONING_PARSERS))
    lora_modules: list[LoRAModulePath] | None = _flag(
        None, "LoRA adapters served by name (with --enable-lora): name=path, or JSON {\"name\": ..., \"path\": "
              "..., \"base_model_name\": ...}; a request's model names one", type=parse_lora_module, nargs="+")
    allow_runtime_lora_updating: bool = _flag(
        False, "POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, which "
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING turns on); behind --api-key when one is set")

    def __post_init__(self):
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError(f"--max-queue={self.max_queue} must be >= 1")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        for flag in ("max_message_bytes", "max_prompt_bytes", "max_engine_restarts"):
            if getattr(self, flag) < (0 if flag == "max_engine_restarts" else 1):
                raise ValueError(f"--{flag.replace('_', '-')}={getattr(self, flag)} is out of range")
        self._check_chat()

    def _check_chat(self):
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        for flag, names in (("tool_call_parser", TOOL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
            if getattr(self, flag) not in (None, *names):
                raise ValueError(f"--{flag.replace('_', '-')}={getattr(self, flag)} is not one of {sorted(names)}")
        read_chat_template(self.chat_template)

    @property
    def tls_files(self) -> tuple[str | None, str | None, str | None]:
        """--tls-cert, --tls-key, --tls-client-ca (each None when not given)."""
        return self.tls_cert, self.tls_key, self.tls_client_ca
