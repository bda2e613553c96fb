"""`python -m jhicache.bench`: the JSON it writes has the documented shape, on a tiny CPU
workload."""

from __future__ import annotations

import asyncio
import json

import jax.numpy as jnp
import numpy as np
import pytest
from tqdm import tqdm

from benchmarks import cli as bench_cli
from benchmarks import host_hit, restart, scoring, storage_hit, store_cost, tables
from jhicache.async_engine import AsyncEngine
from jhicache.bench import (
    cli,
    clients,
    command,
    compile_counter,
    engines,
    multiturn,
    remote,
    workload,
)
from jhicache.bench.workload import MultiTurnChats, MultiTurnSpec
from jhicache.sampling import SamplingParams
from tests.mooncake_support import mooncake_or_skip, running_master

# A small step grid (3 shapes: 64 tokens x 1 or 4 requests, decode 4): each mode's warm-up
# compiles every shape of its grid, and the CPU defaults' grid is 8 shapes.
SMALL_GRID = ["--max-running-requests", "4", "--chunked-prefill-tokens", "64"]
TINY = ["--preset", "tiny", "--clients", "3", "--rounds", "2", "--request-length", "24",
        "--output-length", "2", "--page-size", "8", "--dtype", "float32", *SMALL_GRID]


@pytest.mark.slow
def test_multiturn_json_has_rounds_per_mode_and_unbounded_reference(tmp_path, capsys) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["multiturn", *TINY, "--modes", "off,hierarchical,unbounded", "--out", str(out),
            "--plot", str(png)]
    assert command.main(argv) == 0
    printed = capsys.readouterr()
    assert "timings only check that the bench runs" in printed.out.splitlines()[0]  # a CPU run
    assert png.read_bytes().startswith(b"\x89PNG") and f"plot written to {png}" in printed.out
    assert "%|" not in printed.err  # captured stderr is no terminal: no progress-bar fragments
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"off", "hierarchical", "unbounded"}
    for mode in result["modes"].values():
        assert len(mode["rounds"]) == 2
        for r in mode["rounds"]:
            assert {"mean_ttft_s", "device_hit_rate", "host_hit_rate"} <= set(r)
            assert r["mean_ttft_s"] > 0 and 0 <= r["device_hit_rate"] + r["host_hit_rate"] <= 1
        assert r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"] and r["requests"] == 3
        ttft = mode["ttft"]
        assert 0 < ttft["p50_s"] <= ttft["p90_s"] <= ttft["p99_s"] and ttft["mean_s"] > 0
        assert 0 < mode["itl"]["p50_s"] <= mode["itl"]["p99_s"] and mode["requests"] == 6
        assert mode["max_in_flight"] == 3 and len(mode["send_order"]) == 6
    assert {"request_rate": "inf", "max_parallel": 3, "ready_queue_policy": "fifo",
            "round_barrier": "on"}.items() <= result["spec"].items()
    assert "TTFT mean/p50/p90/p99" in printed.out and "ITL p50/p99" in printed.out
    off, unbounded = result["modes"]["off"], result["modes"]["unbounded"]
    assert all(r["device_hit_rate"] == 0 for r in off["rounds"])
    assert unbounded["rounds"][1]["device_hit_rate"] > 0  # round 2 reuses round 1's conversation
    assert unbounded["device_kv_tokens"] > off["device_kv_tokens"]


def test_host_hit_reports_its_ratios_against_pcie(tmp_path, capsys) -> None:
    out = tmp_path / "hit.json"
    args = [*TINY, "--host-hit-prefix", "64", "--host-hit-turn", "8",
            "--host-hit-trials", "3", "--out", str(out)]
    assert host_hit.main(args) == 0
    hit = json.loads(out.read_text())["host_hit"]
    assert hit["host_hit_tokens"] == 64
    assert hit["pcie_s"] > 0 and hit["host_hit_ratio"] == pytest.approx(
        hit["host_hit_ttft_s"] / max(hit["pcie_s"], hit["device_hit_ttft_s"]))
    ratios = sorted(t["host_hit_ratio"] for t in hit["trials"])
    assert len(ratios) == 3 and hit["host_hit_ratio"] == ratios[1]  # the median trial's figures
    assert hit["trials"][hit["median_trial"]]["host_hit_ttft_s"] == hit["host_hit_ttft_s"]
    assert hit["host_hit_ratio_range"] == [ratios[0], ratios[2]]
    assert "the median of 3 trials" in capsys.readouterr().out
    assert (hit["write_back_bytes"] > 0 and hit["write_back_gbps"] > 0
            and hit["pcie_to_host_gbps"] > 0)
    assert hit["device_hit_beside_write_back_ttft_s"] > 0
    assert all(t["load_alone_s"] > 0 for t in hit["trials"])  # each timed a real load (not nan)
    row = json.loads(out.read_text())["page_rows"]["host_hit"]  # the bench's own page row
    assert row["target"] == "1.1"  # the tiny preset: not a 0.5B model
    assert row["met"] in ("yes", "no") or row["met"].startswith("partly (in ")
    assert row["result"].startswith(f"{hit['host_hit_ttft_s'] * 1e3:.1f} ms (")


