"""AsyncEngine over an engine process: the same tokens as in process, calls across the boundary,
bad input, abort, a killed child, close with streams open, and a parent that dies."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import numpy as np
import pytest

from jhicache import AsyncEngine, SamplingParams
from jhicache.async_engine import EngineClosedError, EngineDeadError
from jhicache.engine_process import EngineSpec
from tests.test_async_engine import LONG, PARAMS, PROMPTS, TIMEOUT_S, expected, run
from tests.test_engine import make_engine


def process_engine() -> AsyncEngine:
    return AsyncEngine(EngineSpec(factory=make_engine))


@pytest.fixture(scope="module")
def shared() -> Iterator[AsyncEngine]:
    engine = process_engine()
    yield engine
    engine.close(timeout=TIMEOUT_S)
    assert engine.process is not None and not engine.process.is_alive()
    assert engine.process.exitcode == 0


def test_generate_and_stream_equal_the_engine_in_process(shared: AsyncEngine) -> None:
    assert not shared.in_process and shared.info.vocab_size == make_engine().model_config.vocab_size
    assert tuple(tuple(o.token_ids) for o in run(lambda: shared.generate(PROMPTS, PARAMS))) \
        == expected()

    async def streamed() -> list[list[int]]:
        async def one(i: int) -> list[int]:
            tokens: list[int] = []
            async for out in shared.stream(PROMPTS[i], PARAMS[i]):
                tokens += out.new_token_ids
                assert out.token_ids == []  # deltas: the tokens so far are the consumer's
            return tokens

        return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))

    assert tuple(map(tuple, run(streamed))) == expected()
    stats = shared.stats()
    assert stats.finished_requests >= 2 * len(PROMPTS)
    assert stats.compiles_serving == shared.compile_counts()["serving"] > 0  # not warmed up
    occupancy = shared.occupancy()
    assert occupancy.running_requests == occupancy.waiting_requests == 0
    assert shared.compile_counts().keys() == {"warmup", "serving"}
    assert shared.flush_cache() is True


def test_bad_input_is_refused_and_the_process_serves_on(shared: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="prompt 1: token id out of range"):
        run(lambda: shared.generate([[1, 2], [1, 10**9]]))
    with pytest.raises(ValueError, match="is a string"):
        run(lambda: shared.generate(["hello"]))
    with pytest.raises(ValueError, match="integer token ids"):
        run(lambda: shared.generate([[1, object()]]))
    assert shared.occupancy().waiting_requests == 0
    assert run(lambda: shared.generate([PROMPTS[0]], PARAMS[0]))[0].token_ids \
        == list(expected()[0])


def test_numpy_prompts_cross_to_the_engine_process(shared: AsyncEngine) -> None:
    """An array, and a list of numpy numbers, as `Engine.generate` takes them in process."""
    prompts = [np.asarray(PROMPTS[0], np.int32), [np.int64(t) for t in PROMPTS[1]]]
    outs = run(lambda: shared.generate(prompts, PARAMS[:2]))
    assert tuple(tuple(o.token_ids) for o in outs) == expected()[:2]
    with pytest.raises(ValueError, match="integer token ids"):
        run(lambda: shared.generate([[1, np.float32(2.5)]]))


def test_abort_by_id_ends_the_stream_with_an_abort_output(shared: AsyncEngine) -> None:
    async def aborted() -> list:
        outs = []
        async for out in shared.stream(PROMPTS[1], LONG, request_id="to-abort"):
            outs.append(out)
            if len(outs) == 2:
                assert await shared.abort("to-abort") is True
        assert await shared.abort("to-abort") is False  # already ended
        return outs

    outs = run(aborted)
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    # every token once, in order (outputs that queued behind the abort's arrive merged in it)
    seen = [t for o in outs for t in o.new_token_ids]
    [whole] = run(lambda: shared.generate([PROMPTS[1]], SamplingParams(max_new_tokens=len(seen))))
    assert len(seen) >= 2 and seen == whole.token_ids
    assert shared.occupancy().running_requests == 0


def test_a_killed_engine_process_fails_its_waiting_callers() -> None:
    engine = process_engine()
    assert engine.process is not None

    async def killed_mid_stream() -> None:
        async for out in engine.stream(PROMPTS[2], LONG):
            if out.new_token_ids:
                os.kill(engine.process.pid, signal.SIGKILL)

    with pytest.raises(EngineDeadError) as raised:
        run(killed_mid_stream)
    assert "exited" in str(raised.value.__cause__)
    assert not engine.is_running
    with pytest.raises(EngineDeadError):
        run(lambda: engine.generate([PROMPTS[0]]))
    engine.close(timeout=TIMEOUT_S)


def test_close_with_streams_open_ends_them_and_the_process() -> None:
    engine = process_engine()

    async def open_streams() -> list[BaseException | None]:
        started = asyncio.Event()

        async def one(i: int) -> BaseException | None:
            try:
                async for _ in engine.stream(PROMPTS[i], LONG):
                    started.set()
            except EngineClosedError as e:
                return e
            return None

        tasks = [asyncio.create_task(one(i)) for i in range(3)]
        await started.wait()
        await engine.aclose()
        return list(await asyncio.gather(*tasks))

    assert all(isinstance(e, EngineClosedError) for e in run(open_streams))
    assert engine.process is not None and engine.process.exitcode == 0
    with pytest.raises(EngineClosedError):
        run(lambda: engine.generate([PROMPTS[0]]))


def test_the_engine_process_exits_when_its_parent_dies() -> None:
    """A parent killed outright (no close) leaves no engine process behind."""
    parent = textwrap.dedent("""
        import os, sys, time
        from jhicache import AsyncEngine
        from jhicache.engine_process import EngineSpec
        from tests.test_engine import make_engine
        engine = AsyncEngine(EngineSpec(factory=make_engine))
        print(engine.process.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + TIMEOUT_S  # a bound so that a failure cannot hang the suite
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, reaped by no one since its parent died, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_thousand_requests_with_random_aborts_leave_nothing_behind(shared: AsyncEngine) -> None:
    """1,000 small streams, 32 at a time, sharing prefixes; a random third end early: aborted
    by id (before or after their first output) or left by their consumer. Every stream gets
    each token once, in order, and ends as it should; afterwards the page accounting holds
    (checked at every step too: `make_engine`) and the child follows no request."""
    rng = random.Random(35)
    bases = [[rng.randrange(1, 500) for _ in range(48)] for _ in range(4)]
    finished = shared.stats().finished_requests
    gate = asyncio.Semaphore(32)

    async def one(i: int) -> str:
        prompt = bases[i % 4][:rng.randrange(1, 48)] + [rng.randrange(1, 500)]
        params = SamplingParams(max_new_tokens=rng.randrange(1, 9))
        how, after = rng.choice(["run"] * 2 + ["abort", "leave"]), rng.randrange(0, 3)
        rid, tokens, last = f"r{i}", [], None
        async with gate:
            stream = shared.stream(prompt, params, request_id=rid)
            async for out in stream:
                tokens += out.new_token_ids
                assert out.token_ids == []  # deltas: the tokens so far are the consumer's
                last = out
                if how == "leave" and len(tokens) >= after and not out.finished:
                    await stream.aclose()
                    return "left"
                if how == "abort" and len(tokens) >= after and not out.finished:
                    await shared.abort(rid)  # False when it finished meanwhile
        assert last is not None and last.finished
        if last.finish_reason == "abort":
            assert how == "abort"
        else:
            assert last.finish_reason == "length" and len(tokens) == params.max_new_tokens
        return last.finish_reason

    async def all_of_them() -> list[str]:
        return list(await asyncio.gather(*(one(i) for i in range(1000))))

    ends = run(all_of_them)
    assert len(ends) == 1000 and ends.count("abort") > 100 and ends.count("left") > 100
    shared.check_invariants()
    occupancy = shared.occupancy()
    assert occupancy.running_requests == occupancy.waiting_requests == 0
    # a stream left after a step that finished its request (the output still on its way) ends
    # in the engine all the same
    done = shared.stats().finished_requests - finished
    assert ends.count("length") <= done <= ends.count("length") + ends.count("left")
