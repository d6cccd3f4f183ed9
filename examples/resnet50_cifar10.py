"""The seed's data-parallel example: ResNet-50 on CIFAR-10 under torchrun.

As in the reference design's distributed-training tutorial: every rank reads its shard of the
data (sample ``i`` of each global batch on rank ``i mod N``), augments it (random crop with 4
pixels of padding, horizontal flip, normalisation), and trains ResNet-50 with momentum SGD
(lr 0.01, momentum 0.9) on softmax cross-entropy; DDP averages the gradients over the ranks
(``gradients_mean``). ``--batch-size`` is per rank, as in the seed. The seed resizes images to
224 x 224; the default here keeps 32 x 32 (``--image-size 224`` for the seed's setting), which
the CPU can train.

    python examples/resnet50_cifar10.py --data-dir ~/data/cifar-10-batches-bin --epochs 1
    torchrun --standalone --nproc-per-node 2 examples/resnet50_cifar10.py --data-dir ...

The data is the binary version of CIFAR-10 (``hetero.data.load_cifar10``); hetero does not
download it. ResNet-50 is written out below (He et al., "Deep Residual Learning for Image
Recognition", CVPR 2016; bottleneck blocks 3-4-6-3, the stride on the 3x3 convolution as in
torchvision) because torchvision's PyPI wheel pins a CUDA build of torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hetero.cli import run_main
from hetero import parallel
from hetero.data import load_cifar10
from hetero.placement import Target, copy_to, resolve_device

MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)  # CIFAR-10 per-channel statistics
STD = torch.tensor([0.2023, 0.1994, 0.2010]).view(1, 3, 1, 1)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv3, self.bn3 = nn.Conv2d(planes, out, 1, bias=False), nn.BatchNorm2d(out)
        self.shortcut = (nn.Sequential(nn.Conv2d(inplanes, out, 1, stride, bias=False), nn.BatchNorm2d(out))
                         if stride != 1 or inplanes != out else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + self.shortcut(x))


class ResNet50(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers, inplanes = [], 64
        for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(blocks):
                layers.append(Bottleneck(inplanes, planes, stride if i == 0 else 1))
                inplanes = planes * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def weights_crc(model: nn.Module) -> int:
    """CRC-32 of every parameter, in order (host copies). Buffers are left out: batch norm's
    running statistics follow each rank's own batches between DDP's broadcasts."""
    crc = 0
    for t in model.parameters():
        crc = zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc


def augment(images: torch.Tensor, generator: torch.Generator, size: int) -> torch.Tensor:
    """uint8 ``(B, 3, 32, 32)`` -> normalised float ``(B, 3, size, size)``: random crop (padding 4),
    random horizontal flip, rescale to [0, 1], normalise."""
    b = images.shape[0]
    padded = F.pad(images.float() / 255.0, (4, 4, 4, 4))
    dx, dy = torch.randint(0, 9, (2, b), generator=generator)
    crops = torch.stack([padded[i, :, dy[i] : dy[i] + 32, dx[i] : dx[i] + 32] for i in range(b)])
    flip = torch.rand(b, generator=generator) < 0.5
    crops[flip] = crops[flip].flip(-1)
    if size != 32:
        crops = F.interpolate(crops, size=(size, size), mode="bilinear", align_corners=False)
    return (crops - MEAN) / STD


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-dir", type=Path, required=True, help="cifar-10-batches-bin (binary version)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank, as in the seed")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--image-size", type=int, default=32, help="224: the seed's resize")
    p.add_argument("--max-steps", type=int, help="stop after this many steps")
    p.add_argument("--eval-samples", type=int, help="evaluate on the first N test images (default: all)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    parallel.init()
    rank, world = parallel.rank(), parallel.world_size()
    device = resolve_device(Target.DEVICE)
    train_x, train_y = load_cifar10(args.data_dir, "train")
    test_x, test_y = load_cifar10(args.data_dir, "test")
    global_batch = args.batch_size * world
    if len(train_x) < global_batch:
        raise ValueError(f"{len(train_x)} training images cannot fill one global batch of {args.batch_size} x {world} ranks; "
                         f"lower --batch-size")
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = ResNet50().to(device)
    net = parallel.data_parallel(model)
    initial_crc = weights_crc(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    aug = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own augmentation stream
    steps, loss_value = 0, float("nan")
    for epoch in range(args.epochs):
        order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(args.seed + epoch))
        for step, start in enumerate(range(0, len(order) - global_batch + 1, global_batch)):  # drop_remainder
            if args.max_steps is not None and steps >= args.max_steps:
                break
            idx = order[start : start + global_batch][rank::world]  # this rank's interleaved share
            x = copy_to(augment(train_x[idx], aug, args.image_size), device)  # host -> device
            loss = F.cross_entropy(net(x), copy_to(train_y[idx], device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps += 1
            if step % args.log_every == 0:
                loss_value = parallel.global_mean(loss)  # the global batch's loss; sync point: the host prints it
                if rank == 0:
                    print(f"epoch: {epoch}, step: {step}, loss is {loss_value:.6g}", flush=True)
    model.eval()
    n_eval = len(test_x) if args.eval_samples is None else min(args.eval_samples, len(test_x))
    correct = 0
    with torch.no_grad():
        for i in range(0, n_eval, 256):
            x = (test_x[i : min(i + 256, n_eval)].float() / 255.0 - MEAN) / STD
            if args.image_size != 32:
                x = F.interpolate(x, size=(args.image_size,) * 2, mode="bilinear", align_corners=False)
            correct += int((model(copy_to(x, device)).argmax(1).cpu() == test_y[i : min(i + 256, n_eval)]).sum())
    # Every rank's weights after training: DDP keeps the replicas identical (a check that can fail).
    crcs = [weights_crc(model)]
    if world > 1:
        crcs = [None] * world
        torch.distributed.all_gather_object(crcs, weights_crc(model))
    result = {"steps": steps, "last_loss": loss_value, "test_accuracy": correct / max(n_eval, 1), "world_size": world,
              "initial_weights_crc": initial_crc, "weights_crc_per_rank": crcs}
    if rank == 0:
        print(json.dumps(result))
    parallel.shutdown()
    return result


if __name__ == "__main__":
    run_main(main, __file__)  # one line for hetero's and this script's own errors, the traceback otherwise
