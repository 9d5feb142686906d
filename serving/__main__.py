"""`python -m serving` is `sightline`."""

from serving.cli import main

raise SystemExit(main())
