"""The entry points: ``python -m launch.NAME`` (or ``fibjax-NAME``); ``python -m launch`` lists them."""

__all__: list[str] = []  # commands, not a library surface
