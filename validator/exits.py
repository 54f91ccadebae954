"""Exit codes of every validator command, defined once (the CLI's --help and the README quote them)."""
OK = 0  # every selected cell passed, or failed only where a declared cause explains it
FAILED = 1  # an undeclared failure or an error cell (run); the reports drifted from the cells (report --check)
USAGE = 2  # bad command-line input; the message names the fix
OUTPUT = 3  # --out cannot be created or written: nothing ran
CELLS = 4  # cells/ holds a file that is not a cell of this schema under its own name (named in the message)
INTERRUPTED = 130  # Ctrl-C; the cells finished so far are kept and the next run resumes

MEANING = {OK: "pass (failures only where declared)", FAILED: "undeclared failure, error cell, or report drift",
           USAGE: "bad arguments", OUTPUT: "--out not writable (nothing ran)",
           CELLS: "a file in cells/ is not a cell", INTERRUPTED: "interrupted (finished cells kept)"}


def epilog() -> str:
    return "exit codes: " + "; ".join(f"{code} {what}" for code, what in MEANING.items())
