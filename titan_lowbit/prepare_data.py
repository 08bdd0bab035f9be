"""Build a BPE tokenizer and a JSONL text dataset from a local corpus, offline.

    python -m titan_lowbit.prepare_data [--out DIR] [--corpus DIR] [--if-missing]

By default the corpus is the running interpreter's standard library (its ``.py``
sources and any ``.txt``/``.rst``/``.md`` files beside them): real text that every
machine with Python already has, so CI and GPU hosts without a network train on the
same kind of data. ``--corpus DIR`` takes any folder of text files instead.

Output: ``--out``, by default the data folder :func:`data_dir` names (the one the
``lowbit_text`` datasets read when a config leaves ``dataset_path`` unset):

- ``train.jsonl`` and ``validation.jsonl``: one ``{"text": ...}`` record per document;
  a document goes to validation when a hash of its relative path says so, so the
  splits are disjoint and stable when files are added. Each split is written in the
  order of a hash of its documents' ids (a fixed shuffle): torchtitan reads a dataset
  in order, and in sorted file order a short run would train on the corpus' first
  folders only and validate on its first validation files, so that the losses of two
  equivalent runs could differ by whatever those few files are like;
- ``tokenizer/tokenizer.json`` and ``tokenizer/tokenizer_config.json``: a byte-level BPE
  tokenizer (HF ``tokenizers``) with ``--vocab-size`` entries (default 2048, the vocab
  of torchtitan's llama3 ``debugmodel``) and BOS/EOS tokens torchtitan recognises;
- ``manifest.json``: inputs, sizes and a content hash of every output file.

The result is deterministic: files are read in sorted order, the tokenizer is trained
single-threaded, the shuffle is a hash, and the same corpus gives byte-identical outputs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

TEXT_SUFFIXES = (".py", ".txt", ".rst", ".md")
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
DATA_VARIABLE = "TITAN_LOWBIT_DATA"
# The corpus' dataset names, as a torchtitan config writes them, and the split each reads.
DATASET_SPLITS = {"lowbit_text": "train", "lowbit_text_validation": "validation"}
# What the outputs hold, recorded in the manifest; ``--if-missing`` rebuilds outputs of
# another format (2: each split shuffled by a hash of its document ids; 1: file order).
FORMAT = 2
# Installed third-party packages differ between machines; the corpus is Python's own text.
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}


def data_dir() -> Path:
    """The default folder of the ``lowbit_text`` corpus: ``$TITAN_LOWBIT_DATA`` when set,
    else ``lowbit_text`` in the user's cache folder (``$XDG_CACHE_HOME/titan_lowbit``,
    ``~/.cache/titan_lowbit`` without it). An absolute path, so a config that leaves
    ``dataset_path`` unset reads the same data from any working directory."""
    if os.environ.get(DATA_VARIABLE):
        return Path(os.environ[DATA_VARIABLE]).expanduser().absolute()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser().absolute() / "titan_lowbit" / "lowbit_text"


def default_corpus() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def iter_documents(corpus: Path, max_bytes: int, max_doc_bytes: int):
    """Yield (relative path, text) for the corpus' text files in sorted order, each
    file cut into pieces of at most ``max_doc_bytes`` at line boundaries, until
    ``max_bytes`` of text were yielded."""
    total = 0
    files = sorted(
        p for p in corpus.rglob("*")
        if p.suffix in TEXT_SUFFIXES and p.is_file()
        and not SKIP_DIRS.intersection(p.relative_to(corpus).parts)
    )
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary-ish or unreadable file: not text for this corpus
        rel = path.relative_to(corpus).as_posix()
        piece: list[str] = []
        size = 0
        pieces = []
        for line in text.splitlines(keepends=True):
            piece.append(line)
            size += len(line)
            if size >= max_doc_bytes:
                pieces.append("".join(piece))
                piece, size = [], 0
        if piece:
            pieces.append("".join(piece))
        for i, doc in enumerate(pieces):
            if not doc.strip():
                continue
            yield f"{rel}#{i}", doc
            total += len(doc)
            if total >= max_bytes:
                return


def is_validation(rel_path: str, every: int) -> bool:
    """A document is in the validation split when the hash of its file says so (all
    pieces of one file land in the same split)."""
    file_part = rel_path.split("#", 1)[0]
    digest = hashlib.sha256(file_part.encode()).digest()
    return int.from_bytes(digest[:4], "little") % every == 0


def shuffled(docs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The documents in the order of the SHA-256 of their ids ("path#piece"): a fixed
    pseudo-random order, the same on every machine, in which neighbouring pieces of one
    file land far apart."""
    return sorted(docs, key=lambda d: hashlib.sha256(d[0].encode()).digest())


