"""The CPU a cell ran on, the instruction set torch's kernels used there, and pinning that set.

torch chooses its CPU kernels when it loads, by what the CPU offers: ATen's vectorized loops
(AVX-512, AVX2 or plain), oneDNN's convolutions (compiled at run time for the widest set allowed) and
MKL's matrix products (by the CPU's maker and set). A wider register adds a sum's terms in another
order, so one cell run with AVX-512 and with AVX2 departs in the last bits of round 1 and by tenths of a
point of accuracy after 100 rounds. A run file therefore records the CPU (:func:`cpu_facts`) and the set
in force (:func:`in_force`), and a cell can run under a pin (:data:`PINS`): environment variables that
cap all three libraries at one set. They are read once, when torch loads, so a pinned run starts a
fresh Python process with them (:func:`reexec_under`); setting them after ``import torch`` does nothing.

This module imports no torch at its top: a harness calls :func:`reexec_under` before torch is loaded.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["PINS", "NATIVE", "ISA_ENV", "VECTOR_FLAGS", "IsaError", "cpu_facts", "in_force", "held", "holds",
           "pinned_environment", "require", "reexec_under", "check_in_force"]

NATIVE = "native"   # no pin: each library takes the widest set the CPU has

# What each pin sets. ATen (ATEN_CPU_CAPABILITY: default, avx2, avx512) and oneDNN (ONEDNN_MAX_CPU_ISA: SSE41,
# AVX, AVX2, AVX512_CORE, ...) are capped at the named set. MKL takes an ISA cap only on Intel CPUs; its
# COMPATIBLE branch (MKL_CBWR) is the one it keeps the same on every x86-64 CPU, Intel or not, so both pins use it.
PINS: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "COMPATIBLE"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_CBWR": "COMPATIBLE"},
}
# The /proc/cpuinfo flags a pin needs: ATen's own test for its AVX2 and AVX-512 kernels (it does not check a set
# forced by ATEN_CPU_CAPABILITY: on a CPU without it the process dies of an illegal instruction), and oneDNN's.
_NEEDS = {"avx2": ("avx2", "fma"),
          "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "fma")}
# The capability torch reports under each pin (torch.backends.cpu.get_cpu_capability()).
_CAPABILITY = {"avx2": "AVX2", "avx512": "AVX512"}

# Every variable that caps a library's set; recorded when set. DNNL_MAX_CPU_ISA is oneDNN's older name, read when
# ONEDNN_MAX_CPU_ISA is not set; MKL_ENABLE_INSTRUCTIONS caps MKL on Intel CPUs.
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")

# The flags that decide which kernels run: x86-64 vector and matrix extensions, and arm64's (Jetson, Raspberry Pi).
VECTOR_FLAGS = ("sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512dq", "avx512cd",
                "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                "amx_int8", "amx_fp16", "asimd", "asimdhp", "asimddp", "sve", "sve2", "bf16", "i8mm")


class IsaError(RuntimeError):
    """A pin that is unknown, that this CPU cannot run, or that did not take effect."""


def _first_processor(text: str) -> dict[str, str]:
    """The ``key: value`` lines of /proc/cpuinfo's first processor block, and the lines after the last block
    (an arm64 board's ``Hardware`` and ``Model`` come there)."""
    blocks = [b for b in text.split("\n\n") if b.strip()]
    fields: dict[str, str] = {}
    for block in blocks[:1] + blocks[-1:]:
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields.setdefault(key.strip(), value.strip())
    return fields


def _caches(root: Path) -> dict[str, str]:
    """CPU 0's caches by level (``{"L1d": "32K", "L2": "1024K", ...}``): oneDNN sizes its blocks by them."""
    found = {}
    for index in sorted(root.glob("index*")):
        try:
            level, kind, size = ((index / f).read_text().strip() for f in ("level", "type", "size"))
        except OSError:
            continue
        found[f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")] = size
    return found


def cpu_facts(cpuinfo: str | None = None, cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")
              ) -> dict[str, Any]:
    """What identifies the CPU for its kernels: its model name, maker and family/model/stepping (a virtual
    machine's model name can be as vague as "AMD EPYC"; the numbers name the generation), the vector extensions
    of :data:`VECTOR_FLAGS` it has, and its cache sizes. ``cpuinfo``: the text of /proc/cpuinfo (read when None;
    a system without it gives what ``platform`` knows)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    fields = _first_processor(cpuinfo)
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    if fields.get("vendor_id"):
        ident = " ".join(f"{name} {fields[key]}" for name, key in (("family", "cpu family"), ("model", "model"),
                                                                  ("stepping", "stepping")) if key in fields)
        ident = f"{fields['vendor_id']} {ident}".strip()
    else:   # arm64: the implementer and part numbers
        ident = " ".join(f"{key.lower().replace('cpu ', '')} {fields[key]}" for key in
                         ("CPU implementer", "CPU architecture", "CPU variant", "CPU part", "CPU revision")
                         if key in fields)
    return {"cpu_model": fields.get("model name") or fields.get("Model") or fields.get("Hardware")
            or platform.processor() or "unknown",
            "cpu_id": ident or "unknown",
            "cpu_flags": [f for f in VECTOR_FLAGS if f in flags],
            "cpu_caches": _caches(cache_dir)}


def in_force(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The set torch's kernels use in this process (``torch_cpu_capability``: "AVX512", "AVX2", "DEFAULT", ...)
    and the variables of :data:`ISA_ENV` that are set (``isa_env``)."""
    import torch

    environ = os.environ if environ is None else environ
    return {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa_env": {k: environ[k] for k in ISA_ENV if k in environ}}


def held(environ: Mapping[str, str] | None = None) -> str | None:
    """The pin ``environ`` holds (every variable of one of :data:`PINS` at its value, and no other cap of
    :data:`ISA_ENV` beside them), or None."""
    environ = os.environ if environ is None else environ
    for name, values in PINS.items():
        if all(environ.get(k) == v for k, v in values.items()) and \
                not any(k in environ for k in ISA_ENV if k not in values):
            return name
    return None


def holds(isa: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``environ`` (this process's when None) is under ``isa``: its pin, or for "native" no cap at all."""
    environ = os.environ if environ is None else environ
    if isa == NATIVE:
        return not any(k in environ for k in ISA_ENV)
    return held(environ) == isa


def pinned_environment(isa: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``environ`` (this process's when None) under ``isa``: one of :data:`PINS` set (and the other caps
    of :data:`ISA_ENV` removed, so that nothing else caps a library), or, for "native", every cap removed."""
    if isa != NATIVE and isa not in PINS:
        raise IsaError(f"unknown instruction set {isa!r}: pin one of {', '.join(PINS)}, or {NATIVE!r} for none")
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in ISA_ENV}
    env.update(PINS.get(isa, {}))
    return env


def require(isa: str, flags: list[str] | None = None) -> None:
    """Raise IsaError unless this CPU (or one with ``flags``) can run ``isa``: a cap above what the CPU has would
    not be a pin (oneDNN and MKL fall back to what there is; ATen would crash)."""
    if isa == NATIVE:
        return
    if isa not in PINS:
        raise IsaError(f"unknown instruction set {isa!r}: pin one of {', '.join(PINS)}, or {NATIVE!r} for none")
    if platform.machine().lower() not in ("x86_64", "amd64") and flags is None:
        raise IsaError(f"{isa} is an x86-64 instruction set and this is {platform.machine()}: run the cell "
                       f"unpinned (--isa {NATIVE}) and compare it with files from the same kind of CPU")
    have = set(cpu_facts()["cpu_flags"] if flags is None else flags)
    missing = [f for f in _NEEDS[isa] if f not in have]
    if missing:
        lower = [name for name in PINS if name != isa and all(f in have for f in _NEEDS[name])]
        raise IsaError(f"this CPU lacks {', '.join(missing)}, which the {isa} pin needs: "
                       + (f"pin {lower[0]} instead, or run" if lower else "run") + " on a CPU that has them")


def reexec_under(isa: str | None, argv: list[str] | None = None) -> None:
    """Make this process run under ``isa`` (None: leave it as it is): when the environment does not hold it
    already, start the same command again (``sys.argv``, or ``argv``) under :func:`pinned_environment`, in place
    of this process; torch reads the variables only when it loads. Returns when nothing needs to change."""
    if isa is None or holds(isa):
        return
    require(isa)
    sys.stdout.flush()
    sys.stderr.flush()
    args = [sys.executable, *(sys.argv if argv is None else argv)]
    os.execve(sys.executable, args, pinned_environment(isa))


def check_in_force(isa: str | None) -> None:
    """Raise IsaError unless torch's kernels in this process are those of ``isa`` (None or "native": nothing to
    check): a pin set after torch loaded is ignored without a word."""
    if isa is None or isa == NATIVE:
        return
    import torch

    got = torch.backends.cpu.get_cpu_capability()
    if got != _CAPABILITY[isa]:
        raise IsaError(f"torch uses its {got} kernels although the {isa} pin is set: the variables were set after "
                       "torch loaded; set them before Python starts (or let the harness start itself again)")


if __name__ == "__main__":   # what this machine has and uses: python bench/isa.py
    import json

    print(json.dumps({**cpu_facts(), **in_force(), "pin": held()}, indent=1))
