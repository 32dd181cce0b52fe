"""The locally built models and in-process engines of `tests.fixtures`, under the one name the
e2e tests import."""

from tests.fixtures.engines import *  # noqa: F403
from tests.fixtures.models import *  # noqa: F403
from tests.fixtures.state_models import *  # noqa: F403
