"""The SYSTEM files of tests/conftest.py run one after another in their pytest-xdist groups
only if their groups reach the scheduler: conftest's marks must come before
pytest-xdist reads them, and the pytest and pytest-xdist pair must carry the group in the
node id (pytest 9.2 with pytest-xdist 3.8 does not, and every system test then ran beside
another)."""
import pytest


def test_a_system_file_runs_in_its_group(request):
    config = request.config
    if getattr(config, "workerinput", None) is None or not config.getvalue("loadgroup"):
        pytest.skip("not under pytest-xdist's --dist loadgroup (make test runs it so)")
    from tests.conftest import SWITCH_GROUPS
    switches = [(item.nodeid, next(g for p, g in SWITCH_GROUPS if item.nodeid.startswith(p)))
                for item in request.session.items if item.nodeid.startswith("tests/bmv2/")]
    for nodeid, group in [(request.node.nodeid, "system")] + switches:
        assert nodeid.endswith(f"@{group}"), (
            f"{nodeid}: not in pytest-xdist's {group} group (pytest {pytest.__version__}: "
            f"a pytest-xdist that ignores groups puts it in none); the tests that start "
            f"Mininet, BMv2 or namespaces would run beside others: see tests/conftest.py and "
            f"install the versions of constraints.txt")
