"""The emulated device's federated runs and its serving check (stages of bench/arm_device.py).

``runs``: a TLS Mosquitto from the cached deployment, two x86 device processes and the aarch64
device started the way its systemd unit starts it (the unit's environment, ``EnvironmentFile``,
``ExecStart``, user and credentials, inside the arm64 root), a FedAvg run and a SphereFed + FFC
run with ``topk:0.1+int8+zstd`` uploads, then one task replayed on both architectures.
``serve``: the FedAvg run's ONNX model served by ``fedge-profile infer`` from the infer-only venv.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import torch
from safetensors.torch import load_file

from arm.fleet_files import ARM_DEVICE, DEVICES, ensure_data
from arm.install import INFER_VENV, timed
from arm.rootfs import ArmError, chroot_cmd, emulated_cpu
from coordinator.ops.mosquitto import LocalMosquitto

__all__ = ["runs", "serve", "unit_command", "cpu_check"]

UNIT = "etc/systemd/system/fedge-client.service"
CREDENTIALS = "/run/credentials/fedge-client.service"
STATE = "/var/lib/fedge"
PYTHON = sys.executable
BIN = Path(PYTHON).parent
RUNS = {
    "fedavg": ["--set", "run.strategy=fedavg"],
    "spherefed_ffc": ["--set", "run.strategy=spherefed", "--set", "codec.up=topk:0.1+int8+zstd"],
}
ROUNDS = 5


def _env_line(value: str) -> tuple[str, str]:
    key, _, val = value.partition("=")
    return key.strip(), val.strip().strip('"')


def unit_command(root: Path) -> tuple[list[str], dict[str, str], str]:
    """(argv, environment, user) of the installed unit's ExecStart, expanded the way systemd does for it."""
    env = {"CREDENTIALS_DIRECTORY": CREDENTIALS, "STATE_DIRECTORY": STATE}
    exec_start, user = "", "root"
    for line in (root / UNIT).read_text().splitlines():
        key, _, value = line.partition("=")
        if key == "Environment":
            env.update([_env_line(value)])
        elif key == "EnvironmentFile":
            path = root / value.lstrip("-").lstrip("/")
            if path.exists():
                env.update(_env_line(v) for v in path.read_text().splitlines() if v.strip() and not v.startswith("#"))
        elif key == "ExecStart":
            exec_start = value
        elif key == "User":
            user = value
    argv = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word) for word in exec_start.split()]
    return argv, env, user


def _credentials(root: Path, user: str) -> None:
    """What systemd's LoadCredential does: a private, read-only copy of the bundle for the service's user."""
    folder = root / CREDENTIALS.lstrip("/")
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "bundle.toml"
    shutil.copy2(root / "etc/fedge/bundle.toml", target)
    uid, gid = _ids(root, user)
    os.chown(folder, uid, gid)
    os.chmod(folder, 0o500)
    os.chown(target, uid, gid)
    os.chmod(target, 0o400)


def _ids(root: Path, user: str) -> tuple[int, int]:
    for line in (root / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == user:
            return int(fields[2]), int(fields[3])
    raise ArmError(f"user {user} does not exist in the arm64 root: the flash kit did not run")


def _start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True)


def _stop(procs: list[subprocess.Popen], grace: float = 120.0) -> list[int | None]:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return [p.returncode for p in procs]


