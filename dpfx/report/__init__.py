"""What dpfx tells its users about a model and a run: every rewrite and graph (``explain``),
every reason it cannot be trained privately (``validate``), and epsilon, the clipped fraction
and the adaptive bound over a run's steps (``RunHistory``)."""
from dpfx.report.history import RunHistory

__all__ = ["RunHistory"]
