"""Paper A's retrieval probe: is learned dilation inert when moving alpha is rewarded?

``tasks`` (the two synthetic tasks, distance samplers, scoring) · ``geometry`` (attended
distances, band centres) · ``cell`` (one condition x depth: the library's model and train
step on a task) · ``grid`` (the experiments, resumable) · ``report`` (tables and plots).
Entry point: ``python -m launch.probe``.
"""

__all__: list[str] = []  # tools behind their launch entry point, not a library surface
