from fastweights.cli import main

raise SystemExit(main())
