"""Tiers: where block bytes live (device, host, disk, remote), behind one narrow interface."""