def train_tokenizer(texts: list[str], vocab_size: int):
    os.environ["RAYON_NUM_THREADS"] = "1"  # must be set before tokenizers starts its pool
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import decoders, models, pre_tokenizers, trainers, Tokenizer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare(corpus: Path, out: Path, vocab_size: int, max_bytes: int, max_doc_bytes: int,
            validation_every: int) -> dict:
    if not corpus.is_dir():
        raise SystemExit(
            f"error: --corpus {corpus} is not a folder. Pass a folder of text files "
            f"({', '.join(TEXT_SUFFIXES)}), or leave --corpus out to use the Python "
            f"standard library at {default_corpus()}."
        )
    docs = list(iter_documents(corpus, max_bytes, max_doc_bytes))
    if not docs:
        raise SystemExit(
            f"error: --corpus {corpus} holds no readable text files "
            f"({', '.join(TEXT_SUFFIXES)})."
        )
    train = [(r, t) for r, t in docs if not is_validation(r, validation_every)]
    val = [(r, t) for r, t in docs if is_validation(r, validation_every)]
    if not train or not val:
        raise SystemExit(
            f"error: --corpus {corpus} has too few files ({len(docs)} documents) to "
            "split into train and validation; add files or lower --validation-every."
        )

    out.mkdir(parents=True, exist_ok=True)
    tok_dir = out / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    tokenizer = train_tokenizer([t for _, t in train], vocab_size)
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
         "add_bos_token": False, "add_eos_token": False,
         "model_max_length": 1 << 20, "tokenizer_class": "PreTrainedTokenizerFast"},
        indent=2, sort_keys=True) + "\n")
    for name, split in (("train.jsonl", shuffled(train)), ("validation.jsonl", shuffled(val))):
        with open(out / name, "w", encoding="utf-8") as f:
            for rel, text in split:
                f.write(json.dumps({"text": text, "source": rel}, ensure_ascii=False) + "\n")

    outputs = ["train.jsonl", "validation.jsonl", "tokenizer/tokenizer.json",
               "tokenizer/tokenizer_config.json"]
    manifest = {
        "format": FORMAT,
        "corpus": str(corpus),
        "vocab_size": tokenizer.get_vocab_size(),
        "documents": {"train": len(train), "validation": len(val)},
        "characters": {"train": sum(len(t) for _, t in train),
                       "validation": sum(len(t) for _, t in val)},
        "sha256": {name: sha256_file(out / name) for name in outputs},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=None,
                        help="folder of text files (default: this Python's standard library)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"output folder (default: ${DATA_VARIABLE}, else "
                             f"~/.cache/titan_lowbit/lowbit_text; here {data_dir()})")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--max-bytes", type=int, default=24_000_000,
                        help="stop reading the corpus after this many characters")
    parser.add_argument("--max-doc-bytes", type=int, default=16_000,
                        help="split longer files into documents of about this size")
    parser.add_argument("--validation-every", type=int, default=20,
                        help="about one file in N goes to the validation split")
    parser.add_argument("--if-missing", action="store_true",
                        help="do nothing when OUT already holds a manifest.json of this "
                             "script's format")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = data_dir()
    if args.vocab_size < 256 + 3:
        parser.error(f"--vocab-size {args.vocab_size} must be at least 259 (256 bytes + 3 special tokens)")
    manifest_path = args.out / "manifest.json"
    corpus = args.corpus
    if args.if_missing and manifest_path.is_file():
        old = json.loads(manifest_path.read_text())
        found = old.get("format", 1)
        if found == FORMAT:
            print(f"prepare_data: {args.out} is ready (manifest.json exists)")
            return 0
        if corpus is None and Path(old.get("corpus", "")).is_dir():
            corpus = Path(old["corpus"])  # rebuild from the corpus it was made of
        print(f"prepare_data: {args.out} holds format {found} data; rebuilding it as "
              f"format {FORMAT} (documents shuffled)", file=sys.stderr)
    if corpus is None:
        corpus = default_corpus()
    manifest = prepare(corpus, args.out, args.vocab_size, args.max_bytes,
                       args.max_doc_bytes, args.validation_every)
    print(f"prepare_data: wrote {args.out}: {json.dumps(manifest['documents'])} documents, "
          f"vocab {manifest['vocab_size']}", file=sys.stderr)
    if args.out.absolute() != data_dir():
        print(f"prepare_data: a config reads it with [training] dataset_path and [validation] "
              f"dataset_path = \"{args.out.absolute()}\" (or with {DATA_VARIABLE}="
              f"{args.out.absolute()} set for every run)", file=sys.stderr)
    return 0


if __name__ == "__main__":  # python -m titan_lowbit.prepare_data
    sys.exit(main())
