"""The tiny models and engine settings of `benchmarks.models`, under the name the tests use."""

from benchmarks.models import *  # noqa: F403
