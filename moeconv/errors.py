"""One error family. The CLI renders these as a single line and exits with `exit_code`; library
users catch `MoeconvError`. Anything else escaping is a bug in moeconv, not a user mistake."""

import re

# What moves the cursor, starts an escape sequence or reorders the text after it: C0 and C1 controls,
# DEL, Unicode's bidirectional controls and its line and paragraph separators.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with each control character shown escaped (\\x1b, \\n, \\u202e): a name from a checkpoint, an
    output or a path is shown on one line, cannot colour, hide, move or retitle the terminal, and the user
    sees what it holds. Error messages and everything the CLI renders go through it."""
    return _CONTROL.sub(lambda match: repr(match.group())[1:-1], text)


def human_bytes(nbytes: float) -> str:
    """A size for people, in decimal units (1.50 MB, 820 B): a message about a small output must not
    read "0.00 GB"."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    raise AssertionError


class MoeconvError(Exception):
    """A user-facing problem (bad input, unsupported checkpoint, refused operation)."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(printable(str(message)))


class PlantedLink(MoeconvError):
    """A symbolic link where convert keeps its lock or its unfinished output: following it would write
    or delete files outside the output."""

    def __init__(self, path: object) -> None:
        super().__init__(f"{path}: is a symbolic link; moeconv does not follow links next to its output: remove it")


class Unfinished(MoeconvError):
    """The work stopped for a reason outside the input (a Ray cluster that failed): unlike a refusal,
    what is finished stays for a resume."""


class VerificationFailed(MoeconvError):
    """A converted checkpoint did not pass `verify`."""

    exit_code = 1


class Interrupted(BaseException):
    """Ctrl-C (SIGINT) or SIGTERM during a command: exit code 3, one line. A BaseException, like
    KeyboardInterrupt, so no `except Exception` on the way swallows it; unlike KeyboardInterrupt,
    Click does not turn it into "Aborted!" and exit code 1."""

    exit_code = 3
