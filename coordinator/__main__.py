"""`python -m coordinator` is `rlx-cluster`."""

from coordinator.cli import main

main()
