"""``python -m tessellm``: the ``tessellm`` command."""

import sys

from tessellm.cli import main

sys.exit(main())
