"""NeMo AutoModel BAGEL recipes that train from a pack: a one-line YAML change, no code.

NeMo's multimodal recipe builds its dataloader in ``setup()`` from
``RecipeConfig(cfg).bagel_dataloader`` -- a typed view that accepts only the online packer's
dataset fields and refuses ``_target_``.  The recipes here are NeMo's own classes with one
difference: while ``setup()`` runs, that view resolves ``dataset: {packed_dir: ...}`` to
``PackedBagelDataloaderConfig``, whose ``build(...)`` takes the same keywords and returns the
same shape (``.dataloader``, ``.dataset``) as NeMo's ``BagelDataloaderConfig``.  Everything else
(model, optimizer, training step, checkpointing, the dataloader state saved per DP rank and
loaded with ``weights_only=True``) is NeMo's code, unchanged.

YAML::

    recipe: loader.nemo.PackedPretrainRecipeForMultimodal   # or PackedFinetuneRecipeForMultimodal
    dataset:
      packed_dir: /data/packed
      progress: /data/progress    # optional: where training stands, for a pack bounded by it
      balance: {sync: lockstep}   # optional: balanced steps (loader.balance.Balance; M: the recipe's)
      vae_latents: true           # optional: padded_latent from the moments prepack latents stored
    dataloader: {num_workers: 2, pin_memory: true, prefetch_factor: 2}

This module imports ``nemo_automodel``; ``import loader`` does not import this module.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

from nemo_automodel.recipes import _typed_config
from nemo_automodel.recipes.multimodal import finetune as _nemo_finetune
from nemo_automodel.recipes.multimodal.finetune import FinetuneRecipeForMultimodal
from nemo_automodel.recipes.multimodal.pretrain import PretrainRecipeForMultimodal
from torchdata.stateful_dataloader import StatefulDataLoader

from loader.balance import Balance
from loader.dataloader import build_dataloader
from loader.dataset import PackedShardDataset
from schemas.errors import ConfigError, UsageError
from schemas.pack_info import PackInfo

log = logging.getLogger(__name__)

_LOADER_FIELDS = ("num_workers", "pin_memory", "prefetch_factor")
_DERIVED_FIELDS = ("global_batch_size",)  # read from the recipe's step_scheduler, not from dataset:
NEMO_GLOBAL_BATCH_SIZE = 8  # NeMo's multimodal recipe's default step_scheduler.global_batch_size


@dataclass(frozen=True)
class PackedDataloaderBuild:
    """What ``build`` returns: the same two attributes as NeMo's ``BagelDataloaderBuild``."""

    dataloader: StatefulDataLoader
    dataset: PackedShardDataset


@dataclass
class PackedBagelDataloaderConfig:
    """``dataset: {packed_dir: ...}`` + the ``dataloader:`` knobs NeMo's BAGEL config accepts.

    Defaults are NeMo's (``num_workers=1``, ``pin_memory=True``, ``prefetch_factor=2``).
    ``verify`` (record digest check) and ``prefetch`` (records read ahead per reader thread)
    are the loader's own, and so is ``progress``: a folder or ``s3://`` URI where the training
    publishes its live position and each checkpoint (NeMo's checkpointer saves the dataloader's
    ``state_dict()``), which ``prepack run --ahead N --progress`` and ``prepack trim --progress``
    bound a pack by (``loader.dataloader``).

    ``balance`` deals each optimizer step's batches to the ranks and micro-steps by their
    estimated cost (``loader.balance.Balance``; NeMo's loss is normalized by the step's global
    token counts, so the step's gradient stays the same): ``true``, or a mapping of
    ``sync`` (``lockstep``, the default: NeMo's recipe trains under FSDP2 without deferring the
    gradient sync, so ranks wait at every layer of every micro-batch; ``step``: DDP under
    ``no_sync``), ``micro_batches`` (default: the recipe's gradient accumulation,
    ``step_scheduler.global_batch_size // (local_batch_size * world size)``, NeMo's
    ``grad_acc_steps``, its default global batch size 8) and ``cost_model`` (a file
    ``schemas.cost.CostModel.read`` takes; default: the pack's).

    ``vae_latents``: ``true`` hands each batch's ``padded_latent`` drawn from the encoder moments
    ``prepack latents`` stored, and no ``padded_images``: the recipe's ``_forward_backward_step``
    then skips its VAE encode (``"prefer"``: pixels for shards without latents).
    """

    packed_dir: str
    num_workers: int = 1
    pin_memory: bool = True
    prefetch_factor: int = 2
    verify: bool = True
    prefetch: int = 2
    progress: str | None = None
    balance: "bool | dict" = False
    vae_latents: "bool | str" = False
    global_batch_size: int | None = None  # the recipe's step_scheduler.global_batch_size (not a dataset key)

    def balance_setting(self, batch_size: int, world_size: int) -> Balance | None:
        """``balance`` as the loader takes it, its micro-batches the recipe's unless given."""
        if self.balance is None or self.balance is False:
            return None
        raw = {} if self.balance is True else self.balance
        raw = raw.to_dict() if hasattr(raw, "to_dict") else raw  # a recipe's ConfigNode
        if not isinstance(raw, Mapping):
            raise ConfigError(f"dataset.balance: expected true or a mapping (sync, micro_batches, cost_model), "
                              f"got {self.balance!r}")
        try:
            return Balance.of({"micro_batches": self.steps_micro_batches(batch_size, world_size), **raw})
        except UsageError as e:
            raise ConfigError(f"dataset.{e}") from None

    def steps_micro_batches(self, batch_size: int, world_size: int) -> int:
        """Micro-batches per rank and optimizer step: NeMo's ``grad_acc_steps``."""
        global_batch = NEMO_GLOBAL_BATCH_SIZE if self.global_batch_size is None else int(self.global_batch_size)
        steps = global_batch // (batch_size * world_size)
        if steps < 1:
            raise ConfigError(f"step_scheduler.global_batch_size {global_batch} is less than local_batch_size "
                              f"{batch_size} x {world_size} ranks: no whole micro-batch per rank")
        return steps

    def build(
        self,
        *,
        tokenizer: Any,
        special_tokens: Mapping[str, object],
        rank: int,
        world_size: int,
        batch_size: int,
        global_seed: int,
    ) -> PackedDataloaderBuild:
        """The pack's dataloader for ``rank`` of ``world_size`` (NeMo's ``build`` keywords).

        The tokenizer is not used (the pack is tokenized); its special-token ids must be the
        ones the pack was made with, since the model embeds them.  A pack made with another
        seed than ``global_seed`` holds other data than the online pipeline would: warned.
        """
        del tokenizer
        if batch_size != 1:
            raise ConfigError(
                f"a packed BAGEL dataloader yields one packed batch per step: "
                f"local_batch_size must be 1, got {batch_size}"
            )
        loader = build_dataloader(
            self.packed_dir,
            rank=rank,
            world_size=world_size,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor,
            verify=self.verify,
            prefetch=self.prefetch,
            progress=self.progress,
            balance=self.balance_setting(batch_size, world_size),
            vae_latents=self.vae_latents,
        )
        dataset: PackedShardDataset = loader.dataset
        _check_identity(dataset.pack.info, special_tokens, global_seed)
        return PackedDataloaderBuild(dataloader=loader, dataset=dataset)


