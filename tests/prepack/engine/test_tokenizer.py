"""Tests for prepack.engine.tokenizer: the offline Qwen2 build, loading rules, BAGEL token ids, fingerprints."""

from __future__ import annotations

import json
import random
import shutil
import socket
import unicodedata
from pathlib import Path

import pytest

from prepack.engine import tokenizer as tk

QWEN2_ADDED_IDS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647, "<|box_start|>": 151648, "<|box_end|>": 151649, "<|quad_start|>": 151650,
    "<|quad_end|>": 151651, "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<tool_call>": 151657, "</tool_call>": 151658,
    "<|fim_prefix|>": 151659, "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663, "<|file_sep|>": 151664,
}
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>"}

SAMPLES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 9:41 and we'll see; they'd've ARE'NT I'M.",
    "你好，世界！这是一个测试句子。日本語のテキスト、カタカナとひらがな。한국어 문장도 있습니다.",
    "Numbers: 0 12 345 6789 3.14159 -42 1e-10 1,000,000 ٣٤٥ ½",
    "Emoji 😀🎉 family 👨‍👩‍👧‍👦 flags 🇺🇸🇯🇵 skin 👍🏽",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\t\tmore\ttabs",
    "line one\nline two\n\n\nafter blank lines\r\nwindows\rold mac",
    "\n\n\n",
    " ",
    "",
    "    def f(x):\n        return x ** 2  # comment\n",
    "ñandú café naïve Ελληνικά русский язык العربية हिन्दी ไทย",
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
    "URL https://example.com/path?q=1&r=2#frag and e-mail a.b@c.de",
    "MixedCASE camelCaseWords snake_case_words SCREAMING_CASE",
    "Punctuation!!! ??? ... --- ___ *** ((())) [[]] {{}}",
    "a" * 300,
    " ".join(["word"] * 120),
]


def _random_texts(count: int, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    alphabet = [chr(c) for c in range(32, 127)]
    alphabet += [chr(c) for c in range(0xA0, 0x250)]
    alphabet += [chr(c) for c in range(0x4E00, 0x4E60)]
    alphabet += ["\u3000", "\u2028", "\x85", "\u200d", "\u0301", "😀", "🎉", "€"]
    alphabet += ["\n", "\r", "\t", " "] * 25
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(count)]


