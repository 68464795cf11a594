"""One module per operator verb that is more than a few lines (status, parked, selftest, demo);
`gateway/cli.py` parses the command line and dispatches to them."""
