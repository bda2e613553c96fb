"""A fleet: two `python -m jhicache.serve` processes on one Mooncake store (a real
`mooncake_master`), `sglang-router --policy cache_aware` in front of them. Through the router
the three generation routes answer; a conversation server A served continues on server B with
its prefix read from the store and the tokens of a server that computes it all; a server of
another namespace never reads those pages. With a store process of its own holding the memory,
the pages outlive the server that wrote them (drained), for a server started after. Every
server checks its page accounting at each step (--check-invariants-every-step: a violation
fails the request), and its /metrics show no serving compile."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest

# The serve extra and the router (the test extra's); where CI requires the Mooncake tests,
# a missing router fails them rather than skip them
for _module in ("fastapi", "uvicorn", "httpx", "tokenizers", "sglang_router"):
    if os.environ.get("JHICACHE_REQUIRE_MOONCAKE") == "1":
        importlib.import_module(_module)
    else:
        pytest.importorskip(_module)

import httpx  # noqa: E402
import pydantic  # noqa: E402

from benchmarks.fleet import MovingBackend, Processes  # noqa: E402
from benchmarks.mooncake_local import StoreService  # noqa: E402
from jhicache.bench import clients  # noqa: E402
from jhicache.bench.backends import Chunk  # noqa: E402
from jhicache.bench.multiturn import turn_params  # noqa: E402
from jhicache.bench.workload import MultiTurnSpec, user_turns  # noqa: E402
from jhicache.sampling import SamplingParams  # noqa: E402
from jhicache.serve.protocol import (  # noqa: E402
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from tests.mooncake_support import Master, running_master  # noqa: E402
from tests.serve_support import metric, write_checkpoint  # noqa: E402

STARTUP_S = 600.0  # a server warming up on a loaded 2-core CI box
TIMEOUT_S = 120.0
MAX_TOKENS = 8
# 4 pages of prompt, then the answer: the prefix B reads is whole pages A wrote
FIRST_TURN = [(7 * i + 3) % 300 + 5 for i in range(64)]
NEXT_USER = [(11 * i + 1) % 300 + 5 for i in range(20)]


class Fleet:
    """Servers of the tiny checkpoint on one store, and a router, started by `procs` (the
    fleet bench's: each ended at the end, with its engine process)."""

    def __init__(self, procs: Processes, checkpoint: Path, master: Master, cache: Path) -> None:
        self.procs, self.checkpoint, self.master, self.cache = procs, checkpoint, master, cache

    def servers(self, *extras: Sequence[str], store: dict | None = None) -> list[str]:
        """Servers on the store (the module's master, or `store`'s config), each with its
        `extras` flags; their URLs, once warmed up."""
        flags = [["--model", str(self.checkpoint), "--page-size", "16",
                  "--device-kv-tokens", "512", "--host-kv-tokens", "1024", "--dtype", "float32",
                  "--chunked-prefill-tokens", "128", "--max-running-requests", "4",
                  "--write-policy", "write_through", "--fetch-threshold", "16",
                  "--fetch-policy", "wait_complete", "--check-invariants-every-step",
                  "--fail-on-compile", "--compilation-cache", str(self.cache),
                  "--storage-backend", "mooncake",
                  "--storage-backend-config", json.dumps(store or self.master.config), *extra]
                 for extra in extras]
        return self.procs.servers(flags)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, compilation_cache: Path) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    checkpoint = write_checkpoint(tmp / "ckpt")
    with running_master(tmp) as master, Processes(tmp, STARTUP_S) as procs:
        yield Fleet(procs, checkpoint, master, compilation_cache)


def _generate(url: str, ids: list[int]) -> dict:
    got = httpx.post(url + "/generate", timeout=TIMEOUT_S, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0,
                                              "ignore_eos": True}})
    assert got.status_code == 200, got.text
    return got.json()