def _check_identity(info: PackInfo, special_tokens: Mapping[str, object], global_seed: int) -> None:
    packed = info.special_tokens or {}
    wrong = {k: (v, packed[k]) for k, v in dict(special_tokens).items() if k in packed and int(v) != int(packed[k])}
    if wrong:
        detail = ", ".join(f"{k}: tokenizer {a}, pack {b}" for k, (a, b) in sorted(wrong.items()))
        raise ConfigError(f"the tokenizer's special token ids differ from the pack's ({detail})")
    seed = (info.config or {}).get("seed")
    if seed is not None and int(seed) != int(global_seed):
        log.warning(
            "pack was made with seed %s, the recipe's seed is %s: data differs from the online pipeline's",
            seed,
            global_seed,
        )


def packed_dataloader_config(raw: Any) -> PackedBagelDataloaderConfig | None:
    """The packed config from a recipe's YAML, or None when ``dataset`` has no ``packed_dir``."""
    dataset = _typed_config._as_dict(raw.get("dataset", None))
    if "packed_dir" not in dataset:
        return None
    own = {f.name for f in fields(PackedBagelDataloaderConfig)} - set(_LOADER_FIELDS) - set(_DERIVED_FIELDS)
    unknown = sorted(set(dataset) - own)
    if unknown:
        raise ConfigError(
            f"dataset: {', '.join(unknown)} not used with packed_dir (the pack fixes the data); "
            f"allowed: {', '.join(sorted(own))}"
        )
    loader = _typed_config._as_dict(raw.get("dataloader", None))
    unknown = sorted(set(loader) - set(_LOADER_FIELDS))
    if unknown:
        raise ConfigError(f"dataloader: unexpected field(s) {', '.join(unknown)}; allowed: {', '.join(_LOADER_FIELDS)}")
    steps = _typed_config._as_dict(raw.get("step_scheduler", None))
    derived = {"global_batch_size": int(steps["global_batch_size"])} if "global_batch_size" in steps else {}
    return PackedBagelDataloaderConfig(**{**dataset, "packed_dir": os.fspath(dataset["packed_dir"])}, **loader,
                                       **derived)


class PackedRecipeConfig(_typed_config.RecipeConfig):
    """NeMo's ``RecipeConfig`` whose ``bagel_dataloader`` reads a pack when ``packed_dir`` is set."""

    @cached_property
    def bagel_dataloader(self):  # type: ignore[override]
        packed = packed_dataloader_config(self._raw)
        return packed if packed is not None else super().bagel_dataloader


@contextlib.contextmanager
def packed_recipe_config() -> Iterator[None]:
    """Within: NeMo's multimodal recipe resolves its dataloader config with ``PackedRecipeConfig``.

    The recipe's ``setup()`` names ``RecipeConfig`` from its module's globals; that name is the
    only seam, so it is swapped for the duration of ``setup()`` and restored after.
    """
    saved = _nemo_finetune.RecipeConfig
    _nemo_finetune.RecipeConfig = PackedRecipeConfig
    try:
        yield
    finally:
        _nemo_finetune.RecipeConfig = saved


class PackedSetupMixin:
    """Runs the recipe's ``setup()`` inside ``packed_recipe_config()``."""

    def setup(self):
        with packed_recipe_config():
            return super().setup()


class PackedFinetuneRecipeForMultimodal(PackedSetupMixin, FinetuneRecipeForMultimodal):
    """NeMo's ``FinetuneRecipeForMultimodal``, reading ``dataset.packed_dir`` when set."""


class PackedPretrainRecipeForMultimodal(PackedSetupMixin, PretrainRecipeForMultimodal):
    """NeMo's ``PretrainRecipeForMultimodal``, reading ``dataset.packed_dir`` when set."""


__all__ = [
    "PackedBagelDataloaderConfig",
    "PackedDataloaderBuild",
    "PackedFinetuneRecipeForMultimodal",
    "PackedPretrainRecipeForMultimodal",
    "PackedRecipeConfig",
    "PackedSetupMixin",
    "packed_dataloader_config",
    "packed_recipe_config",
]
