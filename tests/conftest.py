"""Each test starts from the environment's settings: a test that sets THC_* variables sees
them, whatever an earlier test in the process installed. Under pytest-xdist (``make test``)
the tests that use system-wide resources share one process."""
import pytest

from thc.codec import settings


@pytest.fixture(autouse=True)
def _fresh_settings():
    settings.reset()
    yield
    settings.reset()


SYSTEM = ("tests/bmv2/", "test_testbed.py", "test_faults.py",
          "test_dlcp_training.py", "test_shards.py", "test_priority_links.py",
          "test_namespace.py", "test_xdist_groups.py")
"""Files whose tests start Mininet, BMv2 or network namespaces (system-wide names and
cleanups): one pytest-xdist process runs them all, one after another (``make test``), with
every test marked ``bmv2`` or ``mininet``, and the conformance tests run against BMv2. A new
test that starts one is marked so, or its file is listed here."""


def _starts_system(item) -> bool:
    if item.get_closest_marker("bmv2") or item.get_closest_marker("mininet"):
        return True
    if "tests/conformance/" in item.nodeid:
        callspec = getattr(item, "callspec", None)
        return callspec is not None and callspec.params.get("harness") == "bmv2"
    return any(s in item.nodeid for s in SYSTEM)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _starts_system(item):
            item.add_marker(pytest.mark.xdist_group("system"))


def pytest_addoption(parser):
    parser.addoption("--recompile", action="store_true",
                     help="run the checks tests/verified.py remembers even where the same "
                          "inputs passed them before (the Tofino compile)")


_REMEMBERED: list[str] = []


def pytest_runtest_logreport(report):
    from tests.verified import PROPERTY
    if report.when == "call":
        _REMEMBERED.extend(v for k, v in report.user_properties if k == PROPERTY)


def pytest_terminal_summary(terminalreporter):
    if _REMEMBERED:
        terminalreporter.section("passed on a check remembered for the same inputs "
                                 "(tests/verified.py; --recompile runs it)")
        for line in _REMEMBERED:
            terminalreporter.write_line(line)
