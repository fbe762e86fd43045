"""The `ipdp` command line: the only place that turns ipdp.errors into messages and exit codes."""
