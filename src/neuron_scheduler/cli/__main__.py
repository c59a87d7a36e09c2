"""``python -m neuron_scheduler.cli``: the ``neuron-scheduler`` command."""

import sys

from neuron_scheduler.cli import main

if __name__ == "__main__":
    sys.exit(main())
