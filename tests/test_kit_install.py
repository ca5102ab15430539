"""The flash kit's install.sh, its steps run for real on this machine: torch from an index over HTTP, the
memory and disk checks, the kit's app wheels installed beside fedge and listed by fedge-client, a device's
data fetched and checked by SHA-256, and the wait for the client to say the broker passed its presence back.

install.sh runs ``main`` only when executed; sourced, it only defines its steps, and each test calls the
ones it checks with the kit's own ``kit.env``. PyTorch's CPU index cannot be reached from a test machine:
a directory served by ``python -m http.server`` on 127.0.0.1 stands in for it, holding a small wheel named
and versioned like its torch, and pip really installs it from there. The whole script, as root on an
aarch64 root file system, runs in bench/arm_device.py.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import os
import shutil
import site
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from coordinator.ops.broker import free_port
from coordinator.ops.flash_kit import KitOptions, write_kits
from coordinator.ops.mosquitto import LocalMosquitto, mosquitto_binary
from coordinator.ops.provision import provision

TORCH_VERSION = "2.13.0+cpu"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "diabetes"
# pip as on a fresh device: none of this machine's pip settings (its own wheel folders and indexes)
_ENV = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}


@pytest.fixture(scope="module")
def deploy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kit") / "deploy"
    provision(out, hosts=["broker.lan"], devices=["pi-01", "pi-02"], port=8883)
    return out


@pytest.fixture(scope="module")
def fedge_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("wheel") / "fedge-0.1.0-py3-none-any.whl"
    path.write_bytes(b"PK\x05\x06" + bytes(18))   # copied, never installed here
    return path


def _kit(deploy: Path, wheel: Path, device: str = "pi-01", **options) -> Path:
    return write_kits(deploy, KitOptions(target="pi", wheel=wheel, **options), [device])[device]


def _steps(kit: Path, script: str, **variables: str) -> subprocess.CompletedProcess:
    """Source the kit's install.sh and kit.env, set ``variables``, then run ``script`` (its steps)."""
    assigned = "".join(f"{k}={_quote(v)}\n" for k, v in variables.items())
    text = f"set -euo pipefail\n. {kit}/install.sh\n. {kit}/kit.env\n{assigned}{script}\n"
    return subprocess.run(["bash", "-c", text], capture_output=True, text=True, timeout=300, env=_ENV)


def _quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[tuple[Path, str, Path]]:
    """A directory served over HTTP on 127.0.0.1: (the directory, its URL, the server's request log)."""
    root, log = tmp_path / "served", tmp_path / "http.log"
    root.mkdir()
    port = free_port()
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                                   "--directory", str(root)], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"], capture_output=True).returncode:
            assert time.monotonic() < deadline and server.poll() is None, log.read_text()
            time.sleep(0.1)
        yield root, f"http://127.0.0.1:{port}/", log
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:   # a server that outlives SIGTERM must not outlive the test
            server.kill()
            server.wait(10)


def _torch_like_wheel(folder: Path) -> Path:
    """A wheel named and versioned like PyTorch's CPU build, holding a module ``torch`` with that version."""
    name = f"torch-{TORCH_VERSION}"
    files = {"torch/__init__.py": f'__version__ = "{TORCH_VERSION}"\n',
             f"{name}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {TORCH_VERSION}\n",
             f"{name}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: fedge-test\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
                     f"{len(text.encode())}\n" for path, text in files.items())
    files[f"{name}.dist-info/RECORD"] = record + f"{name}.dist-info/RECORD,,\n"
    path = folder / f"{name}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for inner, text in files.items():
            whl.writestr(inner, text)
    return path


# -- the script itself -----------------------------------------------------------------------------------

