"""The offline text dataset that ``python -m titan_lowbit.prepare_data`` writes, by name.

``[training] dataset = "lowbit_text"`` (and ``[validation] dataset =
"lowbit_text_validation"``) read the JSONL splits under ``dataset_path`` through
torchtitan's own HuggingFace text pipeline, so tokenization, packing, sharding across
data-parallel ranks and checkpointing of the data position are torchtitan's. Left unset,
``dataset_path`` is the data folder :func:`titan_lowbit.prepare_data.data_dir` names
(``$TITAN_LOWBIT_DATA``, else ``~/.cache/titan_lowbit/lowbit_text``): an absolute path,
so the same config reads the same data from any working directory. A relative
``dataset_path`` is, as everywhere in torchtitan, relative to the working directory.

The corpus comes with its own tokenizer (``tokenizer/`` beside the splits). A config that
trains on it and leaves ``[model] hf_assets_path`` at torchtitan's default (a path inside
torchtitan's own repository) gets that tokenizer (:func:`wrap_build_tokenizer`); a path
the config sets is used as it is.
"""

from __future__ import annotations

import functools
import os
from functools import partial

from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets import text_datasets
from torchtitan.tools.logging import logger

from titan_lowbit.kernels.private_apis import patch_entry
from titan_lowbit.log_notes import drop_notes
from titan_lowbit.prepare_data import DATA_VARIABLE, DATASET_SPLITS, data_dir

SPLIT_FILES = {"train": "train.jsonl", "validation": "validation.jsonl"}
# the config key that sets where a split is read from, by torchtitan line
DATASET_PATH_KEYS = {
    (0, 2): {"train": "[training] dataset_path", "validation": "[validation] dataset_path"},
    (0, 3): {"train": "--dataloader.dataset_path", "validation": "--validator.dataloader.dataset_path"},
}


def _missing(what: str, path: str, split: str) -> FileNotFoundError:
    """The error for a corpus file or folder that is not there, naming the config key
    that chose ``path`` and a command that builds it."""
    from titan_lowbit.compat import torchtitan_line

    key = DATASET_PATH_KEYS.get(torchtitan_line(), DATASET_PATH_KEYS[(0, 2)])[split]
    if os.path.abspath(path) == str(data_dir()):
        where = (f"{key} is not set, so the default data folder {path} is read "
                 f"(${DATA_VARIABLE}, else ~/.cache/titan_lowbit/lowbit_text)")
        fix = (f"Build it with `python -m titan_lowbit.prepare_data`, or set {key} to the "
               "folder prepare_data wrote")
    else:
        where = f"{key} = {path!r} ({os.path.abspath(path)})"
        fix = (f"Build it with `python -m titan_lowbit.prepare_data --out {path}`, or point "
               f"{key} at a folder holding train.jsonl, validation.jsonl and tokenizer/")
    return FileNotFoundError(f"{what} does not exist: {where}. {fix}.")


def _load_split(path: str, split: str):
    from datasets import load_dataset

    data_file = os.path.join(path, SPLIT_FILES[split])
    if not os.path.isfile(data_file):
        raise _missing(f"dataset file {data_file}", path, split)
    return load_dataset("json", data_files=data_file, split="train")


def _text(sample: dict) -> str:
    return sample["text"]


def _configs(folder: str) -> dict[str, DatasetConfig]:
    return {name: DatasetConfig(path=folder, loader=partial(_load_split, split=split), sample_processor=_text)
            for name, split in DATASET_SPLITS.items()}


DATASET_CONFIGS: dict[str, DatasetConfig] = {}


def resolve_tokenizer(job_config) -> None:
    """Point ``[model] hf_assets_path`` at the corpus' tokenizer when the config trains on
    ``lowbit_text`` and leaves the path at torchtitan's default; logs the path it chose."""
    from torchtitan.config.job_config import Model as TorchtitanModel  # the 0.2 line's

    model, training = job_config.model, job_config.training
    if model.hf_assets_path != TorchtitanModel().hf_assets_path or training.dataset not in DATASET_CONFIGS:
        return
    folder = training.dataset_path or DATASET_CONFIGS[training.dataset].path
    tokenizer = os.path.join(folder, "tokenizer")
    if not os.path.isfile(os.path.join(tokenizer, "tokenizer.json")):
        raise _missing(f"tokenizer {tokenizer} ([model] hf_assets_path is not set, so "
                       f"{training.dataset}'s own tokenizer is used)", folder, "train")
    model.hf_assets_path = tokenizer
    logger.info(f"titan_lowbit: [model] hf_assets_path is not set; using the tokenizer of "
                f"{training.dataset}, {tokenizer}")
    # torchtitan's warning that this folder has no model.safetensors.index.json (about a
    # Hugging Face export's file layout) is wrong here: it holds a tokenizer, never weights
    drop_notes(f"model.safetensors.index.json not found at hf_assets_path: {tokenizer}")


def wrap_build_tokenizer(build_tokenizer_fn):
    """A train spec's tokenizer builder that first applies :func:`resolve_tokenizer`."""
    if build_tokenizer_fn is None:
        return None

    @functools.wraps(build_tokenizer_fn)
    def build_tokenizer(job_config, *args, **kwargs):
        resolve_tokenizer(job_config)
        return build_tokenizer_fn(job_config, *args, **kwargs)

    return build_tokenizer


def corpus_tokenizer(folder: str | None = None) -> str:
    """The tokenizer folder of the corpus in ``folder`` (default: the data folder)."""
    return os.path.join(folder or str(data_dir()), "tokenizer")


def check_corpus(hf_assets_path: str, *dataloaders) -> None:
    """torchtitan 0.3: before anything is built, that the corpus splits the data loaders
    read (those of them that name a ``lowbit_text`` dataset) and the tokenizer
    ``hf_assets_path`` names exist, each missing one named with the command that builds it."""
    for loader in dataloaders:
        if getattr(loader, "enable", True) is False:  # a validator that is off reads nothing
            continue
        loader = getattr(loader, "dataloader", loader)  # a validator holds its data loader
        split = DATASET_SPLITS.get(getattr(loader, "dataset", None))
        if split is None:
            continue
        folder = getattr(loader, "dataset_path", None) or str(data_dir())
        data_file = os.path.join(folder, SPLIT_FILES[split])
        if not os.path.isfile(data_file):
            raise _missing(f"dataset file {data_file}", folder, split)
        if os.path.abspath(hf_assets_path) == os.path.abspath(corpus_tokenizer(folder)) and not os.path.isfile(
                os.path.join(hf_assets_path, "tokenizer.json")):
            raise _missing(f"tokenizer {hf_assets_path}", folder, "train")


def register() -> None:
    """Register the datasets with the default folder as the environment names it now, in
    torchtitan's dataset table (it has no registration function)."""
    if not DATASET_CONFIGS:
        DATASET_CONFIGS.update(_configs(str(data_dir())))
    for name, config in DATASET_CONFIGS.items():
        if text_datasets.DATASETS.get(name) not in (None, config):
            raise RuntimeError(f"a dataset named {name!r} is already registered with torchtitan")
        patch_entry(text_datasets, "DATASETS", name, config)
