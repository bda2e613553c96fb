"""`python -m jhicache.bench multiturn --url` and `serve-overhead`: the bench's clients through a
real server on 127.0.0.1 get the in-process run's tokens and hits; usage errors; the report."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from tqdm import tqdm

# The serve extra (`pip install -e '.[test,serve]'`, as `make test` does); the GPU machine's
# preinstalled packages may lack it: skip these tests there rather than fail collection.
for _module in ("fastapi", "uvicorn", "aiohttp", "prometheus_client"):
    pytest.importorskip(_module)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import cli as bench_cli  # noqa: E402
from benchmarks import host_hit, serve_overhead  # noqa: E402
from jhicache import AsyncEngine, Engine, SamplingParams  # noqa: E402
from jhicache.bench import (  # noqa: E402
    cli,
    command,
    compile_counter,
    engines,
    multiturn,
    remote,
    remote_run,
)
from jhicache.bench.backends import ServerError  # noqa: E402
from jhicache.serve.context import ServerContext  # noqa: E402
from jhicache.serve.thread import ServerThread, free_socket  # noqa: E402

WORKLOAD = ["--clients", "3", "--rounds", "2", "--request-length", "24", "--output-length", "3"]
ENGINE = ["--page-size", "8", "--dtype", "float32", "--device-kv-tokens", "512"]
URL = "http://127.0.0.1:30000"


def bench_args() -> object:
    return cli.parse_args(["multiturn", *WORKLOAD, *ENGINE])


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    """The tiny preset served with the engine config the bench gives its hierarchical mode."""
    args = bench_args()
    config = engines.engine_config(args, cache_mode="hierarchical", device_kv_tokens=512)
    engine = AsyncEngine(Engine.from_preset("tiny", config, seed=args.seed))
    srv = ServerThread(ServerContext.create(engine, None, "tiny", "preset:tiny")).start()
    yield srv
    srv.stop()


def usage_error(capsys, argv: list[str]) -> str:
    """The usage error of `argv`: `python -m jhicache.bench`'s, or where argv[0] names a bench
    of benchmarks/, that bench's (argv[0] dropped)."""
    benches = {"host-hit": host_hit.add_options, "serve-overhead": serve_overhead.add_options}
    with pytest.raises(SystemExit) as exit_info:
        if argv[0] in benches:
            bench_cli.parse(argv[0], "", argv[1:], benches[argv[0]])
        else:
            cli.parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# ---- the --url path ------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [multiturn.TurnSampling(),
                                      multiturn.TurnSampling(temperature=0.8, top_p=0.9)])
def test_url_run_gets_the_in_process_tokens_and_hits(server: ServerThread,
                                                     sampling: multiturn.TurnSampling) -> None:
    args = bench_args()
    spec, config = multiturn.multiturn_spec(args, 512), multiturn.clients_config(args, args.seed)
    progress = tqdm(disable=True)
    engine = engines.make_engine(args, cache_mode="hierarchical", device_kv_tokens=512)
    here = asyncio.run(multiturn.drive_clients(engine, spec, config, progress, sampling))
    remote.flush_cache(server.url)  # nothing cached by other tests
    over_http = asyncio.run(remote_run.drive_url(server.url, spec, config, progress, sampling))
    assert over_http.histories == here.histories  # a sampled turn's seed crosses HTTP too
    by_turn = {(t.client, t.round): t for t in here.turns}
    for turn in over_http.turns:
        twin = by_turn[(turn.client, turn.round)]
        assert (turn.token_ids, turn.prompt_len) == (twin.token_ids, twin.prompt_len)
        assert (turn.device_hit_tokens, turn.host_hit_tokens) == (twin.device_hit_tokens,
                                                                  twin.host_hit_tokens)
        assert len(turn.token_ids) == 3 and twin.server_ttft_s is None
        assert 0 < turn.ttft_s <= turn.e2e_s
        # the server's and its engine's own TTFT (meta_info): each inside the one around it
        assert turn.engine_ttft_s is not None and turn.server_ttft_s is not None
        assert 0 < turn.engine_ttft_s <= turn.server_ttft_s <= turn.ttft_s
        # a gap per later output; a client that lags the steps gets outputs merged: fewer
        assert len(turn.itl_s) <= 2 and all(gap > 0 for gap in turn.itl_s)
    assert all(t.device_hit_tokens > 0 for t in over_http.turns if t.round == 1)
    assert over_http.max_in_flight == 3


