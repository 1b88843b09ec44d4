import sys

from hyspec.cli import main

sys.exit(main())
