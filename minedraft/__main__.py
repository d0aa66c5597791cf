"""`python -m minedraft ...`: the `minedraft` command."""

from minedraft.app.cli import main

raise SystemExit(main())
