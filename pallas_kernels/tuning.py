"""Kernel tuning read from the device: the SM count that the split-K policy sizes its grid by."""

from __future__ import annotations

import dataclasses
import functools

import jax

# When the device reports no SM count (CPU, interpret mode) the policy assumes an H200, the GPU it
# was tuned on, so split choices off-GPU (the tests) match the H200's.
FALLBACK_SMS = 132


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    """SM count of the GPU and how many programs per SM the split-K policy aims for."""

    num_sms: int
    programs_per_sm: int = 4  # a few programs per SM hide load latency

    def __post_init__(self) -> None:
        if self.num_sms < 1 or self.programs_per_sm < 1:
            raise ValueError(f"need num_sms >= 1 and programs_per_sm >= 1, got {self}")

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
