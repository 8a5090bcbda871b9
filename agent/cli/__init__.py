"""The ``certchat`` command line: argument parsing, subcommands and their one-line errors."""
