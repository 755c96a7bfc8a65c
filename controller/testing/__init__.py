"""Test machinery of the controller layer: a local BMv2 process on veth pairs (bmv2.py) and,
where BMv2 cannot run, an in-memory switch that checks writes against the P4Info
(memswitch.py, entry_checks.py)."""
