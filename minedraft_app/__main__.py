"""`python -m minedraft_app ...`: the `minedraft` command."""

from minedraft_app.cli import main

raise SystemExit(main())
