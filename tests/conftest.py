"""Each test starts from the environment's settings: a test that sets THC_* variables sees
them, whatever an earlier test in the process installed."""
import pytest

from thc.codec import settings


@pytest.fixture(autouse=True)
def _fresh_settings():
    settings.reset()
    yield
    settings.reset()
