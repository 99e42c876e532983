import sys

from kvstrata.cli import main

sys.exit(main())
