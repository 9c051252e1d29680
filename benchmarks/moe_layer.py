"""The layer benchmark; the code lives in mokgen/harness/bench.py (also `python -m mokgen bench`)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mokgen.harness.bench import main  # noqa: E402

sys.exit(main())
