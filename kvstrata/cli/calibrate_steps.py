"""``kvstrata calibrate --engine vllm``'s measurement: vLLM's steps, the connector's cost and two
servers at once, through ``bench serve``'s servers and client (:mod:`kvstrata.calibrate.serving.steps`)."""

from __future__ import annotations

from pathlib import Path

from kvstrata import cli
from kvstrata.pool.config import PoolConfig

MISFIT_WARN = 0.25  # quiet-host calibrations here: 4-9% (one 22%); one beside other work: 80%


def with_vllm_steps(calibration, model_dirs: list[str], dtype: str, pool: PoolConfig | None):
    """The calibration plus each model's prefill and decode step fits and the connector's cost as
    ``vllm serve`` serves it (keyed as ``calibrate``'s transformers prefill keys them), on the CPUs ``bench serve``
    binds its servers to."""
    import dataclasses
    import os
    import tempfile

    from kvstrata.calibrate.serving.host import model_facts
    from kvstrata.calibrate.serving.servers import CPU_HALF, Instance, cpu_halves
    from kvstrata.calibrate.serving.workload import ServeWorkload
    from kvstrata.calibrate.serving.steps import measure_vllm_steps
    from kvstrata.media import Medium
    from kvstrata.plan.calpaths import CalPath

    halves = cpu_halves(sorted(os.sched_getaffinity(0)))  # bench serve's servers run on half the CPUs each
    cpus = None if halves is None else (halves[CPU_HALF[Instance.OURS]], halves[CPU_HALF[Instance.SECOND]])
    block_tokens = ServeWorkload().block_tokens  # bench serve's default block size
    pool_file = None
    if pool is not None and CalPath.POOL_PUT in calibration.paths:  # the connector's server stores in the pool too
        pool_file = pool.config_file
    prefill, decode, connector = dict(calibration.prefill), dict(calibration.decode), dict(calibration.connector)
    stalls = dict(calibration.stalls)
    for model_dir in model_dirs:
        block_bytes = model_facts(Path(model_dir), dtype).bytes_per_token * block_tokens
        written = [CalPath.MEMCPY_ONE, CalPath.DISK_WRITE]  # the server's tiers
        written += [CalPath.POOL_PUT] if pool_file is not None else []
        restore = lambda blocks: calibration.restore_s(Medium.HOST, blocks * block_bytes, blocks)  # noqa: E731
        store = lambda blocks: max(calibration.path(p).seconds(blocks * block_bytes) for p in written)  # noqa: E731
        remote = (lambda blocks: calibration.restore_s(Medium.REMOTE, blocks * block_bytes, blocks)) if pool_file else None  # noqa: E731
        with tempfile.TemporaryDirectory(prefix="kvstrata-steps-") as logs:
            steps = measure_vllm_steps(model_dir, Path(logs), restore, store, dtype=dtype, block_size=block_tokens,
                                       cpus=cpus, pool_file=pool_file, remote_restore_s=remote)
        name = Path(model_dir).resolve().name
        misfit = steps.misfit
        cli.console().print(f"{name} through vllm serve: prefill points {misfit['prefill']:.0%} and decode points "
                            f"{misfit['decode']:.0%} from their fits (median)", highlight=False)
        for what, error in misfit.items():
            if error > MISFIT_WARN:
                cli.console().print(f"[yellow]warning:[/] {name}'s {what} points lie {error:.0%} (median) from their fit: "
                                    f"the host was busy while they were measured, and replays on this profile will be "
                                    f"off; calibrate again on a quiet host", highlight=False)
        if pool_file is not None and not steps.pool_points:
            cli.console().print(f"[yellow]warning:[/] {name}: no load from the pool was seen on the connector's server "
                                f"after the other server stored the blocks; loads from the pool are timed by its "
                                f"path alone", highlight=False)
        prefill[name], decode[name], connector[name] = steps.prefill, steps.decode, steps.connector
        stalls[name] = steps.stalls
    return dataclasses.replace(calibration, prefill=prefill, decode=decode, connector=connector, stalls=stalls)
