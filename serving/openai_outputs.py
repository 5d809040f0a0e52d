"""The engine's outputs as OpenAI response bodies: whole responses, stream chunks, usage and logprobs."""
from __future__ import annotations

import time
from typing import Callable

from jaxpage.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from serving import openai_protocol as oai
from serving.chat_output import MessageParser, MessageStream, assistant_message

Decode = Callable[[int], str]  # one token's text


def usage(prompt_tokens: int, completion_tokens: int) -> oai.Usage:
    return oai.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def final_usage(out: RequestOutput) -> oai.Usage:
    return usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def token_logprobs(token_ids: list[int], entries: list[dict[int, float] | None], k: int, offset: int,
                   decode: Decode, into: oai.CompletionLogprobs | None = None) -> oai.CompletionLogprobs:
    """The legacy completions logprobs of these tokens (appended to ``into``, if given), each with its entry (None:
    a prompt's first token, which has no log-probability); text offsets count from ``offset``."""
    lp = into if into is not None else oai.CompletionLogprobs()
    for token, entry in zip(token_ids, entries):
        text = decode(token)
        lp.tokens.append(text)
        lp.token_logprobs.append(None if entry is None else entry[token])
        lp.text_offset.append(offset)
        lp.top_logprobs.append(None if entry is None else {decode(t): v for t, v in _top(entry, k)})
        offset += len(text)
    return lp


def vllm_prompt_logprobs(token_ids: list[int], entries: PromptLogprobs, k: int,
                         decode: Decode) -> list[dict[int, oai.Logprob] | None]:
    """vLLM's prompt_logprobs field: per prompt token None (the first) or token id -> Logprob, the prompt token
    first, then the top k ranked 1..k (the prompt token outside them: rank None, which jaxpage does not compute)."""
    out: list[dict[int, oai.Logprob] | None] = []
    for token, entry in zip(token_ids, entries):
        if entry is None:
            out.append(None)
            continue
        top = _top(entry, k)
        ranks = {t: rank for rank, (t, _) in enumerate(top, 1)}
        out.append({t: oai.Logprob(logprob=v, rank=ranks.get(t), decoded_token=decode(t))
                    for t, v in {token: entry[token], **dict(top)}.items()})
    return out


def chat_logprobs(c: CompletionOutput, k: int, decode: Decode) -> oai.ChatLogprobs:
    def item(token: int, logprob: float) -> dict:
        text = decode(token)
        return dict(token=text, logprob=logprob, bytes=list(text.encode()))

    return oai.ChatLogprobs(content=[
        oai.TokenLogprob(**item(token, entry[token]), top_logprobs=[oai.TopLogprob(**item(t, v))
                                                                     for t, v in _top(entry, k)])
        for token, entry in zip(c.token_ids, c.logprobs or [])])


class Rendering:
    """What one request's responses carry (its id, model name, logprobs, token ids, vLLM's prompt_logprobs); a
    subclass per endpoint renders the final output (``final``), a stream chunk of (choice, finish reason) pairs
    and the usage chunk."""

    def __init__(self, request_id: str, model: str, decode: Decode, logprobs: int | None, token_ids: bool,
                 prompt_logprobs: int | None = None):
        self.request_id, self.model, self.decode = request_id, model, decode
        self.logprobs, self.token_ids, self.prompt_logprobs = logprobs, token_ids, prompt_logprobs
        self.offsets: dict[int, int] = {}  # per choice: the length of the text sent so far
        self.created = int(time.time())  # one time for every chunk, as OpenAI's
        self.prompt: tuple[list[int], PromptLogprobs] | None = None  # the prompt's ids and logprobs (``note``)

    def note(self, out: RequestOutput) -> None:
        """Keeps the prompt's token ids and logprobs of an output that has them (the first, in delta mode)."""
        if out.prompt_logprobs is not None:
            self.prompt = (out.prompt_token_ids, out.prompt_logprobs)

    def _head(self) -> dict:
        return dict(id=self.request_id, created=self.created, model=self.model)

    def _ids(self, c: CompletionOutput) -> list[int] | None:
        return list(c.token_ids) if self.token_ids else None

    def _prompt_ids(self, out: RequestOutput) -> list[int] | None:
        return list(out.prompt_token_ids) if self.token_ids else None

    def _vllm_prompt_logprobs(self) -> list[dict[int, oai.Logprob] | None] | None:
        if self.prompt_logprobs is None or self.prompt is None:
            return None
        return vllm_prompt_logprobs(*self.prompt, self.prompt_logprobs, self.decode)


