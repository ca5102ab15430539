"""Apps in a flash kit (``fedge-coordinator kit --app WHEEL``): the wheels checked when the kit is written, what
the kit then holds (the wheels, their manifest, each app's identity, the service's app), the devices' memory sized
from the app's example input, and ``fedge-client apps``, which install.sh lists the installed apps with.
tests/test_kit_install.py installs an app wheel with install.sh's own step."""

from __future__ import annotations

import hashlib
import importlib
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_tensors

from coordinator.ops.flash_kit import KitError, KitOptions, memory_need, write_kits
from coordinator.ops.provision import provision
from coordinator.ui.cli import main as coordinator_main
from edge_client import app as app_module
from edge_client.app import app_identity, load_app
from edge_client.cli import main as client_main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "diabetes"

# A second app package, small enough to write here: two apps of different widths in one module.
PROBE = '''
import torch
from torch import nn
from edge_client.app import App, ExampleInput, Metric, Samples


def load(location):
    return Samples(torch.zeros(4, 6), torch.zeros(4, 1))


def make(width):
    return App(name=f"kitprobe_{width}", version="0.3", model=lambda options: nn.Linear(6, width),
               example_input=ExampleInput((6,)), device_data=load, eval_data=load, loss=nn.functional.mse_loss,
               metrics={"mse": Metric(lambda o, t: float(((o - t) ** 2).mean()), False)}, headline="mse")


small, wide = make(2), make(4096)
'''


@pytest.fixture(scope="module")
def deploy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kit") / "deploy"
    provision(out, hosts=["broker.lan"], devices=["pi-01", "pi-02"], port=8883)
    return out


@pytest.fixture()
def fedge_wheel(tmp_path: Path) -> Path:
    path = tmp_path / "fedge-0.1.0-py3-none-any.whl"
    path.write_bytes(b"PK\x05\x06" + bytes(18))   # copied, never installed here
    return path


@pytest.fixture()
def coordinator_has_diabetes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example app importable here, as on a coordinator that runs it."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    importlib.invalidate_caches()


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The probe app's wheel (registering kitprobe_2 and kitprobe_4096), its package importable here."""
    root = tmp_path_factory.mktemp("probe")
    (root / "src" / "kitprobe_app").mkdir(parents=True)
    (root / "src" / "kitprobe_app" / "__init__.py").write_text(PROBE)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root / "src"))
        yield _wheel(root, "kitprobe", "0.3", {"kitprobe_app/__init__.py": PROBE.encode()},
                     {"kitprobe_2": "kitprobe_app:small", "kitprobe_4096": "kitprobe_app:wide"})


def _wheel(folder: Path, dist: str, version: str, files: dict[str, bytes], apps: dict[str, str] | None) -> Path:
    """A wheel as far as the kit reads one: its files, METADATA, WHEEL and the fedge.apps entry points."""
    info = f"{dist}-{version}.dist-info"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: fedge-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    if apps is not None:
        lines = "".join(f"{name} = {path}\n" for name, path in apps.items())
        files[f"{info}/entry_points.txt"] = f"[fedge.apps]\n{lines}".encode()
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
    return path


def _rewritten(wheel: Path, folder: Path, changes: dict[str, bytes]) -> Path:
    """A copy of ``wheel`` in ``folder`` with some of its files' contents replaced."""
    path = folder / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(path, "w") as dst:
        for name in src.namelist():
            dst.writestr(name, changes.get(name, src.read(name)))
    return path


# -- an app wheel in the kit -------------------------------------------------------------------------------------

def test_a_kit_with_an_app_holds_its_wheel_its_manifest_and_the_apps_identity(deploy, fedge_wheel, diabetes_wheel,
                                                                            coordinator_has_diabetes):
    options = KitOptions(target="pi", wheel=fedge_wheel, apps=(diabetes_wheel,))
    kit = write_kits(deploy, options, ["pi-01"])["pi-01"]
    apps = kit / "apps"
    assert sorted(p.name for p in apps.iterdir()) == sorted([diabetes_wheel.name, "SHA256SUMS", "apps.txt"])
    assert (apps / diabetes_wheel.name).read_bytes() == diabetes_wheel.read_bytes()
    digest = hashlib.sha256(diabetes_wheel.read_bytes()).hexdigest()
    assert (apps / "SHA256SUMS").read_text() == f"{digest}  {diabetes_wheel.name}\n"   # as sha256sum -c reads it
    identity = app_identity(load_app("diabetes_app:app"))   # the coordinator's: what its tasks will carry
    assert (apps / "apps.txt").read_text() == f"diabetes 1.0.0 {identity.digest}\n"
    env, client = (kit / "kit.env").read_text(), (kit / "client.env").read_text()
    assert 'FEDGE_APPS="diabetes"\n' in env
    assert "FEDGE_APP=diabetes\n" in client and "FEDGE_DATA=/var/lib/fedge/data.npz\n" in client
    # sized by the app's example input (ten readings), not a 28x28 image
    need, why = memory_need(options)
    assert f"FEDGE_NEED_MIB={need}\n" in env and why.endswith("to train app diabetes 1.0.0 on inputs of shape 10 "
                                                              "at batch size 32")
    assert need < memory_need(KitOptions(target="pi", wheel=fedge_wheel))[0]   # a small MLP beside the cnn
    # the kit written again without apps keeps none of them
    kit = write_kits(deploy, KitOptions(target="pi", wheel=fedge_wheel), ["pi-01"])["pi-01"]
    assert not (kit / "apps").exists()
    assert "FEDGE_APP" not in (kit / "kit.env").read_text() + (kit / "client.env").read_text()


