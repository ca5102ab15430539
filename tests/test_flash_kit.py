"""First-boot kits written from a real provisioning directory: what each holds, who may read it, and the
mistakes refused before anything is written. bench/arm_device.py runs a kit's install.sh on aarch64."""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from coordinator.ops.flash_kit import CPU_INDEX, KitError, KitOptions, client_env, kit_env, memory_need, write_kits
from coordinator.ops.provision import provision
from coordinator.ui.cli import main as coordinator_main
from edge_client.bundle import read_bundle

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def deploy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kit") / "deploy"
    provision(out, hosts=["broker.lan"], devices=["pi-01", "pi-02"], port=8883)
    return out


@pytest.fixture()
def wheel(tmp_path: Path) -> Path:
    # the kit writer only copies the wheel; bench/arm_device.py installs a real one
    path = tmp_path / "fedge-0.1.0-py3-none-any.whl"
    path.write_bytes(b"PK\x05\x06" + bytes(18))
    return path


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_kit_per_device_holds_its_bundle_privately_and_nothing_secret_elsewhere(deploy, wheel, tmp_path):
    data = tmp_path / "own.npz"
    data.write_bytes(b"npz")
    kits = write_kits(deploy, KitOptions(target="pi", wheel=wheel, torch_threads=2, data=data))
    assert sorted(kits) == ["pi-01", "pi-02"]
    kit = kits["pi-02"]
    assert sorted(p.name for p in kit.iterdir()) == sorted(["install.sh", "fedge-client.service", "kit.env",
                                                           "client.env", "bundle.toml", wheel.name, "data.npz"])
    assert _mode(kit) == 0o700 and _mode(kit / "bundle.toml") == 0o600 and _mode(kit / "install.sh") == 0o755
    assert (kit / "bundle.toml").read_bytes() == (deploy / "devices" / "pi-02.toml").read_bytes()
    password = read_bundle(kit / "bundle.toml").password
    for path in kit.iterdir():
        if path.name != "bundle.toml":
            assert password.encode() not in path.read_bytes(), path.name
    assert 'TORCH_SPEC="torch==2.13.0"' in (kit / "kit.env").read_text()
    assert "FEDGE_TORCH_THREADS=2" in (kit / "client.env").read_text()
    # one unit: the kit installs the file the docs describe
    assert (kit / "fedge-client.service").read_text() == (REPO / "deploy" / "fedge-client.service").read_text()
    assert subprocess.run(["bash", "-n", str(kit / "install.sh")]).returncode == 0


def test_the_unit_passes_the_threads_and_client_env_to_the_client(wheel):
    unit = (REPO / "deploy" / "fedge-client.service").read_text()
    assert "EnvironmentFile=-/etc/fedge/client.env" in unit
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert "--torch-threads ${FEDGE_TORCH_THREADS}" in exec_start
    # the app: fedge's own networks unless client.env names an installed one (a kit made with --app)
    assert "--app ${FEDGE_APP}" in exec_start and "Environment=FEDGE_APP=vision" in unit
    small = client_env(KitOptions(target="pi", wheel=wheel, low_memory=True))
    assert "FEDGE_TORCH_THREADS=1" in small and "MALLOC_TRIM_THRESHOLD_=0" in small and "THP_MEM_ALLOC_ENABLE=1" in small
    assert "MALLOC" not in client_env(KitOptions(target="pi", wheel=wheel))


