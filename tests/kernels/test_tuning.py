"""KernelTuning: the SM count read from the device, the H200 fallback, and its use by the split
policy."""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import pytest
from jhicache.pallas_kernels.extend_attention import choose_extend_splits
from jhicache.pallas_kernels.tuning import FALLBACK_SMS, KernelTuning, default_tuning


def test_reads_core_count_and_falls_back_without_one() -> None:
    assert KernelTuning.for_device(types.SimpleNamespace(core_count=78)).num_sms == 78
    for device in (types.SimpleNamespace(), types.SimpleNamespace(core_count=None),
                   types.SimpleNamespace(core_count=0)):
        assert KernelTuning.for_device(device).num_sms == FALLBACK_SMS == 132


def test_default_tuning_is_cached_and_frozen() -> None:
    tuning = default_tuning()
    assert tuning is default_tuning()
    assert tuning.target_programs == tuning.num_sms * tuning.programs_per_sm
    with pytest.raises(dataclasses.FrozenInstanceError):
        tuning.num_sms = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="num_sms"):
        KernelTuning(num_sms=0)


def test_cpu_uses_the_h200_fallback() -> None:
    """The interpreter's CPU device has no SM count: split choices off-GPU stay the H200's."""
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU reports its own SM count")
    assert default_tuning() == KernelTuning(num_sms=FALLBACK_SMS)


@pytest.mark.gpu
def test_gpu_reads_its_sm_count() -> None:
    assert default_tuning().num_sms == jax.devices()[0].core_count


def test_split_policy_follows_the_sm_count() -> None:
    """Qwen2-0.5B, 64 new tokens over 8k keys: 8 live programs. 132 SMs: split to 2 per SM (capped
    at 16 by the keys); 8 SMs are already filled, so no split; 16 SMs at 2 per SM: 32 programs, 4
    splits."""
    choose = functools.partial(choose_extend_splits, 64, 1, 8256, 14, 2, 64, block_q=128,
                               block_k=64)
    assert choose() == choose(tuning=KernelTuning(num_sms=132)) == 16
    assert choose(tuning=KernelTuning(num_sms=8)) == 1
    assert choose(tuning=KernelTuning(num_sms=16)) == 4


def test_split_policy_keeps_its_limits() -> None:
    """The same shape: fewer keys per split allowed -> more splits (up to the grid's aim); a
    smaller partials budget -> fewer."""
    choose = functools.partial(choose_extend_splits, 64, 1, 8256, 14, 2, 64, block_q=128,
                               block_k=64)
    assert choose(tuning=KernelTuning(num_sms=132, min_split_blocks=4)) == 32  # keys allow 32
    # 64 tokens x 14 heads x (64 dims + 1 log-sum-exp) x 4 bytes = 227.5 KiB of partials a split
    assert choose(tuning=KernelTuning(num_sms=132, max_partial_bytes=4 * 232960)) == 4
    with pytest.raises(ValueError):
        KernelTuning(num_sms=132, min_split_blocks=0)
