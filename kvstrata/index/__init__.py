"""Block keys and the prefix index: pure, no torch, no I/O."""
