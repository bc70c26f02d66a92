import sys

from kvactors.cli import main

sys.exit(main())