def test_storage_hit_reads_the_prefix_from_disk_and_measures_the_disk(tmp_path, capsys) -> None:
    out = tmp_path / "storage.json"
    args = [*TINY, "--storage-hit-prefix", "64", "--storage-hit-turn", "8",
            "--storage-hit-trials", "2", "--storage-dir", str(tmp_path), "--out", str(out)]
    assert storage_hit.main(args) == 0
    hit = json.loads(out.read_text())["storage_hit"]
    assert hit["storage_hit_tokens"] == 64 and hit["host_hit_tokens"] == 0
    assert hit["engine_storage_read_bytes"] >= hit["fetched_bytes"] > 0
    assert hit["engine_storage_corrupt_pages"] == hit["engine_storage_truncated_pages"] == 0
    assert hit["files_dropped_from_page_cache"] >= 8  # the prefix's pages, at least
    assert hit["fetch_read_over_disk"] == pytest.approx(
        hit["fetch_read_bps"] / hit["disk_read_ceiling_bps"])
    assert len(hit["trials"]) == 2 and "prefix in storage" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [out]  # the storage and the probe's files are gone


def test_storage_hit_from_a_mooncake_store_measures_the_stores_get_rate(tmp_path) -> None:
    mooncake_or_skip()
    out = tmp_path / "mooncake.json"
    args = [*TINY, "--storage-hit-prefix", "64", "--storage-hit-turn", "8",
            "--storage-hit-trials", "1", "--storage-dir", str(tmp_path), "--out", str(out),
            "--storage-backend", "mooncake"]
    assert storage_hit.main(args) == 0
    hit = json.loads(out.read_text())["storage_hit"]
    assert hit["storage_backend"] == "mooncake" and hit["storage_hit_tokens"] == 64
    assert hit["disk_read_ceiling_bps"] == hit["store_get_bps"] > 0
    assert [t["storage_hit_compiles"] for t in hit["trials"]] == [0]


def test_storage_hit_with_the_split_policy_computes_what_it_does_not_read(tmp_path) -> None:
    out = tmp_path / "split.json"
    args = [*TINY, "--storage-hit-prefix", "64", "--storage-hit-turn", "8",
            "--storage-hit-trials", "1", "--storage-dir", str(tmp_path), "--out", str(out),
            "--fetch-policy", "split", "--storage-io-threads", "3"]
    assert storage_hit.main(args) == 0
    hit = json.loads(out.read_text())["storage_hit"]
    assert hit["fetch_policy"] == "split" and hit["device_hit_tokens"] == 0
    assert hit["storage_io_threads"] == 3
    assert 0 <= hit["storage_hit_tokens"] <= 64 and hit["storage_hit_tokens"] % 8 == 0
    # warmed up as a server is: where the compute meets the reads varies, and compiles nothing
    assert [t["storage_hit_compiles"] for t in hit["trials"]] == [0]


def test_multiturn_with_a_storage_dir_backs_pages_up_and_removes_them_after(tmp_path) -> None:
    out = tmp_path / "mt.json"
    store = tmp_path / "store"
    store.mkdir()
    assert command.main(["multiturn", *TINY, "--modes", "hierarchical", "--storage-dir",
                         str(store), "--out", str(out)]) == 0
    stats = json.loads(out.read_text())["modes"]["hierarchical"]["stats"]
    assert stats["storage_backup_pages"] > 0 and stats["storage_written_bytes"] > 0
    assert list(store.iterdir()) == []