class CompletionRendering(Rendering):
    def __init__(self, *args, echo: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.echo = echo  # the prompt's text, sent before the first token's (with logprobs: the prompt's too)

    def choice(self, c: CompletionOutput, finish_reason: str | None) -> oai.CompletionChoice:
        first = c.index not in self.offsets
        text = (self.echo if first and self.echo else "") + c.text
        offset = self.offsets.get(c.index, len(self.echo or ""))
        logprobs = None
        if self.logprobs is not None:
            logprobs = oai.CompletionLogprobs()
            if first and self.echo is not None and self.prompt is not None:  # the prompt's tokens come first
                token_logprobs(*self.prompt, self.logprobs, 0, self.decode, into=logprobs)
            token_logprobs(c.token_ids, c.logprobs or [], self.logprobs, offset, self.decode, into=logprobs)
        self.offsets[c.index] = self.offsets.get(c.index, 0) + len(text)
        return oai.CompletionChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=finish_reason,
                                    stop_reason=c.stop_reason if finish_reason else None, token_ids=self._ids(c),
                                    prompt_logprobs=self._vllm_prompt_logprobs() if first else None)

    def final(self, out: RequestOutput) -> oai.CompletionResponse:
        self.note(out)
        return oai.CompletionResponse(**self._head(),
                                      choices=[self.choice(c, c.finish_reason) for c in out.outputs],
                                      usage=final_usage(out), prompt_token_ids=self._prompt_ids(out))

    def chunk(self, choices: list[tuple[CompletionOutput, str | None]]) -> oai.CompletionResponse:
        return oai.CompletionResponse(**self._head(),
                                      choices=[self.choice(c, reason) for c, reason in choices])

    def usage_chunk(self, used: oai.Usage) -> oai.CompletionResponse:
        return oai.CompletionResponse(**self._head(), choices=[], usage=used)


class ChatRendering(Rendering):
    """parser: how a choice's text is read into reasoning, content and tool calls (serving/chat_output.py; None:
    all content); calls_finish: a choice that stopped after calling tools finishes with "tool_calls"."""

    def __init__(self, *args, parser: MessageParser | None = None, calls_finish: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.parser, self.calls_finish = parser, calls_finish
        self.streams: dict[int, MessageStream] = {}  # per choice, when streamed with a parser

    def _chat_logprobs(self, c: CompletionOutput) -> oai.ChatLogprobs | None:
        return None if self.logprobs is None else chat_logprobs(c, self.logprobs, self.decode)

    def _finish(self, reason: str | None, called: bool) -> str | None:
        return "tool_calls" if called and reason == "stop" and self.calls_finish else reason

    def _message(self, c: CompletionOutput) -> tuple[oai.AssistantMessage, str | None]:
        if self.parser is None:
            return oai.AssistantMessage(content=c.text), c.finish_reason
        m = self.parser.parse(c.text, final=True)
        return assistant_message(m), self._finish(c.finish_reason, bool(m.calls))

    def final(self, out: RequestOutput) -> oai.ChatCompletionResponse:
        self.note(out)
        choices = []
        for c in out.outputs:
            message, reason = self._message(c)
            choices.append(oai.ChatChoice(index=c.index, message=message, logprobs=self._chat_logprobs(c),
                                          finish_reason=reason, stop_reason=c.stop_reason, token_ids=self._ids(c)))
        return oai.ChatCompletionResponse(**self._head(), choices=choices, usage=final_usage(out),
                                          prompt_token_ids=self._prompt_ids(out),
                                          prompt_logprobs=self._vllm_prompt_logprobs())

    def _delta(self, c: CompletionOutput, reason: str | None) -> tuple[oai.Delta, str | None]:
        if self.parser is None:
            return oai.Delta(content=c.text), reason
        stream = self.streams.setdefault(c.index, MessageStream(self.parser))
        delta = stream.push(c.text, final=reason is not None)
        return delta, self._finish(reason, stream.called)

    def chunk(self, choices: list[tuple[CompletionOutput, str | None]]) -> oai.ChatCompletionChunk:
        items = []
        for c, reason in choices:
            first = c.index not in self.offsets
            self.offsets[c.index] = self.offsets.get(c.index, 0) + len(c.text)
            delta, finish = self._delta(c, reason)
            delta.role = "assistant" if first else None
            items.append(oai.ChatChunkChoice(
                index=c.index, delta=delta, logprobs=self._chat_logprobs(c), finish_reason=finish,
                stop_reason=c.stop_reason if reason else None, token_ids=self._ids(c)))
        return oai.ChatCompletionChunk(**self._head(), choices=items)

    def usage_chunk(self, used: oai.Usage) -> oai.ChatCompletionChunk:
        return oai.ChatCompletionChunk(**self._head(), choices=[], usage=used)
