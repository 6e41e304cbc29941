"""The exceptions that mean "the user must change something": exit 2, one line, no traceback."""

from handlers.checkpoint import CheckpointError
from recipes.cifar_data import DataError
from recipes.config import ConfigError

USER_ERRORS = (ConfigError, DataError, CheckpointError)
