"""Ways a rank dies on a cluster, injected into one rank of a real run (``--trainer.callbacks+=faults.InjectFault``)."""

import os
import resource
import signal
import time

import lightning as L
import torch

KINDS = ("raise", "out_of_memory", "hang", "kill")


class InjectFault(L.Callback):
    """At the start of training step ``step``, rank ``rank`` fails in the way ``kind`` names:

    - ``raise``: an exception in this rank only;
    - ``out_of_memory``: a real allocation failure (the rank's address space is capped just above what it uses,
      then it asks for 1 GiB more), as a rank that runs out of host memory sees it;
    - ``hang``: the rank stops before its next collective and never arrives (its peers wait in theirs);
    - ``kill``: SIGKILL, as the OOM killer or a failed node ends a process.
    """

    def __init__(self, rank: int, step: int, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not one of {KINDS}")
        self.rank, self.step, self.kind = rank, step, kind

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        print(f"injecting {self.kind} into rank {self.rank} at step {self.step} (t={time.time():.3f})", flush=True)
        if self.kind == "raise":
            raise RuntimeError(f"an injected fault in rank {self.rank}")
        if self.kind == "out_of_memory":
            limits = resource.getrlimit(resource.RLIMIT_AS)
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (used + 2**28, limits[1]))
            try:
                torch.ones(2**30, dtype=torch.uint8)
            finally:
                resource.setrlimit(resource.RLIMIT_AS, limits)
        if self.kind == "hang":
            time.sleep(3600)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
