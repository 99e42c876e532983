"""Moving block bytes between tiers: handlers by (src medium, dst medium) on worker threads."""

from kvstrata.transfer.engine import HANDLERS, Handler, TransferEngine, TransferResult

__all__ = ["HANDLERS", "Handler", "TransferEngine", "TransferResult"]
