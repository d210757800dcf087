"""One module per ``eagle-tree`` command, each with ``main(argv) -> int``."""
