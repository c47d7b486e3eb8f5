import sys

from govray.cli import main

sys.exit(main())