def _coordinator(cache: Path, name: str, data: dict[str, Path], log: Path) -> dict:
    deploy = cache / "deploy"
    out = cache / "runs" / name
    if out.exists():
        shutil.rmtree(out)
    env = dict(os.environ, FEDGE_MQTT_PASSWORD=(deploy / "coordinator" / "password").read_text().strip())
    cmd = [str(BIN / "fedge-coordinator"), "run", "--config", str(deploy / "coordinator" / "coordinator.toml"),
           "--clients", str(len(DEVICES)), "--data", f"npz:{data['eval']}", "--rounds", str(ROUNDS),
           "--out", str(out), "--set", "model.name=cnn", "--set", "clients.presence_timeout=1800",
           "--set", "clients.round_timeout=900", "--set", "run.seed=0", *RUNS[name]]
    print(f"  {name}: {ROUNDS} rounds, 3 devices (one aarch64, emulated)")
    t = time.monotonic()
    done = subprocess.run(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    if done.returncode != 0:
        raise ArmError(f"the {name} run failed ({done.returncode}); see {log} and {out}/coordinator.log")
    return _run_facts(out, time.monotonic() - t)


def _run_facts(out: Path, seconds: float) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in rows if r.get("round", 0) >= 1]
    summary = json.loads((out / "summary.json").read_text())
    per_device = {}
    for device in DEVICES:
        tasks = [json.loads(line) for line in (out / "clients" / f"{device}.jsonl").read_text().splitlines()]
        train = [t for t in tasks if t.get("objective") != "ffc_stats"]
        facts = json.loads((out / "clients" / f"{device}.json").read_text())
        per_device[device] = {
            "arch": (facts.get("device") or {}).get("arch"),
            "tasks": len(tasks), "errors": sum(1 for t in tasks if t.get("error")),
            "late": sum(1 for t in tasks if t.get("late")),
            "task_seconds": [round(t["profile"]["seconds"], 2) for t in train if t.get("profile")],
            "peak_rss_mb": max((t["profile"].get("peak_rss_bytes") or 0 for t in tasks if t.get("profile")),
                               default=0) / 2**20,
            "bytes_up": [r["bytes_per_client"].get(device, {}).get("up") for r in rounds if "bytes_per_client" in r]}
    return {"seconds": round(seconds, 1), "rounds": len(rounds),
            "all_devices_every_round": all(r["returned"] == len(DEVICES) for r in rounds),
            "rejected": sum(r.get("rejected", 0) for r in rounds), "failed": sum(r.get("failed", 0) for r in rounds),
            "accuracy": [round(r["test_accuracy"], 4) for r in rounds if "test_accuracy" in r],
            "final_accuracy": summary["final_accuracy"], "model": summary["model"],
            "ffc": {k: rows[-1][k] for k in ("ffc_accuracy_before", "ffc_accuracy_after", "ffc_returned")
                    if k in rows[-1]},
            "devices": per_device, "export": summary.get("export"), "out": str(out)}


_LINEAR = ("import torch; print(torch.nn.functional.linear(torch.ones(1, 16), "
           "torch.arange(32.).reshape(2, 16)).tolist())")


def cpu_check(root: Path, log: Path) -> dict:
    """One dot product on qemu's default CPU and on the emulated one; x86 gives [[120.0, 376.0]]."""
    out = {}
    for cpu in ("max", emulated_cpu()):
        got = timed(chroot_cmd(root, ["/opt/fedge/.venv/bin/python", "-c", _LINEAR], env={"QEMU_CPU": cpu}), log)
        lines = [line for line in str(got["output"]).splitlines() if line.startswith("[[")]
        out[cpu] = lines[-1] if lines else f"failed ({got['returncode']})"
    out["x86_64"] = str(torch.nn.functional.linear(torch.ones(1, 16), torch.arange(32.).reshape(2, 16)).tolist())
    return out


def runs(cache: Path, root: Path, port: int, log: Path) -> dict:
    data = ensure_data(cache / "data")
    deploy = cache / "deploy"
    work = cache / "runs"
    work.mkdir(exist_ok=True)
    broker = LocalMosquitto(workdir=work / "broker", config=(deploy / "broker" / "fedge.conf").read_text(), port=port)
    argv, env, user = unit_command(root)
    _credentials(root, user)
    state = root / STATE.lstrip("/")
    (state / "profile.jsonl").unlink(missing_ok=True)
    procs: list[subprocess.Popen] = []
    result: dict = {"emulated_cpu": emulated_cpu(), "cpu_check": cpu_check(root, log), "unit_exec": " ".join(argv),
                    "unit_env": {k: v for k, v in env.items() if k.startswith(("MALLOC", "FEDGE_"))}}
    broker.start()
    try:
        uid, gid = _ids(root, user)
        service_env = {**env, "HOME": STATE}
        procs.append(_start(chroot_cmd(root, argv, user=f"{uid}:{gid}", env=service_env), work / f"{ARM_DEVICE}.log"))
        for device in DEVICES:
            if device != ARM_DEVICE:
                procs.append(_start([str(BIN / "fedge-client"), "run", "--bundle", str(deploy / "devices" /
                                     f"{device}.toml"), "--data", f"npz:{data[device]}", "--state-dir",
                                     str(work / f"state-{device}"), "--torch-threads", "1"], work / f"{device}.log"))
        for name in RUNS:
            result[name] = _coordinator(cache, name, data, log)
            print(f"    accuracy per round {result[name]['accuracy']}, all devices every round: "
                  f"{result[name]['all_devices_every_round']}")
    finally:
        result["device_exit_codes"] = dict(zip([ARM_DEVICE, *[d for d in DEVICES if d != ARM_DEVICE]], _stop(procs)))
        broker.stop()
    profile = [json.loads(line) for line in (state / "profile.jsonl").read_text().splitlines()]
    result["arm_profile"] = {"lines": len(profile), "arch": sorted({str(p.get("arch")) for p in profile})}
    result["cross_architecture"] = replay(cache, root, data, log)
    return result


