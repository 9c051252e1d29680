import sys

from mokgen.cli import main

sys.exit(main())
