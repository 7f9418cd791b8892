"""Datasets that need no download, and deterministic disjoint sharding among trainers.

- "stdlib" (the default): the bytes of the Python standard library's source files on this machine,
  a byte-level vocabulary of 256. Files go to train or validation by a hash of their relative path.
- "text": a folder of text files (*.txt, *.md, *.py, ...), byte-level, split the same way.
- "tokens": a nanoGPT-style uint16 token file (.bin); validation is `val.bin` beside it when present,
  else the last `val_fraction` of the tokens.
- "synthetic": a classification task from a fixed random teacher, for the MLP test model.
- "custom": your own, made by a dataset factory of your model's module (`factory`, see
  swarm/training/models/custom.py): factory(seed=...) returns an object with num_train, num_val,
  train(indices) and val(indices).

A language-model sample i is the window tokens[i*L : i*L + L + 1] (inputs and shifted targets), so
samples never overlap. Trainer j of T takes positions j, j+T, j+2T, ... of each epoch's permutation.
"""

from __future__ import annotations

import logging
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from swarm.core.settings import setting

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".csv", ".html", ".c", ".h", ".js", ".tex"}


DATASET_KINDS = ("stdlib", "text", "tokens", "synthetic", "custom")


@dataclass(frozen=True)
class DataConfig:
    kind: str = setting(
        "stdlib", "stdlib (this machine's Python sources), text, tokens, synthetic (mlp's default)",
        flag="--dataset", choices=DATASET_KINDS,
    )  # fmt: skip
    path: str | None = setting(
        None, "folder of text files (text) or uint16 .bin token file (tokens)", flag="--data-path"
    )
    val_fraction: float = setting(0.05, "share of the data held out for validation")
    max_bytes: int = setting(8_000_000, "bytes of text read at most", flag="--data-max-bytes")
    seed: int = setting(0, "data order seed (--seed sets it)", cli=False)
    synthetic_samples: int = setting(20_000, "samples of the synthetic dataset", cli=False)
    factory: str | None = setting(None, "custom: the dataset factory, package.module:function", cli=False)
    kwargs: dict | None = setting(None, "custom: keyword arguments of the dataset factory", cli=False)

    def __post_init__(self) -> None:
        if self.kind not in DATASET_KINDS:
            raise ValueError(f"unknown dataset kind {self.kind!r}; choose one of {', '.join(DATASET_KINDS)}")
        if self.kind == "custom" and ":" not in str(self.factory or ""):
            raise ValueError("a custom dataset needs a factory, 'package.module:make_dataset'")
        if self.kind in ("text", "tokens") and not self.path:
            raise ValueError(f"--dataset {self.kind} needs --data-path (a folder of text files, or a .bin token file)")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5), got {self.val_fraction}")

    def to_dict(self) -> dict:
        return asdict(self)