def replay(cache: Path, root: Path, data: dict[str, Path], log: Path) -> dict:
    """The arm device's round-2 task of the FedAvg run, replayed on x86 and on aarch64: tensors compared."""
    run = cache / "runs" / "fedavg"
    spec = json.dumps(json.loads((run / "summary.json").read_text())["model"])
    train = tomllib.loads((run / "config.toml").read_text())["train"]
    hyper = json.dumps({k: train[k] for k in ("lr", "momentum", "epochs", "batch_size", "weight_decay",
                                              "max_grad_norm")})
    inside = Path("/tmp/fedge-replay")
    host_dir, arm_dir = cache / "replay" / "x86_64", root / "tmp/fedge-replay/out"
    for folder in (host_dir, arm_dir, root / inside.relative_to("/")):
        folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(run / "checkpoints" / "round_0001.safetensors", root / "tmp/fedge-replay/global.safetensors")
    shutil.copy2(data[ARM_DEVICE], root / "tmp/fedge-replay/data.npz")
    script = Path(__file__).with_name("replay_task.py")
    shutil.copy2(script, root / "tmp/fedge-replay/replay_task.py")
    common = ["--spec", spec, "--hyper", hyper, "--codec", "topk:0.1+int8+zstd"]
    host = timed([PYTHON, str(script), "--checkpoint", str(run / "checkpoints" / "round_0001.safetensors"),
                  "--data", f"npz:{data[ARM_DEVICE]}", "--out", str(host_dir), *common], log)
    arm = timed(chroot_cmd(root, ["/opt/fedge/.venv/bin/python", "/tmp/fedge-replay/replay_task.py", "--checkpoint",
                                  "/tmp/fedge-replay/global.safetensors", "--data", "npz:/tmp/fedge-replay/data.npz",
                                  "--out", "/tmp/fedge-replay/out", *common]), log)
    if host["returncode"] or arm["returncode"]:
        raise ArmError(f"the replayed task failed (x86 {host['returncode']}, aarch64 {arm['returncode']}); see {log}")
    return compare(host_dir, arm_dir)


def compare(x86: Path, arm: Path) -> dict:
    """Largest differences between the two machines' trained weights and wire tensors."""
    out = {"facts": {"x86_64": json.loads((x86 / "facts.json").read_text()),
                     "aarch64": json.loads((arm / "facts.json").read_text())}}
    for name in ("trained", "wire"):
        a, b = load_file(str(x86 / f"{name}.safetensors")), load_file(str(arm / f"{name}.safetensors"))
        same_keys = set(a) == set(b)
        diffs = {k: float((a[k].double() - b[k].double()).abs().max()) for k in a if k in b and a[k].shape == b[k].shape
                 and a[k].dtype != torch.uint8}
        equal = sum(1 for k in a if k in b and a[k].shape == b[k].shape and torch.equal(a[k], b[k]))
        out[name] = {"same_names_and_shapes": same_keys and all(a[k].shape == b[k].shape for k in a),
                     "tensors": len(a), "bitwise_equal_tensors": equal,
                     "max_abs_diff": max(diffs.values(), default=0.0)}
    return out


def serve(cache: Path, root: Path, port: int, log: Path) -> dict:
    """The FedAvg run's ONNX model on aarch64, from the venv with the infer extra alone."""
    run = cache / "runs" / "fedavg"
    summary = json.loads((run / "summary.json").read_text())
    export = summary.get("export") or {}
    if not export.get("onnx"):
        raise ArmError(f"{run} has no exported ONNX model: run the runs stage first")
    data = ensure_data(cache / "data")
    inside = root / "tmp/fedge-serve"
    if inside.exists():
        shutil.rmtree(inside)
    inside.mkdir(parents=True)
    shutil.copy2(export["onnx"], inside / "model.onnx")
    shutil.copy2(data["eval"], inside / "eval.npz")
    got = timed(chroot_cmd(root, [f"{INFER_VENV}/bin/fedge-profile", "infer", "/tmp/fedge-serve/model.onnx",
                                  "--data", "npz:/tmp/fedge-serve/eval.npz", "--runs", "50", "--warmup", "5",
                                  "--state-dir", "/tmp/fedge-serve/state"]), log)
    if got["returncode"] != 0:
        raise ArmError(f"fedge-profile infer failed on aarch64; see {log}")
    records = [json.loads(line) for line in (inside / "state" / "profile.jsonl").read_text().splitlines()]
    return {"printed": str(got["output"]).strip().splitlines()[-12:], "record": records[-1],
            "coordinator_onnx_accuracy": export.get("test_accuracy"), "wall_s": got["wall_s"], "cpu_s": got["cpu_s"]}
