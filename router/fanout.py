"""Requests of several choices (`n`, `best_of`, a list of prompts): each choice runs as its
own generation through the Frontend, concurrently; the answers are merged into one OpenAI
response (whole) or one SSE stream whose chunks carry their choice's index.

`best_of` > `n` runs best_of generations per prompt and keeps the n with the highest total
log-probability (logprobs are computed for the ranking even when the client did not ask)."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable

from pdserve.common.errors import EXPECTED_ERRORS, InvalidRequestError, to_service_error
from pdserve.proto.pdserve.v1 import generation_pb2
from pdserve.router.openai_format import Collected, ResponseFormatter, sse, sum_usage
from pdserve.router.openai_request import MAX_CHOICES, Choice, OpenAIRequest

Generate = Callable[[generation_pb2.GenerateRequest], AsyncIterator[generation_pb2.GenerateResponse]]
MakeFormatter = Callable[[int], ResponseFormatter]  # choice index -> its formatter


def plan_choices(parsed: OpenAIRequest, request_id: str) -> list[Choice]:
    choices = parsed.choices()
    for i, choice in enumerate(choices):
        choice.request.request_id = f"{request_id}-{i}"
        if parsed.best_of > parsed.n:
            choice.request.sampling.logprobs = True  # the ranking needs them
    return choices


async def _collect(responses: AsyncIterator[generation_pb2.GenerateResponse]) -> Collected:
    collected = Collected()
    async with contextlib.aclosing(responses):
        async for response in responses:
            collected.add(response)
    return collected


def _best(parsed: OpenAIRequest, collected: list[Collected]) -> list[Collected]:
    """Per prompt, the n of its best_of generations with the highest total logprob."""
    if parsed.best_of == parsed.n:
        return collected
    kept = []
    for start in range(0, len(collected), parsed.best_of):
        group = collected[start:start + parsed.best_of]
        group.sort(key=lambda c: sum(lp.logprob for lp in c.logprobs), reverse=True)
        kept += group[:parsed.n]
    return kept


async def whole(parsed: OpenAIRequest, choices: list[Choice], generate: Generate,
                formatter: ResponseFormatter) -> dict:
    """Every choice to its end; ServiceError from the first that fails (the others are closed)."""
    tasks = [asyncio.ensure_future(_collect(generate(c.request))) for c in choices]
    try:
        collected = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return formatter.whole_many(_best(parsed, list(collected)), parsed.n)


async def _pump(index: int, responses, queue: asyncio.Queue) -> None:
    try:
        async with contextlib.aclosing(responses):
            async for response in responses:
                await queue.put((index, response))
        await queue.put((index, None))
    except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
        await queue.put((index, exc))


async def merged(choices: list[Choice], generate: Generate) -> AsyncIterator[tuple[int, generation_pb2.GenerateResponse]]:
    """(choice index, message) of every choice's stream as they come; raises the first error."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=4 * len(choices))
    tasks = [asyncio.ensure_future(_pump(i, generate(c.request), queue)) for i, c in enumerate(choices)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def sse_events(parsed: OpenAIRequest, num_choices: int, first: tuple[int, generation_pb2.GenerateResponse],
                     stream: AsyncIterator[tuple[int, generation_pb2.GenerateResponse]],
                     make_formatter: MakeFormatter) -> AsyncIterator[bytes]:
    """The SSE body of a streamed multi-choice request (best_of == n here), from the first
    message of `merged` on (the caller awaited it, so errors before it get a real status)."""
    formatters = [make_formatter(i) for i in range(num_choices)]
    lasts: list = [None] * num_choices
    try:
        item = first
        while item is not None:
            index, response = item
            if response.finish_reason:
                lasts[index] = response
            yield sse(formatters[index].chunk(response, parsed.include_usage))
            item = await anext(stream, None)
        if parsed.include_usage and None not in lasts:
            yield sse(formatters[0].usage_chunk(sum_usage(lasts, parsed.n)))
    except EXPECTED_ERRORS as err:
        yield sse(to_service_error(err).openai_body())
    finally:
        await stream.aclose()
    yield sse("[DONE]")


# -- gRPC: GenerateRequest.n / best_of ----------------------------------------------------------

def grpc_choices(request: generation_pb2.GenerateRequest) -> tuple[int, list[Choice]]:
    """(n, the best_of generations to run) of a gRPC request, validated like HTTP's."""
    n = request.n or 1
    best_of = request.best_of or n
    if best_of < n:
        raise InvalidRequestError("best_of must be at least n", param="best_of")
    if best_of > MAX_CHOICES:
        raise InvalidRequestError(f"at most {MAX_CHOICES} generations per request",
                                  param="best_of" if request.best_of else "n")
    parsed = OpenAIRequest(request, True, False, request.model, n, best_of)
    choices = parsed.choices()
    for k, choice in enumerate(choices):
        choice.request.ClearField("n")
        choice.request.ClearField("best_of")
        if request.request_id:
            choice.request.request_id = f"{request.request_id}-{k}"
        if best_of > n:
            choice.request.sampling.logprobs = True  # the ranking needs them
    return n, choices


async def grpc_stream(request: generation_pb2.GenerateRequest,
                      generate: Generate) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """The messages of a gRPC request of several choices, each tagged with its index: as they
    come (best_of == n), or the kept n, each whole, once every generation has finished."""
    n, choices = grpc_choices(request)
    if len(choices) == n:
        async for index, response in merged(choices, generate):
            response.index = index
            yield response
        return
    runs: list[list[generation_pb2.GenerateResponse]] = [[] for _ in choices]
    async for index, response in merged(choices, generate):
        runs[index].append(response)
    runs.sort(key=lambda messages: sum(lp.logprob for m in messages for lp in m.logprobs), reverse=True)
    for index, messages in enumerate(runs[:n]):
        for response in messages:
            response.index = index
            if not request.sampling.logprobs:
                del response.logprobs[:]
            yield response
