"""Policies: eviction, writing down the tiers, prefetch (pure: no torch, no I/O)."""
