"""The SYSTEM files of tests/conftest.py share one pytest-xdist process only if their group
reaches the scheduler: conftest's marks must come before pytest-xdist reads them, and the
pytest and pytest-xdist pair must carry the group in the node id (pytest 9.2 with
pytest-xdist 3.8 does not, and every system test then ran beside another)."""
import pytest


def test_a_system_file_runs_in_the_system_group(request):
    config = request.config
    if getattr(config, "workerinput", None) is None or not config.getvalue("loadgroup"):
        pytest.skip("not under pytest-xdist's --dist loadgroup (make test runs it so)")
    assert request.node.nodeid.endswith("@system"), (
        f"{request.node.nodeid}: pytest-xdist ignored the group (pytest "
        f"{pytest.__version__}); the tests that start Mininet, BMv2 or namespaces would run "
        f"in parallel: install the versions of constraints.txt")
