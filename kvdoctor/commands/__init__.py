"""One module per ``kvdoctor`` subcommand. Each defines ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``, and imports nothing heavy at module level."""