@pytest.fixture(scope="session")
def qwen_cache(tmp_path_factory):
    """Build qwen2-offline once per session in a private cache."""
    root = tmp_path_factory.mktemp("bagel-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(tk.CACHE_ENV, str(root))
        built = tk.qwen2_offline_dir()
        yield built


@pytest.fixture
def qwen(qwen_cache, monkeypatch):
    monkeypatch.setenv(tk.CACHE_ENV, str(qwen_cache.parent))
    return tk.load_tokenizer(tk.QWEN2_OFFLINE)


@pytest.fixture(scope="session")
def ranks():
    return tk.load_tiktoken_ranks(tk.qwen_tiktoken_path())


@pytest.fixture(scope="session")
def tiktoken_qwen(ranks):
    import tiktoken

    return tiktoken.Encoding("qwen-test", pat_str=tk.QWEN2_PATTERN, mergeable_ranks=ranks, special_tokens={})


def _small_tokenizer_dir(path: Path, **special) -> Path:
    """A tiny byte-level BPE tokenizer directory without BAGEL's tokens (unless given as special)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    merges = [("t", "h"), ("th", "e"), ("Ġ", "the"), ("i", "n")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Tokenizer(BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    defaults = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, **{**defaults, **special})
    fast.save_pretrained(path)
    return path


# ------------------------------------------------------------------------------------------------
# qwen2-offline


@pytest.mark.slow  # builds qwen2-offline in a private cache (the qwen_cache fixture)
def test_qwen2_offline_matches_tiktoken(qwen, tiktoken_qwen):
    texts = SAMPLES + _random_texts(400)
    mismatches = []
    for text in texts:
        normalized = unicodedata.normalize("NFC", text)
        ids = qwen.encode(text)
        if ids != tiktoken_qwen.encode_ordinary(normalized):
            mismatches.append(text)
        assert qwen.decode(ids) == normalized, repr(text)
    assert not mismatches, f"{len(mismatches)} texts differ from tiktoken, e.g. {mismatches[0]!r}"
    # Digits are split one by one, as in Qwen2 (not GPT-4's groups of three).
    assert len(qwen.encode("1234567")) == 7


@pytest.mark.slow  # builds qwen2-offline in a private cache (the qwen_cache fixture)
def test_qwen2_offline_layout_and_special_tokens(qwen):
    assert type(qwen).__name__ == "Qwen2Tokenizer"
    assert qwen.vocab_size == 151643
    assert len(qwen) == 151665
    assert qwen.encode("hi") == qwen.encode("hi", add_special_tokens=False)  # no BOS is added
    assert qwen.bos_token is None
    assert qwen.eos_token == "<|im_end|>" and qwen.eos_token_id == 151645
    assert qwen.pad_token == "<|endoftext|>" and qwen.pad_token_id == 151643
    for name, token_id in QWEN2_ADDED_IDS.items():
        assert qwen.convert_tokens_to_ids(name) == token_id
        assert qwen.added_tokens_decoder[token_id].special == (name not in NOT_SPECIAL), name
    extras = [str(t) for t in qwen.extra_special_tokens]
    assert extras == list(QWEN2_ADDED_IDS)[1:14]
    assert qwen.encode("<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]
    state = json.loads(qwen.backend_tokenizer.to_str())
    assert state["normalizer"]["type"] == "NFC"
    assert state["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == tk.QWEN2_PATTERN
    assert state["model"]["type"] == "BPE" and len(state["model"]["merges"]) == 151387


def test_bpe_merges_rebuild_every_token(ranks):
    merges = tk.bpe_merges_from_ranks(ranks)
    by_rank = sorted(ranks, key=ranks.__getitem__)
    assert len(merges) == len(ranks) - 256
    for i, (left, right) in enumerate(merges):
        assert left + right == by_rank[256 + i]
        assert ranks[left] < 256 + i and ranks[right] < 256 + i
    assert merges[:3] == [(b" ", b" "), (b"  ", b"  "), (b"i", b"n")]


@pytest.mark.slow  # builds qwen2-offline in a private cache (the qwen_cache fixture)
def test_cache_is_reused_not_rebuilt(qwen_cache, qwen, monkeypatch):
    marker = (qwen_cache / "bagel_prepack_build.json").read_text()

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt although a complete cache exists")

    monkeypatch.setattr(tk, "_build_qwen2_offline", no_build)
    again = tk.load_tokenizer({"pretrained_model_name_or_path": "qwen2-offline"})
    assert (qwen_cache / "bagel_prepack_build.json").read_text() == marker
    assert json.loads(marker)["fingerprint"] == tk.tokenizer_fingerprint(again)
    for text in SAMPLES:
        assert again.encode(text) == qwen.encode(text)
    assert not [p for p in qwen_cache.parent.iterdir() if p.name.startswith(".")]


def _fake_builder(source_dir: Path, competitor: Path | None = None):
    """Stand-in for the real build: copies a finished build, optionally racing another builder."""

    def build(source, out_dir, *, source_sha256):
        for item in source_dir.iterdir():
            shutil.copy(item, out_dir / item.name)
        if competitor is not None:
            shutil.copytree(source_dir, competitor)

    return build


@pytest.mark.slow  # builds qwen2-offline in a private cache (the qwen_cache fixture)
def test_concurrent_builder_loses_gracefully(qwen_cache, tmp_path, monkeypatch):
    monkeypatch.setenv(tk.CACHE_ENV, str(tmp_path))
    final = tmp_path / qwen_cache.name
    monkeypatch.setattr(tk, "_build_qwen2_offline", _fake_builder(qwen_cache, competitor=final))
    assert tk.qwen2_offline_dir() == final
    assert (final / "bagel_prepack_build.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]  # our staging dir is gone


@pytest.mark.slow  # builds qwen2-offline in a private cache (the qwen_cache fixture)
def test_incomplete_cache_is_rebuilt(qwen_cache, tmp_path, monkeypatch):
    monkeypatch.setenv(tk.CACHE_ENV, str(tmp_path))
    final = tmp_path / qwen_cache.name
    final.mkdir()
    (final / "tokenizer.json").write_text("{truncated")
    monkeypatch.setattr(tk, "_build_qwen2_offline", _fake_builder(qwen_cache))
    assert tk.qwen2_offline_dir() == final
    assert (final / "tokenizer.json").read_bytes() == (qwen_cache / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]


@pytest.mark.slow  # builds qwen2-offline in a private cache (the qwen_cache fixture)
def test_cache_dir_name_follows_vocabulary(qwen_cache, tmp_path, monkeypatch):
    monkeypatch.setenv(tk.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(tk, "_build_qwen2_offline", _fake_builder(qwen_cache))
    altered = tmp_path / "other.tiktoken"
    altered.write_bytes(tk.qwen_tiktoken_path().read_bytes() + b"\n")
    other = tk.qwen2_offline_dir(altered)
    assert other.name.startswith("qwen2-offline-") and other.name != qwen_cache.name


# ------------------------------------------------------------------------------------------------
# load_tokenizer


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        tk.load_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="not found"):
        tk.load_tokenizer("./no/such/dir")
    with pytest.raises(ValueError, match="unknown tokenizer name"):
        tk.load_tokenizer("qwen3-offline")
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache"):
        tk.load_tokenizer({"pretrained_model_name_or_path": "nobody/nothing-here", "cache_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="pretrained_model_name_or_path"):
        tk.load_tokenizer({"name": "qwen2-offline"})
    (tmp_path / "file.json").write_text("{}")
    with pytest.raises(ValueError, match="directory"):
        tk.load_tokenizer(tmp_path / "file.json")
    with pytest.raises(TypeError):
        tk.load_tokenizer(42)
    for exc in (FileNotFoundError, ValueError):
        try:
            tk.load_tokenizer("qwen3-offline" if exc is ValueError else str(tmp_path / "missing"))
        except exc as err:
            assert "\n" not in str(err)


def test_load_directory_and_recipe_mapping(tmp_path):
    path = _small_tokenizer_dir(tmp_path / "small")
    plain = tk.load_tokenizer(str(path))
    mapped = tk.load_tokenizer(
        {"pretrained_model_name_or_path": path, "model_max_length": 77, "_target_": "ignored",
         "local_files_only": False}
    )
    assert mapped.model_max_length == 77
    assert plain.encode("the thin") == mapped.encode("the thin")


def test_hub_id_found_in_local_cache_without_network(tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someorg--tiny-tok"
    _small_tokenizer_dir(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    spec = {"pretrained_model_name_or_path": "someorg/tiny-tok", "cache_dir": str(tmp_path / "hub")}
    loaded = tk.load_tokenizer(spec)
    assert loaded.eos_token == "</s>"


# ------------------------------------------------------------------------------------------------
# special_token_ids against the reference


def _reference_add_special_tokens():
    from nemo_automodel.components.datasets.multimodal.utils import add_special_tokens

    return add_special_tokens


def _added_state(tokenizer):
    return [(i, str(t), t.special, t.normalized) for i, t in sorted(tokenizer.added_tokens_decoder.items())]


@pytest.mark.slow  # builds qwen2-offline in a private cache (the qwen_cache fixture)
def test_special_token_ids_qwen_matches_reference(qwen, qwen_cache):
    reference_tok = tk.load_tokenizer(qwen_cache)
    _, expected, _ = _reference_add_special_tokens()(reference_tok)
    tokenizer, ids = tk.special_token_ids(qwen)
    assert tokenizer is qwen
    assert ids.as_dict() == expected
    assert ids == tk.SpecialTokens(151644, 151645, 151652, 151653)
    # Same side effects as the reference: no growth, same added-token flags afterwards.
    assert len(qwen) == len(reference_tok) == 151665
    assert _added_state(qwen) == _added_state(reference_tok)
    with pytest.raises(Exception):
        ids.bos_token_id = 0  # frozen


@pytest.mark.parametrize(
    "special",
    [{}, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}],
    ids=["none-declared", "im-declared"],
)
def test_special_token_ids_small_matches_reference(tmp_path, special):
    path = _small_tokenizer_dir(tmp_path / "small", **special)
    base_len = len(tk.load_tokenizer(path))
    reference_tok = tk.load_tokenizer(path)
    _, expected, added = _reference_add_special_tokens()(reference_tok)
    tokenizer, ids = tk.special_token_ids(tk.load_tokenizer(path))
    assert ids.as_dict() == expected
    assert len(tokenizer) == len(reference_tok)
    assert _added_state(tokenizer) == _added_state(reference_tok)
    if not special:
        assert added == 4 and sorted(expected.values()) == list(range(base_len, base_len + 4))
    # Calling it again changes nothing.
    _, again = tk.special_token_ids(tokenizer)
    assert again == ids and len(tokenizer) == len(reference_tok)


# ------------------------------------------------------------------------------------------------
# fingerprints


@pytest.mark.slow  # builds qwen2-offline in a private cache (the qwen_cache fixture)
def test_fingerprint_same_content_different_directories(qwen, qwen_cache, tmp_path):
    copy = shutil.copytree(qwen_cache, tmp_path / "elsewhere")
    other = tk.load_tokenizer(copy)
    first = tk.tokenizer_fingerprint(qwen)
    assert len(first) == 64 and int(first, 16) >= 0
    assert tk.tokenizer_fingerprint(other) == first
    qwen(["a", "bbb ccc"], padding=True)  # call-time padding does not count
    assert tk.tokenizer_fingerprint(qwen) == first


def test_fingerprint_changes_with_vocabulary(tmp_path):
    a = tk.load_tokenizer(_small_tokenizer_dir(tmp_path / "a"))
    b = tk.load_tokenizer(_small_tokenizer_dir(tmp_path / "b"))
    assert tk.tokenizer_fingerprint(a) == tk.tokenizer_fingerprint(b)

    changed = tmp_path / "c"
    shutil.copytree(tmp_path / "a", changed)
    state = json.loads((changed / "tokenizer.json").read_text())
    state["model"]["merges"] = state["model"]["merges"][:-1]  # drop one merge
    (changed / "tokenizer.json").write_text(json.dumps(state))
    assert tk.tokenizer_fingerprint(tk.load_tokenizer(changed)) != tk.tokenizer_fingerprint(a)

    b.add_tokens(["<new>"])
    assert tk.tokenizer_fingerprint(b) != tk.tokenizer_fingerprint(a)


@pytest.mark.slow  # builds qwen2-offline in a private cache (the qwen_cache fixture)
def test_fingerprint_differs_between_tokenizers(qwen, tmp_path):
    small = tk.load_tokenizer(_small_tokenizer_dir(tmp_path / "small"))
    assert tk.tokenizer_fingerprint(qwen) != tk.tokenizer_fingerprint(small)



def test_recorded_fingerprint_is_computed_once_per_tokenizer(tmp_path, monkeypatch):
    """A job takes the fingerprint from its record (computed once per tokenizer); another vocabulary
    or a token added in place is another tokenizer, computed anew; a damaged record is computed
    again, and a cache that cannot be written still gives the fingerprint."""
    computed = []
    real = tk._fingerprint_of
    monkeypatch.setattr(tk, "_fingerprint_of", lambda *a: computed.append(1) or real(*a))
    root = tmp_path / "cache"
    a = tk.load_tokenizer(_small_tokenizer_dir(tmp_path / "a"))
    first = tk.recorded_fingerprint(a, root)
    assert first == tk.tokenizer_fingerprint(a) and len(computed) == 2
    computed.clear()
    assert tk.recorded_fingerprint(a, root) == first and not computed  # recorded: not computed again

    changed = tmp_path / "c"
    shutil.copytree(tmp_path / "a", changed)
    state = json.loads((changed / "tokenizer.json").read_text())
    state["model"]["merges"] = state["model"]["merges"][:-1]  # the files changed: one merge less
    (changed / "tokenizer.json").write_text(json.dumps(state))
    other = tk.load_tokenizer(changed)
    assert tk.recorded_fingerprint(other, root) == tk.tokenizer_fingerprint(other) != first
    a.add_tokens(["<new>"])  # the same object, another vocabulary
    assert tk.recorded_fingerprint(a, root) == tk.tokenizer_fingerprint(a) != first

    b = tk.load_tokenizer(tmp_path / "a")
    for record in (root / "tokenizer-fingerprints").iterdir():
        record.write_text('{"key": "x", "fingerprint": "' + "0" * 64 + '"}')  # another key's, or damaged
    computed.clear()
    assert tk.recorded_fingerprint(b, root) == first and len(computed) == 1
    (tmp_path / "not-a-dir").write_text("")
    assert tk.recorded_fingerprint(b, tmp_path / "not-a-dir") == first