def test_the_command_says_which_app_the_devices_run_and_how_to_train_it(deploy, fedge_wheel, diabetes_wheel,
                                                                        coordinator_has_diabetes, capsys):
    assert coordinator_main(["kit", "--deploy", str(deploy), "--target", "pi", "--wheel", str(fedge_wheel),
                             "--device", "pi-02", "--app", str(diabetes_wheel), "--data-path", "/mnt/usb/d.csv"]) == 0
    out = capsys.readouterr().out
    assert "the devices get app diabetes 1.0.0" in out and "fedge-client run --app diabetes" in out
    assert "--set app.module=diabetes" in out
    assert "FEDGE_DATA=/mnt/usb/d.csv\n" in (deploy / "kits" / "pi-02" / "client.env").read_text()   # no npz: prefix
    # the built-in networks' sizing is not for an app
    assert coordinator_main(["kit", "--deploy", str(deploy), "--target", "pi", "--wheel", str(fedge_wheel),
                             "--app", str(diabetes_wheel), "--image-size", "96"]) == 2
    assert "with --app the apps' example inputs size the devices' memory check" in capsys.readouterr().err


def test_a_wheel_whose_files_are_not_the_coordinators_app_is_refused(deploy, fedge_wheel, diabetes_wheel,
                                                                    coordinator_has_diabetes, tmp_path):
    with zipfile.ZipFile(diabetes_wheel) as whl:
        source = whl.read("diabetes_app/__init__.py")
        entry_points = next(n for n in whl.namelist() if n.endswith("entry_points.txt"))
    edited = _rewritten(diabetes_wheel, tmp_path, {"diabetes_app/__init__.py": source + b"# edited\n"})
    with pytest.raises(KitError, match=r"the files of diabetes_app installed here \(digest \w{12}\) are not the "
                                       r"wheel's \(digest \w{12}\).*refuse"):
        write_kits(deploy, KitOptions(target="pi", wheel=fedge_wheel, apps=(edited,)), ["pi-01"])
    renamed = _rewritten(diabetes_wheel, tmp_path, {entry_points: b"[fedge.apps]\nsugar = diabetes_app:app\n"})
    with pytest.raises(KitError, match="calls itself 'diabetes': devices find an app by its own name"):
        write_kits(deploy, KitOptions(target="pi", wheel=fedge_wheel, apps=(renamed,)), ["pi-01"])


# -- refused before anything is written ---------------------------------------------------------------------------

def test_what_is_not_an_app_wheel_is_refused_with_what_is_wrong(deploy, fedge_wheel, tmp_path, probe):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a wheel")
    fake = tmp_path / "fake-1.0-py3-none-any.whl"
    fake.write_text("not a zip")
    plain = _wheel(tmp_path, "plainlib", "2.0", {"plainlib/__init__.py": b""}, None)
    builtin = _wheel(tmp_path, "shadow", "1.0", {"shadow/__init__.py": b""}, {"vision": "shadow:app"})
    cases = [((tmp_path / "gone-1.0-py3-none-any.whl",), "no such file"),
             ((notes,), "notes.txt is not a wheel file"),
             ((fake,), "fake-1.0-py3-none-any.whl is not a readable wheel"),
             ((plain,), (r"plainlib-2.0-py3-none-any.whl \(plainlib 2.0\) registers no app: its metadata has no "
                         r"entry point in the fedge.apps group")),
             ((builtin,), "other than fedge's own vision"),
             ((probe, probe), "both hold kitprobe")]
    fresh = tmp_path / "deploy"
    shutil.copytree(deploy / "devices", fresh / "devices")
    for apps, message in cases:
        with pytest.raises(KitError, match=message) as refused:
            write_kits(fresh, KitOptions(target="pi", wheel=fedge_wheel, apps=apps))
        assert "\n" not in str(refused.value)
    with pytest.raises(KitError, match="leave them out"):
        write_kits(fresh, KitOptions(target="pi", wheel=fedge_wheel, apps=(probe,), model="vgg9"))
    assert not (fresh / "kits").exists()


