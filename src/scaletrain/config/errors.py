"""The error every config reader raises for what a user wrote (its own module: the command imports it without
loading pydantic)."""


class ConfigError(ValueError):
    """A job config a user wrote is wrong; the message is one line naming the field."""
