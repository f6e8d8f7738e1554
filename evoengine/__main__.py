"""``python -m evoengine`` is the ``evoengine`` command."""

from evoengine.cli import main

raise SystemExit(main())
