"""Kernel tuning: the SM count read from the device, the split-K policy's limits, and from how
many new tokens extend attention hands their causal part to cuDNN."""

from __future__ import annotations

import dataclasses
import functools

import jax

# When the device reports no SM count (CPU, interpret mode) the policy assumes an H200, the GPU it
# was tuned on, so split choices off-GPU (the tests) match the H200's.
FALLBACK_SMS = 132


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    """SM count of the GPU and how the split-K policies (extend attention's, and the skinny
    matmul's, which aims for `target_programs` too) size their grids by it."""

    num_sms: int
    # Split programs the grid aims for per SM: two resident programs let one's loads and softmax
    # overlap the other's dots; the split count is rounded down, so the grid never spills a few
    # programs into an extra wave.
    programs_per_sm: int = 2
    # key blocks per split at least: finer splits lost to coarser ones on the GPU at both Qwen2
    # shapes (the split-K sweep in benchmarks/LOG.md, 2026-11-30)
    min_split_blocks: int = 8
    # float32 partial accumulators [splits, T * H, D] at most: written once and read once, they
    # would cost more HBM traffic than the keys of a chunk that fills the GPU anyway
    max_partial_bytes: int = 64 << 20
    # Extend batches of at least this many token rows compute their new tokens' attention among
    # themselves apart, on cuDNN where the GPU has it (`fresh_attention`): its kernel beat ours
    # on fresh prompts of 4 x 2048 and 1 x 8192 tokens (BENCHMARKS.md, the kernel targets),
    # while a short turn would pay one more launch per layer for a few rows. The crossover
    # itself is not measured: 1024 is a guess between the two
    fresh_apart_tokens: int = 1024

    def __post_init__(self) -> None:
        if min(self.num_sms, self.programs_per_sm, self.min_split_blocks,
               self.max_partial_bytes, self.fresh_apart_tokens) < 1:
            raise ValueError(f"every field must be >= 1, got {self}")

    @property
    def target_programs(self) -> int:
        """Programs a split grid aims for: programs_per_sm on every SM."""
        return self.num_sms * self.programs_per_sm

    @classmethod
    def for_device(cls, device: jax.Device) -> KernelTuning:
        """Tuning for `device`: its SM count (CUDA devices' `core_count`), else FALLBACK_SMS."""
        sms = getattr(device, "core_count", None)
        return cls(num_sms=sms if isinstance(sms, int) and sms > 0 else FALLBACK_SMS)


@functools.cache
def default_tuning() -> KernelTuning:
    """Tuning for the default device (jax.devices()[0]), read once: the device does not change."""
    return KernelTuning.for_device(jax.devices()[0])
