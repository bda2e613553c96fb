"""Tensor parallelism: config checks here; the multi-device checks (tests/tensor_parallel_checks.py)
in subprocesses with 4 CPU devices, a group of checks each, since XLA_FLAGS must be set before
JAX starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from jhicache.models import preset_config
from jhicache.models.sharding import TensorParallel

from jhicache import EngineConfig
from tests.tensor_parallel_checks import CHECKS, DEVICES, GROUPS

ROOT = Path(__file__).resolve().parent.parent


def _run_check(*names: str) -> subprocess.CompletedProcess:
    """Runs checks, or groups of them, in a subprocess with 4 CPU devices."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", "tests.tensor_parallel_checks", *names],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_the_groups_hold_every_check_once() -> None:
    grouped = [name for names in GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(CHECKS)


@pytest.mark.slow
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_on_four_cpu_devices(group: str) -> None:
    result = _run_check(group)
    assert result.returncode == 0, f"{group}:\n{result.stdout}\n{result.stderr[-8000:]}"
    for name in GROUPS[group]:
        assert f"check {name}: passed" in result.stdout


def test_the_checks_fail_when_they_should() -> None:
    """The subprocess reports a failing check, and goes on with the next (so a passing one
    means something, and one failure hides no other)."""
    result = _run_check("no_such_check", "bad_sizes_rejected")
    assert result.returncode != 0 and "KeyError" in result.stderr
    assert "failed checks: no_such_check" in result.stderr
    assert "check bad_sizes_rejected: passed" in result.stdout


def test_config_field_is_checked() -> None:
    assert EngineConfig().tensor_parallel_size == 1
    assert EngineConfig(tensor_parallel_size=2, cache_mode="device").tensor_parallel_size == 2
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            EngineConfig(tensor_parallel_size=bad, cache_mode="off")


def test_host_tier_under_tp_is_accepted() -> None:
    """The host tier is sharded like the device pool: hierarchical works at any valid tp."""
    assert EngineConfig(tensor_parallel_size=2).cache_mode.value == "hierarchical"
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0, cache_mode="hierarchical")


def test_misfit_sizes_are_refused_before_a_mesh_is_built() -> None:
    config = preset_config("qwen2-7b")  # 28 heads, 4 KV heads
    devices = [object()] * 8  # only counted: the sizes below are refused before a mesh is built
    for size, reason in ((8, "num_attention_heads"), (3, "device count")):
        with pytest.raises(ValueError, match=reason):
            TensorParallel.create(size, config, devices=devices)
    layout = TensorParallel.create(1, config)
    assert (layout.kv_replicas, layout.storage_kv_heads) == (1, 4)


def test_tiny_tp_preset_splits_four_ways_without_replication() -> None:
    small = preset_config("tiny-tp")
    assert small.num_key_value_heads % 4 == 0 and small.num_attention_heads % 4 == 0
    assert small.vocab_size % 4 == 0 and small.intermediate_size % 4 == 0
