"""`python -m coordinator` is `rlx-cluster`."""

from coordinator.cli.main import main

main()
