"""Parameter server: tables sharded over server processes, pulled and pushed by workers.

For tables beyond one host's memory. One torchrun job of ``S + W`` processes: the last ``S``
ranks are servers, each holding a hash shard of every table group with its sparse optimizer
state (:mod:`hetero.ps.server`); the first ``W`` ranks are workers that train data-parallel among
themselves (DDP over the workers' group) and pull and push table rows (:mod:`hetero.ps.client`).
Everything travels over torch.distributed (gloo point-to-point for requests, DCP for
checkpoints); see :mod:`hetero.ps.transport`. Dynamic tables keep their key maps on the servers
beside their rows (:mod:`hetero.ps.keys`; sync mode). Every process runs the same script::

    job = PSJob.init(PSConfig(num_servers=2))   # after parallel.init(); tables built later are deferred
    model = build_model()                       # the same seed everywhere; no table rows allocated
    job.shard_tables(model)                     # servers build their shard; workers get clients
    sparse = {"deep": LazyAdam(...), ...}       # on servers: state for the shard's rows
    job.start(model, sparse)                    # memory budget check; servers serve until the workers stop
    if job.role is Role.WORKER:
        ... Trainer(model, ..., ps_job=job).fit()   # wraps the sparse optimizers in PSSparse
    job.shutdown()                              # workers: stop the servers

The reference is MindSpore's parameter server (worker pull/push, server-side optimizer,
synchronous); the modes (:class:`PSMode`) follow PaddlePaddle's and Persia's asynchronous
training and HET's bounded-staleness cache.

Security: the servers answer any process of the job, unauthenticated and unencrypted, as all of
torch.distributed does; the network between the hosts must be trusted. With ``--standalone`` or
a loopback ``MASTER_ADDR`` the store and gloo bind to loopback (:func:`hetero.parallel.init`).
"""

from hetero.ps.client import PSClient, PSSparse, RowCache
from hetero.ps.config import PSConfig, PSMode, Role
from hetero.ps.job import PSJob, Stage, remote_tables
from hetero.ps.server import ParameterServer
from hetero.ps.transport import ServerLostError, ServerTimeoutError

__all__ = [
    "PSClient",
    "PSConfig",
    "PSJob",
    "PSMode",
    "PSSparse",
    "ParameterServer",
    "Role",
    "RowCache",
    "ServerLostError",
    "ServerTimeoutError",
    "Stage",
    "remote_tables",
]