def test_multiturn_with_a_mooncake_store_backs_pages_up_there(tmp_path) -> None:
    out, config = tmp_path / "mt.json", tmp_path / "store.json"
    with running_master(tmp_path) as master:
        config.write_text(json.dumps(master.config))
        assert command.main(["multiturn", *TINY, "--modes", "hierarchical", "--mooncake-config",
                             f"@{config}", "--out", str(out)]) == 0
    stats = json.loads(out.read_text())["modes"]["hierarchical"]["stats"]
    assert stats["storage_backup_pages"] > 0 and stats["storage_written_bytes"] > 0


def test_a_mooncake_config_that_is_not_a_json_object_is_a_clear_error(tmp_path, capsys) -> None:
    for text in ("[1]", "{", f"@{tmp_path / 'missing.json'}"):
        with pytest.raises(SystemExit):
            cli.parse_args(["multiturn", *TINY, "--mooncake-config", text])
        assert "--mooncake-config" in capsys.readouterr().err


def test_as_served_warms_up_freezes_the_heap_and_gives_the_collector_back() -> None:
    """Inside, the engine is warmed up and the process's heap frozen, as a server's start
    leaves them, young collections made rarer; after, nothing is frozen and the thresholds
    are as they were (the bench builds other engines next)."""
    import gc

    from jhicache.warmup import SERVED_YOUNG_THRESHOLD

    thresholds = gc.get_threshold()
    assert thresholds[0] != SERVED_YOUNG_THRESHOLD
    engine = engines.make_engine(cli.parse_args(["multiturn", *TINY]), cache_mode="device",
                                 device_kv_tokens=256)
    with engines.as_served(engine):
        assert engine.warmed_up and gc.get_freeze_count() > 0
        assert gc.get_threshold() == (SERVED_YOUNG_THRESHOLD, *thresholds[1:])
        assert engine.startup.warmup is not None
        # (frozen objects freed since by their counts leave the permanent generation)
        assert engine.startup.warmup.frozen_objects >= gc.get_freeze_count()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds
    with engines.as_served():  # an engine elsewhere: this process's heap alone
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] == SERVED_YOUNG_THRESHOLD
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds


def test_device_hit_beside_write_back_is_a_device_hit_while_other_is_written() -> None:
    args = bench_cli.parse("host-hit", "", [*TINY, "--host-hit-prefix", "64",
                                             "--host-hit-turn", "8"], host_hit.add_options)
    engine = engines.make_engine(args, cache_mode="hierarchical", device_kv_tokens=4 * 96,
                                 load_back_threshold=1)
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    prefix, other = workload.random_prompts(rng, vocab, 2, 64)
    turns = workload.random_prompts(rng, vocab, 3, 8)
    before = engine.stats()
    assert host_hit.device_hit_beside_write_back(engine, prefix, other, turns) > 0
    after = engine.stats()
    assert after.load_back_bytes == before.load_back_bytes  # `prefix` never left the device
    page_bytes = engine.device_pool.layout.page_bytes
    assert after.write_back_bytes - before.write_back_bytes >= 64 // 8 * page_bytes  # `other`
    assert engine.cache.match(other).device_len == 0 and engine.cache.match(prefix).host_len == 0
    engine.check_invariants()


def test_load_back_alone_brings_a_host_run_to_the_device() -> None:
    """`Engine.load_back`, the seam the host-hit bench times a load alone through."""
    args = bench_cli.parse("host-hit", "", TINY, host_hit.add_options)
    engine = engines.make_engine(args, cache_mode="hierarchical", device_kv_tokens=4 * 96,
                                 load_back_threshold=1)
    rng = np.random.default_rng(1)
    vocab = engine.model_config.vocab_size
    [prefix] = workload.random_prompts(rng, vocab, 1, 64)
    turns = workload.random_prompts(rng, vocab, 2, 8)
    assert not engine.load_back(prefix + turns[0])  # cached nowhere: nothing to load
    host_hit.ttft_of(engine, prefix + turns[0])
    host_hit.push_to_host(engine)
    request_id = engine.add_request(prefix + turns[1], SamplingParams(max_new_tokens=1))
    assert not engine.load_back(prefix + turns[1])  # a request is unfinished
    assert engine.abort(request_id)
    engine.drain()
    assert engine.load_back(prefix + turns[1])
    _, out = host_hit.ttft_of(engine, prefix + turns[1])
    assert (out.device_hit_tokens, out.host_hit_tokens) == (64, 0)
    engine.check_invariants()


