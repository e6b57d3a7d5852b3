"""``python -m forge_jax.cli``, as the ``forge-jax`` script."""

import sys

from forge_jax.cli import main

sys.exit(main())
