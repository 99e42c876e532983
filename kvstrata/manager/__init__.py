"""The block manager: the cache's pure half (which block is where, in what state, and what to move)."""
