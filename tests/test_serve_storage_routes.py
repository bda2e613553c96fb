"""The storage tier's admin routes: shown, attached and detached at run time while a stream
is served (it ends with the tokens it would have had), cleared; refused without the admin key
when the server has one; a field this server does not take is refused by name."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks.mooncake_local import local_store
from jhicache.serve.thread import ServerThread
from tests.mooncake_support import mooncake_or_skip, running_master
from tests.serve_support import ENGINE_CONFIG, TIMEOUT_S, metric, start_server
from tests.waiting import wait_until

httpx = pytest.importorskip("httpx")
KEY = "secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    config = dataclasses.replace(ENGINE_CONFIG, write_policy="write_through")
    srv = start_server(None, config=config, process=True, admin_api_key=KEY)
    yield srv
    srv.stop()


def test_attach_and_detach_while_a_stream_is_served(server: ServerThread,
                                                    tmp_path: Path) -> None:
    prompt = {"input_ids": list(range(1, 200)), "sampling_params": {"max_new_tokens": 24,
                                                                    "temperature": 0}}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
        expected = http.post("/generate", json=prompt).json()["output_ids"]
        assert http.get("/hicache/storage-backend", headers=AUTH).json()[
            "hicache_storage_backend"] is None

        def attach() -> None:
            attached = http.put("/hicache/storage-backend", headers=AUTH, json={
                "hicache_storage_backend": "file", "storage_dir": str(tmp_path)})
            assert attached.status_code == 200, attached.text
            assert attached.json()["storage_dir"] == str(tmp_path)

        assert _streams_around(server.url, [prompt], attach) == [expected]
        info = http.get("/server_info").json()
        assert info["storage_dir"] == str(tmp_path) and info["storage_backend"] == "file"
        assert info["hicache_storage_backend"] == "file"
        http.post("/generate", json={**prompt, "input_ids": list(range(300, 420))})
        assert http.delete("/hicache/storage-backend", headers=AUTH).status_code == 200
        assert list(tmp_path.rglob("*.kv"))  # written before the detach returned
        info = http.get("/server_info").json()
        assert info["storage_dir"] is None and info["hicache_storage_backend"] is None
        assert http.post("/generate", json=prompt).json()["output_ids"] == expected


def _streams_around(url: str, prompts: list[dict], action: Callable[[], None]) -> list[list[int]]:
    """The prompts streamed at once (a client each), `action()` run once every stream's first
    event has come; each stream's last output_ids, in the prompts' order."""
    started = threading.Barrier(len(prompts) + 1)

    def stream(prompt: dict) -> list[int]:
        with httpx.Client(base_url=url, timeout=TIMEOUT_S) as http, \
                http.stream("POST", "/generate", json={**prompt, "stream": True}) as answer:
            lines = (line for line in answer.iter_lines() if line.startswith("data:"))
            events = [next(lines)]
            started.wait(TIMEOUT_S)
            events += lines
        return list(json.loads(events[-2].removeprefix("data:"))["output_ids"])  # before [DONE]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, prompt) for prompt in prompts]
        started.wait(TIMEOUT_S)
        action()
        return [future.result() for future in futures]


def test_a_mooncake_store_attached_and_detached_while_streams_are_served(
        server: ServerThread, tmp_path: Path) -> None:
    """A Mooncake store attached while four streams are served, detached while four more are:
    every stream ends with the tokens it has alone; the pages written through meanwhile are in
    the store (its memory a store service's, so they outlive the server's client), and a prefix
    flushed from the device and host tiers hits there once the store is attached again."""
    mooncake_or_skip()
    with local_store(tmp_path, 64 << 20) as (store, _), \
            httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
        body = {"hicache_storage_backend": "mooncake",
                "hicache_storage_backend_extra_config_json": json.dumps(store)}
        prompts = [{"input_ids": list(range(i, 200 + i)),
                    "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
                   for i in range(1, 5)]
        expected = [http.post("/generate", json=p).json()["output_ids"] for p in prompts]
        prompt = prompts[0]

        def attach() -> None:
            answer = http.put("/hicache/storage-backend", headers=AUTH, json=body)
            assert answer.status_code == 200, answer.text

        def detach() -> None:
            assert http.delete("/hicache/storage-backend", headers=AUTH).status_code == 200

        try:
            assert _streams_around(server.url, prompts, attach) == expected
            assert http.get("/server_info").json()["hicache_storage_backend"] == "mooncake"
            other = {**prompt, "input_ids": list(range(100, 500))}  # past the fetch threshold
            computed = http.post("/generate", json=other).json()["output_ids"]  # written through
            assert _streams_around(server.url, prompts, detach) == expected
            assert http.get("/hicache/storage-backend", headers=AUTH).json()[
                "hicache_storage_backend"] is None
            attach()
            assert http.post("/flush_cache").status_code == 200  # device and host tiers emptied
            again = http.post("/generate", json=other).json()
            assert again["meta_info"]["cached_tokens_details"]["storage"] >= 384
            assert again["output_ids"] == computed
            assert http.post("/hicache/storage-backend/clear", headers=AUTH).json() == {
                "cleared": True}
        finally:  # the module's server leaves with no tier, whatever happened
            http.delete("/hicache/storage-backend", headers=AUTH)


def test_admin_routes_need_the_key_and_refuse_unknown_fields(server: ServerThread,
                                                             tmp_path: Path) -> None:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
        assert http.get("/hicache/storage-backend").status_code == 401
        body = {"hicache_storage_backend": "file", "storage_dir": str(tmp_path)}
        assert http.put("/hicache/storage-backend", json=body).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert http.delete("/hicache/storage-backend", headers=wrong).status_code == 401
        refused = http.put("/hicache/storage-backend", headers=AUTH, json={
            **body, "hicache_storage_prefetch_policy": "timeout"})
        assert refused.status_code == 400 and "hicache_storage_prefetch_policy" in refused.text
        bad = http.put("/hicache/storage-backend", headers=AUTH,
                       json={"hicache_storage_backend": "file"})  # no directory
        assert bad.status_code == 400 and "storage_dir" in bad.text
        assert http.put("/hicache/storage-backend", headers=AUTH, json=body).status_code == 200
        assert http.post("/hicache/storage-backend/clear", headers=AUTH).json() == {
            "cleared": True}
        assert http.delete("/hicache/storage-backend", headers=AUTH).status_code == 200


def test_a_server_with_its_engine_in_process_stores_the_cache_when_stopped(tmp_path: Path) -> None:
    """As an engine process does at its end: the pages that never left the device (the default
    write policy) are in storage once the server has stopped."""
    config = dataclasses.replace(ENGINE_CONFIG, storage_dir=str(tmp_path))
    srv = start_server(None, config=config, process=False)
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT_S) as http:
            http.post("/generate", json={"input_ids": list(range(1, 100)),
                                         "sampling_params": {"max_new_tokens": 2}})
    finally:
        srv.stop()
    assert len(list(tmp_path.rglob("*.kv"))) >= 6  # the prompt's six whole pages


def test_clearing_a_store_whose_master_is_gone_is_refused(tmp_path: Path) -> None:
    """Both clear routes answer 503 while the store cannot be reached (nothing deleted, so
    never "cleared"), /metrics shows it, and they clear again once a master answers."""
    mooncake_or_skip()
    with running_master(tmp_path) as master:
        config = dataclasses.replace(ENGINE_CONFIG, storage_backend="mooncake",
                                     storage_backend_config=json.dumps(master.config))
        srv = start_server(None, config=config)
        try:
            with httpx.Client(base_url=srv.url, timeout=TIMEOUT_S) as http:
                assert metric(http, "jhicache:storage_reachable") == 1
                master.stop()
                wait_until(lambda: metric(http, "jhicache:storage_reachable") == 0)
                refused = http.post("/hicache/storage-backend/clear")
                assert refused.status_code == 503 and "cannot be reached" in refused.text
                native = http.post("/clear_hicache_storage_backend")
                assert native.status_code == 503 and "cannot be reached" in native.text
                master.start()
                wait_until(lambda: metric(http, "jhicache:storage_reachable") == 1)
                assert http.post("/hicache/storage-backend/clear").json() == {"cleared": True}
        finally:
            srv.stop()
