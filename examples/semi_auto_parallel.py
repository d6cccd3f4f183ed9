"""The reference design's semi-auto parallel network: a Mul and an Equal, each with a weight and a
sharding strategy, run on DTensor shards over a device mesh.

    python examples/semi_auto_parallel.py                                     # one process: the reference
    torchrun --standalone --nproc-per-node 2 examples/semi_auto_parallel.py --tp 2 --strategy 1,2
    torchrun --standalone --nproc-per-node 4 examples/semi_auto_parallel.py --tp 2 --strategy 2,2

``--strategy a,b`` cuts both inputs of both operators (the input and the weight, ``(8, 16)``)
into ``a`` slices of rows and ``b`` of columns; ``a x b`` must be the number of ranks. Prints one
JSON line: the CRC-32 of the Mul's output and of the Equal's (gathered), equal at any strategy.
"""

from __future__ import annotations

import argparse
import json
import zlib

import torch
from torch import nn

from hetero import parallel
from hetero.cli import run_main


class SemiAutoNet(nn.Module):
    """``y = x * mul_weight``; ``e = (y == equal_weight)``; both operators sharded by ``strategy``."""

    def __init__(self, mesh=None, strategy=None) -> None:  # noqa: ANN001 - a DeviceMesh
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.mul_weight = nn.Parameter(torch.randn(8, 16, generator=g))
        self.equal_weight = nn.Parameter(torch.full((8, 16), 0.1))
        self.mul, self.equal = torch.mul, torch.eq
        if strategy is not None:
            self.mul = parallel.shard(torch.mul, strategy, mesh=mesh, name="mul")
            self.equal = parallel.shard(torch.eq, strategy, mesh=mesh, name="equal")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.mul(x, self.mul_weight)
        return y, self.equal(y, self.equal_weight)


def inputs() -> torch.Tensor:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    x[0, :4] = 0.1 / SemiAutoNet().mul_weight.detach()[0, :4]  # some products equal the Equal's weight
    return x


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy().tobytes())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tp", type=int, default=1, help="operator-parallel ranks (the mesh's tp dimension)")
    p.add_argument("--strategy", default=None, help="rows,columns slices of both inputs of both operators")
    args = p.parse_args(argv)
    parallel.init()
    net = SemiAutoNet()
    if args.strategy is not None:
        rows, cols = (int(v) for v in args.strategy.split(","))
        mesh = parallel.build_mesh(parallel.MeshConfig(tp=args.tp))
        net = SemiAutoNet(mesh, ((rows, cols), (rows, cols)))
    y, e = net(inputs())
    y, e = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (y, e))  # gathered on every rank
    result = {"mul_crc": crc(y), "equal_crc": crc(e), "equal_true": int(e.sum()), "world_size": parallel.world_size()}
    if parallel.rank() == 0:
        print(json.dumps(result))
    parallel.shutdown()
    return result


if __name__ == "__main__":
    run_main(main, __file__)  # one line for hetero's and this script's own errors, the traceback otherwise