class Dataset:
    """Numbered samples: `train(indices)` and `val(indices)` return (inputs, targets) batches."""

    num_train: int
    num_val: int

    def train(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def val(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class TokenWindows(Dataset):
    """Non-overlapping windows of seq_len + 1 tokens over a train and a validation token stream."""

    def __init__(self, train_tokens: np.ndarray, val_tokens: np.ndarray, seq_len: int, vocab_size: int) -> None:
        self.seq_len = seq_len
        self._train, self._val = train_tokens, val_tokens
        self.num_train = (len(train_tokens) - 1) // seq_len
        self.num_val = (len(val_tokens) - 1) // seq_len
        if self.num_train < 1 or self.num_val < 1:
            raise ValueError(
                f"dataset too small for seq_len={seq_len}: {len(train_tokens)} train and {len(val_tokens)} val tokens"
            )
        top = int(max(train_tokens.max(initial=0), val_tokens.max(initial=0)))
        if top >= vocab_size:
            raise ValueError(f"dataset has token id {top}, outside the model's vocabulary of {vocab_size}")

    def _windows(self, tokens: np.ndarray, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        L = self.seq_len
        rows = np.stack([np.asarray(tokens[i * L : i * L + L + 1], dtype=np.int64) for i in indices])
        rows_t = torch.from_numpy(rows)
        return rows_t[:, :-1].contiguous(), rows_t[:, 1:].contiguous()

    def train(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._windows(self._train, indices)

    def val(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._windows(self._val, indices)


class SyntheticClassification(Dataset):
    """x ~ N(0, 1), label = argmax of a fixed random linear teacher: learnable, deterministic."""

    def __init__(self, in_dim: int, n_classes: int, num_samples: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed + 7919)
        self._teacher = torch.randn(in_dim, n_classes, generator=gen)
        self.in_dim, self.seed = in_dim, seed
        self.num_val = max(1, num_samples // 10)
        self.num_train = num_samples

    def _samples(self, indices: list[int], offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs = torch.stack(
            [
                torch.randn(self.in_dim, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + offset + i))
                for i in indices
            ]
        )
        return xs, (xs @ self._teacher).argmax(dim=1)

    def train(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._samples(indices, 0)

    def val(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._samples(indices, 1 << 40)


def _split_files(files: list[Path], root: Path, val_fraction: float, max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    train, val = bytearray(), bytearray()
    val_cap = max(int(max_bytes * val_fraction), 4096)
    for f in files:
        if len(train) >= max_bytes and len(val) >= val_cap:
            break
        is_val = zlib.crc32(str(f.relative_to(root)).encode()) % 10_000 < val_fraction * 10_000
        buf = val if is_val else train
        if len(buf) >= (val_cap if is_val else max_bytes):
            continue
        try:
            buf += f.read_bytes() + b"\n\n"
        except OSError:
            continue
    return np.frombuffer(bytes(train[:max_bytes]), dtype=np.uint8), np.frombuffer(bytes(val[:val_cap]), dtype=np.uint8)


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    if not files:
        raise RuntimeError(f"found no Python source files under {root} for the built-in dataset")
    return root, files


def load_custom(cfg: DataConfig) -> Dataset:
    """The dataset of a custom dataset factory, checked to have the Dataset interface."""
    from swarm.training.models import load_factory

    dataset = load_factory(cfg.factory)(seed=cfg.seed, **(cfg.kwargs or {}))
    missing = [name for name in ("num_train", "num_val", "train", "val") if not hasattr(dataset, name)]
    if missing:
        raise ValueError(f"the dataset from {cfg.factory} lacks {', '.join(missing)} (see swarm.training.data.Dataset)")
    if dataset.num_train < 1 or dataset.num_val < 1:
        raise ValueError(f"the dataset from {cfg.factory} has {dataset.num_train} train, {dataset.num_val} val samples")
    return dataset


def load_dataset(cfg: DataConfig, model_spec: dict) -> Dataset:
    kind = cfg.kind
    if kind == "custom":
        return load_custom(cfg)
    if kind == "synthetic":
        if model_spec.get("kind") != "mlp":
            raise ValueError("the synthetic dataset is a classification task for the 'mlp' model")
        return SyntheticClassification(
            model_spec.get("in_dim", 32), model_spec.get("n_classes", 10), cfg.synthetic_samples, cfg.seed
        )
    seq_len = int(model_spec.get("seq_len", 128))
    vocab = int(model_spec.get("vocab_size", 256))
    if kind == "stdlib":
        root, files = stdlib_files()
        train, val = _split_files(files, root, cfg.val_fraction, cfg.max_bytes)
    elif kind == "text":
        root = Path(cfg.path).expanduser().resolve()
        if not root.is_dir():
            raise ValueError(f"--data-path {root} is not a folder: give a folder of text files for --dataset text")
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise ValueError(f"no text files ({', '.join(sorted(TEXT_SUFFIXES))}) under --data-path {root}: add some")
        train, val = _split_files(files, root, cfg.val_fraction, cfg.max_bytes)
    else:
        path = Path(cfg.path).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"--data-path {path} is not a file: give a uint16 token file (.bin) for --dataset tokens")
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        val_path = path.with_name("val.bin")
        if val_path.exists() and val_path != path:
            train, val = tokens, np.memmap(val_path, dtype=np.uint16, mode="r")
        else:
            cut = int(len(tokens) * (1 - cfg.val_fraction))
            train, val = tokens[:cut], tokens[cut:]
    return TokenWindows(train, val, seq_len, vocab)


class ShardSampler:
    """Deterministic, disjoint shard of sample indices for trainer `index` of `count`, epoch by epoch."""

    def __init__(self, num_items: int, index: int, count: int, seed: int) -> None:
        if not 0 <= index < count:
            raise ValueError(f"trainer index {index} outside 0..{count - 1}")
        if num_items < count:
            raise ValueError(f"{num_items} samples cannot be shared among {count} trainers")
        self.num_items, self.index, self.count, self.seed = num_items, index, count, seed
        self._epoch_len = len(range(index, num_items, count))
        self._cached: tuple[int, list[int]] | None = None

    def epoch(self, epoch: int) -> list[int]:
        perm = torch.randperm(self.num_items, generator=torch.Generator().manual_seed(self.seed * 10_007 + epoch))
        return perm[self.index :: self.count].tolist()

    def __iter__(self) -> Iterator[int]:
        epoch = 0
        while True:
            yield from self.epoch(epoch)
            epoch += 1

    def take(self, position: int, n: int) -> list[int]:
        """The shard's samples at positions position .. position+n-1 (epoch after epoch): a
        microbatch's samples follow from its place in the trainer's stream, so a restarted trainer
        (or a replay) finds the same ones."""
        out: list[int] = []
        while len(out) < n:
            epoch, start = divmod(position + len(out), self._epoch_len)
            if self._cached is None or self._cached[0] != epoch:
                self._cached = (epoch, self.epoch(epoch))
            out.extend(self._cached[1][start : start + n - len(out)])
        return out


def val_indices(dataset: Dataset, num_samples: int) -> list[int]:
    """A fixed, evenly spread validation subset."""
    n = min(num_samples, dataset.num_val)
    return [int(i) for i in np.linspace(0, dataset.num_val - 1, n).round().astype(int)]
