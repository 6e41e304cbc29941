"""The exceptions that mean "the user must change something": exit 2, one line, no traceback."""

from handlers.checkpoint.files import CheckpointError
from recipes.runner.config.command_line import ConfigError


class DataError(RuntimeError):
    """The data is missing, unreadable or malformed; the message names the file or folder
    and what is expected."""


USER_ERRORS = (ConfigError, DataError, CheckpointError)

