BUILTINS = ("b200-cx8-gen6", "gen5-cx8-socket-direct", "h200-cx7-gen5", "workstation")  # sorted, as listed
