"""Join the process group from torchrun's environment, all-reduce once, hold it for a few seconds."""

import time

import torch

from hetero import parallel

assert parallel.init()
t = torch.ones(1)
torch.distributed.all_reduce(t)
assert t.item() == parallel.world_size()
time.sleep(4)
parallel.shutdown()
