"""`python -m dlrm.planning`: the `dlrm-plan` command."""

from dlrm.planning.cli import console_main

console_main()
