"""tools/check_wheels.py without the network: reading the extras, pip's command lines,
following dependencies under the device's markers, and the verdicts."""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("check_wheels", ROOT / "tools" / "check_wheels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_wheels"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


cw = _load()
AARCH64 = cw.TARGETS_BY_NAME["aarch64-py3.11"]
ARMV7 = cw.TARGETS_BY_NAME["armv7l-py3.11"]

PYPROJECT = """
[project]
name = "fedge"
dependencies = ["packaging>=20"]

[project.optional-dependencies]
client = ["torch>=2.1", "numpy>=1.24", "tomli>=2.0; python_version < '3.11'"]
infer = ["numpy<3", "onnxruntime>=1.17"]
coordinator = ["fedge[client]", "rich>=13"]
"""


def _roots(tmp_path: Path, extras: list[str]):
    path = tmp_path / "pyproject.toml"
    path.write_text(PYPROJECT)
    return {r.requirement.name: r for r in cw.read_extras(path, extras)}


def test_extras_merge_packages_and_bring_base_dependencies(tmp_path):
    roots = _roots(tmp_path, ["client", "infer"])
    assert sorted(roots) == ["numpy", "onnxruntime", "packaging", "tomli", "torch"]
    assert roots["numpy"].extras == ["client", "infer"]
    assert str(roots["numpy"].requirement.specifier) == "<3,>=1.24"
    assert roots["packaging"].extras == ["base"]
    assert str(roots["tomli"].requirement.marker) == 'python_version < "3.11"'


def test_an_extra_naming_the_project_brings_the_other_extra(tmp_path):
    roots = _roots(tmp_path, ["coordinator"])
    assert {"torch", "numpy", "rich", "packaging"} <= set(roots)
    assert roots["torch"].extras == ["coordinator"]


def test_unknown_extra_is_an_error(tmp_path):
    with pytest.raises(KeyError):
        _roots(tmp_path, ["nope"])


def test_the_real_pyproject_has_what_devices_need():
    names = {r.requirement.name for r in cw.read_extras(ROOT / "pyproject.toml", ["client", "infer"])}
    assert {"torch", "numpy", "onnxruntime"} <= names


def test_torch_pin_comes_from_the_makefile_and_replaces_the_range(tmp_path):
    makefile = tmp_path / "Makefile"
    makefile.write_text("PYTHON ?= python3\nTORCH_VERSION ?= 2.13.0\n")
    assert cw.read_torch_pin(makefile) == "2.13.0"
    assert cw.read_torch_pin(tmp_path / "absent") is None
    roots = cw.pin_torch(list(_roots(tmp_path, ["client"]).values()), "2.13.0")
    torch = next(r for r in roots if r.requirement.name == "torch")
    assert str(torch.requirement) == "torch==2.13.0"


def test_platform_tags_cover_every_older_glibc():
    tags = cw.manylinux_platforms("aarch64", 35)
    assert tags[0] == "manylinux_2_35_aarch64"
    assert {"manylinux_2_28_aarch64", "manylinux_2_17_aarch64"} <= set(tags)
    assert tags[-2:] == ("manylinux2014_aarch64", "linux_aarch64")
    assert "manylinux_2_16_aarch64" not in tags
    assert {"linux_armv7l", "manylinux_2_31_armv7l", "manylinux2014_armv7l"} <= set(ARMV7.platforms)


def test_pip_command_fetches_one_binary_wheel_for_the_target(tmp_path):
    cmd = cw.pip_download_command("py", "torch==2.13.0", AARCH64, tmp_path, ["URL"])
    assert cmd[:4] == ["py", "-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:", "--no-cache-dir"} <= set(cmd)
    for flag, value in [("--python-version", "3.11"), ("--implementation", "cp"),
                        ("--abi", "cp311"), ("--dest", str(tmp_path)), ("--extra-index-url", "URL")]:
        assert cmd[cmd.index(flag) + 1] == value
    platforms = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--platform"]
    assert platforms == list(AARCH64.platforms)
    assert cmd[-1] == "torch==2.13.0"
    assert "--extra-index-url" not in cw.pip_download_command("py", "x", ARMV7, tmp_path)


def test_pip_reason_is_one_line():
    out = ("Looking in indexes: ...\nWARNING: something\n"
           "ERROR: Could not find a version that satisfies the requirement x (from versions: none)\n"
           "ERROR: No matching distribution found for x\n")
    assert cw.pip_reason(out) == "Could not find a version that satisfies the requirement x (from versions: none)"
    assert cw.pip_reason("WARNING: Retrying (Retry(total=4))\nERROR: boom").startswith(
        "package index unreachable: boom")


def test_a_wheel_reports_its_own_dependencies(tmp_path):
    path = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("demo/__init__.py", "")
        zf.writestr("demo-1.0.dist-info/METADATA",
                    "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n"
                    "Requires-Dist: numpy>=1\nRequires-Dist: rich; extra == \"ui\"\n\n")
    info = cw.read_wheel(path)
    assert (info.name, info.version, info.filename) == ("demo", "1.0", path.name)
    assert info.requires_dist == ["numpy>=1", 'rich; extra == "ui"']
    assert info.size == path.stat().st_size


def _wheel(name, version, *deps, size=1000):
    return cw.WheelInfo(f"{name}-{version}-py3-none-any.whl", name, version, size, list(deps))


class FakeIndex:
    """Stands in for pip: the best wheel matching a requirement, or pip's complaint."""

    def __init__(self, wheels):
        self.wheels = wheels  # name -> list of WheelInfo, best first
        self.asked: list[str] = []

    def __call__(self, requirement: str):
        self.asked.append(requirement)
        req = cw.Requirement(requirement)
        for w in self.wheels.get(req.name, []):
            if req.specifier.contains(w.version, prereleases=True):
                return w
        return cw.Missing(f"Could not find a version that satisfies the requirement {requirement}")


def test_dependencies_follow_the_targets_markers_and_extras():
    index = FakeIndex({
        "torch": [_wheel("torch", "2.13.0", "filelock",
                         'cuda-toolkit[cublas]==13.0.3; platform_system == "Linux"',
                         'only-x86==1; platform_machine == "x86_64"',
                         'old-py==1; python_version < "3.11"',
                         'optree>=0.13; extra == "optree"')],
        "filelock": [_wheel("filelock", "4.0")],
        "cuda-toolkit": [_wheel("cuda-toolkit", "13.0.3", 'nvidia-cublas==13.1; extra == "cublas"',
                                'nvidia-cufft==12; extra == "cufft"')],
        "nvidia-cublas": [_wheel("nvidia-cublas", "13.1", size=500)],
        "numpy": [_wheel("numpy", "2.4.6")],
    })
    roots = [cw.RootRequirement(cw.Requirement("torch==2.13.0"), ["client"]),
             cw.RootRequirement(cw.Requirement("numpy>=1.24"), ["client", "infer"])]
    packages = cw.resolve(roots, AARCH64, index)
    assert sorted(packages) == ["cuda-toolkit", "filelock", "numpy", "nvidia-cublas", "torch"]
    assert packages["nvidia-cublas"].required_by == ["cuda-toolkit"]
    assert packages["numpy"].required_by == ["client, infer"]
    assert packages["torch"].depends_on == {"filelock", "cuda-toolkit"}
    assert index.asked.count("torch==2.13.0") == 1

    summary = cw.summarize(packages)
    assert summary["can_train"] is True
    assert summary["train"]["wheels"] == 5 and summary["train"]["bytes"] == 4500
    assert summary["can_serve_onnx"] is False
    assert summary["serve"]["missing"] == ["onnxruntime"]
    assert summary["missing"] == []


def test_one_missing_wheel_does_not_hide_the_others():
    index = FakeIndex({"paho-mqtt": [_wheel("paho-mqtt", "2.2.0")], "numpy": []})
    roots = [cw.RootRequirement(cw.Requirement(r), ["client"]) for r in
             ("torch==2.13.0", "numpy>=1.24", "paho-mqtt>=2.0", "onnxruntime>=1.17")]
    packages = cw.resolve(roots, ARMV7, index)
    assert packages["paho-mqtt"].wheel is not None
    assert packages["torch"].wheel is None and "torch==2.13.0" in packages["torch"].reason
    summary = cw.summarize(packages)
    assert (summary["can_train"], summary["can_serve_onnx"]) == (False, False)
    assert summary["missing"] == ["numpy", "onnxruntime", "torch"]
    assert summary["train"]["missing"] == ["numpy", "torch"]

    line = cw.summary_line("armv7l-py3.11", summary)
    assert "can train: no (no wheel for numpy, torch)" in line
    assert "can serve ONNX: no" in line
    table = cw.format_table(ARMV7, packages, summary)
    assert "MISSING: Could not find a version" in table
    assert "paho-mqtt-2.2.0-py3-none-any.whl" in table
    assert table.splitlines()[-1] == line


def test_a_tighter_specifier_later_fetches_again():
    index = FakeIndex({
        "a": [_wheel("a", "1.0", "c>=1")],
        "b": [_wheel("b", "1.0", "c<2")],
        "c": [_wheel("c", "2.0"), _wheel("c", "1.5")],
    })
    roots = [cw.RootRequirement(cw.Requirement(n), ["client"]) for n in ("a", "b")]
    packages = cw.resolve(roots, AARCH64, index)
    assert packages["c"].wheel.version == "1.5"
    assert packages["c"].required_by == ["a", "b"]


def test_help_runs_without_the_network(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cw.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--json" in out and "armv7l-py3.11" in out
