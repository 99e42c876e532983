"""Load times of a cached prefix predicted from this host's calibration, for the decision.

:func:`kvstrata.plan.recompute.choose` weighs ``L(blocks)``, the seconds to load the *last*
``blocks`` blocks of a hit, and ``X(blocks)``, the part of that load that delays computing when
both share the processors. Here both come from a :class:`~kvstrata.plan.host.HostCalibration`
and the hit's media (one :class:`~kvstrata.media.Medium` per block, in prompt order, as a
lookup reports them).

Pure arithmetic: no torch, no I/O. Where the model runs is a plain flag (``on_cpu``).
"""

from __future__ import annotations

from collections import Counter

from kvstrata.media import Medium
from kvstrata.plan.calpaths import CalPath
from kvstrata.plan.host import HostCalibration
from kvstrata.plan.recompute import LoadTime


def calibrated_load_time(
    calibration: HostCalibration, media: tuple[Medium, ...], block_bytes: int, workers: int
) -> LoadTime:
    """``L(blocks)``: predicted seconds to load the last ``blocks`` blocks on ``media``.

    Per source tier :meth:`HostCalibration.restore_s`, the tiers' times added (a conservative
    sum: the cache fetches them in one plan). Blocks already on the device cost nothing. Disk
    reads use the cold-read path when it was calibrated (a prediction for storage, not for the
    page cache), else the page-cache path.

    Args:
        calibration: this host's measured paths.
        media: the hit's blocks' media, one per block, in order.
        block_bytes: bytes of one block.
        workers: the cache's transfer threads (``CacheConfig.workers``).

    Returns:
        ``L``; it raises KeyError for a tier whose path was not calibrated.
    """
    cold = CalPath.DISK_READ_COLD in calibration.paths

    def load_s(blocks: int) -> float:
        return sum(
            calibration.restore_s(medium, n * block_bytes, n, workers, cold=cold)
            for medium, n in _to_restore(media, blocks).items()
        )

    return load_s


def calibrated_contention(
    calibration: HostCalibration, media: tuple[Medium, ...], block_bytes: int, load: LoadTime, on_cpu: bool
) -> LoadTime | None:
    """``X(blocks)`` of :func:`kvstrata.plan.recompute.choose`.

    Args:
        calibration: this host's measured paths.
        media: the hit's blocks' media, one per block, in order.
        block_bytes: bytes of one block.
        load: ``L`` (:func:`calibrated_load_time`), the fallback where a path is missing.
        on_cpu: the model runs on the CPU (shares its cores with the load).

    Returns:
        None when the model runs on a GPU (it computes while the CPU and DMA engines load); on
        the CPU, the load's processor time, taken whole (conservative): per source tier its
        one-thread cost from the calibration (disk: the page-cache read path, i.e. copying and
        checksumming, not the storage's wait), or the whole predicted load where a path is
        missing.
    """
    if not on_cpu:
        return None

    def cpu_s(blocks: int) -> float:
        try:
            return sum(
                calibration.restore_s(medium, n * block_bytes, n, workers=1, cold=False)
                for medium, n in _to_restore(media, blocks).items()
            )
        except KeyError:  # a path not calibrated: the whole load counts
            return load(blocks)

    return cpu_s


def promotion_s(calibration: HostCalibration, media: tuple[Medium, ...], block_bytes: int, workers: int) -> float:
    """Predicted seconds to promote the disk and pool blocks among ``media`` to the host tier
    (a prefetch for a queued request), per source tier by :meth:`HostCalibration.restore_s`."""
    counts = Counter(media)
    return sum(
        calibration.restore_s(medium, counts[medium] * block_bytes, counts[medium], workers)
        for medium in (Medium.DISK, Medium.REMOTE)
        if counts[medium]
    )


def _to_restore(media: tuple[Medium, ...], blocks: int) -> Counter[Medium]:
    """Blocks per source tier among the last ``blocks`` of ``media``; those on the device move nothing."""
    counts = Counter(media[len(media) - blocks:] if blocks else ())
    counts.pop(Medium.DEVICE, None)
    return counts
