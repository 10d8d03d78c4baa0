"""The source kinds a config's groups name, each declared once with what it needs from the config.

A group's name is its kind, as in BAGEL's ``grouped_datasets`` (``t2i_pretrain``, ``vlm_sft``,
``unified_edit``).  ``schemas.config`` checks a group against its kind here; the engine registers
one source implementation per kind (``prepack.engine.sources``) and checks at import that every
kind declared here has exactly one.  A new kind is declared here, then implemented there.
"""

from __future__ import annotations

from dataclasses import dataclass

# The keys every kind accepts in its group and in each of its ``dataset_info`` entries (the
# reference's; a kind may ignore some of them).
GROUP_KEYS = (
    "dataset_names",
    "weight",
    "is_mandatory",
    "num_used_data",
    "image_transform_args",
    "vit_image_transform_args",
    "frame_sampler_args",
    "shuffle_lines",
    "shuffle_seed",
    "resume_data_status",
)
DATASET_KEYS = ("data_dir", "jsonl_path", "parquet_info_path", "json_dir", "num_files", "num_total_samples")


@dataclass(frozen=True)
class Needs:
    """A config key a kind cannot do without, and why (said in the error when it is missing)."""

    key: str
    why: str = ""

    def missing(self, where: str) -> str:
        return f"{where} needs '{self.key}'" + (f" ({self.why})" if self.why else "")


@dataclass(frozen=True)
class SourceKind:
    """One kind of group: its name, the keys it accepts and those it needs, in the group and in
    each of its datasets (checked in this order)."""

    name: str
    reads: str  # what its rows are, in a few words
    group_needs: tuple[Needs, ...]
    dataset_needs: tuple[Needs, ...] = ()
    group_keys: tuple[str, ...] = GROUP_KEYS
    dataset_keys: tuple[str, ...] = DATASET_KEYS


T2I = SourceKind("t2i_pretrain", "parquet rows of an image and its captions",
                 group_needs=(Needs("image_transform_args"),))
SFT = SourceKind("vlm_sft", "JSONL conversations with images, several images or a video",
                 group_needs=(Needs("image_transform_args"),
                              Needs("frame_sampler_args", "the reference requires a frame sampler")),
                 dataset_needs=(Needs("jsonl_path", "vlm_sft reads conversations from JSONL"),))
EDIT = SourceKind("unified_edit", "parquet rows of an image chain and its edit instructions",
                  group_needs=(Needs("image_transform_args"),
                               Needs("vit_image_transform_args", "edit rows feed the ViT too")),
                  dataset_needs=(Needs("parquet_info_path", "unified_edit reads row groups from it"),))

KINDS: dict[str, SourceKind] = {kind.name: kind for kind in (T2I, SFT, EDIT)}