def test_unknown_mode_is_a_clear_error(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["multiturn", "--modes", "off,warp"])
    assert "unknown mode" in capsys.readouterr().err


def test_a_storage_dir_that_cannot_be_made_is_a_clear_error(tmp_path, capsys) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit):
        cli.parse_args(["multiturn", *TINY, "--storage-dir", str(blocker / "store")])
    assert "cannot make this directory" in capsys.readouterr().err


def test_multiturn_saves_finished_modes_when_a_later_one_fails(tmp_path, monkeypatch) -> None:
    def only_off(args, spec, mode, progress):  # stands in for a run cut short after its first mode
        if mode != "off":
            raise KeyboardInterrupt
        return {"rounds": [], "mode": mode}

    monkeypatch.setattr(multiturn, "run_multiturn_mode", only_off)
    out = tmp_path / "partial.json"
    with pytest.raises(KeyboardInterrupt):
        command.main(["multiturn", *TINY, "--modes", "off,device", "--out", str(out)])
    assert json.loads(out.read_text())["modes"] == {"off": {"rounds": [], "mode": "off"}}


# A workload that evicts and loads back (hierarchical), so that equal hit rates mean something.
EVICTING = ["--preset", "tiny", "--clients", "3", "--rounds", "3", "--request-length", "24",
            "--output-length", "3", "--page-size", "8", "--dtype", "float32", *SMALL_GRID]


def engine_for(args, spec: MultiTurnSpec):
    return engines.make_engine(args, cache_mode="hierarchical",
                               device_kv_tokens=multiturn.device_tokens_for(args, spec))


def generate_rounds(args, spec: MultiTurnSpec) -> tuple[list[tuple[float, float]], list]:
    """The bench's path before AsyncEngine: one `Engine.generate` of all prompts per round."""
    engine, chats = engine_for(args, spec), MultiTurnChats(spec)
    rates = []
    for _ in range(spec.num_rounds):
        params = SamplingParams(max_new_tokens=spec.output_length)
        outputs = engine.generate(chats.prompts(), params)
        chats.extend([o.token_ids for o in outputs])
        prompt = sum(o.prompt_len for o in outputs)
        rates.append((sum(o.device_hit_tokens for o in outputs) / prompt,
                      sum(o.host_hit_tokens for o in outputs) / prompt))
    return rates, [tuple(h) for h in chats.histories]


