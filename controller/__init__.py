"""P4Runtime controller of the THC aggregation switch (one module per P4 control)."""
