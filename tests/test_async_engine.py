"""AsyncEngine: streams and generate equal the sync engine; cancel, bad input, failure, close."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest

from jhicache import AsyncEngine, RequestOutput, SamplingParams
from jhicache.async_engine import EngineClosedError, EngineDeadError
from tests.test_engine import make_engine

T = TypeVar("T")

PROMPTS = [[(5 * i + j) % 500 for j in range(8 + 5 * i)] for i in range(8)]
PARAMS = [SamplingParams(max_new_tokens=2 + i) for i in range(8)]
LONG = SamplingParams(max_new_tokens=300)  # never finishes within a test: it is cut short
TIMEOUT_S = 120.0


@functools.cache
def expected() -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(o.token_ids) for o in make_engine().generate(PROMPTS, PARAMS))


def run(make: Callable[[], Awaitable[T]]) -> T:
    """Runs a coroutine in a fresh event loop; no test can hang past TIMEOUT_S."""
    async def guarded() -> T:
        return await asyncio.wait_for(make(), TIMEOUT_S)

    return asyncio.run(guarded())


@pytest.fixture
def aengine() -> Iterator[AsyncEngine]:
    engine = AsyncEngine(make_engine())
    yield engine
    engine.close(timeout=TIMEOUT_S)
    assert not engine.thread.is_alive()


def record_aborts(aengine: AsyncEngine) -> list[tuple[str, bool]]:
    """Records each `engine.abort(id)` the loop thread makes, with what it returned."""
    calls: list[tuple[str, bool]] = []
    abort = aengine.engine.abort

    def recording(request_id: str) -> bool:
        result = abort(request_id)
        calls.append((request_id, result))
        return result

    aengine.engine.abort = recording  # type: ignore[method-assign]
    return calls


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)


async def wait_idle(aengine: AsyncEngine) -> None:
    """Until the engine holds no request; then its page accounting must hold."""
    await until(lambda: not aengine.engine.has_unfinished())
    aengine.engine.check_invariants()


async def collect(aengine: AsyncEngine, prompt: list[int], params: SamplingParams,
                  request_id: str | None = None) -> list[RequestOutput]:
    return [out async for out in aengine.stream(prompt, params, request_id)]


def assert_streamed(outs: list[RequestOutput], expected_tokens: tuple[int, ...]) -> None:
    """The outputs of one stream, deltas: new tokens concatenate to the expected ones (one
    output per step, or several merged for a consumer that lagged the steps: never more outputs
    than tokens), and none carries the tokens so far."""
    assert expected_tokens and 1 <= len(outs) <= len(expected_tokens)
    tokens: list[int] = []
    for out in outs:
        assert out.new_token_ids and out.token_ids == []
        tokens += out.new_token_ids
    assert tuple(tokens) == expected_tokens
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "length" and outs[-1].ttft_s > 0


async def first_tokens(stream, count: int, got: list[RequestOutput]) -> None:
    """Consumes `stream` until it has produced `count` outputs (appended to `got`)."""
    async for out in stream:
        got.append(out)
        if len(got) >= count:
            return


# ---- results equal the synchronous engine -------------------------------------------------

def test_concurrent_streams_equal_synchronous_generate(aengine: AsyncEngine) -> None:
    async def main() -> list[list[RequestOutput]]:
        outs = await asyncio.gather(*(collect(aengine, p, sp) for p, sp in zip(PROMPTS, PARAMS)))
        await wait_idle(aengine)
        return outs

    streams = run(main)
    for outs, tokens in zip(streams, expected()):
        assert_streamed(outs, tokens)
    assert aengine.engine.stats().finished_requests == len(PROMPTS)


def test_generate_equals_synchronous_generate_from_successive_event_loops(
        aengine: AsyncEngine) -> None:
    finals = run(lambda: aengine.generate(PROMPTS, PARAMS))
    assert [tuple(o.token_ids) for o in finals] == list(expected())
    assert all(o.new_token_ids == o.token_ids and o.finished and o.finish_reason == "length"
               for o in finals)
    assert [o.prompt_len for o in finals] == [len(p) for p in PROMPTS]
    one = SamplingParams(max_new_tokens=4)  # one SamplingParams for all, in a new event loop
    again = run(lambda: aengine.generate(PROMPTS[:3], one))
    assert [o.token_ids for o in again] == [o.token_ids for o in
                                            make_engine().generate(PROMPTS[:3], one)]
    assert run(lambda: aengine.generate([], one)) == []


def test_many_coroutines_submitting_at_once(aengine: AsyncEngine) -> None:
    async def main() -> tuple[list[list[RequestOutput]], list[list[RequestOutput]]]:
        gens = [aengine.generate([PROMPTS[i % 8]], PARAMS[i % 8]) for i in range(20)]
        streams = [collect(aengine, PROMPTS[i % 8], PARAMS[i % 8]) for i in range(12)]
        results = await asyncio.gather(*gens, *streams)
        await wait_idle(aengine)
        return results[:20], results[20:]

    gens, streams = run(main)
    assert [tuple(g[0].token_ids) for g in gens] == [expected()[i % 8] for i in range(20)]
    for i, outs in enumerate(streams):
        assert_streamed(outs, expected()[i % 8])
    assert aengine.engine.stats().finished_requests == 32


# ---- a consumer that leaves aborts its request --------------------------------------------

def test_a_lagging_consumer_gets_the_waiting_outputs_merged(aengine: AsyncEngine) -> None:
    """A consumer that blocks while the engine runs on takes the outputs queued meanwhile as
    one: every token once, in order."""
    async def consume() -> list[RequestOutput]:
        outs = []
        async for out in aengine.stream(PROMPTS[1], SamplingParams(max_new_tokens=12), "lag"):
            outs.append(out)
            if len(outs) == 1:
                while "lag" in aengine._sinks:  # blocks this loop: the outputs queue up
                    time.sleep(0.01)
        return outs

    outs = run(consume)
    [whole] = run(lambda: aengine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=12)))
    assert outs[-1].finished and len(whole.token_ids) == 12
    assert [t for o in outs for t in o.new_token_ids] == whole.token_ids
    assert len(outs) <= 3 and max(len(o.new_token_ids) for o in outs) >= 2


def test_leaving_a_stream_early_aborts_its_request(aengine: AsyncEngine) -> None:
    aborts = record_aborts(aengine)

    async def breaker() -> list[RequestOutput]:
        got = []
        async for out in aengine.stream(list(range(10, 30)), LONG, request_id="breaks"):
            got.append(out)
            if len(got) == 2:
                break  # the generator is closed once collected: that aborts the request
        return got

    async def cancelled(started: asyncio.Event, got: list[RequestOutput]) -> None:
        async for out in aengine.stream(list(range(30, 50)), LONG, request_id="cancelled"):
            got.append(out)
            if len(got) == 2:
                started.set()

    async def closed() -> list[RequestOutput]:
        got: list[RequestOutput] = []
        stream = aengine.stream(list(range(50, 70)), LONG, request_id="closed")
        await first_tokens(stream, 2, got)
        await stream.aclose()
        return got

    async def main() -> tuple[list[RequestOutput], ...]:
        other = asyncio.create_task(collect(aengine, PROMPTS[7], PARAMS[7]))
        started, got = asyncio.Event(), []
        task = asyncio.create_task(cancelled(started, got))
        broke, was_closed = await asyncio.gather(breaker(), closed())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: len(aborts) == 3)
        await wait_idle(aengine)
        return broke, got, was_closed, await other

    broke, got, was_closed, other = run(main)
    for outs in (broke, got, was_closed):
        assert len(outs) >= 2 and not outs[-1].finished and outs[-1].new_token_ids
    assert sorted(aborts) == [("breaks", True), ("cancelled", True), ("closed", True)]
    assert_streamed(other, expected()[7])
    after = run(lambda: aengine.generate(PROMPTS[:2], PARAMS[:2]))
    assert [tuple(o.token_ids) for o in after] == list(expected()[:2])


def test_submissions_cancelled_at_any_moment_leave_the_engine_serving(
        aengine: AsyncEngine) -> None:
    """Cancelled before the loop thread took the submission, while it adds it, or after."""
    async def main() -> list[RequestOutput]:
        for i in range(16):
            task = asyncio.create_task(collect(aengine, PROMPTS[i % 8], LONG))
            for _ in range(i % 4):
                await asyncio.sleep(0)
            await asyncio.sleep(0.002 * (i % 3))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await wait_idle(aengine)
        return await aengine.generate(PROMPTS, PARAMS)

    assert [tuple(o.token_ids) for o in run(main)] == list(expected())


def test_cancelling_generate_aborts_all_its_requests(aengine: AsyncEngine) -> None:
    aborts = record_aborts(aengine)

    async def main() -> None:
        task = asyncio.create_task(aengine.generate(PROMPTS[:3], LONG))
        await until(lambda: aengine.engine.stats().decode_steps >= 2)  # under way
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: len(aborts) == 3)
        await wait_idle(aengine)

    run(main)
    assert [result for _, result in aborts] == [True] * 3


def test_abort_by_id_ends_the_stream_with_an_abort_output(aengine: AsyncEngine) -> None:
    async def main() -> tuple[list[RequestOutput], bool, bool, bool]:
        got: list[RequestOutput] = []
        stream = aengine.stream(list(range(10, 30)), LONG, request_id="chat")
        await first_tokens(stream, 2, got)
        aborted = await aengine.abort("chat")
        got += [out async for out in stream]  # ends, with the abort output
        again, unknown = await aengine.abort("chat"), await aengine.abort("nope")
        await wait_idle(aengine)
        return got, aborted, again, unknown

    got, aborted, again, unknown = run(main)
    assert aborted and not again and not unknown
    assert got[-1].finished and got[-1].finish_reason == "abort"
    # every token once, in order (outputs that queued behind the abort's arrive merged in it)
    seen = [t for o in got for t in o.new_token_ids]
    [whole] = make_engine().generate([list(range(10, 30))],
                                     SamplingParams(max_new_tokens=len(seen)))
    assert len(seen) >= 2 and seen == whole.token_ids


# ---- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("prompt,params,message", [
    ([], SamplingParams(), "empty"),
    ([1, 512], SamplingParams(), "out of range"),
    ("abc", SamplingParams(), "string"),
    ([1] * 400, SamplingParams(), "device pool"),
    ([1, 2], {"max_new_tokens": 2}, "SamplingParams"),
])
def test_bad_input_raises_value_error_and_the_engine_serves_on(
        aengine: AsyncEngine, prompt: object, params: object, message: str) -> None:
    async def main() -> list[RequestOutput]:
        with pytest.raises(ValueError, match=message):
            await collect(aengine, prompt, params)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=message) as info:
            await aengine.generate([PROMPTS[0], prompt], params)  # type: ignore[list-item]
        if isinstance(params, SamplingParams):
            assert "prompt 1" in str(info.value)  # named as Engine.generate names it
        assert not aengine.engine.has_unfinished()  # the good prompt was not queued either
        return await aengine.generate(PROMPTS[:2], PARAMS[:2])

    assert [tuple(o.token_ids) for o in run(main)] == list(expected()[:2])


def test_generate_refuses_what_engine_generate_refuses(aengine: AsyncEngine) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="flat list of ints"):
            await aengine.generate([1, 2, 3])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
            await aengine.generate(PROMPTS[:3], PARAMS[:2])

    run(main)
    assert not aengine.engine.has_unfinished()


def test_a_duplicate_request_id_is_refused_and_does_not_abort_the_first(
        aengine: AsyncEngine) -> None:
    aborts = record_aborts(aengine)

    async def main() -> list[RequestOutput]:
        first = aengine.stream(PROMPTS[7], PARAMS[7], request_id="dup")
        got = [await anext(first)]  # under way
        with pytest.raises(ValueError, match="already queued"):
            await collect(aengine, PROMPTS[0], PARAMS[0], request_id="dup")
        return got + [out async for out in first]

    assert_streamed(run(main), expected()[7])
    assert aborts == []


# ---- failure and shutdown -----------------------------------------------------------------

def test_an_error_in_the_loop_reaches_every_waiting_caller(aengine: AsyncEngine) -> None:
    armed = threading.Event()
    step = aengine.engine.step

    def failing_step() -> list[RequestOutput]:
        if armed.is_set():
            armed.clear()
            raise ZeroDivisionError("boom")
        return step()

    aengine.engine.step = failing_step  # type: ignore[method-assign]

    async def main() -> list[BaseException]:
        gots: list[list[RequestOutput]] = [[] for _ in range(3)]
        streams = [aengine.stream(PROMPTS[i], LONG) for i in range(3)]
        waiting = [asyncio.create_task(first_tokens(s, 10**6, got))
                   for s, got in zip(streams, gots)]
        waiting.append(asyncio.create_task(aengine.generate(PROMPTS[3:5], LONG)))
        await until(lambda: all(gots))  # every stream is under way
        armed.set()
        errors = await asyncio.gather(*waiting, return_exceptions=True)
        with pytest.raises(EngineDeadError):
            await collect(aengine, PROMPTS[0], PARAMS[0])
        with pytest.raises(EngineDeadError):
            await aengine.generate(PROMPTS[:1], PARAMS[:1])
        assert await aengine.abort("anything") is False
        return errors

    errors = run(main)
    assert len(errors) == 4 and len({id(e) for e in errors}) == 4  # each caller its own error
    for error in errors:
        assert isinstance(error, EngineDeadError) and isinstance(error, RuntimeError)
        assert str(error) == "engine loop failed" and isinstance(error.__cause__, ZeroDivisionError)
    aengine.thread.join(TIMEOUT_S)
    assert not aengine.thread.is_alive() and not aengine.is_running
    assert not aengine.engine.has_unfinished()  # its requests were dropped
    aengine.close()
    aengine.close()


@pytest.mark.parametrize("how", ["aclose", "close", "async with"])
def test_close_with_requests_in_flight_fails_them_and_ends_the_thread(how: str) -> None:
    aengine = AsyncEngine(make_engine())

    async def main() -> list[BaseException]:
        gots: list[list[RequestOutput]] = [[] for _ in range(3)]
        async with contextlib.AsyncExitStack() as stack:
            if how == "async with":
                await stack.enter_async_context(aengine)
            streams = [aengine.stream(PROMPTS[i], LONG) for i in range(3)]
            waiting = [asyncio.create_task(first_tokens(s, 10**6, got))
                       for s, got in zip(streams, gots)]
            waiting.append(asyncio.create_task(aengine.generate(PROMPTS[3:5], LONG)))
            await until(lambda: all(gots))
            if how == "aclose":
                await aengine.aclose()
            elif how == "close":
                aengine.close(timeout=TIMEOUT_S)
        errors = await asyncio.gather(*waiting, return_exceptions=True)
        with pytest.raises(EngineClosedError, match="AsyncEngine closed"):
            await collect(aengine, PROMPTS[0], PARAMS[0])
        await aengine.aclose()  # idempotent
        return errors

    errors = run(main)
    assert len(errors) == 4
    assert all(isinstance(e, EngineClosedError) and isinstance(e, RuntimeError) for e in errors)
    aengine.thread.join(TIMEOUT_S)
    assert not aengine.thread.is_alive() and not aengine.is_running
    assert not aengine.engine.has_unfinished()
    aengine.engine.check_invariants()
    aengine.close()
    # The engine itself serves on after its AsyncEngine is gone.
    assert aengine.engine.generate(PROMPTS[:1], PARAMS[:1])[0].token_ids == list(expected()[0])


def test_close_of_an_idle_engine_is_prompt_and_idempotent() -> None:
    aengine = AsyncEngine(make_engine())
    assert aengine.thread.is_alive() and aengine.is_running
    aengine.close(timeout=TIMEOUT_S)
    assert not aengine.thread.is_alive()
    aengine.close()
    with pytest.raises(EngineClosedError):
        run(lambda: aengine.generate(PROMPTS[:1]))


def test_together_applies_the_submissions_made_inside_before_any_step(aengine) -> None:
    calls: list[str] = []
    add, step = aengine.engine.add_request, aengine.engine.step
    aengine.engine.add_request = lambda *a, **k: calls.append("add") or add(*a, **k)
    aengine.engine.step = lambda *a, **k: calls.append("step") or step(*a, **k)

    async def drain(prompt: list[int]) -> list[int]:
        return [t async for out in aengine.stream(prompt, SamplingParams(max_new_tokens=2))
                for t in out.new_token_ids]

    async def main() -> list[list[int]]:
        with aengine.together():
            tasks = [asyncio.create_task(drain(p)) for p in PROMPTS[:4]]
            await asyncio.sleep(0.2)  # time enough for the thread to step, were it not held
            assert "step" not in calls  # added (the loop applies them as they come), not run
        return await asyncio.gather(*tasks)

    outputs = run(main)
    assert calls[:5] == ["add"] * 4 + ["step"] and "add" not in calls[5:]
    assert [tuple(o) for o in outputs] == [tuple(make_engine().generate(
        PROMPTS[:4], SamplingParams(max_new_tokens=2))[i].token_ids) for i in range(4)]
