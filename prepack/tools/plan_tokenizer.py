"""The tokenizer ``prepack plan`` samples with: the built-in one without importing transformers.

The packer's sources call one tokenizer method, ``encode(text) -> list[int]``.  For the built-in
``qwen2-offline`` tokenizer that is exactly the ``tokenizers`` backend's ``encode`` (its
post-processor adds nothing), and the backend can be read straight from the cached
``tokenizer.json``, without the seconds transformers takes to import and wrap it (measured:
docs/performance.md, "``prepack plan``: how close it came").  BAGEL's four tokens are registered
the way :func:`prepack.engine.tokenizer.special_token_ids` registers them (a token not named in the
tokenizer config's special tokens is added again as a plain added token, keeping its id), so the
backend ends up equal to the one ``prepack run`` packs with (``tests/prepack/tools/test_plan.py``
compares the two, and their encodings).

Any other tokenizer (a directory, a Hub snapshot, a mapping) is loaded by ``prepack run``'s own
loader: only a tokenizer this project builds and verifies takes the shortcut.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from prepack.engine.tokenizer import BAGEL_TOKENS, QWEN2_OFFLINE, SpecialTokens, qwen2_offline_dir

log = logging.getLogger(__name__)

# tokenizer_config.json keys whose values transformers lists in ``special_tokens_map``
_NAMED_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class BackendEncoder:
    """``encode(text)`` as the transformers tokenizer gives it, from its ``tokenizers`` backend alone."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=True).ids


def _declared_special(config: Mapping[str, Any]) -> set[str]:
    out: set[str] = set()
    for key in _NAMED_SPECIAL_KEYS:
        value = config.get(key)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            out.add(value)
    return out


def load_qwen2_offline_backend() -> tuple[BackendEncoder, SpecialTokens]:
    """qwen2-offline's backend with BAGEL's tokens registered, read from its cached build."""
    from tokenizers import AddedToken, Tokenizer

    folder = qwen2_offline_dir()
    backend = Tokenizer.from_file(os.fspath(folder / "tokenizer.json"))
    with open(folder / "tokenizer_config.json", encoding="utf-8") as handle:
        declared = _declared_special(json.load(handle))
    missing = [t for t in BAGEL_TOKENS if t not in declared]
    if missing:  # what transformers' add_tokens(list of str) does: plain, normalized added tokens
        backend.add_tokens([AddedToken(t, single_word=False, lstrip=False, rstrip=False, normalized=True,
                                       special=False) for t in missing])
    ids = [backend.token_to_id(t) for t in BAGEL_TOKENS]
    if any(i is None for i in ids):
        raise ValueError(f"{QWEN2_OFFLINE}: no id for {[t for t, i in zip(BAGEL_TOKENS, ids) if i is None]}")
    return BackendEncoder(backend), SpecialTokens(*ids)


def load_plan_tokenizer(spec: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[Any, SpecialTokens]:
    """(tokenizer with ``encode``, BAGEL's token ids) for sampling: the shortcut for qwen2-offline only."""
    if spec == QWEN2_OFFLINE:
        return load_qwen2_offline_backend()
    # here, not at the top: transformers (seconds), which the qwen2-offline shortcut avoids
    from prepack.engine.tokenizer import load_tokenizer, special_token_ids

    return special_token_ids(load_tokenizer(spec))
