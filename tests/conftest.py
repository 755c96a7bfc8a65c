"""Each test starts from the environment's settings: a test that sets THC_* variables sees
them, whatever an earlier test in the process installed. Under pytest-xdist (``make test``)
the tests that start switches, testbeds or namespaces run in groups of their own (SYSTEM)."""
import pytest

from thc.codec import settings


@pytest.fixture
def alone():
    """A Gloo process group of this process alone, for the test's length."""
    import torch.distributed as dist

    from thc.testing.clusters import free_tcp_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _fresh_settings():
    settings.reset()
    yield
    settings.reset()


SYSTEM = ("tests/bmv2/", "tests/bmv2_idle/", "test_testbed.py", "test_faults.py",
          "test_dlcp_training.py", "test_shards.py", "test_priority_links.py",
          "test_namespace.py", "test_xdist_groups.py")
"""Files whose tests start Mininet, BMv2 or network namespaces: with every test marked
``bmv2`` or ``mininet`` and the conformance tests run against BMv2, they run one after
another in pytest-xdist groups (``make test``): the Mininet testbeds and namespaces in one
(``system``), the BMv2 switches in the groups of :data:`SWITCH_GROUPS`, each group's tests
in one process with a switch of its own (p4runtime-shell holds one P4Runtime session a
process). Each names what it creates after a tag of its own (thc.emu.cleanup,
controller.testing.bmv2), so they never touch each other's. A new test that starts one is
marked so, or its file is listed here."""

SWITCH_GROUPS = (("tests/bmv2/test_switch_model_fuzz.py", "bmv2-frames"),
                 ("tests/bmv2/test_switch_checksums.py", "bmv2-frames"),
                 ("tests/bmv2/test_switch_dscp.py", "bmv2-frames"),
                 ("tests/bmv2/", "bmv2"), ("tests/bmv2_idle/", "bmv2"))
"""The BMv2 tests' groups, by the first prefix of their node id that matches (the
conformance suite's BMv2 runs are a group of their own): three switch processes, so that
no one of them holds up the suite."""


def _system_group(item) -> str | None:
    if "tests/conformance/" in item.nodeid:
        callspec = getattr(item, "callspec", None)
        return "bmv2-conformance" if callspec is not None \
            and callspec.params.get("harness") == "bmv2" else None
    if not (item.get_closest_marker("bmv2") or item.get_closest_marker("mininet")
            or any(s in item.nodeid for s in SYSTEM)):
        return None
    return next((group for prefix, group in SWITCH_GROUPS if item.nodeid.startswith(prefix)),
                "system")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if (group := _system_group(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))


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
