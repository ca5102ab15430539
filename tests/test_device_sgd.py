"""The device's SGD and Adam are torch.optim's arithmetic to the bit, without importing torch's compiler."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from edge_client.optim import DeviceSGD


@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.9, 5e-4)])
def test_the_same_steps_as_torch_sgd(momentum, weight_decay):
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 4))
    theirs = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 4))
    theirs.load_state_dict(ours.state_dict())
    frozen = ours[2].bias, theirs[2].bias          # a parameter without a gradient is left alone by both
    frozen[0].requires_grad_(False)
    frozen[1].requires_grad_(False)
    a = DeviceSGD([p for p in ours.parameters() if p.requires_grad], lr=0.05, momentum=momentum,
                  weight_decay=weight_decay)
    b = torch.optim.SGD([p for p in theirs.parameters() if p.requires_grad], lr=0.05, momentum=momentum,
                        weight_decay=weight_decay)
    for step in range(12):
        x, y = torch.randn(8, 20), torch.randint(0, 4, (8,))
        for model, opt in ((ours, a), (theirs, b)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q)


def test_training_on_the_device_never_imports_torch_dynamo():
    code = ("import sys, torch; from edge_client.objectives import warm_up, train, LocalData, TaskContext; "
            "from profiling.profiler import Profiler; from edge_client.registry import build_model; warm_up(); "
            "m = build_model({'name': 'cnn', 'num_classes': 10, 'in_channels': 1, 'image_size': 28}); "
            "d = LocalData(torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))); "
            "train(m, d, {'epochs': 1, 'batch_size': 16, 'lr': 0.02, 'momentum': 0.9}, "
            "TaskContext(seed=0, round=1, client_id='pi', state_dir=None, profiler=Profiler())); "
            "print('torch._dynamo' in sys.modules)")
    assert not _imports_torch_dynamo(code)


def test_the_same_steps_as_torch_adam():
    from edge_client.optim import DeviceAdam

    torch.manual_seed(1)
    ours = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 4))
    theirs = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 4))
    theirs.load_state_dict(ours.state_dict())
    a, b = DeviceAdam(ours.parameters(), lr=1e-3), torch.optim.Adam(theirs.parameters(), lr=1e-3)
    for step in range(12):
        x, y = torch.randn(8, 20), torch.randint(0, 4, (8,))
        for model, opt in ((ours, a), (theirs, b)):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if step % 4 == 3:   # a step where one layer has no gradient: both leave it (and its moments) alone
                loss = nn.functional.cross_entropy(model[2](torch.relu(model[0](x).detach())), y)
            loss.backward()
            opt.step()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q)


def test_dfl_training_on_the_device_never_imports_torch_dynamo():
    code = ("import sys, torch; from edge_client.registry import build_model; from edge_client.objectives import "
            "warm_up, LocalData, TrainHyper; from profiling.profiler import Profiler; "
            "from methods.dfl.device import DflHyper, local_stage, global_stage; warm_up(); "
            "m = build_model({'name': 'dfl', 'backbone': 'cnn', 'num_classes': 10, 'in_channels': 3, 'image_size': 8}); "
            "d = LocalData(torch.randn(32, 3, 8, 8), torch.randint(0, 10, (32,))); g = torch.Generator().manual_seed(0); "
            "local_stage(m, d, TrainHyper(batch_size=16), DflHyper(), g, Profiler()); "
            "global_stage(m, d, TrainHyper(batch_size=16), DflHyper(), g, Profiler()); "
            "print('torch._dynamo' in sys.modules)")
    assert not _imports_torch_dynamo(code)


def _imports_torch_dynamo(code: str) -> bool:
    """Run ``code`` (which ends by printing whether torch._dynamo is loaded) in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() == "True"