def test_an_app_that_does_not_load_here_is_refused_naming_the_install(deploy, fedge_wheel, tmp_path):
    absent = _wheel(tmp_path, "absent", "1.0", {"absent_app/__init__.py": b""}, {"absent": "absent_app_nowhere:app"})
    with pytest.raises(KitError, match=r"app absent \(absent_app_nowhere:app\) does not load on this machine, "
                                       r"which must hold it .*\(pip install .*absent-1.0-py3-none-any.whl\): app "
                                       r"'absent_app_nowhere:app' does not import"):
        write_kits(deploy, KitOptions(target="pi", wheel=fedge_wheel, apps=(absent,)), ["pi-01"])


# -- starting weights -------------------------------------------------------------------------------------------

WEIGHTED = PROBE.replace("small, wide = make(2), make(4096)", """
app = App(name="kitweights", version="1.0", model=lambda options: nn.Linear(6, 2), example_input=ExampleInput((6,)),
          device_data=load, eval_data=load, loss=nn.functional.mse_loss, weights="start.safetensors",
          metrics={"mse": Metric(lambda o, t: float(((o - t) ** 2).mean()), False)}, headline="mse")
""")


def test_an_apps_starting_weights_must_be_in_its_wheel_as_installed_here(deploy, fedge_wheel, tmp_path, monkeypatch):
    weights = save_tensors({"weight": torch.ones(2, 6), "bias": torch.zeros(2)})
    package = tmp_path / "src" / "kitweights_app"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(WEIGHTED)
    (package / "start.safetensors").write_bytes(weights)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    importlib.invalidate_caches()
    sources = {"kitweights_app/__init__.py": WEIGHTED.encode()}
    entry = {"kitweights": "kitweights_app:app"}
    shipped = _wheel(tmp_path, "kitweights", "1.0", {**sources, "kitweights_app/start.safetensors": weights}, entry)
    kit = write_kits(deploy, KitOptions(target="pi", wheel=fedge_wheel, apps=(shipped,)), ["pi-01"])["pi-01"]
    line = (kit / "apps" / "apps.txt").read_text()
    assert line == app_identity(load_app("kitweights_app:app")).line() + "\n"
    assert line.endswith(f" weights={hashlib.sha256(weights).hexdigest()}\n")
    (tmp_path / "without").mkdir()
    without = _wheel(tmp_path / "without", "kitweights", "1.0", sources, entry)
    with pytest.raises(KitError, match=r"its weights file is not in the wheel \(as kitweights_app/start.safetensors\); "
                                       "ship it as package data"):
        write_kits(deploy, KitOptions(target="pi", wheel=fedge_wheel, apps=(without,)), ["pi-01"])
    (tmp_path / "other").mkdir()
    other = _wheel(tmp_path / "other", "kitweights", "1.0",
                   {**sources, "kitweights_app/start.safetensors": b"x" + weights}, entry)
    with pytest.raises(KitError, match="the wheel's weights file kitweights_app/start.safetensors has sha256"):
        write_kits(deploy, KitOptions(target="pi", wheel=fedge_wheel, apps=(other,)), ["pi-01"])


# -- several apps -------------------------------------------------------------------------------------------------

def test_a_kit_with_several_apps_sizes_for_the_largest_and_leaves_the_choice_to_the_device(deploy, fedge_wheel,
                                                                                           probe, capsys):
    options = KitOptions(target="pi", wheel=fedge_wheel, apps=(probe,))
    kit = write_kits(deploy, options, ["pi-01"])["pi-01"]
    assert 'FEDGE_APPS="kitprobe_2 kitprobe_4096"\n' in (kit / "kit.env").read_text()
    assert (kit / "apps" / "apps.txt").read_text().splitlines() == [
        app_identity(load_app(f"kitprobe_app:{n}")).line() for n in ("small", "wide")]
    client = (kit / "client.env").read_text()
    assert "\nFEDGE_APP=" not in client and "#FEDGE_APP=kitprobe_2\n" in client
    assert memory_need(options)[1].endswith("train app kitprobe_4096 0.3 on inputs of shape 6 (the most of the "
                                            "kit's 2 apps) at batch size 32")
    assert coordinator_main(["kit", "--deploy", str(deploy), "--target", "pi", "--wheel", str(fedge_wheel),
                             "--device", "pi-01", "--app", str(probe)]) == 0
    out = capsys.readouterr().out
    assert "the devices get apps kitprobe_2 0.3, kitprobe_4096 0.3; each must be told which it runs" in out
    assert "app.module" not in out


# -- fedge-client apps ----------------------------------------------------------------------------------------------

def test_fedge_client_lists_the_installed_apps_and_names_one_that_does_not_load(monkeypatch, capsys):
    assert client_main(["apps"]) == 0
    assert app_identity(load_app("vision")).line() in capsys.readouterr().out.splitlines()
    installed = app_module.installed_apps()
    monkeypatch.setattr(app_module, "installed_apps", lambda: {**installed, "broken": "no_such_package_here:app"})
    assert client_main(["apps"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("vision ") and "fedge-client: app broken does not load: AppError: app " in err
