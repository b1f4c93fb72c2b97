"""`python -m layerstream.bench`: the same entry point as `layerstream bench`."""

import sys

from .cli import main

sys.exit(main())
