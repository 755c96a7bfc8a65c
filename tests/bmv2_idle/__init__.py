"""The run idle rule on a real BMv2: a build of thc.p4 whose idle time is seconds, not
protocol.json's minute (needs p4c and BMv2; skipped with the reason when missing)."""
