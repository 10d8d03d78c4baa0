"""The reference online packer (NeMo AutoModel 0.7.0) driven as an oracle for parity tests.

Test-only: imports ``nemo_automodel`` (installed with --no-deps).  Worker w of K is emulated by
answering ``torch.utils.data.get_worker_info()`` as a DataLoader worker would (the reference reads
it for file slicing and for its per-iterator seed); ``test_parity`` also checks this emulation
against a real multi-worker DataLoader.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import asdict
from types import SimpleNamespace
from unittest import mock

import torch

from schemas.config import PrepackConfig


def reference_dataset_block(cfg: PrepackConfig) -> tuple[dict, dict]:
    """``grouped_datasets`` and ``dataset_info`` as the reference takes them (absolute paths)."""
    grouped, info = {}, {}
    for g in cfg.groups:
        entry = {
            "dataset_names": [d.name for d in g.datasets],
            "weight": g.weight,
            "is_mandatory": g.is_mandatory,
            "num_used_data": list(g.num_used_data),
        }
        if g.image_transform:
            entry["image_transform_args"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(g.image_transform).items()}
        if g.vit_image_transform:
            entry["vit_image_transform_args"] = {
                k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(g.vit_image_transform).items()
            }
        if g.frame_sampler:
            entry["frame_sampler_args"] = asdict(g.frame_sampler)
        if g.name == "vlm_sft":
            entry["shuffle_lines"] = g.shuffle_lines
            entry["shuffle_seed"] = g.shuffle_seed
        grouped[g.name] = entry
        info[g.name] = {}
        for d in g.datasets:
            e = {"data_dir": d.data_dir}
            if d.jsonl_path:
                e["jsonl_path"] = d.jsonl_path
            if d.parquet_info_path:
                e["parquet_info_path"] = d.parquet_info_path
            info[g.name][d.name] = e
    return grouped, info


@contextlib.contextmanager
def as_dataloader_worker(worker: int, num_workers: int):
    """Make the reference believe it runs in DataLoader worker ``worker`` of ``num_workers``."""
    if num_workers == 0:
        yield
        return
    info = SimpleNamespace(id=worker, num_workers=num_workers, seed=0, dataset=None)
    with mock.patch.object(torch.utils.data, "get_worker_info", lambda: info):
        yield


def reference_dataset(cfg: PrepackConfig, rank: int, tokenizer):
    from nemo_automodel.components.datasets.multimodal import BagelDatasetConfig, add_special_tokens

    grouped, info = reference_dataset_block(cfg)
    knobs = asdict(cfg.knobs)
    dcfg = BagelDatasetConfig(grouped_datasets=copy.deepcopy(grouped), dataset_info=info, **knobs)
    tokenizer, special, _ = add_special_tokens(tokenizer)
    return dcfg.build(
        tokenizer=tokenizer,
        special_tokens=special,
        rank=rank,
        world_size=cfg.world_size,
        num_workers=cfg.num_workers,
        global_seed=cfg.seed,
    )


def reference_batches(cfg: PrepackConfig, stream: int, tokenizer, n: int) -> list[dict]:
    """The first ``n`` batches of stream ``stream`` as the reference collate's ``to_dict()``."""
    from nemo_automodel.components.datasets.multimodal import SimpleCustomBatch

    rank, worker = cfg.stream_rank_worker(stream)
    out = []
    with as_dataloader_worker(worker, cfg.num_workers):
        ds = reference_dataset(cfg, rank, tokenizer)
        it = iter(ds)
        for _ in range(n):
            out.append(SimpleCustomBatch([next(it)]).to_dict())
    return out


def reference_chain(cfgs: list[PrepackConfig], switches: list[int], stream: int, tokenizer, n: int) -> list[dict]:
    """The first ``n`` batches of stream ``stream`` under a mix change, as the reference defines one: a
    ``PackedDataset`` of ``cfgs[0]`` yields ``switches[0]`` batches; one of ``cfgs[1]`` loads its
    ``state_dict()`` (taken in the worker, where the stream's random state is live) and goes on to
    batch ``switches[1]`` (counted from the start), and so on; the last config yields the rest."""
    from nemo_automodel.components.datasets.multimodal import SimpleCustomBatch

    rank, worker = cfgs[0].stream_rank_worker(stream)
    out: list[dict] = []
    with as_dataloader_worker(worker, cfgs[0].num_workers):
        state = None
        for i, cfg in enumerate(cfgs):
            ds = reference_dataset(cfg, rank, tokenizer)
            if state is not None:
                ds.load_state_dict(state)
            it = iter(ds)
            stop = switches[i] if i < len(switches) else n
            while len(out) < stop:
                out.append(SimpleCustomBatch([next(it)]).to_dict())
            state = ds.state_dict()
    return out
