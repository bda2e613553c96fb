"""The server's text side without a server: the incremental detokenizer (multi-byte characters
split over tokens), stop strings, the tokenizer's chat template and EOS ids, and the CLI flags."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

# The serve extra (`pip install -e '.[test,serve]'`, as `make test` does); the GPU machine's
# preinstalled packages may lack it: skip these tests there rather than fail collection.
for _module in ("fastapi", "uvicorn", "tokenizers", "jinja2"):
    pytest.importorskip(_module)


from jhicache import EngineConfig
from jhicache.config import TransferTuning
from jhicache.serve import cli
from jhicache.serve.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from jhicache.serve.long_texts import LONG_TEXT_CHARS, TokenCountError
from jhicache.serve.stop_strings import StopStrings
from jhicache.serve.tokenizer import ChatTemplateError, Tokenizer
from tests.serve_support import train_tokenizer

MULTI_BYTE = "naïve 日本語 🙂 cafe 😀😀 héllo"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory: Path = tmp_path_factory.mktemp("tok")
    train_tokenizer(directory)
    return Tokenizer.from_dir(directory)


def test_multi_byte_characters_split_over_tokens(tokenizer: Tokenizer):
    ids = tokenizer.encode(MULTI_BYTE)
    # the test means something only if single tokens are partial characters
    assert sum(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids) >= 6
    detok = IncrementalDetokenizer(tokenizer.decode)
    deltas = [detok.push([i]) for i in ids]
    deltas.append(detok.finish())
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == detok.text == MULTI_BYTE
    assert sum(1 for d in deltas if d) < len(ids)  # some tokens were held back


def test_token_text_is_each_tokens_own_decoding_special_tokens_kept(tokenizer: Tokenizer):
    """Every id's text, asked twice (the second from what the first kept), is its decoding
    alone with special tokens kept, as log probabilities name tokens."""
    ids = list(range(tokenizer.vocab_size))
    first = [tokenizer.token_text(i) for i in ids]
    assert [tokenizer.token_text(i) for i in reversed(ids)] == first[::-1]
    assert first == [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert "<|im_end|>" in first and "" not in first
    decoded_at_once = Tokenizer.from_dir(tokenizer.path)  # as a server keeps them at its start
    decoded_at_once.decode_vocabulary()
    assert [decoded_at_once.token_text(i) for i in ids] == first
    # in one call, in any order, with an id past the tokenizer's (a model's padding row,
    # which an alternative may name): before the vocabulary is decoded and after
    past = tokenizer.vocab_size + 3
    shuffled = [*random.Random(0).sample(ids, len(ids)), past]
    expected = [first[i] for i in shuffled[:-1]] + [tokenizer.decode([past], False)]
    assert Tokenizer.from_dir(tokenizer.path).token_texts(shuffled) == expected
    assert decoded_at_once.token_texts(shuffled) == expected
    assert decoded_at_once.token_texts(shuffled[:-1]) == expected[:-1]

def test_detokenizer_after_a_prompt_and_in_chunks(tokenizer: Tokenizer):
    prompt = tokenizer.encode("hello world 日")
    out = tokenizer.encode(" 本 the lazy dog 🙂!")
    detok = IncrementalDetokenizer(tokenizer.decode, prompt)
    text = detok.push(out[:3]) + detok.push(out[3:7]) + detok.push(out[7:]) + detok.finish()
    assert text == tokenizer.decode(out) == " 本 the lazy dog 🙂!"


def test_detokenizer_releases_an_incomplete_character_at_the_end(tokenizer: Tokenizer):
    ids = tokenizer.encode("ok 🙂")[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tokenizer.decode)
    held = detok.push(ids)
    assert REPLACEMENT_CHAR not in held
    assert detok.finish().endswith(REPLACEMENT_CHAR)
    assert detok.text == tokenizer.decode(ids)


def test_stop_strings_find_and_hold_back():
    stops = StopStrings(["END", "", "xy"])
    assert stops.stops == ("END", "xy") and stops.hold == 2
    assert stops.find("abc EN", 0) is None
    assert stops.find("abc END and xy", 6) == (4, "END")  # starts before the searched part
    assert stops.find("a xy END", 0) == (2, "xy")  # the earliest wins
    assert stops.streamable(6) == 4 and stops.streamable(1) == 0
    assert StopStrings().hold == 0 and StopStrings().streamable(5) == 5


def test_chat_template_and_eos(tokenizer: Tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]
    assert tokenizer.eos_token_ids == tuple(tokenizer.encode("<|im_end|>",
                                                             add_special_tokens=False))


def test_a_long_text_is_tokenized_in_a_process_of_its_own_to_the_same_ids(tmp_path: Path):
    backend = train_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_dir(tmp_path)
    text = "hello world, naïve cafe tea 🙂 " * (LONG_TEXT_CHARS // 20)
    assert len(text) > LONG_TEXT_CHARS
    want = backend.encode(text).ids
    try:
        assert tokenizer.encode(text) == want
        with pytest.raises(TokenCountError) as over:
            tokenizer.encode(text, limit=len(want) - 1)
        assert over.value.tokens == len(want)
        assert tokenizer.encode(text, limit=len(want)) == want
        short = "hello world"  # tokenized here, the limit as for a long one
        assert tokenizer.encode(short) == backend.encode(short).ids
        with pytest.raises(TokenCountError):
            tokenizer.encode(short, limit=1)
    finally:
        tokenizer.close()


def test_chat_template_raise_exception(tmp_path: Path):
    train_tokenizer(tmp_path)
    config = (tmp_path / "tokenizer_config.json")
    config.write_text('{"chat_template": "{{ raise_exception(\\"no system role\\") }}"}')
    with pytest.raises(ChatTemplateError, match="no system role"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "system", "content": "x"}])
    config.write_text("{}")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_engine_flags_mirror_engine_config():
    parser = cli.build_parser()
    args = parser.parse_args(["--preset", "tiny", "--page-size", "16", "--device-kv-tokens", "256",
                              "--cache-mode", "device", "--no-overlap-schedule",
                              "--host-to-device-ratio", "2.5",
                              "--transfer-tuning-load-head-bytes", "4096"])
    config = cli.engine_config(args)
    assert config == EngineConfig(page_size=16, device_kv_tokens=256, cache_mode="device",
                                  overlap_schedule=False, host_to_device_ratio=2.5,
                                  transfer_tuning=TransferTuning(load_head_bytes=4096))
    assert cli.engine_config(parser.parse_args(["--preset", "tiny"])) == EngineConfig()
    help_text = parser.format_help()
    for flag, words in [("--write-policy", "write_through_selective"),
                        ("--max-running-requests", "requests decoded together"),
                        ("--tensor-parallel-size", "devices the model is sharded over")]:
        assert flag in help_text and words in " ".join(help_text.split())
    with pytest.raises(SystemExit):
        parser.parse_args(["--preset", "tiny", "--cache-mode", "sometimes"])


def test_the_storage_backend_config_is_read_from_a_file_after_an_at(tmp_path):
    parser = cli.build_parser()
    config_file = tmp_path / "store.json"
    config_file.write_text('{"protocol": "tcp"}')
    flags = ["--preset", "tiny", "--storage-backend", "mooncake", "--storage-backend-config"]
    config = cli.engine_config(parser.parse_args([*flags, f"@{config_file}"]))
    assert json.loads(config.storage_backend_config or "") == {"protocol": "tcp"}
    with pytest.raises(ValueError, match=r"--storage-backend-config @.*missing\.json"):
        cli.engine_config(parser.parse_args([*flags, f"@{tmp_path / 'missing.json'}"]))


@pytest.mark.parametrize(("flags", "named"), [
    (["--max-request-bytes", "0"], "argument --max-request-bytes: '0'"),
    (["--shutdown-timeout", "-1"], "argument --shutdown-timeout: '-1'"),
    (["--shutdown-timeout", "nan"], "argument --shutdown-timeout: 'nan'"),
    (["--port", "70000"], "argument --port: '70000'"),
    (["--seed", "-3"], "argument --seed: '-3'"),
    (["--page-size", "0"], "--page-size=0: expected an int >= 1"),
    (["--page-size", "16", "--device-kv-tokens", "100"],
     "--device-kv-tokens=100 is not a multiple of --page-size=16"),
    (["--host-to-device-ratio", "nan"], "--host-to-device-ratio=nan"),
    (["--transfer-tuning-load-head-bytes", "0"], "--transfer-tuning-load-head-bytes=0"),
    (["--storage-capacity-bytes", "1000"], "--storage-capacity-bytes: it sets the storage "
                                           "tier, which is off without --storage-dir"),
    (["--fetch-policy", "split", "--storage-io-threads", "2"],
     "--fetch-policy, --storage-io-threads: they set the storage tier"),
])
def test_bad_flags_are_refused_as_parsed_naming_the_flag(capsys: pytest.CaptureFixture[str],
                                                         flags: list[str], named: str):
    with pytest.raises(SystemExit) as exited:
        cli.parse_args(["--preset", "tiny", *flags])
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_storage_flags_with_a_storage_dir_are_taken(tmp_path: Path):
    args, config = cli.parse_args(["--preset", "tiny", "--storage-dir", str(tmp_path),
                                   "--storage-capacity-bytes", "1000", "--fetch-threshold", "0"])
    assert (config.storage_dir, config.storage_capacity_bytes) == (str(tmp_path), 1000)
    assert config.fetch_threshold == 0 and args.shutdown_timeout == 30.0


def test_help_lists_every_preset_and_the_readme_too():
    from jhicache.models.presets import PRESETS

    assert set(cli.PRESET_NAMES) == set(PRESETS)
    # whitespace dropped: argparse may wrap a name at its hyphen
    help_text = "".join(cli.build_parser().format_help().split())
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for name in PRESETS:
        assert name in help_text and f"`{name}`" in readme
