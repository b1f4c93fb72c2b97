#!/usr/bin/env python3
"""The side-by-side FLUX-shaped benchmark; it lives in the package (layerstream.bench, `layerstream bench`)
so that an installed layerstream can run it. This file keeps the path the GPU script and docs use."""

import sys

from layerstream.bench import main

sys.exit(main())
