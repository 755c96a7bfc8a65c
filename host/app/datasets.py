"""Training data for the worker: Fashion-MNIST from Debian's IDX files, digits as a fallback.

Fashion-MNIST (70,000 28x28 grey images, 10 classes) is large enough that compression costs
show in accuracy; Debian ships it as ``dataset-fashion-mnist`` (gzipped IDX files under
/usr/share/datasets/fashion-mnist/), installed by ``make system-deps``. Where it is absent
(not root, not Debian), :func:`load` falls back to scikit-learn's 8x8 digits and says so in
the returned :class:`Dataset`'s ``note``. A damaged file is a :class:`DatasetError` naming
the file and what is wrong with it, never a numpy exception from deep inside.
"""
from __future__ import annotations

import gzip
import importlib.util
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from thc.codec.settings import Settings, current

FASHION_FILES = {"train_images": "train-images-idx3-ubyte.gz",
                 "train_labels": "train-labels-idx1-ubyte.gz",
                 "test_images": "t10k-images-idx3-ubyte.gz",
                 "test_labels": "t10k-labels-idx1-ubyte.gz"}
IDX_UBYTE = 0x08
"""IDX element type code of unsigned bytes (the only one MNIST-style files use)."""


class DatasetError(ValueError):
    """A data file that cannot be read; the message names the file."""


@dataclass(frozen=True)
class Dataset:
    """Standardized float32 images (N, 1, H, W) and int64 labels, split into train and test."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    note: str = ""
    """Why this data set was chosen when it is not the one asked for (empty otherwise)."""

    @property
    def classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def read_idx(path: Path | str) -> np.ndarray:
    """An IDX file (optionally gzipped) of unsigned bytes as a numpy array of its shape."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such file") from None
    except (OSError, EOFError, zlib.error) as e:
        raise DatasetError(f"{path}: not a readable gzip file ({e})") from None
    if len(raw) < 4:
        raise DatasetError(f"{path}: {len(raw)} bytes, too short for an IDX header")
    zero, dtype, ndim = struct.unpack_from(">HBB", raw)
    if zero != 0 or dtype != IDX_UBYTE or not 1 <= ndim <= 4:
        raise DatasetError(f"{path}: not an IDX file of unsigned bytes (magic "
                           f"{raw[:4].hex()}, expected 000008 followed by 01..04)")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(f"{path}: truncated IDX header")
    shape = struct.unpack_from(f">{ndim}I", raw, 4)
    want = int(np.prod(shape, dtype=np.int64))
    have = len(raw) - header
    if have != want:
        raise DatasetError(f"{path}: header announces shape {shape} ({want} bytes of data) "
                           f"but the file holds {have}: truncated or corrupt")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def _standardize(images: np.ndarray, scale: float) -> np.ndarray:
    return ((images.astype(np.float32) / scale - 0.5) / 0.5)[:, None, :, :]


def fashion_dir(settings: Settings | None = None) -> Path:
    """Where Fashion-MNIST's files lie (THC_FASHION_MNIST, else Debian's folder)."""
    return Path((settings or current()).fashion_mnist)


def fashion_missing(settings: Settings | None = None) -> str | None:
    """Why Fashion-MNIST cannot be read where :func:`fashion_dir` says (no folder, or a
    folder without some of its four files), else None."""
    directory = fashion_dir(settings)
    if not directory.is_dir():
        return f"Fashion-MNIST not found in {directory}"
    absent = [name for name in FASHION_FILES.values() if not (directory / name).is_file()]
    if absent:
        return f"{directory} lacks Fashion-MNIST's {', '.join(absent)}"
    return None


def load_fashion_mnist(directory: Path | str | None = None) -> Dataset:
    """The 60,000/10,000 split of the IDX files in ``directory`` (default: :func:`fashion_dir`)."""
    directory = fashion_dir() if directory is None else Path(directory)
    arrays = {key: read_idx(directory / name) for key, name in FASHION_FILES.items()}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DatasetError(f"{directory}: {split} images {images.shape} and labels "
                               f"{labels.shape} do not match")
        if labels.size and labels.max() > 9:
            raise DatasetError(f"{directory / FASHION_FILES[split + '_labels']}: label "
                               f"{int(labels.max())} outside 0..9")
    return Dataset("fashion-mnist",
                   _standardize(arrays["train_images"], 255.0),
                   arrays["train_labels"].astype(np.int64),
                   _standardize(arrays["test_images"], 255.0),
                   arrays["test_labels"].astype(np.int64))


def _digits_file() -> Path | None:
    """scikit-learn's copy of the digits (``sklearn/datasets/data/digits.csv.gz``: 64 pixels
    and the label a row), found without importing scikit-learn, whose import (scipy's with
    it) takes seconds of every worker's start; None where it is not there."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    return path if path.is_file() else None


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images 1797x8x8 float64 in 0..16, labels int64): as ``sklearn.datasets.load_digits``
    gives them, read from its file where it is found, else through it."""
    path = _digits_file()
    if path is not None:
        rows = np.loadtxt(path, delimiter=",", dtype=np.float64)
        if rows.ndim == 2 and rows.shape[1] == 65:
            return rows[:, :64].reshape(-1, 8, 8), rows[:, 64].astype(np.int64)
    from sklearn.datasets import load_digits as sk_digits
    d = sk_digits()
    return d.images, d.target.astype(np.int64)


def load_digits(seed: int = 0) -> Dataset:
    """scikit-learn's digits (1,797 8x8 images), split 80/20 with a fixed seed."""
    images, y = digits_arrays()
    x = _standardize(images, 16.0)
    perm = np.random.default_rng(seed).permutation(len(y))
    cut = int(0.8 * len(y))
    return Dataset("digits", x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]])


DATASETS = ("fashion-mnist", "digits")
TRAIN_IMAGES = {"fashion-mnist": 60_000, "digits": 1_437}
"""Each data set's training images (digits: 80% of 1,797), for checks made before a run
loads them."""
AUTO = "auto"
"""The commands' default data set: Fashion-MNIST where its files are installed, else digits,
saying why. Named explicitly, Fashion-MNIST must be there."""


def resolve(name: str, settings: Settings | None = None) -> tuple[str, str]:
    """(the data set ``name`` stands for, a note when :data:`AUTO` fell back to digits)."""
    if name != AUTO:
        return name, ""
    why = fashion_missing(settings)
    if why is None:
        return "fashion-mnist", ""
    return "digits", (f"{why} (Debian package dataset-fashion-mnist, installed by `make "
                      f"system-deps` as root): using scikit-learn's digits instead")


def load(name: str = AUTO, seed: int = 0, settings: Settings | None = None) -> Dataset:
    """``name`` (:data:`AUTO`: digits with a note saying why when Fashion-MNIST's files are
    absent).

    Fashion-MNIST named but absent, or a directory that exists but holds damaged files,
    raises DatasetError: a silent fallback would train on another data set than asked, or
    hide a broken installation.
    """
    name, note = resolve(name, settings)
    if name == "digits":
        d = load_digits(seed)
        return Dataset(d.name, d.x_train, d.y_train, d.x_test, d.y_test, note)
    if name != "fashion-mnist":
        raise DatasetError(f"unknown data set {name!r}; choose from {', '.join(DATASETS)} "
                           f"or {AUTO}")
    if why := fashion_missing(settings):
        raise DatasetError(f"{why} (Debian package dataset-fashion-mnist, `make system-deps` "
                           f"as root, or THC_FASHION_MNIST): install it, or choose digits")
    return load_fashion_mnist(fashion_dir(settings))
