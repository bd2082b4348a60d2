"""One error family. The CLI renders these as a single line and exits with `exit_code`; library
users catch `MoeconvError`. Anything else escaping is a bug in moeconv, not a user mistake."""


class MoeconvError(Exception):
    """A user-facing problem (bad input, unsupported checkpoint, refused operation)."""

    exit_code = 2


class VerificationFailed(MoeconvError):
    """A converted checkpoint did not pass `verify`."""

    exit_code = 1
