"""Several processes, one program: `jax.distributed` wiring for the CLI.

Where the process group comes from, in order:

    --coordinator HOST:PORT --num-processes N --process-id I    explicit (engine.launch)
    SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID   srun
    OMPI_MCA_orte_hnp_uri, OMPI_COMM_WORLD_SIZE                 mpirun / mpiexec (Open MPI)
    TPU_WORKER_HOSTNAMES or TPU_PROCESS_ADDRESSES (2+ hosts)    Cloud TPU pod slices

The cluster cases call `jax.distributed.initialize()` with no arguments (jax reads the
same variables, and `JAX_COORDINATOR_ADDRESS` / `JAX_COORDINATOR_PORT` override its
choice). With none of them, or a cluster of one process, nothing is initialized and the
CLI runs as one process. `process_count` needs no jax: the CLI forces
layout.size / processes host devices per process before jax is imported. On CPU, jax 0.10
runs cross-process collectives over gloo by default.
"""
from __future__ import annotations

import os


def cluster_process_count(environ=os.environ) -> int | None:
    """The number of processes a known cluster environment declares, or None."""
    if all(v in environ for v in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
                                  "SLURM_PROCID", "SLURM_LOCALID")):
        return int(environ["SLURM_NTASKS"])
    if "OMPI_MCA_orte_hnp_uri" in environ and "OMPI_COMM_WORLD_SIZE" in environ:
        return int(environ["OMPI_COMM_WORLD_SIZE"])
    hosts = environ.get("TPU_PROCESS_ADDRESSES") or environ.get("TPU_WORKER_HOSTNAMES")
    if hosts:
        return len(hosts.split(","))
    return None


def process_count(args, environ=os.environ) -> int:
    """Processes this run spans: --num-processes, else the cluster's, else 1."""
    if args.num_processes is not None:
        return args.num_processes
    return cluster_process_count(environ) or 1


def flag_problems(args, layout_size: int, environ=os.environ) -> list[str]:
    """Contradictory or incomplete multi-process flags (no jax needed)."""
    given = [f for f, v in (("--coordinator", args.coordinator),
                            ("--num-processes", args.num_processes),
                            ("--process-id", args.process_id)) if v is not None]
    problems = []
    if given and len(given) < 3:
        missing = [f for f in ("--coordinator", "--num-processes", "--process-id")
                   if f not in given]
        problems.append(f"{', '.join(given)} needs {', '.join(missing)} too")
    if args.coordinator is not None:
        host, _, port = args.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            problems.append(f"--coordinator {args.coordinator!r}: want HOST:PORT")
    if args.num_processes is not None and args.num_processes < 1:
        problems.append(f"num_processes={args.num_processes} must be >= 1")
    elif args.process_id is not None and args.num_processes is not None and not (
            0 <= args.process_id < args.num_processes):
        problems.append(f"process_id={args.process_id} must be in [0, {args.num_processes})")
    n = process_count(args, environ) if not problems else 1
    if n > 1 and layout_size % n:
        problems.append(f"layout of {layout_size} devices does not split over {n} processes")
    return problems


def initialize(args, environ=os.environ) -> None:
    """Join the process group the flags or the cluster describe; no-op for one process."""
    if args.coordinator is not None:
        if args.num_processes > 1:
            import jax
            jax.distributed.initialize(coordinator_address=args.coordinator,
                                       num_processes=args.num_processes,
                                       process_id=args.process_id)
        return
    if (cluster_process_count(environ) or 1) > 1:
        import jax
        jax.distributed.initialize()


def is_main() -> bool:
    import jax
    return jax.process_index() == 0


def agree(ok: bool) -> bool:
    """Process 0's `ok` on every process (with several, a collective every process
    calls), so a check only process 0 can make stops them all."""
    import jax

    if jax.process_count() == 1:
        return ok
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


def host_value(x) -> float:
    """A replicated (out_specs=P()) scalar as a Python float. Reads this process's first
    shard, so it works when the array spans devices of other processes too."""
    import numpy as np
    return float(np.asarray(x.addressable_shards[0].data))


def host_count() -> int:
    """Distinct machines among the processes (processes on one host share its cores)."""
    import socket
    import zlib

    import jax
    import numpy as np
    if jax.process_count() == 1:
        return 1
    from jax.experimental import multihost_utils
    mine = np.asarray([zlib.crc32(socket.gethostname().encode())], np.int32)
    return len(set(np.asarray(multihost_utils.process_allgather(mine)).ravel().tolist()))


def peak_flops(dtype, devices) -> tuple[float, str]:
    """`engine.run.mfu.peak_flops` for the global devices, the same figure on every process:
    process 0 measures (a CPU matmul, with the other processes waiting, so they do not
    compete for its cores) and broadcasts; a CPU peak is per host, so it is multiplied
    by the number of distinct hosts."""
    import jax
    import numpy as np

    from engine.run import mfu
    if jax.process_count() == 1:
        return mfu.peak_flops(dtype, devices)
    from jax.experimental import multihost_utils
    hosts = host_count()
    peak, source = mfu.peak_flops(dtype, devices) if is_main() else (0.0, "")
    peak = float(np.asarray(multihost_utils.broadcast_one_to_all(np.float64(peak))))
    if devices[0].platform == "cpu":
        peak *= hosts
        source = f"measured matmul on one CPU x {hosts} host(s), by process 0"
    return peak, source
