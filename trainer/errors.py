"""User-facing errors: one clear line, exit code 2, no traceback."""


class UserError(Exception):
    """A problem with the user's input (config, data, paths, checkpoints).

    ``train.py`` and the scripts print ``error: <message>`` and exit with code 2.
    The message must be a single line that names the offending key, file or value.
    """

    exit_code = 2
