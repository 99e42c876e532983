"""The planner: restore time along every path of the seed, and its seven architectures compared."""
