"""The worker's data: IDX reading, Fashion-MNIST when installed, digits fallback, clear errors."""
from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from thc.app import datasets as D
from thc.codec import settings
from thc.codec.settings import Settings


def idx_bytes(arr: np.ndarray) -> bytes:
    return struct.pack(">HBB", 0, D.IDX_UBYTE, arr.ndim) + \
        struct.pack(f">{arr.ndim}I", *arr.shape) + arr.astype(np.uint8).tobytes()


def write_set(directory, n_train=12, n_test=5, side=28):
    rng = np.random.default_rng(0)
    arrays = {"train_images": rng.integers(0, 256, (n_train, side, side)),
              "train_labels": rng.integers(0, 10, n_train),
              "test_images": rng.integers(0, 256, (n_test, side, side)),
              "test_labels": rng.integers(0, 10, n_test)}
    for key, name in D.FASHION_FILES.items():
        (directory / name).write_bytes(gzip.compress(idx_bytes(arrays[key])))
    return arrays


def test_idx_round_trip(tmp_path):
    arrays = write_set(tmp_path)
    ds = D.load_fashion_mnist(tmp_path)
    assert ds.x_train.shape == (12, 1, 28, 28) and ds.x_train.dtype == np.float32
    assert np.array_equal(ds.y_test, arrays["test_labels"])
    back = np.rint((ds.x_train[:, 0] * 0.5 + 0.5) * 255).astype(int)
    assert np.array_equal(back, arrays["train_images"])
    assert ds.x_train.min() >= -1.0 and ds.x_train.max() <= 1.0


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[: len(b) // 2], "not a readable gzip"),
    (lambda b: gzip.compress(gzip.decompress(b)[:-7]), "truncated or corrupt"),
    (lambda b: gzip.compress(b"\x00\x00\x0d\x03" + gzip.decompress(b)[4:]), "not an IDX"),
    (lambda b: gzip.compress(b"\x00\x00"), "too short"),
])
def test_damaged_file_names_the_file(tmp_path, damage, message):
    write_set(tmp_path)
    victim = tmp_path / D.FASHION_FILES["train_images"]
    victim.write_bytes(damage(victim.read_bytes()))
    with pytest.raises(D.DatasetError, match=message) as e:
        D.load_fashion_mnist(tmp_path)
    assert str(victim) in str(e.value)


def test_missing_file_and_mismatched_counts(tmp_path):
    write_set(tmp_path)
    (tmp_path / D.FASHION_FILES["test_labels"]).unlink()
    with pytest.raises(D.DatasetError, match="no such file"):
        D.load_fashion_mnist(tmp_path)
    write_set(tmp_path)
    (tmp_path / D.FASHION_FILES["test_labels"]).write_bytes(
        gzip.compress(idx_bytes(np.zeros(4, np.uint8))))
    with pytest.raises(D.DatasetError, match="do not match"):
        D.load_fashion_mnist(tmp_path)


def test_fallback_to_digits_says_why(monkeypatch, tmp_path):
    absent = Settings(fashion_mnist=str(tmp_path / "absent"))
    ds = D.load("auto", settings=absent)
    assert ds.name == "digits" and "not found" in ds.note and ds.classes == 10
    assert len(ds.y_train) + len(ds.y_test) == 1797
    # named, it must be there: no other data set than asked
    with pytest.raises(D.DatasetError, match="not found in .*absent.*choose digits"):
        D.load("fashion-mnist", settings=absent)
    with pytest.raises(D.DatasetError, match="unknown data set"):
        D.load("cifar")


def test_a_folder_without_the_files_is_no_fashion_mnist(tmp_path, monkeypatch):
    """A folder that exists but lacks the files passed as installed: ``auto`` took
    Fashion-MNIST instead of digits, and every mode's workers failed on the missing file."""
    import argparse

    from thc.emu.mainargs import data_unavailable
    write_set(tmp_path)
    (tmp_path / D.FASHION_FILES["test_labels"]).unlink()
    partial = Settings(fashion_mnist=str(tmp_path))
    ds = D.load("auto", settings=partial)
    assert ds.name == "digits" and "lacks Fashion-MNIST's t10k-labels-idx1-ubyte.gz" in ds.note
    with pytest.raises(D.DatasetError, match="lacks Fashion-MNIST's t10k-labels"):
        D.load("fashion-mnist", settings=partial)
    monkeypatch.setenv("THC_FASHION_MNIST", str(tmp_path))
    settings.reset()
    try:
        said = data_unavailable(argparse.Namespace(data="fashion-mnist"), "thc run")
    finally:
        monkeypatch.undo()
        settings.reset()
    assert said and "lacks Fashion-MNIST's t10k-labels-idx1-ubyte.gz" in said
    # auto falls back to digits, and says so in the arguments a report keeps
    monkeypatch.setenv("THC_FASHION_MNIST", str(tmp_path))
    settings.reset()
    try:
        args = argparse.Namespace(data="auto")
        assert data_unavailable(args, "thc run") is None
    finally:
        monkeypatch.undo()
        settings.reset()
    assert args.data == "digits" and "using scikit-learn's digits instead" in args.data_note


@pytest.mark.skipif(not D.fashion_dir().is_dir(), reason=f"{D.fashion_dir()} not installed")
def test_installed_fashion_mnist():
    ds = D.load("fashion-mnist")
    assert ds.name == "fashion-mnist" and ds.note == ""
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    assert np.bincount(ds.y_train).tolist() == [6000] * 10


@pytest.mark.parametrize("found", [True, False])
def test_digits_are_scikit_learns_whether_read_from_its_file_or_through_it(monkeypatch, found):
    """Read from scikit-learn's file (no scikit-learn import) or, where it is not found,
    through ``load_digits``: the same images and labels as scikit-learn's own loader."""
    from sklearn.datasets import load_digits

    assert D._digits_file() is not None, "scikit-learn's digits file moved: read it again"
    if not found:
        monkeypatch.setattr(D, "_digits_file", lambda: None)
    images, labels = D.digits_arrays()
    ref = load_digits()
    np.testing.assert_array_equal(images, ref.images)
    np.testing.assert_array_equal(labels, ref.target)
    assert images.dtype == ref.images.dtype and labels.dtype == np.int64


@pytest.mark.parametrize("name", D.DATASETS)
def test_the_training_images_checked_before_a_run_are_the_data_sets(name):
    """`thc run` refuses a batch the training images cannot fill by these counts, before it
    loads them."""
    if name == "fashion-mnist" and (why := D.fashion_missing()):
        pytest.skip(f"Fashion-MNIST is not installed: {why}")
    assert len(D.load(name).y_train) == D.TRAIN_IMAGES[name]
