"""The offline text dataset that ``scripts/prepare_data.py`` writes, by name.

``[training] dataset = "lowbit_text"`` (and ``[validation] dataset =
"lowbit_text_validation"``) read the JSONL splits under ``dataset_path`` (default
``assets/lowbit_text``, relative to the working directory) through torchtitan's own
HuggingFace text pipeline, so tokenization, packing, sharding across data-parallel ranks
and checkpointing of the data position are torchtitan's.
"""

from __future__ import annotations

import os
from functools import partial

from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

DEFAULT_DIR = os.path.join("assets", "lowbit_text")
SPLIT_FILES = {"train": "train.jsonl", "validation": "validation.jsonl"}


def _load_split(path: str, split: str):
    from datasets import load_dataset

    data_file = os.path.join(path, SPLIT_FILES[split])
    if not os.path.isfile(data_file):
        raise FileNotFoundError(
            f"dataset file {data_file} does not exist. Run `python scripts/prepare_data.py "
            f"--out {path}` (scripts/train.sh does it for you), or point "
            "[training] dataset_path at a folder holding train.jsonl and validation.jsonl."
        )
    return load_dataset("json", data_files=data_file, split="train")


def _text(sample: dict) -> str:
    return sample["text"]


DATASET_CONFIGS: dict[str, DatasetConfig] = {
    "lowbit_text": DatasetConfig(
        path=DEFAULT_DIR, loader=partial(_load_split, split="train"), sample_processor=_text
    ),
    "lowbit_text_validation": DatasetConfig(
        path=DEFAULT_DIR,
        loader=partial(_load_split, split="validation"),
        sample_processor=_text,
    ),
}


def register() -> None:
    for name, config in DATASET_CONFIGS.items():
        if DATASETS.get(name) not in (None, config):
            raise RuntimeError(f"a dataset named {name!r} is already registered with torchtitan")
        DATASETS[name] = config
