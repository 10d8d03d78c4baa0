"""A mix change: what a continuation's config may change from its parent's, and how groups match.

The online packer defines a mix change: a ``PackedDataset`` built from config B that loads the
``state_dict`` of one built from A goes on from A's state (the overflow buffer, the random state,
each group's data position) under B's weights, mandatory groups, token budgets, buffer knobs,
dropout probabilities and transforms.  What would move a group's data order (its datasets, how
many files it uses, its line shuffle, ``data_seed``, the world size, K) or the tokens (the
tokenizer) cannot change: the positions would then point elsewhere.

Groups are matched **by name** (the reference matches them by position, so it crashes, or
silently pairs the wrong states, when a group is removed or inserted before others; appending a
group at the end means the same in both): a group of B that A lacks starts at the beginning of
its data, a group of A that B lacks is dropped.
"""

from __future__ import annotations

from dataclasses import fields

from schemas.config import PackingKnobs, PrepackConfig
from schemas.errors import PackRefused

# Knobs a continuation may change (the rest shape the layout or the data order).
CHANGEABLE_KNOBS = frozenset({
    "expected_num_tokens", "max_num_tokens_per_sample", "max_num_tokens", "prefer_buffer_before", "max_buffer_size",
    "text_cond_dropout_prob", "vit_cond_dropout_prob", "vae_cond_dropout_prob",
})
# Per group: what fixes its data order (refused); weight, is_mandatory and the transforms may change.
GROUP_DATA_FIELDS = ("datasets", "num_used_data", "shuffle_lines", "shuffle_seed")
# prepack: what must stay (the streams themselves); budget, shard size, compression and the
# damaged-input policy may change.
FIXED_PREPACK = ("world_size",)


def mix_change_refusal(old: PrepackConfig, new: PrepackConfig) -> str | None:
    """Why ``new`` cannot continue a pack of ``old`` (one line naming the key), or None."""
    for key in FIXED_PREPACK:
        a, b = getattr(old.prepack, key), getattr(new.prepack, key)
        if a != b:
            return f"prepack.{key} changed ({a} -> {b}): a continuation keeps the parent's streams"
    if new.num_workers != old.num_workers:
        return (f"dataloader.num_workers changed ({old.num_workers} -> {new.num_workers}): a continuation keeps "
                "the parent's streams")
    if new.seed != old.seed:
        return (f"seed changed ({old.seed} -> {new.seed}): a continuation goes on with the parent's random state, "
                "so a new seed would change nothing")
    if new.tokenizer != old.tokenizer:
        return "tokenizer changed: a continuation packs with the parent's tokenizer"
    for f in fields(PackingKnobs):
        a, b = getattr(old.knobs, f.name), getattr(new.knobs, f.name)
        if a != b and f.name not in CHANGEABLE_KNOBS:
            why = ("it moves every group's data order" if f.name == "data_seed"
                   else "it changes how the parent's buffered samples are laid out")
            return f"dataset.{f.name} changed ({a} -> {b}): {why}; a continuation may change only " \
                   f"{', '.join(sorted(CHANGEABLE_KNOBS))}, weights, is_mandatory and transforms"
    before = {g.name: g for g in old.groups}
    for g in new.groups:
        o = before.get(g.name)
        if o is None:
            continue
        for key in GROUP_DATA_FIELDS:
            if getattr(o, key) != getattr(g, key):
                shown = "dataset_names/dataset_info" if key == "datasets" else key
                return (f"dataset.grouped_datasets.{g.name}.{shown} changed: it moves the group's data order, so "
                        "its position in the parent would point elsewhere")
    return None


def check_mix_change(old: PrepackConfig, new: PrepackConfig, where: str) -> None:
    """``PackRefused`` with ``mix_change_refusal``'s line, naming the parent ``where``."""
    why = mix_change_refusal(old, new)
    if why:
        raise PackRefused(f"cannot continue {where}: {why}")


def group_matches(old: PrepackConfig, new: PrepackConfig) -> list[int | None]:
    """For each group of ``new``, the index of the group of ``old`` with its name (None: a new group)."""
    at = {g.name: i for i, g in enumerate(old.groups)}
    return [at.get(g.name) for g in new.groups]

