"""Generated accelerometer windows of five gestures: deterministic from a seed, separable but noisy.

A window is 2 s at 50 Hz (100 readings) of the x, y and z axes, in g. Each device draws, once, how it
sits in the hand and how its sensor reads: a tilt of gravity away from z (up to 20 degrees), a gain per
axis (0.85 to 1.15), an offset per axis (standard deviation 0.08 g) and a noise level (0.15 to 0.35 g).
Each window of a device then has its gesture's motion, with the gesture's own random phase, timing and
amplitude, added to that device's gravity, scaled by its gains, shifted by its offsets, plus Gaussian
noise of its level:

- ``rest``:   a slow wobble (0.2 to 0.5 Hz, 0.02 to 0.08 g on x and y), and in half the windows a fidget:
  one small bump (0.15 to 0.35 g, 50 to 150 ms wide) on any axis;
- ``shake``:  a 3 to 6 Hz swing along x (0.4 to 1.2 g), a fifth of it on y, random phases;
- ``circle``: a 0.7 to 1.8 Hz circle in the x-y plane (x a cosine, y a sine; 0.3 to 0.8 g), either way round;
- ``tap``:    1 to 3 sharp pulses on z (0.7 to 1.6 g, 20 to 40 ms wide) at random times;
- ``swipe``:  one push along y and its stop (a derivative of a Gaussian, 0.12 to 0.25 s wide, 0.4 to 1.0 g
  peak, centred 0.6 to 1.4 s into the window), left or right.

Weak taps and swipes under a noisy sensor look like a fidgeting hand at rest: that is where the errors are.
The gestures are in equal numbers on every device (as equal as the count allows), in a random order.

Device ``i`` of seed ``s`` draws from ``numpy.random.default_rng([s, i])``; the evaluation set's devices
from ``default_rng([s, 999, k])``, so they are devices no training set has.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["GESTURES", "SAMPLE_RATE_HZ", "STEPS", "AXES", "Device", "device_windows", "eval_set", "training_pool"]

GESTURES = ("rest", "shake", "circle", "tap", "swipe")
SAMPLE_RATE_HZ, STEPS, AXES = 50, 100, 3
EVAL_STREAM = 999          # the evaluation devices' seed stream, apart from the training devices' 1, 2, ...
EVAL_DEVICES, EVAL_PER_DEVICE = 5, 100
POOL_DEVICES, POOL_PER_DEVICE = 6, 150


@dataclass(frozen=True)
class Device:
    """How one device reads the same motion: where gravity falls on its axes, its gains, offsets and noise."""

    gravity: np.ndarray   # [3], g
    gain: np.ndarray      # [3]
    offset: np.ndarray    # [3], g
    noise: float          # standard deviation of the additive noise, g

    @classmethod
    def draw(cls, rng: np.random.Generator) -> Device:
        tilt, turn = rng.uniform(0, np.radians(20)), rng.uniform(0, 2 * np.pi)
        gravity = np.array([np.sin(tilt) * np.cos(turn), np.sin(tilt) * np.sin(turn), np.cos(tilt)])
        return cls(gravity, rng.uniform(0.85, 1.15, AXES), rng.normal(0, 0.08, AXES), float(rng.uniform(0.15, 0.35)))


def _motion(label: int, rng: np.random.Generator, t: np.ndarray) -> np.ndarray:
    """One window's motion [STEPS, 3] in g for gesture ``label``, before the device's reading of it."""
    m = np.zeros((len(t), AXES))
    gesture = GESTURES[label]
    if gesture == "rest":
        hz, phase = rng.uniform(0.2, 0.5), rng.uniform(0, 2 * np.pi, 2)
        m[:, :2] = rng.uniform(0.02, 0.08) * np.sin(2 * np.pi * hz * t[:, None] + phase)
        if rng.random() < 0.5:   # a fidget: one small bump on any axis
            at, width = rng.uniform(0.2, t[-1] - 0.2), rng.uniform(0.05, 0.15)
            m[:, rng.integers(AXES)] += rng.uniform(0.15, 0.35) * np.exp(-0.5 * ((t - at) / width) ** 2)
    elif gesture == "shake":
        hz, phase, size = rng.uniform(3, 6), rng.uniform(0, 2 * np.pi), rng.uniform(0.4, 1.2)
        m[:, 0] = size * np.sin(2 * np.pi * hz * t + phase)
        m[:, 1] = 0.2 * size * np.sin(2 * np.pi * hz * t + phase + rng.uniform(0, 2 * np.pi))
    elif gesture == "circle":
        hz, phase, size = rng.uniform(0.7, 1.8), rng.uniform(0, 2 * np.pi), rng.uniform(0.3, 0.8)
        way = rng.choice([-1.0, 1.0])
        m[:, 0] = size * np.cos(2 * np.pi * hz * t + phase)
        m[:, 1] = way * size * np.sin(2 * np.pi * hz * t + phase)
    elif gesture == "tap":
        for _ in range(rng.integers(1, 4)):
            at, width = rng.uniform(0.1, t[-1] - 0.1), rng.uniform(0.02, 0.04)
            m[:, 2] += rng.uniform(0.7, 1.6) * np.exp(-0.5 * ((t - at) / width) ** 2)
    else:   # swipe
        at, width, size = rng.uniform(0.6, 1.4), rng.uniform(0.12, 0.25), rng.uniform(0.4, 1.0)
        u = (t - at) / width
        m[:, 1] = rng.choice([-1.0, 1.0]) * size * np.exp(0.5) * -u * np.exp(-0.5 * u ** 2)   # peak |size|
    return m


def device_windows(seed: int, index: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` windows of device ``index`` (its own reading of motion), the gestures as even as ``n`` allows, in a
    random order: ``x`` [n, 100, 3] float32 and ``y`` [n] int64."""
    return _windows(np.random.default_rng([seed, index]), n)


def _windows(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    device = Device.draw(rng)
    t = np.arange(STEPS) / SAMPLE_RATE_HZ
    y = rng.permutation(np.arange(n) % len(GESTURES))
    x = np.stack([_motion(int(label), rng, t) for label in y]) if n else np.zeros((0, STEPS, AXES))
    x = (device.gravity + x) * device.gain + device.offset + rng.normal(0, device.noise, x.shape)
    return x.astype(np.float32), y.astype(np.int64)


def eval_set(seed: int = 0, devices: int = EVAL_DEVICES,
             per_device: int = EVAL_PER_DEVICE) -> tuple[np.ndarray, np.ndarray]:
    """The evaluation windows: ``per_device`` from each of ``devices`` devices no training set has."""
    parts = [_windows(np.random.default_rng([seed, EVAL_STREAM, k]), per_device) for k in range(devices)]
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])


def training_pool(seed: int = 0, devices: int = POOL_DEVICES,
                  per_device: int = POOL_PER_DEVICE) -> tuple[np.ndarray, np.ndarray]:
    """Devices 1 to ``devices``'s windows together: what a simulation splits among its spawned devices."""
    parts = [device_windows(seed, i, per_device) for i in range(1, devices + 1)]
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])
