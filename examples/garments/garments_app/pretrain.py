"""Pretrain the network centrally on the source task (Fashion-MNIST classes 0-4) and save it for fine-tuning.

    python -m garments_app.pretrain [--out PATH] [--samples 10000] [--epochs 2]

What is saved is the whole state dict but the last layer (``classifier.3``, whose five source classes mean
nothing for the target task): the feature extractor, its normalization statistics and the classifier's hidden
layer. The fine-tuning app loads it on every party and starts its output layer from the coordinator's weights.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from garments_app.data import DEFAULT_DIR, SOURCE_CLASSES, garments, to_inputs
from garments_app.network import mobilenet_v3_small

__all__ = ["pretrain", "main", "DROPPED"]

DEFAULT_OUT = Path(__file__).resolve().parent / "pretrained.safetensors"
DROPPED = ("classifier.3.",)   # the source task's output layer


def pretrain(out: Path, *, samples: int = 10000, epochs: int = 2, batch_size: int = 64, lr: float = 0.05,
             seed: int = 0, directory: Path = DEFAULT_DIR, say=print) -> dict[str, float]:
    """Train on ``samples`` source pictures for ``epochs`` and write the weights to ``out``; the figures."""
    torch.manual_seed(seed)
    pictures, labels = garments("train", SOURCE_CLASSES, directory, limit=samples, seed=seed)
    x, y = to_inputs(pictures), torch.from_numpy(labels)
    net = mobilenet_v3_small(num_classes=len(SOURCE_CLASSES))
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=1e-5)
    steps = epochs * ((len(x) + batch_size - 1) // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps)
    started = time.monotonic()
    net.train()
    for epoch in range(epochs):
        order, correct, total = torch.randperm(len(x)), 0, 0.0
        for start in range(0, len(x), batch_size):
            index = order[start:start + batch_size]
            scores = net(x[index])
            loss = nn.functional.cross_entropy(scores, y[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            correct += int((scores.argmax(1) == y[index]).sum())
            total += float(loss.detach()) * len(index)
        say(f"epoch {epoch + 1}/{epochs}: loss {total / len(x):.3f}, training accuracy {correct / len(x):.3f}")
    state = {k: v.detach().clone().contiguous() for k, v in net.state_dict().items()
             if not k.startswith(DROPPED) and v.is_floating_point()}   # BN's step counters are not needed
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out))
    seconds = time.monotonic() - started
    say(f"wrote {len(state)} tensors to {out} ({seconds:.0f} s)")
    return {"seconds": seconds, "samples": float(len(x)), "tensors": float(len(state))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="safetensors file (default: the package's)")
    parser.add_argument("--samples", type=int, default=10000, help="source pictures to train on (0: all 30,000)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=DEFAULT_DIR, help="directory of the four IDX files")
    args = parser.parse_args(argv)
    pretrain(args.out, samples=args.samples, epochs=args.epochs, lr=args.lr, seed=args.seed, directory=args.data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