def test_kit_envs_are_plain_shell_assignments(wheel):
    options = KitOptions(target="pi", wheel=wheel, torch_pip_args="--index-url https://example.invalid/cpu")
    for text in (kit_env(options), client_env(options)):
        done = subprocess.run(["bash", "-c", "set -eu; . /dev/stdin; env"], input=text, capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr
    assert 'TORCH_PIP_ARGS="--index-url https://example.invalid/cpu"' in kit_env(options)


def test_a_kit_with_a_privacy_budget_installs_the_accountant_and_sets_the_budget(wheel):
    private = KitOptions(target="pi", wheel=wheel, privacy_budget=8.0, min_noise_multiplier=2.0)
    assert 'FEDGE_EXTRA="private-client"' in kit_env(private)
    assert "FEDGE_PRIVACY_BUDGET=8\n" in client_env(private) and "FEDGE_MIN_NOISE_MULTIPLIER=2\n" in client_env(private)
    plain = KitOptions(target="pi", wheel=wheel)
    assert 'FEDGE_EXTRA="client"' in kit_env(plain) and "PRIVACY" not in client_env(plain)
    install = (REPO / "coordinator" / "ops" / "kit" / "install.sh").read_text()
    assert '"${FEDGE_EXTRA:-client}"' in install and '[${extra}]' in install   # older kit.env: the client extra


def test_rewriting_a_kit_replaces_the_old_wheel(deploy, wheel, tmp_path):
    write_kits(deploy, KitOptions(target="pi", wheel=wheel), ["pi-01"])
    newer = tmp_path / "fedge-0.2.0-py3-none-any.whl"
    shutil.copy2(wheel, newer)
    kit = write_kits(deploy, KitOptions(target="pi", wheel=newer), ["pi-01"])["pi-01"]
    assert sorted(p.name for p in kit.glob("fedge-*.whl")) == [newer.name]
    assert 'FEDGE_WHEEL="fedge-0.2.0-py3-none-any.whl"' in (kit / "kit.env").read_text()


def test_a_jetson_kit_carries_nvidias_torch_wheel(deploy, wheel, tmp_path):
    torch_wheel = tmp_path / "torch-2.5.0a0+872d972e41.nv24.08-cp310-cp310-linux_aarch64.whl"
    torch_wheel.write_bytes(b"PK")
    kit = write_kits(deploy, KitOptions(target="jetson", wheel=wheel, torch_wheel=torch_wheel), ["pi-01"])["pi-01"]
    assert (kit / torch_wheel.name).exists()
    assert f'TORCH_WHEEL="{torch_wheel.name}"' in (kit / "kit.env").read_text()
    assert "TORCH_SPEC" not in (kit / "kit.env").read_text()


@pytest.mark.parametrize("change, message", [
    ({"target": "pi32"}, "choose one of"),
    ({"wheel": Path("/nonexistent/fedge-0.1.0-py3-none-any.whl")}, "pip wheel --no-deps"),
    ({"torch_spec": "torch"}, "exact pin"),
    ({"target": "jetson"}, "NVIDIA's PyTorch wheel"),
    ({"torch_threads": -1}, "--torch-threads"),
    ({"data_spec": "npz:$(reboot)"}, "may not contain"),
    ({"privacy_budget": -1.0}, "--privacy-budget must be a positive epsilon"),
    ({"min_noise_multiplier": 2.0}, "given only with --privacy-budget"),
    ({"data_url": "ftp://host/x.npz", "data_sha256": "0" * 64}, "http:// or https://"),
    ({"data_url": "https://host/{device}.npz"}, "needs --data-sha256"),
    ({"data_url": "https://host/{device}.npz", "data_sha256": "abc"}, "neither a SHA-256"),
    ({"data_sha256": "0" * 64}, "goes with --data-url"),
    ({"data_dir": Path("/nonexistent")}, "is not a directory"),
    ({"model": "resnet-9000"}, "--model 'resnet-9000'"),
    ({"batch_size": 0}, "must be positive"),
    ({"torch_index": "https://x/$(reboot)"}, "may not contain"),
])
def test_bad_requests_are_refused_before_anything_is_written(deploy, wheel, change, message, tmp_path):
    fresh = tmp_path / "deploy"
    shutil.copytree(deploy / "devices", fresh / "devices")
    with pytest.raises(KitError, match=message):
        write_kits(fresh, KitOptions(**{"target": "pi", "wheel": wheel, **change}))
    assert not (fresh / "kits").exists()


def test_unknown_devices_and_a_wrong_directory_are_named(deploy, wheel, tmp_path):
    with pytest.raises(KitError, match="no bundle for pi-09.*provisioned: pi-01, pi-02"):
        write_kits(deploy, KitOptions(target="pi", wheel=wheel), ["pi-09"])
    with pytest.raises(KitError, match="no devices/ folder"):
        write_kits(tmp_path, KitOptions(target="pi", wheel=wheel))


def test_the_command_writes_kits_and_says_what_next(deploy, wheel, capsys):
    assert coordinator_main(["kit", "--deploy", str(deploy), "--target", "pi", "--wheel", str(wheel),
                             "--device", "pi-01"]) == 0
    out = capsys.readouterr().out
    assert "wrote 1 pi kits" in out and "install.sh" in out
    assert coordinator_main(["kit", "--deploy", str(deploy), "--target", "pi", "--wheel", str(wheel),
                             "--torch", "torch>=2"]) == 2
    assert "exact pin" in capsys.readouterr().err


def test_a_pi_kit_takes_torchs_cpu_build_by_default_and_says_how_large_it_is(wheel):
    default = kit_env(KitOptions(target="pi", wheel=wheel))
    assert f'TORCH_INDEX="{CPU_INDEX}"' in default and CPU_INDEX == "https://download.pytorch.org/whl/cpu"
    assert "TORCH_DOWNLOAD_MB=200\n" in default and "TORCH_INSTALLED_MB=900\n" in default
    package_index = kit_env(KitOptions(target="pi", wheel=wheel, torch_index=""))
    assert 'TORCH_INDEX=""' in package_index and "TORCH_INSTALLED_MB=4900\n" in package_index
    assert "a CUDA build on aarch64" in package_index


def test_the_kit_says_how_much_memory_the_client_needs_for_the_model(wheel, deploy, capsys):
    need, why = memory_need(KitOptions(target="pi", wheel=wheel))
    assert need == 331 and why.startswith("331 MiB: 260 to start")   # cnn, 1x28x28, batch 32
    bigger, _ = memory_need(KitOptions(target="pi", wheel=wheel, model="vgg9", batch_size=64))
    assert bigger > need
    assert f"FEDGE_NEED_MIB={need}\n" in kit_env(KitOptions(target="pi", wheel=wheel))
    assert coordinator_main(["kit", "--deploy", str(deploy), "--target", "pi", "--wheel", str(wheel), "--device",
                             "pi-01", "--model", "vgg9", "--batch-size", "64"]) == 0
    assert f"each device needs {bigger} MiB" in capsys.readouterr().out


def test_each_device_gets_its_own_npz_from_a_data_dir(deploy, wheel, tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    for device in ("pi-01", "pi-02"):
        (own / f"{device}.npz").write_bytes(device.encode())
    kits = write_kits(deploy, KitOptions(target="pi", wheel=wheel, data_dir=own))
    assert [(kits[d] / "data.npz").read_bytes() for d in ("pi-01", "pi-02")] == [b"pi-01", b"pi-02"]
    (own / "pi-02.npz").unlink()
    fresh = tmp_path / "fresh"
    shutil.copytree(deploy / "devices", fresh / "devices")
    with pytest.raises(KitError, match="has no pi-02.npz"):
        write_kits(fresh, KitOptions(target="pi", wheel=wheel, data_dir=own))
    assert not (fresh / "kits").exists()
    # written again without data, a kit keeps none of the old
    assert not (write_kits(deploy, KitOptions(target="pi", wheel=wheel), ["pi-01"])["pi-01"] / "data.npz").exists()


def test_data_to_fetch_is_named_per_device_with_its_digest(deploy, wheel, tmp_path):
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{'a' * 64}  data/pi-01.npz\n{'b' * 64} *pi-02.npz\n")
    kits = write_kits(deploy, KitOptions(target="pi", wheel=wheel, data_url="https://data.lan/fleet/{device}.npz",
                                         data_sha256=str(sums)))
    for device, digest in (("pi-01", "a" * 64), ("pi-02", "b" * 64)):
        env = (kits[device] / "kit.env").read_text()
        assert f'DATA_URL="https://data.lan/fleet/{device}.npz"' in env and f'DATA_SHA256="{digest}"' in env
        assert not (kits[device] / "data.npz").exists()
    one = kit_env(KitOptions(target="pi", wheel=wheel), "https://d/x.npz", "c" * 64)
    assert 'DATA_SHA256="cccc' in one
    sums.write_text(f"{'a' * 64}  pi-01.npz\n")
    with pytest.raises(KitError, match="names no pi-02.npz"):
        write_kits(deploy, KitOptions(target="pi", wheel=wheel, data_url="https://d/{device}.npz",
                                      data_sha256=str(sums)))


def test_data_already_on_the_device_is_named_by_its_path(deploy, wheel, capsys):
    assert coordinator_main(["kit", "--deploy", str(deploy), "--target", "pi", "--wheel", str(wheel), "--device",
                             "pi-02", "--data-path", "/mnt/usb/pi-02.npz"]) == 0
    assert "FEDGE_DATA=npz:/mnt/usb/pi-02.npz\n" in (deploy / "kits" / "pi-02" / "client.env").read_text()
