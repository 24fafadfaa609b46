"""The error every config reader raises for what a user wrote (its own module: the command imports it without
loading pydantic)."""


class ConfigError(ValueError):
    """A job config a user wrote is wrong; the message is one line naming the field."""


class FieldError(ValueError):
    """What a user gave for one field is wrong: "field: detail". A front end that calls the field by another name
    (`plan --hf` for model.hf) shows it under its own name with `named()`, the text staying where it was raised."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"{field}: {detail}")
        self.field, self.detail = field, detail

    def named(self, field: str) -> str:
        return f"{field}: {self.detail}"
