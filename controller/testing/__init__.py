"""Test machinery of the controller layer: a local BMv2 process on veth pairs."""
