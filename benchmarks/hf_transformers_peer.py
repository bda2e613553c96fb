"""The peer for the no-cache prefill: HF transformers' forward of the preset's family (Qwen2,
Qwen3, Llama 3; SDPA attention, random bf16 weights of the preset's shape) over one prompt, on
the same GPU.

    python3 benchmarks/hf_transformers_peer.py --preset qwen2-7b --tokens 8192 --out F.json

Times `model(ids, logits_to_keep=1, use_cache=False)` with CUDA events, median of 3 after 2
warm-up calls: the prompt's forward alone, no tokenizer, no sampling. Needs torch and
transformers (the GPU machine has both; the package does not depend on them).
"""

from __future__ import annotations

import argparse
import json

import torch
from jhicache.models import PRESETS, preset_config
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig


def hf_config(preset: str) -> PretrainedConfig:
    """transformers' config of the preset's shape and family, from our config.json writer (JAX
    is imported but starts no backend: torch has the GPU to itself)."""
    d = preset_config(preset).to_hf_dict()
    d.pop("architectures", None)
    return AutoConfig.for_model(d.pop("model_type"), **d, torch_dtype="bfloat16")


def median_ms(fn, reps: int = 3, warm: int = 2) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2-7b", choices=sorted(PRESETS))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out")
    args = parser.parse_args()
    config = hf_config(args.preset)
    config._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config).eval()
    torch.set_default_dtype(torch.float32)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), device="cuda")
    with torch.no_grad():
        ms = median_ms(lambda: model(ids, logits_to_keep=1, use_cache=False))
    res = {"preset": args.preset, "tokens": args.tokens, "prefill_ms": ms,
           "torch": torch.__version__, "device": torch.cuda.get_device_name()}
    print(f"HF transformers {args.preset} prefill of {args.tokens} tokens: {ms:.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
