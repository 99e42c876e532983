"""What the hardware model expects of a restore from each tier, and of a prefill.

Two sources, the seed's rule: capacity and the bottleneck link from specs (the profile's
topology: :class:`~kvstrata.plan.restore.RestorePlanner`'s path for the tier), latency and rate
from measurement (a ``kvstrata calibrate`` profile's fits: :meth:`HostCalibration.restore_s`,
the tier's fixed cost plus bytes over each path's rate). The doctor holds what a server achieved
against these.

Pure: the profile and the calibration are loaded by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvstrata.hardware.specs import HardwareProfile
from kvstrata.media import Medium
from kvstrata.plan.calpaths import CalPath
from kvstrata.plan.host import RESTORE_FIXED, HostCalibration, PrefillFit
from kvstrata.plan.restore import RestoreEstimate, RestorePath, RestorePlanner, instance_gpus

# The seed's path a restore from each tier takes into one GPU: a pool restore is a batched get
# into host memory, then a copy to the device (HostCalibration.restore_paths), so two hops.
SPEC_PATH = {
    Medium.HOST: RestorePath.LOCAL_DRAM,
    Medium.DISK: RestorePath.NVME,
    Medium.REMOTE: RestorePath.REMOTE_TWO_HOP,
}


class PrefillSource(Enum):
    """Which prefill rate load-or-recompute is judged with.

    The server's own (its prefill seconds less kvstrata's loads, over the tokens it computed) is
    the engine being diagnosed, batching and kernels included; a calibrated profile's fit is the
    model run by transformers on this host, which can be far from the engine (measured here on
    the tiny model: a 321 ms fixed cost where vLLM's whole time to first token was 40 ms).
    """

    AUTO = "auto"  # the server's where its counters give one, else the profile's
    SERVER = "server"
    PROFILE = "profile"


@dataclass(frozen=True)
class Prediction:
    """A restore's predicted time and where the prediction comes from.

    Attributes:
        seconds: predicted seconds.
        basis: "calibrated" (the profile's fits on this host) or "spec" (the topology's
            line rates and efficiencies, no fixed cost).
        fixed_s: the part of ``seconds`` that does not depend on the bytes (the tier's
            calibrated fixed cost per restore, times restores); 0 on the spec basis.
    """

    seconds: float
    basis: str
    fixed_s: float = 0.0


@dataclass(frozen=True)
class Expectations:
    """The hardware a server runs on, as the doctor needs it.

    Attributes:
        profile: the hardware profile (its topology gives each tier's spec path); None: none.
        calibration: this host's measured fits; None: an uncalibrated profile.
        workers: the cache's transfer threads (``CacheConfig.workers``).
        prefill: the model's calibrated prefill fit; None: not calibrated for this model.
        prefill_source: which prefill rate to judge loads against (see :class:`PrefillSource`).
    """

    profile: HardwareProfile | None = None
    calibration: HostCalibration | None = None
    workers: int = 2
    prefill: PrefillFit | None = None
    prefill_source: PrefillSource = PrefillSource.AUTO

    def spec(self, medium: Medium, nbytes: int) -> RestoreEstimate | None:
        """The spec path's estimate for restoring ``nbytes`` from ``medium`` into one GPU, or
        None (no profile, the device tier, or no GPU in the profile)."""
        path = SPEC_PATH.get(medium)
        if self.profile is None or path is None or not self.profile.gpus:
            return None
        planner = RestorePlanner(self.profile, instance_gpus(self.profile, 1))
        return planner.restore(path, [max(1, int(nbytes))])

    def restore(self, medium: Medium, nbytes: float, blocks: float, restores: float) -> Prediction | None:
        """Predicted seconds for ``restores`` restores from ``medium`` moving ``nbytes`` in
        ``blocks`` blocks in all (each restore the mean size): calibrated where the profile
        has the tier's paths, else the spec path's; None where neither predicts.

        A disk restore is predicted cold (from the drive, not the page cache) where the
        calibration measured cold reads: the slower of the two, so an achieved rate below it
        is below what the drive itself does.
        """
        if medium is Medium.DEVICE or nbytes <= 0 or restores <= 0:
            return None
        if self.calibration is not None:
            cold = medium is Medium.DISK and CalPath.DISK_BLOCKS_COLD in self.calibration.paths
            per_restore_bytes = int(nbytes / restores)
            try:
                one = self.calibration.restore_s(medium, per_restore_bytes, max(1, round(blocks / restores)),
                                                 self.workers, cold=cold)
            except KeyError:  # a path this host did not calibrate: fall back to the spec
                one = None
            if one is not None:
                fixed = self.calibration.paths.get(RESTORE_FIXED[medium])
                fixed_s = min(one, fixed.latency_s) if fixed is not None else 0.0
                return Prediction(one * restores, "calibrated", fixed_s * restores)
        estimate = self.spec(medium, int(nbytes / restores))
        if estimate is None or not estimate.available or estimate.seconds <= 0:
            return None
        return Prediction(estimate.seconds * restores, "spec")