@pytest.mark.slow
def test_a_fleet_behind_the_router_shares_one_store(fleet: Fleet) -> None:
    a, b = fleet.servers((), ())
    router = fleet.procs.router([a, b])

    # the three routes, through the router, unchanged
    native = httpx.post(router + "/generate", timeout=TIMEOUT_S, json={
        "text": "the quick brown fox", "sampling_params": {"max_new_tokens": 4,
                                                           "temperature": 0}})
    assert native.status_code == 200, native.text
    assert len(native.json()["output_ids"]) <= 4 and "meta_info" in native.json()
    model = httpx.get(a + "/v1/models", timeout=10).json()["data"][0]["id"]
    completion = httpx.post(router + "/v1/completions", timeout=TIMEOUT_S, json={
        "model": model, "prompt": "a cache keeps", "max_tokens": 4, "temperature": 0})
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] is not None
    chat = httpx.post(router + "/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": model, "messages": [{"role": "user", "content": "hello server"}],
        "max_tokens": 4, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"

    # a conversation A served continues on B (sent to B directly: the router would keep it
    # on A), its prefix read from the store
    first = _generate(a, FIRST_TURN)
    assert first["meta_info"]["cached_tokens_details"]["storage"] == 0
    assert httpx.post(a + "/flush_cache", timeout=TIMEOUT_S).status_code == 200  # backups done
    second_turn = FIRST_TURN + first["output_ids"] + NEXT_USER
    on_b = _generate(b, second_turn)
    from_store = on_b["meta_info"]["cached_tokens_details"]["storage"]
    assert from_store >= len(FIRST_TURN)  # at least the first prompt's pages
    with httpx.Client(base_url=b, timeout=10) as http:
        assert metric(http, "jhicache:cache_hit_tokens_total", tier="storage") >= from_store

    # another namespace on the same store: it computes everything, which gives the tokens of
    # no cache at all, which B's must equal
    (other,) = fleet.servers(("--storage-model-name", "another model"))
    on_other = _generate(other, second_turn)
    assert on_other["meta_info"]["cached_tokens_details"]["storage"] == 0
    assert on_other["meta_info"]["cached_tokens"] == 0
    assert on_b["output_ids"] == on_other["output_ids"]
    with httpx.Client(base_url=other, timeout=10) as http:
        assert metric(http, "jhicache:cache_hit_tokens_total", tier="storage") == 0

    for url in (a, b, other):  # every step checked its pages; none compiled while serving
        with httpx.Client(base_url=url, timeout=10) as http:
            assert metric(http, "jhicache:compiles_total", phase="serving") == 0
            assert metric(http, "jhicache:storage_write_failures_total", 0.0, reason="io") == 0


class _Recording:
    """A backend that answers every turn with one token at once, noting the turns it got."""

    def __init__(self) -> None:
        self.turns: list[str] = []

    def together(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    async def stream(self, prompt: Sequence[int], params: SamplingParams,
                     request_id: str) -> AsyncIterator[Chunk]:
        self.turns.append(request_id)
        yield Chunk((1,), (1,), True, len(prompt), 0, 0, None)


# What sglang-router 0.3.2 forwards for a plain request to each route (captured from it)
ROUTER_BODIES = {
    GenerateRequest: {"model": None, "input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 2}, "return_text_in_logprobs": False, "stream": False,
        "log_metrics": True, "return_hidden_states": False, "background": False,
        "no_logs": False, "return_bytes": False, "return_entropy": False},
    CompletionRequest: {"model": "m", "prompt": "hi", "max_tokens": 2, "temperature": 0.0,
                        "stream": False, "echo": False, "no_stop_trim": False,
                        "ignore_eos": False, "skip_special_tokens": True,
                        "return_hidden_states": False},
    ChatCompletionRequest: {"messages": [{"role": "user", "content": "hi"}], "model": "m",
                            "logprobs": False, "max_completion_tokens": 2, "stream": False,
                            "no_stop_trim": False, "ignore_eos": False,
                            "continue_final_message": False, "skip_special_tokens": True,
                            "separate_reasoning": True, "stream_reasoning": True,
                            "return_hidden_states": False}}


@pytest.mark.parametrize("request_type", list(ROUTER_BODIES), ids=lambda t: t.__name__)
def test_the_routers_fields_are_taken_at_their_defaults_only(request_type: type) -> None:
    body = ROUTER_BODIES[request_type]
    request_type.model_validate(body)
    with pytest.raises(pydantic.ValidationError, match="return_hidden_states"):
        request_type.model_validate({**body, "return_hidden_states": True})


def test_the_bench_moves_each_turn_to_the_next_server() -> None:
    """The fleet bench's clients: turn r of conversation c on server (c + r) mod n, so no turn
    after the first finds its conversation's last turn on its server."""
    servers = [_Recording() for _ in range(3)]
    spec = MultiTurnSpec(num_clients=4, num_rounds=3, request_length=4, output_length=1)
    asyncio.run(clients.run_clients(MovingBackend(servers), user_turns(spec),
                                    turn_params(spec), clients.ClientsConfig()))
    got = {turn: i for i, server in enumerate(servers) for turn in server.turns}
    assert got == {f"c{c}-r{r}": (c + r) % 3 for c in range(4) for r in range(3)}


@pytest.mark.slow
def test_pages_outlive_a_drained_server_in_a_store_process(fleet: Fleet, tmp_path: Path) -> None:
    """A store of its own: Mooncake's store service contributes the memory, the servers none
    (global_segment_size 0). A conversation whose server was stopped (drained) continues
    on a server started after (added), its prefix read from the store, with the tokens that
    server computes with nothing cached."""
    with running_master(tmp_path) as master:
        service = StoreService(master, 64 << 20, tmp_path)
        service.start()
        try:
            store = {**master.config, "global_segment_size": 0}
            (a,) = fleet.servers((), store=store)
            first = _generate(a, FIRST_TURN)
            assert httpx.post(a + "/flush_cache", timeout=TIMEOUT_S).status_code == 200
            fleet.procs.end(a)  # its clean stop; its process and engine process gone
            (b,) = fleet.servers((), store=store)
            second_turn = FIRST_TURN + first["output_ids"] + NEXT_USER
            on_b = _generate(b, second_turn)
            assert on_b["meta_info"]["cached_tokens_details"]["storage"] >= len(FIRST_TURN)
            for route in ("/flush_cache", "/clear_hicache_storage_backend"):  # nothing cached
                assert httpx.post(b + route, timeout=TIMEOUT_S).status_code == 200
            computed = _generate(b, second_turn)
            assert computed["meta_info"]["cached_tokens"] == 0
            assert on_b["output_ids"] == computed["output_ids"]
            fleet.procs.end(b)  # before its store goes
        finally:
            service.stop()
