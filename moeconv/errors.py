"""One error family. The CLI renders these as a single line and exits with `exit_code`; library
users catch `MoeconvError`. Anything else escaping is a bug in moeconv, not a user mistake."""

import re

# Control characters (a tensor name or a path from a hostile checkpoint may hold a newline) are
# shown escaped, so a message is always one line.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


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
        super().__init__(_CONTROL.sub(lambda match: repr(match.group())[1:-1], str(message)))


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
