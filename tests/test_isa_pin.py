"""Run files say which CPU and instruction set they ran with, a pin caps torch's kernels at one set, and
bench/reproduce.py tells a re-run on another CPU from a regression.

torch's kernels add in another order on an AVX-512 CPU than on an AVX2 one, so a cell gives the same bits
only on the same instruction set; these tests hold the recording, the wording and the pin's environment.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import isa  # noqa: E402
import reproduce  # noqa: E402
from coordinator.config import ConfigError  # noqa: E402
from provenance import machine  # noqa: E402
from run_matrix import load_matrix  # noqa: E402

INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
stepping\t: 8
flags\t\t: fpu sse4_1 sse4_2 avx avx2 fma f16c avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16 \
amx_tile amx_bf16 amx_int8 avx512_fp16

processor\t: 1
vendor_id\t: GenuineIntel
"""
PI4 = """processor\t: 0
BogoMIPS\t: 108.00
Features\t: fp asimd evtstrm crc32 cpuid
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x0
CPU part\t: 0xd08
CPU revision\t: 3

Hardware\t: BCM2835
Model\t\t: Raspberry Pi 4 Model B Rev 1.4
"""
AVX512_HOST = {"arch": "x86_64", "cpus": 2, "torch_threads": 2, "cpu_model": "AMD EPYC",
               "cpu_id": "AuthenticAMD family 25 model 17 stepping 1",
               "cpu_flags": ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl"],
               "cpu_caches": {"L1d": "32K", "L2": "1024K"}, "torch_cpu_capability": "AVX512", "isa_env": {}}
AVX2_HOST = {**AVX512_HOST, "cpu_model": "Intel(R) Core(TM) i7-8700", "cpu_id": "GenuineIntel family 6 model 158",
             "cpu_flags": ["sse4_2", "avx", "avx2", "fma"], "cpu_caches": {"L1d": "32K", "L2": "256K"},
             "torch_cpu_capability": "AVX2"}


