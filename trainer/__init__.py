"""Pipeline + data-parallel training engine (the Varuna API)."""
