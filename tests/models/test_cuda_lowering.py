"""The engine's forward programs lower for CUDA from the CPU (the Pallas kernels to Triton IR,
the rest to XLA's GPU ops): a check no interpreter test makes, for each family at a tiny shape,
on an extend batch and a decode batch, as the engine plans them."""

from __future__ import annotations

import importlib
import pkgutil

import jax
import jhicache.pallas_kernels as kernels
import numpy as np
import pytest
from jhicache.pallas_kernels import backend

from jhicache import Engine, EngineConfig, SamplingParams
from jhicache.batch import model_inputs


def _as_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kernel module lowers its calls as on a GPU (no interpreter). JAX's caches are
    cleared first: a kernel's jitted wrapper traced before (interpreted) would be reused."""
    jax.clear_caches()
    original = backend.use_interpreter
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        if getattr(module, "use_interpreter", None) is original:
            monkeypatch.setattr(module, "use_interpreter", lambda: False)


def _lowered_text(engine: Engine, decode: bool) -> str:
    """The step the scheduler plans next (decode or extend, as asked), its programs lowered for
    CUDA, as one text."""
    batch = engine.scheduler.schedule()
    assert batch is not None and batch.is_decode == decode
    inputs = model_inputs(batch, engine.grid, engine.load_flags)
    programs, pool = engine.runner.programs, engine.device_pool
    k, v = tuple(pool.k), tuple(pool.v)
    first = programs.lower_first(k, v, inputs.tokens, inputs.meta, platforms=("cuda",))
    hidden = first.out_info[0]
    rest = programs.lower_rest(k, v, jax.ShapeDtypeStruct(hidden.shape, hidden.dtype),
                               inputs.meta, inputs.last_index, platforms=("cuda",))
    return "\n".join(low.as_text() for low in (first, *rest))


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3", "tiny-llama3"])
def test_forward_programs_lower_for_cuda(preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine.from_preset(preset, EngineConfig(
        cache_mode="device", device_kv_tokens=4096, page_size=64, dtype="bfloat16",
        max_running_requests=4))
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    for length in (130, 7):
        engine.add_request(rng.integers(0, vocab, length).tolist(),
                           SamplingParams(max_new_tokens=4))
    with monkeypatch.context() as patched:
        _as_on_a_gpu(patched)
        extend = _lowered_text(engine, decode=False)
    jax.clear_caches()  # nor may the engine's own steps reuse what was traced for CUDA
    assert extend.count("triton") >= engine.model_config.num_hidden_layers
    while any(r.num_generated < 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # the prompts computed here, in the interpreter
    with monkeypatch.context() as patched:
        _as_on_a_gpu(patched)
        decode = _lowered_text(engine, decode=True)
    jax.clear_caches()
    assert decode.count("triton") >= engine.model_config.num_hidden_layers
