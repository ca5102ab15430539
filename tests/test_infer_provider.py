"""``fedge-profile infer --provider`` and the accuracy on labelled samples, in real ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from profiling.infer import PROVIDERS, InferError, InferSettings, benchmark, choose_provider, format_result
from test_profiling import _infer_without_torch, _onnx_cnn


def test_auto_takes_the_first_accelerator_onnx_runtime_offers():
    cpu = PROVIDERS["cpu"]
    assert choose_provider("auto", [cpu]) == cpu
    assert choose_provider("auto", ["CUDAExecutionProvider", cpu]) == "CUDAExecutionProvider"
    assert choose_provider("auto", [cpu, "CUDAExecutionProvider", "TensorrtExecutionProvider"]) \
        == "TensorrtExecutionProvider"
    assert choose_provider("cpu", [cpu]) == cpu
    with pytest.raises(InferError, match="has no CUDAExecutionProvider .*offers: cpu.*onnxruntime-gpu"):
        choose_provider("cuda", [cpu])
    with pytest.raises(InferError, match="unknown provider 'gpu'"):
        choose_provider("gpu", [cpu])


def test_the_report_names_the_provider_that_ran(tmp_path):
    model = _onnx_cnn(tmp_path / "cnn.onnx")
    record = benchmark(model, InferSettings(runs=5, warmup=1, batch=4, provider="auto"))
    expected = choose_provider("auto", ort.get_available_providers())
    assert record["provider"] == expected and record["provider_asked"] == "auto"
    assert f"on {expected} (auto)" in format_result(record)
    out = _infer_without_torch(str(model), "--runs", "5", "--warmup", "0", "--no-record", "--provider", "cpu")
    assert out.returncode == 0 and "on CPUExecutionProvider," in out.stdout, out.stderr


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="this onnxruntime has CUDA")
def test_asking_for_a_missing_provider_is_one_line_and_exit_2(tmp_path):
    model = _onnx_cnn(tmp_path / "cnn.onnx")
    for name in ("cuda", "tensorrt"):
        out = _infer_without_torch(str(model), "--no-record", "--provider", name)
        assert out.returncode == 2 and "onnxruntime-gpu" in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("batch", ["N", 4])   # a dynamic batch axis, and one fixed at 4 (the last chunk padded)
def test_accuracy_on_labelled_samples_is_what_onnx_runtime_computes(tmp_path, batch):
    model = _onnx_cnn(tmp_path / "cnn.onnx", batch=batch)
    rng = np.random.default_rng(2)
    x = rng.random((23, 1, 8, 8)).astype(np.float32)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    predicted = np.concatenate([session.run(None, {"x": x[i:i + 1].repeat(4 if batch == 4 else 1, 0)})[0][:1]
                                for i in range(len(x))]).argmax(1)
    y = np.where(rng.random(23) < 0.6, predicted, (predicted + 1) % 10).astype(np.int64)   # about 60 % right
    np.savez(tmp_path / "labelled.npz", x_test=x, y_test=y)
    record = benchmark(model, InferSettings(runs=3, warmup=0, batch=8, data=f"npz:{tmp_path / 'labelled.npz'}"))
    assert record["accuracy_samples"] == 23
    assert record["accuracy"] == pytest.approx(float((predicted == y).mean()))
    assert "accuracy" in format_result(record)


def test_labels_that_do_not_fit_are_refused(tmp_path):
    model = _onnx_cnn(tmp_path / "cnn.onnx")
    x = np.zeros((5, 1, 8, 8), np.float32)
    for name, y in {"short": np.zeros(4, np.int64), "float": np.zeros(5, np.float32),
                    "2d": np.zeros((5, 1), np.int64)}.items():
        np.savez(tmp_path / f"{name}.npz", x=x, y=y)
        with pytest.raises(InferError, match="labels .* must be integers, one per sample"):
            benchmark(model, InferSettings(runs=1, warmup=0, data=f"npz:{tmp_path / name}.npz"))


def test_a_truncated_npz_is_one_line_naming_the_damage_without_torch(tmp_path):
    model = _onnx_cnn(tmp_path / "cnn.onnx")
    np.savez(tmp_path / "samples.npz", x_test=np.zeros((50, 1, 8, 8), np.float32), y_test=np.zeros(50, np.int64))
    whole = (tmp_path / "samples.npz").read_bytes()
    (tmp_path / "samples.npz").write_bytes(whole[:len(whole) // 2])
    out = _infer_without_torch(str(model), "--no-record", "--runs", "1", "--data", f"npz:{tmp_path / 'samples.npz'}")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "not a valid .npz (truncated or damaged zip archive" in lines[0] and "numpy.savez" in lines[0]
