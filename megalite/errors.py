"""The ground floor's errors: raised anywhere, imported by any floor (DESIGN.md 4c)."""


class ConfigError(ValueError):
    """A setting (or a combination of settings) that cannot work."""