class CountingAsyncEngine(AsyncEngine):
    """Records how many of its streams are open (submitted, final output not yet taken)."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.open = self.most_open = 0

    async def stream(self, prompt, params=SamplingParams(), request_id=None):
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            async for out in super().stream(prompt, params, request_id):
                yield out
        finally:
            self.open -= 1


def run_clients(argv: list[str], monkeypatch) -> tuple[clients.ClientsRun, int]:
    """multiturn.drive_clients on a fresh hierarchical engine; also the most streams open at
    once."""
    args = cli.parse_args(["multiturn", *EVICTING, *argv])
    spec = multiturn.multiturn_spec(args, 512)
    served: list[CountingAsyncEngine] = []
    monkeypatch.setattr(multiturn, "AsyncEngine",
                        lambda e: served.append(CountingAsyncEngine(e)) or served[-1])
    progress = tqdm(disable=True)
    run = asyncio.run(multiturn.drive_clients(engine_for(args, spec), spec,
                                              multiturn.clients_config(args, args.seed), progress))
    return run, served[0].most_open


def test_round_barrier_on_gives_the_old_generate_paths_hits_and_tokens(monkeypatch) -> None:
    args = cli.parse_args(["multiturn", *EVICTING])
    spec = multiturn.multiturn_spec(args, 512)
    rates, histories = generate_rounds(args, spec)
    assert any(host > 0 for _, host in rates)  # the workload does load back
    run, _ = run_clients([], monkeypatch)
    summaries = [clients.round_summary([t for t in run.turns if t.round == r])
                 for r in range(3)]
    assert [(s["device_hit_rate"], s["host_hit_rate"]) for s in summaries] == rates
    assert list(run.histories) == histories
    assert [(t.client, t.round) for t in run.turns] == [(c, r) for r in range(3) for c in range(3)]


def test_no_barrier_keeps_max_parallel_and_the_same_conversations(monkeypatch) -> None:
    args = cli.parse_args(["multiturn", *EVICTING])
    _, histories = generate_rounds(args, multiturn.multiturn_spec(args, 512))
    argv = ["--round-barrier", "off", "--request-rate", "50", "--max-parallel", "2"]
    run, most_open = run_clients(argv, monkeypatch)
    assert most_open == 2 and run.max_in_flight == 2
    assert list(run.histories) == histories
    sent = sorted((t.client, t.round) for t in run.turns)
    assert sent == [(c, r) for c in range(3) for r in range(3)]
    gaps = sorted(b.sent_s - a.sent_s for a, b in zip(run.turns, run.turns[1:]))
    assert gaps[len(gaps) // 2] > 0.002  # Poisson gaps of mean 20 ms between sends, not a burst


def test_random_ready_queue_is_reproducible_by_seed(monkeypatch) -> None:
    def order(seed: str, policy: str = "random") -> list[tuple[int, int]]:
        argv = ["--clients", "5", "--rounds", "2", "--round-barrier", "off", "--max-parallel", "1",
                "--ready-queue-policy", policy, "--seed", seed]
        run, _ = run_clients(argv, monkeypatch)
        return [(t.client, t.round) for t in run.turns]

    first = order("3")
    assert order("3") == first
    assert first != order("4") and first != order("3", "fifo")
    # fifo: an answered client queues behind those already waiting
    assert order("3", "fifo") == [(c, r) for r in range(2) for c in range(5)]


def test_compile_counter_names_what_compiled_in_its_block() -> None:
    import jax
    import jax.numpy as jnp

    def shifted_by_seven(x):
        return x + 7

    program = jax.jit(shifted_by_seven)
    three, five = jnp.ones(3), jnp.ones(5)
    program(three)  # compiled before the block: not counted
    with compile_counter.CompileCounter() as compiles:
        program(three)
        program(five)  # a new shape
    assert compiles.count == 1
    assert len(compiles.programs) == 1 and "shifted_by_seven" in compiles.programs[0]


def test_host_hit_timeline_and_the_device_wait(monkeypatch) -> None:
    from tests.test_engine import deferred_copies, make_engine

    deferred_copies(monkeypatch)  # copies land only when waited for
    engine = make_engine(page_size=4, device_kv_tokens=32, host_kv_tokens=128)
    first, other = list(range(1, 25)), list(range(100, 124))
    engine.generate([first], SamplingParams(max_new_tokens=1))
    engine.generate([other], SamplingParams(max_new_tokens=1))  # evicts `first` to host
    ttft_s, out, timeline = host_hit.traced_ttft(engine, first + [7, 7, 7, 7])
    assert out.host_hit_tokens == 24
    flags = np.asarray(jnp.copy(engine.device_pool.load_flags))
    assert (flags[:-1] >= 1).all() and flags[-1] == 0  # every layer's flag set by its load
    times = timeline["steps_returned_ms"]
    assert times[0] >= 0 and times == sorted(times) and times[-1] == timeline["first_token_ms"]
    # one clock: the add_request call comes before the arrival the TTFT counts from
    assert timeline["first_token_ms"] >= ttft_s * 1e3 > 0
    assert engine.device_pool.gate_timeouts() == 0
    assert all(p["ms"] >= 0 and p["generation"] in (0, 1, 2) for p in timeline["gc_pauses"])
    row = {**_HOST_HIT_ROW, "host_hit_timeline": timeline, "engine_load_back_s": 0.002,
           "engine_load_gated_steps": 1, "gate_timeouts": 0}
    text = tables.host_hit_table(row)
    assert "step() returned at" in text and "gate timeouts 0" in text
    assert "garbage collections" in text


def test_gc_pauses_records_each_collection_inside_the_block() -> None:
    import gc

    with host_hit.gc_pauses() as pauses:
        gc.collect(1)
        gc.collect(2)
    gc.collect()  # outside: not recorded
    assert [g for g, _, _ in pauses] == [1, 2]
    assert all(end >= start for _, start, end in pauses)


_HOST_HIT_ROW = {"prefix_tokens": 64, "turn_tokens": 8, "no_cache_ttft_s": 0.1,
                 "device_hit_ttft_s": 0.01, "host_hit_ttft_s": 0.02, "load_alone_s": 0.01,
                 "load_gbps": 1.0, "load_hidden_fraction": 0.5, "pcie_s": 0.01, "pcie_gbps": 1.0,
                 "host_hit_ratio": 2.0, "write_back_gbps": 1.0, "write_back_copy_gbps": 1.0,
                 "pcie_to_host_gbps": 1.0, "device_hit_beside_write_back_ttft_s": 0.01}


def test_the_measured_run_is_served_by_a_warmed_engine_that_compiles_nothing() -> None:
    args = cli.parse_args(["multiturn", *TINY, "--seed", "7", "--range-ratio", "0.5"])
    spec = multiturn.multiturn_spec(args, 512)
    args._device_tokens = multiturn.device_tokens_for(args, spec)  # as bench_multiturn sets it
    measured = multiturn.measured_run(args, spec, "hierarchical", tqdm(disable=True))
    summary = multiturn.measured_summary(measured, spec)
    assert summary["warmup"]["shapes"] == len(measured.engine.grid.shapes()) > 0
    assert summary["compiles_during_run"]["count"] == 0
    assert measured.engine.stats().compiles_serving == 0
    # a gap needs two outputs with tokens (a consumer that lags gets outputs merged: maybe none)
    assert 0 <= summary["max_token_gap_s"] <= max(t.e2e_s for t in measured.run.turns)
    # variable lengths: turns and answers drawn from [12, 24] and [1, 2] tokens
    prompts = [t.prompt_len for t in measured.run.turns if t.round == 0]
    assert all(12 <= n <= 24 for n in prompts) and len(set(prompts)) > 1
    assert {len(t.token_ids) for t in measured.run.turns} <= {1, 2}


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_restart_serves_the_later_rounds_from_storage(tmp_path, backend: str) -> None:
    """Half the rounds, a new engine on the same storage (directory, or Mooncake store), the
    other half: their hits come from storage, as many as without the restart, with the same
    answers. With the default write policies: the first engine's close writes what never left
    the device."""
    if backend == "mooncake":
        mooncake_or_skip()
    out, store = tmp_path / "restart.json", tmp_path / "not" / "yet"  # the bench makes it
    args = [*TINY, "--request-length", "300", "--storage-dir", str(store), "--out", str(out),
            "--storage-backend", backend]
    assert restart.main(args) == 0
    result = json.loads(out.read_text())["restart"]
    assert result["storage_backend"] == backend
    assert result["restart_round"] == 1 and result["storage_pages_at_restart"] > 0
    assert result["restarted"]["storage_hit_rate"] > 0
    assert result["straight"]["storage_hit_rate"] == 0  # its own tiers hold everything
    assert result["hit_rate_ratio"] > 0.9 and result["same_answers"]
    assert result["compiles"] == [0, 0, 0]
    assert list(store.iterdir()) == []
    row = json.loads(out.read_text())["page_rows"]["restart"]
    assert row["target"] == ">= 0.95" and row["result"].startswith(
        f"hit rate {result['restarted']['hit_rate']:.3f} after the restart")
    assert row["met"] == ("yes" if result["hit_rate_ratio"] >= 0.95 else "no")


def test_multiturn_with_logprobs_asks_them_of_every_request(tmp_path) -> None:
    out = tmp_path / "lp.json"
    assert command.main(["multiturn", *TINY, "--modes", "hierarchical", "--logprobs", "2",
                         "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["spec"]["logprobs"] == 2
    result = run["modes"]["hierarchical"]
    assert result["compiles_during_run"]["count"] == 0
    with pytest.raises(SystemExit):
        command.main(["multiturn", *TINY, "--logprobs", "21"])


@pytest.mark.parametrize("server", ["process", "thread"])
def test_scoring_times_a_scored_prompt_against_its_prefill(tmp_path, server: str) -> None:
    out = tmp_path / "scoring.json"
    assert scoring.main([*TINY, "--scoring-prompt", "100", "--scoring-trials", "2",
                         "--scoring-server", server, "--out", str(out)]) == 0
    result = json.loads(out.read_text())["scoring"]
    assert result["server"] == server
    assert len(result["trials"]) == 2 and result["prompt_tokens"] == 100
    assert all(t["compiles"] == 0 for t in result["trials"])
    assert result["scored_over_prefill"] == pytest.approx(
        result["scored_ttft_s"] / result["prefill_ttft_s"])
    assert result["scored_over_prefill_e2e"] == pytest.approx(
        result["scored_e2e_s"] / result["prefill_e2e_s"])
    for t in result["trials"]:  # the generate call holds the engine's TTFT
        assert t["prefill_e2e_s"] >= t["prefill_ttft_s"] and t["scored_e2e_s"] >= t["scored_ttft_s"]
    http = result["http"]  # through the server, the scored body checked by the bench itself
    assert len(http["trials"]) == 2 and all(t["compiles"] == 0 for t in http["trials"])
    assert http["scored_over_prefill"] == pytest.approx(
        http["scored_e2e_s"] / http["prefill_e2e_s"])


def test_turn_params_seed_each_sampled_turn_by_its_place() -> None:
    spec = MultiTurnSpec(num_clients=3, num_rounds=2, output_length=5)
    greedy = multiturn.turn_params(spec)
    assert all(p.is_greedy and p.seed is None and p.top_p is None for row in greedy for p in row)
    sampled = multiturn.turn_params(spec, multiturn.TurnSampling(0.8, 0.9, logprobs=2))
    flat = [p for row in sampled for p in row]
    assert [p.seed for p in flat] == list(range(6))  # [round][client]: round * clients + client
    assert {(p.temperature, p.top_p, p.logprobs, p.max_new_tokens) for p in flat} == {
        (0.8, 0.9, 2, 5)}


def test_penalties_reach_every_turn_and_the_remote_body() -> None:
    """--presence-penalty, --frequency-penalty and --repetition-penalty: every turn's params
    carry them, the HTTP body names them as SGLang does, and the report says so."""
    args = cli.parse_args(["multiturn", "--presence-penalty", "0.5", "--frequency-penalty",
                           "-0.25", "--repetition-penalty", "1.1"])
    sampling = multiturn.turn_sampling(args)
    flat = [p for row in multiturn.turn_params(MultiTurnSpec(num_clients=2, num_rounds=2),
                                               sampling) for p in row]
    assert {(p.presence_penalty, p.frequency_penalty, p.repetition_penalty) for p in flat} == {
        (0.5, -0.25, 1.1)}
    body = json.loads(remote.generate_body([1, 2], flat[0]))["sampling_params"]
    assert (body["presence_penalty"], body["frequency_penalty"],
            body["repetition_penalty"]) == (0.5, -0.25, 1.1)
    plain = json.loads(remote.generate_body([1, 2], multiturn.turn_params(
        MultiTurnSpec(num_clients=1, num_rounds=1))[0][0]))["sampling_params"]
    assert not {"presence_penalty", "frequency_penalty", "repetition_penalty"} & set(plain)


@pytest.mark.parametrize("store", ["unused", "unreachable"])
def test_store_cost_runs_with_the_store_against_no_storage_tier(tmp_path, store: str) -> None:
    """The runs with the store write every turn to it (unused) or fail every write (its master
    gone once the engine is warm), neither hits it; the runs without a tier write nothing; the
    row compares them."""
    mooncake_or_skip()
    out = tmp_path / "store_cost.json"
    args = [*TINY, "--write-policy", "write_through", "--store", store, "--pairs", "1",
            "--out", str(out)]
    assert store_cost.main(args) == 0
    data = json.loads(out.read_text())
    result = data["store_cost"]
    (with_store,), (plain,) = result["runs"]["store"], result["runs"]["no_storage"]
    stats = with_store["stats"]
    assert stats["storage_hit_tokens"] == 0
    if store == "unused":
        assert stats["storage_backup_pages"] > 0 and stats["storage_write_failures_io"] == 0
    else:
        assert stats["storage_backup_pages"] == 0 and stats["storage_write_failures_io"] > 0
    assert plain["stats"]["storage_backup_pages"] == 0
    assert plain["stats"]["storage_write_failures_io"] == 0
    assert with_store["compiles_during_run"]["count"] == 0
    assert plain["compiles_during_run"]["count"] == 0
    ratio = with_store["throughput_tokens_per_s"] / plain["throughput_tokens_per_s"]
    assert result["store"] == store and result["ratios"] == [ratio]
    row = data["page_rows"]["store_cost"]
    assert row["target"] == ">= 0.98 (within 2%)"
    assert row["result"].startswith(f"the store {store}: ")
    assert row["met"] == ("yes" if ratio >= 0.98 else "no")
