"""The operator's verbs, one module each (status: a package of one module per idea): each has
`main(settings, **its own arguments)`, and `add_arguments(parser)` or `ACTIONS` when it takes
arguments of its own. `gateway/cli.py` names them in its table and imports one only when it runs."""
