"""The errors a testbed raises, below every module that builds one."""


class TestbedError(RuntimeError):
    """The testbed cannot be built or used as asked; the message says why."""

    __test__ = False  # not a pytest test class


class Unavailable(TestbedError):
    """Mininet cannot run here (not root, not installed, ...): fall back to loopback."""
