import sys

from effattn_jax.convert.cli import main

sys.exit(main())