def test_multiturn_url_command_writes_the_servers_run(server: ServerThread, tmp_path,
                                                      capsys) -> None:
    out = tmp_path / "remote.json"
    assert command.main(["multiturn", "--url", server.url + "/", *WORKLOAD, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"server"} and result["preset"] == "tiny"
    assert result["server"]["url"] == server.url and "--modes does not apply" in printed
    assert result["server"]["vocab_from"] == "/get_model_info" and result["page_size"] is None
    run = result["modes"]["server"]
    assert run["stats"] is None and run["device_kv_tokens"] == 512 and run["requests"] == 6
    assert run["ttft"]["mean_s"] > 0 and 0 < run["itl"]["p50_s"] <= run["itl"]["p99_s"]
    assert run["e2e"]["mean_s"] >= run["ttft"]["mean_s"] and run["throughput_tokens_per_s"] > 0
    first, second = run["rounds"]
    assert first["device_hit_rate"] == 0 < second["device_hit_rate"]
    assert 0 < second["engine_mean_ttft_s"] < second["mean_ttft_s"]  # from meta_info
    assert "server: " in printed and "engine counters: see the server's /metrics" in printed


def test_unreachable_server_is_a_message_not_a_traceback(capsys) -> None:
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    assert command.main(["multiturn", "--url", f"http://127.0.0.1:{port}", *WORKLOAD]) == 1
    err = capsys.readouterr().err
    assert "cannot reach the server at" in err and "Traceback" not in err


def test_a_refused_request_raises_server_error_with_the_status(server: ServerThread) -> None:
    async def send() -> None:
        async with remote.http_backend(server.url, 1) as backend:
            async for _ in backend.stream([10**6], SamplingParams(max_new_tokens=2), "bad"):
                pass

    with pytest.raises(ServerError, match="answered 400"):
        asyncio.run(send())


def test_a_stream_event_longer_than_aiohttps_default_line_is_read() -> None:
    """A long answer's last event carries every output id (SGLang's stream): 40,000 here, some
    230 kB on one line, past aiohttp's default limit of 128 kB."""
    from aiohttp import web

    ids = list(range(40_000))

    async def generate(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        event = {"output_ids": ids, "meta_info": {"prompt_tokens": 3, "finish_reason": "x"}}
        await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def stream() -> list:
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.SockSite(runner, free_socket())
        await site.start()
        try:
            async with remote.http_backend(site.name, 1) as backend:
                return [chunk async for chunk in backend.stream(
                    [1, 2, 3], SamplingParams(max_new_tokens=2), "long")]
        finally:
            await runner.cleanup()

    [chunk] = asyncio.run(stream())
    assert chunk.token_ids == tuple(ids) and chunk.finished and chunk.prompt_len == 3
    ids = list(range(400_000))  # 2.6 MB: a clear error, not a traceback from aiohttp
    with pytest.raises(ServerError, match="an event too long to read"):
        asyncio.run(stream())


def test_events_are_checked_and_a_server_without_tier_split_counts_device_hits() -> None:
    sglang = {"output_ids": [5, 6], "meta_info": {"prompt_tokens": 9, "cached_tokens": 4,
                                                  "finish_reason": None}}
    chunk = remote.parse_chunk(sglang, (5,))
    assert (chunk.new_token_ids, chunk.device_hit_tokens, chunk.host_hit_tokens) == ((6,), 4, 0)
    assert not chunk.finished and chunk.prompt_len == 9
    with pytest.raises(ServerError, match="do not extend"):
        remote.parse_chunk(sglang, (7,))
    with pytest.raises(ServerError, match="with an error"):
        remote.parse_chunk({"error": {"message": "engine unavailable"}}, ())
    with pytest.raises(ServerError, match="without output_ids"):
        remote.parse_chunk({"text": ""}, ())


# ---- usage errors --------------------------------------------------------------------------

def test_modes_are_refused_with_url(capsys) -> None:
    err = usage_error(capsys, ["multiturn", "--url", URL, "--modes", "hierarchical"])
    assert "--modes does not apply with --url" in err and "its own --cache-mode" in err


@pytest.mark.parametrize("option", [["--page-size", "8"], ["--device-kv-tokens", "512"],
                                    ["--write-policy", "write_through"], ["--dtype", "float32"]])
def test_engine_options_are_refused_with_url(capsys, option: list[str]) -> None:
    err = usage_error(capsys, ["multiturn", "--url", URL, *option])
    assert f"{option[0]} configure(s) an engine in this process" in err


@pytest.mark.parametrize("what", ["all", "model", "host-hit", "serve-overhead"])
def test_url_is_for_multiturn_only(capsys, what: str) -> None:
    assert "use it with `multiturn`" in usage_error(capsys, [what, "--url", URL])


@pytest.mark.parametrize("url", ["127.0.0.1:30000", "ftp://host:1", "http://", "http://h:port",
                                 "http://h:99999", "http://h:1/generate", "http://h:1?x=1"])
def test_bad_urls_are_usage_errors(capsys, url: str) -> None:
    assert "argument --url:" in usage_error(capsys, ["multiturn", "--url", url])


def test_a_base_url_loses_its_trailing_slash() -> None:
    assert cli.parse_args(["multiturn", "--url", URL + "/"]).url == URL
    assert cli.parse_args(["multiturn"]).url is None


# ---- serve-overhead ------------------------------------------------------------------------

@pytest.mark.slow
def test_serve_overhead_reports_each_path_and_its_difference(tmp_path, capsys) -> None:
    out = tmp_path / "overhead.json"
    assert serve_overhead.main([*WORKLOAD, *ENGINE, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())["serve_overhead"]
    assert set(result["modes"]) == {"hierarchical"}  # its default
    mode = result["modes"]["hierarchical"]
    assert mode["same_tokens"] is True
    here, http, proc = mode["in_process"], mode["http"], mode["http_process"]
    for run in (here, http, proc):
        assert run["requests"] == 6 and run["ttft"]["mean_s"] > 0 and run["itl"]["p50_s"] > 0
        assert run["stats"]["decode_tokens"] > 0 and run["device_kv_tokens"] == 512
        assert run["rounds"][1]["device_hit_rate"] > 0
        assert run["compiles_during_run"]["count"] == 0
        hit = run["device_hit"]  # the probe: 3 turns, the last two hitting the device
        assert hit["turns"] == 2 and hit["device_hit_rate"] > 0 and hit["ttft"]["p50_s"] > 0
        assert 0 < hit["engine_ttft_p50_s"] <= hit["ttft"]["p50_s"]
    assert here["device_hit"]["server_ttft_p50_s"] is None  # no server in process
    for run in (http, proc):
        hit = run["device_hit"]
        assert hit["engine_ttft_p50_s"] <= hit["server_ttft_p50_s"] <= hit["ttft"]["p50_s"]
    gap = mode["overhead"]
    assert gap["mean_e2e_s"] == pytest.approx(http["e2e"]["mean_s"] - here["e2e"]["mean_s"])
    assert gap["mean_ttft_s"] == pytest.approx(http["ttft"]["mean_s"] - here["ttft"]["mean_s"])
    assert gap["throughput_ratio"] == pytest.approx(
        http["throughput_tokens_per_s"] / here["throughput_tokens_per_s"])
    gap = mode["overhead_process"]
    assert gap["p50_itl_s"] == pytest.approx(proc["itl"]["p50_s"] - here["itl"]["p50_s"])
    assert gap["p50_device_hit_ttft_s"] == pytest.approx(
        proc["device_hit"]["ttft"]["p50_s"] - here["device_hit"]["ttft"]["p50_s"])
    assert gap["throughput_ratio"] == pytest.approx(
        proc["throughput_tokens_per_s"] / here["throughput_tokens_per_s"])
    assert proc["warmup"]["shapes"] > 0 and proc["compiles_during_run"]["count"] == 0
    assert "uvicorn" in result["how"] and "HTTP - in process" in printed
    assert "tokens identical in process and over HTTP (both ways)" in printed
    assert "HTTP+proc - in" in printed and "device hit TTFT p50" in printed
    assert "XLA compiles during the measured run" in printed
    # the clients' own CPU time, where they ran alone in a process (not beside the engine)
    assert here["clients_cpu_s"] is None and here["clients_cpu_per_request_s"] is None
    for run in (http, proc):
        assert run["clients_cpu_per_request_s"] == pytest.approx(run["clients_cpu_s"] / 6)
        assert run["clients_cpu_s"] > 0
    assert "the HTTP clients' own CPU time per request" in printed
    assert "device hit TTFT p50 as the clients / the server / the engine saw it" in printed


def test_compile_counter_counts_only_inside_its_block() -> None:
    with compile_counter.CompileCounter() as compiles:
        jax.jit(lambda x: x * 3 + 1)(jnp.ones(7)).block_until_ready()
    assert compiles.count >= 1 and compiles.seconds > 0
    seen = compiles.count
    jax.jit(lambda x: x * 5 - 2)(jnp.ones(9)).block_until_ready()
    assert compiles.count == seen
