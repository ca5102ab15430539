"""Tests for edge_client.data: real datasets, bad files, partition schemes."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_digits

from edge_client import data as D
from edge_client.datasets import _fixed_split
from edge_client.data import (
    DataError,
    Dataset,
    client_split,
    load_client_split,
    describe_partitions,
    load_dataset,
    partition_indices,
)

FMNIST = Path(D.FASHION_MNIST_DIR)
FMNIST_FILES = [
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
]
needs_fmnist = pytest.mark.skipif(
    not all((FMNIST / f).is_file() for f in FMNIST_FILES),
    reason=f"Fashion-MNIST IDX files not installed in {FMNIST}",
)
SPECS = ["iid", "dirichlet:0.5", "shards:2"]


def raises(match: str):
    """pytest.raises(DataError) that also checks the message is a single line."""

    class _Ctx:
        def __enter__(self):
            self.ctx = pytest.raises(DataError, match=match)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            out = self.ctx.__exit__(*exc)
            assert "\n" not in str(self.info.value)
            return out

    return _Ctx()


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset("digits")


@pytest.fixture(scope="module")
def fmnist() -> Dataset:
    if not all((FMNIST / f).is_file() for f in FMNIST_FILES):
        pytest.skip(f"Fashion-MNIST IDX files not installed in {FMNIST}")
    return load_dataset("fashion-mnist")


# --------------------------------------------------------------------------- digits


def test_digits_shapes_and_normalization(digits: Dataset) -> None:
    assert digits.name == "digits"
    assert digits.x_train.shape == (1438, 1, 8, 8) and digits.x_test.shape == (359, 1, 8, 8)
    assert digits.x_train.dtype == np.float32 and digits.x_test.dtype == np.float32
    assert digits.y_train.dtype == np.int64 and digits.y_test.dtype == np.int64
    assert (digits.num_classes, digits.in_channels, digits.image_size) == (10, 1, 8)
    assert abs(float(digits.x_train.mean())) < 1e-3
    assert abs(float(digits.x_train.std()) - 1.0) < 1e-3


def test_digits_split_is_fixed_and_stratified(digits: Dataset) -> None:
    again = load_dataset("digits")
    np.testing.assert_array_equal(again.x_train, digits.x_train)
    np.testing.assert_array_equal(again.y_test, digits.y_test)
    all_counts = np.bincount(load_digits().target)
    test_counts = np.bincount(digits.y_test, minlength=10)
    assert np.all(np.abs(test_counts - 0.2 * all_counts) <= 1)


def test_digits_constants_match_train_split() -> None:
    bunch = load_digits()
    train_idx, _ = _fixed_split(bunch.target)
    x = bunch.images[train_idx] / 16.0
    assert abs(x.mean() - D.DIGITS_MEAN) < 1e-4
    assert abs(x.std() - D.DIGITS_STD) < 1e-4


# --------------------------------------------------------------------------- fashion-mnist


def test_fashion_mnist_shapes_and_normalization(fmnist: Dataset) -> None:
    assert fmnist.x_train.shape == (60000, 1, 28, 28) and fmnist.x_test.shape == (10000, 1, 28, 28)
    assert fmnist.x_train.dtype == np.float32 and fmnist.y_train.dtype == np.int64
    assert (fmnist.num_classes, fmnist.in_channels, fmnist.image_size) == (10, 1, 28)
    np.testing.assert_array_equal(np.bincount(fmnist.y_train), [6000] * 10)
    np.testing.assert_array_equal(np.bincount(fmnist.y_test), [1000] * 10)
    assert abs(float(fmnist.x_train.mean())) < 0.01
    assert abs(float(fmnist.x_train.std()) - 1.0) < 0.01
    assert np.isclose(fmnist.x_train.min(), -D.FASHION_MNIST_MEAN / D.FASHION_MNIST_STD, atol=1e-5)


@needs_fmnist
def test_a_coordinator_without_spawned_clients_loads_only_the_test_split(fmnist: Dataset) -> None:
    """It evaluates on the test split; the 188 MB train split would only sit in its memory."""
    test_only = D.load_dataset("fashion-mnist", train=False)
    assert len(test_only.x_train) == 0 and not test_only.train_loaded
    np.testing.assert_array_equal(test_only.x_test, fmnist.x_test)
    assert (test_only.num_classes, test_only.in_channels, test_only.image_size) == (10, 1, 28)
    for spec in ("attribute:color:5", "attribute:rotate:4"):   # the test split as the clients see theirs
        for a, b in zip(D.evaluation_split(test_only, spec), D.evaluation_split(fmnist, spec)):
            np.testing.assert_array_equal(a, b)


def _write_idx(path: Path, magic: int, arr: np.ndarray, gz: bool = False) -> None:
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    body = header + np.ascontiguousarray(arr, dtype=np.uint8).tobytes()
    path.write_bytes(gzip.compress(body) if gz else body)


def _raw_idx(name: str) -> np.ndarray:
    data = gzip.decompress((FMNIST / name).read_bytes())
    ndim = 3 if "images" in name else 1
    dims = np.frombuffer(data, ">u4", count=ndim, offset=4)
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(dims)


@needs_fmnist
def test_fashion_mnist_accepts_ungzipped_files(tmp_path: Path, fmnist: Dataset) -> None:
    # A real 200/50 subset, written without .gz, must load identically to the same rows of the full set.
    for prefix, n in (("train", 200), ("t10k", 50)):
        _write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", 2051, _raw_idx(f"{prefix}-images-idx3-ubyte.gz")[:n])
        _write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", 2049, _raw_idx(f"{prefix}-labels-idx1-ubyte.gz")[:n])
    small = load_dataset(f"fashion-mnist:{tmp_path}")
    np.testing.assert_array_equal(small.x_train, fmnist.x_train[:200])
    np.testing.assert_array_equal(small.y_test, fmnist.y_test[:50])


def _fake_fmnist(directory: Path, **override: tuple[int, np.ndarray] | bytes) -> None:
    """Small valid IDX set; `override` replaces one file by (magic, array) or raw bytes."""
    rng = np.random.default_rng(0)
    files = {
        "train-images-idx3-ubyte": (2051, rng.integers(0, 256, (30, 28, 28))),
        "train-labels-idx1-ubyte": (2049, np.arange(30) % 10),
        "t10k-images-idx3-ubyte": (2051, rng.integers(0, 256, (10, 28, 28))),
        "t10k-labels-idx1-ubyte": (2049, np.arange(10)),
    }
    for name, spec in files.items():
        spec = override.get(name.replace("-", "_"), spec)
        if isinstance(spec, bytes):
            (directory / f"{name}.gz").write_bytes(spec)
        elif spec is not None:
            _write_idx(directory / f"{name}.gz", *spec, gz=True)


def test_fake_fashion_mnist_loads(tmp_path: Path) -> None:
    _fake_fmnist(tmp_path)
    ds = load_dataset(f"fashion-mnist:{tmp_path}")
    assert ds.x_train.shape == (30, 1, 28, 28) and ds.y_test.tolist() == list(range(10))


@pytest.mark.parametrize(
    "override, match",
    [
        ({"train_labels_idx1_ubyte": (2051, np.arange(30) % 10)}, "wrong IDX magic 2051, expected 2049"),
        ({"t10k_images_idx3_ubyte": (2049, np.zeros((10, 28, 28)))}, "wrong IDX magic 2049, expected 2051"),
        ({"train_images_idx3_ubyte": gzip.compress(b"\x00\x00\x08\x03" + b"\x00" * 20)}, "truncated or corrupt"),
        ({"train_images_idx3_ubyte": gzip.compress(b"\x00\x00\x08")}, "truncated IDX header"),
        ({"train_images_idx3_ubyte": gzip.compress(b"\x00\x00\x08\x03" + b"".join(d.to_bytes(4, "big") for d in (30, 28, 28))
                                                   + bytes(range(256)) * 92)[:-20]}, "cannot read"),
        ({"train_labels_idx1_ubyte": (2049, np.arange(29) % 10)}, "30 images but .* 29 labels"),
        ({"t10k_labels_idx1_ubyte": (2049, np.arange(10) + 1)}, "label 10 out of range 0..9"),
        ({"t10k_labels_idx1_ubyte": None}, "missing t10k-labels-idx1-ubyte.gz"),
    ],
)
def test_fashion_mnist_bad_files(tmp_path: Path, override: dict, match: str) -> None:
    _fake_fmnist(tmp_path, **override)
    with raises(match):
        load_dataset(f"fashion-mnist:{tmp_path}")


def test_fashion_mnist_missing_dir(tmp_path: Path) -> None:
    with raises("directory not found"):
        load_dataset(f"fashion-mnist:{tmp_path / 'nope'}")


# --------------------------------------------------------------------------- npz


def test_npz_uint8_hw_roundtrip(tmp_path: Path) -> None:
    bunch = load_digits()
    x = (bunch.images * 15).astype(np.uint8)  # real digits as 0..240 bytes
    np.savez(tmp_path / "d.npz", x=x, y=bunch.target.astype(np.int32))
    ds = load_dataset(f"npz:{tmp_path / 'd.npz'}")
    tr, te = _fixed_split(bunch.target)
    assert ds.name == "npz" and ds.num_classes == 10
    assert ds.x_train.shape == (1438, 1, 8, 8) and ds.x_test.shape == (359, 1, 8, 8)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    np.testing.assert_allclose(ds.x_train[:, 0], x[tr] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(ds.y_test, bunch.target[te])


def test_npz_float_chw_with_test_split(tmp_path: Path, digits: Dataset) -> None:
    x = np.repeat(digits.x_train[:100], 3, axis=1).astype(np.float64)
    np.savez(tmp_path / "f.npz", x=x, y=digits.y_train[:100], x_test=x[:7], y_test=np.full(7, 11))
    ds = load_dataset(f"npz:{tmp_path / 'f.npz'}")
    assert ds.x_train.shape == (100, 3, 8, 8) and ds.x_test.shape == (7, 3, 8, 8)
    np.testing.assert_allclose(ds.x_train, x, rtol=1e-6)  # floats are not rescaled
    assert ds.num_classes == 12 and ds.in_channels == 3 and ds.image_size == 8


def _npz(tmp_path: Path, **arrays: np.ndarray) -> str:
    np.savez(tmp_path / "bad.npz", **arrays)
    return f"npz:{tmp_path / 'bad.npz'}"


X = np.zeros((20, 8, 8), np.uint8)
Y = np.arange(20) % 4


@pytest.mark.parametrize(
    "arrays, match",
    [
        ({"x": np.zeros((20, 64), np.uint8), "y": Y}, r"must be \[N, H, W\] or \[N, C, H, W\]"),
        ({"x": np.zeros((20, 8, 6), np.uint8), "y": Y}, "images must be square"),
        ({"x": np.where(np.eye(8) > 0, np.nan, 0.0)[None].repeat(20, 0), "y": Y}, "NaN or inf"),
        ({"x": np.full((20, 8, 8), np.inf, np.float32), "y": Y}, "NaN or inf"),
        ({"x": X, "y": Y - 1}, "negative label -1"),
        ({"x": X, "y": Y.astype(np.float32)}, "integer labels"),
        ({"x": X, "y": Y[:19]}, "20 images but 19 labels"),
        ({"x": X, "y": Y.reshape(4, 5)}, "1-D labels"),
        ({"x": X.astype(np.int16), "y": Y}, "uint8 .* or float"),
        ({"x": X}, "needs arrays 'x' and 'y'"),
        ({"x": X, "y": Y, "x_test": X}, "both 'x_test' and 'y_test'"),
        ({"x": X[:0], "y": Y[:0]}, "empty dataset"),
        ({"x": X[:2], "y": Y[:2]}, "too few samples"),
        ({"x": X, "y": Y, "x_test": X[:, :4, :4], "y_test": Y}, "same"),
    ],
)
def test_npz_bad_contents(tmp_path: Path, arrays: dict, match: str) -> None:
    with raises(match):
        load_dataset(_npz(tmp_path, **arrays))


def test_npz_missing_or_unreadable(tmp_path: Path) -> None:
    with raises("npz file not found"):
        load_dataset(f"npz:{tmp_path / 'missing.npz'}")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with raises("not a valid .npz .no zip archive"):
        load_dataset(f"npz:{tmp_path / 'junk.npz'}")
    np.savez(tmp_path / "obj.npz", x=np.array([{"a": 1}], dtype=object), y=Y)
    with raises("not a readable .npz of plain arrays"):
        load_dataset(f"npz:{tmp_path / 'obj.npz'}")
    np.save(tmp_path / "one.npy", np.zeros((4, 8, 8), np.uint8))
    with raises("a single .npy array, not an .npz archive"):
        load_dataset(f"npz:{tmp_path / 'one.npy'}")


def _valid_npz(path: Path, compressed: bool = False) -> bytes:
    x = (load_digits().images[:200] * 15).astype(np.uint8)
    (np.savez_compressed if compressed else np.savez)(path, x=x, y=load_digits().target[:200])
    return path.read_bytes()


@pytest.mark.parametrize("compressed", [False, True])
def test_a_truncated_npz_is_one_line_saying_so(tmp_path: Path, compressed: bool) -> None:
    whole = _valid_npz(tmp_path / "d.npz", compressed)
    (tmp_path / "d.npz").write_bytes(whole[:len(whole) // 2])
    with raises(r"d.npz: not a valid .npz \(truncated or damaged zip archive: .*\); re-create it with numpy.savez"):
        load_dataset(f"npz:{tmp_path / 'd.npz'}")


def test_an_npz_with_a_damaged_member_is_one_line_saying_so(tmp_path: Path) -> None:
    whole = bytearray(_valid_npz(tmp_path / "d.npz", compressed=True))
    middle = len(whole) // 3            # inside the first member's compressed data
    whole[middle:middle + 64] = bytes(64)
    (tmp_path / "d.npz").write_bytes(bytes(whole))
    with raises("not a valid .npz .truncated or damaged zip archive"):
        load_dataset(f"npz:{tmp_path / 'd.npz'}")


def test_random_bytes_are_not_called_pickled_data(tmp_path: Path) -> None:
    (tmp_path / "r.npz").write_bytes(np.random.default_rng(0).bytes(5000))
    with raises("not a valid .npz .no zip archive at its start") as info:
        load_dataset(f"npz:{tmp_path / 'r.npz'}")
    assert "pickle" not in str(info.value)


@pytest.mark.parametrize("spec", ["mnist", "digits:x", "npz", "npz:", "", "Digits"])
def test_unknown_dataset_spec(spec: str) -> None:
    with raises("unknown dataset spec .* valid: digits, fashion-mnist"):
        load_dataset(spec)


def test_dataset_refuses_non_square() -> None:
    x = np.zeros((3, 1, 4, 5), np.float32)
    y = np.zeros(3, np.int64)
    with raises("square"):
        Dataset("t", x, y, x, y, num_classes=1)


# --------------------------------------------------------------------------- partitions


@pytest.mark.parametrize("spec", SPECS)
def test_partition_covers_each_index_once(digits: Dataset, spec: str) -> None:
    parts = partition_indices(digits.y_train, spec, 10, seed=3)
    assert len(parts) == 10 and all(len(p) > 0 for p in parts)
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)  # sorted, unique
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(digits.y_train)))


@pytest.mark.parametrize("spec", SPECS)
def test_partition_deterministic_and_seeded(digits: Dataset, spec: str) -> None:
    a = partition_indices(digits.y_train, spec, 7, seed=1)
    b = partition_indices(digits.y_train, spec, 7, seed=1)
    c = partition_indices(digits.y_train, spec, 7, seed=2)
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    assert not all(np.array_equal(p, q) for p, q in zip(a, c))


def test_iid_is_balanced(digits: Dataset) -> None:
    sizes = [len(p) for p in partition_indices(digits.y_train, "iid", 10, seed=0)]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shards_limit_classes_per_partition(digits: Dataset, seed: int) -> None:
    parts = partition_indices(digits.y_train, "shards:2", 10, seed)
    n_classes = [len(d["classes"]) for d in describe_partitions(digits.y_train, parts, 10)]
    # 2 shards per client, each shard spans at most 2 adjacent classes.
    assert max(n_classes) <= 4 and np.mean(n_classes) <= 3


def test_shards_classic_fashion_mnist(fmnist: Dataset) -> None:
    # 100 clients x 2 shards of 300: shards align with the 6000-per-class boundaries.
    parts = partition_indices(fmnist.y_train, "shards:2", 100, seed=0)
    assert all(len(np.unique(fmnist.y_train[p])) <= 2 for p in parts)
    assert {len(p) for p in parts} == {600}


def _mean_top_class_share(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    return float(np.mean([np.bincount(labels[p]).max() / len(p) for p in parts]))


def test_dirichlet_small_alpha_is_skewed(digits: Dataset) -> None:
    y = digits.y_train
    skewed = partition_indices(y, "dirichlet:0.1", 10, seed=0)
    iid = partition_indices(y, "iid", 10, seed=0)
    assert _mean_top_class_share(y, skewed) > 0.35
    assert _mean_top_class_share(y, iid) < 0.2
    assert min(len(p) for p in skewed) >= 10


def test_dirichlet_gives_up_with_advice() -> None:
    labels = np.repeat([0, 1], 10)  # 2 classes, tiny alpha: at most 2 of 10 clients get data
    with raises("larger alpha or fewer clients"):
        partition_indices(labels, "dirichlet:0.001", 10, seed=0)


@pytest.mark.parametrize(
    "spec",
    ["", "IID", "iid:2", "dirichlet", "dirichlet:", "dirichlet:0", "dirichlet:-1", "dirichlet:nan",
     "dirichlet:inf", "dirichlet:abc", "shards", "shards:0", "shards:1.5", "shards:x", "random"],
)
def test_bad_partition_spec(spec: str) -> None:
    with raises("bad partition spec .* valid: iid, dirichlet:ALPHA"):
        partition_indices(np.arange(20) % 2, spec, 2, seed=0)


@pytest.mark.parametrize("n", [0, -1, 21])
def test_bad_num_partitions(n: int) -> None:
    with raises(r"num_partitions must be in 1\.\.20"):
        partition_indices(np.arange(20) % 2, "iid", n, seed=0)


def test_too_many_shards() -> None:
    with raises("exceeds 20 samples"):
        partition_indices(np.arange(20) % 2, "shards:3", 10, seed=0)


def test_bad_labels_for_partition() -> None:
    with raises("1-D integer"):
        partition_indices(np.zeros(10, np.float32), "iid", 2, seed=0)


# --------------------------------------------------------------------------- client_split / describe


def test_client_split_matches_partitions(digits: Dataset) -> None:
    parts = partition_indices(digits.y_train, "dirichlet:1.0", 5, seed=4)
    total = 0
    for i, idx in enumerate(parts):
        x, y = client_split(digits, "dirichlet:1.0", i, 5, seed=4)
        np.testing.assert_array_equal(x, digits.x_train[idx])
        np.testing.assert_array_equal(y, digits.y_train[idx])
        total += len(y)
    assert total == len(digits.y_train)


@pytest.mark.parametrize("index", [-1, 5])
def test_client_split_index_out_of_range(digits: Dataset, index: int) -> None:
    with raises(r"partition index .* out of range 0\.\.4"):
        client_split(digits, "iid", index, 5, seed=0)


def test_describe_partitions(digits: Dataset) -> None:
    parts = partition_indices(digits.y_train, "shards:1", 10, seed=0)
    info = describe_partitions(digits.y_train, parts, digits.num_classes)
    assert [d["index"] for d in info] == list(range(10))
    for d, p in zip(info, parts):
        assert d["size"] == len(p) == sum(d["classes"].values())
        assert all(isinstance(k, int) and isinstance(v, int) and v > 0 for k, v in d["classes"].items())
    assert sum(d["size"] for d in info) == len(digits.y_train)


def test_a_simulated_clients_rows_load_alone_and_equal_the_whole_datasets(fmnist: Dataset) -> None:
    import subprocess
    import sys

    for spec in ("iid", "dirichlet:0.1", "shards:2"):
        for index in (0, 9):
            x, y = load_client_split("fashion-mnist", spec, index, 10, 3)
            want_x, want_y = client_split(fmnist, spec, index, 10, 3)
            assert x.dtype == np.float32 and np.array_equal(x, want_x) and np.array_equal(y, want_y)
    with pytest.raises(DataError, match="partition index 10 out of range"):
        load_client_split("fashion-mnist", "iid", 10, 10, 0)
    # what a spawned client's process peaks at, loading one of 100 partitions: below the 219 MB of the
    # whole dataset in float32 that the old path held
    code = ("from edge_client.data import load_client_split; "
            "load_client_split('fashion-mnist', 'dirichlet:0.1', 3, 100, 0); "
            "print(next(int(l.split()[1]) // 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')))")
    peak_mb = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 timeout=120).stdout)
    code_all = code.replace("load_client_split('fashion-mnist', 'dirichlet:0.1', 3, 100, 0)",
                            "from edge_client.data import load_dataset, client_split; "
                            "client_split(load_dataset('fashion-mnist'), 'dirichlet:0.1', 3, 100, 0)")
    whole_mb = int(subprocess.run([sys.executable, "-c", code_all], capture_output=True, text=True, check=True,
                                  timeout=120).stdout)
    assert peak_mb < whole_mb - 100, (peak_mb, whole_mb)


def test_both_commands_say_what_is_wrong_with_a_truncated_npz_in_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "own.npz"
    whole = _valid_npz(path)
    path.write_bytes(whole[:len(whole) // 2])
    want = "truncated or damaged zip archive"
    commands = {
        "fedge-client": [sys.executable, "-m", "edge_client.cli", "run", "--broker", "mqtt://127.0.0.1:1",
                         "--client-id", "pi-01", "--data", f"npz:{path}", "--state-dir", str(tmp_path / "state")],
        "fedge-coordinator": [sys.executable, "-m", "coordinator.ui.cli", "run", "--data", f"npz:{path}",
                              "--clients", "1", "--out", str(tmp_path / "run")],
    }
    for name, cmd in commands.items():   # (fedge-coordinator prints its errors on stdout, in its console)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        lines = (out.stdout + out.stderr).strip().splitlines()
        assert out.returncode != 0 and len(lines) == 1, (name, out.stdout, out.stderr)
        assert f"{path}: not a valid .npz ({want}" in lines[0] and "re-create it with numpy.savez" in lines[0], lines
    assert not (tmp_path / "run").exists()