def test_the_machine_record_holds_the_cpu_and_the_set_in_force():
    record = machine()
    assert set(reproduce.CPU_KEYS) <= set(record)
    assert record["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert isinstance(record["cpu_flags"], list) and set(record["cpu_flags"]) <= set(isa.VECTOR_FLAGS)
    assert set(record["isa_env"]) <= set(isa.ISA_ENV)
    json.dumps(record)   # it goes into a JSON run file as it is


def test_cpu_facts_name_the_model_generation_extensions_and_caches(tmp_path):
    for level, kind, size in ((1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K")):
        index = tmp_path / f"index{level}{kind[0]}"
        index.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (index / name).write_text(f"{value}\n")
    intel = isa.cpu_facts(INTEL, tmp_path)
    assert intel["cpu_model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert intel["cpu_id"] == "GenuineIntel family 6 model 143 stepping 8"
    assert intel["cpu_flags"] == ["sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq",
                                  "avx512cd", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                                  "amx_tile", "amx_bf16", "amx_int8"]   # fpu is not a vector extension
    assert intel["cpu_caches"] == {"L1d": "48K", "L1i": "32K", "L2": "2048K"}
    pi = isa.cpu_facts(PI4, tmp_path / "absent")
    assert pi["cpu_model"] == "Raspberry Pi 4 Model B Rev 1.4" and pi["cpu_flags"] == ["asimd"]
    assert pi["cpu_id"] == "implementer 0x41 architecture 8 variant 0x0 part 0xd08 revision 3"
    assert pi["cpu_caches"] == {}


def test_reproduce_says_which_cpu_facts_differ_and_that_the_difference_may_come_from_them():
    notes = reproduce.cpu_differences(AVX512_HOST, AVX2_HOST)
    assert notes[0] == ("torch's CPU kernels: AVX512 recorded, AVX2 here (another instruction set adds in another "
                        "order)")
    assert "vector extensions: the recorded CPU had avx512f, avx512bw, avx512vl, this one has not" in notes
    assert any(n.startswith("another CPU: AMD EPYC (AuthenticAMD family 25 model 17 stepping 1) recorded, "
                            "Intel(R) Core(TM) i7-8700") for n in notes)
    assert any(n.startswith("caches: L1d=32K L2=1024K recorded, L1d=32K L2=256K here") for n in notes)
    said = reproduce.verdict(AVX512_HOST, AVX2_HOST)
    assert said.startswith("not the recorded CPU or instruction set (torch's CPU kernels: AVX512 recorded, AVX2 here")
    assert "may come from that rather than from the code" in said

    pinned = {**AVX512_HOST, "torch_cpu_capability": "AVX2", "isa_env": dict(isa.PINS["avx2"])}
    assert reproduce.cpu_differences(pinned, AVX512_HOST) == [
        "torch's CPU kernels: AVX2 recorded, AVX512 here (another instruction set adds in another order)",
        "instruction-set caps: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=COMPATIBLE recorded, "
        "none here"]


def test_on_the_same_cpu_and_set_a_difference_is_a_regression_and_an_old_file_cannot_tell():
    assert reproduce.cpu_differences(AVX512_HOST, dict(AVX512_HOST)) == []
    assert reproduce.verdict(AVX512_HOST, dict(AVX512_HOST)) == (
        "same CPU and instruction set as recorded: not the machine, a regression (in the code, or in a library the "
        "notes above name)")
    assert reproduce.verdict(AVX512_HOST, {**AVX512_HOST, "torch_threads": 1}).startswith(
        "same CPU and instruction set, other torch_threads")
    old = {"arch": "x86_64", "cpus": 2, "torch_threads": 2}   # a run file written before the CPU was recorded
    assert reproduce.cpu_differences(old, AVX512_HOST)[0].startswith(
        "it predates the recording of the CPU and its instruction set")
    assert reproduce.verdict(old, AVX512_HOST).startswith("the file does not record its CPU")
    assert reproduce.verdict({}, AVX512_HOST).startswith("the file does not record its CPU")


def test_a_pin_sets_every_cap_and_removes_the_others():
    base = {"PATH": "/bin", "DNNL_MAX_CPU_ISA": "AVX512_CORE", "MKL_ENABLE_INSTRUCTIONS": "AVX512"}
    env = isa.pinned_environment("avx2", base)
    assert env == {"PATH": "/bin", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                   "MKL_CBWR": "COMPATIBLE"}
    assert isa.held(env) == "avx2" and isa.holds("avx2", env) and not isa.holds(isa.NATIVE, env)
    assert isa.pinned_environment("avx512", base)["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    assert isa.pinned_environment("avx512", base)["ATEN_CPU_CAPABILITY"] == "avx512"
    assert isa.pinned_environment(isa.NATIVE, env) == {"PATH": "/bin"}
    assert isa.held(base) is None and isa.held({**env, "DNNL_MAX_CPU_ISA": "AVX2"}) is None
    assert isa.holds(isa.NATIVE, {"PATH": "/bin"})
    with pytest.raises(isa.IsaError, match="unknown instruction set 'sse2': pin one of avx2, avx512"):
        isa.pinned_environment("sse2", base)


def test_a_pin_this_cpu_cannot_run_is_refused_with_the_one_it_can():
    isa.require("avx2", flags=["avx2", "fma"])
    with pytest.raises(isa.IsaError, match="lacks avx512f, avx512bw, avx512vl, avx512dq, avx512cd, which the avx512 "
                                           "pin needs: pin avx2 instead"):
        isa.require("avx512", flags=["avx", "avx2", "fma"])
    with pytest.raises(isa.IsaError, match="lacks avx2, fma, which the avx2 pin needs: run on a CPU"):
        isa.require("avx2", flags=["avx"])


def test_the_harness_starts_itself_again_under_a_pin_it_does_not_hold(monkeypatch):
    started = []
    monkeypatch.setattr(isa.os, "execve", lambda path, args, env: started.append((path, args, env)))
    monkeypatch.setattr(isa, "require", lambda pin: None)
    for name in isa.ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    isa.reexec_under("avx2", ["bench/run_matrix.py", "m.toml"])
    (path, args, env), = started
    assert args[1:] == ["bench/run_matrix.py", "m.toml"] and env["ATEN_CPU_CAPABILITY"] == "avx2"
    isa.reexec_under(None)
    isa.reexec_under(isa.NATIVE)   # nothing capped already
    for name, value in isa.PINS["avx2"].items():
        monkeypatch.setenv(name, value)
    isa.reexec_under("avx2")
    assert len(started) == 1


def test_a_pin_set_after_torch_loaded_is_caught():
    now = torch.backends.cpu.get_cpu_capability()
    other = [name for name, capability in isa._CAPABILITY.items() if capability != now]
    isa.check_in_force(isa.NATIVE)
    with pytest.raises(isa.IsaError, match="set after torch loaded"):
        isa.check_in_force(other[0])


def test_torch_takes_the_pin_when_it_loads_under_it():
    try:
        isa.require("avx2")
    except isa.IsaError as exc:
        pytest.skip(str(exc))
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                          env=isa.pinned_environment("avx2"), capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "AVX2"


def test_reproduce_reruns_a_pinned_file_under_its_pin(tmp_path, monkeypatch):
    run_file = tmp_path / "c-s0-r1.json"
    run_file.write_text(json.dumps({"config": {"run": {"rounds": 1}}, "rows": [{"round": 0}], "seed": 0, "rounds": 1,
                                    "isa": "avx2", "machine": AVX2_HOST}))
    ran = []
    monkeypatch.setattr(reproduce.subprocess, "run", lambda command, env, check:
                        ran.append((command, env)) or subprocess.CompletedProcess(command, 1))
    monkeypatch.setattr(isa, "require", lambda pin: None)
    for name in isa.ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    assert reproduce.main([str(run_file), "--rounds", "1"]) == 1   # the status of the process under the pin
    (command, env), = ran
    assert command[-5:] == [str(run_file), "--isa", "avx2", "--rounds", "1"]
    assert isa.held(env) == "avx2"


def test_a_matrix_pins_its_cells(tmp_path):
    matrix = tmp_path / "m.toml"
    matrix.write_text('name = "m"\nisa = "avx2"\nseeds = [0]\n[base.run]\nrounds = 2\n')
    assert load_matrix(matrix).isa == "avx2"
    matrix.write_text('name = "m"\nisa = "sse"\n')
    with pytest.raises(ConfigError, match="isa must be one of 'avx2', 'avx512'"):
        load_matrix(matrix)


def test_the_pin_note_comes_before_the_run(monkeypatch):
    for name in isa.ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    notes = reproduce._provenance_notes({"isa": "avx2", "machine": AVX2_HOST, "source": {}})
    assert "it ran under the avx2 pin, this process runs unpinned: expect a difference" in notes
    assert not any(n.startswith("cpu_") or n.startswith("torch_cpu") for n in notes)   # said in words, not as keys
