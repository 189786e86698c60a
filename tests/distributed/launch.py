"""Run a function on N local processes joined in a gloo process group (CPU distributed tests).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes; each one joins a
gloo group through a ``FileStore`` in a fresh temporary directory (no ports to collide between
concurrent test runs), runs ``fn(*args)``, and sends back its return value. The caller gets
the list of return values in rank order, a ``RuntimeError`` carrying the traceback of the first
rank that raised, or a ``TimeoutError`` (with every process killed) when the run hangs, as a
deadlocked collective would.

``fn`` must be importable by name from a fresh interpreter (a module-level function of a test
module or package); its arguments and return value must be picklable (tensors are fine).
Inside ``fn``, ``torch.distributed.get_rank()`` says which rank it is. Each process is limited
to one intra-op thread so that W processes share a small machine without oversubscription.

Not covered: NCCL or several machines (use torchrun for those).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException


def _worker(
    rank: int, fn: Callable[..., Any], world_size: int, workdir: str, args: tuple[Any, ...]
) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        result = fn(*args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(workdir, f"result_{rank}.pt"))


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180.0
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return each rank's result in rank order."""
    assert world_size >= 1, world_size
    with tempfile.TemporaryDirectory(prefix="etude_dist_") as workdir:
        context = mp.start_processes(
            _worker,
            args=(fn, world_size, workdir, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{getattr(fn, '__name__', fn)} on {world_size} ranks did not finish in "
                        f"{timeout_s:.0f} s (a collective that not every rank entered?)"
                    )
        except ProcessException as e:
            raise RuntimeError(f"a rank of {getattr(fn, '__name__', fn)} failed:\n{e}") from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        return [
            torch.load(Path(workdir) / f"result_{rank}.pt", weights_only=False)
            for rank in range(world_size)
        ]
