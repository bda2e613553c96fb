"""load_pretrained on damaged checkpoint files: each is a ValueError naming the file (and the
tensor), raised from the parser's own error, never a bare SafetensorError, KeyError or
AttributeError."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jhicache.models import load_pretrained
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from tests.models.numpy_reference import random_hf_weights, small_hf_config, write_hf_checkpoint

INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
EMBED = "model.embed_tokens.weight"


def _sharded(directory: Path, seed: int = 0) -> Path:
    """A two-shard HF checkpoint of fresh random weights: embeddings in shard 1, the rest in 2."""
    cfg = small_hf_config()
    weights = random_hf_weights(cfg, seed=seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    first = {EMBED: weights.pop(EMBED)}
    save_file(first, str(directory / SHARDS[0]))
    save_file(weights, str(directory / SHARDS[1]))
    weight_map = {**{n: SHARDS[0] for n in first}, **{n: SHARDS[1] for n in weights}}
    (directory / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def _raises_naming(error: type[Exception], *parts: str | Path) -> Any:
    return pytest.raises(error, match=".*".join(re.escape(str(p)) for p in parts))


def test_sharded_fixture_loads(tmp_path: Path):
    model = load_pretrained(_sharded(tmp_path))
    assert model.config.num_hidden_layers == 2


@pytest.mark.parametrize("text", ["{not json", "", "\x00\xff binary"])
def test_config_json_not_json_names_the_file(tmp_path: Path, text: str):
    ckpt = _sharded(tmp_path)
    (ckpt / "config.json").write_bytes(text.encode("latin-1"))
    with _raises_naming(ValueError, ckpt / "config.json", "not valid JSON"):
        load_pretrained(ckpt)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda cfg: [cfg], "JSON object"),  # was AttributeError
        # was ZeroDivisionError
        (lambda cfg: {**cfg, "num_key_value_heads": 0}, "num_key_value_heads"),
        (lambda cfg: {**cfg, "hidden_size": "64"}, "hidden_size"),  # was TypeError
        # dataclass
        (lambda cfg: {k: v for k, v in cfg.items() if k != "hidden_size"}, "hidden_size"),
        (lambda cfg: {**cfg, "layer_types": ["full_attention", "sliding_attention"]},
         "layer_types"),
        (lambda cfg: {**cfg, "head_dim": 15}, "head_dim"),
    ],
)
def test_bad_config_json_names_file_and_field(tmp_path: Path, mutate: Any, field: str):
    ckpt = _sharded(tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(mutate(cfg)))
    with _raises_naming(ValueError, ckpt / "config.json", field):
        load_pretrained(ckpt)


@pytest.mark.parametrize(
    "index",
    [
        "{truncated",  # not JSON
        json.dumps([]),  # not an object
        json.dumps({"metadata": {}}),  # was a bare KeyError
        json.dumps({"weight_map": [SHARDS[0]]}),
        json.dumps({"weight_map": {EMBED: 1}}),
        json.dumps({"weight_map": {EMBED: ""}}),
    ],
)
def test_bad_index_names_the_index_file(tmp_path: Path, index: str):
    ckpt = _sharded(tmp_path)
    (ckpt / INDEX).write_text(index)
    with _raises_naming(ValueError, ckpt / INDEX):
        load_pretrained(ckpt)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _garbage(path: Path) -> None:
    path.write_bytes(np.random.default_rng(3).bytes(path.stat().st_size))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [_truncate, _garbage, _empty],
                         ids=["truncated", "garbage", "empty"])
@pytest.mark.parametrize("shard", SHARDS)
def test_unreadable_shard_names_the_file(tmp_path: Path, damage: Any, shard: str):
    ckpt = _sharded(tmp_path)
    damage(ckpt / shard)
    with _raises_naming(ValueError, ckpt / shard) as info:
        load_pretrained(ckpt)
    assert isinstance(info.value.__cause__, SafetensorError)


@pytest.mark.parametrize("damage", [_truncate, _garbage], ids=["truncated", "garbage"])
def test_unreadable_single_file_names_it(tmp_path: Path, damage: Any):
    cfg = small_hf_config()
    ckpt = write_hf_checkpoint(tmp_path, cfg, random_hf_weights(cfg, seed=4))
    damage(ckpt / "model.safetensors")
    with _raises_naming(ValueError, ckpt / "model.safetensors") as info:
        load_pretrained(ckpt)
    assert isinstance(info.value.__cause__, SafetensorError)


def test_tensor_listed_in_index_but_absent_from_its_shard(tmp_path: Path):
    ckpt = _sharded(tmp_path)
    save_file({"unrelated": np.random.default_rng(5).standard_normal(3).astype(np.float32)},
              str(ckpt / SHARDS[0]))  # the index still says the embeddings are here
    with _raises_naming(ValueError, EMBED, ckpt / SHARDS[0]):
        load_pretrained(ckpt)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
def test_non_float_tensor_names_tensor_file_and_dtype(tmp_path: Path, dtype: type):
    """Right shape, wrong kind: casting integers to weights used to load silently."""
    ckpt = _sharded(tmp_path)
    embed = load_file(str(ckpt / SHARDS[0]))[EMBED]
    save_file({EMBED: (embed * 100).astype(dtype)}, str(ckpt / SHARDS[0]))
    with _raises_naming(ValueError, EMBED, ckpt / SHARDS[0], "dtype"):
        load_pretrained(ckpt)


def test_wrong_shape_names_tensor_and_full_path(tmp_path: Path):
    ckpt = _sharded(tmp_path)
    embed = load_file(str(ckpt / SHARDS[0]))[EMBED]
    save_file({EMBED: embed[:, :-1].copy()}, str(ckpt / SHARDS[0]))
    with _raises_naming(ValueError, EMBED, ckpt / SHARDS[0], "shape"):
        load_pretrained(ckpt)


def test_missing_shard_names_it(tmp_path: Path):
    ckpt = _sharded(tmp_path)
    (ckpt / SHARDS[1]).unlink()
    with _raises_naming(FileNotFoundError, ckpt / SHARDS[1], ckpt / INDEX):
        load_pretrained(ckpt)
