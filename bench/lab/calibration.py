"""How fast each emulated board is, from published figures, and how many of this machine's cores one
unit of that speed is worth. Pure arithmetic, so the figures behind the fleet file can be checked.

Relative speeds (Raspberry Pi Zero 2 W = 1.0) come from neural-network benchmarks run on both boards
of a pair, never from integer benchmarks such as sysbench: the lab's work is FP32 training. Where a
source measured a board at another clock than the fleet's, the ratio is scaled by clock, which is an
upper bound (memory does not speed up with the core). The absolute scale comes
from one published training time (:data:`ANCHOR`) and a measurement of the same work on this
machine (``bench/lab_calibration.py``). The sources' titles and what was taken from each are in
docs/edge-lab.md ("Calibration").
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

__all__ = ["SPEEDS", "NCNN_PI3BPLUS_MS", "NCNN_PI4_MS", "NCNN_ZERO2W_MS", "NCNN_PI5_MS", "ANCHOR", "Anchor",
           "time_ratios", "median_ratio", "clock_scaled", "derived_speeds", "share_for", "calibrated_cpu_scale", "time_dilation",
           "projected_seconds"]

# The relative speeds taken, per class of bench/fleets/mixed.toml (which must match them): what
# :func:`derived_speeds` gives per source, rounded, with the choice made where sources disagree.
SPEEDS = {"pi-zero-2w": 1.0, "pi4-2gb": 2.6, "pi4-4gb": 3.1, "pi4-8gb": 3.1, "pi5-4gb": 6.2, "orin-nano": 6.7}

# benchncnn, 4 threads, FP32 models, average ms (Tencent/ncnn benchmark/README.md): the Pi 3 Model B+
# (Cortex-A53 at 1.4 GHz) and the Pi 4 Model B (Cortex-A72 at 1.5 GHz) entries.
NCNN_PI3BPLUS_MS = {"squeezenet": 108.96, "mobilenet": 152.31, "mobilenet_v2": 194.50, "shufflenet": 91.75,
                    "googlenet": 303.24, "resnet18": 416.54, "alexnet": 276.13, "vgg16": 1902.28}
NCNN_PI4_MS = {"squeezenet": 58.73, "mobilenet": 86.01, "mobilenet_v2": 75.84, "shufflenet": 37.98,
               "googlenet": 176.24, "resnet18": 233.89, "alexnet": 183.05, "vgg16": 988.65}
# benchncnn, 4 threads, FP32 models, average ms (nnn112358/ncnn_benchmark_test): a Zero 2 W on 64-bit
# Raspberry Pi OS (bookworm) and a Pi 5, with the same recent ncnn.
NCNN_ZERO2W_MS = {"squeezenet": 95.22, "mobilenet": 127.40, "mobilenet_v2": 129.15, "mobilenet_v3": 98.33,
                  "shufflenet": 67.21, "shufflenet_v2": 52.57, "mnasnet": 112.34, "proxylessnasnet": 118.76,
                  "efficientnet_b0": 155.99, "efficientnetv2_b0": 172.09, "regnety_400m": 135.91,
                  "blazeface": 17.60, "googlenet": 265.41, "resnet18": 314.21, "alexnet": 188.94}
NCNN_PI5_MS = {"squeezenet": 6.67, "mobilenet": 9.62, "mobilenet_v2": 9.69, "mobilenet_v3": 7.25,
               "shufflenet": 5.43, "shufflenet_v2": 4.44, "mnasnet": 7.77, "proxylessnasnet": 8.28,
               "efficientnet_b0": 20.63, "efficientnetv2_b0": 12.36, "regnety_400m": 9.13, "blazeface": 2.11,
               "googlenet": 21.74, "resnet18": 17.69, "alexnet": 19.15}

# Clocks (GHz) of the boards as the sources ran them and as the fleet emulates them.
CLOCK_GHZ = {"pi3bplus": 1.4, "zero2w": 1.0, "pi4-early": 1.5, "pi4": 1.8, "orin-nano": 1.5, "orin-nano-super": 1.7}

PI4_OVER_PI3_HACKSTER = 2.0      # about 2x in TensorFlow inference, Pi 4 against the Pi 3 (Hackster, 2019)
PI5_OVER_PI4_FLOWER = 2.0        # 2x in PyTorch training across the models (Flower blog, 2023)
ORIN_SUPER_TOKENS_S, PI4_TOKENS_S = 87.0, 35.3   # llama.cpp on the CPU, 4 threads (hybridgroup/yzma)


@dataclass(frozen=True)
class Anchor:
    """One published training time: ``seconds`` for ``batches`` batches of ``batch`` images on ``board``."""
    board: str
    speed_class: str       # the fleet class whose relative speed the board has
    model: str
    batch: int
    image: tuple[int, int, int]
    batches: int
    seconds: float
    source: str

    @property
    def seconds_per_batch(self) -> float:
        return self.seconds / self.batches


# ResNet-18 (11.7 M parameters), every parameter trained, batch 16 of 3x224x224, 1000 classes, 20 batches
# from the file system, PyTorch on a Raspberry Pi 5 (8 GB): the t_train column of the example run in
# the README of Flower's embedded federated vision benchmark.
ANCHOR = Anchor(board="Raspberry Pi 5", speed_class="pi5-4gb", model="resnet18", batch=16, image=(3, 224, 224),
                batches=20, seconds=116.85,
                source="Flower embedded federated vision benchmark, README example run (Raspberry Pi 5)")


def time_ratios(slow_ms: dict[str, float], fast_ms: dict[str, float]) -> dict[str, float]:
    """Per model present in both: how many times longer the slow board took."""
    return {m: slow_ms[m] / fast_ms[m] for m in slow_ms if m in fast_ms and fast_ms[m] > 0}


def median_ratio(slow_ms: dict[str, float], fast_ms: dict[str, float]) -> float:
    """The median of :func:`time_ratios`: one model an implementation favours does not move it."""
    ratios = list(time_ratios(slow_ms, fast_ms).values())
    if not ratios:
        raise ValueError("no model in common")
    return median(ratios)


def clock_scaled(ratio: float, from_ghz: float, to_ghz: float) -> float:
    """A speed ratio measured at ``from_ghz`` carried to ``to_ghz`` on the same cores (time ~ 1/clock)."""
    return ratio * to_ghz / from_ghz


def derived_speeds() -> dict[str, dict[str, float]]:
    """Each class's relative speed as each source gives it (Zero 2 W = 1.0), before rounding.

    Pi 4: the Pi 3 B+ to Pi 4 ratio (ncnn, per-model median; Hackster's about 2x), carried from the
    3 B+'s 1.4 GHz to the Zero's 1.0 GHz (the same Cortex-A53) and from the Pi 4's 1.5 GHz to 1.8 GHz.
    Pi 5: twice the 1.8 GHz Pi 4 (Flower, PyTorch training); ncnn's Pi 5 / Zero ratio beside it, which
    disagrees (ncnn computes in half precision on the Pi 5's Cortex-A76, FP32 training does not).
    Orin Nano: llama.cpp's Orin Nano Super / Pi 4 ratio, carried from 1.7 to 1.5 GHz, times the Pi 4's.
    """
    a53 = CLOCK_GHZ["pi3bplus"] / CLOCK_GHZ["zero2w"]
    ncnn_pi4 = median_ratio(NCNN_PI3BPLUS_MS, NCNN_PI4_MS) * a53
    hackster_pi4 = PI4_OVER_PI3_HACKSTER * a53
    to_18 = CLOCK_GHZ["pi4"] / CLOCK_GHZ["pi4-early"]
    pi4_18 = SPEEDS["pi4-4gb"]   # the Pi 4 at 1.8 GHz as taken, the base of the Pi 5 and Orin ratios
    orin = clock_scaled(ORIN_SUPER_TOKENS_S / PI4_TOKENS_S, CLOCK_GHZ["orin-nano-super"], CLOCK_GHZ["orin-nano"])
    return {
        "pi4-1.5GHz": {"ncnn": ncnn_pi4, "hackster": hackster_pi4},
        "pi4-1.8GHz": {"ncnn": ncnn_pi4 * to_18, "hackster": hackster_pi4 * to_18},
        "pi5": {"flower": PI5_OVER_PI4_FLOWER * pi4_18, "ncnn": median_ratio(NCNN_ZERO2W_MS, NCNN_PI5_MS)},
        "orin-nano": {"llama.cpp": orin * pi4_18},
    }


def share_for(host_seconds: float, board_seconds: float) -> float:
    """The share of one of this machine's cores that does in ``board_seconds`` what one full core does
    in ``host_seconds``: a CFS quota stretches CPU time by 1/share."""
    if host_seconds <= 0 or board_seconds <= 0:
        raise ValueError("times must be positive")
    return host_seconds / board_seconds


def calibrated_cpu_scale(host_seconds: float, board_seconds: float, board_speed: float) -> float:
    """Cores of this machine per unit of relative speed that make the emulated board as fast as the real one."""
    return share_for(host_seconds, board_seconds) / board_speed


def time_dilation(calibrated_scale: float, used_scale: float) -> float:
    """How many lab seconds one second on the real board takes when the lab runs at ``used_scale``
    instead of ``calibrated_scale`` (1.0: real time; 2.0: the lab is twice as slow as the boards)."""
    return calibrated_scale / used_scale


def projected_seconds(host_seconds: float, speed: float, cpu_scale: float) -> float:
    """Seconds a device of relative ``speed`` takes, at ``cpu_scale``, for what one full core of this
    machine does in ``host_seconds`` (a share above one core is taken as parallel, an upper bound)."""
    return host_seconds / (speed * cpu_scale)
