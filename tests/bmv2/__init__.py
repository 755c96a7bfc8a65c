"""Tests that need a real BMv2 (simple_switch_grpc); skipped with the reason when missing."""
