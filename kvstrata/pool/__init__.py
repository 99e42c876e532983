"""The shared remote DRAM pool: Mooncake Store's master and pool daemons, started or found."""
