"""The one error type users see: a single line, exit code 2."""


class TourError(Exception):
    """Bad input or environment (unknown model, pin mismatch, unreadable trace...).

    The CLI prints `error: <message>` on one line and exits 2; nothing else
    should catch it.
    """

    exit_code = 2
