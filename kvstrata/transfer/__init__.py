"""Moving block bytes between tiers: handlers by (src medium, dst medium), run by the transfer worker."""

from kvstrata.transfer.handlers import HANDLERS, Handler
from kvstrata.transfer.worker import Moved, TransferResult, TransferWorker

__all__ = ["HANDLERS", "Handler", "Moved", "TransferResult", "TransferWorker"]