def test_the_install_script_passes_shellcheck(deploy, fedge_wheel):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    kit = _kit(deploy, fedge_wheel)
    done = subprocess.run(["shellcheck", str(kit / "install.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_the_venv_step_updates_the_package_lists_before_installing_python3_venv(deploy, fedge_wheel):
    # a fresh image has no package lists: apt-get install alone finds no python3-venv
    text = (_kit(deploy, fedge_wheel) / "install.sh").read_text()
    step = text[text.index("make_venv() {"):text.index("have_torch()")]
    assert 0 < step.index("apt-get update") < step.index("apt-get install -y -q python3-venv")


# -- torch: the CPU-only build, from the index the kit names --------------------------------------------

def test_torch_is_installed_from_the_index_the_kit_names_and_its_size_is_announced(deploy, fedge_wheel, served,
                                                                                   tmp_path):
    root, url, log = served
    (root / "torch").mkdir()
    _torch_like_wheel(root / "torch")
    kit = _kit(deploy, fedge_wheel)   # the default: PyTorch's CPU index, which this machine cannot reach
    venv = tmp_path / "opt" / ".venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, env=_ENV)
    # the same kit, its index swapped for the local one: the pip invocation is install.sh's own
    done = _steps(kit, "install_torch; have_torch", PREFIX=str(tmp_path / "opt"), VENV=str(venv), TORCH_INDEX=url)
    assert done.returncode == 0, done.stderr
    assert ("installing torch==2.13.0, the CPU-only build from PyTorch's index https://download.pytorch.org/whl/cpu: "
            "about 200 MB to download, about 900 MB installed") in done.stdout
    assert done.stdout.strip().endswith(TORCH_VERSION)
    requests = log.read_text()
    assert "GET /torch/ " in requests and f"GET /torch/torch-{TORCH_VERSION.replace('+', '%2B')}-py3" in requests
    assert not (tmp_path / "opt" / ".pip-tmp").exists()
    again = _steps(kit, "install_torch", PREFIX=str(tmp_path / "opt"), VENV=str(venv), TORCH_INDEX=url)
    assert again.returncode == 0 and "installing" not in again.stdout   # the pinned version is there: no download


def test_an_index_without_the_pin_stops_the_install_with_what_to_check(deploy, fedge_wheel, served, tmp_path):
    _, url, _ = served   # an empty index
    kit = _kit(deploy, fedge_wheel)
    venv = tmp_path / "opt" / ".venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, env=_ENV)
    done = _steps(kit, "install_torch", PREFIX=str(tmp_path / "opt"), VENV=str(venv), TORCH_INDEX=url)
    assert done.returncode == 1
    assert f"pip could not install torch==2.13.0 from {url}" in done.stderr


# -- the fleet owner's apps, beside fedge ---------------------------------------------------------------------------

def _device_venv(prefix: Path) -> Path:
    """A device's venv in miniature, whose torch and fedge are this interpreter's: a .pth file adds its
    site-packages (what --system-site-packages does from a plain interpreter, which this one, a venv, is not),
    so its pip too (the new venv has none of its own, whose old setuptools torch's metadata refuses), and
    bin/fedge-client is the console script pip writes for fedge."""
    venv = prefix / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120, env=_ENV)
    purelib = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (purelib / "_this_interpreter.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in site.getsitepackages()) + "\n")
    script = venv / "bin" / "fedge-client"
    script.write_text(f"#!{venv}/bin/python\nfrom edge_client.cli import entry\nentry()\n")
    script.chmod(0o755)
    return venv


def test_the_kits_app_wheel_is_installed_beside_fedge_and_listed_as_the_coordinator_has_it(
        deploy, fedge_wheel, diabetes_wheel, served, tmp_path, monkeypatch):
    _, url, _ = served   # an empty index as both indexes: the app's dependencies are installed, nothing is fetched
    monkeypatch.syspath_prepend(str(EXAMPLE))   # the coordinator's side of the app, which the kit checks it against
    importlib.invalidate_caches()
    kit = _kit(deploy, fedge_wheel, apps=(diabetes_wheel,))
    venv = _device_venv(tmp_path / "opt")
    where = {"PREFIX": str(tmp_path / "opt"), "VENV": str(venv), "TORCH_INDEX": url,
             "TORCH_PIP_ARGS": f"--index-url {url}"}
    done = _steps(kit, "install_apps", **where)
    assert done.returncode == 0, done.stdout + done.stderr
    expected = (kit / "apps" / "apps.txt").read_text().strip()   # diabetes 1.0.0 DIGEST, the coordinator's
    assert f"installing the apps diabetes from {diabetes_wheel.name} and their dependencies" in done.stdout
    assert f"app diabetes 1.0.0 (digest {expected.split()[2][:12]}) installed" in done.stdout
    assert (venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages" /
            "diabetes_app" / "__init__.py").is_file()   # in the device's venv, not on a path of this test's
    listed = subprocess.run([str(venv / "bin" / "fedge-client"), "apps"], capture_output=True, text=True,
                            timeout=120, env=_ENV)
    assert listed.returncode == 0 and expected in listed.stdout.splitlines(), listed.stderr
    again = _steps(kit, "install_apps", **where)
    assert again.returncode == 0 and "installing" not in again.stdout   # the same wheels: nothing reinstalled
    # a device whose app is not the coordinator's would refuse its tasks: the install stops, naming both
    (kit / "apps" / "apps.txt").write_text(expected[:-12] + "0" * 12 + "\n")
    other = _steps(kit, "install_apps", **where)
    assert other.returncode == 1
    assert (f"fedge-client apps does not list app diabetes 1.0.0 with digest {expected[-64:-12]}000000000000, the "
            f"coordinator's, as the kit expects; it lists diabetes 1.0.0 (digest {expected[-64:-52]})") in other.stderr
    # a wheel damaged on the way (a boot partition's FAT): refused by the kit's manifest
    with open(kit / "apps" / diabetes_wheel.name, "ab") as wheel:
        wheel.write(b"\0")
    damaged = _steps(kit, "install_apps", **where)
    assert damaged.returncode == 1 and "do not match the kit's manifest" in damaged.stderr


def test_a_kit_with_several_apps_installs_nothing_until_told_which_the_device_runs(deploy, fedge_wheel):
    kit = _kit(deploy, fedge_wheel)   # its client.env names no app
    untold = _steps(kit, "check_app_choice", FEDGE_APPS="diabetes kws")
    assert untold.returncode == 1
    assert ("this kit installs the apps diabetes kws: say which this device runs with FEDGE_APP=NAME in "
            f"{kit}/client.env") in untold.stderr
    with open(kit / "client.env", "a") as env:
        env.write("FEDGE_APP=kws\n")
    assert _steps(kit, "check_app_choice", FEDGE_APPS="diabetes kws").returncode == 0
    wrong = _steps(kit, "check_app_choice", FEDGE_APPS="diabetes tab")
    assert wrong.returncode == 1 and "FEDGE_APP=kws" in wrong.stderr and "none of this kit's apps" in wrong.stderr


# -- will it fit: memory and disk -------------------------------------------------------------------------

def _kernel_files(tmp_path: Path, cgroup_line: str, limit_file: str, limit: str) -> dict[str, str]:
    """MemTotal and a memory cgroup's limit as the kernel shows them, for a device of this test's choosing."""
    (tmp_path / "meminfo").write_text("MemTotal:        3884000 kB\nMemFree:         1000000 kB\n")
    (tmp_path / "cgroup").write_text(cgroup_line + "\n")
    path = tmp_path / "fs" / limit_file
    path.parent.mkdir(parents=True)
    path.write_text(limit + "\n")
    (path.parent.parent / path.name).write_text("max\n" if path.name == "memory.max" else "9223372036854771712\n")
    return {"MEMINFO": str(tmp_path / "meminfo"), "PROC_CGROUP": str(tmp_path / "cgroup"),
            "CGROUP_FS": str(tmp_path / "fs")}


@pytest.mark.parametrize("cgroup_line, limit_file, limit, mib", [
    ("0::/fleet/pi-07", "fleet/pi-07/memory.max", str(140 * 2**20), 140),                            # cgroup v2
    ("4:memory:/docker/pi-07", "memory/docker/pi-07/memory.limit_in_bytes", str(170 * 2**20), 170),  # cgroup v1
])
def test_a_device_capped_below_the_clients_need_is_refused_before_anything_is_installed(
        deploy, fedge_wheel, tmp_path, cgroup_line, limit_file, limit, mib):
    kit = _kit(deploy, fedge_wheel)
    kernel = _kernel_files(tmp_path, cgroup_line, limit_file, limit)
    assert _steps(kit, "memory_limit_mib", **kernel).stdout.strip() == str(mib)
    refused = _steps(kit, "check_memory", **kernel)
    assert refused.returncode == 1
    assert (f"this device lets a process use {mib} MiB (MemTotal, or a memory cgroup's limit), but fedge's client "
            "needs about 331 MiB: 260 to start (torch's import alone about 220) and 71 to train cnn") in refused.stderr
    assert "install.sh --ignore-memory" in refused.stderr
    anyway = _steps(kit, "check_memory", IGNORE_MEMORY="1", **kernel)
    assert anyway.returncode == 0 and "warning:" in anyway.stderr and "installing anyway" in anyway.stderr


def test_this_machines_memory_is_read_and_a_need_it_meets_passes(deploy, fedge_wheel):
    kit = _kit(deploy, fedge_wheel)
    have = int(_steps(kit, "memory_limit_mib").stdout)
    meminfo = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    assert 0 < have <= meminfo
    assert _steps(kit, "check_memory").returncode == 0                     # 331 MiB: this machine has more
    assert _steps(kit, "check_memory", FEDGE_NEED_MIB=str(have + 1)).returncode == 1


def test_too_little_free_disk_stops_with_the_numbers(deploy, fedge_wheel, tmp_path):
    kit = _kit(deploy, fedge_wheel)
    prefix = str(tmp_path / "not" / "made" / "yet")
    free = int(_steps(kit, f"free_mb {prefix}").stdout)
    assert abs(free - shutil.disk_usage(tmp_path).free // 2**20) < 64   # df's MB are MiB; other writers meanwhile
    short = _steps(kit, f"check_space {free + 10_000}", PREFIX=prefix)
    assert short.returncode == 1
    assert f"{prefix} needs about {free + 10_000} MB free for this install but its filesystem has" in short.stderr
    assert _steps(kit, "check_space 1", PREFIX=prefix).returncode == 0


# -- data from a URL, checked by SHA-256 ------------------------------------------------------------------

def test_data_too_large_for_the_boot_partition_is_fetched_and_checked(deploy, fedge_wheel, served, tmp_path):
    root, url, _ = served
    for device in ("pi-01", "pi-02"):
        np.savez(root / f"{device}.npz", x=np.full((4, 1, 8, 8), len(device), np.float32), y=np.arange(4))
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(subprocess.run(["sha256sum", "pi-01.npz", "pi-02.npz"], cwd=root, capture_output=True,
                                   text=True, check=True).stdout)
    kit = _kit(deploy, fedge_wheel, "pi-02", data_url=url + "{device}.npz", data_sha256=str(sums))
    state = tmp_path / "state"
    state.mkdir()
    done = _steps(kit, "install_data", STATE=str(state))
    assert done.returncode == 0, done.stderr
    assert (state / "data.npz").read_bytes() == (root / "pi-02.npz").read_bytes()
    assert "checked by SHA-256" in done.stdout
    again = _steps(kit, "install_data", STATE=str(state))
    assert "already" in again.stdout
    # another file at the URL: refused, and nothing of it left
    (state / "data.npz").unlink()
    np.savez(root / "pi-02.npz", x=np.zeros((4, 1, 8, 8), np.float32), y=np.arange(4))
    wrong = _steps(kit, "install_data", STATE=str(state))
    assert wrong.returncode == 1 and "not the" in wrong.stderr and "the kit expects" in wrong.stderr
    assert sorted(p.name for p in state.iterdir()) == []


# -- the device announced itself ---------------------------------------------------------------------------

def _client(broker: str, data: Path, tmp_path: Path, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDGE_")} | {"OMP_WAIT_POLICY": "PASSIVE"}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "edge_client.cli", "run", "--broker", broker, "--client-id",
                                 "pi-01", "--data", f"npz:{data}", "--state-dir", str(tmp_path / "state"),
                                 "--torch-threads", "1"], stdout=out, stderr=subprocess.STDOUT, env=env)


# the service's log and state, read from the client process this test started instead of journalctl
# (a process that exited but is not yet reaped counts as stopped, as systemd would say)
_WATCH = 'service_log() {{ cat {log}; }}\n' \
         'service_running() {{ local s; s=$(cut -d" " -f3 /proc/{pid}/stat 2>/dev/null); [ -n "$s" ] && [ "$s" != Z ]; }}\n' \
         'service_failure() {{ echo "it exited"; }}\nwait_online "$(date +%s)"\necho "ONLINE=$ONLINE"'


def test_the_install_waits_for_the_client_to_say_the_broker_passed_its_presence_back(deploy, fedge_wheel,
                                                                                     tmp_path):
    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    kit = _kit(deploy, fedge_wheel)
    data = tmp_path / "d.npz"
    np.savez(data, x=np.zeros((8, 1, 8, 8), np.float32), y=np.arange(8) % 2)
    with LocalMosquitto(workdir=tmp_path / "mq") as broker:
        log = tmp_path / "client.log"
        client = _client(broker.url, data, tmp_path, log)
        try:
            online = _steps(kit, _WATCH.format(log=log, pid=client.pid), WAIT_ONLINE="60")
        finally:
            client.terminate()
            client.wait(30)
    assert online.returncode == 0 and "ONLINE=yes" in online.stdout, online.stderr + log.read_text()
    # no broker where the bundle says: the client keeps trying, the install says it did not see it online
    log = tmp_path / "unreached.log"
    client = _client(f"mqtt://127.0.0.1:{free_port()}", data, tmp_path, log)
    try:
        unseen = _steps(kit, _WATCH.format(log=log, pid=client.pid), WAIT_ONLINE="3")
    finally:
        client.terminate()
        client.wait(30)
    assert unseen.returncode == 0 and "ONLINE=no" in unseen.stdout
    # a client that stops (here: its data is missing) fails the install with how long it lasted
    log = tmp_path / "stopped.log"
    client = _client(f"mqtt://127.0.0.1:{free_port()}", tmp_path / "missing.npz", tmp_path, log)
    stopped = _steps(kit, _WATCH.format(log=log, pid=client.pid), WAIT_ONLINE="60")
    client.wait(30)
    assert stopped.returncode == 1 and "fedge-client stopped" in stopped.stderr and "it exited" in stopped.stderr


def test_a_board_short_of_memory_gets_the_low_memory_settings_once(deploy, fedge_wheel, tmp_path):
    kit = _kit(deploy, fedge_wheel)
    kernel = _kernel_files(tmp_path, "0::/", "memory.max", "max")
    env = tmp_path / "client.env"
    env.write_text((kit / "client.env").read_text())
    roomy = _steps(kit, f"small_board_settings {env}", **kernel)   # 3,792 MiB: left as the kit made it
    assert roomy.returncode == 0, roomy.stderr
    assert "MALLOC" not in env.read_text()
    (tmp_path / "meminfo").write_text("MemTotal:         427000 kB\n")   # a Pi Zero 2 W after the GPU's share
    small = _steps(kit, f"small_board_settings {env} && small_board_settings {env}", **kernel)
    assert small.returncode == 0, small.stderr
    text = env.read_text()
    assert "416 MiB, under 1024: the service gets the low-memory settings" in small.stdout
    for setting in ("MALLOC_MMAP_THRESHOLD_=65536", "MALLOC_TRIM_THRESHOLD_=0", "THP_MEM_ALLOC_ENABLE=1"):
        assert text.count(setting + "\n") == 1
