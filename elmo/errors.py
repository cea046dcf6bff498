"""One error type per kind of failure, so every front end (CLI, gRPC, batch job) maps them once."""


class ElmoError(Exception):
    """Base class: the message is meant for the user and names the problem."""


class ConfigError(ElmoError):
    """A model or training configuration is inconsistent (the message names the field)."""


class InputError(ElmoError):
    """Caller input is invalid (empty, too long, wrong type...)."""


class ModelFileError(ElmoError):
    """A model directory or one of its files is missing, corrupt or inconsistent (names the file)."""


class DataError(ElmoError):
    """A corpus or labelled data file is missing, empty or malformed (names the file)."""
