"""Errors a user can fix. Front-ends print their message as one paragraph and exit non-zero, no traceback."""


class UserError(Exception):
    """A mistake in the user's input (preset, data, paths, command line). The message says what to do."""


class ConfigError(UserError):
    """One or more problems found while validating a preset; `problems` lists them all."""

    def __init__(self, problems: list[str], source: str = "the preset"):
        self.problems = list(problems)
        self.source = source
        lines = "\n".join(f"  - {p}" for p in self.problems)
        count = f"{len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}"
        super().__init__(f"{source} has {count}:\n{lines}")
