"""The engine's outputs as OpenAI response bodies: whole responses, stream chunks, usage and logprobs."""
from __future__ import annotations

import time
from typing import Callable

from jaxpage.outputs import CompletionOutput, RequestOutput
from serving import openai_protocol as oai

Decode = Callable[[int], str]  # one token's text


def usage(prompt_tokens: int, completion_tokens: int) -> oai.Usage:
    return oai.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def final_usage(out: RequestOutput) -> oai.Usage:
    return usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def completion_logprobs(c: CompletionOutput, k: int, offset: int, decode: Decode) -> oai.CompletionLogprobs:
    """The legacy completions logprobs of c's tokens; text offsets count from ``offset``."""
    lp = oai.CompletionLogprobs()
    for token, entry in zip(c.token_ids, c.logprobs or []):
        text = decode(token)
        lp.tokens.append(text)
        lp.token_logprobs.append(entry[token])
        lp.text_offset.append(offset)
        lp.top_logprobs.append({decode(t): v for t, v in _top(entry, k)})
        offset += len(text)
    return lp


def chat_logprobs(c: CompletionOutput, k: int, decode: Decode) -> oai.ChatLogprobs:
    def item(token: int, logprob: float) -> dict:
        text = decode(token)
        return dict(token=text, logprob=logprob, bytes=list(text.encode()))

    return oai.ChatLogprobs(content=[
        oai.TokenLogprob(**item(token, entry[token]), top_logprobs=[oai.TopLogprob(**item(t, v))
                                                                     for t, v in _top(entry, k)])
        for token, entry in zip(c.token_ids, c.logprobs or [])])


class Rendering:
    """What one request's responses carry (its id, model name, logprobs, token ids); a subclass per endpoint
    renders the final output (``final``), a stream chunk of (choice, finish reason) pairs and the usage chunk."""

    def __init__(self, request_id: str, model: str, decode: Decode, logprobs: int | None, token_ids: bool):
        self.request_id, self.model, self.decode = request_id, model, decode
        self.logprobs, self.token_ids = logprobs, token_ids
        self.offsets: dict[int, int] = {}  # per choice: the length of the text sent so far
        self.created = int(time.time())  # one time for every chunk, as OpenAI's

    def _head(self) -> dict:
        return dict(id=self.request_id, created=self.created, model=self.model)

    def _ids(self, c: CompletionOutput) -> list[int] | None:
        return list(c.token_ids) if self.token_ids else None

    def _prompt_ids(self, out: RequestOutput) -> list[int] | None:
        return list(out.prompt_token_ids) if self.token_ids else None


class CompletionRendering(Rendering):
    def __init__(self, *args, echo: str | None = None):
        super().__init__(*args)
        self.echo = echo  # the prompt's text, sent before the first token's

    def choice(self, c: CompletionOutput, finish_reason: str | None) -> oai.CompletionChoice:
        first = c.index not in self.offsets
        text = (self.echo if first and self.echo else "") + c.text
        offset = self.offsets.get(c.index, len(self.echo or ""))
        logprobs = None if self.logprobs is None else completion_logprobs(c, self.logprobs, offset, self.decode)
        self.offsets[c.index] = self.offsets.get(c.index, 0) + len(text)
        return oai.CompletionChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=finish_reason,
                                    stop_reason=c.stop_reason if finish_reason else None, token_ids=self._ids(c))

    def final(self, out: RequestOutput) -> oai.CompletionResponse:
        return oai.CompletionResponse(**self._head(),
                                      choices=[self.choice(c, c.finish_reason) for c in out.outputs],
                                      usage=final_usage(out), prompt_token_ids=self._prompt_ids(out))

    def chunk(self, choices: list[tuple[CompletionOutput, str | None]]) -> oai.CompletionResponse:
        return oai.CompletionResponse(**self._head(),
                                      choices=[self.choice(c, reason) for c, reason in choices])

    def usage_chunk(self, used: oai.Usage) -> oai.CompletionResponse:
        return oai.CompletionResponse(**self._head(), choices=[], usage=used)


class ChatRendering(Rendering):
    def _chat_logprobs(self, c: CompletionOutput) -> oai.ChatLogprobs | None:
        return None if self.logprobs is None else chat_logprobs(c, self.logprobs, self.decode)

    def final(self, out: RequestOutput) -> oai.ChatCompletionResponse:
        choices = [oai.ChatChoice(index=c.index, message=oai.AssistantMessage(content=c.text),
                                  logprobs=self._chat_logprobs(c), finish_reason=c.finish_reason,
                                  stop_reason=c.stop_reason, token_ids=self._ids(c)) for c in out.outputs]
        return oai.ChatCompletionResponse(**self._head(), choices=choices,
                                          usage=final_usage(out), prompt_token_ids=self._prompt_ids(out))

    def chunk(self, choices: list[tuple[CompletionOutput, str | None]]) -> oai.ChatCompletionChunk:
        items = []
        for c, reason in choices:
            first = c.index not in self.offsets
            self.offsets[c.index] = self.offsets.get(c.index, 0) + len(c.text)
            items.append(oai.ChatChunkChoice(
                index=c.index, delta=oai.Delta(role="assistant" if first else None, content=c.text),
                logprobs=self._chat_logprobs(c), finish_reason=reason, stop_reason=c.stop_reason if reason else None,
                token_ids=self._ids(c)))
        return oai.ChatCompletionChunk(**self._head(), choices=items)

    def usage_chunk(self, used: oai.Usage) -> oai.ChatCompletionChunk:
        return oai.ChatCompletionChunk(**self._head(), choices=[], usage=used)
