"""`python -m sdpagraph ...` is the `sdpagraph` command."""
from sdpagraph.cli import main

raise SystemExit(main())
