"""Turn-level returns and GAE along each branch (to be completed)."""
